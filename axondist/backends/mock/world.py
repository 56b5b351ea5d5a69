"""The shared state of an in-process world: its ranks' flight recorders, who left, the
rounds of collectives in progress (one lock and signal each) and the mailboxes of
point-to-point messages (one per pair of ranks and tag). :mod:`axondist.backends.mock.backend`
puts a backend per rank on top of it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from ..._validate import positive_seconds
from ...errors import (
    CollectiveTimeoutError,
    RankExitedError,
    WorldAbortedError,
)
from ..base import default_timeout, stall_warning_after
from ..plan import Signature
from ..recording.recorder import FlightRecorder, describe_call, describe_status
from ..watchdog.wait_graph import describe_cycle, find_cycle
from ..watchdog.watchdog import warn

# Stages of a round.
_GATHERING, _SHARING, _DONE = range(3)

Text = Callable[[], str]

#: Seconds a cycle of waits must hold, with no message or round completing anywhere,
#: before it is reported as a deadlock.
CYCLE_STILL = 1.0


class _Signal:
    """A lock with a wait/notify_all pair (what ``threading.Condition`` does, for a
    fraction of its set-up cost: one is made per collective call)."""

    __slots__ = ("_lock", "_sleepers")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sleepers: list[Any] = []

    def __enter__(self) -> _Signal:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> None:
        """Release the lock (held by the caller), sleep until notified or ``timeout``
        seconds passed, and take the lock again."""
        sleeper = threading.Lock()
        sleeper.acquire()
        self._sleepers.append(sleeper)
        self._lock.release()
        try:
            sleeper.acquire(True, max(timeout, 0.0))
        finally:
            self._lock.acquire()
            if sleeper in self._sleepers:
                self._sleepers.remove(sleeper)

    def notify_all(self) -> None:
        """Wake every thread sleeping in :meth:`wait` (call it holding the lock)."""
        for sleeper in self._sleepers:
            sleeper.release()
        self._sleepers.clear()


class _Round:
    """One collective call, shared by the ranks of a group; ``signal`` guards its fields.

    Its work is split into ``parts`` (numbered from 0), which ranks claim one at a
    time (``claimed``) until every part is ``finished``.
    """

    __slots__ = ("op_name", "payloads", "signatures", "arrived", "parts", "claimed",
                 "finished", "stage", "error", "differ", "signal")

    def __init__(self, op_name: str, size: int) -> None:
        self.op_name = op_name
        self.payloads: list[Any] = [None] * size
        self.signatures: list[Signature | None] = [None] * size
        self.arrived = 0
        self.parts = 0
        self.claimed = 0
        self.finished = 0
        self.stage = _GATHERING
        self.error: BaseException | None = None
        #: The ranks' calls as every backend prints them, when they differ (each rank
        #: names its own call first in the message, as under MPI).
        self.differ: list[Signature] | None = None
        self.signal = _Signal()


class _Mailbox:
    """Messages from one rank to another with one tag, oldest first, each as ``(kind,
    item)``: ``"send_object"`` for an object, ``"send"`` for an array."""

    __slots__ = ("items", "signal")

    def __init__(self) -> None:
        self.items: collections.deque[tuple[str, Any]] = collections.deque()
        self.signal = _Signal()

    def messages(self) -> int:
        """How many :func:`axondist.send` messages wait here: each is an object (its shape
        and dtype) and an array, so the larger of the two counts (a receive that took one
        and failed before the other leaves one message half taken, still one)."""
        objects = sum(kind == "send_object" for kind, _ in self.items)
        return max(objects, len(self.items) - objects)


class MockWorld:
    """State shared by every rank of one in-process world.

    ``lock`` guards the tables (rounds, mailboxes, who left, who receives) and
    is only held briefly; threads sleep on the signal of the round or mailbox
    they wait for, and :meth:`abort` and :meth:`mark_left` wake every sleeper
    through ``sleepers``. Lock order: a round's or mailbox's signal first, then
    ``lock``.
    """

    def __init__(self, world_size: int, timeout: float | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"MockWorld: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = default_timeout() if timeout is None else positive_seconds(
            timeout, "mock world")
        self.stall = stall_warning_after(self.timeout)
        self.recorders = [FlightRecorder(r, world_size, "in-process") for r in range(world_size)]
        self.lock = threading.Lock()
        #: world rank -> why it left (its function returned, sys.exit, an error).
        self.left: dict[int, str] = {}
        #: world rank -> (its mailbox, the world rank it receives from) while it waits.
        self.receiving: dict[int, tuple[_Mailbox, int]] = {}
        #: Counts posted messages and completed rounds: a cycle of waits is a deadlock
        #: only when it holds while nothing moves anywhere in the world.
        self.progress = 0
        #: world rank -> the thread that runs the rank's function (set as it starts).
        self.rank_threads: dict[int, int] = {}
        #: World ranks whose own thread (``rank_threads``) sleeps in a call now.
        self.sleeping: set[int] = set()
        self.rounds: dict[tuple[Any, int], _Round] = {}
        self.mailboxes: dict[tuple[Any, int, int, int], _Mailbox] = {}
        #: The signals threads sleep on now, with how many sleep on each.
        self.sleepers: collections.Counter[_Signal] = collections.Counter()
        self.abort_reason: str | None = None

    def _wake_everyone(self) -> None:
        with self.lock:
            signals = list(self.sleepers)
        for signal in signals:
            with signal:
                signal.notify_all()

    def abort(self, rank: int, exc: BaseException) -> None:
        """Mark the world failed and wake every waiting rank."""
        with self.lock:
            if self.abort_reason is None:
                self.abort_reason = f"rank {rank} failed with {type(exc).__name__}: {exc}"
        self._wake_everyone()

    def mark_left(self, rank: int, why: str) -> None:
        """Record that ``rank`` will make no more calls, and wake the ranks waiting for it."""
        with self.lock:
            self.left[rank] = why
        self._wake_everyone()

    def mailbox(self, key: tuple[Any, int, int, int]) -> _Mailbox:
        """The mailbox of ``(group key, source, destination, tag)``, created when first used."""
        with self.lock:
            box = self.mailboxes.get(key)
            if box is None:
                box = self.mailboxes[key] = _Mailbox()
            return box

    def unreceived(self) -> list[str]:
        """Messages sent but never received, as text (what a finished world should not hold)."""
        with self.lock:
            return [f"{box.messages()} from rank {src} to rank {dst} (tag {tag}"
                    + (f", group {key})" if key != ("world",) else ")")
                    for (key, src, dst, tag), box in self.mailboxes.items() if box.items]

    def _check_abort(self, what: str | Text) -> None:
        if self.abort_reason is not None:
            raise WorldAbortedError(f"{_text(what)} cancelled: {self.abort_reason}")

    def describe_rank(self, rank: int) -> str:
        """What ``rank`` is doing, from its flight recorder."""
        status = self.recorders[rank].status()
        if rank not in self.left:
            return describe_status(status)
        last = status["last"]
        done = (f"after {describe_call(last)}" if last else "before making any call")
        return f"rank {rank} left {done}"

    def wait_for(self, signal: _Signal, ready: Callable[[], bool], what: str | Text,
                 missing: Text, waiting_for: Callable[[], list[int]] | None = None,
                 timeout: float | None = None, rank: int | None = None) -> None:
        """Wait (holding ``signal``, which whoever makes ``ready()`` true notifies) until
        ``ready()``.

        ``waiting_for`` lists the world ranks the wait needs: one that left
        fails the wait at once, and the stall warning names each with its last
        calls. Abort, departure and timeout become errors. A wait of world rank
        ``rank`` on its own thread that is part of a cycle of waits (see
        :meth:`wait_cycle`) fails as a deadlock.
        """
        if ready():
            return
        if rank is not None and self.rank_threads.get(rank) != threading.get_ident():
            rank = None  # another thread of the rank's (a non-blocking call's)
        with self.lock:
            self.sleepers[signal] += 1
            if rank is not None:
                self.sleeping.add(rank)
        try:
            self._sleep_until(signal, ready, what, missing, waiting_for, timeout, rank)
        finally:
            with self.lock:
                self.sleepers[signal] -= 1
                if not self.sleepers[signal]:
                    del self.sleepers[signal]
                if rank is not None:
                    self.sleeping.discard(rank)

    def wait_cycle(self, me: int) -> str | None:
        """Text naming a cycle of waits from world rank ``me`` back to it, of any length,
        with a collective in it (a cycle of receives alone the receive words itself), or
        None. Only ranks whose own thread sleeps in their one call in progress count: a
        rank with another thread in a call, or whose own thread is outside one, may still
        end the wait."""
        with self.lock:
            sleeping = set(self.sleeping)
        statuses = {r: self.recorders[r].status(recent=0) for r in sorted(sleeping)
                    if r not in self.left}
        known = {r: s for r, s in statuses.items() if len(s["running"]) == 1}
        groups: dict[str, tuple[int, ...]] = {}
        for recorder in self.recorders:
            groups.update(recorder.groups)
        cycle = find_cycle(me, known, groups)
        if cycle is None or all("peer" in entry for _, entry, _ in cycle):
            return None
        return describe_cycle(me, cycle)

    def _sleep_until(self, signal: _Signal, ready: Callable[[], bool],
                     what: str | Text, missing: Text,
                     waiting_for: Callable[[], list[int]] | None,
                     timeout: float | None, rank: int | None) -> None:
        start = time.monotonic()
        timeout = self.timeout if timeout is None else timeout
        deadline = start + timeout
        warn_at = start + self.stall
        moved, still_since = self.progress, start  # what moved last, and when
        while not ready():
            self._check_abort(what)
            needed = waiting_for() if waiting_for is not None else []
            gone = [r for r in needed if r in self.left]
            if gone:
                raise RankExitedError(
                    f"{_text(what)}: " + "; ".join(f"{self.describe_rank(r)} ({self.left[r]})"
                                                   for r in gone)
                    + ": it will never join this call")
            now = time.monotonic()
            if self.progress != moved:
                moved, still_since = self.progress, now
            elif rank is not None and now - still_since >= CYCLE_STILL:
                cycle = self.wait_cycle(rank)
                if cycle is not None:
                    raise CollectiveTimeoutError(f"{_text(what)}: {cycle}")
                still_since = now  # look again after as long
            if now >= deadline:
                detail = "".join(f"; {self.describe_rank(r)}" for r in needed)
                raise CollectiveTimeoutError(
                    f"{_text(what)}: {missing()} within {timeout:g} s{detail}; every rank of "
                    "the group must make the same collective calls in the same order"
                )
            if now >= warn_at:
                if needed:
                    warn(f"stall: {_text(what)} has waited {now - start:.1f} s (fails at "
                         f"{timeout:g} s); missing ranks {needed}:\n"
                         + "\n".join("  " + self.describe_rank(r) for r in needed),
                         "[axondist] ")
                warn_at = now + self.stall
            signal.wait(min(deadline - now, warn_at - now, CYCLE_STILL / 2))


def _text(what: str | Text) -> str:
    return what if isinstance(what, str) else what()
