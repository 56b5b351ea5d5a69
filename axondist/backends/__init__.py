"""Communication backends behind one contract (:class:`Backend`).

``mock`` (threads in one process) is always available; ``mpi`` needs mpi4py
and ``nccl`` needs CuPy. Backends import their library only when created.
"""

from .base import Backend, CompletedWork, FutureWork, Work
from .mock import MockBackend, MockWorld
from .registry import backend_names, create_backend, register_backend

__all__ = ["Backend", "CompletedWork", "FutureWork", "MockBackend", "MockWorld", "NcclBackend",
           "Work", "backend_names", "create_backend", "register_backend"]


def __getattr__(name: str) -> object:
    if name == "NcclBackend":  # pure Python, but keep `import axondist` light
        from .nccl import NcclBackend

        return NcclBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
