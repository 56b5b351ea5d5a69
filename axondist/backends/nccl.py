"""The NCCL backend: collectives between GPUs on CuPy arrays, over ``cupy.cuda.nccl``.

Importing this module imports neither CuPy nor mpi4py; creating a backend
does, and raises :class:`~axondist.errors.BackendUnavailableError` saying
what to install when CuPy or NCCL is missing.

Three ways to start
-------------------
* ``axondist.init("nccl")`` calls :func:`create_world_backend`: under
  ``mpiexec`` rank 0's unique id travels by an MPI broadcast and each process
  takes GPU ``node-local rank % device count``; otherwise the torchrun-style
  variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``) locate rank 0, which hands out the id over a small TCP
  rendezvous (:mod:`axondist.backends._rendezvous`); with neither, a one-GPU
  world. The chosen GPU becomes the process's current CuPy device.
* By hand: ``uid = NcclBackend.generate_unique_id()`` on one process, sent
  to the others any way you like (``uid.hex()`` is text), then
  ``NcclBackend(uid, rank, world_size, device)`` on every process.
* One process, several GPUs: ``NcclBackend.create_world([0, 1])`` returns
  one backend per device. Either drive each from its own thread
  (:func:`spawn_on_devices` does that and gives each thread a
  :class:`~axondist.World`, like :func:`axondist.spawn`), or issue every
  device's call from one thread inside one :func:`group_calls` block::

      backends = NcclBackend.create_world([0, 1])
      with group_calls():
          for b, x in zip(backends, xs):   # xs[i] lives on GPU backends[i].device
              b.all_reduce(x, ReduceOp.SUM)
      # every all_reduce has completed here

  Calls that need the host to wait for the GPU (object exchange,
  ``barrier``, ``new_group``, ``Work.wait``) cannot run inside a group.

Streams, completion and async handles
-------------------------------------
Each backend owns a CUDA stream on its device. An operation first makes
that stream wait for the caller's current stream (so it sees the caller's
writes), then enqueues NCCL's kernels and records an event after them.
A blocking call (``async_op=False``) waits for that event before returning,
as the Backend contract asks. ``async_op=True`` returns an :class:`NcclWork`
at once: ``wait()`` blocks the host until the event, ``is_completed()``
queries it, ``wait_stream()`` makes a stream wait for it without blocking
the host. Waits give up after the backend's ``timeout`` with
:class:`~axondist.errors.CollectiveTimeoutError` and surface NCCL's
asynchronous errors (a failed peer) as :class:`NcclError` naming the
operation. Keep a Work until it completed: it holds the buffers alive.

Grouped (bucketed) calls
------------------------
``with backend.grouped():`` (the same as :func:`group_calls`) brackets calls
in ``ncclGroupStart``/``ncclGroupEnd`` so NCCL launches them together: many
small all-reduces of a gradient bucket, or a send and a receive between
two ranks that must not wait for each other. Inside the block nothing has
run yet: issue calls with ``async_op=True`` and wait after the block (a
blocking call's own wait happens when the block ends).

How each operation maps onto NCCL
---------------------------------
* Reductions follow :func:`~axondist.backends._nccl_types.reduce_plan`:
  AVERAGE is ``ncclAvg`` on NCCL >= 2.10 and sum-then-divide before;
  complex numbers are pairs of floats (SUM, AVERAGE); ``bool`` is ``uint8``
  with max/min for OR/AND; bfloat16 (CuPy arrays of ``ml_dtypes.bfloat16``,
  CuPy >= 14) maps to ``ncclBfloat16`` (NCCL >= 2.10).
* Data that is only moved (broadcast, gathers, scatter, send/recv) travels
  as bytes, so every dtype works on every NCCL.
* Uneven counts: ``all_gather`` is one ``ncclBroadcast`` per rank inside a
  group, ``reduce_scatter`` one ``ncclReduce`` per rank inside a group (no
  padding, no extra memory); ``gather`` and ``scatter`` are grouped
  send/recv with the root's own block copied on its GPU. Equal counts use
  ``ncclAllGather``/``ncclReduceScatter``.
* Sub-groups: CuPy does not expose ``ncclCommSplit``, so ``new_group``
  broadcasts a fresh unique id from the group's first member over the
  parent communicator and the members create a communicator with it.
* Python objects (``allgather_object``, ``broadcast_object``,
  ``send_object``/``recv_object``) are pickled into a ``uint8`` device
  buffer and sent over NCCL itself after an exchange of lengths, so they
  work the same whatever the bootstrap was.
* NCCL has no message tags: messages between two ranks match in the order
  they were sent, and ``send``/``recv`` ignore ``tag``. ``recv_object``
  checks it (it travels in the object header), and
  :func:`axondist.recv` sends shape and dtype that way before the array.
  A send waits for its receiver (large messages always do), so two ranks
  must not both send to each other first: exchange inside ``grouped()``.
* ``AXONDIST_DEBUG=1`` also compares every collective's arguments across
  ranks (one extra object exchange per call), outside groups.

One backend is used by one thread at a time.
"""

from __future__ import annotations

import os
from typing import Any

from .._environment import launched_by_mpi
from ..errors import BackendUnavailableError
from ._nccl_backend import NcclBackend
from ._nccl_runtime import NcclWork, device_count, group_calls, load_cupy
from ._nccl_types import (
    GroupedCallError,
    NcclError,
    NcclUniqueId,
    NotOnDeviceError,
    select_device,
)
from ._rendezvous import LaunchEnv, exchange_from_rank0
from .base import default_timeout

_UNIQUE_ID_KEY = "axondist/nccl/unique_id"


# --- the world of a launched job -------------------------------------------------------------

_OPTIONS = ("timeout", "device")


def create_world_backend(**options: Any) -> NcclBackend:
    """This process's world backend (what ``axondist.init("nccl")`` calls).

    Under ``mpiexec``/``srun``, rank and size come from MPI and rank 0's
    unique id is broadcast with mpi4py; otherwise from the torchrun-style
    environment with a TCP rendezvous at ``MASTER_ADDR:MASTER_PORT``; with
    neither, a one-rank world. The GPU is ``device`` when given, else
    ``node-local rank % device count``; it becomes the current CuPy device.

    Args:
        **options: ``timeout`` (seconds, also for the rendezvous) and
            ``device`` (a GPU id overriding the automatic choice).

    Raises:
        TypeError: an unknown option.
        BackendUnavailableError: CuPy, NCCL, a GPU or (under mpiexec) mpi4py missing.
        ValueError: a malformed torchrun environment (names the variable).
        CollectiveTimeoutError: the rendezvous found no rank 0 / not every rank.
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
    return backend


def bootstrap_from_env(env: LaunchEnv, *, timeout: float | None = None,
                       device: int | None = None) -> NcclBackend:
    """An NcclBackend for ``env``: the unique id from rank 0 over the TCP rendezvous.

    The GPU is ``device`` when given, else ``(LOCAL_RANK or RANK) % device count``.
    """
    cupy, _ = load_cupy()
    if device is None:
        local = env.local_rank if env.local_rank is not None else env.rank
        device = select_device(local, device_count(cupy))
    wait = default_timeout() if timeout is None else float(timeout)
    uid = exchange_from_rank0(env, _UNIQUE_ID_KEY,
                              lambda: NcclBackend.generate_unique_id().internal, wait)
    return NcclBackend(uid, env.rank, env.world_size, device, timeout=timeout)


def _bootstrap_mpi(timeout: float | None, device: int | None) -> NcclBackend:
    cupy, _ = load_cupy()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            "the nccl backend under mpiexec needs mpi4py to share NCCL's unique id: "
            "pip install 'axondist[mpi]' (or launch with torchrun-style MASTER_ADDR/MASTER_PORT/"
            "WORLD_SIZE/RANK instead of mpiexec)") from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if device is None:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank = local.Get_rank()
        local.Free()
        device = select_device(local_rank, device_count(cupy))
    uid = NcclBackend.generate_unique_id() if rank == 0 else None
    uid = comm.bcast(uid, root=0)
    return NcclBackend(uid, rank, size, int(device), timeout=timeout)


# --- one process, one thread per GPU ------------------------------------------------------------

def use_device(device: int) -> None:
    """Make GPU ``device`` the calling thread's current CuPy device."""
    cupy, _ = load_cupy()
    cupy.cuda.Device(device).use()


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
