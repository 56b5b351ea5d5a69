"""What launched this process: an MPI launcher, an env-style launcher, or nothing.

A leaf module (it imports nothing from axondist), so every layer may ask.
"""

from __future__ import annotations

import os

# Environment variables set by MPI launchers (MPICH/Hydra, Open MPI, PMIx, Slurm's srun).
_MPI_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                    "MPI_LOCALNRANKS", "HYDI_CONTROL_FD")


def launched_by_mpi() -> bool:
    """True when this process was started by mpiexec/mpirun/srun (one of several ranks)."""
    env = os.environ
    if any(v in env for v in _MPI_LAUNCH_VARS):
        return True
    return "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


__all__ = ["launched_by_mpi"]
