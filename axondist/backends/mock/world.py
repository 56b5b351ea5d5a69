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
from ..watchdog.watchdog import warn

# Stages of a round.
_GATHERING, _SHARING, _DONE = range(3)

Text = Callable[[], str]


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
        #: Counts posted messages and completed rounds: a receive cycle is a deadlock
        #: only when it holds while nothing moves anywhere in the world.
        self.progress = 0
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
                 timeout: float | None = None) -> None:
        """Wait (holding ``signal``, which whoever makes ``ready()`` true notifies) until
        ``ready()``.

        ``waiting_for`` lists the world ranks the wait needs: one that left
        fails the wait at once, and the stall warning names each with its last
        calls. Abort, departure and timeout become errors.
        """
        if ready():
            return
        with self.lock:
            self.sleepers[signal] += 1
        try:
            self._sleep_until(signal, ready, what, missing, waiting_for, timeout)
        finally:
            with self.lock:
                self.sleepers[signal] -= 1
                if not self.sleepers[signal]:
                    del self.sleepers[signal]

    def _sleep_until(self, signal: _Signal, ready: Callable[[], bool],
                     what: str | Text, missing: Text,
                     waiting_for: Callable[[], list[int]] | None,
                     timeout: float | None) -> None:
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
                    f"{_text(what)}: " + "; ".join(f"{self.describe_rank(r)} ({self.left[r]})"
                                                   for r in gone)
                    + ": it will never join this call")
            now = time.monotonic()
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
            signal.wait(min(deadline - now, warn_at - now, 1.0))


def _text(what: str | Text) -> str:
    return what if isinstance(what, str) else what()
