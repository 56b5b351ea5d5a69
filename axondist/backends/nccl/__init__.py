"""The NCCL backend: collectives between GPUs on CuPy arrays, over ``cupy.cuda.nccl``.

Importing this package imports neither CuPy nor mpi4py; creating a backend does, and
raises :class:`~axondist.errors.BackendUnavailableError` saying what to install when
CuPy or NCCL is missing. ``axondist.init("nccl")`` calls :func:`create_world_backend`
(:mod:`.bootstrap`: rank 0's unique id shared over MPI under ``mpiexec``, else over a
TCP rendezvous from torchrun-style variables). The backend itself is
:class:`NcclBackend` (:mod:`.backend`), holding its communicator (:mod:`.communicator`:
stream, launch, recording, checks) and messages (:mod:`.messages`); its collectives are
plans (:mod:`.plans`), on the shared runtime (:mod:`.runtime`) and the tables it knows
without a GPU (:mod:`.basics`); ``docs/backends.md`` explains streams, grouped calls, how each
operation maps onto NCCL, and the cross-rank check, flight recorder and watchdog every
collective runs under (``AXONDIST_CHECKS=0`` turns the check off).
"""

from .backend import NcclBackend
from .basics import GroupedCallError, NcclError, NcclUniqueId, NotOnDeviceError
from .bootstrap import bootstrap_from_env, create_world_backend, use_device
from .runtime import NcclWork, group_calls

__all__ = [
    "GroupedCallError",
    "NcclBackend",
    "NcclError",
    "NcclUniqueId",
    "NcclWork",
    "NotOnDeviceError",
    "bootstrap_from_env",
    "create_world_backend",
    "group_calls",
    "use_device",
]
