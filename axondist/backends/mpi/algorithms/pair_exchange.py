"""A checked all-gather or reduce-scatter in a group of two as one point-to-point exchange.

Once the check agreed, each rank sends the other what it needs straight from the caller's
buffer (its block for an all-gather; the other rank's block for a reduce-scatter) and
receives into the caller's result, one ``Sendrecv`` on the checks' communicator; a
reduce-scatter then adds the two halves with NumPy (for two ranks ``a + b`` is ``b + a``
bit for bit: the bits of MPI's own ``Reduce_scatter``, and of ``Allreduce``'s block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey
from ..plans import AllGatherPlan, ReduceScatterPlan

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: The data's tag on the checks' communicator (the check's swap uses PAIR_TAG).
DATA_TAG = 4
#: NumPy's equal of each reduction (MIN and MAX propagate NaN, as the backend's float ops).
_UFUNCS = {"SUM": np.add, "AVERAGE": np.add, "MAX": np.maximum, "MIN": np.minimum,
           "PRODUCT": np.multiply}


def _pair(backend: MPIBackend) -> tuple[int, Any]:
    """The other rank and the checks' communicator (the table's rule: a checked pair)."""
    guard = backend.guard
    assert guard.peer is not None and guard.comm is not None
    return guard.peer, guard.comm


class PairAllGatherPlan(AllGatherPlan):
    """This rank's block copied into place, the other's received there."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = _pair(backend)
        lo = self._displs[backend.rank]
        self._mine = slice(lo, lo + self._counts[backend.rank])
        peer = 1 - backend.rank
        self._theirs = slice(self._displs[peer], self._displs[peer] + self._counts[peer])

    def _move(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat = out.reshape(-1)
        flat[self._mine] = send.reshape(-1)
        self._private.Sendrecv(self._spec(send), self._peer, DATA_TAG,
                               self._spec(flat[self._theirs]), self._peer, DATA_TAG)
        return out


class PairReduceScatterPlan(ReduceScatterPlan):
    """The other rank's block sent, this rank's block of theirs received into scratch
    memory the plan keeps, then combined into the result."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs", "_scratch", "_ufunc")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = _pair(backend)
        rank, peer = backend.rank, 1 - backend.rank
        first = self._counts[0]
        self._mine = slice(0, first) if rank == 0 else slice(first, None)
        self._theirs = slice(0, first) if peer == 0 else slice(first, None)
        self._scratch = np.empty(self._counts[rank], key.dtype)
        self._ufunc = _UFUNCS[key.reduce_op]  # type: ignore[index]

    def _move(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat = send.reshape(-1)
        self._private.Sendrecv([self._wire(flat[self._theirs]), self._mtype], self._peer,
                               DATA_TAG, [self._wire(self._scratch), self._mtype], self._peer,
                               DATA_TAG)
        with np.errstate(invalid="ignore"):  # MIN and MAX propagate NaN on purpose
            self._ufunc(flat[self._mine], self._scratch, out=out.reshape(-1))
        self._finish(out)
        return out


__all__ = ["DATA_TAG", "PairAllGatherPlan", "PairReduceScatterPlan"]
