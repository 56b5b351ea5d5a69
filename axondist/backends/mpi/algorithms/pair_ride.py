"""Small blocking collectives in a group of two whose data rides with their check.

Each rank sends one message, its check header followed by the values the other rank needs
(all of them for an all-reduce; the other rank's block for a reduce-scatter; its own block
for an all-gather), through
persistent requests on the checks' communicator, and receives the other rank's the same
way: the check and the data cost one message each way, where MPI's own call makes at least
one round trip after the check's. Once the headers agree a reduction combines the two sides
with NumPy (for two ranks ``a + b`` equals ``b + a`` bit for bit, so the result has the
bits of MPI's own ``Allreduce`` or ``Reduce_scatter``). A rank whose call differs meets this
message in its own check and both raise the mismatch; the caller's buffer is written only
after the headers agreed. Messages are built in the guard's one outgoing buffer and land in
its one receive buffer, so a plan keeps no memory of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...checks import Key
from ...plan import CallKey, Plan
from ..guard import HEADER, PAIR_TAG, CallGuard, check_words
from ..plans import AllGatherPlan, MPIPlan, ReduceScatterPlan
from ..transport import mean_scaling
from .pair_exchange import UFUNCS, PairRun, pair_blocks

if TYPE_CHECKING:
    from ..backend import MPIBackend

class RidingCheck:
    """A two-rank call's check whose message carries its data: this rank's header (the
    call's hash ``h``, no disagreement, the bytes that follow) and ``sends`` bytes of values
    (:attr:`outgoing`, filled by the plan before :meth:`agree`), in a persistent send; the
    other rank's header must say ``receives`` bytes follow (:attr:`incoming`). The message is
    built in the guard's one outgoing buffer and lands in its one receive buffer."""

    __slots__ = ("_guard", "_collective", "_check_key", "_expected", "head", "header",
                 "requests", "outgoing", "incoming")

    def __init__(self, guard: CallGuard, h: int, collective: str, check_key: Key,
                 dtype: np.dtype, sends: int, receives: int) -> None:
        assert guard.comm is not None and guard.peer is not None  # the table's rule
        self._guard, self._collective, self._check_key = guard, collective, check_key
        message = guard.outgoing[:HEADER + sends]
        #: This call's header, written into the shared message at every call (other plans
        #: build theirs there too), and where it goes.
        self.head = np.array([h, 0, sends], np.int64)
        self.header = message[:HEADER].view(np.int64)
        self.outgoing = message[HEADER:].view(dtype)
        self.incoming = guard.received[HEADER:HEADER + receives].view(dtype)
        self.requests = [guard.comm.Send_init(message, guard.peer, PAIR_TAG), guard.receive]
        self._expected = receives

    @classmethod
    def of(cls, plan: MPIPlan, sends: int, receives: int) -> RidingCheck:
        """The riding check of a checked MPI plan."""
        return cls(plan._guard, int(plan._words[0]), plan.key.collective, plan._check_key,
                   plan.key.dtype, sends, receives)

    def agree(self) -> None:
        """Swap the messages; return when the other rank makes the same call, else raise
        the mismatch on both."""
        self.header[:] = self.head
        if self._guard.swap(self.requests, int(self.head[0]), self._expected):
            self._guard.disagree(self._collective, self._check_key)

    def free(self) -> None:
        self.requests[0].Free()


class PairRidePlan(Plan):
    """The riding all-reduce of one key (see the module docstring): all of this rank's
    values ride, and the other rank's are combined with them."""

    __slots__ = ("_guard", "_check_key", "_h", "_nbytes", "_check", "_mine", "_theirs",
                 "_ufunc", "_scale", "_nan_quiet")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(key)
        guard = self._guard = backend.guard
        self._check_key = key.signature() + (("async_op", False),)
        self._h = int(check_words("all_reduce", self._check_key)[0])
        self._nbytes = int(np.prod(key.shape, dtype=np.int64)) * key.dtype.itemsize
        self._check = RidingCheck(guard, self._h, "all_reduce", self._check_key, key.dtype,
                                  self._nbytes, self._nbytes)
        self._mine = self._check.outgoing.reshape(key.shape)
        self._theirs = self._check.incoming.reshape(key.shape)
        self._ufunc = UFUNCS[key.reduce_op]  # type: ignore[index]
        self._scale = mean_scaling(2)[1] if key.reduce_op == "AVERAGE" else None
        #: MIN and MAX meet NaN on purpose (they propagate it): no warning for that.
        self._nan_quiet = key.reduce_op in ("MIN", "MAX")

    def run(self, send: Any, recv: Any = None) -> Any:
        guard = self._guard
        seq, slot = guard.begin("all_reduce", self._check_key[:-1])
        try:
            mine, check = self._mine, self._check
            mine[...] = send
            # the check's agree(), inlined: the call-cost budget counts this path's frames
            check.header[:] = check.head
            if guard.swap(check.requests, self._h, self._nbytes):
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
        self._check.free()


def _flat(array: Any) -> Any:
    """``array`` as one dimension, a view (the plans' buffers are contiguous)."""
    return array.reshape(-1)


class PairRideReduceScatterPlan(PairRun, ReduceScatterPlan):
    """The other rank's block rides with the check; its values of this rank's block are
    combined with this rank's into the result."""

    __slots__ = ("_mine", "_theirs", "_ufunc", "_nan_quiet", "_check")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        rank = backend.rank
        self._mine, self._theirs = pair_blocks(self._counts, rank)
        self._ufunc = UFUNCS[key.reduce_op]  # type: ignore[index]
        #: MIN and MAX meet NaN on purpose (they propagate it): no warning for that.
        self._nan_quiet = key.reduce_op in ("MIN", "MAX")
        size = key.dtype.itemsize
        self._check = RidingCheck.of(self, self._counts[1 - rank] * size,
                                     self._counts[rank] * size)

    def _exchange(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        flat = _flat(send)
        self._check.outgoing[...] = flat[self._theirs]
        self._check.agree()
        if self._nan_quiet:
            with np.errstate(invalid="ignore"):
                self._ufunc(flat[self._mine], self._check.incoming, out=_flat(out))
        else:
            self._ufunc(flat[self._mine], self._check.incoming, out=_flat(out))
        self._finish(out)
        return out

    def _move(self, send: Any, recv: Any) -> Any:
        raise AssertionError("a blocking riding reduce-scatter runs _exchange")


class PairRideAllGatherPlan(PairRun, AllGatherPlan):
    """This rank's block rides with the check; the other's lands in place from it."""

    __slots__ = ("_mine", "_theirs", "_check")

    def __init__(self, backend: MPIBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        rank, size = backend.rank, key.dtype.itemsize
        self._mine, self._theirs = pair_blocks(self._counts, rank)
        self._check = RidingCheck.of(self, self._counts[rank] * size,
                                     self._counts[1 - rank] * size)

    def _exchange(self, send: Any, recv: Any) -> Any:
        out = self._output(recv)
        self._check.outgoing[...] = _flat(send)
        self._check.agree()
        flat = _flat(out)
        flat[self._theirs] = self._check.incoming
        flat[self._mine] = _flat(send)
        return out

    def _move(self, send: Any, recv: Any) -> Any:
        raise AssertionError("a blocking riding all-gather runs _exchange")


__all__ = ["PairRideAllGatherPlan", "PairRidePlan", "PairRideReduceScatterPlan",
           "RidingCheck"]
