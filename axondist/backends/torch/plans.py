"""The torch backend's prepared calls: one class per collective and algorithm (see
:mod:`.choose`), each a checked call of torch.distributed on tensors over the caller's
buffers, or (the ``Wired`` classes) the same call's bytes on the group's own sockets
(:mod:`.wires`).

:meth:`TorchPlan.run` holds what every call shares: its number, its flight-recorder
entry, its cross-rank check and its place in the group's call order (a non-blocking call is
queued, see :class:`~.queues.CallOrder`). A subclass adds only :meth:`TorchPlan._move`: how
its data moves once the ranks agreed, as ``(torch's Work or None, what finishes the call
once that Work completed, or None)``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from math import prod
from typing import TYPE_CHECKING, Any

from ... import _array
from ...ops import combine_into
from ..checks import check_words
from ..plan import IN_PLACE, CallKey, Plan, checked_out, element_counts, output_shape, split_sizes
from .choose import Algorithm
from .interop import reduce_op
from .queues import QueuedWork

if TYPE_CHECKING:
    from .backend import TorchBackend

#: What a plan's move returns: torch's Work (None: done already) and what finishes the call.
Moved = tuple[Any, Callable[[], None] | None]


class TorchPlan(Plan):
    """A checked collective on torch.distributed: the key's check words, reduction op and
    output shape resolved once."""

    __slots__ = ("_b", "_guard", "_detail", "_check_key", "_words", "_xp", "_out_shape",
                 "_op", "_scale")

    def __init__(self, backend: TorchBackend, key: CallKey) -> None:
        super().__init__(key)
        self._b = backend
        self._guard = backend.guard
        self._detail = key.signature()
        self._check_key = self._detail + (("async_op", key.async_op),)
        self._words = check_words(key.collective, self._check_key)
        self._xp = _array.module_named(key.library)
        self._out_shape = output_shape(key, backend.rank, backend.world_size)
        self._op = None if key.op is None else reduce_op(backend.dist, key.op, key.dtype,
                                                         key.collective)
        #: The divisor of a mean (torch sums; the plan divides), else None.
        self._scale = backend.world_size if key.reduce_op == "AVERAGE" else None

    def run(self, send: Any, recv: Any = None) -> Any:
        key, guard, b = self.key, self._guard, self._b
        what = key.collective
        result = recv = send if what in IN_PLACE else self._output(recv)

        def issue() -> Moved:
            return b.translated(what, lambda: self._checked_move(send, recv))

        seq, slot = guard.begin(what, self._detail, blocking=not key.async_op)
        if key.async_op:
            guard.rec.end(slot)
            return QueuedWork(b, b.order.later(issue), result, what, seq)
        try:
            work, finish = b.order.now(issue)
        finally:
            guard.rec.end(slot)
        if work is not None:
            b.translated(what, work.wait)
        if finish is not None:
            finish()
        return result

    def _output(self, recv: Any) -> Any:
        """The buffer the result goes to: ``recv`` once checked, else a new one."""
        if recv is None:
            return self._xp.empty(self._out_shape, dtype=self.key.dtype)
        return checked_out(recv, self.key, self._out_shape, self.key.collective)

    def _checked_move(self, send: Any, recv: Any) -> Moved:
        if self._guard.checks:
            self._guard.agree(self.key.collective, self._check_key, self._words)
        return self._move(send, recv)

    def _move(self, send: Any, recv: Any) -> Moved:
        """Start moving the data of a checked call (see the module docstring)."""
        raise NotImplementedError

    def _mean(self, buf: Any) -> Callable[[], None] | None:
        """What turns the sum in ``buf`` into the mean (None unless an AVERAGE)."""
        if self._scale is None:
            return None
        n, xp = self._scale, self._xp
        return lambda: xp.divide(buf, n, out=buf, casting="unsafe")


# --- torch's own collectives ------------------------------------------------------------------

class AllReducePlan(TorchPlan):
    """torch's ``all_reduce`` in place."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b = self._b
        return (b.dist.all_reduce(b.tensor(send), self._op, group=b.pg, async_op=True),
                self._mean(send))


class BroadcastPlan(TorchPlan):
    """torch's ``broadcast`` in place."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b = self._b
        return b.dist.broadcast(b.tensor(send), group=b.pg, group_src=self.key.root,
                                async_op=True), None


class WiredBroadcastPlan(TorchPlan):
    """A broadcast of host memory on the group's own sockets, after the check on them."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, root = self._guard.wires, self.key.root
        assert wires is not None and root is not None  # a broadcast in a wired group
        wires.broadcast(send, root)
        return None, None


class WiredPairAllReducePlan(TorchPlan):
    """A two-member SUM or AVERAGE all-reduce of host memory on the group's own sockets,
    after the check on them: each member sums (and scales) the half it owns."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, scale = self._guard.wires, self._scale
        assert wires is not None  # an all-reduce in a wired group

        def combine(mine: Any, other: Any) -> None:
            self._xp.add(mine, other, out=mine)
            if scale is not None:
                self._xp.divide(mine, scale, out=mine, casting="unsafe")

        wires.pair_reduce(send, combine)
        return None, None


class WiredPairReduceScatterPlan(TorchPlan):
    """A two-member SUM or AVERAGE reduce-scatter of equal blocks of host memory on the
    group's own sockets, after the check on them: each member sends the other's block and
    sums (and scales) its own."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me = self._guard.wires, self._b.rank
        assert wires is not None  # a reduce-scatter in a wired group
        flat_out, flat_in = recv.reshape(-1), send.reshape(-1)
        size = flat_out.size
        blocks = (flat_in[:size], flat_in[size:2 * size])
        other = self._xp.empty_like(flat_out)
        wires.pair_swap(blocks[1 - me], other)
        self._xp.add(blocks[me], other, out=flat_out)
        return None, self._mean(flat_out)


class ReducePlan(TorchPlan):
    """torch's ``reduce`` into the root's buffer; a non-root reduces a copy (gloo may write
    a non-root's buffer)."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, root = self._b, self.key.root
        if b.rank == root:
            return b.dist.reduce(b.tensor(send), group=b.pg, group_dst=root, op=self._op,
                                 async_op=True), self._mean(send)
        scratch = self._xp.array(send, copy=True)
        return b.dist.reduce(b.tensor(scratch), group=b.pg, group_dst=root, op=self._op,
                             async_op=True), None


class AllGatherPlan(TorchPlan):
    """torch's ``all_gather_single`` of equal blocks."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b = self._b
        return b.dist.all_gather_single(b.tensor(recv.reshape(-1)), b.tensor(send.reshape(-1)),
                                        group=b.pg, async_op=True), None


class ReduceScatterPlan(TorchPlan):
    """torch's ``reduce_scatter_single`` of equal blocks."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, flat_out = self._b, recv.reshape(-1)
        work = b.dist.reduce_scatter_single(b.tensor(flat_out), b.tensor(send.reshape(-1)),
                                            op=self._op, group=b.pg, async_op=True)
        return work, self._mean(flat_out)


# --- blocks padded to the largest ---------------------------------------------------------------

class _BlocksPlan(TorchPlan):
    """A call whose data is cut into one block per rank (``_counts`` elements each: the
    key's, unless ``counts`` says otherwise)."""

    __slots__ = ("_counts", "_most")

    def __init__(self, backend: TorchBackend, key: CallKey,
                 counts: list[int] | None = None) -> None:
        super().__init__(backend, key)
        self._counts = element_counts(key, backend.world_size) if counts is None else counts
        self._most = max(self._counts)


def unpad(padded: Any, most: int, counts: list[int], out: Any) -> None:
    """Copy block k of ``padded`` (``counts[k]`` of its ``most`` elements) to the flat
    ``out``, one after another."""
    at = 0
    for k, c in enumerate(counts):
        out[at:at + c] = padded[k * most:k * most + c]
        at += c


def blocks_of(flat: Any, counts: list[int]) -> list[Any]:
    """The flat ``flat`` cut into consecutive blocks of ``counts`` elements (views)."""
    ends = list(accumulate(counts))
    return [flat[end - c:end] for c, end in zip(counts, ends, strict=True)]


def _others(n: int, me: int) -> list[int]:
    """Every group rank of ``n`` but ``me``."""
    return [p for p in range(n) if p != me]


def _share(wires: Any, blocks: list[Any], me: int) -> None:
    """An all-gather in place: ``blocks[me]`` (filled) goes to every other member, and each
    other member's block lands in its place in ``blocks`` (views of one flat buffer)."""
    peers = _others(len(blocks), me)
    wires.exchange(dict.fromkeys(peers, blocks[me]), {p: blocks[p] for p in peers})


def _collect(wires: Any, mine: Any, blocks: list[Any] | None, me: int, root: int) -> None:
    """A gather at ``root``: a member sends ``mine``; the root (whose own block the caller
    placed) reads every other member's into its place in ``blocks``."""
    if me != root:
        wires.exchange({root: mine}, {})
    else:
        assert blocks is not None  # the root's places
        wires.exchange({}, {p: blocks[p] for p in _others(len(blocks), me)})


class WiredAllGatherPlan(_BlocksPlan):
    """An all-gather of host memory on the group's own sockets, after the check on them:
    each member writes its block (of any size: nothing is padded) on every other member's
    connection and reads theirs straight into its output."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me = self._guard.wires, self._b.rank
        assert wires is not None  # an all-gather in a wired group
        blocks = blocks_of(recv.reshape(-1), self._counts)
        blocks[me][...] = send.reshape(-1)
        _share(wires, blocks, me)
        return None, None


class PaddedAllGatherPlan(_BlocksPlan):
    """An all-gather of uneven blocks: each rank's block zero-padded to the largest, torch's
    ``all_gather_single``, the padding dropped."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, counts, most, xp = self._b, self._counts, self._most, self._xp
        mine = xp.zeros(most, dtype=send.dtype)
        mine[:send.size] = send.reshape(-1)
        every = xp.empty(most * len(counts), dtype=send.dtype)
        work = b.dist.all_gather_single(b.tensor(every), b.tensor(mine), group=b.pg,
                                        async_op=True)
        return work, lambda: unpad(every, most, counts, recv.reshape(-1))


class PaddedReduceScatterPlan(_BlocksPlan):
    """A reduce-scatter of uneven blocks: the blocks zero-padded to the largest, torch's
    ``reduce_scatter_single``, this rank's block taken from its padded one."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, counts, most, xp = self._b, self._counts, self._most, self._xp
        blocks = xp.zeros(most * len(counts), dtype=send.dtype)
        flat, at = send.reshape(-1), 0
        for k, c in enumerate(counts):
            blocks[k * most:k * most + c] = flat[at:at + c]
            at += c
        mine = xp.empty(most, dtype=send.dtype)
        work = b.dist.reduce_scatter_single(b.tensor(mine), b.tensor(blocks), op=self._op,
                                            group=b.pg, async_op=True)
        mean, flat_out = self._mean(mine), recv.reshape(-1)

        def finish() -> None:
            if mean is not None:
                mean()
            flat_out[...] = mine[:flat_out.size]
        return work, finish


# --- sums in rank order -------------------------------------------------------------------------

class _RankOrderPlan(_BlocksPlan):
    """A SUM (or AVERAGE) whose every element is the same sum whatever the message's length
    or cut: every rank's copy of a rank's block arrives by one ``all_to_all_single``, and the
    copies are added in rank order (the mock world's bits). Blocking: a non-blocking call
    runs it on the group's issuing thread."""

    __slots__ = ()

    def _block_sum(self, flat: Any) -> Any:
        """This rank's block of the reduction of the flat ``flat`` cut into blocks of
        ``_counts`` elements, its copies combined in rank order (:func:`~axondist.ops.
        combine_into`, as the mock world combines them)."""
        assert self.key.op is not None  # a reduction
        copies = self._copies(flat)
        return combine_into(copies[0], list(copies), self.key.op)

    def _copies(self, flat: Any) -> Any:
        """Every rank's copy of this rank's block of ``flat``, one row per rank: torch's
        ``all_to_all_single``."""
        b, n, counts = self._b, self._b.world_size, self._counts
        size = counts[b.rank]
        copies = self._xp.empty(n * size, dtype=flat.dtype)
        b.dist.all_to_all_single(b.tensor(copies), b.tensor(flat), [size] * n, counts,
                                 group=b.pg)
        return copies.reshape(n, size)


class RankOrderReduceScatterPlan(_RankOrderPlan):
    """A reduce-scatter that adds in rank order (see :class:`_RankOrderPlan`)."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        recv.reshape(-1)[...] = self._block_sum(send.reshape(-1))
        return None, None


class RankOrderAllReducePlan(_RankOrderPlan):
    """An all-reduce that adds in rank order: the reduce-scatter of near-equal blocks (see
    :class:`_RankOrderPlan`), then an all-gather of the blocks padded to the largest."""

    __slots__ = ()

    def __init__(self, backend: TorchBackend, key: CallKey) -> None:
        super().__init__(backend, key, split_sizes(prod(key.shape), backend.world_size))

    def _move(self, send: Any, recv: Any) -> Moved:
        b, counts, most, xp = self._b, self._counts, self._most, self._xp
        flat = send.reshape(-1)
        mine = xp.zeros(most, dtype=flat.dtype)
        mine[:counts[b.rank]] = self._block_sum(flat)
        every = xp.empty(most * b.world_size, dtype=flat.dtype)
        b.dist.all_gather_single(b.tensor(every), b.tensor(mine), group=b.pg)
        unpad(every, most, counts, flat)
        return None, None


class _RankOrderOnWires(_RankOrderPlan):
    """A reduction of host memory combined in rank order (any op), whose copies travel on
    the group's own sockets after the check on them: each member writes every other
    member's block on that member's connection and reads the others' copies of its own (a
    sum: the same adds in the same order as through gloo's all-to-all, the same bits)."""

    __slots__ = ()

    def _copies(self, flat: Any) -> Any:
        wires, me, counts = self._guard.wires, self._b.rank, self._counts
        assert wires is not None  # a reduction in a wired group
        blocks = blocks_of(flat, counts)
        copies = self._xp.empty((len(counts), counts[me]), dtype=flat.dtype)
        copies[me] = blocks[me]
        peers = _others(len(counts), me)
        wires.exchange({p: blocks[p] for p in peers}, {p: copies[p] for p in peers})
        return copies


class WiredRankOrderReduceScatterPlan(_RankOrderOnWires, RankOrderReduceScatterPlan):
    """A reduce-scatter combined in rank order, on the group's own sockets."""

    __slots__ = ()


class WiredRankOrderAllReducePlan(_RankOrderOnWires, RankOrderAllReducePlan):
    """An all-reduce combined in rank order on the group's own sockets: the reduce-scatter
    of near-equal blocks, then each member writes its block of the result on every other
    member's connection and reads theirs into place."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me = self._guard.wires, self._b.rank
        assert wires is not None  # an all-reduce in a wired group
        flat = send.reshape(-1)
        block = self._block_sum(flat)
        blocks = blocks_of(flat, self._counts)
        blocks[me][...] = block
        _share(wires, blocks, me)
        return None, None


class WiredRankOrderReducePlan(_RankOrderOnWires):
    """A reduce combined in rank order on the group's own sockets: the reduce-scatter of
    near-equal blocks, then each member writes its block of the result on the root's
    connection, which reads them into place (the other members' buffers are left as they
    were)."""

    __slots__ = ()

    def __init__(self, backend: TorchBackend, key: CallKey) -> None:
        super().__init__(backend, key, split_sizes(prod(key.shape), backend.world_size))

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me, root = self._guard.wires, self._b.rank, self.key.root
        assert wires is not None and root is not None  # a reduce in a wired group
        flat = send.reshape(-1)
        block = self._block_sum(flat)
        blocks = None
        if me == root:
            blocks = blocks_of(flat, self._counts)
            blocks[me][...] = block
        _collect(wires, block, blocks, me, root)
        return None, None


# --- MIN and MAX with their NaNs ------------------------------------------------------------------

class NanAllReducePlan(TorchPlan):
    """A float MIN or MAX all-reduce whose NaNs survive: before torch's reduction (which
    drops them) starts, the OR over the ranks (a SUM of booleans) of where each rank's
    values are NaN starts; once both completed, the NaNs are put back where any rank had
    one."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, xp = self._b, self._xp
        flat = send.reshape(-1)
        mask = xp.isnan(flat)
        nans = b.dist.all_reduce(b.tensor(mask), b.dist.ReduceOp.SUM, group=b.pg,
                                 async_op=True)
        work = b.dist.all_reduce(b.tensor(send), self._op, group=b.pg, async_op=True)

        def restore() -> None:
            b.translated(self.key.collective, nans.wait)
            flat[mask] = xp.nan
        return work, restore


class _NanThroughAllReduce(TorchPlan):
    """A float MIN or MAX reduce or reduce-scatter as a :class:`NanAllReducePlan`'s move on
    a copy of the whole buffer, this rank's part of it kept."""

    __slots__ = ("_whole",)

    def __init__(self, backend: TorchBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        self._whole = NanAllReducePlan(backend, key)

    def _move_copy(self, send: Any, keep: Callable[[Any], None]) -> Moved:
        copy = self._xp.array(send.reshape(-1), copy=True)
        work, restore = self._whole._move(copy, None)

        def finish() -> None:
            if restore is not None:
                restore()
            keep(copy)
        return work, finish


class NanReducePlan(_NanThroughAllReduce):
    """A float MIN or MAX reduce: the all-reduce of a copy, kept on the root."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        def keep(copy: Any) -> None:
            if self._b.rank == self.key.root:
                send.reshape(-1)[...] = copy
        return self._move_copy(send, keep)


class NanReduceScatterPlan(_NanThroughAllReduce):
    """A float MIN or MAX reduce-scatter: the all-reduce of a copy, this rank's block
    kept."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, flat_out = self._b, recv.reshape(-1)
        lo = sum(element_counts(self.key, b.world_size)[:b.rank])

        def keep(copy: Any) -> None:
            flat_out[...] = copy[lo:lo + flat_out.size]
        return self._move_copy(send, keep)


# --- rooted calls and the all-to-all ------------------------------------------------------------

class GatherPlan(_BlocksPlan):
    """torch's ``gather`` of equal blocks, straight into the root's result (None
    elsewhere)."""

    __slots__ = ()

    def _output(self, recv: Any) -> Any:
        return super()._output(recv) if self._b.rank == self.key.root else None

    def _move(self, send: Any, recv: Any) -> Moved:
        b, most = self._b, self._most
        blocks = None if recv is None else [
            b.tensor(block) for block in recv.reshape(-1).reshape(len(self._counts), most)]
        return b.dist.gather(b.tensor(send.reshape(-1)), blocks, group=b.pg,
                             group_dst=self.key.root, async_op=True), None


class PaddedGatherPlan(GatherPlan):
    """A gather of uneven blocks: each rank's block zero-padded to the largest, torch's
    ``gather`` on the root, the padding dropped there."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, counts, most, xp = self._b, self._counts, self._most, self._xp
        mine = xp.zeros(most, dtype=send.dtype)
        mine[:send.size] = send.reshape(-1)
        every = None if recv is None else xp.empty(most * len(counts), dtype=send.dtype)
        blocks = None if every is None else [
            b.tensor(block) for block in every.reshape(len(counts), most)]
        work = b.dist.gather(b.tensor(mine), blocks, group=b.pg, group_dst=self.key.root,
                             async_op=True)
        if every is None:
            return work, None
        return work, lambda: unpad(every, most, counts, recv.reshape(-1))


class ScatterPlan(_BlocksPlan):
    """torch's ``scatter`` of equal blocks of the root's array (``send``, None elsewhere)."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, most = self._b, self._most
        blocks = None if send is None else [
            b.tensor(block) for block in send.reshape(-1).reshape(len(self._counts), most)]
        return b.dist.scatter(b.tensor(recv.reshape(-1)), blocks, group=b.pg,
                              group_src=self.key.root, async_op=True), None


class PaddedScatterPlan(ScatterPlan):
    """A scatter of uneven blocks: the root's blocks zero-padded to the largest, torch's
    ``scatter``, each rank's block taken from its padded one."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        b, counts, most, xp = self._b, self._counts, self._most, self._xp
        mine = xp.empty(most, dtype=recv.dtype)
        blocks = None
        if send is not None:
            padded = xp.zeros(most * len(counts), dtype=send.dtype)
            flat, at = send.reshape(-1), 0
            for k, c in enumerate(counts):
                padded[k * most:k * most + c] = flat[at:at + c]
                at += c
            blocks = [b.tensor(block) for block in padded.reshape(len(counts), most)]
        work = b.dist.scatter(b.tensor(mine), blocks, group=b.pg, group_src=self.key.root,
                              async_op=True)
        flat_out = recv.reshape(-1)

        def finish() -> None:
            flat_out[...] = mine[:flat_out.size]
        return work, finish


class AllToAllPlan(TorchPlan):
    """torch's ``all_to_all_single``, with the element counts this rank sends and
    receives (the key's row counts: to each rank, then from each)."""

    __slots__ = ("_sent", "_came")

    def __init__(self, backend: TorchBackend, key: CallKey) -> None:
        super().__init__(backend, key)
        n, row = backend.world_size, prod(key.shape[1:])
        counts = list(key.counts or ())
        self._sent = [c * row for c in counts[:n]]
        self._came = [c * row for c in counts[n:]]

    def _move(self, send: Any, recv: Any) -> Moved:
        b = self._b
        return b.dist.all_to_all_single(b.tensor(recv.reshape(-1)), b.tensor(send.reshape(-1)),
                                        self._came, self._sent, group=b.pg,
                                        async_op=True), None


# --- rooted calls and the all-to-all on the group's own sockets ----------------------------------

class WiredGatherPlan(GatherPlan):
    """A gather of host memory on the group's own sockets, after the check on them: each
    member writes its block (of any size) on the root's connection, and the root reads them
    straight into its result."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me, root = self._guard.wires, self._b.rank, self.key.root
        assert wires is not None and root is not None  # a gather in a wired group
        mine, blocks = send.reshape(-1), None
        if me == root:
            blocks = blocks_of(recv.reshape(-1), self._counts)
            blocks[me][...] = mine
        _collect(wires, mine, blocks, me, root)
        return None, None


class WiredScatterPlan(ScatterPlan):
    """A scatter of host memory on the group's own sockets, after the check on them: the
    root writes each member's block (of any size) on its connection."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me, root = self._guard.wires, self._b.rank, self.key.root
        assert wires is not None and root is not None  # a scatter in a wired group
        if me != root:
            wires.exchange({}, {root: recv.reshape(-1)})
            return None, None
        blocks = blocks_of(send.reshape(-1), self._counts)
        recv.reshape(-1)[...] = blocks[me]
        wires.exchange({p: blocks[p] for p in _others(len(blocks), me)}, {})
        return None, None


class WiredAllToAllPlan(AllToAllPlan):
    """An all-to-all of host memory on the group's own sockets, after the check on them:
    each member writes block ``p`` of its input on member ``p``'s connection and reads
    what each member sent it straight into its output."""

    __slots__ = ()

    def _move(self, send: Any, recv: Any) -> Moved:
        wires, me = self._guard.wires, self._b.rank
        assert wires is not None  # an all-to-all in a wired group
        sent = blocks_of(send.reshape(-1), self._sent)
        came = blocks_of(recv.reshape(-1), self._came)
        came[me][...] = sent[me]
        others = _others(len(sent), me)
        wires.exchange({p: sent[p] for p in others}, {p: came[p] for p in others})
        return None, None


#: The plan class of each collective and algorithm the table can choose.
PLANS: dict[tuple[str, Algorithm], type[TorchPlan]] = {
    ("all_reduce", Algorithm.TORCH): AllReducePlan,
    ("all_reduce", Algorithm.RANK_ORDER_SUM): RankOrderAllReducePlan,
    ("all_reduce", Algorithm.RANK_ORDER_WIRES): WiredRankOrderAllReducePlan,
    ("all_reduce", Algorithm.NAN_RESTORE): NanAllReducePlan,
    ("all_reduce", Algorithm.PAIR_WIRES): WiredPairAllReducePlan,
    ("broadcast", Algorithm.TORCH): BroadcastPlan,
    ("broadcast", Algorithm.WIRES): WiredBroadcastPlan,
    ("reduce", Algorithm.TORCH): ReducePlan,
    ("reduce", Algorithm.NAN_RESTORE): NanReducePlan,
    ("reduce", Algorithm.RANK_ORDER_WIRES): WiredRankOrderReducePlan,
    ("all_gather", Algorithm.TORCH): AllGatherPlan,
    ("all_gather", Algorithm.PADDED): PaddedAllGatherPlan,
    ("all_gather", Algorithm.WIRES): WiredAllGatherPlan,
    ("reduce_scatter", Algorithm.TORCH): ReduceScatterPlan,
    ("reduce_scatter", Algorithm.RANK_ORDER_SUM): RankOrderReduceScatterPlan,
    ("reduce_scatter", Algorithm.RANK_ORDER_WIRES): WiredRankOrderReduceScatterPlan,
    ("reduce_scatter", Algorithm.NAN_RESTORE): NanReduceScatterPlan,
    ("reduce_scatter", Algorithm.PADDED): PaddedReduceScatterPlan,
    ("reduce_scatter", Algorithm.PAIR_WIRES): WiredPairReduceScatterPlan,
    ("gather", Algorithm.TORCH): GatherPlan,
    ("gather", Algorithm.PADDED): PaddedGatherPlan,
    ("gather", Algorithm.WIRES): WiredGatherPlan,
    ("scatter", Algorithm.TORCH): ScatterPlan,
    ("scatter", Algorithm.PADDED): PaddedScatterPlan,
    ("scatter", Algorithm.WIRES): WiredScatterPlan,
    ("all_to_all", Algorithm.TORCH): AllToAllPlan,
    ("all_to_all", Algorithm.WIRES): WiredAllToAllPlan,
}


__all__ = ["PLANS", "AllGatherPlan", "AllReducePlan", "AllToAllPlan", "BroadcastPlan",
           "GatherPlan", "NanAllReducePlan", "NanReducePlan", "NanReduceScatterPlan",
           "PaddedAllGatherPlan", "PaddedGatherPlan", "PaddedReduceScatterPlan",
           "PaddedScatterPlan", "RankOrderAllReducePlan", "RankOrderReduceScatterPlan",
           "ReducePlan", "ReduceScatterPlan", "ScatterPlan", "TorchPlan", "WiredAllGatherPlan",
           "WiredAllToAllPlan", "WiredGatherPlan", "WiredPairAllReducePlan",
           "WiredPairReduceScatterPlan", "WiredRankOrderAllReducePlan",
           "WiredRankOrderReducePlan", "WiredRankOrderReduceScatterPlan", "WiredScatterPlan",
           "blocks_of", "unpad"]
