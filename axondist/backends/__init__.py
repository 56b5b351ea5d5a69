"""Communication backends behind one contract (:class:`Backend`).

``mock`` (threads in one process) is always available; ``mpi`` needs mpi4py
and ``nccl`` needs CuPy. Backends import their library only when created, and
this package loads none of them itself: an MPI job never loads the mock world.
"""

from .base import Backend, CompletedWork, FutureWork, Work
from .registry import backend_names, create_backend, register_backend

__all__ = ["Backend", "CompletedWork", "FutureWork", "MockBackend", "MockWorld", "NcclBackend",
           "Work", "backend_names", "create_backend", "register_backend"]

#: Names loaded from their backend's package on first use (PEP 562).
_LAZY = {"MockBackend": "mock", "MockWorld": "mock", "NcclBackend": "nccl"}


def __getattr__(name: str) -> object:
    package = _LAZY.get(name)
    if package is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{package}", __name__), name)
    globals()[name] = value
    return value
