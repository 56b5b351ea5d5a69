"""What launched this process (an MPI launcher, an env-style launcher such as torchrun, or
nothing), read from the environment only; it imports nothing but :mod:`axondist.errors` and
:mod:`axondist.backends.settings` (which imports nothing), so every layer may ask without an
import cycle."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from .backends import settings
from .errors import LaunchError

# Environment variables set by MPI launchers (MPICH/Hydra, Open MPI, PMIx, Slurm's srun).
_MPI_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                    "MPI_LOCALNRANKS", "HYDI_CONTROL_FD")

# Env-style launchers (torchrun, torch.distributed.launch, accelerate, deepspeed): the
# process learns its place from these variables alone.
_ENV_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                    "TORCHELASTIC_RUN_ID")

#: Backends that can build a world from RANK/WORLD_SIZE/MASTER_ADDR themselves.
ENV_CAPABLE_BACKENDS = frozenset({"nccl", "torch"})


def launched_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by mpiexec/mpirun/srun (one of several ranks).

    The innermost launcher decides. A process torchrun started (``TORCHELASTIC_RUN_ID``) is
    never an MPI rank, even when ``srun`` or ``mpiexec`` started torchrun and their variables
    were passed down. Slurm's ``SLURM_PROCID`` alone (``srun`` without a PMI plugin) counts
    only when no ``RANK``/``WORLD_SIZE`` name a world of several processes.

    Args:
        env: the environment to read (``os.environ`` when None).

    Returns:
        Whether an MPI launcher's variables are present (Slurm's only with more than one task).
    """
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return False
    if any(v in env for v in _MPI_LAUNCH_VARS):
        return True
    return ("SLURM_PROCID" in env and _as_int(env.get("SLURM_NTASKS")) not in (None, 0, 1)
            and env_launch_size(env) is None)


#: Launcher variables giving (ranks on this host, ranks in the job): hydra, Open MPI, torchrun.
_LOCAL_AND_TOTAL = (("MPI_LOCALNRANKS", "PMI_SIZE"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
                    ("LOCAL_WORLD_SIZE", "WORLD_SIZE"))


def launched_on_one_host(env: Mapping[str, str] | None = None) -> bool:
    """True when the launcher says every rank of the job runs on this host.

    Args:
        env: the environment to read (``os.environ`` when None).

    Returns:
        Whether the launcher's count of ranks on this host (hydra's ``MPI_LOCALNRANKS``,
        Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``, torchrun's ``LOCAL_WORLD_SIZE``) equals
        its count of ranks in the job; False when it gives neither.
    """
    env = os.environ if env is None else env
    for local, total in _LOCAL_AND_TOTAL:
        if env.get(local, "").isdigit() and env.get(local) == env.get(total):
            return True
    return False


def _as_int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def env_launch_size(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` an env-style launcher (torchrun) gave this process, or None.

    A launch counts as multi-process when ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE`` is above 1,
    or ``RANK``/``LOCAL_RANK`` is above 0 (a rank beyond the first implies other ranks even
    when the size is missing); ``TORCHELASTIC_RUN_ID`` alone is not enough.

    Args:
        env: the environment to read (``os.environ`` when None).

    Returns:
        The rank and world size (the size may be a lower bound, ``rank + 1``, when the launcher
        did not say), or None when the variables describe at most one process.
    """
    env = os.environ if env is None else env
    rank = _as_int(env.get("RANK"))
    local_rank = _as_int(env.get("LOCAL_RANK"))
    size = _as_int(env.get("WORLD_SIZE")) or _as_int(env.get("LOCAL_WORLD_SIZE"))
    known_rank = rank if rank is not None else local_rank
    lower_bound = (known_rank or 0) + 1
    size = max(size or 0, lower_bound)
    if size <= 1:
        return None
    return known_rank or 0, size


def torch_installed() -> bool:
    """Whether torch can be imported (looked up, not imported)."""
    return importlib.util.find_spec("torch") is not None


def default_backend(env: Mapping[str, str] | None = None) -> str:
    """The backend ``init()`` starts when none is named: ``AXONDIST_BACKEND``, else
    ``"mpi"`` in a job an MPI launcher started, ``"torch"`` in one an env-style launcher
    (torchrun, a Kubernetes operator) started when torch is installed, else ``"mock"``.

    Args:
        env: the environment to read (``os.environ`` when None).
    """
    env = os.environ if env is None else env
    named: str | None = settings.read("AXONDIST_BACKEND", env)
    if named:
        return named
    if launched_by_mpi(env):
        return "mpi"
    if env_launch_size(env) is not None and torch_installed():
        return "torch"
    return "mock"


def check_env_launch(backend_name: str, env: Mapping[str, str] | None = None) -> None:
    """Refuse to start a CPU world inside an env-style multi-process launch.

    Under ``torchrun --nproc_per_node=N`` every process would otherwise become rank 0 of a
    one-rank world and train its own, independent model. The ``torch`` and ``nccl``
    backends read ``RANK``/``WORLD_SIZE`` themselves, and a process launched by MPI gets its
    world from MPI, so they pass.

    Args:
        backend_name: the backend ``init()`` is about to start (``"mock"``, ``"mpi"``...).
        env: the environment to read (``os.environ`` when None).

    Raises:
        LaunchError: the environment names several processes (``WORLD_SIZE`` > 1...) and
            neither MPI launched this process nor can the backend use those variables; the
            message says what to run instead.
    """
    env = os.environ if env is None else env
    if backend_name.lower() in ENV_CAPABLE_BACKENDS or launched_by_mpi(env):
        return
    found = env_launch_size(env)
    if found is None:
        return
    rank, size = found
    exact = "WORLD_SIZE" in env or "LOCAL_WORLD_SIZE" in env
    n = str(size) if exact else "N"
    seen = ", ".join(f"{v}={env[v]}" for v in _ENV_LAUNCH_VARS if v in env)
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "an env-style launcher"
    torch = ("ad.init('torch'), or ad.init() with no backend named" if torch_installed()
             else "pip install '.[torch]' from the axondist checkout, then ad.init()")
    raise LaunchError(
        f"init: this process looks like rank {rank} of {size if exact else f'at least {size}'} "
        f"started by {launcher} ({seen}), but the {backend_name!r} backend cannot build a "
        "world from these variables: each process would train its own model as rank 0 of 1. "
        f"Use the 'torch' backend, which joins this world through torch.distributed ({torch}), "
        f"or launch with `axondist run -n {n} script.py` or `mpiexec -n {n} python script.py` "
        "instead (or use backend 'nccl' on GPUs); if the variables are left over in your "
        "shell, unset them.")


__all__ = ["ENV_CAPABLE_BACKENDS", "check_env_launch", "default_backend", "env_launch_size",
           "launched_by_mpi", "launched_on_one_host", "torch_installed"]
