"""A blocking AVERAGE all-reduce in a group of two as two exchanges, the mean fused in.

Once the check agreed, each rank owns one half of the buffer (rank 0 the first
``ceil(n / 2)`` elements, rank 1 the rest). It sends the other rank its values of their
half and receives theirs of its own into a temporary (one ``Sendrecv``: the reduce-scatter),
then, block by block while the block is in cache, adds the two and scales the sum into the
mean in place; a second ``Sendrecv`` swaps the finished halves (the all-gather). Every
element is summed once and scaled once, by the rank that owns it: for two ranks ``a + b``
is ``b + a`` bit for bit, and the scaling is the one
:class:`~axondist.backends.mpi.plans.AllReducePlan` applies after MPI's SUM, so the result
has the bits of ``Allreduce`` then the division, without the separate pass over the whole
buffer. The temporary is half the buffer, allocated per call
and not kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey
from ..plans import AllReducePlan
from .pair_exchange import DATA_TAG, pair_of

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: Bytes of a block summed and scaled in one go (the three operands fit in a core's cache).
BLOCK_BYTES = 256 << 10


class PairHalvesMeanPlan(AllReducePlan):
    """The two-rank mean of one key (see the module docstring)."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs", "_block", "_scale")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        numel = 1
        for d in key.shape:
            numel *= d
        first = (numel + 1) // 2
        halves = (slice(0, first), slice(first, numel))
        self._mine, self._theirs = halves[backend.rank], halves[1 - backend.rank]
        self._block = max(1, BLOCK_BYTES // key.dtype.itemsize)
        assert self._average is not None  # the table's rule: AVERAGE
        how, by = self._average
        self._scale = (getattr(np, how), by)

    def _move(self, send: Any, recv: Any) -> Any:
        flat = send.reshape(-1)
        mine, theirs = flat[self._mine], flat[self._theirs]
        peer, comm, mtype = self._peer, self._private, self._mtype
        landing = np.empty_like(mine)
        comm.Sendrecv([self._wire(theirs), mtype], peer, DATA_TAG, [self._wire(landing), mtype],
                      peer, DATA_TAG)
        scale, by = self._scale
        step = self._block
        for lo in range(0, mine.size, step):
            block = mine[lo:lo + step]
            np.add(block, landing[lo:lo + step], out=block)
            scale(block, by, out=block, casting="unsafe")
        comm.Sendrecv([self._wire(mine), mtype], peer, DATA_TAG, [self._wire(theirs), mtype],
                      peer, DATA_TAG)
        return send


__all__ = ["BLOCK_BYTES", "PairHalvesMeanPlan"]
