"""A blocking weighted sum in a group of two on one host whose buffers both lie in shared
regions (:mod:`axondist.backends.shared_regions`): each rank combines its half straight from
both buffers and writes the result into both, so no byte crosses through MPI.

The check's message carries where this rank's buffer lies (its region's locator and offset)
and its weight; once the headers agree each rank maps the other's region (once: the mapping
is kept while this rank's own region lives) and, block by block while the block is in cache,
writes ``mine * my_weight + theirs * their_weight`` into its half of both buffers (for two
ranks ``a + b`` is ``b + a`` bit for bit, so the result has the bits of weighting each
buffer, then MPI's SUM ``Allreduce``). A last one-byte message each way tells the other
rank its half is written (or that this rank failed, so both raise), so neither returns while
the other still writes into its buffer.
A rank whose buffer is not in a region (or whose call differs otherwise) meets this call's
header in its own check, and both raise the mismatch, naming ``memory``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np

from ....errors import WorldAbortedError
from ... import shared_regions
from ...shared_regions import Locator
from ..guard import check_words
from ..transport import raise_mpi_error
from .pair_ride import RidingCheck

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: Bytes of a block combined in one go (in cache).
BLOCK_BYTES = 1 << 18
#: The "my half is written" messages' tag on the checks' communicator.
DONE_TAG = 7
#: The words the check's message carries: the locator's four, the offset, the weight's bits.
_WORDS = 6


class PairSharedSumPlan:
    """The shared weighted sum of one dtype and shape (see the module docstring)."""

    def __init__(self, backend: MPIBackend, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        guard = self._guard = backend.guard
        assert guard.comm is not None and guard.peer is not None  # shares_memory's rule
        self._comm, self._peer = guard.comm, guard.peer
        self._mpi = backend.mpi
        self._rank = backend.rank
        self._dtype = dtype
        self._nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._check_key = (("dtype", str(dtype)), ("shape", shape), ("reduce_op", "SUM"),
                           ("memory", "shared"), ("async_op", False))
        h = int(check_words("all_reduce", self._check_key)[0])
        self._check = RidingCheck(guard, h, "all_reduce", self._check_key, np.dtype(np.int64),
                                  8 * _WORDS, 8 * _WORDS)
        self._tmp = np.empty(max(1, BLOCK_BYTES // dtype.itemsize), dtype)
        self._scaled = np.empty_like(self._tmp)
        #: This rank's "my half is written" flag, and the other rank's.
        self._done = (np.zeros(1, np.uint8), np.zeros(1, np.uint8))
        #: The other rank's regions mapped here, by this rank's region (dropped with it).
        self._peers: dict[Locator, tuple[Locator, np.ndarray]] = {}

    def run(self, buf: np.ndarray, factor: float, where: tuple[Locator, int]) -> None:
        guard = self._guard
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            mine, offset = where
            words = self._check.outgoing
            words[:4] = mine
            words[4] = offset
            words[5:6].view(np.float64)[0] = factor
            self._check.agree()
            got = self._check.incoming
            done, peer_done = self._done
            done[0] = peer_done[0] = 0
            try:
                theirs = self._theirs(mine, Locator(*(int(w) for w in got[:4])), int(got[4]))
                their_factor = float(got[5:6].view(np.float64)[0])
                self._combine(buf.reshape(-1), theirs, factor, their_factor)
                done[0] = 1
            finally:  # also when this rank failed: the other rank is told, not left waiting
                try:
                    self._comm.Sendrecv([done, self._mpi.BYTE], self._peer, DONE_TAG,
                                        [peer_done, self._mpi.BYTE], self._peer, DONE_TAG)
                except self._mpi.Exception as exc:
                    raise_mpi_error(self._mpi, exc, "all_reduce")
            if not peer_done[0]:
                raise WorldAbortedError(
                    f"all_reduce #{seq} (memory=shared): rank {self._peer} of the group failed "
                    "to sum its half of the two buffers (its error says why), so this rank's "
                    "buffer holds only this rank's half of the result")
        finally:
            guard.rec.end(slot)

    def _theirs(self, mine: Locator, locator: Locator, offset: int) -> np.ndarray:
        """The other rank's buffer, from its region mapped here (kept while ``mine`` lives)."""
        known = self._peers.get(mine)
        if known is None or known[0] != locator:
            if known is None:
                whole = shared_regions.region_array(mine)
                if whole is not None:
                    weakref.finalize(whole, self._peers.pop, mine, None)
            known = self._peers[mine] = (locator, shared_regions.map_region(locator))
        return known[1][offset:offset + self._nbytes].view(self._dtype)

    def _combine(self, mine: np.ndarray, theirs: np.ndarray, factor: float,
                 their_factor: float) -> None:
        n = mine.size
        lo, hi = (0, (n + 1) // 2) if self._rank == 0 else ((n + 1) // 2, n)
        out_all, scaled_all = self._tmp, self._scaled
        weighted = factor != 1.0 or their_factor != 1.0
        for start in range(lo, hi, out_all.size):
            end = min(start + out_all.size, hi)
            a, b, out = mine[start:end], theirs[start:end], out_all[:end - start]
            if weighted:
                scaled = scaled_all[:end - start]
                np.multiply(a, factor, out=out, casting="unsafe")
                np.multiply(b, their_factor, out=scaled, casting="unsafe")
                np.add(out, scaled, out=out)
            else:
                np.add(a, b, out=out)
            a[...] = out
            b[...] = out

    def free(self) -> None:
        self._check.free()
        self._peers.clear()
