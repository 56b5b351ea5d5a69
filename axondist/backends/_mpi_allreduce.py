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
from ._mpi_guard import RING_DTYPES, RING_TAG, Rider
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

#: Elements a weighted ring scales and adds at a time (each part still in cache).
_CACHED = 1 << 16
#: The persistent rings' tags on the private communicator: piece ``u`` (numbered over the
#: backend's lifetime) sends with ``_PERSISTENT_TAG + u % _PERSISTENT_TAGS``, so pieces in
#: flight at once never take each other's messages.
_PERSISTENT_TAG = RING_TAG + 8
_PERSISTENT_TAGS = 1 << 14
#: The blocking weighted ring's tag for the weights the ranks hand their right neighbours.
_WEIGHT_TAG = RING_TAG + 2


def weigh_and_add(mine: Any, got: Any, weight: float, got_weight: float, xp: Any = np) -> None:
    """``mine = mine * weight + got * got_weight`` in place (``got`` is scratch and is
    scaled in place too), in parts of ``_CACHED`` elements so each part is scaled and
    added while it is in cache: one pass over memory. A weight of 1 is skipped (exact).
    Each product is rounded to the arrays' dtype, as a sender weighting its own values
    before sending them would round them, so the ring's bits do not depend on which
    rank applies a weight."""
    if weight == 1.0 and got_weight == 1.0:
        xp.add(mine, got, out=mine)
        return
    for lo in range(0, mine.shape[0], _CACHED):
        part, arrived = mine[lo:lo + _CACHED], got[lo:lo + _CACHED]
        if weight != 1.0:
            xp.multiply(part, weight, out=part, casting="unsafe")
        if got_weight != 1.0:
            xp.multiply(arrived, got_weight, out=arrived, casting="unsafe")
        xp.add(part, arrived, out=part)


class ScratchPool:
    """Scratch buffers that :class:`PersistentRing` steps borrow, each for one step: the
    partial sum arriving from the left lands in one, is added, and the buffer goes back.
    A buffer given back is the next one taken (still in cache), and there are only as
    many as steps were ever in flight at once (a bigger one replaces a free one too
    small), instead of one per piece. Buffers are written once when made (no page faults
    in later steps)."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: list[Any] = []

    def take(self, nbytes: int) -> Any:
        """A byte buffer of at least ``nbytes`` (the most recently given back that fits)."""
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            if free[i].nbytes >= nbytes:
                return free.pop(i)
        if free:
            free.pop()  # too small: replaced by the bigger one made here
        buf = np.empty(nbytes, np.uint8)
        buf[...] = 0
        return buf

    def give(self, buf: Any) -> None:
        """Return a buffer :meth:`take` handed out."""
        self._free.append(buf)

    def __len__(self) -> int:
        return len(self._free)


class PersistentRing:
    """One piece of a persistent SUM all-reduce as a ring of point-to-point requests made
    once (``Send_init`` per step, ``Recv_init`` for the all-gather's): n - 1 reduce-scatter
    steps, each adding the partial sum that arrives from the left into this rank's copy of
    a block, then n - 1 all-gather steps handing the finished blocks round, as the blocking
    ring of :meth:`AllReduceMixin._ring_mean` does (over the same piece the same blocks, so
    the same bits as the blocking weighted sum). :meth:`start` takes this rank's weight:
    each rank's values are weighted as they join the ring, in cache, while the partial sum
    that arrives is added (the first step's block, which left its rank unweighted, with the
    weight that travels with it), so weighting costs no pass of its own. A reduce-scatter
    step receives into a buffer borrowed from ``pool`` for that step only (an ``Irecv``), so
    rings share a few buffers that stay in cache. A step starts when the previous one
    completed on this rank; :meth:`test` and :meth:`block` move it on, so the ring advances
    only while its caller tests or waits.

    Args:
        comm: the group's private communicator.
        flat: the piece, flat, in its dtype (the sums are formed on it).
        wire: the same memory as MPI moves it (``flat`` or a view of it).
        mtype: the MPI datatype of ``wire``'s elements.
        rank: this rank in ``comm``.
        size: ``comm``'s size (> 1).
        tag: the tag every message of this piece carries.
        pool: where reduce-scatter steps borrow their receive buffers.
    """

    __slots__ = ("_steps", "_weighing", "_weights", "_weight", "_live", "_got", "_comm",
                 "_left", "_tag", "_mtype", "_dtype", "_wire_dtype", "_pool", "step", "_mpi")

    def __init__(self, comm: Any, flat: Any, wire: Any, mtype: Any, rank: int, size: int,
                 tag: int, pool: ScratchPool) -> None:
        counts = block_counts(flat.size, size)
        blocks = [slice(lo, lo + c) for lo, c in zip(displacements(counts), counts)]
        right, left = (rank + 1) % size, (rank - 1) % size
        self._comm, self._left, self._tag, self._mtype = comm, left, tag, mtype
        self._dtype, self._wire_dtype, self._pool = flat.dtype, wire.dtype, pool
        #: this rank's weight (sent right at each start) and the left neighbour's
        self._weights = np.zeros(2, np.float64)
        self._weight = 1.0
        # The weights' messages start before step 0's data: same tag, same pair of ranks,
        # so MPI matches them first (messages do not overtake).
        self._weighing = [comm.Recv_init([self._weights[1:], MPI.DOUBLE], left, tag),
                          comm.Send_init([self._weights[:1], MPI.DOUBLE], right, tag)]
        #: per step: its persistent requests, and for a reduce-scatter step the block the
        #: arriving partial sum is added into (None for an all-gather step)
        self._steps: list[tuple[list[Any], Any]] = []
        for step in range(size - 1):  # reduce-scatter: block (rank - step - 1) grows
            out, into = blocks[(rank - step) % size], blocks[(rank - step - 1) % size]
            self._steps.append(([comm.Send_init([wire[out], mtype], right, tag)], flat[into]))
        for step in range(size - 1):  # all-gather: pass the finished blocks on
            out, into = blocks[(rank + 1 - step) % size], blocks[(rank - step) % size]
            self._steps.append(([comm.Recv_init([wire[into], mtype], left, tag),
                                 comm.Send_init([wire[out], mtype], right, tag)], None))
        #: the requests of the step in flight
        self._live: list[Any] = []
        #: the borrowed buffer the step in flight receives into (None: none borrowed)
        self._got: Any = None
        #: the step in flight; ``len(steps)`` when idle or done
        self.step = len(self._steps)
        self._mpi = MPI

    def start(self, weight: float = 1.0) -> None:
        """Start the first step (the piece must be complete by now; its values are
        multiplied by ``weight`` as they join the ring, rounded to the piece's dtype)."""
        self.step = 0
        self._weight = weight = float(weight)
        self._weights[0] = weight
        self._mpi.Prequest.Startall(self._weighing)  # the weights first
        self._start_step(self._weighing)

    def _start_step(self, also: list[Any]) -> None:
        """Start step ``self.step`` (``also``: requests already started that it waits for)."""
        requests, mine = self._steps[self.step]
        live = list(also)
        if mine is not None:  # receive the partial sum into a borrowed buffer
            got = self._got = self._pool.take(mine.shape[0] * self._dtype.itemsize)
            wire = got[:mine.shape[0] * self._dtype.itemsize].view(self._wire_dtype)
            live.append(self._comm.Irecv([wire, self._mtype], self._left, self._tag))
        self._mpi.Prequest.Startall(requests)
        self._live = live + requests

    def test(self) -> bool:
        """Move the ring on without blocking; whether it finished."""
        testall = self._mpi.Request.Testall
        while self.step < len(self._steps):
            if not testall(self._live):
                return False
            self._next()
        return True

    def block(self) -> None:
        """Wait for the ring to finish."""
        waitall = self._mpi.Request.Waitall
        while self.step < len(self._steps):
            waitall(self._live)
            self._next()

    def _next(self) -> None:
        """The step in flight completed: add what arrived (reduce-scatter), start the next."""
        mine = self._steps[self.step][1]
        if mine is not None:  # the first step's block left its rank unweighted
            got = self._got
            self._got = None
            count = mine.shape[0]
            weigh_and_add(mine, got[:count * self._dtype.itemsize].view(self._dtype),
                          self._weight, float(self._weights[1]) if self.step == 0 else 1.0)
            self._pool.give(got)
        self.step += 1
        self._live = []
        if self.step < len(self._steps):
            self._start_step([])

    def free(self) -> None:
        """Release the requests (the ring must not be in flight)."""
        for request in self._weighing + [r for requests, _ in self._steps for r in requests]:
            if request != self._mpi.REQUEST_NULL:
                request.Free()


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
        """MPI-4 persistent ``Allreduce_init`` requests over pieces of ``buf`` (a
        :class:`~axondist.backends.base.PersistentAllReduce` that fuses the weight of
        ``start(k, weight)``), made once and started each step.

        No per-call allocation, so no page faults per start (an ``Iallreduce``
        allocates MPI's temporary buffers every call). The ranks check once,
        here, that they set up the same call; each start is numbered and
        recorded as an ``all_reduce`` (the watchdog names a rank that never
        starts a piece) and its Work honours ``wait(timeout)``. Pieces are of
        ``piece_bytes`` (default: the weighted sums' piece, ``chunk_bytes``
        unless ``AXONDIST_PIECE_MB`` asks for small ones), on one host at most
        ``chunk_bytes``, the blocking weighted sum's pieces: the same blocks and bits,
        and blocks that stay in cache while they are weighted and added (two ranks,
        95 MiB, compute 0: 4 MiB pieces took 1.3x the blocking sum, 2 MiB ones 1.13x).
        A SUM piece above ``MEAN_IN_BLOCKS_BYTES`` in a dtype the rings add is a
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
        if self._blocking_rings:  # one host: the blocking weighted sum's pieces at most
            piece = min(piece, self._chunk)
        bounds = piece_bounds(flat.size, flat.itemsize, piece)
        guard, comm = self._guard, self._comm
        self._blocking("all_reduce", (buf.dtype, buf.shape, op._name_, "persistent"),
                       lambda: None)
        requests: list[Any] = []
        try:
            for lo, hi in bounds:
                if self._rings_piece(flat, op, average, hi - lo):
                    requests.append(self._persistent_ring(flat[lo:hi], wire[lo:hi], mtype))
                else:
                    requests.append(comm.Allreduce_init(_IN_PLACE, [wire[lo:hi], mtype], mop))
        except MPI.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        keys = [(buf.dtype, (hi - lo,), op._name_, True) for lo, hi in bounds]

        def start(k: int, weight: float) -> Work:
            request = requests[k]
            ring = isinstance(request, PersistentRing)
            if weight != 1.0 and not ring:  # a ring weights its values as they join it
                part = flat[bounds[k][0]:bounds[k][1]]
                np.multiply(part, weight, out=part, casting="unsafe")
            seq, slot = guard.begin("all_reduce", keys[k], blocking=False)
            try:
                if ring:
                    request.start(weight)
                else:
                    request.Start()
            except MPI.Exception as exc:
                raise_mpi_error(exc, "all_reduce")
            finally:
                guard.rec.end(slot)
            # Not Testall on the collective's request: MPICH fails it on persistent ones.
            poll, finish = (request.test, request.block) if ring else (request.Test,
                                                                     request.Wait)

            def test() -> bool:
                try:
                    return bool(poll())
                except MPI.Exception as exc:
                    raise_mpi_error(exc, "all_reduce")

            def block() -> None:
                try:
                    finish()
                except MPI.Exception as exc:
                    raise_mpi_error(exc, "all_reduce")

            piece = flat[bounds[k][0]:bounds[k][1]]
            return Backend.Polled(test, block, piece, "all_reduce",
                                  (lambda: self._divide(piece)) if average else None,
                                  (guard.rec, guard.group, seq))

        def free() -> None:
            if not MPI.Is_finalized():
                for request in requests:
                    if isinstance(request, PersistentRing):
                        request.free()
                    elif request != MPI.REQUEST_NULL:
                        request.Free()

        handle = Backend.Persistent(buf, bounds, start, free, fuses_weight=True)
        self._persistent.add(handle)
        return handle

    def _rings_piece(self, flat: Any, op: ReduceOp, average: bool, count: int) -> bool:
        """Whether a persistent all-reduce's piece of ``count`` elements of ``flat`` runs as
        a :class:`PersistentRing`: a SUM over several ranks in a dtype the rings add, above
        ``MEAN_IN_BLOCKS_BYTES`` (where the blocking weighted sum rings too). Decided from
        the call's arguments alone, so every rank decides alike."""
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
