"""The MPI backend: one process per rank, over mpi4py, on axondist's own duplicate of
``COMM_WORLD``.

Every collective is a prepared call: numbered and recorded in the rank's flight recorder,
checked across ranks (:mod:`.guard`), then moved by MPI's own collective or, where the
table in :mod:`.choose` says a measured win justifies it, by an algorithm of
:mod:`.algorithms`. A watchdog ends a job that stalls (:mod:`.world`).
``docs/backends.md`` explains the design and the measurements behind it.
"""

from .backend import MPIBackend
from .transport import MPIOptions, MPIWork
from .world import create_world_backend, install_abort_hook

__all__ = ["MPIBackend", "MPIOptions", "MPIWork", "create_world_backend", "install_abort_hook"]
