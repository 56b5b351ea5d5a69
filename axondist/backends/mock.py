"""An in-process world: N ranks on N threads of one process, deterministic.

Each collective is a round: every rank deposits its buffers, the last to
arrive checks that all ranks agree on the arguments, and each rank computes
its share of the result in rank order (the same bits on every run). A call
whose peers do not come warns after the stall time, naming them and their
last calls, and fails at the world's timeout; a peer that left or failed, or
a cycle of receives, fails it at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import _array
from .._validate import as_rank, positive_seconds
from ..errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankExitedError,
    WorldAbortedError,
)
from ..ops import ReduceOp, combine_into
from ._watchdog import warn
from .base import (
    Backend,
    CompletedWork,
    FutureWork,
    Signature,
    Work,
    compare_signatures,
    default_timeout,
    stall_warning_after,
)
from .recorder import FlightRecorder, describe_call, describe_status

#: Seconds a cycle of receives must hold, with no message or round completing anywhere,
#: before it is reported as a deadlock.
_CYCLE_STILL = 1.0

# Below this many elements one rank reduces everything: slicing costs more
# than it saves.
_PARALLEL_REDUCE_MIN = 1 << 20


class _Round:
    """One collective call, shared by the ranks of a group."""

    __slots__ = ("op_name", "payloads", "signatures", "arrived", "departed", "error", "scratch")

    def __init__(self, op_name: str, size: int) -> None:
        self.op_name = op_name
        self.payloads: list[Any] = [None] * size
        self.signatures: list[Signature | None] = [None] * size
        self.arrived = 0
        self.departed = 0
        self.error: BaseException | None = None
        self.scratch: dict[str, Any] = {}


class MockWorld:
    """State shared by every rank of one in-process world."""

    def __init__(self, world_size: int, timeout: float | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"MockWorld: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = default_timeout() if timeout is None else positive_seconds(
            timeout, "mock world")
        self.stall = stall_warning_after(self.timeout)
        self.recorders = [FlightRecorder(r, world_size, "in-process") for r in range(world_size)]
        #: world rank -> why it left (its function returned, sys.exit, an error).
        self.left: dict[int, str] = {}
        #: world rank -> (its mailbox, the world rank it receives from) while it waits.
        self.receiving: dict[int, tuple[collections.deque, int]] = {}
        #: Counts posted messages and completed rounds: a receive cycle is a deadlock
        #: only when it holds while nothing moves anywhere in the world.
        self.progress = 0
        self.cond = threading.Condition()
        self.rounds: dict[tuple[Any, int], _Round] = {}
        self.mailboxes: dict[tuple[Any, int, int, int], collections.deque] = (
            collections.defaultdict(collections.deque)
        )
        self.abort_reason: str | None = None

    def abort(self, rank: int, exc: BaseException) -> None:
        """Mark the world failed and wake every waiting rank."""
        with self.cond:
            if self.abort_reason is None:
                self.abort_reason = f"rank {rank} failed with {type(exc).__name__}: {exc}"
            self.cond.notify_all()

    def mark_left(self, rank: int, why: str) -> None:
        """Record that ``rank`` will make no more calls, and wake the ranks waiting for it."""
        with self.cond:
            self.left[rank] = why
            self.cond.notify_all()

    def unreceived(self) -> list[str]:
        """Messages sent but never received, as text (what a finished world should not hold)."""
        with self.cond:
            return [f"{len(box)} from rank {src} to rank {dst} (tag {tag}"
                    + (f", group {key})" if key != ("world",) else ")")
                    for (key, src, dst, tag), box in self.mailboxes.items() if box]

    def _check_abort(self, what: str) -> None:
        if self.abort_reason is not None:
            raise WorldAbortedError(f"{what} cancelled: {self.abort_reason}")

    def describe_rank(self, rank: int) -> str:
        """What ``rank`` is doing, from its flight recorder."""
        status = self.recorders[rank].status()
        if rank not in self.left:
            return describe_status(status)
        last = status["last"]
        done = (f"after {describe_call(last)}" if last else "before making any call")
        return f"rank {rank} left {done}"

    def wait_for(self, ready: Callable[[], bool], what: str,
                 missing: Callable[[], str],
                 waiting_for: Callable[[], list[int]] | None = None,
                 timeout: float | None = None) -> None:
        """Wait (holding ``cond``) until ``ready()``.

        ``waiting_for`` lists the world ranks the wait needs: one that left
        fails the wait at once, and the stall warning names each with its last
        calls. Abort, departure and timeout become errors.
        """
        start = time.monotonic()
        timeout = self.timeout if timeout is None else timeout
        deadline = start + timeout
        warn_at = start + self.stall
        while not ready():
            self._check_abort(what)
            needed = waiting_for() if waiting_for is not None else []
            gone = [r for r in needed if r in self.left]
            if gone:
                raise RankExitedError(
                    f"{what}: " + "; ".join(f"{self.describe_rank(r)} ({self.left[r]})"
                                            for r in gone)
                    + ": it will never join this call")
            now = time.monotonic()
            if now >= deadline:
                detail = "".join(f"; {self.describe_rank(r)}" for r in needed)
                raise CollectiveTimeoutError(
                    f"{what}: {missing()} within {timeout:g} s{detail}; every rank of the "
                    "group must make the same collective calls in the same order"
                )
            if now >= warn_at and needed:
                warn(f"stall: {what} has waited {now - start:.1f} s (fails at {timeout:g} s); "
                     f"missing ranks {needed}:\n"
                     + "\n".join("  " + self.describe_rank(r) for r in needed), "[axondist] ")
                warn_at = now + self.stall
            self.cond.wait(min(deadline - now, warn_at - now, 1.0))


class MockBackend(Backend):
    """One rank's endpoint in a :class:`MockWorld` communicator.

    Create a world with :meth:`create_world`, which returns one backend per
    rank; each must be used from its own thread (see :func:`axondist.spawn`).
    """

    name = "mock"

    def __init__(self, world: MockWorld, group_key: Any, ranks: Sequence[int], rank: int) -> None:
        self.world = world
        self.group_key = group_key
        self.global_ranks = tuple(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self._seq = 0
        self._p2p_seq = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.recorder: FlightRecorder = world.recorders[self.global_ranks[rank]]
        self.group_name = _group_name(group_key)
        self.recorder.groups[self.group_name] = self.global_ranks

    @classmethod
    def create_world(cls, world_size: int, timeout: float | None = None) -> list[MockBackend]:
        """One backend per rank of a new in-process world of ``world_size`` ranks."""
        world = MockWorld(world_size, timeout)
        ranks = tuple(range(world_size))
        return [cls(world, ("world",), ranks, r) for r in range(world_size)]

    # --- the round machinery -------------------------------------------------------
    def _describe(self, op_name: str, seq: int) -> str:
        return (f"{op_name} #{seq + 1} on {self.group_name} of ranks {list(self.global_ranks)} "
                f"(rank {self.global_ranks[self.rank]})")

    def _arrive(self, op_name: str, seq: int, payload: Any, signature: Signature,
                timeout: float | None = None) -> _Round:
        """Deposit this rank's payload and wait for every rank of the group."""
        w, n = self.world, self.world_size
        what = self._describe(op_name, seq)
        with w.cond:
            w._check_abort(what)
            key = (self.group_key, seq)
            rnd = w.rounds.get(key)
            if rnd is None:
                rnd = w.rounds[key] = _Round(op_name, n)
            rnd.payloads[self.rank] = payload
            rnd.signatures[self.rank] = (("op", op_name),) + tuple(signature)
            rnd.arrived += 1
            if rnd.arrived == n:
                rnd.error = compare_signatures(op_name, rnd.signatures)
                w.progress += 1
                w.cond.notify_all()
            else:
                def absent() -> list[int]:
                    return [self.global_ranks[r] for r in range(n) if rnd.signatures[r] is None]

                def missing() -> str:
                    return f"ranks {absent()} of {n} did not join"

                try:
                    w.wait_for(lambda: rnd.arrived == n, what, missing, absent, timeout)
                except BaseException:
                    w.rounds.pop(key, None)
                    raise
            if rnd.error is not None:
                self._leave(key, rnd)
                raise rnd.error
        return rnd

    def _depart(self, seq: int, rnd: _Round, wait: bool) -> None:
        """Leave the round; with ``wait``, only once every rank finished reading inputs."""
        w, n = self.world, self.world_size
        key = (self.group_key, seq)
        with w.cond:
            self._leave(key, rnd)
            if wait and rnd.departed < n:
                w.wait_for(lambda: rnd.departed >= n, self._describe(rnd.op_name, seq),
                           lambda: "some ranks did not finish")

    def _leave(self, key: Any, rnd: _Round) -> None:
        rnd.departed += 1
        if rnd.departed == self.world_size:
            self.world.rounds.pop(key, None)
        self.world.cond.notify_all()

    def _run(self, op_name: str, payload: Any, signature: Signature,
             compute: Callable[[_Round], Any], async_op: bool, wait_all: bool = True,
             timeout: float | None = None) -> Work:
        seq = self._seq
        self._seq += 1
        recorder = self.recorder

        def execute() -> Any:
            slot = recorder.begin(self.group_name, seq + 1, op_name, signature)
            try:
                rnd = self._arrive(op_name, seq, payload, signature, timeout)
                try:
                    result = compute(rnd)
                finally:
                    self._depart(seq, rnd, wait_all)
            finally:
                recorder.end(slot)
            return result

        if not async_op:
            return CompletedWork(execute())
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"axondist-mock-r{self.rank}")
        return FutureWork(self._executor.submit(execute),
                          what=self._describe(op_name, seq))

    # --- collectives -----------------------------------------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp, *, signature: Signature = (),
                   async_op: bool = False) -> Work:
        """Reduce ``buf`` in place over the group, combining in rank order.

        The result is built in rank 0's buffer and copied out, so every rank gets
        the same bits on every run; from 2**20 elements on, each rank reduces one
        slice in parallel.
        """
        def compute(rnd: _Round) -> Any:
            self._reduce_share(rnd, op, rnd.payloads, buf.size)
            return buf

        return self._run("all_reduce", buf, signature + (("reduce_op", op.name),),
                         compute, async_op)

    def _reduce_share(self, rnd: _Round, op: ReduceOp, inputs: Sequence[Any], numel: int) -> None:
        """This rank's part of an all-reduce, once every rank's input has arrived.

        The result is accumulated in place in rank 0's buffer (so no temporary
        is allocated), in rank order. Small buffers: the first rank here does
        all of it under the lock. Large buffers: each rank reduces one slice in
        parallel and a barrier waits for every slice. Then every other rank
        copies rank 0's buffer; the departure barrier in :meth:`_run` keeps
        rank 0 from returning (and reusing its buffer) before they are done.
        """
        n, r, w = self.world_size, self.rank, self.world
        flats = [x.reshape(-1) for x in inputs]
        if numel < _PARALLEL_REDUCE_MIN:
            with w.cond:
                if not rnd.scratch.get("reduced"):
                    combine_into(flats[0], flats, op)
                    rnd.scratch["reduced"] = True
        else:
            lo, hi = r * numel // n, (r + 1) * numel // n
            if hi > lo:
                combine_into(flats[0][lo:hi], [f[lo:hi] for f in flats], op)
            with w.cond:
                rnd.scratch["slices"] = rnd.scratch.get("slices", 0) + 1
                w.cond.notify_all()
                w.wait_for(lambda: rnd.scratch["slices"] >= n, f"{rnd.op_name} (reducing slices)",
                           lambda: "some ranks did not finish reducing")
        if r != 0:
            flats[r][...] = flats[0]

    def broadcast(self, buf: Any, root: int, *, signature: Signature = (),
                  async_op: bool = False) -> Work:
        """Copy ``root``'s ``buf`` into every other rank's ``buf`` (``root``'s is untouched)."""
        self._check_rank(root, "broadcast", "root")

        def compute(rnd: _Round) -> Any:
            if self.rank != root:
                buf[...] = rnd.payloads[root]
            return buf

        return self._run("broadcast", buf, signature + (("root", root),), compute, async_op)

    def all_gather(self, send: Any, recv: Any, counts: Sequence[int], *,
                   signature: Signature = (), async_op: bool = False) -> Work:
        """Write each rank's ``send`` (``counts[k]`` elements from rank k) into ``recv``."""
        def compute(rnd: _Round) -> Any:
            flat, off = recv.reshape(-1), 0
            for k, c in enumerate(counts):
                flat[off:off + c] = rnd.payloads[k].reshape(-1)
                off += c
            return recv

        return self._run("all_gather", send, signature + (("counts", tuple(counts)),),
                         compute, async_op)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: ReduceOp, *,
                       signature: Signature = (), async_op: bool = False) -> Work:
        """Reduce the ranks' ``send``; ``recv`` gets this rank's block (``counts[rank]`` long)."""
        def compute(rnd: _Round) -> Any:
            lo = sum(counts[: self.rank])
            hi = lo + counts[self.rank]
            combine_into(recv.reshape(-1), [p.reshape(-1)[lo:hi] for p in rnd.payloads], op)
            return recv

        return self._run("reduce_scatter", send,
                         signature + (("counts", tuple(counts)), ("reduce_op", op.name)),
                         compute, async_op)

    def gather(self, send: Any, recv: Any | None, counts: Sequence[int], root: int, *,
               signature: Signature = (), async_op: bool = False) -> Work:
        """Concatenate the ranks' ``send`` into ``root``'s ``recv``; other ranks' result is None."""
        self._check_rank(root, "gather", "root")

        def compute(rnd: _Round) -> Any:
            if self.rank != root:
                return None
            assert recv is not None  # the root always passes its receive buffer
            flat, off = recv.reshape(-1), 0
            for k, c in enumerate(counts):
                flat[off:off + c] = rnd.payloads[k].reshape(-1)
                off += c
            return recv

        return self._run("gather", send,
                         signature + (("root", root), ("counts", tuple(counts))),
                         compute, async_op)

    def scatter(self, send: Any | None, recv: Any, counts: Sequence[int], root: int, *,
                signature: Signature = (), async_op: bool = False) -> Work:
        """Copy this rank's block (``counts[rank]`` long) of ``root``'s ``send`` into ``recv``."""
        self._check_rank(root, "scatter", "root")

        def compute(rnd: _Round) -> Any:
            lo = sum(counts[: self.rank])
            recv.reshape(-1)[...] = rnd.payloads[root].reshape(-1)[lo:lo + counts[self.rank]]
            return recv

        return self._run("scatter", send,
                         signature + (("root", root), ("counts", tuple(counts))),
                         compute, async_op)

    def barrier(self) -> None:
        """Return once every rank of the group has arrived (or fail after the world's timeout)."""
        self._run("barrier", None, (), lambda rnd: None, False, wait_all=False)

    def monitored_barrier(self, timeout: float) -> None:
        """:meth:`barrier` failing after ``timeout`` seconds, naming the absent ranks."""
        self._run("barrier", None, (), lambda rnd: None, False, wait_all=False, timeout=timeout)

    # --- objects -----------------------------------------------------------------------
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (the objects themselves, not copies), in rank order."""
        return self._run("allgather_object", obj, (),
                         lambda rnd: list(rnd.payloads), False, wait_all=False).wait()

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every rank (the same object, not a copy)."""
        self._check_rank(root, "broadcast_object", "root")
        return self._run("broadcast_object", obj, (("root", root),),
                         lambda rnd: rnd.payloads[root], False, wait_all=False).wait()

    # --- point to point ----------------------------------------------------------------
    def _mailbox(self, src: int, dst: int, tag: int) -> collections.deque:
        return self.world.mailboxes[(self.group_key, src, dst, tag)]

    def send(self, buf: Any, dst: int, tag: int = 0) -> None:
        """Post a copy of ``buf`` to ``dst``'s mailbox and return at once (never blocks)."""
        self._post(_array.namespace(buf).array(buf, copy=True), dst, tag, "send")

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Post a deep copy of ``obj`` to ``dst``'s mailbox and return at once."""
        self._post(copy.deepcopy(obj), dst, tag, "send_object")

    def _post(self, item: Any, dst: int, tag: int, what: str) -> None:
        self._check_rank(dst, what, "dst")
        with self.world.cond:
            self.world._check_abort(what)
            self._mailbox(self.rank, dst, tag).append(item)
            self.world.progress += 1
            self.world.cond.notify_all()

    def _take(self, src: int, tag: int, what: str, pop: bool = True) -> Any:
        """The next message from ``src`` with ``tag`` (removed from the mailbox if ``pop``)."""
        self._check_rank(src, what, "src")
        w = self.world
        box = self._mailbox(src, self.rank, tag)
        me, peer = self.global_ranks[self.rank], self.global_ranks[src]
        description = f"{what} on rank {me} from rank {peer} (tag {tag})"

        seen: list[float] = []  # (progress, since) while a cycle is seen

        def ready() -> bool:
            if box:
                return True
            if not self._receive_cycle(me, peer):
                seen.clear()
            elif not seen or seen[0] != w.progress:
                seen[:] = [w.progress, time.monotonic()]
            elif time.monotonic() - seen[1] >= _CYCLE_STILL:
                raise CollectiveTimeoutError(
                    f"{description}: deadlock: every rank in the cycle "
                    + " -> ".join(f"rank {r}" for r in self._receive_cycle(me, peer))
                    + " waits to receive from the next one and no message moved for "
                    f"{_CYCLE_STILL:g} s; make one side send first")
            return False

        with w.cond:
            if not box:
                self._p2p_seq += 1
                slot = self.recorder.begin(f"{self.group_name}:p2p", self._p2p_seq, what,
                                           (("peer", peer), ("tag", tag)))
                w.receiving[me] = (box, peer)
                try:
                    w.wait_for(ready, description, lambda: f"rank {peer} sent nothing",
                               lambda: [peer])
                finally:
                    w.receiving.pop(me, None)
                    self.recorder.end(slot)
            return box.popleft() if pop else box[0]

    def _receive_cycle(self, me: int, peer: int) -> list[int]:
        """The ranks of a cycle of pending receives from this rank back to it (empty when
        there is none). Alone it proves nothing: another thread of a rank may still send."""
        w, chain, at = self.world, [me], peer
        while at in w.receiving and at not in chain:
            mailbox, source = w.receiving[at]
            if mailbox:
                return []  # its message is there: it is about to wake up
            chain.append(at)
            at = source
        return chain + [me] if at == me and len(chain) > 1 else []

    def recv(self, buf: Any, src: int, tag: int = 0) -> None:
        """Wait for the next message from ``src`` with ``tag`` and copy it into ``buf``.

        Raises:
            CollectiveMismatchError: the message's size or dtype differs from ``buf``'s.
            CollectiveTimeoutError: nothing arrived within the world's timeout.
        """
        data = self._take(src, tag, "recv")  # consumed even when it does not fit: the next
        if data.size != buf.size or data.dtype != buf.dtype:  # recv gets the next message
            raise CollectiveMismatchError(
                f"recv from rank {src} (tag {tag}): message is {_array.describe(data)} but the "
                f"receive buffer is {_array.describe(buf)}; the message was discarded"
            )
        buf.reshape(-1)[...] = data.reshape(-1)

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """Wait for the next object ``src`` sent with ``tag`` (a deep copy of what it sent)."""
        return self._take(src, tag, "recv")

    # --- groups ------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> MockBackend | None:
        """A backend over ``ranks`` (group-local); None on ranks outside it.

        Collective: every rank must pass the same ranks, else every rank raises
        :class:`~axondist.errors.CollectiveMismatchError` naming what each passed.
        """
        ranks = tuple(int(r) for r in ranks)
        seq = self._seq  # the key of the group, identical on every rank
        all_ranks = self.allgather_object(ranks)
        if any(r != ranks for r in all_ranks):
            raise CollectiveMismatchError(
                "new_group: ranks disagree on the members: "
                + ", ".join(f"rank {k} passed {list(r)}" for k, r in enumerate(all_ranks))
            )
        if self.rank not in ranks:
            return None
        global_ranks = tuple(self.global_ranks[r] for r in ranks)
        return MockBackend(self.world, (self.group_key, seq), global_ranks, ranks.index(self.rank))

    def _check_rank(self, r: int, what: str, arg: str) -> None:
        as_rank(r, self.world_size, what, arg)
    def drain(self) -> None:
        """Wait until this rank's ``async_op`` calls finished (they may still fail)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Shut down this rank's thread for ``async_op`` work without waiting; idempotent."""
        if self.group_key != ("world",):
            self.recorder.groups.pop(self.group_name, None)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _group_name(group_key: Any) -> str:
    """``"world"``, ``"world.3"``...: a group's name in flight-recorder entries."""
    if group_key == ("world",):
        return "world"
    parent, seq = group_key
    return f"{_group_name(parent)}.{seq}"


def create_world_backend(timeout: float | None = None) -> MockBackend:
    """A one-rank mock world (``axondist.init("mock")``)."""
    return MockBackend.create_world(1, timeout)[0]
