"""The helper thread that tests OVERLAPPED DDP's all-reduces in flight between gradients.

Driven with stand-in Works (no communication): it tests the oldest unfinished piece until
none is left and then idles, it stops with the synchronizer (closed or collected), a
failing test stops it without an unhandled thread exception, and it keeps out of the
caller's way through the synchronizer's lock.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends.base import Work
from axondist.ddp import GradientSynchronizer
from axondist.ddp.pieces import ProgressHelper

THREAD = "axondist-grad-progress"


class CountingWork(Work):
    """Completes at its ``after``-th test; ``fail`` raises at the first test instead."""

    def __init__(self, after: int, fail: bool = False) -> None:
        self.after, self.fail, self.tests = after, fail, 0
        self.threads: set[str] = set()

    def is_completed(self) -> bool:
        self.threads.add(threading.current_thread().name)
        if self.tests >= self.after:
            return True
        self.tests += 1
        if self.fail:
            raise RuntimeError("all_reduce: MPI_ERR_OTHER")
        return self.tests >= self.after

    def wait(self, timeout: float | None = None) -> None:
        self.tests = self.after


def helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def eventually(condition, seconds: float = 20.0) -> bool:
    """Poll ``condition`` until true or ``seconds`` passed (a bound, not a timing check)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@settings(max_examples=10, deadline=None)
@given(afters=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_the_helper_tests_every_piece_until_done_then_idles(afters: list[int]) -> None:
    sync = GradientSynchronizer("overlapped")
    works = [CountingWork(a) for a in afters]
    helper = ProgressHelper(sync, 1e-4)
    try:
        with sync._lock:
            sync._in_flight.extend(works)
            helper.wake()
        assert eventually(lambda: all(w.tests == w.after for w in works))
        assert eventually(lambda: not helper._woken.is_set())  # nothing left: it idles
        assert all(w.threads == {THREAD} for w in works)
        counts = [w.tests for w in works]
        time.sleep(0.01)
        assert [w.tests for w in works] == counts  # no test past completion
    finally:
        helper.stop()
    assert not helper._thread.is_alive()


def test_the_helper_waits_for_the_lock_the_caller_holds() -> None:
    sync = GradientSynchronizer("overlapped")
    work = CountingWork(3)
    helper = ProgressHelper(sync, 1e-4)
    try:
        with sync._lock:
            sync._in_flight.append(work)
            helper.wake()
            time.sleep(0.05)
            assert work.tests == 0  # the caller holds the lock: no test meanwhile
        assert eventually(lambda: work.tests == 3)
    finally:
        helper.stop()


def test_a_failing_test_stops_the_helper_quietly_and_a_wake_restarts_it() -> None:
    sync = GradientSynchronizer("overlapped")
    bad = CountingWork(5, fail=True)
    helper = ProgressHelper(sync, 1e-4)
    try:
        with sync._lock:
            sync._in_flight.append(bad)
            helper.wake()
        assert eventually(lambda: not helper._woken.is_set())
        assert bad.tests == 1 and helper._thread.is_alive()
        good = CountingWork(2)
        with sync._lock:
            sync._in_flight.clear()
            sync._in_flight.append(good)
            helper.wake()
        assert eventually(lambda: good.tests == 2)
    finally:
        helper.stop()


def test_the_helper_ends_with_a_collected_synchronizer() -> None:
    sync = GradientSynchronizer("overlapped")
    helper = ProgressHelper(sync, 1e-4)
    thread = helper._thread
    del sync
    gc.collect()
    thread.join(20)  # it notices within a second
    assert not thread.is_alive()


@pytest.mark.parametrize("interval, expected", [(None, 0.0), (0, 0.0), (-1, 0.0),
                                                (0.002, 0.002)])
def test_the_interval_is_off_on_one_host_unless_asked(interval, expected) -> None:
    class OneHost:
        world_size = 4

        def node_info(self) -> tuple[int, int, int]:
            return 0, 1, 4

    class TwoHosts(OneHost):
        def node_info(self) -> tuple[int, int, int]:
            return 1, 1, 2

    sync = GradientSynchronizer("overlapped")
    sync.progress_interval = interval
    sync._group = OneHost()  # type: ignore[assignment]
    assert sync._helper_interval() == expected
    sync._group = TwoHosts()  # type: ignore[assignment]
    assert sync._helper_interval() == (1e-3 if interval is None else expected)
