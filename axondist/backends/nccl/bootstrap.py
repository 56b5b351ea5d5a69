"""How a launched job's ranks start their NCCL world: rank and size from MPI or from
torchrun-style variables, rank 0's unique id shared over MPI or the TCP rendezvous, and
each rank's GPU chosen (``node-local rank % device count`` unless given).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from types import ModuleType
from typing import Any

from ..._environment import launched_by_mpi
from ...errors import BackendUnavailableError, RankError
from ..base import default_timeout
from ..rendezvous import LaunchEnv, allgather_over_rendezvous
from .backend import NcclBackend
from .basics import NcclUniqueId, RankGpu, select_device, shared_gpu_message
from .runtime import device_count, gpu_identity, load_cupy

_PLACEMENT_KEY = "axondist/nccl/placement"


# --- the world of a launched job -------------------------------------------------------------

_OPTIONS = ("timeout", "device")


def create_world_backend(**options: Any) -> NcclBackend:
    """This process's world backend (what ``axondist.init("nccl")`` calls).

    Under ``mpiexec``/``srun``, rank and size come from MPI and rank 0's
    unique id is broadcast with mpi4py; otherwise from the torchrun-style
    environment with a TCP rendezvous at ``MASTER_ADDR:MASTER_PORT``; with
    neither, a one-rank world. The GPU is ``device`` when given, else
    ``node-local rank % device count``; it becomes the current CuPy device.
    Before NCCL starts, the ranks exchange their host and GPU over that same
    channel, and ranks that would share a GPU are refused.
    When the watchdog aborts this rank's communicators (a call past
    ``timeout``, a needed rank gone), the waiting call raises its report and
    the process ends itself 30 s later should that error be caught.

    Args:
        **options: ``timeout`` (seconds, also for the rendezvous) and
            ``device`` (a GPU id overriding the automatic choice).

    Raises:
        TypeError: an unknown option.
        BackendUnavailableError: CuPy, NCCL, a GPU or (under mpiexec) mpi4py missing.
        ValueError: a malformed torchrun environment (names the variable).
        CollectiveTimeoutError: the rendezvous found no rank 0 / not every rank.
        RankError: two ranks on one GPU (the message names them, the GPU, how many
            GPUs the host has and what to run instead).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"nccl backend: unknown options {unknown}; accepted: {list(_OPTIONS)}")
    timeout = options.get("timeout")
    device = options.get("device")
    cupy, _ = load_cupy()
    if launched_by_mpi():
        backend = _bootstrap_mpi(timeout, device)
    elif LaunchEnv.present(os.environ):
        backend = bootstrap_from_env(LaunchEnv.from_environ(os.environ), timeout=timeout,
                                     device=device)
    else:
        backend = NcclBackend(NcclBackend.generate_unique_id(), 0, 1,
                              0 if device is None else int(device), timeout=timeout)
    cupy.cuda.Device(backend.device).use()
    backend.comm.state.end_process = True  # a launched job: a watchdog abort ends this process
    return backend


def bootstrap_from_env(env: LaunchEnv, *, timeout: float | None = None,
                       device: int | None = None) -> NcclBackend:
    """An NcclBackend for ``env``: the ranks' GPUs and rank 0's unique id exchanged over
    the TCP rendezvous, ranks that would share a GPU refused before NCCL starts.

    The GPU is ``device`` when given, else ``(LOCAL_RANK or RANK) % device count``.

    Raises:
        RankError: two ranks on one GPU (the message names them, the GPU and what to
            run instead).
    """
    cupy, _ = load_cupy()
    count = device_count(cupy)
    if device is None:
        local = env.local_rank if env.local_rank is not None else env.rank
        device = select_device(local, count)
    wait = default_timeout() if timeout is None else float(timeout)
    place = _placement(cupy, device, count)
    mine = dataclasses.asdict(place)
    if env.rank == 0:
        mine["unique_id"] = NcclBackend.generate_unique_id().hex()
    table = [json.loads(v) for v in allgather_over_rendezvous(
        env, _PLACEMENT_KEY, json.dumps(mine).encode(), wait)]
    uid = NcclUniqueId.from_hex(table[0]["unique_id"])
    _refuse_shared_gpus([RankGpu(**{k: t[k] for k in mine if k != "unique_id"})
                         for t in table])
    return NcclBackend(uid, env.rank, env.world_size, device, timeout=timeout)


def _bootstrap_mpi(timeout: float | None, device: int | None) -> NcclBackend:
    cupy, _ = load_cupy()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            "the nccl backend under mpiexec needs mpi4py to share NCCL's unique id: "
            "from the axondist checkout, pip install '.[mpi]' (or launch with torchrun-style "
            "MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK instead of mpiexec)") from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    count = device_count(cupy)
    if device is None:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank = local.Get_rank()
        local.Free()
        device = select_device(local_rank, count)
    _refuse_shared_gpus(comm.allgather(_placement(cupy, int(device), count)))
    uid = NcclBackend.generate_unique_id() if rank == 0 else None
    uid = comm.bcast(uid, root=0)
    return NcclBackend(uid, rank, size, int(device), timeout=timeout)


def _placement(cupy: ModuleType, device: int, count: int) -> RankGpu:
    return RankGpu(socket.gethostname(), gpu_identity(cupy, device), int(device), count)


def _refuse_shared_gpus(table: list[RankGpu]) -> None:
    """Raise on every rank alike when ranks would share a GPU (NCCL would fail with a bare
    ncclInvalidUsage)."""
    message = shared_gpu_message(table)
    if message is not None:
        raise RankError(message)


# --- one process, one thread per GPU ------------------------------------------------------------

def use_device(device: int) -> None:
    """Make GPU ``device`` the calling thread's current CuPy device."""
    cupy, _ = load_cupy()
    cupy.cuda.Device(device).use()


__all__ = ["bootstrap_from_env", "create_world_backend", "use_device"]
