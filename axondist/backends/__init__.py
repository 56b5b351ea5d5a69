"""Communication backends behind one contract (:class:`Backend`).

``mock`` (threads in one process) is always available; ``mpi`` needs mpi4py
and ``nccl`` needs CuPy. Backends import their library only when created.
"""

from .base import Backend, CompletedWork, FutureWork, Work
from .mock import MockBackend, MockWorld

__all__ = ["Backend", "CompletedWork", "FutureWork", "MockBackend", "MockWorld", "Work"]
