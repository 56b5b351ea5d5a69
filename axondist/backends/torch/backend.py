"""The torch backend: one rank's endpoint in a ``torch.distributed`` process group.

torch picks the engine by where a buffer lives: gloo for NumPy arrays (seen as CPU
tensors) and NCCL for CuPy arrays (CUDA tensors), both through DLPack without copies.
Every call is numbered, recorded and checked across ranks first
(:class:`~axondist.backends.torch.guard.TorchGuard`), so a mismatch raises the same
error as on the other backends instead of gloo's abort. What gloo cannot do directly, the
plans here arrange: uneven all-gathers, reduce-scatters, gathers and scatters run on
blocks padded to the largest, a mean is a SUM then a division (as on MPI), and a
point-to-point message carries a small header first, so a receive of the wrong size
raises instead of ending the process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import _array
from ..._frameworks import TORCH
from ..._validate import as_rank
from ...errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidBufferError,
    TooManyGroupsError,
    WorldAbortedError,
)
from ...ops import ReduceOp
from .._diagnostics import process_gone
from ..base import PlannedBackend, Signature
from ..call_check import Key, agreed, check_words
from ..plan import (
    IN_PLACE,
    CallKey,
    Plan,
    UnsizedAllGatherPlan,
    WidenedMeanPlan,
    checked_out,
    element_counts,
    output_shape,
    split_sizes,
)
from ..recorder import FlightRecorder
from ..work import CompletedWork, PolledWork, Work
from .guard import TorchGuard
from .interop import load_torch, reduce_op

_HALF = frozenset(d for d in _array.SUPPORTED_DTYPES if d.itemsize == 2 and d.kind != "i")
_INT64 = np.dtype(np.int64)
#: What gloo's errors say when a peer's process ended.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: Seconds a call whose peer's connection closed looks for the rank whose process ended.
_GONE_WITHIN = 1.0
#: Sends up to this many bytes return at once, from copies (MPI's eager sends do too).
EAGER_BYTES = 64 << 10
#: Tags a user tag maps to: a message's header and data, and an object's header and bytes.
_TAG_KINDS = 4
#: The most groups made by ``new_group`` that may be alive at once on a rank: each holds a
#: gloo process group, with its threads (two workers and a socket loop) and a connection to
#: every other member, for as long as it lives.
MAX_GROUPS = 1000


def _tags(tag: int) -> tuple[int, int, int, int]:
    base = _TAG_KINDS * int(tag)
    return base, base + 1, base + 2, base + 3


def _ended(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended: gone, or ended and waiting for its
    parent to collect it (a zombie: its sockets are closed already)."""
    if process_gone(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def node_info(hosts: Sequence[str], rank: int) -> tuple[int, int, int]:
    """(node id, local rank, local size) of ``rank`` from every rank's host name; nodes
    are numbered by their first rank, so every rank agrees."""
    order = list(dict.fromkeys(hosts))
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return order.index(hosts[rank]), local.index(rank), len(local)


class TorchPlan(Plan):
    """A checked collective on torch.distributed: the key's check words, reduction op,
    padding and output shape resolved once; :meth:`run` numbers, records and checks the
    call, then starts torch's collective on tensors over the caller's buffers."""

    __slots__ = ("_b", "_guard", "_detail", "_check_key", "_words", "_xp", "_out_shape",
                 "_op", "_counts", "_padded", "_scale", "_nans", "_in_rank_order", "_move")

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
        self._scale = backend.world_size if key.reduce_op == "AVERAGE" else None
        #: gloo's MIN and MAX drop NaNs; a second, boolean reduction puts them back.
        self._nans = key.reduce_op in ("MIN", "MAX") and _array.is_floating(key.dtype)
        #: Sums of floats over 3 ranks or more add the ranks' values in rank order (gloo's
        #: ring adds each element in an order that depends on the message's length).
        self._in_rank_order = (backend.world_size > 2 and key.reduce_op in ("SUM", "AVERAGE")
                               and (_array.is_floating(key.dtype) or key.dtype.kind == "c"))
        self._counts: list[int] = []
        self._padded = False
        if key.collective in ("all_gather", "reduce_scatter"):
            self._counts = element_counts(key, backend.world_size)
            self._padded = len(set(self._counts)) > 1
        self._move: Callable[[Any, Any], tuple[Any, Callable[[], None] | None]] = \
            getattr(self, f"_{key.collective}")

    def run(self, send: Any, recv: Any = None) -> Any:
        key, guard, b = self.key, self._guard, self._b
        what = key.collective
        if what in IN_PLACE:
            result = send
        elif recv is None:
            result = recv = self._xp.empty(self._out_shape, dtype=key.dtype)
        else:
            result = checked_out(recv, key, self._out_shape, what)

        def issue() -> tuple[Any, Callable[[], None] | None]:
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

    def _checked_move(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        if self._guard.checks:
            self._guard.agree(self.key.collective, self._check_key, self._words)
        return self._move(send, recv)

    # --- each collective: start it, and what finishes it once it completed ----------------
    def _mean(self, buf: Any) -> Callable[[], None] | None:
        if self._scale is None:
            return None
        n = self._scale
        return lambda: self._xp.divide(buf, n, out=buf, casting="unsafe")

    def _nans_back(self, values: Any, start: Callable[[Any], Any]) -> Callable[[], None]:
        """What puts NaNs back into a MIN or MAX's result ``values`` (gloo's comparisons drop
        them): ``start(mask)`` starts the OR over the ranks (a SUM of booleans) of where
        each rank's input is NaN, shaped as ``values``. Called before the values' own
        reduction starts, which overwrites them."""
        flat = values.reshape(-1)
        mask = self._xp.isnan(flat)
        work = start(mask)

        def restore() -> None:
            self._b.translated(self.key.collective, work.wait)
            flat[mask] = self._xp.nan
        return restore

    def _sum_in_rank_order(self, flat: Any, counts: list[int]) -> Any:
        """This rank's block (``counts[rank]`` elements) of the SUM (or AVERAGE) over the
        ranks of the flat ``flat`` cut into blocks of ``counts``: every rank's copy of the
        block arrives by one all-to-all, and the copies are added in rank order, so each
        element is the same sum whatever the message's length or cut (the mock world's
        bits). Blocking: a non-blocking call runs it on the group's issuing thread."""
        b, xp, n = self._b, self._xp, self._b.world_size
        size = counts[b.rank]
        copies = xp.empty(n * size, dtype=flat.dtype)
        b.dist.all_to_all_single(b.tensor(copies), b.tensor(flat), [size] * n, counts,
                                 group=b.pg)
        copies = copies.reshape(n, size)
        block = copies[0]
        for k in range(1, n):
            xp.add(block, copies[k], out=block)
        if self._scale is not None:
            xp.divide(block, self._scale, out=block, casting="unsafe")
        return block

    def _all_reduce(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        b = self._b
        if self._in_rank_order:  # a reduce-scatter in rank order, then an all-gather
            flat, n = send.reshape(-1), b.world_size
            counts = split_sizes(flat.size, n)
            most = max(counts)
            mine = self._xp.zeros(most, dtype=flat.dtype)
            mine[:counts[b.rank]] = self._sum_in_rank_order(flat, counts)
            every = self._xp.empty(most * n, dtype=flat.dtype)
            b.dist.all_gather_single(b.tensor(every), b.tensor(mine), group=b.pg)
            at = 0
            for k, c in enumerate(counts):
                flat[at:at + c] = every[k * most:k * most + c]
                at += c
            return None, None
        restore = self._nans_back(send, lambda mask: b.dist.all_reduce(
            b.tensor(mask), b.dist.ReduceOp.SUM, group=b.pg, async_op=True)) \
            if self._nans else self._mean(send)
        return b.dist.all_reduce(b.tensor(send), self._op, group=b.pg, async_op=True), restore

    def _broadcast(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        b = self._b
        return b.dist.broadcast(b.tensor(send), group=b.pg, group_src=self.key.root,
                                async_op=True), None

    def _reduce(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        b, root = self._b, self.key.root
        if self._nans:  # the mask reduction would need a scratch on every rank anyway
            return self._nans_via_all_reduce(send)
        if b.rank == root:
            return b.dist.reduce(b.tensor(send), group=b.pg, group_dst=root, op=self._op,
                                 async_op=True), self._mean(send)
        scratch = self._xp.array(send, copy=True)  # gloo may use a non-root's buffer
        return b.dist.reduce(b.tensor(scratch), group=b.pg, group_dst=root, op=self._op,
                             async_op=True), None

    def _nans_via_all_reduce(self, send: Any) -> tuple[Any, Callable[[], None] | None]:
        """A MIN or MAX reduce as an all-reduce of a copy, kept on the root only."""
        copy = self._xp.array(send, copy=True)
        work, restore = self._all_reduce(copy, None)
        root = self._b.rank == self.key.root

        def finish() -> None:
            if restore is not None:
                restore()
            if root:
                send[...] = copy
        return work, finish

    def _all_gather(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        b, counts = self._b, self._counts
        if not self._padded:
            return b.dist.all_gather_single(b.tensor(recv.reshape(-1)), b.tensor(
                send.reshape(-1)), group=b.pg, async_op=True), None
        most, xp = max(counts), self._xp
        mine = xp.zeros(most, dtype=send.dtype)
        mine[:send.size] = send.reshape(-1)
        every = xp.empty(most * len(counts), dtype=send.dtype)
        work = b.dist.all_gather_single(b.tensor(every), b.tensor(mine), group=b.pg,
                                        async_op=True)

        def unpad() -> None:
            flat, at = recv.reshape(-1), 0
            for k, c in enumerate(counts):
                flat[at:at + c] = every[k * most:k * most + c]
                at += c
        return work, unpad

    def _reduce_scatter(self, send: Any, recv: Any) -> tuple[Any, Callable[[], None] | None]:
        b, counts = self._b, self._counts
        flat_out = recv.reshape(-1)
        if self._in_rank_order:
            flat_out[...] = self._sum_in_rank_order(send.reshape(-1), counts)
            return None, None
        if self._nans:  # MIN/MAX of floats: the whole buffer, NaNs put back, then a block
            whole = self._xp.array(send.reshape(-1), copy=True)
            work, restore = self._all_reduce(whole, None)
            lo = sum(counts[:b.rank])

            def block() -> None:
                if restore is not None:
                    restore()
                flat_out[...] = whole[lo:lo + flat_out.size]
            return work, block
        if not self._padded:
            work = b.dist.reduce_scatter_single(b.tensor(flat_out), b.tensor(send.reshape(-1)),
                                                op=self._op, group=b.pg, async_op=True)
            return work, self._mean(flat_out)
        most, xp = max(counts), self._xp
        blocks = xp.zeros(most * len(counts), dtype=send.dtype)
        flat, at = send.reshape(-1), 0
        for k, c in enumerate(counts):
            blocks[k * most:k * most + c] = flat[at:at + c]
            at += c
        mine = xp.empty(most, dtype=send.dtype)
        work = b.dist.reduce_scatter_single(b.tensor(mine), b.tensor(blocks), op=self._op,
                                            group=b.pg, async_op=True)
        mean = self._mean(mine)

        def unpad() -> None:
            if mean is not None:
                mean()
            flat_out[...] = mine[:flat_out.size]
        return work, unpad


class TorchBackend(PlannedBackend):
    """One rank's endpoint in a ``torch.distributed`` process group.

    Args:
        pg: the process group (the default group for the world).
        recorder: the rank's flight recorder.
        group_name: the group's name in the recorder.
        members: the group's members as global ranks (in group-rank order).
        hosts: every member's host name (for :meth:`node_info`).
        checks: check every collective's arguments across ranks first.
        debug: compare full arguments (a pickled all-gather) instead of hashes.
        uid: the world's unique id (its subgroups' names in torch start with it).
        timeout: torch's timeout of the subgroups made from this one (a ``timedelta``;
            None: torch's default).
        owns_group: destroy ``pg`` in :meth:`close`.
        live: the open backends of this rank's world by group name, shared by the world and
            its groups (a new dict for the world's).
    """

    name = "torch"

    def __init__(self, pg: Any, *, recorder: FlightRecorder, group_name: str = "world",
                 members: Sequence[int], hosts: Sequence[str], uid: str = "",
                 timeout: Any = None, checks: bool = True, debug: bool = False,
                 owns_group: bool = False, live: dict[str, TorchBackend] | None = None) -> None:
        self.torch, self.dist = load_torch()
        self.pg = pg
        #: The open backends of this rank's world, by group name (see :meth:`release`).
        self.live = {} if live is None else live
        self.live[group_name] = self
        self.members = tuple(members)
        self.uid = uid
        self.timeout = timeout
        self.world_size = len(self.members)
        self.rank = self.members.index(self.dist.get_rank())
        self.options = {"checks": checks, "debug": debug}
        #: The plans check hashes of their keys; the signatures of the general methods
        #: are not needed.
        self.needs_signature = False
        self._hosts = tuple(hosts)
        self._node = node_info(self._hosts, self.rank)
        self._owns_group = owns_group
        self.guard = TorchGuard(self.dist, self.torch, pg, checks or debug, recorder,
                                group_name, self.members, debug)
        #: The rank's watchdog (the world backend of a job of several ranks only).
        self.watchdog: Any = None
        #: The threads that send to each rank, shared by the world's groups.
        self.outbox = Outbox(self.guard.members[self.rank])
        #: The order in which the group's calls reach torch (non-blocking ones queued).
        self.order = CallOrder(f"axondist-{group_name}")
        self._closed = False

    # --- what the plans share ---------------------------------------------------------------
    @property
    def recorder(self) -> FlightRecorder:  # type: ignore[override]
        """The rank's flight recorder (shared by its groups)."""
        return self.guard.rec

    def tensor(self, buf: Any) -> Any:
        """A tensor over ``buf``'s memory (no copy)."""
        return TORCH.wrap(buf, None)

    def translated(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, with torch.distributed's errors turned into axondist's (see
        :meth:`our_error`)."""
        try:
            return run()
        except RuntimeError as exc:
            ours = self.our_error(what, exc)
            if ours is None:
                raise
            raise ours from (None if isinstance(ours, WorldAbortedError) else exc)

    def our_error(self, what: str, exc: RuntimeError) -> Exception | None:
        """axondist's error for torch.distributed's ``exc`` during ``what``: a peer's closed
        connection a :class:`WorldAbortedError` naming the ranks whose processes are gone,
        torch's timeout a :class:`CollectiveTimeoutError`; None for other errors."""
        text = str(exc)
        first = text.splitlines()[0] if text else type(exc).__name__
        if any(sign in text for sign in _PEER_GONE):
            gone = self.gone_ranks(within=_GONE_WITHIN)
            who = (f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} ended"
                   if gone else "a rank it needs ended (or its host is cut off)")
            return WorldAbortedError(
                f"{what} on rank {self.rank} of {self.world_size} (group {self.guard.group}) "
                f"cannot complete: {who}; that rank's output says why (torch.distributed: "
                f"{first})")
        if "imed out" in text or "Timeout" in text:
            return CollectiveTimeoutError(
                f"{what} on rank {self.rank} of {self.world_size}: torch.distributed timed out "
                f"({first}); set AXONDIST_TIMEOUT if the job is only slow")
        return None

    def gone_ranks(self, within: float = 0.0) -> list[int]:
        """The group ranks whose processes, on this host, are gone (the watchdog's table of
        the peers says where each runs), looked for during ``within`` seconds: a peer's
        socket closes while its process is still ending."""
        peers = getattr(self.watchdog, "peers", None) or {}
        host = self.guard.rec.host
        mine = [(r, found[3]) for r, world_rank in enumerate(self.members)
                if (found := peers.get(world_rank)) is not None and found[2] == host]
        deadline = time.monotonic() + within
        while True:
            gone = [r for r, pid in mine if _ended(pid)]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.01)

    def work(self, work: Any, result: Any, what: str, finish: Callable[[], None] | None,
             seq: int) -> Work:
        """The Work of a started torch Work (None: the call completed already, but for
        ``finish``): ``wait()`` returns ``result``."""
        if work is None:
            if finish is not None:
                finish()
            return CompletedWork(result)
        def done() -> bool:
            return bool(work.is_completed()) and self.translated(what, work.wait) is not None

        return PolledWork(done, lambda: self.translated(what, work.wait), result, what, finish,
                          (self.guard.rec, self.guard.group, seq))

    # --- prepared calls -------------------------------------------------------------------
    def make_plan(self, key: CallKey) -> Plan:
        """A widened mean for half-precision AVERAGEs, a count exchange for an unsized
        all-gather, else torch's collective (:class:`TorchPlan`)."""
        if key.reduce_op == "AVERAGE" and key.dtype in _HALF:
            return WidenedMeanPlan(self, key)
        if key.collective == "all_gather" and key.counts is None:
            return UnsizedAllGatherPlan(self, key)
        return TorchPlan(self, key)

    # --- the contract's general methods, as plans (the others: PlannedBackend) ----------
    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """The reduce-scatter of flat ``send`` into blocks of ``counts`` elements."""
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or sum(counts) != send.size \
                or recv.size != counts[self.rank]:
            raise InvalidBufferError(
                f"reduce_scatter: counts={counts} must list {self.world_size} element counts "
                f"adding up to send's {send.size}, with this rank's equal to recv's {recv.size}")
        flat = send.reshape(-1)
        key = CallKey.of("reduce_scatter", flat, reduce_op=op, counts=tuple(counts),
                         async_op=async_op)
        return self._planned(key, flat, recv.reshape(-1), recv)

    # --- rooted and irregular calls (blocking; padded where sizes differ) ------------------
    def _checked(self, op: str, key: Key, run: Callable[[], Any]) -> Any:
        """``run()`` as call ``op``: numbered, recorded, checked across ranks first."""
        guard = self.guard

        def issue() -> Any:
            if guard.checks:
                self.translated(op, lambda: guard.agree(op, key, guard.words(op, key)))
            return self.translated(op, run)

        seq, slot = guard.begin(op, key)
        try:
            return self.order.now(issue)
        finally:
            guard.rec.end(slot)

    def _rooted(self, what: str, root: int, counts: Sequence[int], mine: Any,
                full: Any | None, full_arg: str) -> tuple[list[int], Any]:
        as_rank(root, self.world_size, what, "root")
        counts = [int(c) for c in counts]
        if self.rank != root:
            full = None
        elif full is None:
            raise InvalidBufferError(f"{what}: the root (rank {root}) must pass a {full_arg} "
                                     "buffer")
        if (len(counts) != self.world_size or mine.size != counts[self.rank]
                or (full is not None and full.size != sum(counts))):
            raise InvalidBufferError(
                f"{what}: counts={counts} must list {self.world_size} element counts, with this "
                f"rank's equal to its block's {mine.size}"
                + ("" if full is None else f" and their sum to {full_arg}'s {full.size}"))
        return counts, full

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """Every rank's ``send`` into ``root``'s ``recv``, in rank order (blocks padded to
        the largest: gloo gathers equal blocks)."""
        counts, recv = self._rooted("gather", root, counts, send, recv, "recv")
        xp, most = _array.namespace(send), max(counts)
        mine = xp.zeros(most, dtype=send.dtype)
        mine[:send.size] = send.reshape(-1)
        every = [xp.empty(most, dtype=send.dtype) for _ in counts] if recv is not None else None
        key = (("dtype", str(send.dtype)), ("counts", tuple(counts)), ("root", root))
        self._checked("gather", key, lambda: self.dist.gather(
            self.tensor(mine), None if every is None else [self.tensor(e) for e in every],
            group=self.pg, group_dst=root))
        if recv is not None and every is not None:
            flat, at = recv.reshape(-1), 0
            for block, c in zip(every, counts):
                flat[at:at + c] = block[:c]
                at += c
        return CompletedWork(recv)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """Block r of ``root``'s ``send`` into rank r's ``recv`` (blocks padded to the
        largest)."""
        counts, send = self._rooted("scatter", root, counts, recv, send, "send")
        xp, most = _array.namespace(recv), max(counts)
        mine = xp.empty(most, dtype=recv.dtype)
        blocks = None
        if send is not None:
            flat, at, blocks = send.reshape(-1), 0, []
            for c in counts:
                block = xp.zeros(most, dtype=send.dtype)
                block[:c] = flat[at:at + c]
                blocks.append(block)
                at += c
        key = (("dtype", str(recv.dtype)), ("counts", tuple(counts)), ("root", root))
        self._checked("scatter", key, lambda: self.dist.scatter(
            self.tensor(mine), None if blocks is None else [self.tensor(b) for b in blocks],
            group=self.pg, group_src=root))
        recv.reshape(-1)[...] = mine[:recv.size]
        return CompletedWork(recv)

    def all_to_all(self, send: Any, recv: Any, send_counts: Sequence[int],
                   recv_counts: Sequence[int], *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """``all_to_all_single`` with torch's split sizes."""
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if (len(sc) != self.world_size or len(rc) != self.world_size or send.size != sum(sc)
                or recv.size != sum(rc)):
            raise InvalidBufferError(
                f"all_to_all: send_counts={sc} and recv_counts={rc} must list "
                f"{self.world_size} element counts adding up to send's {send.size} and recv's "
                f"{recv.size}")
        self._checked("all_to_all", (("dtype", str(send.dtype)),),
                      lambda: self.dist.all_to_all_single(
                          self.tensor(recv.reshape(-1)), self.tensor(send.reshape(-1)), rc, sc,
                          group=self.pg))
        return CompletedWork(recv)

    def barrier(self) -> None:
        """A barrier (the check's all-reduce is one; no data moves after it)."""
        if not self.guard.checks:
            self._checked("barrier", (), lambda: self.dist.barrier(group=self.pg))
            return
        self._checked("barrier", (), lambda: None)

    def monitored_barrier(self, timeout: float) -> None:
        """A barrier that fails after ``timeout`` seconds on every rank that arrived, naming
        the ranks that did not and what each is doing (from their flight recorders). The
        barrier is the check's all-reduce, polled; the group is unusable after a failure."""
        guard = self.guard
        deadline = time.monotonic() + timeout
        seq, slot = guard.begin("barrier", ())
        try:
            sent = guard.words("barrier", ()).copy()
            tensor = self.torch.from_numpy(sent)
            work = self.order.now(lambda: self.translated("barrier", lambda: self.dist.all_reduce(
                tensor, self.dist.ReduceOp.MAX, group=self.pg, async_op=True)))
            pause = 1e-4
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise guard.absent_error("barrier", seq)
                time.sleep(pause)
                pause = min(2 * pause, 1e-2)
            self.translated("barrier", work.wait)
            if not agreed(sent):
                guard.disagree("barrier", ())
        finally:
            guard.rec.end(slot)

    # --- point to point: a header (bytes, dtype), then the data ------------------------------
    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Send ``buf``: a header with its size, then its bytes (see :meth:`_post`)."""
        as_rank(dst, self.world_size, "send", "dst")
        head_tag, data_tag, _, _ = _tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            self._post(buf.reshape(-1).view(np.uint8), dst, head_tag, data_tag, tag)
        finally:
            guard.rec.end(slot)

    def _post(self, payload: Any, dst: int, head_tag: int, data_tag: int, tag: int) -> None:
        """Send the bytes ``payload`` after their size, on the thread that sends to ``dst``
        (so sends to one rank keep their order). Up to :data:`EAGER_BYTES` this returns
        at once, sending a copy, as MPI's eager sends do: gloo's own send waits for its
        receive, so two ranks that each send before they receive would wait forever.
        Larger sends wait for their receive, as on MPI."""
        outbox = self.outbox
        if outbox.error is not None:
            raise outbox.error
        eager = payload.size <= EAGER_BYTES
        if eager:
            payload = payload.copy()
        header = np.array([payload.size], _INT64)
        to = self.guard.members[dst]

        def send() -> None:
            self.dist.send(self.torch.from_numpy(header), group=self.pg, group_dst=dst,
                           tag=head_tag)
            if payload.size:
                self.dist.send(self.tensor(payload), group=self.pg, group_dst=dst,
                               tag=data_tag)

        sent = outbox.submit((id(self.pg), dst, head_tag), to, tag,
                             lambda: self.translated("send", send))
        if not eager:
            sent.result()

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Receive the next message from ``src`` with ``tag`` into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size is not ``buf.nbytes`` (the message
                is received and dropped).
        """
        as_rank(src, self.world_size, "recv", "src")
        head_tag, data_tag, _, _ = _tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag),
                                       ("bytes", buf.nbytes)))
        try:
            header = np.zeros(1, _INT64)
            self.dist.recv(self.torch.from_numpy(header), group=self.pg, group_src=src,
                           tag=head_tag)
            size = int(header[0])
            target = buf.reshape(-1).view(np.uint8) if size == buf.nbytes else np.empty(
                size, np.uint8)
            if size:
                self.dist.recv(self.tensor(target), group=self.pg, group_src=src, tag=data_tag)
        finally:
            guard.rec.end(slot)
        if size != buf.nbytes:
            raise CollectiveMismatchError(
                f"recv from rank {src} (tag {tag}) into {_array.describe(buf)}: the message has "
                f"{size} bytes but the buffer holds {buf.nbytes}; send and recv must use the "
                "same shape and dtype")

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a pickled ``obj`` (its length, then its bytes) in a tag space of its own."""
        as_rank(dst, self.world_size, "send_object", "dst")
        _, _, head_tag, data_tag = _tags(tag)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        guard = self.guard
        slot = guard.begin_p2p("send", (("peer", guard.members[dst]), ("tag", tag)))
        try:
            self._post(data, dst, head_tag, data_tag, tag)
        finally:
            guard.rec.end(slot)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object ``src`` sent with ``tag``."""
        as_rank(src, self.world_size, "recv_object", "src")
        _, _, head_tag, data_tag = _tags(tag)
        guard = self.guard
        slot = guard.begin_p2p("recv", (("peer", guard.members[src]), ("tag", tag)))
        try:
            header = np.zeros(1, _INT64)
            self.dist.recv(self.torch.from_numpy(header), group=self.pg, group_src=src,
                           tag=head_tag)
            data = np.empty(int(header[0]), np.uint8)
            self.dist.recv(self.torch.from_numpy(data), group=self.pg, group_src=src,
                           tag=data_tag)
        finally:
            guard.rec.end(slot)
        return pickle.loads(data.tobytes())

    # --- small objects ---------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Copies of every rank's ``obj``, in rank order (torch's ``all_gather_object``)."""
        found: list[Any] = [None] * self.world_size
        self._checked("allgather_object", (),
                      lambda: self.dist.all_gather_object(found, obj, group=self.pg))
        return found

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (a copy, also on root)."""
        as_rank(root, self.world_size, "broadcast_object", "root")
        box = [pickle.dumps(obj) if self.rank == root else None]
        self._checked("broadcast_object", (("root", root),),
                      lambda: self.dist.broadcast_object_list(box, group=self.pg,
                                                              group_src=root))
        return pickle.loads(box[0])  # type: ignore[arg-type]

    # --- groups and life cycle -------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> TorchBackend | None:
        """A process group over ``ranks`` (of this group), made by its members alone; the
        others get None. The members are part of the checked arguments: ranks that
        disagree raise before any group is made.

        torch's own ``new_group(use_local_synchronization=True)`` names a group by its ranks
        and the number of groups each process holds, which differs between ranks that belong
        to different groups, and makes the members wait forever for each other. Here the
        name comes from the parent group's name and its count of groups made, which its
        members share, under the world's unique id.
        """
        ranks = tuple(int(r) for r in ranks)
        for r in ranks:
            as_rank(r, self.world_size, "new_group", "rank")
        alive = sum(b._owns_group for b in self.live.values())
        if alive >= MAX_GROUPS:
            raise TooManyGroupsError(f"the torch backend allows at most {MAX_GROUPS}")
        guard = self.guard
        name = f"{guard.group}.{guard.groups_made}"
        guard.groups_made += 1
        members = [self.members[r] for r in ranks]
        made: list[Any] = []
        if self.rank in ranks:
            run = lambda: made.append(self._make_group(members, name))  # noqa: E731
        else:
            run = lambda: None  # noqa: E731
        self._checked("new_group", (("ranks", ranks),), run)
        if not made:
            return None
        sub = TorchBackend(made[0], recorder=guard.rec, group_name=name, members=members,
                           hosts=[self._hosts[r] for r in ranks], uid=self.uid,
                           timeout=self.timeout, checks=self.options["checks"],
                           debug=self.options["debug"], owns_group=True, live=self.live)
        sub.watchdog = self.watchdog
        sub.outbox = self.outbox
        return sub

    def _make_group(self, members: list[int], name: str) -> Any:
        """torch's process group over the global ranks ``members`` (called by them alone),
        registered with torch.distributed under a name unique to this world."""
        c10d = self.dist.distributed_c10d
        helper = getattr(c10d, "_new_process_group_helper", None)
        if helper is None:  # a torch without the helper: its own (ranks must not diverge)
            return self.dist.new_group(members, use_local_synchronization=True, group_desc=name)
        unique = f"axondist.{self.uid}.{name}"
        me = self.dist.get_rank()
        pg, _ = helper(len(members), members.index(me), members,
                       c10d.Backend(self.dist.get_backend()),
                       c10d._get_default_store(), unique, group_desc=name,
                       timeout=self.timeout)
        c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(members)}
        # every member has connected to every other before any uses (or destroys) the group:
        # a rank that went on and destroyed it would cut a peer's connecting off
        self.dist.barrier(group=pg)
        return pg

    def node_info(self) -> tuple[int, int, int]:
        """``(node_id, local_rank, local_size)`` from the ranks' host names."""
        return self._node

    def close(self) -> None:
        """Forget the plans; destroy the process group of a subgroup (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.live.pop(self.guard.group, None)
        self.order.close()
        self.free_plans()
        self.guard.forget()
        if self._owns_group and self.dist.is_initialized():
            try:  # the members' last calls on the group have ended everywhere
                self.dist.barrier(group=self.pg)
            finally:
                self.dist.destroy_process_group(self.pg)

    def release(self, default_group: bool) -> None:
        """At interpreter exit: destroy the process group of every open group of this rank's
        world here and now, without a word to the other ranks (they may be gone), and let go
        of them, ``default_group`` (torch's, which ``init`` made) too. Until then this
        module's objects hold the groups, so torch's threads would still run inside gloo
        while Python finalizes and frees them, which aborts the process ("terminate called
        without an active exception"). A group with calls still queued, or sends not yet
        received, is left as it is: its threads are inside gloo, and would never join."""
        busy = self.outbox.busy()
        for backend in sorted(self.live.values(), key=lambda b: not b._owns_group):
            if backend.order.busy() or busy:
                continue
            backend._closed = True
            backend.order.close()
            backend.free_plans()
            if backend._owns_group and self.dist.is_initialized():
                self.dist.destroy_process_group(backend.pg)
            backend.pg = backend.guard.pg = backend.guard.checks_group = None
        if not any(b.order.busy() for b in self.live.values()) and not busy:
            self.live.clear()
            if default_group and self.dist.is_initialized():
                self.dist.destroy_process_group()


class SerialThread:
    """A daemon thread that runs what it is given in order, each call's value in a future.

    A daemon, unlike ``ThreadPoolExecutor``'s workers, which the interpreter joins at exit:
    a send nobody receives must not keep the process from ending (and from saying so).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``job()``; the future of its value."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        """End the thread after the jobs queued so far."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)


class Outbox:
    """What this rank's sends queue (:meth:`TorchBackend.send`), sent in order per channel
    (group, destination and tag: the order a receiver matches them in) by a thread of the
    channel's own while it has messages, and the sends not received yet.

    A channel's thread is a daemon, unlike ``ThreadPoolExecutor``'s workers, which the
    interpreter joins at exit: a send nobody receives must not keep the process from
    ending (and from saying so).

    Args:
        me: this rank in the world.
    """

    def __init__(self, me: int) -> None:
        self.me = me
        self.error: BaseException | None = None
        self._channels: dict[tuple[Any, ...], collections.deque] = {}
        self._running: set[tuple[Any, ...]] = set()
        #: ``(destination, user tag, future, whether an object)`` of each send not received.
        self._pending: list[tuple[int, int, concurrent.futures.Future, bool]] = []
        self._lock = threading.Lock()

    def submit(self, channel: tuple[Any, ...], dst: int, tag: int,
               send: Callable[[], None]) -> concurrent.futures.Future:
        """Queue ``send()`` (a message to world rank ``dst`` with user ``tag``) behind the
        channel's earlier ones; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending = [p for p in self._pending if not _delivered(p[2])]
            self._pending.append((dst, tag, future, channel[-1] % _TAG_KINDS >= 2))
            self._channels.setdefault(channel, collections.deque()).append((send, future))
            if channel not in self._running:
                self._running.add(channel)
                threading.Thread(target=self._drain, args=(channel,), daemon=True,
                                 name=f"axondist-send-to-{dst}").start()
        return future

    def _drain(self, channel: tuple[Any, ...]) -> None:
        while True:
            with self._lock:
                jobs = self._channels[channel]
                if not jobs:
                    self._running.discard(channel)
                    del self._channels[channel]
                    return
                send, future = jobs.popleft()
            try:
                send()
            except BaseException as exc:  # noqa: BLE001 - raised at the next send, or waited
                self.error = self.error or exc
                future.set_exception(exc)
            else:
                future.set_result(None)

    def busy(self) -> bool:
        """Whether a send is still being sent (its thread is inside torch.distributed)."""
        with self._lock:
            return bool(self._running)

    def unreceived(self, settle: float = 0.05) -> dict[tuple[int, int, int], int]:
        """The sends not received after ``settle`` seconds (still waiting, or failed: the
        receiver ended without taking them), as ``{(this world rank, destination world
        rank, user tag): messages}``."""
        deadline = time.monotonic() + settle
        while True:
            with self._lock:
                pending = list(self._pending)
            if all(p[2].done() for p in pending) or time.monotonic() >= deadline:
                break
            time.sleep(1e-3)
        # axondist.send is an object (its shape and dtype) and an array: one message, counted
        # by the larger of the two counts (a receive that failed between them took one)
        halves: dict[tuple[int, int, int], list[int]] = {}
        for dst, tag, _, is_object in (p for p in pending if not _delivered(p[2])):
            halves.setdefault((self.me, dst, tag), [0, 0])[is_object] += 1
        return {key: max(counts) for key, counts in halves.items()}


def _delivered(sent: concurrent.futures.Future) -> bool:
    """Whether a send's future says its message was taken by its receiver."""
    return sent.done() and sent.exception() is None


class CallOrder:
    """The order in which one group's calls reach torch.distributed, which pairs the ranks'
    collectives by the order they were issued.

    A non-blocking call's check waits until every rank made its call, which must not block
    the caller (it may send what another rank waits for first), so :meth:`later` issues the
    check and then the call on a thread of the group's own, in call order; :meth:`now`
    issues a blocking call at once, or behind the queued ones while there are any.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread: SerialThread | None = None
        self._queued = 0
        self._last: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def later(self, issue: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``issue()``; its future. The thread lives while calls are queued (a thread
        per group for the group's life would grow with the groups)."""
        with self._lock:
            if self._thread is None:
                self._thread = SerialThread(self._name)
            self._queued += 1
            self._last = self._thread.submit(lambda: self._issue(issue))
            return self._last

    def busy(self) -> bool:
        """Whether calls are queued (their thread may be inside torch.distributed)."""
        return self._queued > 0

    def now(self, issue: Callable[[], Any]) -> Any:
        """``issue()`` once every queued call was issued; its value."""
        if self._queued:
            return self.later(issue).result()
        return issue()

    def _issue(self, issue: Callable[[], Any]) -> Any:
        try:
            return issue()
        finally:
            with self._lock:
                self._queued -= 1
                if not self._queued and self._thread is not None:
                    self._thread.stop()  # it ends after this call; the next makes another
                    self._thread = None

    def close(self) -> None:
        """Wait until what is queued was issued (the thread then ends)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])


class QueuedWork(Work):
    """The Work of a queued non-blocking call: once :class:`CallOrder` issued it (its check
    passed, torch's call started), the Work of torch's call (:meth:`TorchBackend.work`)."""

    __slots__ = ("_backend", "_future", "_result", "_what", "_seq", "_started")

    def __init__(self, backend: TorchBackend, future: concurrent.futures.Future, result: Any,
                 what: str, seq: int) -> None:
        self._backend, self._future, self._result = backend, future, result
        self._what, self._seq = what, seq
        self._started: Work | None = None

    def _issued(self, timeout: float | None) -> Work:
        if self._started is None:
            try:
                work, finish = self._future.result(timeout)
            except concurrent.futures.TimeoutError:
                raise CollectiveTimeoutError(
                    f"Work.wait: {self._what} did not complete within timeout={timeout:g} s; "
                    "it is still running (call wait() again, or check that every rank "
                    "started it)") from None
            self._started = self._backend.work(work, self._result, self._what, finish,
                                               self._seq)
        return self._started

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the call (at most ``timeout`` seconds in all); its result."""
        guard = self._backend.guard
        slot = guard.rec.begin(guard.group, self._seq, f"wait {self._what}", None)
        try:
            start = time.monotonic()
            started = self._issued(timeout)
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            return started.wait(left)
        finally:
            guard.rec.end(slot)

    def is_completed(self) -> bool:
        """True once the call finished (or failed); never blocks."""
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        return self._issued(0).is_completed()


__all__ = ["TorchBackend", "TorchPlan", "node_info"]
