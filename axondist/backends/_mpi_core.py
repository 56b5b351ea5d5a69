"""The MPI backend's foundation: the lazily loaded ``MPI`` module, the state every
collective reads (communicator, options, dtype plans, call guard, node layout), host
staging of device arrays, and the wrappers that number, record and check a call
(:class:`MPIBackendBase`). ``axondist.backends.mpi`` builds the backend on it.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _array
from .._validate import as_rank
from ..errors import CollectiveMismatchError, InvalidBufferError
from ..ops import ReduceOp
from ._mpi_common import (
    MPIOptions,
    MPIWork,
    StagedWork,
    chunk_for,
    copy_back,
    cuda_aware_from_alloc_kinds,
    host_copy,
    load_mpi,
    mean_scaling,
    piece_size,
    synchronize_device,
    type_table,
    unsupported,
)
from ._mpi_guard import CallGuard
from ._watchdog import Watchdog
from .base import (
    Backend,
    CompletedWork,
    Signature,
    Work,
    compare_signatures,
)
from .recorder import FlightRecorder

# Bound by _load_mpi(): module globals keep the hot path to plain lookups.
MPI: Any = None
_IN_PLACE: Any = None
#: Other modules' binders of the same globals (see :func:`bind_mpi`).
_BINDERS: list[Callable[[Any], None]] = []


def _load_mpi() -> Any:
    global MPI, _IN_PLACE
    if MPI is None:
        MPI = load_mpi()
        _IN_PLACE = MPI.IN_PLACE
        for bind in _BINDERS:
            bind(MPI)
    return MPI


def bind_mpi(namespace: dict[str, Any]) -> None:
    """Set ``MPI`` and ``_IN_PLACE`` in ``namespace`` (a module's ``globals()``) once
    mpi4py's ``MPI`` is loaded (now, if it already is): how the backend's other modules
    keep them in module globals too."""
    def bind(mpi: Any) -> None:
        namespace.update(MPI=mpi, _IN_PLACE=mpi.IN_PLACE)

    _BINDERS.append(bind)
    if MPI is not None:
        bind(MPI)


def _node_info(node_ids: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(node id, local rank, local size) of ``rank`` from every rank's node id; nodes are
    numbered by their first rank, so every rank agrees."""
    order = list(dict.fromkeys(node_ids))
    mine = node_ids[rank]
    local = [r for r, n in enumerate(node_ids) if n == mine]
    return order.index(mine), local.index(rank), len(local)


# --- the backend ---------------------------------------------------------------------------

class MPIBackendBase(Backend):
    """What the MPI backend's collectives share: its communicator, options and dtype
    plans, the call guard (numbering, recording, checks), the node layout, host staging,
    and the wrappers that run a call numbered, recorded and checked. The collectives
    themselves are in :class:`~axondist.backends.mpi.MPIBackend` and its parts.

    Args:
        comm: the communicator (already a duplicate: the backend frees it on
            :meth:`close`). Construction is collective over ``comm``.
        options: data-movement policy (:meth:`MPIOptions.from_env` when None).
    """

    name = "mpi"
    #: The checked blocking all-reduce (:class:`~axondist.backends._mpi_allreduce.AllReduceMixin`).
    _checked_all_reduce: Callable[[Any, ReduceOp], None]

    def __init__(self, comm: Any, options: MPIOptions | None = None, *,
                 recorder: FlightRecorder | None = None, group_name: str = "world",
                 members: Sequence[int] | None = None,
                 node_ids: Sequence[int] | None = None) -> None:
        _load_mpi()
        self._comm = comm
        self.options = options if options is not None else MPIOptions.from_env()
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._types = type_table()
        self._reduce_plans = self._types.reduce
        # The same keyed by the op's name, for the hot path: ReduceOp's hash is
        # Enum's Python-level __hash__ (~0.1 us), a str caches its hash.
        self._plans_by_name = {op._name_: plans for op, plans in self._reduce_plans.items()}
        self._transfer_plans = self._types.transfer
        self._debug = self.options.debug
        #: axondist.comm builds the signature tuples only when this is true (the
        #: backend computes its own checks from the buffers otherwise).
        self.needs_signature = self._debug
        self._stage_always = self.options.host_staging == "always"
        #: The *_blocking entry points take the general path (debug checks, staging).
        self._slow = self._debug or self._stage_always
        if recorder is None:
            recorder = FlightRecorder(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(),
                                      MPI.Get_processor_name())
        self._guard = CallGuard(comm, MPI, recorder, group_name,
                                range(self.world_size) if members is None else members,
                                self.options.checks and not self._debug)
        self._cuda_aware: bool | None = True if self.options.host_staging == "never" else None
        self._tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        #: Each rank's node id (nodes numbered by their lowest rank): sub-groups derive
        #: their layout from it without communicating.
        self._nodes = self._compute_nodes() if node_ids is None else list(node_ids)
        self._node = _node_info(self._nodes, self.rank)
        #: Bytes per piece of big messages (``chunk_bytes``, by default from the layout).
        self._chunk_bytes = chunk_for(self.options.chunk_bytes, len(set(self._nodes)))
        self._chunk = self._chunk_bytes or sys.maxsize
        #: Blocking big sums, means and reduce-scatters as rings of point-to-point steps
        #: (``_mpi_allreduce``): on one node they beat MPICH's own collectives; across
        #: hosts each of a ring's 2 (n - 1) steps waits for the link's latency, and
        #: MPICH's algorithms, with fewer rounds, cost less (docs/multi-host.md).
        self._blocking_rings = len(set(self._nodes)) == 1
        self._host_twin: MPIBackendBase | None = None
        #: Scratch memory of the point-to-point algorithms, per array library.
        self._scratch_buffers: dict[str, Any] = {}
        #: Live persistent all-reduces: close() frees what their owners did not.
        self._persistent: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The rank's watchdog (the world backend of a job of several ranks only).
        self.watchdog: Watchdog | None = None
        self._bind_hot_path()

    #: The ``*_blocking`` entry points and the checked calls they become without a
    #: general path to take.
    _HOT_PATHS = (("all_reduce_blocking", "_checked_all_reduce"),
                  ("broadcast_blocking", "_checked_broadcast"),
                  ("all_gather_blocking", "_checked_all_gather"),
                  ("reduce_scatter_blocking", "_checked_reduce_scatter"))

    def _bind_hot_path(self) -> None:
        """Point the ``*_blocking`` entry points straight at the checked calls where no
        general path is needed (one Python frame less per small collective)."""
        for entry, checked in self._HOT_PATHS:
            self.__dict__.pop(entry, None)
            if not self._slow:
                setattr(self, entry, getattr(self, checked))

    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """The rank's flight recorder (shared by its groups)."""
        return self._guard.rec

    @property
    def comm(self) -> Any:
        """The mpi4py communicator carrying this backend's traffic (not COMM_WORLD)."""
        return self._comm

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers may go to MPI directly (detected once)."""
        if self._cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            if query is not None:
                self._cuda_aware = bool(query())
            else:
                info = self._comm.Get_info()
                try:
                    self._cuda_aware = cuda_aware_from_alloc_kinds(
                        info.Get("mpi_memory_alloc_kinds") or "")
                finally:
                    info.Free()
        return self._cuda_aware

    def _compute_nodes(self) -> list[int]:
        """Every rank's node id, from ``Split_type(COMM_TYPE_SHARED)``."""
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            leader = local.bcast(self.rank, root=0)
            return list(self._comm.allgather(leader))
        finally:
            local.Free()

    # --- helpers ---------------------------------------------------------------------------
    def _agree(self, op_name: str, signature: Signature, async_op: bool = False) -> None:
        """Under debug: raise the same CollectiveMismatchError on every rank on disagreement.

        ``async_op`` is compared too: MPI never matches a non-blocking
        collective (``Iallreduce``) with a blocking one on another rank.
        """
        sigs = self._comm.allgather((("op", op_name),) + tuple(signature)
                                    + (("async_op", bool(async_op)),))
        error = compare_signatures(op_name, sigs)
        if error is not None:
            raise error

    def _check_rank(self, r: int, what: str, arg: str) -> None:
        as_rank(r, self.world_size, what, arg)
    def _bad_counts(self, what: str, counts: list[int],
                    sizes: Sequence[tuple[str, Any, int]]) -> Exception:
        """The error for counts that do not fit the group or the buffers (slow path only)."""
        if len(counts) != self.world_size:
            return CollectiveMismatchError(f"{what}: counts lists {len(counts)} ranks, the "
                                           f"group has {self.world_size}")
        for arg, buf, expected in sizes:
            if buf is not None and buf.size != expected:
                return InvalidBufferError(
                    f"{what}: {arg} has {buf.size} elements but counts={counts} asks for "
                    f"{expected} on rank {self.rank}")
        return CollectiveMismatchError(f"{what}: counts={counts} do not fit")  # unreachable

    def _needs_host(self, *bufs: Any) -> bool:
        """True when these buffers go through host copies; else makes device ones ready."""
        if self._stage_always:
            return True
        if not any(b is not None and _array.is_cupy(b) for b in bufs):
            return False
        if not self.cuda_aware:
            return True
        synchronize_device(*bufs)
        return False

    @property
    def _host(self) -> MPIBackendBase:
        """This backend without host staging: what staged calls run on their NumPy copies."""
        if self._host_twin is None:
            twin = copy.copy(self)
            twin._stage_always = False
            twin._slow = twin._debug
            twin._bind_hot_path()
            twin._host_twin = twin
            self._host_twin = twin
        return self._host_twin

    def _via_host(self, call: Callable[..., Work], args: Sequence[Any], reads: Sequence[int],
                  writes: Sequence[int], out: int, async_op: bool) -> Work:
        """Run ``call`` on host copies of ``args`` (values copied for ``reads``), then copy
        ``writes`` back (in ``wait()`` when async); the result is ``args[out]``."""
        hosts: list[Any] = [None if a is None else host_copy(a) if i in reads
                            else _array.host_staging_buffer(a) for i, a in enumerate(args)]
        work = call(*hosts)

        def finish() -> None:
            for i in writes:
                if args[i] is not None:
                    copy_back(args[i], hosts[i])

        if not async_op:
            work.wait()
            finish()
            return CompletedWork(args[out])
        return StagedWork(work, finish, args[out])

    def _scratch(self, xp: Any, count: int, dtype: Any) -> Any:
        """``count`` elements of ``dtype`` of this backend's scratch memory (one buffer
        per array library, grown when needed and kept: a fresh one would cost its page
        faults on every call)."""
        nbytes = count * np.dtype(dtype).itemsize
        scratch = self._scratch_buffers.get(xp.__name__)
        if scratch is None or scratch.nbytes < nbytes:
            scratch = self._scratch_buffers[xp.__name__] = xp.zeros(nbytes, np.uint8)
        return scratch[:nbytes].view(dtype)

    def _divide(self, buf: Any) -> None:
        """Turn the sum in ``buf`` into the mean, in place (see :func:`mean_scaling`)."""
        how, by = mean_scaling(self.world_size)
        getattr(_array.namespace(buf), how)(buf, by, out=buf, casting="unsafe")

    #: Bytes per fused piece once :meth:`_piece` computed it (0: not yet).
    _piece_memo = 0

    def _piece(self) -> int:
        """Bytes per piece of a weighted all-reduce (:func:`piece_size`)."""
        if not self._piece_memo:
            self._piece_memo = piece_size(self.options.piece_bytes, self._chunk_bytes)
        return self._piece_memo

    def _transfer(self, buf: Any, what: str) -> tuple[Any, Any]:
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported(what, buf.dtype)
        view, mtype = plan
        return (buf if view is None else buf.view(view)), mtype

    def _reduction(self, buf: Any, op: ReduceOp, what: str) -> tuple[Any, Any, Any, bool]:
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported(what, buf.dtype, op)
        view, mtype, mop, average = plan
        return (buf if view is None else buf.view(view)), mtype, mop, average

    def _blocking(self, op: str, key: tuple[Any, ...], run: Callable[..., Any],
                  *args: Any) -> Any:
        """``run(*args)`` as call ``op``: numbered, recorded, checked across ranks first."""
        guard = self._guard
        seq, slot = guard.begin(op, key)
        try:
            if guard.checks:
                guard.agree(op, key)
            return run(*args)
        finally:
            guard.rec.end(slot)

    def _issue(self, op: str, key: tuple[Any, ...], start: Callable[..., Work],
               *args: Any) -> Work:
        """Start non-blocking call ``op`` after its check; its Work records the wait."""
        guard = self._guard
        seq, slot = guard.begin(op, key, blocking=False)
        try:
            # Not blocking: the check is issued first and settled in wait(), before the
            # data, so a mismatch still raises before any wrong value is returned.
            check = guard.agree_later(op, key) if guard.checks else None
            work = start(*args)
        finally:
            guard.rec.end(slot)
        if isinstance(work, MPIWork):
            work.track(guard.rec, guard.group, seq)
            if check is not None:
                work.checked_by(*check)
        elif check is not None:
            check[0].Wait()
            check[1]()
        return work
