"""A small blocking all-reduce in a group of two whose data rides with its check.

Each rank sends one message, its check header followed by its values, through persistent
requests on the checks' communicator, and receives the other rank's the same way; once
the headers agree it combines the two halves with NumPy (for two ranks ``a + b`` equals
``b + a`` bit for bit, so the result has the bits of MPI's own ``Allreduce``). A rank whose
call differs meets this message in its own check and both raise the mismatch; the caller's
buffer is written only after the headers agreed. Messages are built in the guard's one
outgoing buffer and land in its one receive buffer, so a plan keeps no memory of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...plan import CallKey, Plan
from ..guard import HEADER, PAIR_TAG, check_words
from ..transport import mean_scaling

if TYPE_CHECKING:
    from ..backend import MPIBackend

#: NumPy's equal of each reduction (MIN and MAX propagate NaN, as the backend's float ops).
_UFUNCS = {"SUM": np.add, "AVERAGE": np.add, "MAX": np.maximum, "MIN": np.minimum,
           "PRODUCT": np.multiply}


class PairRidePlan(Plan):
    """The riding all-reduce of one key (see the module docstring)."""

    __slots__ = ("_guard", "_check_key", "_h", "_nbytes", "_head", "_header", "_mine",
                 "_theirs", "_requests", "_ufunc", "_scale", "_nan_quiet")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        guard = self._guard = backend.guard
        assert guard.comm is not None and guard.peer is not None  # the table's rule
        self._check_key = key.signature() + (("async_op", False),)
        self._h = int(check_words("all_reduce", self._check_key)[0])
        count = int(np.prod(key.shape, dtype=np.int64))
        self._nbytes = count * key.dtype.itemsize
        message = guard.outgoing[:HEADER + self._nbytes]
        #: This call's header (the hash, no disagreement, the data's bytes), written into
        #: the shared message at every call: other plans write theirs there too.
        self._head = np.array([self._h, 0, self._nbytes], np.int64)
        self._header = message[:HEADER].view(np.int64)
        self._mine = message[HEADER:].view(key.dtype).reshape(key.shape)
        self._theirs = guard.received[HEADER:HEADER + self._nbytes].view(key.dtype).reshape(
            key.shape)
        self._requests = [guard.comm.Send_init(message, guard.peer, PAIR_TAG), guard.receive]
        self._ufunc = _UFUNCS[key.reduce_op]  # type: ignore[index]
        self._scale = mean_scaling(2)[1] if key.reduce_op == "AVERAGE" else None
        #: MIN and MAX meet NaN on purpose (they propagate it): no warning for that.
        self._nan_quiet = key.reduce_op in ("MIN", "MAX")

    def run(self, send: Any, recv: Any = None) -> Any:
        guard = self._guard
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            mine = self._mine
            self._header[:] = self._head
            mine[...] = send
            if guard.swap(self._requests, self._h, self._nbytes):
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

    def free(self) -> None:
        self._requests[0].Free()


__all__ = ["PairRidePlan"]
