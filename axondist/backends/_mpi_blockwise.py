"""The MPI backend's broadcast and reduce-scatter (its all-gathers are in
``_mpi_gather``): blocking calls checked (their data carried with the check in a two-rank
group, up to ``RIDE_MAX_BYTES``), non-blocking ones in pieces or checked in ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _array
from ..errors import InvalidBufferError
from ..ops import ReduceOp
from ._mpi_carriers import PairMove
from ._mpi_common import (
    MEAN_IN_BLOCKS_BYTES,
    MPIWork,
    displacements,
    mean_scaling,
    piece_bounds,
    raise_mpi_error,
    unsupported,
)
from ._mpi_core import MPIBackendBase, bind_mpi
from ._mpi_guard import RING_DTYPES, RING_TAG, UFUNCS, UNPLANNED
from .base import (
    CompletedWork,
    Signature,
    Work,
)

# Bound when mpi4py loads (_mpi_core.bind_mpi): module globals keep the hot path to plain
# lookups.
MPI: Any = None
_IN_PLACE: Any = None
bind_mpi(globals())


_NDARRAY = np.ndarray


class BlockwiseMixin(MPIBackendBase):
    """Broadcast and reduce-scatter of :class:`~axondist.backends.mpi.MPIBackend`."""

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
                carrier = guard.carriers.get(("broadcast", key), UNPLANNED)
                if carrier is UNPLANNED:
                    carrier = self._plan_broadcast(key, buf, root)
                if carrier is None:
                    guard.agree("broadcast", key)
                elif carrier.__class__ is PairMove:  # too big to ride: point to point
                    data = [buf if carrier.view is None else buf.view(carrier.view),
                            carrier.mtype]
                    if carrier.keep:
                        guard.move(carrier, "broadcast", key, data, None)
                    else:
                        guard.move(carrier, "broadcast", key, None, data)
                    return
                elif buf.__class__ is _NDARRAY or isinstance(buf, np.ndarray):
                    if carrier.keep:  # the root's data travels
                        carrier.mine[...] = buf
                        guard.carry(carrier, "broadcast", key)
                    else:
                        guard.carry(carrier, "broadcast", key)
                        buf[...] = carrier.theirs
                    return
                else:
                    guard.agree("broadcast", key, riding=False)
            self._broadcast_now(buf, root)
        finally:
            rec.end_blocking(slot, group, seq)

    def _plan_broadcast(self, key: tuple[Any, ...], buf: Any, root: int) -> Any:
        """Broadcast ``key``'s :class:`Carrier` (its ``keep`` true on the root), its
        :class:`PairMove` where the data is too big to ride, or None where neither
        applies (not two ranks, past chunk_bytes); kept by the guard."""
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
        shapes = (buf.shape, (0,)) if self.rank == root else ((0,), buf.shape)
        guard = self._guard
        carrier: Any = guard.carrier("broadcast", key, buf.nbytes, buf.dtype, *shapes)
        if carrier is None and guard.moves_data(buf.nbytes, self._chunk):
            plan = self._transfer_plans.get(buf.dtype)
            if plan is None:
                raise unsupported("broadcast", buf.dtype)
            carrier = guard.pair_move("broadcast", key, *plan)
        if carrier is not None:
            carrier.keep = self.rank == root
        return carrier

    def _broadcast_now(self, buf: Any, root: int) -> None:
        if not 0 <= root < self.world_size:
            self._check_rank(root, "broadcast", "root")
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
                rider = guard.carriers.get(("reduce_scatter", key), UNPLANNED)
                if rider is UNPLANNED:
                    rider = self._plan_reduce_scatter(key, send, counts)
                if rider is None:
                    guard.agree("reduce_scatter", key)
                elif send.__class__ is recv.__class__ is _NDARRAY or (
                        isinstance(send, np.ndarray) and isinstance(recv, np.ndarray)):
                    flat = send if send.ndim == 1 else send.reshape(-1)
                    rider.mine[...] = flat[rider.give]
                    guard.carry(rider, "reduce_scatter", key)
                    out = recv if recv.ndim == 1 else recv.reshape(-1)
                    rider.ufunc(flat[rider.keep], rider.theirs, out=out)
                    if rider.scale is not None:
                        rider.scale(out, rider.by, out=out, casting="unsafe")
                    return
                else:
                    guard.agree("reduce_scatter", key, riding=False)
            self._reduce_scatter_now(send, recv, counts, op)
        finally:
            rec.end_blocking(slot, group, seq)

    def _plan_reduce_scatter(self, key: tuple[Any, ...], send: Any, counts: list[int]) -> Any:
        """Reduce-scatter ``key``'s :class:`Rider` (``keep`` and ``give`` the slices of the
        flat input for this rank's block and the other's), or None where the data cannot
        ride; kept by the guard."""
        rank, first = self.rank, counts[0]
        pair = self.world_size == 2  # (the guard gives None in other groups)
        rider = self._guard.carrier("reduce_scatter", key, sum(counts) * send.dtype.itemsize,
                                    send.dtype, (counts[1 - rank] if pair else 0,),
                                    (counts[rank],), key[2])
        if rider is not None:
            rider.keep, rider.give = ((slice(0, first), slice(first, None)) if rank == 0
                                      else (slice(first, None), slice(0, first)))
        return rider

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
        if (send.dtype in RING_DTYPES and op._name_ in UFUNCS and self._blocking_rings
                and self._guard.private is not None
                and send.size * send.dtype.itemsize > MEAN_IN_BLOCKS_BYTES):
            try:
                self._ring_reduce_scatter(send, recv, counts, mtype, op._name_)
            except MPI.Exception as exc:
                raise_mpi_error(exc, "reduce_scatter")
            return
        try:
            if counts.count(counts[0]) == len(counts):
                self._comm.Reduce_scatter_block([s, mtype], [r, mtype], mop)
            else:
                self._comm.Reduce_scatter([s, mtype], [r, mtype], counts, mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "reduce_scatter")
        if average:
            self._divide(recv)

    def _ring_reduce_scatter(self, send: Any, recv: Any, counts: list[int], mtype: Any,
                             op_name: str) -> None:
        """A big blocking reduce-scatter as a ring over point-to-point messages on the
        group's private communicator: in n - 1 steps each rank combines the partial
        result it receives from its left neighbour with its own block and passes it on,
        the last step landing its own block in ``recv``; AVERAGE then scales that block
        (1/n of the data). ``send`` is left as it was. Chosen from the call's dtype, op
        and size alone, so every rank takes the same path; MPICH's
        ``Reduce_scatter_block`` took 1.35x as long for two ranks at 16 MiB."""
        comm, n, rank = self._guard.private, self.world_size, self.rank
        assert comm is not None  # the caller checked: a group of one has no ring
        xp = _array.namespace(send)
        combine = getattr(xp, UFUNCS[op_name].__name__)
        flat, out = send.reshape(-1), recv.reshape(-1)
        starts = displacements(counts)
        blocks = [slice(lo, lo + c) for lo, c in zip(starts, counts)]
        # Partial results travel through two scratch buffers in turn (three ranks or
        # more); the last step receives straight into ``recv`` (two ranks: no scratch).
        widest = max(counts)
        scratch = self._scratch(xp, 2 * widest, flat.dtype) if n > 2 else out[:0]
        buffers = (scratch[:widest], scratch[widest:])
        right, left = (rank + 1) % n, (rank - 1) % n
        outgoing = flat[blocks[(rank - 1) % n]]
        for step in range(n - 1):
            here = blocks[(rank - step - 2) % n]
            size = here.stop - here.start
            arriving = out if step == n - 2 else buffers[step % 2][:size]
            comm.Sendrecv([outgoing, mtype], right, RING_TAG, [arriving, mtype], left, RING_TAG)
            combine(flat[here], arriving, out=arriving)
            outgoing = arriving
        if op_name == "AVERAGE":
            how, by = mean_scaling(n)
            getattr(xp, how)(out, by, out=out, casting="unsafe")

    def _reduce_scatter_start(self, send: Any, recv: Any, counts: list[int],
                              op: ReduceOp) -> Work:
        s, r, mtype, mop, average = self._reduce_scatter_plan(send, recv, op)
        try:
            request = self._comm.Ireduce_scatter([s, mtype], [r, mtype], counts, mop)
        except MPI.Exception as exc:
            raise_mpi_error(exc, "reduce_scatter")
        return MPIWork([request], (lambda: self._divide(recv)) if average else None, recv,
                       "reduce_scatter")
