"""Blocking sums in a group of two on one host whose buffers both lie in shared regions
(:mod:`axondist.backends.shared_regions`): each rank reads the other's buffer where it lies,
so no byte crosses through MPI.

:class:`PairSharedSumPlan` is the weighted all-reduce: each rank combines its half of both
buffers and writes the result into both. :class:`PairSharedReduceScatterPlan` is the
weighted reduce-scatter: each rank combines its own block of rows of both buffers into a
new array, and writes nothing into either buffer.

The check's message carries where this rank's buffer lies (its region's locator and offset)
and its weight; once the headers agree each rank maps the other's region (once: the mapping
is kept while this rank's own region lives) and, block by block while the block is in cache,
computes ``mine * my_weight + theirs * their_weight`` (the sum in place in its half of both
buffers, with no scratch; for two ranks ``a + b`` is ``b + a`` bit for bit, so the result
has the bits of weighting each buffer, then MPI's SUM). A last
one-byte message each way tells the other rank this rank is done with both buffers (or that
it failed, so both raise), so neither returns, and reuses its buffer, while the other still
reads or writes it. A rank whose buffer is not in a region (or whose call differs otherwise)
meets this call's header in its own check, and both raise the mismatch, naming ``memory``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
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
#: The smallest buffer a shared sum runs for (below it the handshake's two round trips
#: cost more than the ordinary path moves: against it, 2 ranks, two runs, 16 KiB 1.49-1.61x,
#: 32 KiB 1.26-1.37x, 64 KiB 0.86-0.94x, 256 KiB 0.39-0.47x).
SUM_FROM_BYTES = 64 << 10
#: The smallest buffer a shared reduce-scatter runs for (against the ordinary path: 64 KiB
#: 1.39-1.82x, 128 KiB 1.29-1.69x, 256 KiB 0.90-0.97x, 1 MiB 0.76x).
REDUCE_SCATTER_FROM_BYTES = 256 << 10
#: The "I am done with both buffers" messages' tag on the checks' communicator.
DONE_TAG = 7
#: The words the check's message carries: the locator's four, the offset, the weight's bits.
_WORDS = 6


class _PairSharedPlan:
    """The handshake around a combine of two shared buffers of one dtype and shape (see the
    module docstring); a subclass says what it combines, :meth:`_combine`."""

    collective = ""
    #: The smallest buffer, in bytes, this plan runs for (the same rule on every rank).
    from_bytes = 0
    #: What the other rank is told it lacks when this rank fails.
    _lost = ""

    def __init__(self, backend: MPIBackend, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        guard = self._guard = backend.guard
        assert guard.comm is not None and guard.peer is not None  # shares_memory's rule
        self._comm, self._peer = guard.comm, guard.peer
        self._mpi = backend.mpi
        self._rank = backend.rank
        self._dtype = dtype
        self._shape = shape
        self._nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._check_key = (("dtype", str(dtype)), ("shape", shape), ("reduce_op", "SUM"),
                           ("memory", "shared"), ("async_op", False))
        h = int(check_words(self.collective, self._check_key)[0])
        self._check = RidingCheck(guard, h, self.collective, self._check_key,
                                  np.dtype(np.int64), 8 * _WORDS, 8 * _WORDS)
        self._block = max(1, BLOCK_BYTES // dtype.itemsize)
        #: This rank's "done" flag, and the other rank's.
        self._done = (np.zeros(1, np.uint8), np.zeros(1, np.uint8))
        #: The other rank's regions mapped here, by this rank's region (dropped with it).
        self._peers: dict[Locator, tuple[Locator, np.ndarray]] = {}

    def _handshake(self, buf: np.ndarray, factor: float, where: tuple[Locator, int]) -> object:
        """Check, map the other rank's buffer, :meth:`_combine`, tell each other it is done;
        what the combine returned."""
        guard = self._guard
        seq, slot = guard.begin(self.collective, self._check_key[:-1])
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
                result = self._combine(buf.reshape(-1), theirs, factor, their_factor)
                done[0] = 1
            finally:  # also when this rank failed: the other rank is told, not left waiting
                try:
                    self._comm.Sendrecv([done, self._mpi.BYTE], self._peer, DONE_TAG,
                                        [peer_done, self._mpi.BYTE], self._peer, DONE_TAG)
                except self._mpi.Exception as exc:
                    raise_mpi_error(self._mpi, exc, self.collective)
            if not peer_done[0]:
                raise WorldAbortedError(
                    f"{self.collective} #{seq} (memory=shared): rank {self._peer} of the group "
                    f"failed to combine its half of the two buffers (its error says why), so "
                    f"{self._lost}")
            return result
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
                 their_factor: float) -> object:
        raise NotImplementedError

    def _blocks(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """The cache-sized blocks ``[start, end)`` of ``[lo, hi)``."""
        step = self._block
        return ((start, min(start + step, hi)) for start in range(lo, hi, step))

    def free(self) -> None:
        self._check.free()
        self._peers.clear()


class PairSharedSumPlan(_PairSharedPlan):
    """The shared weighted all-reduce, in place in both buffers (see the module docstring)."""

    collective = "all_reduce"
    from_bytes = SUM_FROM_BYTES
    _lost = "this rank's buffer holds only this rank's half of the result"

    def run(self, buf: np.ndarray, factor: float, where: tuple[Locator, int]) -> None:
        self._handshake(buf, factor, where)

    def _combine(self, mine: np.ndarray, theirs: np.ndarray, factor: float,
                 their_factor: float) -> None:
        n = mine.size
        lo, hi = (0, (n + 1) // 2) if self._rank == 0 else ((n + 1) // 2, n)
        weighted = factor != 1.0 or their_factor != 1.0
        for start, end in self._blocks(lo, hi):
            a, b = mine[start:end], theirs[start:end]
            if weighted:  # this half of both buffers is this rank's to write: no scratch
                np.multiply(a, factor, out=a, casting="unsafe")
                np.multiply(b, their_factor, out=b, casting="unsafe")
            np.add(a, b, out=a)
            b[...] = a


class PairSharedReduceScatterPlan(_PairSharedPlan):
    """The shared weighted reduce-scatter: this rank's block of rows (as
    :func:`numpy.array_split` splits axis 0 in two), in a new array; neither buffer is
    written (see the module docstring)."""

    collective = "reduce_scatter"
    from_bytes = REDUCE_SCATTER_FROM_BYTES
    _lost = "the call fails on both ranks"

    def __init__(self, backend: MPIBackend, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        super().__init__(backend, dtype, shape)
        rows = shape[0]
        first = (rows + 1) // 2
        self._rows = (0, first) if self._rank == 0 else (first, rows)

    def run(self, buf: np.ndarray, factor: float, where: tuple[Locator, int]) -> np.ndarray:
        block = self._handshake(buf, factor, where)
        assert isinstance(block, np.ndarray)
        return block

    def _combine(self, mine: np.ndarray, theirs: np.ndarray, factor: float,
                 their_factor: float) -> np.ndarray:
        row = int(np.prod(self._shape[1:], dtype=np.int64))
        lo, hi = (r * row for r in self._rows)
        block = np.empty((self._rows[1] - self._rows[0],) + self._shape[1:], self._dtype)
        flat = block.reshape(-1)
        scratch = self._scratch(lo, hi) if factor != 1.0 or their_factor != 1.0 else flat
        for start, end in self._blocks(lo, hi):
            self._weighted(mine[start:end], theirs[start:end], flat[start - lo:end - lo],
                           factor, their_factor, scratch)
        return block

    def _scratch(self, lo: int, hi: int) -> np.ndarray:
        """A block's scratch, made per call (a plan keeps no buffer between calls)."""
        return np.empty(max(0, min(self._block, hi - lo)), self._dtype)

    def _weighted(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, factor: float,
                  their_factor: float, scratch: np.ndarray) -> None:
        """``out = a * factor + b * their_factor`` (one block; ``scratch`` as large)."""
        if factor != 1.0 or their_factor != 1.0:
            scaled = scratch[:out.size]
            np.multiply(a, factor, out=out, casting="unsafe")
            np.multiply(b, their_factor, out=scaled, casting="unsafe")
            np.add(out, scaled, out=out)
        else:
            np.add(a, b, out=out)
