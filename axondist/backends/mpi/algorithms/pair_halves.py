"""A blocking AVERAGE all-reduce in a group of two as two exchanges, the check's round
trip overlapped with the first and the mean fused in.

Each rank owns one half of the buffer (rank 0 the first ``ceil(n / 2)`` elements, rank 1
the rest). The other rank's half leaves ahead of the check (on ``AHEAD_TAG``, straight from
the caller's buffer), and the check's header says so: a rank whose call differs meets that
header in its own check, receives and drops the data
(:meth:`~axondist.backends.mpi.guard.CallGuard.swap`), and both raise the mismatch, with no
message left behind and no caller's buffer written. Once the headers agree, each rank
receives the other's values of its half into a temporary (per call, as MPI's own
``Allreduce`` takes one: kept, it would be memory no one counts), then block by block adds
them to its own while the block is in cache, scales the sum into the mean in place and
sends the finished block back; the other rank's finished blocks land in its half
meanwhile.

Every element is summed once and scaled once, by the rank that owns it: for two ranks
``a + b`` is ``b + a`` bit for bit, and the scaling is the one
:class:`~axondist.backends.mpi.plans.AllReducePlan` applies after MPI's SUM, so the result
has the bits of ``Allreduce`` then the division, in two exchanges as ``Allreduce`` makes
them, without a separate pass over the buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey, Plan
from ..guard import AHEAD_TAG, PAIR_TAG, check_words
from ..transport import mean_scaling, raise_mpi_error
from .pair_exchange import pair_of

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: Bytes of a block summed and scaled in one go (in cache), then sent back.
BLOCK_BYTES = 1 << 20
#: The finished blocks' tag on the checks' communicator.
GATHER_TAG = 5


def block_bounds(lo: int, hi: int, blocks: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``blocks`` near-equal ``[start, end)`` element ranges."""
    size = hi - lo
    return [(lo + k * size // blocks, lo + (k + 1) * size // blocks) for k in range(blocks)]


class PairHalvesMeanPlan(Plan):
    """The two-rank mean of one key (see the module docstring)."""

    __slots__ = ("_guard", "_mpi", "_check_key", "_h", "_peer", "_comm", "_mtype", "_mine",
                 "_theirs", "_scale", "_expected", "_header", "_swap")

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
        blocks = max(1, -(-first * size // BLOCK_BYTES))
        halves = (block_bounds(0, first, blocks), block_bounds(first, numel, blocks))
        #: Each half as blocks (the same number on both ranks).
        self._mine, self._theirs = halves[backend.rank], halves[1 - backend.rank]
        #: This call's header: the hash, no disagreement, and minus the bytes sent ahead
        #: (the other rank's half); then what the other's says.
        self._header = np.array([self._h, 0, -self._span(self._theirs) * size], np.int64)
        self._expected = -self._span(self._mine) * size
        self._swap = [self._comm.Send_init(self._header, self._peer, PAIR_TAG), guard.receive]
        how, by = mean_scaling(2)
        self._scale = (getattr(np, how), by)

    @staticmethod
    def _span(blocks: list[tuple[int, int]]) -> int:
        return blocks[-1][1] - blocks[0][0]

    def run(self, send: Any, recv: Any = None) -> Any:
        guard, mpi = self._guard, self._mpi
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            flat = send.reshape(-1)
            theirs = flat[self._theirs[0][0]:self._theirs[-1][1]]
            try:
                ahead = self._comm.Isend([theirs, self._mtype], self._peer, AHEAD_TAG)
                if guard.swap(self._swap, self._h, self._expected):
                    ahead.Wait()  # the other rank dropped it
                    guard.disagree("all_reduce", self._check_key)
                self._combine(flat, ahead)
            except mpi.Exception as exc:
                raise_mpi_error(mpi, exc, "all_reduce")
        finally:
            guard.rec.end(slot)
        return send

    def _combine(self, flat: Any, ahead: Any) -> None:
        """Receive the other rank's values of this half; sum, scale and send back block by
        block, the other's finished blocks received into the other half."""
        comm, peer, mtype, dtype = self._comm, self._peer, self._mtype, self.key.dtype
        mine, theirs = self._mine, self._theirs
        lo0 = mine[0][0]
        count = self._span(mine)
        values = np.empty(count, dtype)
        comm.Recv([values, mtype], peer, AHEAD_TAG)
        ahead.Wait()  # this rank's half of theirs has left: its finished blocks may land
        requests = [comm.Irecv([flat[lo:hi], mtype], peer, GATHER_TAG) for lo, hi in theirs]
        scale, by = self._scale
        step = CACHE_BLOCK // dtype.itemsize
        for lo, hi in mine:
            for at in range(lo, hi, step):
                end = min(at + step, hi)
                block = flat[at:end]
                np.add(block, values[at - lo0:end - lo0], out=block)
                scale(block, by, out=block, casting="unsafe")
            requests.append(comm.Isend([flat[lo:hi], mtype], peer, GATHER_TAG))
        self._mpi.Request.Waitall(requests)

    def free(self) -> None:
        self._swap[0].Free()


#: Bytes summed and scaled at once: the three operands stay in a core's cache.
CACHE_BLOCK = 256 << 10


__all__ = ["BLOCK_BYTES", "CACHE_BLOCK", "GATHER_TAG", "PairHalvesMeanPlan", "block_bounds"]
