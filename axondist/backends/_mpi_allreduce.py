"""The MPI backend's all-reduces: the blocking call (its check riding in the data of a
small one), pieces of big ones, means as reduce-scatter, scaled block and all-gather,
weighted sums (DDP's gradient buckets), and persistent all-reduces (MPI-4 requests, or
rings of persistent point-to-point requests for big pieces).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _array
from ..ops import ReduceOp
from ._mpi_carriers import Rider
from ._mpi_common import (
    MEAN_IN_BLOCKS_BYTES,
    MPIWork,
    block_counts,
    displacements,
    mean_scaling,
    piece_bounds,
    raise_mpi_error,
    unsupported,
)
from ._mpi_core import MPIBackendBase, bind_mpi
from ._mpi_guard import RING_DTYPES, RING_TAG
from ._mpi_rings import _CACHED, PersistentRing, ScratchPool, weigh_and_add  # noqa: F401 (tests)
from .base import (
    Backend,
    CompletedWork,
    Signature,
    Work,
)

# Bound when mpi4py loads (_mpi_core.bind_mpi): module globals keep the hot path to plain
# lookups.
MPI: Any = None
_IN_PLACE: Any = None
bind_mpi(globals())

#: The persistent rings' tags on the private communicator: piece ``u`` (numbered over the
#: backend's lifetime) sends with ``_PERSISTENT_TAG + u % _PERSISTENT_TAGS``, so pieces in
#: flight at once never take each other's messages.
_PERSISTENT_TAG = RING_TAG + 8
_PERSISTENT_TAGS = 1 << 14
#: The blocking weighted ring's tag for the weights the ranks hand their right neighbours.
_WEIGHT_TAG = RING_TAG + 2


class AllReduceMixin(MPIBackendBase):
    """The all-reduce collectives of :class:`~axondist.backends.mpi.MPIBackend`."""

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

    def _all_reduce_now(self, buf: Any, op: ReduceOp) -> None:
        """The MPI calls of a blocking all-reduce (no check, no record)."""
        plan = self._plans_by_name[op._name_].get(buf.dtype)
        if plan is None:
            raise unsupported("all_reduce", buf.dtype, op)
        view, mtype, mop, average = plan
        data = buf if view is None else buf.view(view)
        if (average and data.nbytes > MEAN_IN_BLOCKS_BYTES and self.world_size > 1
                and self._blocking_rings):
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
        the pieces are small). Above ``MEAN_IN_BLOCKS_BYTES`` (and ``chunk_bytes``
        pieces) the weighted ring of :meth:`_ring_mean` instead, where the dtype allows:
        the weighting then rides in the ring's own passes."""
        flat, wire = buf.reshape(-1), data.reshape(-1)
        comm, scale = self._comm, factor != 1.0
        ring = self._guard.private
        try:
            if (ring is not None and self._blocking_rings and flat.dtype in RING_DTYPES
                    and self._piece() >= self._chunk
                    and flat.size * flat.itemsize > MEAN_IN_BLOCKS_BYTES):
                left = self._left_weight(ring, factor)
                for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk):
                    self._ring_mean(ring, flat[lo:hi], wire[lo:hi], mtype, factor, left)
                return
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._piece()):
                if scale:
                    piece = flat[lo:hi]
                    np.multiply(piece, factor, out=piece, casting="unsafe")
                comm.Allreduce(_IN_PLACE, [wire[lo:hi], mtype], mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _mean_in_blocks(self, buf: Any, data: Any, mtype: Any, mop: Any) -> None:
        """Blocking AVERAGE of a big buffer as a ring over point-to-point messages (on the
        group's private communicator): n - 1 steps of a reduce-scatter, each rank adding
        the block it receives from its left neighbour into its own copy, leave every
        rank the whole sum of one block; it scales that block by 1/n (see
        :func:`mean_scaling`: 1/n of the data, while it is still in cache) and n - 1
        steps of an all-gather hand the blocks round. Every block is summed and scaled
        on one rank only, so all ranks get the same bits, and the scaling costs no pass
        of its own over the data: the mean costs what MPI's own sum does
        (``docs/backends.md`` has the measurements). Without a private communicator
        (one rank) the sum is the mean."""
        comm = self._guard.private
        if comm is None:
            return
        flat, wire = buf.reshape(-1), data.reshape(-1)
        try:
            for lo, hi in piece_bounds(flat.size, flat.itemsize, self._chunk):
                self._ring_mean(comm, flat[lo:hi], wire[lo:hi], mtype)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _left_weight(self, comm: Any, weight: float) -> float:
        """Hand ``weight`` to the right neighbour on ``comm``; the left neighbour's."""
        mine, left = np.array([weight], np.float64), np.zeros(1, np.float64)
        comm.Sendrecv([mine, MPI.DOUBLE], (self.rank + 1) % self.world_size, _WEIGHT_TAG,
                      [left, MPI.DOUBLE], (self.rank - 1) % self.world_size, _WEIGHT_TAG)
        return float(left[0])

    def _ring_mean(self, comm: Any, flat: Any, wire: Any, mtype: Any,
                   weight: float | None = None, left_weight: float = 1.0) -> None:
        """One piece of :meth:`_mean_in_blocks` (``flat`` in its dtype, ``wire`` the same
        memory as MPI moves it), or with ``weight`` one of a weighted sum's: each rank's
        values are multiplied by its weight as they join the ring, in cache-sized parts
        just before the partial sum that arrives is added (:func:`weigh_and_add`; the
        first step's block leaves its rank unweighted and its receiver multiplies it by
        ``left_weight``, the sender's weight), and nothing is scaled at the end."""
        n, rank = self.world_size, self.rank
        counts = block_counts(flat.size, n)
        starts = displacements(counts)
        blocks = [slice(lo, lo + c) for lo, c in zip(starts, counts)]
        xp = _array.namespace(flat)
        received = self._scratch(xp, max(counts), flat.dtype)
        wire_received = received if received.dtype == wire.dtype else received.view(wire.dtype)
        right, left = (rank + 1) % n, (rank - 1) % n
        weight_here = 1.0 if weight is None else float(weight)
        for step in range(n - 1):  # reduce-scatter: block (rank - step - 1) grows
            out, into = blocks[(rank - step) % n], blocks[(rank - step - 1) % n]
            size = into.stop - into.start
            comm.Sendrecv([wire[out], mtype], right, RING_TAG,
                          [wire_received[:size], mtype], left, RING_TAG)
            weigh_and_add(flat[into], received[:size], weight_here,
                          float(left_weight) if step == 0 else 1.0, xp)
        if weight is None:
            own = flat[blocks[(rank + 1) % n]]
            how, by = mean_scaling(n)
            getattr(xp, how)(own, by, out=own, casting="unsafe")
        for step in range(n - 1):  # all-gather: pass the finished blocks on
            out, into = blocks[(rank + 1 - step) % n], blocks[(rank - step) % n]
            comm.Sendrecv([wire[out], mtype], right, RING_TAG + 1,
                          [wire[into], mtype], left, RING_TAG + 1)

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

    def persistent_all_reduce(self, buf: Any, op: ReduceOp = ReduceOp.SUM, *,
                              piece_bytes: int | None = None) -> Backend.Persistent:
        """MPI-4 persistent ``Allreduce_init`` requests over pieces of ``buf``, or rings of
        persistent point-to-point requests (a
        :class:`~axondist.backends.base.PersistentAllReduce` that fuses the weight of
        ``start(k, weight)``), made once and started each step.

        No per-call allocation, so no page faults per start (an ``Iallreduce``
        allocates MPI's temporary buffers every call). The ranks check once,
        here, that they set up the same call; each start is numbered and
        recorded as an ``all_reduce`` (the watchdog names a rank that never
        starts a piece) and its Work honours ``wait(timeout)``. Pieces are of
        ``piece_bytes`` (default: the weighted sums' piece, ``chunk_bytes``
        unless ``AXONDIST_PIECE_MB`` asks for small ones), on one host at most
        ``chunk_bytes``, the blocking weighted sum's pieces, ringed wherever it rings them:
        the same blocks and bits, and blocks that stay in cache while they are weighted and
        added (two ranks, 95 MiB, compute 0: pieces of two such blocks moved by one ring
        took 1.2-1.35x the blocking sum, single blocks 1.08-1.25x). A SUM piece ringed
        (above ``MEAN_IN_BLOCKS_BYTES``, in a dtype the rings add) is a
        :class:`PersistentRing` on the private communicator (no MPI temporaries: its
        receive buffers are borrowed step by step from the backend's
        :class:`ScratchPool`); smaller ones are ``Allreduce_init`` requests. Device
        buffers, debug mode and host staging take the default (a non-blocking
        all-reduce per start).
        """
        if type(buf) is not np.ndarray or self._slow:
            return super().persistent_all_reduce(buf, op, piece_bytes=piece_bytes)
        data, mtype, mop, average = self._reduction(buf, op, "all_reduce")
        flat, wire = buf.reshape(-1), data.reshape(-1)
        piece = piece_bytes or self._piece()
        # One host: the blocking weighted sum's pieces at most (bigger pieces, several of
        # its pieces per ring, measured slower at compute 0: later starts, more in flight),
        # ringed wherever that sum rings them, so the same blocks and bits.
        like_blocking = bool(self._blocking_rings and self._chunk and piece >= self._chunk)
        if self._blocking_rings and self._chunk:
            piece = min(piece, self._chunk)
        bounds = piece_bounds(flat.size, flat.itemsize, piece)
        self._blocking("all_reduce", (buf.dtype, buf.shape, op._name_, "persistent"),
                       lambda: None)
        pieces: list[_PersistentPiece] = []
        try:
            for lo, hi in bounds:
                count = flat.size if like_blocking else hi - lo
                if self._rings_piece(flat, op, average, count):
                    request: Any = self._persistent_ring(flat[lo:hi], wire[lo:hi], mtype)
                else:
                    request = _CollectiveRequest(self._comm.Allreduce_init(
                        _IN_PLACE, [wire[lo:hi], mtype], mop))
                pieces.append(_PersistentPiece(self, request, flat[lo:hi], op, average))
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

        def start(k: int, weight: float, same_weight: bool) -> Work:
            return pieces[k].start(weight, same_weight)

        def free() -> None:
            if not MPI.Is_finalized():
                for one in pieces:
                    one.request.free()

        handle = Backend.Persistent(buf, bounds, start, free, fuses_weight=True)
        self._persistent.add(handle)
        return handle

    def _rings_piece(self, flat: Any, op: ReduceOp, average: bool, count: int) -> bool:
        """Whether a persistent all-reduce's piece of ``flat`` runs as a
        :class:`PersistentRing`: a SUM over several ranks in a dtype the rings add, where
        ``count`` elements exceed ``MEAN_IN_BLOCKS_BYTES`` (``count``: the piece's, or,
        for the blocking weighted sum's own pieces, the whole buffer's, as that sum decides
        for all its pieces at once). Decided from the call's arguments alone, so every
        rank decides alike."""
        return (op._name_ == "SUM" and not average and self._guard.private is not None
                and flat.dtype in RING_DTYPES
                and count * flat.itemsize > MEAN_IN_BLOCKS_BYTES)

    def _persistent_ring(self, flat: Any, wire: Any, mtype: Any) -> PersistentRing:
        """A :class:`PersistentRing` over ``flat`` with the next piece tag."""
        uid = self._ring_pieces
        self._ring_pieces = uid + 1
        if self._ring_scratch is None:
            self._ring_scratch = ScratchPool()
        return PersistentRing(self._guard.private, flat, wire, mtype, self.rank,
                              self.world_size, _PERSISTENT_TAG + uid % _PERSISTENT_TAGS,
                              self._ring_scratch)

    #: Persistent rings made so far by this backend (their tags follow it); the same count
    #: on every rank, as the rings are made collectively.
    _ring_pieces = 0
    #: The receive buffers this backend's persistent rings borrow step by step.
    _ring_scratch: ScratchPool | None = None


class _CollectiveRequest:
    """An ``Allreduce_init`` request with a ring's interface (``start``, ``test``,
    ``block``, ``free``): a piece too small for a ring. ``start`` multiplies the piece by
    the weight first (a ring weights its values as they join it)."""

    __slots__ = ("_request", "piece")

    def __init__(self, request: Any) -> None:
        self._request = request
        self.piece: Any = None

    def start(self, weight: float = 1.0, left_weight: float | None = None) -> None:
        if weight != 1.0:
            np.multiply(self.piece, weight, out=self.piece, casting="unsafe")
        try:
            self._request.Start()
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def test(self) -> bool:
        # Not Testall on the collective's request: MPICH fails it on persistent ones.
        try:
            return bool(self._request.Test())
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def block(self) -> None:
        try:
            self._request.Wait()
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def free(self) -> None:
        if self._request != MPI.REQUEST_NULL:
            self._request.Free()


class _PersistentPiece:
    """One piece of an MPI persistent all-reduce: its ring (or collective request), the
    piece's memory and the call's record key, made once; :meth:`start` numbers and
    records the start, starts the request with the weight and returns a polled Work whose
    test and wait move the request on."""

    __slots__ = ("request", "_piece", "_key", "_guard", "_finish", "_test", "_block")

    def __init__(self, backend: Any, request: Any, piece: Any, op: ReduceOp,
                 average: bool) -> None:
        self.request = request
        if isinstance(request, _CollectiveRequest):
            request.piece = piece
        self._piece = piece
        self._key = (piece.dtype, (piece.size,), op._name_, True)
        self._guard = backend._guard
        self._finish = (lambda: backend._divide(piece)) if average else None
        self._test, self._block = request.test, request.block

    def start(self, weight: float, same_weight: bool) -> Work:
        guard = self._guard
        seq, slot = guard.begin("all_reduce", self._key, blocking=False)
        try:
            self.request.start(weight, weight if same_weight else None)
        finally:
            guard.rec.end(slot)
        return Backend.Polled(self._test, self._block, self._piece, "all_reduce",
                              self._finish, (guard.rec, guard.group, seq))
