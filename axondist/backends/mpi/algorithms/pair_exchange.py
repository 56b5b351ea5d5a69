"""A checked all-gather, reduce-scatter or broadcast in a group of two as one point-to-point
exchange, the data sent ahead of the check.

Each rank sends the other what it needs straight from the caller's buffer (its block for
an all-gather; the other rank's block for a reduce-scatter; the root's values for a
broadcast), *ahead* of the check, on ``AHEAD_TAG``, and the check's header says how much
(:class:`AheadCheck`): the check and the data cost one round trip, as MPI's own call does.
A rank whose call differs meets that header in its own check, receives and drops the data
(:meth:`~axondist.backends.mpi.guard.CallGuard.swap`), and both raise the mismatch, with no
message left behind and no caller's buffer written. A reduce-scatter then adds the two
halves with NumPy (for two ranks ``a + b`` is ``b + a`` bit for bit: the bits of MPI's own
``Reduce_scatter``, and of ``Allreduce``'s block). No plan keeps memory between calls:
data lands in the caller's result (a reduce-scatter's in a temporary when the result
overlaps its input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ....errors import InvalidBufferError
from ...plan import CallKey, checked_out
from ..choose import PAIR_GATHER_MAX_BYTES
from ..guard import AHEAD_TAG, PAIR_TAG
from ..plans import (
    AllGatherPlan,
    BroadcastPlan,
    MPIPlan,
    ReduceScatterPlan,
    UnsizedAllGatherPlan,
)
from ..transport import displacements, raise_mpi_error

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: NumPy's equal of each reduction (MIN and MAX propagate NaN, as the backend's float ops).
UFUNCS = {"SUM": np.add, "AVERAGE": np.add, "MAX": np.maximum, "MIN": np.minimum,
          "PRODUCT": np.multiply}


def pair_of(backend: MPIBackend) -> tuple[int, Any]:
    """The other rank and the checks' communicator (the table's rule: a checked pair)."""
    guard = backend.guard
    assert guard.peer is not None and guard.comm is not None
    return guard.peer, guard.comm


def pair_blocks(counts: list[int], rank: int) -> tuple[slice, slice]:
    """This rank's block and the other rank's in a flat buffer of the two ranks' blocks in
    rank order (``counts``: their elements)."""
    first, second = slice(0, counts[0]), slice(counts[0], counts[0] + counts[1])
    return (first, second) if rank == 0 else (second, first)


class AheadCheck:
    """A two-rank call's check whose data may leave ahead of it: this rank's header (the
    call's hash, no disagreement, minus the bytes it sends ahead) in a persistent send, and
    what the other rank's header must say (minus the bytes it sends ahead).

    Args:
        plan: the call's plan (its hash and its key as the check compares them).
        sends / receives: bytes this rank sends ahead, and receives from the other's.
    """

    __slots__ = ("_guard", "_plan", "_header", "_requests", "_expected")

    def __init__(self, plan: MPIPlan, backend: MPIBackend, sends: int, receives: int) -> None:
        guard = self._guard = backend.guard
        peer, comm = pair_of(backend)
        self._plan = plan
        self._header = np.array([int(plan._words[0]), 0, -sends], np.int64)
        self._requests = [comm.Send_init(self._header, peer, PAIR_TAG), guard.receive]
        self._expected = -receives

    def agree(self, ahead: Any) -> None:
        """Return when the other rank makes the same call; else, once ``ahead`` (the
        request of what this rank sent ahead, or None) completed, raise the mismatch."""
        plan = self._plan
        if self._guard.swap(self._requests, int(self._header[0]), self._expected):
            if ahead is not None:
                ahead.Wait()  # the other rank received and dropped it
            self._guard.disagree(plan.key.collective, plan._check_key)

    def free(self) -> None:
        self._requests[0].Free()


class PairRun:
    """``run`` of a blocking two-rank plan: numbered and recorded, then :meth:`_exchange`
    (which checks, through its :class:`AheadCheck` or riding check); MPI errors as
    axondist's. A non-blocking call runs as its MPI plan's."""

    __slots__ = ()

    def run(self: Any, send: Any, recv: Any = None) -> Any:
        if self.key.async_op:
            return MPIPlan.run(self, send, recv)
        guard, what = self._guard, self.key.collective
        seq, slot = guard.begin(what, self._detail)
        try:
            try:
                return self._exchange(send, recv)
            except self._mpi.Exception as exc:
                raise_mpi_error(self._mpi, exc, what)
        finally:
            guard.rec.end(slot)

    def free(self: Any) -> None:
        self._check.free()


class PairAllGatherPlan(PairRun, AllGatherPlan):
    """This rank's block copied into place, the other's received there."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs", "_check")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        size = key.dtype.itemsize
        self._mine, self._theirs = pair_blocks(self._counts, backend.rank)
        self._check = AheadCheck(self, backend, self._counts[backend.rank] * size,
                                 self._counts[1 - backend.rank] * size)

    def _exchange(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat = out.reshape(-1)
        comm, peer = self._private, self._peer
        ahead = comm.Isend(self._spec(send), peer, AHEAD_TAG)
        self._check.agree(ahead)
        comm.Recv(self._spec(flat[self._theirs]), peer, AHEAD_TAG)
        flat[self._mine] = send.reshape(-1)
        ahead.Wait()
        return out

    def _move(self, send: Any, recv: Any) -> Any:
        raise AssertionError("a blocking pair all-gather runs _exchange")


class PairReduceScatterPlan(PairRun, ReduceScatterPlan):
    """The other rank's block sent, this rank's block of theirs received into the result
    (into a temporary when the result overlaps the input), then combined there."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs", "_ufunc", "_check")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        rank, peer = backend.rank, 1 - backend.rank
        self._mine, self._theirs = pair_blocks(self._counts, rank)
        self._ufunc = UFUNCS[key.reduce_op]  # type: ignore[index]
        size = key.dtype.itemsize
        self._check = AheadCheck(self, backend, self._counts[peer] * size,
                                 self._counts[rank] * size)

    def _exchange(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat, result = send.reshape(-1), out.reshape(-1)
        comm, peer, mtype = self._private, self._peer, self._mtype
        landing = np.empty_like(result) if np.may_share_memory(send, out) else result
        ahead = comm.Isend([self._wire(flat[self._theirs]), mtype], peer, AHEAD_TAG)
        self._check.agree(ahead)
        comm.Recv([self._wire(landing), mtype], peer, AHEAD_TAG)
        ahead.Wait()
        with np.errstate(invalid="ignore"):  # MIN and MAX propagate NaN on purpose
            self._ufunc(flat[self._mine], landing, out=result)
        self._finish(out)
        return out

    def _move(self, send: Any, recv: Any) -> Any:
        raise AssertionError("a blocking pair reduce-scatter runs _exchange")


class PairBroadcastPlan(PairRun, BroadcastPlan):
    """The root's values sent ahead of the check; the other rank receives them into its
    buffer once the check agreed."""

    __slots__ = ("_peer", "_private", "_root", "_check")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        self._root = backend.rank == key.root
        nbytes = key.dtype.itemsize
        for d in key.shape:
            nbytes *= d
        self._check = AheadCheck(self, backend, nbytes if self._root else 0,
                                 0 if self._root else nbytes)

    def _exchange(self, send: Any, recv: Any) -> Any:
        comm, peer = self._private, self._peer
        if self._root:
            ahead = comm.Isend(self._spec(send), peer, AHEAD_TAG)
            self._check.agree(ahead)
            ahead.Wait()
        else:
            self._check.agree(None)
            comm.Recv(self._spec(send), peer, AHEAD_TAG)
        return send

    def _move(self, send: Any, recv: Any) -> Any:
        raise AssertionError("a blocking pair broadcast runs _exchange")


class PairUnsizedAllGatherPlan(PairRun, UnsizedAllGatherPlan):
    """An all-gather whose row counts neither rank knows: the check's header carries this
    rank's block, so the counts need no round trip of their own. A block of at most
    ``PAIR_GATHER_MAX_BYTES`` leaves ahead of the check (its header says minus its bytes);
    a larger one waits for it (its header says its rows). Once the headers agree (the
    call's hash, whatever the sizes) both ranks know both blocks: two large blocks move by
    MPI's ``Allgatherv`` (``Allgather`` when equal), anything else point to point. An
    ``out`` of the wrong shape is known only then: the blocks still move (into a
    temporary), so no message is left behind, and the error is raised after."""

    __slots__ = ("_peer", "_private", "_header", "_requests")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        self._header = np.array([int(self._words[0]), 0, 0], np.int64)
        self._requests = [self._private.Send_init(self._header, self._peer, PAIR_TAG),
                          backend.guard.receive]

    def _exchange(self, send: Any, recv: Any) -> Any:
        guard, comm, peer = self._guard, self._private, self._peer
        row_bytes = self._row_size * self.key.dtype.itemsize
        mine = send.shape[0] * row_bytes
        early = 0 < mine <= PAIR_GATHER_MAX_BYTES
        ahead = comm.Isend(self._spec(send), peer, AHEAD_TAG) if early else None
        self._header[2] = -mine if early else send.shape[0]  # bytes sent ahead, or rows
        if guard.swap(self._requests, int(self._header[0]), None):
            if ahead is not None:
                ahead.Wait()  # the other rank received and dropped it
            guard.disagree("all_gather", self._check_key)
        told = int(guard.seen[2])
        their_rows = -told // row_bytes if told < 0 else told
        rows = [send.shape[0], their_rows] if self._b.rank == 0 else [their_rows, send.shape[0]]
        shape = (sum(rows),) + tuple(self.key.shape[1:])
        refused = None
        try:
            out = (self._xp.empty(shape, dtype=self.key.dtype) if recv is None
                   else checked_out(recv, self.key, shape, "all_gather"))
        except InvalidBufferError as exc:  # known only now: finish the exchange, then raise
            refused, out = exc, self._xp.empty(shape, dtype=self.key.dtype)
        self._move_blocks(send, out, rows, early, told, ahead)
        if refused is not None:
            raise refused
        return out

    def _move_blocks(self, send: Any, out: Any, rows: list[int], early: bool, told: int,
                     ahead: Any) -> None:
        """Both blocks into ``out`` (``rows``: the ranks' rows; ``early``: this rank's block
        left ahead, ``ahead`` its request; ``told``: the other rank's header)."""
        comm, peer, rank = self._private, self._peer, self._b.rank
        counts = [r * self._row_size for r in rows]
        mine, theirs = counts[rank], counts[1 - rank]
        if not early and told >= 0 and mine > 0 and theirs > 0:  # two large blocks: MPI's
            s, r = self._spec(send), self._spec(out)
            if mine == theirs:
                self._comm.Allgather(s, r)
            else:
                self._comm.Allgatherv(s, [r[0], counts, displacements(counts), r[1]])
            return
        flat = out.reshape(-1)
        here, there = pair_blocks(counts, rank)
        if ahead is None and mine > 0:
            ahead = comm.Isend(self._spec(send), peer, AHEAD_TAG)
        if theirs > 0:
            comm.Recv(self._spec(flat[there]), peer, AHEAD_TAG)
        flat[here] = send.reshape(-1)
        if ahead is not None:
            ahead.Wait()

    def free(self) -> None:
        self._requests[0].Free()


__all__ = ["UFUNCS", "AheadCheck", "PairAllGatherPlan", "PairBroadcastPlan",
           "PairReduceScatterPlan", "PairRun", "PairUnsizedAllGatherPlan", "pair_blocks",
           "pair_of"]
