"""The mock world's plans: each collective as one round of the world's threads.

A plan's :meth:`~MockPlan.run` deposits this rank's buffers in the round of its call
(:meth:`MockBackend._run <axondist.backends.mock.backend.MockBackend._run>`); the last rank
to arrive checks that every rank made the same call (the key's signature, compared as the
other backends compare it) and then does the round's work for every rank: the parts below,
each writing one slice of the ranks' results from every rank's inputs. Reductions combine
in rank order, so every run gives the same bits.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

from ... import _array
from ...errors import InvalidBufferError
from ...ops import ReduceOp, combine_into
from ..plan import CallKey, Plan, checked_out, output_shape, split_sizes
from ..work import MappedWork, ThenWork
from .world import _Round

if TYPE_CHECKING:
    from .backend import MockBackend

#: Bytes of one buffer per part of a large all-reduce (parts are claimed one at a time,
#: so a rank that wakes late finds less left to do).
_PART_BYTES = 256 << 10


class MockPlan(Plan):
    """What every mock plan keeps: the backend, the call as the ranks compare it, the
    result's shape and array library, the element counts of its blocks, how many parts
    its round has and the bytes it moves."""

    __slots__ = ("_b", "_call", "_out_shape", "_xp", "_elements", "_parts", "_bytes", "_op",
                 "_root")

    def __init__(self, backend: MockBackend, key: CallKey) -> None:
        super().__init__(key)
        n = backend.world_size
        self._b = backend
        self._call = (("op", key.collective),) + key.signature() + (("async_op", key.async_op),)
        self._out_shape = output_shape(key, backend.rank, n)
        self._xp = _array.module_named(key.library)
        row = prod(key.shape[1:])
        rows = key.counts if key.counts is not None else split_sizes(
            key.shape[0] if key.shape else 0, n)
        self._elements = [r * row for r in rows]
        self._parts = n
        self._bytes = 2 * n * prod(key.shape) * key.dtype.itemsize
        self._op: Any = None if key.reduce_op is None else ReduceOp[key.reduce_op]
        self._root = -1 if key.root is None else key.root

    def _output(self, recv: Any) -> Any:
        if recv is None:
            return self._xp.empty(self._out_shape, dtype=self.key.dtype)
        return checked_out(recv, self.key, self._out_shape, self.key.collective)

    def _round(self, payload: Any, result: Any) -> Any:
        """Take part in this call's round with ``payload``; ``result`` once it is done (a
        Work answering it for a non-blocking call)."""
        work = self._b._run(self.key.collective, payload, self._call, self.key.async_op,
                            self._part, self._parts, self._whole, self._bytes)
        return MappedWork(work, result) if self.key.async_op else result

    def _part(self, rnd: _Round, i: int) -> None:
        """Write part ``i`` of the round's results."""
        raise NotImplementedError

    _whole: Any = None  # a plan that does its round in one step sets it


class AllReducePlan(MockPlan):
    """The ranks' buffers combined in rank order into rank 0's, then copied into the
    others'; a large buffer in slices of about 256 KiB, which the ranks share."""

    __slots__ = ()

    def __init__(self, backend: MockBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        nbytes = prod(key.shape) * key.dtype.itemsize
        self._parts = max(1, min(nbytes // _PART_BYTES, 4 * backend.world_size))

    def run(self, send: Any, recv: Any = None) -> Any:
        work = self._b._run("all_reduce", send, self._call, self.key.async_op, self._part,
                            self._parts, self._whole, self._bytes)
        return MappedWork(work, send) if self.key.async_op else send

    def _part(self, rnd: _Round, i: int) -> None:
        numel, m = rnd.payloads[0].size, rnd.parts
        lo, hi = i * numel // m, (i + 1) * numel // m
        _reduce_and_copy([f.reshape(-1)[lo:hi] for f in rnd.payloads], self._op)

    def _whole(self, rnd: _Round) -> None:
        _reduce_and_copy(rnd.payloads, self._op)


class ReducePlan(MockPlan):
    """The ranks' buffers combined in rank order into the root's (others keep theirs)."""

    __slots__ = ()

    def __init__(self, backend: MockBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._parts = 1

    def run(self, send: Any, recv: Any = None) -> Any:
        return self._round(send, send)

    def _whole(self, rnd: _Round) -> None:
        bufs, root = rnd.payloads, self._root
        if root == 0:
            combine_into(bufs[0], bufs, self._op)
        else:
            bufs[root][...] = combine_into(_array.namespace(bufs[0]).empty_like(bufs[0]),
                                           bufs, self._op)

    def _part(self, rnd: _Round, i: int) -> None:
        self._whole(rnd)


class BroadcastPlan(MockPlan):
    """The root's buffer copied into every other rank's, one part per rank."""

    __slots__ = ()

    def run(self, send: Any, recv: Any = None) -> Any:
        return self._round(send, send)

    def _part(self, rnd: _Round, k: int) -> None:
        if k != self._root:
            rnd.payloads[k][...] = rnd.payloads[self._root]


class AllGatherPlan(MockPlan):
    """Every rank's rows written into each rank's result, one part per rank."""

    __slots__ = ()

    def run(self, send: Any, recv: Any = None) -> Any:
        out = self._output(recv)
        return self._round((send, out), out)

    def _part(self, rnd: _Round, k: int) -> None:
        _concatenate(rnd.payloads[k][1], [p[0] for p in rnd.payloads], self._elements)


class UnsizedAllGatherPlan(MockPlan):
    """An all-gather whose row counts the round itself learns: each rank's result is made
    (or its ``out`` checked) once every rank's rows are there."""

    __slots__ = ()

    def run(self, send: Any, recv: Any = None) -> Any:
        payload = [send, recv, None]
        work = self._b._run("all_gather", payload, self._call, self.key.async_op, self._part,
                            self._parts, None, self._bytes)
        if self.key.async_op:
            return ThenWork(work, lambda _: self._result(payload))
        return self._result(payload)

    def _result(self, payload: list[Any]) -> Any:
        send, out, made = payload
        if out is not None and made is not out:  # this rank's out cannot hold the result
            checked_out(out, self.key, made.shape, "all_gather")
        return made

    def _part(self, rnd: _Round, k: int) -> None:
        payload = rnd.payloads[k]
        sends = [p[0] for p in rnd.payloads]
        shape = (sum(s.shape[0] for s in sends),) + tuple(self.key.shape[1:])
        target = payload[1]
        try:
            target = checked_out(target, self.key, shape, "all_gather")
        except InvalidBufferError:
            target = None  # its rank raises, after the round
        if target is None:
            target = self._xp.empty(shape, dtype=self.key.dtype)
        _concatenate(target, sends, [s.size for s in sends])
        payload[2] = target


class ReduceScatterPlan(MockPlan):
    """Block k of the ranks' inputs combined in rank order into rank k's result."""

    __slots__ = ()

    def run(self, send: Any, recv: Any = None) -> Any:
        out = self._output(recv)
        return self._round((send, out), out)

    def _part(self, rnd: _Round, k: int) -> None:
        lo = sum(self._elements[:k])
        hi = lo + self._elements[k]
        combine_into(rnd.payloads[k][1].reshape(-1),
                     [p[0].reshape(-1)[lo:hi] for p in rnd.payloads], self._op)


class GatherPlan(MockPlan):
    """Every rank's rows written into the root's result; None on the others."""

    __slots__ = ()

    def __init__(self, backend: MockBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._parts = 1

    def run(self, send: Any, recv: Any = None) -> Any:
        out = self._output(recv) if self._b.rank == self._root else None
        return self._round((send, out), out)

    def _whole(self, rnd: _Round) -> None:
        _concatenate(rnd.payloads[self._root][1], [p[0] for p in rnd.payloads],
                     self._elements)

    def _part(self, rnd: _Round, i: int) -> None:
        self._whole(rnd)


class ScatterPlan(MockPlan):
    """Block k of the root's array copied into rank k's result, one part per rank."""

    __slots__ = ()

    def run(self, send: Any, recv: Any = None) -> Any:
        out = self._output(recv)
        return self._round((send, out), out)

    def _part(self, rnd: _Round, k: int) -> None:
        lo = sum(self._elements[:k])
        whole = rnd.payloads[self._root][0].reshape(-1)
        rnd.payloads[k][1].reshape(-1)[...] = whole[lo:lo + self._elements[k]]


class AllToAllPlan(MockPlan):
    """Rank k's result: the block every rank holds for k, in rank order, one part per
    receiving rank (each rank's payload says where its blocks lie)."""

    __slots__ = ("_sent",)

    def __init__(self, backend: MockBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        n, row = backend.world_size, prod(key.shape[1:])
        counts = [c * row for c in (key.counts or ())[:n]]
        #: ``_sent[d]``: the elements of this rank's input that go to rank d.
        self._sent = [(sum(counts[:d]), sum(counts[:d + 1])) for d in range(n)]

    def run(self, send: Any, recv: Any = None) -> Any:
        out = self._output(recv)
        return self._round((send, out, self._sent), out)

    def _part(self, rnd: _Round, k: int) -> None:
        target, at = rnd.payloads[k][1].reshape(-1), 0
        for send, _, sent in rnd.payloads:
            lo, hi = sent[k]
            target[at:at + hi - lo] = send.reshape(-1)[lo:hi]
            at += hi - lo


#: The plan of each collective (an all-gather without row counts: UnsizedAllGatherPlan).
PLANS: dict[str, type[MockPlan]] = {
    "all_reduce": AllReducePlan,
    "broadcast": BroadcastPlan,
    "reduce": ReducePlan,
    "all_gather": AllGatherPlan,
    "reduce_scatter": ReduceScatterPlan,
    "gather": GatherPlan,
    "scatter": ScatterPlan,
    "all_to_all": AllToAllPlan,
}


def _reduce_and_copy(parts: list[Any], op: ReduceOp | None) -> None:
    """Combine ``parts`` into ``parts[0]`` in rank order, then copy it into the others."""
    combine_into(parts[0], parts, op)  # type: ignore[arg-type]
    for part in parts[1:]:
        part[...] = parts[0]


def _concatenate(recv: Any, sends: list[Any], counts: list[int]) -> None:
    """Write ``sends`` (``counts[k]`` elements from the k-th) one after another into ``recv``."""
    flat, off = recv.reshape(-1), 0
    for send, c in zip(sends, counts):
        flat[off:off + c] = send.reshape(-1)
        off += c


__all__ = ["PLANS", "MockPlan", "UnsizedAllGatherPlan"]
