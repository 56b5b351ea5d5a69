"""A blocking AVERAGE all-reduce in a group of two as two exchanges, the check's round
trip overlapped with the first and the mean fused in.

Each rank owns one half of the buffer (rank 0 the first ``ceil(n / 2)`` elements, rank 1
the rest), cut into the same number of blocks of at most :data:`BLOCK_BYTES` on both
ranks. The first block of the other rank's half leaves ahead of the check (on
``AHEAD_TAG``, straight from the caller's buffer), and the check's header says so: a rank
whose call differs meets that header in its own check, receives and drops the block
(:meth:`~axondist.backends.mpi.guard.CallGuard.swap`), and both raise the mismatch, with
no message left behind and no caller's buffer written. Once the headers agree, block by
block, each rank receives the other's values of its block into the group's receive buffer
(``guard.received``, two blocks in turn), adds them to its own while the block is in cache,
scales the sum into the mean in place and sends the finished block back, receiving the
other rank's finished block into its half; the next block's values are on their way
meanwhile.

Every element is summed once and scaled once, by the rank that owns it: for two ranks
``a + b`` is ``b + a`` bit for bit, and the scaling is the one
:class:`~axondist.backends.mpi.plans.AllReducePlan` applies after MPI's SUM, so the result
has the bits of ``Allreduce`` then the division, in the exchanges ``Allreduce`` makes itself,
without a separate pass over the buffer and without memory of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey, Plan
from ..guard import AHEAD_TAG, HEADER, PAIR_TAG, RECEIVE_ROOM, check_words
from ..transport import mean_scaling, raise_mpi_error
from .pair_exchange import DATA_TAG, pair_of

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: Bytes of a block summed and scaled in one go (two fit the group's receive buffer).
BLOCK_BYTES = RECEIVE_ROOM // 2
#: The finished blocks' tag on the checks' communicator.
GATHER_TAG = 5


def block_bounds(lo: int, hi: int, blocks: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``blocks`` near-equal ``[start, end)`` element ranges."""
    size = hi - lo
    return [(lo + k * size // blocks, lo + (k + 1) * size // blocks) for k in range(blocks)]


class PairHalvesMeanPlan(Plan):
    """The two-rank mean of one key (see the module docstring)."""

    __slots__ = ("_guard", "_mpi", "_check_key", "_h", "_peer", "_comm", "_mtype", "_mine",
                 "_theirs", "_slots", "_scale", "_expected", "_header", "_swap")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        guard = self._guard = backend.guard
        self._mpi = backend.mpi
        self._peer, self._comm = pair_of(backend)
        self._check_key = key.signature() + (("async_op", False),)
        self._h = int(check_words("all_reduce", self._check_key)[0])
        self._mtype = backend.types.transfer[key.dtype][1]
        numel = 1
        for d in key.shape:
            numel *= d
        first = (numel + 1) // 2
        size = key.dtype.itemsize
        blocks = max(1, -(-first // (BLOCK_BYTES // size)))
        halves = (block_bounds(0, first, blocks), block_bounds(first, numel, blocks))
        self._mine, self._theirs = halves[backend.rank], halves[1 - backend.rank]
        #: This call's header: the hash, no disagreement, and minus the bytes of the block
        #: sent ahead (the first of the other rank's half); then what the other's says.
        ahead = (self._theirs[0][1] - self._theirs[0][0]) * size
        self._header = np.array([self._h, 0, -ahead], np.int64)
        self._expected = -(self._mine[0][1] - self._mine[0][0]) * size
        self._swap = [self._comm.Send_init(self._header, self._peer, PAIR_TAG), guard.receive]
        #: Where block k's values from the other rank land: two halves of the receive
        #: buffer after the header, in turn.
        self._slots = (HEADER, HEADER + BLOCK_BYTES)
        how, by = mean_scaling(2)
        self._scale = (getattr(np, how), by)

    def run(self, send: Any, recv: Any = None) -> Any:
        guard, mpi = self._guard, self._mpi
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            flat = send.reshape(-1)
            tlo, thi = self._theirs[0]
            try:
                ahead = self._comm.Isend([flat[tlo:thi], self._mtype], self._peer, AHEAD_TAG)
                if guard.swap(self._swap, self._h, self._expected):
                    ahead.Wait()  # the other rank dropped it
                    guard.disagree("all_reduce", self._check_key)
                self._combine(flat, ahead)
            except mpi.Exception as exc:
                raise_mpi_error(mpi, exc, "all_reduce")
        finally:
            guard.rec.end(slot)
        return send

    def _receive(self, k: int, tag: int) -> Any:
        """Post the receive of block ``k``'s values from the other rank (into its slot)."""
        lo, hi = self._mine[k]
        dtype = self.key.dtype
        at = self._slots[k & 1]
        into = self._guard.received[at:at + (hi - lo) * dtype.itemsize].view(dtype)
        return self._comm.Irecv([into, self._mtype], self._peer, tag), into

    def _combine(self, flat: Any, ahead: Any) -> None:
        """Block by block: sum, scale, send back; the next block's values in flight."""
        comm, peer, mtype = self._comm, self._peer, self._mtype
        mine, theirs = self._mine, self._theirs
        waitall = self._mpi.Request.Waitall
        scale, by = self._scale
        request, values = self._receive(0, AHEAD_TAG)
        pending = [request, ahead]
        finished: list[Any] = []
        for k, (lo, hi) in enumerate(mine):
            if k + 1 < len(mine):  # block k+1's values, into the other slot
                request, following = self._receive(k + 1, DATA_TAG)
                tlo, thi = theirs[k + 1]
                ahead_of = [request, comm.Isend([flat[tlo:thi], mtype], peer, DATA_TAG)]
            waitall(pending)
            block = flat[lo:hi]
            np.add(block, values, out=block)
            scale(block, by, out=block, casting="unsafe")
            tlo, thi = theirs[k]
            finished += (comm.Isend([block, mtype], peer, GATHER_TAG),
                         comm.Irecv([flat[tlo:thi], mtype], peer, GATHER_TAG))
            if k + 1 < len(mine):
                pending, values = ahead_of, following
        waitall(finished)

    def free(self) -> None:
        self._swap[0].Free()


__all__ = ["BLOCK_BYTES", "GATHER_TAG", "PairHalvesMeanPlan", "block_bounds"]
