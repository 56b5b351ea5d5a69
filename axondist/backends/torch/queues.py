"""The torch backend's threads and queues: the order in which one group's calls reach
torch.distributed (:class:`CallOrder`, a non-blocking call queued on a thread of the group's
own), the Work of such a queued call (:class:`QueuedWork`), the sends of a rank
(:class:`Outbox`, one thread per channel while it has messages), and the teardown of the
groups it destroyed (:class:`Reaper`).

Every thread here is a daemon, unlike ``ThreadPoolExecutor``'s workers, which the
interpreter joins at exit: a send nobody receives, or a call a peer never joins, must not
keep the process from ending (and from saying so).
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import CollectiveTimeoutError
from ..work import Work

if TYPE_CHECKING:
    from .backend import TorchBackend

#: Tags a user tag maps to: a message's header and data, and an object's header and bytes.
TAG_KINDS = 4


def tags(tag: int) -> tuple[int, int, int, int]:
    """The torch tags of user ``tag``: a message's header and data, an object's header and
    bytes."""
    base = TAG_KINDS * int(tag)
    return base, base + 1, base + 2, base + 3


class SerialThread:
    """A daemon thread that runs what it is given in order, each call's value in a future."""

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


class Reaper:
    """A daemon thread that lets go of destroyed process groups, so that gloo's teardown (it
    joins the group's socket loop, which looks at its sockets every few milliseconds: about
    20 ms a group) does not hold up the rank that closed the group. :meth:`drain` waits for
    what was handed over, and must run before the interpreter finalizes (gloo's threads may
    not outlive it)."""

    def __init__(self) -> None:
        self._groups: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def drop(self, pg: Any) -> None:
        """Take over the last reference to ``pg`` (destroyed in torch.distributed already)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="axondist-torch-groups-freed")
                self._thread.start()
        self._groups.put(pg)

    def drain(self) -> None:
        """Wait until every group handed over is freed."""
        if self._thread is not None:
            self._groups.join()

    def _loop(self) -> None:
        while True:
            pg = self._groups.get()
            del pg  # the last reference: gloo's teardown runs here, without the GIL
            self._groups.task_done()


class Outbox:
    """What this rank's sends queue (:meth:`TorchBackend.send`), sent in order per channel
    (group, destination and tag: the order a receiver matches them in) by a thread of the
    channel's own while it has messages, and the sends not received yet.

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
            self._pending.append((dst, tag, future, channel[-1] % TAG_KINDS >= 2))
            self._channels.setdefault(channel, collections.deque()).append((send, future))
            if channel not in self._running:
                self._running.add(channel)
                threading.Thread(target=self._drain, args=(channel,), daemon=True,
                                 name=f"axondist-send-to-{dst}").start()
        return future

    def track(self, dst: int, tag: int, receipt: concurrent.futures.Future,
              is_object: bool) -> None:
        """Count a message to world rank ``dst`` with user ``tag`` sent without a thread of
        this outbox (through the world's own connections) until ``receipt`` says it was
        received."""
        with self._lock:
            self._pending = [p for p in self._pending if not _delivered(p[2])]
            self._pending.append((dst, tag, receipt, is_object))

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


__all__ = ["TAG_KINDS", "CallOrder", "Outbox", "QueuedWork", "SerialThread", "tags"]
