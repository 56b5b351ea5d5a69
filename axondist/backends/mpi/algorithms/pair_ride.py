"""A small blocking all-reduce in a group of two whose data rides with its check.

Each rank sends one message, its check header followed by its values, on the checks'
communicator, and receives the other rank's through the guard's persistent request; once
the headers agree it combines the two halves with NumPy (for two ranks ``a + b`` equals
``b + a`` bit for bit, so the result has the bits of MPI's own ``Allreduce``). A rank whose
call differs meets this message in its own check and both raise the mismatch; the caller's
buffer is written only after the headers agreed. The outgoing message is made per call
(at most ``RIDE_MAX_BYTES``, from the heap), so a plan keeps no buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey, Plan
from ..guard import HEADER, PAIR_TAG, check_words
from ..transport import mean_scaling, raise_mpi_error

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: NumPy's equal of each reduction (MIN and MAX propagate NaN, as the backend's float ops).
_UFUNCS = {"SUM": np.add, "AVERAGE": np.add, "MAX": np.maximum, "MIN": np.minimum,
           "PRODUCT": np.multiply}


class PairRidePlan(Plan):
    """The riding all-reduce of one key (see the module docstring)."""

    __slots__ = ("_guard", "_check_key", "_h", "_nbytes", "_head", "_comm", "_peer", "_mpi",
                 "_theirs", "_ufunc", "_scale", "_nan_quiet")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        guard = self._guard = backend.guard
        assert guard.comm is not None and guard.peer is not None  # the table's rule
        self._comm, self._peer, self._mpi = guard.comm, guard.peer, backend.mpi
        self._check_key = key.signature() + (("async_op", False),)
        self._h = int(check_words("all_reduce", self._check_key)[0])
        count = int(np.prod(key.shape, dtype=np.int64))
        self._nbytes = count * key.dtype.itemsize
        #: The message's header: the call's hash, no disagreement, the data's bytes.
        self._head = np.array([self._h, 0, self._nbytes], np.int64).view(np.uint8)
        self._theirs = guard.received[HEADER:HEADER + self._nbytes].view(key.dtype).reshape(
            key.shape)
        self._ufunc = _UFUNCS[key.reduce_op]  # type: ignore[index]
        self._scale = mean_scaling(2)[1] if key.reduce_op == "AVERAGE" else None
        #: MIN and MAX meet NaN on purpose (they propagate it): no warning for that.
        self._nan_quiet = key.reduce_op in ("MIN", "MAX")

    def run(self, send: Any, recv: Any = None) -> Any:
        guard = self._guard
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            message = np.empty(HEADER + self._nbytes, np.uint8)
            message[:HEADER] = self._head
            mine = message[HEADER:].view(self.key.dtype).reshape(self.key.shape)
            mine[...] = send
            mpi = self._mpi
            try:
                sending = self._comm.Isend(message, self._peer, PAIR_TAG)
            except mpi.Exception as exc:
                raise_mpi_error(mpi, exc, "the cross-rank check")
            differ = guard.swap([guard.receive], self._h, self._nbytes)
            try:
                sending.Wait()
            except mpi.Exception as exc:
                raise_mpi_error(mpi, exc, "the cross-rank check")
            if differ:
                guard.disagree("all_reduce", self._check_key)
            if self._nan_quiet:
                with np.errstate(invalid="ignore"):
                    self._ufunc(mine, self._theirs, out=send)
            else:
                self._ufunc(mine, self._theirs, out=send)
            if self._scale is not None:
                np.multiply(send, self._scale, out=send)
        finally:
            guard.rec.end(slot)
        return send


__all__ = ["PairRidePlan"]
