"""A checked all-gather or reduce-scatter in a group of two as one point-to-point exchange.

Once the check agreed, each rank sends the other what it needs straight from the caller's
buffer (its block for an all-gather; the other rank's block for a reduce-scatter) and
receives into the caller's result, one ``Sendrecv`` on the checks' communicator; a
reduce-scatter then adds the two halves with NumPy (for two ranks ``a + b`` is ``b + a``
bit for bit: the bits of MPI's own ``Reduce_scatter``, and of ``Allreduce``'s block).
Neither keeps memory between calls: a reduce-scatter receives the other rank's part of
its block straight into the result and combines it there.
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


def pair_of(backend: MPIBackend) -> tuple[int, Any]:
    """The other rank and the checks' communicator (the table's rule: a checked pair)."""
    guard = backend.guard
    assert guard.peer is not None and guard.comm is not None
    return guard.peer, guard.comm


class PairAllGatherPlan(AllGatherPlan):
    """This rank's block copied into place, the other's received there."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
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
    """The other rank's block sent, this rank's block of theirs received into the result
    (into a temporary when the result overlaps the input), then combined there."""

    __slots__ = ("_peer", "_private", "_mine", "_theirs", "_ufunc")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._peer, self._private = pair_of(backend)
        rank, peer = backend.rank, 1 - backend.rank
        first = self._counts[0]
        self._mine = slice(0, first) if rank == 0 else slice(first, None)
        self._theirs = slice(0, first) if peer == 0 else slice(first, None)
        self._ufunc = _UFUNCS[key.reduce_op]  # type: ignore[index]

    def _move(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat, result = send.reshape(-1), out.reshape(-1)
        landing = np.empty_like(result) if np.may_share_memory(send, out) else result
        self._private.Sendrecv([self._wire(flat[self._theirs]), self._mtype], self._peer,
                               DATA_TAG, [self._wire(landing), self._mtype], self._peer,
                               DATA_TAG)
        with np.errstate(invalid="ignore"):  # MIN and MAX propagate NaN on purpose
            self._ufunc(flat[self._mine], landing, out=result)
        self._finish(out)
        return out


__all__ = ["DATA_TAG", "PairAllGatherPlan", "PairReduceScatterPlan", "pair_of"]
