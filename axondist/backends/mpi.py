"""The MPI backend: one process per rank, over mpi4py, on axondist's own duplicate of
``COMM_WORLD``. Every collective is recorded in the rank's flight recorder and starts with
a check that all ranks make the same call (carried in the data of a small all-reduce); a
watchdog ends a job that stalls.
``docs/backends.md`` explains the design (pieces, fused arithmetic, half-precision and
NaN handling, CuPy staging, the checks and the watchdog) and the measurements behind it.
"""

from __future__ import annotations

import copy
import secrets
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _array
from .._validate import as_rank, positive_seconds
from ..errors import CollectiveMismatchError, InvalidBufferError
from ..ops import ReduceOp
from ._mpi_common import (
    BYTES,
    MEAN_IN_BLOCKS_BYTES,
    MPIOptions,
    MPIWork,
    StagedWork,
    block_counts,
    chunk_for,
    copy_back,
    cuda_aware_from_alloc_kinds,
    displacements,
    host_copy,
    load_mpi,
    mean_scaling,
    piece_bounds,
    piece_size,
    raise_mpi_error,
    split_tag,
    synchronize_device,
    type_table,
    unsupported,
)
from ._mpi_guard import CallGuard, Rider, wait_until
from ._watchdog import Watchdog, exit_soon, print_and_flush, silence_all
from .base import (
    Backend,
    CompletedWork,
    Signature,
    Work,
    compare_signatures,
    default_timeout,
    stall_warning_after,
)
from .recorder import FlightRecorder

#: A plan not made yet (None is a plan: "no carrier").
_UNSET: Any = object()

# Bound by _load_mpi(): module globals keep the hot path to plain lookups.
MPI: Any = None
_IN_PLACE: Any = None


def _load_mpi() -> Any:
    global MPI, _IN_PLACE
    if MPI is None:
        MPI = load_mpi()
        _IN_PLACE = MPI.IN_PLACE
    return MPI


# --- the backend ---------------------------------------------------------------------------

class MPIBackend(Backend):
    """One rank's endpoint in an MPI communicator that axondist owns.

    Args:
        comm: the communicator (already a duplicate: the backend frees it on
            :meth:`close`). Construction is collective over ``comm``.
        options: data-movement policy (:meth:`MPIOptions.from_env` when None).
    """

    name = "mpi"

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
        self._host_twin: MPIBackend | None = None
        #: Live persistent all-reduces: close() frees what their owners did not.
        self._persistent: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The rank's watchdog (the world backend of a job of several ranks only).
        self.watchdog: Watchdog | None = None
        self._bind_hot_path()

    def _bind_hot_path(self) -> None:
        """Point :meth:`all_reduce_blocking` straight at the checked call where no
        general path is needed (one Python frame less per small all-reduce)."""
        self.__dict__.pop("all_reduce_blocking", None)
        if not self._slow:
            self.all_reduce_blocking = self._checked_all_reduce  # type: ignore[method-assign]

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
    def _host(self) -> MPIBackend:
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
                            else np.empty(a.shape, a.dtype) for i, a in enumerate(args)]
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

    # --- collectives -----------------------------------------------------------------------
    # Each method is one layer: checks, then (rarely) the host-staging detour, which
    # re-enters the same method on the host twin with NumPy copies, then the MPI call.
    # The small blocking case is kept to attribute reads, dict lookups and the call:
    # at 4 KiB its Python cost is comparable to the whole MPI all-reduce.

    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``Allreduce`` in place (``Iallreduce`` pieces with ``async_op``).

        Messages above ``chunk_bytes`` run in pieces; a blocking AVERAGE above
        ``MEAN_IN_BLOCKS_BYTES`` is a reduce-scatter, a scaled move and an all-gather
        (:meth:`_mean_in_blocks`). Device arrays go through
        host copies unless MPI is CUDA-aware.
        """
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(
                lambda h: self._host.all_reduce(h, op, signature=signature, async_op=async_op),
                [buf], (0,), (0,), 0, async_op)
        if self._debug:
            self._agree("all_reduce", signature + (("reduce_op", op.name),), async_op)
        key = (buf.dtype, buf.shape, op._name_, async_op)
        if not async_op:
            self._checked_all_reduce(buf, op)  # the same check as the hot path's
            return CompletedWork(buf)
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        return self._issue("all_reduce", key, self._all_reduce_pieces, buf,
                           buf if view is None else buf.view(view), mtype, mop, average, True)

    def all_reduce_blocking(self, buf: Any, op: ReduceOp) -> None:
        """The blocking :meth:`all_reduce` without a Work object: axondist.comm's hot path.

        ``buf`` is a NumPy array (or a device array MPI reads directly). Under
        debug or host staging it takes the general path.
        """
        if self._slow:
            self.all_reduce(buf, op, signature=(("dtype", buf.dtype), ("shape", buf.shape)))
            return
        self._checked_all_reduce(buf, op)

    def _checked_all_reduce(self, buf: Any, op: ReduceOp) -> None:
        """A blocking all-reduce, numbered, recorded and checked: the check rides in the
        message where the call's key allows it (the same choice on every rank), else it
        goes first."""
        key = (buf.dtype, buf.shape, op._name_, False)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "all_reduce", key)
        try:
            plan = guard.all_reduces.get(key)
            if plan is None:
                plan = self._plan_all_reduce(key, buf, op)
            rider, direct = plan
            if rider is not None:
                if buf.__class__ is np.ndarray or isinstance(buf, np.ndarray):
                    guard.ride(rider, buf, key)
                    return
                # Device memory MPI reads itself: this rank cannot ride. Ranks that
                # do meet this separate check and all raise, naming the buffers.
                guard.agree("all_reduce", key, riding=False)
            elif guard.checks:
                guard.agree("all_reduce", key)
            if direct is None:
                self._all_reduce_now(buf, op)
                return
            try:
                self._comm.Allreduce(_IN_PLACE, [buf, direct[0]], direct[1])
            except MPI.Exception as exc:
                raise_mpi_error(exc, "all_reduce")
        finally:
            rec.end_blocking(slot, group, seq)

    def _plan_all_reduce(self, key: tuple[Any, ...], buf: Any,
                         op: ReduceOp) -> tuple[Rider | None, tuple[Any, Any] | None]:
        """How blocking all-reduce ``key`` runs, remembered by the guard: its
        :class:`Rider` (None where the check cannot ride in its message), and its MPI
        ``(datatype, op)`` where it is one ``Allreduce`` of the buffer as it is (None: the
        general :meth:`_all_reduce_now`). Decided from the key alone (dtype, shape, op),
        so every rank that makes the same call decides alike."""
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        direct = (mtype, mop) if (view is None and not average
                                  and buf.size * buf.dtype.itemsize <= self._chunk) else None
        rider = None
        if view is None and self._guard.checks:
            rider = self._guard.rider(key, buf.dtype, buf.size, op._name_, self.world_size)
        return self._guard.remember(key, rider, direct)

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

    def _all_reduce_now(self, buf: Any, op: ReduceOp) -> None:
        """The MPI calls of a blocking all-reduce (no check, no record)."""
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        data = buf if view is None else buf.view(view)
        if average and data.nbytes > MEAN_IN_BLOCKS_BYTES and self.world_size > 1:
            self._mean_in_blocks(buf, data, mtype, mop)
            return
        if data.nbytes > self._chunk:
            self._all_reduce_pieces(buf, data, mtype, mop, average, False)
            return
        try:
            self._comm.Allreduce(_IN_PLACE, [data, mtype], mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        if average:
            self._divide(buf)

    def scaled_sum_blocking(self, buf: Any, factor: float = 1.0) -> None:
        """Multiply ``buf`` (a NumPy array) by ``factor`` and sum it over the ranks, in place.

        Equal to ``buf *= factor`` (casting unsafely to ``buf``'s dtype; skipped
        when ``factor`` is 1) then a SUM :meth:`all_reduce_blocking`, piece by
        piece (:attr:`MPIOptions.piece_bytes`, by default ``chunk_bytes``), each
        piece weighted just before its Allreduce (small pieces: while in cache).
        The pieces depend only on ``buf``'s size and dtype and the options, so
        ranks with different factors (sample weights) make the same MPI calls.
        What gradient buckets use for their weighted sum.
        """
        plan = self._plans_by_name["SUM"].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, ReduceOp.SUM)
        if self._slow:
            super().scaled_sum_blocking(buf, factor)
            return
        view, mtype, mop, _ = plan
        self._blocking("scaled_sum", (buf.dtype, buf.shape), self._fused_pieces, buf,
                       buf if view is None else buf.view(view), mtype, mop, factor)

    def _fused_pieces(self, buf: Any, data: Any, mtype: Any, mop: Any, factor: float) -> None:
        """Blocking SUM all-reduce piece by piece (:meth:`_piece` bytes each), each piece
        multiplied by ``factor`` (unless 1) just before its Allreduce (while in cache, when
        the pieces are small)."""
        flat, wire = buf.reshape(-1), data.reshape(-1)
        comm, scale = self._comm, factor != 1.0
        try:
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._piece()):
                if scale:
                    piece = flat[lo:hi]
                    np.multiply(piece, factor, out=piece, casting="unsafe")
                comm.Allreduce(_IN_PLACE, [wire[lo:hi], mtype], mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _mean_in_blocks(self, buf: Any, data: Any, mtype: Any, mop: Any) -> None:
        """Blocking AVERAGE, per ``chunk_bytes``: an in-place reduce-scatter leaves this
        rank's block of the sum at the front of the chunk; the scaling by 1/n (see
        :func:`mean_scaling`) writes it to its own place, and an in-place all-gather
        fills in the others' blocks. The arithmetic touches 1/n of the data, fused with a
        move, and each chunk costs two collectives whatever the network's latency
        (``docs/backends.md`` has the measurements)."""
        flat, wire = buf.reshape(-1), data.reshape(-1)
        n, rank, comm = self.world_size, self.rank, self._comm
        how, by = mean_scaling(n)
        scale = getattr(_array.namespace(buf), how)
        try:
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk):
                counts = block_counts(hi - lo, n)
                mine, start = counts[rank], sum(counts[:rank])
                part, wpart = flat[lo:hi], [wire[lo:hi], mtype]
                even = counts[0] == counts[-1]
                if even:
                    comm.Reduce_scatter_block(_IN_PLACE, wpart, mop)
                else:
                    comm.Reduce_scatter(_IN_PLACE, wpart, counts, mop)
                # start >= counts[0] >= mine on ranks > 0: source and target never overlap.
                scale(part[:mine], by, out=part[start:start + mine], casting="unsafe")
                if even:
                    comm.Allgather(_IN_PLACE, wpart)
                else:
                    comm.Allgatherv(_IN_PLACE, [wire[lo:hi], counts, displacements(counts),
                                                mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _all_reduce_pieces(self, buf: Any, data: Any, mtype: Any, mop: Any, average: bool,
                           async_op: bool) -> Work:
        """Big or non-blocking all-reduce: one call per piece of at most ``chunk_bytes``."""
        flat = data.reshape(-1)
        pieces = [flat[lo:hi] for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk)]
        comm = self._comm
        try:
            if not async_op:
                for piece in pieces:
                    comm.Allreduce(_IN_PLACE, [piece, mtype], mop)
                if average:
                    self._divide(buf)
                return CompletedWork(buf)
            requests = [comm.Iallreduce(_IN_PLACE, [p, mtype], mop) for p in pieces]
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        return MPIWork(requests, (lambda: self._divide(buf)) if average else None, buf,
                       "all_reduce")

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """``Bcast`` of ``root``'s ``buf`` (``Ibcast`` if ``async_op``), in chunk_bytes pieces."""
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
        if (type(buf) is not np.ndarray or self._stage_always) and self._needs_host(buf):
            return self._via_host(
                lambda h: self._host.broadcast(h, root, signature=signature, async_op=async_op),
                [buf], (0,) if self.rank == root else (), (0,), 0, async_op)
        if self._debug:
            self._agree("broadcast", signature + (("root", root),), async_op)
        if not async_op:
            self._checked_broadcast(buf, root)
            return CompletedWork(buf)
        return self._issue("broadcast", (buf.dtype, buf.shape, root, async_op),
                           self._broadcast_pieces, buf, root)

    def _broadcast_pieces(self, buf: Any, root: int) -> Work:
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported("broadcast", buf.dtype)
        view, mtype = plan
        flat = (buf if view is None else buf.view(view)).reshape(-1)
        try:
            requests = [self._comm.Ibcast([flat[lo:hi], mtype], root)
                        for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk)]
        except MPI.Exception as exc:
            raise_mpi_error(exc, "broadcast")
        return MPIWork(requests, None, buf, "broadcast")

    def broadcast_blocking(self, buf: Any, root: int) -> None:
        """The blocking :meth:`broadcast` without a Work object (as :meth:`all_reduce_blocking`)."""
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
        if self._slow:
            self.broadcast(buf, root, signature=(("dtype", buf.dtype), ("shape", buf.shape)))
            return
        self._checked_broadcast(buf, root)

    def _checked_broadcast(self, buf: Any, root: int) -> None:
        """A blocking broadcast, numbered, recorded and checked; in a two-rank group a
        small one's data rides with the check (:meth:`CallGuard.carrier`)."""
        key = (buf.dtype, buf.shape, root, False)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "broadcast", key)
        try:
            if guard.checks:
                carrier = guard.carriers.get(("broadcast", key), _UNSET)
                if carrier is _UNSET:
                    shapes = (buf.shape, (0,)) if self.rank == root else ((0,), buf.shape)
                    carrier = guard.remember_carrier("broadcast", key, guard.carrier(
                        "broadcast", key, buf.nbytes, buf.dtype, *shapes))
                if carrier is None:
                    guard.agree("broadcast", key)
                elif buf.__class__ is np.ndarray or isinstance(buf, np.ndarray):
                    if self.rank == root:
                        carrier.mine[...] = buf
                    guard.carry(carrier, "broadcast", key)
                    if self.rank != root:
                        buf[...] = carrier.theirs
                    return
                else:
                    guard.agree("broadcast", key, riding=False)
            self._broadcast_now(buf, root)
        finally:
            rec.end_blocking(slot, group, seq)

    def _broadcast_now(self, buf: Any, root: int) -> None:
        plan = self._transfer_plans.get(buf.dtype)
        if plan is None:
            raise unsupported("broadcast", buf.dtype)
        view, mtype = plan
        data = buf if view is None else buf.view(view)
        comm = self._comm
        try:
            if data.nbytes <= self._chunk:
                comm.Bcast([data, mtype], root)
                return
            flat = data.reshape(-1)
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk):
                comm.Bcast([flat[lo:hi], mtype], root)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "broadcast")

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """``Allgather`` of ``send`` into ``recv`` (``Allgatherv`` for uneven ``counts``).

        Raises:
            CollectiveMismatchError: ``counts`` does not list one size per rank.
            InvalidBufferError: ``send`` or ``recv`` does not hold what ``counts`` says.
        """
        counts = counts if type(counts) is list else [int(c) for c in counts]
        total = sum(counts)
        if (len(counts) != self.world_size or send.size != counts[self.rank]
                or recv.size != total):
            raise self._bad_counts("all_gather", counts, (("send", send, counts[self.rank]),
                                                          ("recv", recv, total)))
        if ((type(send) is not np.ndarray or type(recv) is not np.ndarray or self._stage_always)
                and self._needs_host(send, recv)):
            return self._via_host(
                lambda s, r: self._host.all_gather(s, r, counts, signature=signature,
                                                   async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("all_gather", signature + (("counts", tuple(counts)),), async_op)
        if not async_op:
            self._checked_all_gather(send, recv, counts)
            return CompletedWork(recv)
        return self._issue("all_gather", (send.dtype, tuple(counts), async_op),
                           self._all_gather_start, send, recv, counts)

    def _all_gather_start(self, send: Any, recv: Any, counts: list[int]) -> Work:
        s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):
                request = self._comm.Iallgather([s, mtype], [r, mtype])
            else:
                request = self._comm.Iallgatherv([s, mtype],
                                                 [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")
        return MPIWork([request], None, recv, "all_gather")

    def _gather_buffers(self, send: Any, recv: Any) -> tuple[Any, Any, Any]:
        """(send view, recv view, MPI datatype) for an all-gather."""
        plan = self._transfer_plans.get(send.dtype)
        rplan = plan if recv.dtype is send.dtype else self._transfer_plans.get(recv.dtype)
        if plan is None or rplan is None:
            raise unsupported("all_gather", send.dtype if plan is None else recv.dtype)
        view, mtype = plan
        return (send if view is None else send.view(view),
                recv if rplan[0] is None else recv.view(rplan[0]), mtype)

    def all_gather_blocking(self, send: Any, recv: Any, counts: list[int]) -> None:
        """The blocking :meth:`all_gather` without a Work object (see
        :meth:`all_reduce_blocking`); ``counts`` is a list of ints the caller checked
        against the group and the buffers."""
        if self._slow:
            self.all_gather(send, recv, counts, signature=(("dtype", send.dtype),))
            return
        self._checked_all_gather(send, recv, counts)

    def _checked_all_gather(self, send: Any, recv: Any, counts: list[int]) -> None:
        """A blocking all-gather, numbered, recorded and checked; in a two-rank group a
        small one's data rides with the check (:meth:`CallGuard.carrier`)."""
        key = (send.dtype, tuple(counts), False)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "all_gather", key)
        try:
            if guard.checks:
                carrier = guard.carriers.get(("all_gather", key), _UNSET)
                if carrier is _UNSET:
                    carrier = guard.remember_carrier("all_gather", key, guard.carrier(
                        "all_gather", key, sum(counts) * send.dtype.itemsize, send.dtype,
                        (counts[self.rank],), (counts[1 - self.rank],))
                        if self.world_size == 2 else None)
                if carrier is None:
                    guard.agree("all_gather", key)
                elif send.__class__ is recv.__class__ is np.ndarray or (
                        isinstance(send, np.ndarray) and isinstance(recv, np.ndarray)):
                    flat = send.reshape(-1) if send.ndim != 1 else send
                    carrier.mine[...] = flat
                    guard.carry(carrier, "all_gather", key)
                    rows = recv.reshape(-1) if recv.ndim != 1 else recv
                    first = counts[0]
                    rows[:first] = flat if self.rank == 0 else carrier.theirs
                    rows[first:] = carrier.theirs if self.rank == 0 else flat
                    return
                else:
                    guard.agree("all_gather", key, riding=False)
            self._all_gather_now(send, recv, counts)
        finally:
            rec.end_blocking(slot, group, seq)

    def _all_gather_now(self, send: Any, recv: Any, counts: list[int]) -> None:
        plan = self._transfer_plans.get(send.dtype)
        if plan is not None and plan[0] is None and recv.dtype is send.dtype:
            s, r, mtype = send, recv, plan[1]  # a native MPI type: no views
        else:
            s, r, mtype = self._gather_buffers(send, recv)
        try:
            if counts.count(counts[0]) == len(counts):  # the common case needs no displs
                self._comm.Allgather([s, mtype], [r, mtype])
            else:
                self._comm.Allgatherv([s, mtype], [r, counts, displacements(counts), mtype])
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_gather")

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """``Reduce_scatter`` of ``send`` by ``counts`` into ``recv``; AVERAGE divides afterwards.

        Raises:
            CollectiveMismatchError: ``counts`` does not list one size per rank.
            InvalidBufferError: ``send`` or ``recv`` does not hold what ``counts`` says.
        """
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if (len(counts) != self.world_size or send.size != sum(counts)
                or recv.size != counts[self.rank]):
            raise self._bad_counts("reduce_scatter", counts, (("send", send, sum(counts)),
                                                              ("recv", recv, counts[self.rank])))
        if ((type(send) is not np.ndarray or type(recv) is not np.ndarray or self._stage_always)
                and self._needs_host(send, recv)):
            return self._via_host(
                lambda s, r: self._host.reduce_scatter(s, r, counts, op, signature=signature,
                                                       async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("reduce_scatter",
                        signature + (("counts", tuple(counts)), ("reduce_op", op.name)), async_op)
        if not async_op:
            self._checked_reduce_scatter(send, recv, counts, op)
            return CompletedWork(recv)
        return self._issue("reduce_scatter", (send.dtype, tuple(counts), op._name_, async_op),
                           self._reduce_scatter_start, send, recv, counts, op)

    def reduce_scatter_blocking(self, send: Any, recv: Any, counts: list[int],
                                op: ReduceOp) -> None:
        """The blocking :meth:`reduce_scatter` without a Work object (see
        :meth:`all_reduce_blocking`): ``counts`` is a list of ints the caller checked against
        the group and the buffers, ``send`` and ``recv`` NumPy arrays of one dtype."""
        if self._slow:
            self.reduce_scatter(send, recv, counts, op, signature=(("dtype", send.dtype),))
            return
        self._checked_reduce_scatter(send, recv, counts, op)

    def _checked_reduce_scatter(self, send: Any, recv: Any, counts: list[int],
                                op: ReduceOp) -> None:
        """A blocking reduce-scatter, numbered, recorded and checked; in a two-rank group a
        small one's data rides with the check (:meth:`CallGuard.carrier`): each rank
        sends the other's block and combines the block it gets with its own."""
        key = (send.dtype, tuple(counts), op._name_, False)
        guard = self._guard
        group, seq = guard.group, next(guard.seqs)
        rec = guard.rec
        slot = rec.begin(group, seq, "reduce_scatter", key)
        try:
            if guard.checks:
                carrier = guard.carriers.get(("reduce_scatter", key), _UNSET)
                if carrier is _UNSET:
                    carrier = guard.remember_carrier("reduce_scatter", key, guard.carrier(
                        "reduce_scatter", key, sum(counts) * send.dtype.itemsize, send.dtype,
                        (counts[1 - self.rank],), (counts[self.rank],), op._name_)
                        if self.world_size == 2 else None)
                if carrier is None:
                    guard.agree("reduce_scatter", key)
                elif send.__class__ is recv.__class__ is np.ndarray or (
                        isinstance(send, np.ndarray) and isinstance(recv, np.ndarray)):
                    flat = send.reshape(-1) if send.ndim != 1 else send
                    first = counts[0]
                    mine, other = (flat[:first], flat[first:]) if self.rank == 0 else \
                        (flat[first:], flat[:first])
                    carrier.mine[...] = other
                    guard.carry(carrier, "reduce_scatter", key)
                    out = recv.reshape(-1) if recv.ndim != 1 else recv
                    rider: Rider = carrier  # made with an op
                    rider.ufunc(mine, rider.theirs, out=out)
                    if rider.scale is not None:
                        rider.scale(out, rider.by, out=out, casting="unsafe")
                    return
                else:
                    guard.agree("reduce_scatter", key, riding=False)
            self._reduce_scatter_now(send, recv, counts, op)
        finally:
            rec.end_blocking(slot, group, seq)

    def _reduce_scatter_plan(self, send: Any, recv: Any, op: ReduceOp) -> tuple[Any, Any, Any,
                                                                                 Any, bool]:
        """(send view, recv view, MPI datatype, MPI op, average) of a reduce-scatter."""
        plan = self._plans_by_name[op._name_].get(send.dtype)
        if plan is None:
            raise unsupported("reduce_scatter", send.dtype, op)
        if recv.dtype != send.dtype:
            raise InvalidBufferError(f"reduce_scatter: recv has dtype {recv.dtype} but send has "
                                     f"{send.dtype}; pass a recv of send's dtype")
        view, mtype, mop, average = plan
        if view is None:
            return send, recv, mtype, mop, average
        return send.view(view), recv.view(view), mtype, mop, average

    def _reduce_scatter_now(self, send: Any, recv: Any, counts: list[int], op: ReduceOp) -> None:
        """The MPI call of a blocking reduce-scatter (``Reduce_scatter_block`` for equal
        counts: no counts array to build), then AVERAGE's scaling of this rank's block."""
        plan = self._plans_by_name[op._name_].get(send.dtype)
        if plan is not None and plan[0] is None and recv.dtype is send.dtype:
            s, r, mtype, mop, average = send, recv, plan[1], plan[2], plan[3]  # no views
        else:
            s, r, mtype, mop, average = self._reduce_scatter_plan(send, recv, op)
        try:
            if counts.count(counts[0]) == len(counts):
                self._comm.Reduce_scatter_block([s, mtype], [r, mtype], mop)
            else:
                self._comm.Reduce_scatter([s, mtype], [r, mtype], counts, mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "reduce_scatter")
        if average:
            self._divide(recv)

    def _reduce_scatter_start(self, send: Any, recv: Any, counts: list[int],
                              op: ReduceOp) -> Work:
        s, r, mtype, mop, average = self._reduce_scatter_plan(send, recv, op)
        try:
            request = self._comm.Ireduce_scatter([s, mtype], [r, mtype], counts, mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "reduce_scatter")
        return MPIWork([request], (lambda: self._divide(recv)) if average else None, recv,
                       "reduce_scatter")

    def _rooted(self, what: str, root: int, counts: Sequence[int], mine: Any,
                full: Any | None, mine_arg: str, full_arg: str) -> tuple[list[int], Any]:
        """Checks shared by gather and scatter: ``counts`` as ints, and ``full`` (the
        root's whole buffer) kept on the root only."""
        self._check_rank(root, what, "root")
        counts = counts if type(counts) is list else [int(c) for c in counts]
        if self.rank != root:
            full = None
        elif full is None:
            raise InvalidBufferError(f"{what}: the root (rank {root}) must pass a {full_arg} "
                                     "buffer")
        if (len(counts) != self.world_size or mine.size != counts[self.rank]
                or (full is not None and full.size != sum(counts))):
            raise self._bad_counts(what, counts, ((mine_arg, mine, counts[self.rank]),
                                                  (full_arg, full, sum(counts))))
        return counts, full

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """``Gatherv`` into ``root``'s ``recv``; elsewhere ``recv`` is ignored and the result None.

        Raises:
            InvalidBufferError: the root passed no ``recv``, or a buffer does not
                hold what ``counts`` says.
        """
        counts, recv = self._rooted("gather", root, counts, send, recv, "send", "recv")
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.gather(s, r, counts, root, signature=signature,
                                               async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("gather", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        key = (send.dtype, tuple(counts), root, async_op)
        call = self._issue if async_op else self._blocking
        return call("gather", key, self._rooted_call, "gather", send, recv, counts, root,
                    async_op)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """``Scatterv`` of ``root``'s ``send`` by ``counts``; ``send`` is ignored elsewhere.

        Raises:
            InvalidBufferError: the root passed no ``send``, or a buffer does not
                hold what ``counts`` says.
        """
        counts, send = self._rooted("scatter", root, counts, recv, send, "recv", "send")
        if self._needs_host(send, recv):
            return self._via_host(
                lambda s, r: self._host.scatter(s, r, counts, root, signature=signature,
                                                async_op=async_op),
                [send, recv], (0,), (1,), 1, async_op)
        if self._debug:
            self._agree("scatter", signature + (("root", root), ("counts", tuple(counts))),
                        async_op)
        key = (recv.dtype, tuple(counts), root, async_op)
        call = self._issue if async_op else self._blocking
        return call("scatter", key, self._rooted_call, "scatter", recv, send, counts, root,
                    async_op)

    def _rooted_call(self, what: str, mine: Any, full: Any | None, counts: list[int],
                     root: int, async_op: bool) -> Work:
        """``Gatherv``/``Scatterv`` (or their non-blocking forms): ``mine`` is this rank's
        block, ``full`` the root's whole buffer (None elsewhere)."""
        m, mtype = self._transfer(mine, what)
        spec = None
        if full is not None:
            f, _ = self._transfer(full, what)
            spec = [f, counts, displacements(counts), mtype]
        comm = self._comm
        args: tuple[Any, ...]
        try:
            if what == "gather":
                args = ([m, mtype], spec, root)
                call = comm.Igatherv if async_op else comm.Gatherv
            else:
                args = (spec, [m, mtype], root)
                call = comm.Iscatterv if async_op else comm.Scatterv
            if not async_op:
                call(*args)
                return CompletedWork(full if what == "gather" else mine)
            request = call(*args)
        except MPI.Exception as exc:
            raise_mpi_error(exc, what)
        return MPIWork([request], None, full if what == "gather" else mine, what)

    def reduce(self, buf: Any, op: ReduceOp, root: int, *, signature: Signature = (),
               async_op: bool = False) -> Work:
        """``Reduce`` into ``root``'s ``buf`` (in place there); AVERAGE divides on the root.

        Non-blocking calls and host staging take the general path (an all-reduce).
        """
        self._check_rank(root, "reduce", "root")
        if async_op or self._slow or self._needs_host(buf):
            return super().reduce(buf, op, root, signature=signature, async_op=async_op)
        data, mtype, mop, average = self._reduction(buf, op, "reduce")
        comm, mine = self._comm, self.rank == root

        def run() -> None:
            try:
                if mine:
                    comm.Reduce(_IN_PLACE, [data, mtype], mop, root)
                else:
                    comm.Reduce([data, mtype], None, mop, root)
            except MPI.Exception as exc:
                raise_mpi_error(exc, "reduce")
            if average and mine:
                self._divide(buf)

        self._blocking("reduce", (buf.dtype, buf.shape, op._name_, root, False), run)
        return CompletedWork(buf)

    def all_to_all(self, send: Any, recv: Any, send_counts: Sequence[int],
                   recv_counts: Sequence[int], *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``Alltoallv``: block k of ``send`` to rank k, ``recv`` gets the blocks in rank order.

        Non-blocking calls and host staging take the general path.
        """
        if async_op or self._slow or self._needs_host(send, recv):
            return super().all_to_all(send, recv, send_counts, recv_counts,
                                      signature=signature, async_op=async_op)
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if (len(sc) != self.world_size or len(rc) != self.world_size or send.size != sum(sc)
                or recv.size != sum(rc)):
            raise self._bad_counts("all_to_all", sc, (("send", send, sum(sc)),
                                                      ("recv", recv, sum(rc))))
        s, mtype = self._transfer(send, "all_to_all")
        r, _ = self._transfer(recv, "all_to_all")

        def run() -> None:
            try:
                self._comm.Alltoallv([s, sc, displacements(sc), mtype],
                                     [r, rc, displacements(rc), mtype])
            except MPI.Exception as exc:
                raise_mpi_error(exc, "all_to_all")

        self._blocking("all_to_all", (send.dtype, False), run)
        return CompletedWork(recv)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds naming the ranks that did not
        arrive (asked through the watchdog); the communicator is unusable afterwards."""
        guard = self._guard
        deadline = time.monotonic() + timeout
        seq, slot = guard.begin("barrier", ())
        try:
            guard.agree_within("barrier", (), seq, deadline)
            request = self._comm.Ibarrier()
            wait_until(request.Test, deadline, lambda: guard._absent_error("barrier", seq))
        finally:
            guard.rec.end(slot)

    def barrier(self) -> None:
        """``Barrier`` on the backend's communicator (the watchdog ends a barrier that
        some rank never enters)."""
        if self._debug:
            self._agree("barrier", ())
        self._blocking("barrier", (), self._comm.Barrier)

    # --- point to point (arrays as bytes; headers in their own tag space) ------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """``Send`` of ``buf``'s bytes; returns once MPI may reuse ``buf``.

        Above MPI's eager limit that is when the matching receive has started, so
        two ranks sending large messages to each other first would deadlock.
        ``tag`` must be in ``0 .. TAG_UB // 2`` (objects use a disjoint tag space).
        """
        self._check_rank(dst, "send", "dst")
        data_tag, _ = split_tag(tag, self._tag_ub)
        if self._needs_host(buf):
            buf = host_copy(buf)
        guard = self._guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            self._comm.Send(buf.reshape(-1).view(BYTES), dst, data_tag)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "send")
        finally:
            guard.rec.end(slot)

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """``Recv`` of the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes``
                (a longer message is reported by MPI as truncated).
        """
        self._check_rank(src, "recv", "src")
        data_tag, _ = split_tag(tag, self._tag_ub)
        target = np.empty(buf.shape, buf.dtype) if self._needs_host(buf) else buf
        status = MPI.Status()
        what = f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}"
        guard = self._guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag),
                                       ("bytes", target.nbytes)))
        try:
            self._comm.Recv(target.reshape(-1).view(BYTES), src, data_tag, status)
        except MPI.Exception as exc:
            raise_mpi_error(exc, what)
        finally:
            guard.rec.end(slot)
        got = status.Get_count(MPI.BYTE)
        if got != target.nbytes:
            raise CollectiveMismatchError(
                f"{what}: the message has {got} bytes but the buffer holds {target.nbytes}; "
                "send and recv must use the same shape and dtype")
        if target is not buf:
            copy_back(buf, target)

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """mpi4py's pickled ``send`` of ``obj``, in a tag space apart from the arrays'."""
        self._check_rank(dst, "send_object", "dst")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self._guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag)))
        try:
            self._comm.send(obj, dst, header_tag)
        finally:
            guard.rec.end(slot)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag`` (mpi4py's pickled ``recv``)."""
        self._check_rank(src, "recv_object", "src")
        _, header_tag = split_tag(tag, self._tag_ub)
        guard = self._guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag)))
        try:
            return self._comm.recv(None, src, header_tag)
        finally:
            guard.rec.end(slot)

    # --- small objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (mpi4py's pickled ``allgather``)."""
        if self._debug:
            self._agree("allgather_object", ())
        result: list[Any] = self._blocking("allgather_object", (), self._comm.allgather, obj)
        return result

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (mpi4py's pickled ``bcast``: a copy, also on root)."""
        self._check_rank(root, "broadcast_object", "root")
        if self._debug:
            self._agree("broadcast_object", (("root", root),))
        return self._blocking("broadcast_object", (root,), self._comm.bcast, obj, root)

    def persistent_all_reduce(self, buf: Any, op: ReduceOp = ReduceOp.SUM, *,
                              piece_bytes: int | None = None) -> Backend.Persistent:
        """MPI-4 persistent ``Allreduce_init`` requests over pieces of ``buf`` (a
        :class:`~axondist.backends.base.PersistentAllReduce`), made once and started each step.

        No per-call allocation, so no page faults per start (an ``Iallreduce``
        allocates MPI's temporary buffers every call). The ranks check once,
        here, that they set up the same call; each start is numbered and
        recorded as an ``all_reduce`` (the watchdog names a rank that never
        starts a piece) and its Work honours ``wait(timeout)``. Pieces are of
        ``piece_bytes`` (default: the weighted sums' piece, ``chunk_bytes``
        unless ``AXONDIST_PIECE_MB`` asks for small ones that stay in cache
        between a caller's weighting and MPI's copy). Device buffers, debug mode
        and host staging take the default (a non-blocking all-reduce per start).
        """
        if type(buf) is not np.ndarray or self._slow:
            return super().persistent_all_reduce(buf, op, piece_bytes=piece_bytes)
        data, mtype, mop, average = self._reduction(buf, op, "all_reduce")
        flat, wire = buf.reshape(-1), data.reshape(-1)
        bounds = piece_bounds(flat.size, flat.itemsize, piece_bytes or self._piece())
        guard, comm = self._guard, self._comm
        self._blocking("all_reduce", (buf.dtype, buf.shape, op._name_, "persistent"),
                       lambda: None)
        try:
            requests = [comm.Allreduce_init(_IN_PLACE, [wire[lo:hi], mtype], mop)
                        for lo, hi in bounds]
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        keys = [(buf.dtype, (hi - lo,), op._name_, True) for lo, hi in bounds]

        def start(k: int) -> Work:
            request = requests[k]
            seq, slot = guard.begin("all_reduce", keys[k], blocking=False)
            try:
                request.Start()
            except MPI.Exception as exc:
                raise_mpi_error(exc, "all_reduce")
            finally:
                guard.rec.end(slot)

            def test() -> bool:  # not Testall: MPICH fails it on persistent collectives
                try:
                    return bool(request.Test())
                except MPI.Exception as exc:
                    raise_mpi_error(exc, "all_reduce")

            def block() -> None:
                try:
                    request.Wait()
                except MPI.Exception as exc:
                    raise_mpi_error(exc, "all_reduce")

            piece = flat[bounds[k][0]:bounds[k][1]]
            return Backend.Polled(test, block, piece, "all_reduce",
                                  (lambda: self._divide(piece)) if average else None,
                                  (guard.rec, guard.group, seq))

        def free() -> None:
            if not MPI.Is_finalized():
                for request in requests:
                    if request != MPI.REQUEST_NULL:
                        request.Free()

        handle = Backend.Persistent(buf, bounds, start, free)
        self._persistent.add(handle)
        return handle

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MPIBackend | None:
        """``Split`` of this communicator: members get keys in ``ranks`` order, others
        pass ``MPI.UNDEFINED`` (and get None)."""
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            self._check_rank(r, "new_group", "rank")
        if self._debug:
            self._agree("new_group", (("ranks", ranks),))
        # The members are part of the checked arguments: ranks that disagree raise
        # CollectiveMismatchError naming what each passed, before the Split.
        self._blocking("new_group", (ranks,), lambda: None)
        guard = self._guard
        name = f"{guard.group}.{guard.groups_made}"
        guard.groups_made += 1
        member = self.rank in ranks
        sub = self._comm.Split(0 if member else MPI.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        if not member:
            return None
        sub.Set_errhandler(MPI.ERRORS_RETURN)
        return MPIBackend(sub, self.options, recorder=guard.rec, group_name=name,
                          members=[guard.members[r] for r in ranks],
                          node_ids=[self._nodes[r] for r in ranks])

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from ``Split_type(COMM_TYPE_SHARED)``,
        computed when the backend was created."""
        return self._node

    def close(self) -> None:
        """Free the communicator (collective: call it on every rank).

        Idempotent, and a no-op once MPI is finalized.
        """
        comm, self._comm, self._host_twin = self._comm, None, None
        if comm is not None and not MPI.Is_finalized() and comm != MPI.COMM_NULL:
            self._guard.rec.groups.pop(self._guard.group, None)
            self._guard.rec.groups.pop(self._guard.p2p_group, None)
            for handle in list(self._persistent):
                handle.free()  # collective, as close() is: every rank holds the same ones
            self._guard.close()
            comm.Free()


# --- the job: factory and abort-on-failure -------------------------------------------------

_HOOK_INSTALLED = False


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank end the whole MPI job.

    The hook prints the traceback with each line prefixed by
    ``[axondist rank R/N]`` to stderr, then calls ``COMM_WORLD.Abort(1)`` (on a
    one-rank job it defers to the previous hook). Installed once per process.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _load_mpi()
    previous = sys.excepthook

    def abort_job(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        silence_all()  # this rank fails: its peers must not read its exit as a departure
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if size == 1:
            previous(exc_type, exc, tb)
            return
        prefix = f"[axondist rank {rank}/{size}] "
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        text += f"rank {rank} failed: aborting the MPI job so the other ranks do not wait forever\n"
        sys.stderr.write("".join(prefix + line for line in text.splitlines(True)))
        sys.stderr.flush()
        world.Abort(1)

    sys.excepthook = abort_job
    _HOOK_INSTALLED = True


def _node_info(node_ids: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(node id, local rank, local size) of ``rank`` from every rank's node id; nodes are
    numbered by their first rank, so every rank agrees."""
    order = list(dict.fromkeys(node_ids))
    mine = node_ids[rank]
    local = [r for r, n in enumerate(node_ids) if n == mine]
    return order.index(mine), local.index(rank), len(local)


def create_world_backend(*, comm: Any = None, abort_on_exception: bool = True,
                         timeout: float | None = None, **options: Any) -> MPIBackend:
    """This process's endpoint in the world of the MPI job (``axondist.init("mpi")``).

    Also starts the rank's watchdog (for more than one rank): a call that
    waits past ``timeout`` seconds, or for a rank that left, ends the job on
    every rank with one message naming the ranks and what each was doing.

    Args:
        comm: the mpi4py communicator whose ranks form the world
            (``MPI.COMM_WORLD`` when None); axondist communicates on a
            duplicate of it, never on it.
        abort_on_exception: install :func:`install_abort_hook`.
        timeout: seconds a call may wait for its peers (``AXONDIST_TIMEOUT``,
            default 600); stall warnings start at ``AXONDIST_STALL_WARNING``
            (default 60, at most half the timeout).
        **options: fields of :class:`MPIOptions` (``chunk_bytes``,
            ``host_staging``, ``debug``, ``checks``), overriding the environment.

    Raises:
        BackendUnavailableError: mpi4py or the MPI library is missing.
        TypeError: an unknown option.
        ValueError: a timeout that is not a finite number > 0, or ranks started
            with different settings.
    """
    _load_mpi()
    policy = MPIOptions.from_env(**options)
    wait = default_timeout() if timeout is None else positive_seconds(timeout, "init")
    if abort_on_exception:
        install_abort_hook()
    base = MPI.COMM_WORLD if comm is None else comm
    dup = base.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = dup.Get_rank(), dup.Get_size()
    recorder = FlightRecorder(rank, size, MPI.Get_processor_name())
    watchdog = None
    if size > 1:
        watchdog = Watchdog(recorder, timeout=wait, stall=stall_warning_after(wait),
                            abort=_abort_job, token=dup.bcast(secrets.token_hex(16), root=0))
    settings = (policy.checks, policy.debug, policy.chunk_bytes, policy.piece_bytes, wait)
    table = dup.allgather((settings, watchdog.address if watchdog else None))
    if any(t[0] != settings for t in table):
        detail = ", ".join(f"rank {k}: checks={t[0][0]}, debug={t[0][1]}, chunk_bytes={t[0][2]}, "
                           f"piece_bytes={t[0][3]}, timeout={t[0][4]:g}"
                           for k, t in enumerate(table))
        dup.Free()
        raise ValueError("init: the ranks were started with different axondist settings "
                         f"({detail}); set AXONDIST_CHECKS, AXONDIST_DEBUG, "
                         "AXONDIST_MPI_CHUNK_BYTES, AXONDIST_PIECE_MB and AXONDIST_TIMEOUT alike "
                         "on every rank")
    if watchdog is not None:
        watchdog.start([t[1] for t in table])
    backend = MPIBackend(dup, policy, recorder=recorder)
    backend.watchdog = watchdog
    return backend


def _abort_job(message: str) -> None:
    """Print ``message`` on this rank and end the job on every rank (the watchdog's end)."""
    silence_all()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    print_and_flush(f"[axondist rank {rank}/{size}] ", message)
    exit_soon(1, 5.0)  # should MPI_Abort itself hang (a launcher cut off from this host)
    world.Abort(1)


__all__ = ["MPIBackend", "MPIOptions", "MPIWork", "create_world_backend", "install_abort_hook"]
