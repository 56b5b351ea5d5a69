"""Collective plans built on point-to-point messages alone, correct on any backend.

A backend's :meth:`~axondist.backends.base.Backend.make_plan` returns :func:`p2p_plan` for
every call it does not run its own way. The plans move data with the backend's ``send``
and ``recv`` only, on the tag :data:`COLLECTIVE_TAG`, and need nothing else of it:

- **No deadlock, even when a send waits for its receive.** Every message of a call has a
  place in one order that every rank walks (by sender, then receiver); when the earliest
  message not yet delivered is the k-th, its sender and receiver have finished all their
  earlier ones, so both stand at it and it completes.
- **Reductions in rank order.** Each block of a reduction is combined by one rank, in rank
  order (:func:`axondist.ops.combine_into`), so a float sum has the same bits on every rank
  and every run, as on the mock world. An all-reduce is a reduce-scatter of n blocks and an
  all-gather of the results: ``2 (n - 1) / n`` of the buffer in and out of each rank.
- **Non-blocking calls** run to the end before they return a completed Work.

Half-precision means widen to float32 (:class:`~axondist.backends.plan.WidenedMeanPlan`)
and an all-gather without row counts exchanges them first
(:class:`~axondist.backends.plan.UnsizedAllGatherPlan`), both through the backend's plans.
These plans do not check that the ranks made the same call: a backend with a cross-rank
check runs it around them (:mod:`axondist.backends.checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import TYPE_CHECKING, Any

from .. import _array
from ..ops import ReduceOp, combine_into
from .plan import (
    CallKey,
    Plan,
    UnsizedAllGatherPlan,
    WidenedMeanPlan,
    checked_out,
    output_shape,
    split_sizes,
)
from .work import CompletedWork

if TYPE_CHECKING:
    from .base import Backend

#: The tag of every message of these plans (MPI guarantees tags up to 32767; halved by
#: backends that keep a second tag space for object headers). A backend whose users may
#: send on this tag keeps the plans' messages apart (a communicator of their own).
COLLECTIVE_TAG = 16383



class P2PPlan(Plan):
    """What every point-to-point plan keeps: the backend, the group's size and this rank,
    the array library, the result's shape and the rows of the call's blocks."""

    __slots__ = ("_b", "_n", "_me", "_xp", "_out_shape", "_row")

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(key)
        self._b = backend
        self._n = backend.world_size
        self._me = backend.rank
        self._xp = _array.module_named(key.library)
        self._out_shape = output_shape(key, backend.rank, backend.world_size)
        self._row = prod(key.shape[1:])

    def run(self, send: Any, recv: Any = None) -> Any:
        result = self._move(send, recv)
        return CompletedWork(result) if self.key.async_op else result

    def _move(self, send: Any, recv: Any) -> Any:
        """Do the call; its result."""
        raise NotImplementedError

    def _output(self, recv: Any) -> Any:
        if recv is None:
            return self._xp.empty(self._out_shape, dtype=self.key.dtype)
        return checked_out(recv, self.key, self._out_shape, self.key.collective)

    def _send(self, buf: Any, dst: int) -> None:
        if buf.size:
            self._b.send(buf, dst, COLLECTIVE_TAG)

    def _recv(self, buf: Any, src: int) -> None:
        if buf.size:
            self._b.recv(buf, src, COLLECTIVE_TAG)

    def _exchange(self, outgoing: Callable[[int], Any], incoming: Callable[[int], Any],
                  senders: range | list[int] | None = None,
                  receivers: range | list[int] | None = None) -> None:
        """Every message from a rank of ``senders`` to another rank of ``receivers``
        (all ranks when None), in the one order every rank walks: ``outgoing(dst)`` is this
        rank's message to ``dst``, ``incoming(src)`` the buffer for ``src``'s."""
        me = self._me
        for src in range(self._n) if senders is None else senders:
            for dst in range(self._n) if receivers is None else receivers:
                if src == dst:
                    continue
                if src == me:
                    self._send(outgoing(dst), dst)
                elif dst == me:
                    self._recv(incoming(src), src)

    def _combine(self, out: Any, mine: Any, received: list[Any]) -> None:
        """``out`` = the ranks' blocks combined in rank order (``mine`` this rank's,
        ``received[k]`` rank k's; ``out`` may be ``mine``)."""
        blocks = list(received)
        blocks[self._me] = mine if self._me == 0 or out is not mine else mine.copy()
        combine_into(out, blocks, ReduceOp[self.key.reduce_op])  # type: ignore[misc]


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` of consecutive blocks of ``sizes``."""
    out, at = [], 0
    for size in sizes:
        out.append((at, at + size))
        at += size
    return out


class P2PReduceScatterPlan(P2PPlan):
    """Rank d receives block d of every other rank's ``send`` and combines them in rank
    order into its result."""

    __slots__ = ("_blocks",)

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        rows = key.counts if key.counts is not None else split_sizes(key.shape[0], self._n)
        self._blocks = _bounds(list(rows))

    def _move(self, send: Any, recv: Any) -> Any:
        out, blocks, me = self._output(recv), self._blocks, self._me
        lo, hi = blocks[me]
        received = [self._xp.empty_like(out) for _ in range(self._n)]
        self._exchange(lambda d: send[blocks[d][0]:blocks[d][1]], lambda s: received[s])
        self._combine(out, send[lo:hi], received)
        return out


class P2PAllReducePlan(P2PPlan):
    """A reduce-scatter of n near-equal blocks of the flat buffer (each combined by its
    owner in rank order), then an all-gather of the combined blocks, in place."""

    __slots__ = ("_blocks",)

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._blocks = _bounds(split_sizes(prod(key.shape), self._n))

    def _move(self, send: Any, recv: Any) -> Any:
        flat, blocks, me = send.reshape(-1), self._blocks, self._me
        lo, hi = blocks[me]
        own = flat[lo:hi]
        received = [self._xp.empty(hi - lo, dtype=flat.dtype) for _ in range(self._n)]
        self._exchange(lambda d: flat[blocks[d][0]:blocks[d][1]], lambda s: received[s])
        self._combine(own, own, received)
        self._exchange(lambda d: own, lambda s: flat[blocks[s][0]:blocks[s][1]])
        return send


class P2PReducePlan(P2PPlan):
    """Every rank's buffer to the root, which combines them in rank order into its own."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        root = self.key.root
        assert root is not None
        received = [self._xp.empty_like(send) for _ in range(self._n)] \
            if self._me == root else []
        self._exchange(lambda d: send, lambda s: received[s], receivers=[root])
        if self._me == root:
            self._combine(send, send, received)
        return send


class P2PBroadcastPlan(P2PPlan):
    """The root sends its buffer to every other rank."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Any:
        root = self.key.root
        assert root is not None
        self._exchange(lambda d: send, lambda s: send, senders=[root])
        return send


class P2PAllGatherPlan(P2PPlan):
    """Every rank sends its rows to every other, into the result's block of its rank."""

    __slots__ = ("_blocks",)

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._blocks = _bounds(list(key.counts or ()))

    def _move(self, send: Any, recv: Any) -> Any:
        out, blocks = self._output(recv), self._blocks
        lo, hi = blocks[self._me]
        out[lo:hi] = send
        self._exchange(lambda d: send, lambda s: out[blocks[s][0]:blocks[s][1]])
        return out


class P2PGatherPlan(P2PPlan):
    """Every rank sends its rows to the root, into the result's block of its rank."""

    __slots__ = ("_blocks",)

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._blocks = _bounds(list(key.counts or ()))

    def _move(self, send: Any, recv: Any) -> Any:
        root, blocks = self.key.root, self._blocks
        assert root is not None
        out = self._output(recv) if self._me == root else None
        if out is not None:
            lo, hi = blocks[root]
            out[lo:hi] = send
        self._exchange(lambda d: send, lambda s: out[blocks[s][0]:blocks[s][1]],  # type: ignore[index]
                       receivers=[root])
        return out


class P2PScatterPlan(P2PPlan):
    """The root sends block r of its array to rank r."""

    __slots__ = ("_blocks",)

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        rows = key.counts if key.counts is not None else split_sizes(key.shape[0], self._n)
        self._blocks = _bounds(list(rows))

    def _move(self, send: Any, recv: Any) -> Any:
        root, blocks, out = self.key.root, self._blocks, self._output(recv)
        assert root is not None
        if self._me == root:
            lo, hi = blocks[root]
            out[...] = send[lo:hi]
        self._exchange(lambda d: send[blocks[d][0]:blocks[d][1]], lambda s: out,
                       senders=[root])
        return out


class P2PAllToAllPlan(P2PPlan):
    """Rank s sends its block for rank d straight to d, which receives it into the
    result's block of rank s."""

    __slots__ = ("_sent", "_came")

    def __init__(self, backend: Backend, key: CallKey) -> None:
        super().__init__(backend, key)
        n, counts = self._n, list(key.counts or ())
        self._sent = _bounds(counts[:n])
        self._came = _bounds(counts[n:])

    def _move(self, send: Any, recv: Any) -> Any:
        out, sent, came, me = self._output(recv), self._sent, self._came, self._me
        out[came[me][0]:came[me][1]] = send[sent[me][0]:sent[me][1]]
        self._exchange(lambda d: send[sent[d][0]:sent[d][1]],
                       lambda s: out[came[s][0]:came[s][1]])
        return out


#: The point-to-point plan of each collective.
P2P_PLANS: dict[str, type[P2PPlan]] = {
    "all_reduce": P2PAllReducePlan,
    "broadcast": P2PBroadcastPlan,
    "reduce": P2PReducePlan,
    "all_gather": P2PAllGatherPlan,
    "reduce_scatter": P2PReduceScatterPlan,
    "gather": P2PGatherPlan,
    "scatter": P2PScatterPlan,
    "all_to_all": P2PAllToAllPlan,
}


def p2p_plan(backend: Backend, key: CallKey) -> Plan:
    """A correct plan of ``key`` over ``backend.send``/``recv`` alone (see the module
    docstring): what a backend's ``make_plan`` returns for the calls it does not
    specialise."""
    if key.reduce_op == "AVERAGE" and key.dtype.name in _array.HALF_PRECISION:
        return WidenedMeanPlan(backend, key)
    if key.collective == "all_gather" and key.counts is None:
        return UnsizedAllGatherPlan(backend, key)
    return P2P_PLANS[key.collective](backend, key)


__all__ = ["COLLECTIVE_TAG", "P2P_PLANS", "P2PPlan", "p2p_plan"]
