"""PolledWork and PersistentAllReduce without communication: polling, timeouts, recording,
the piece plan, and the rules of starting and freeing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.backends.base import (
    CompletedWork,
    PersistentAllReduce,
    PolledWork,
    _piece_bounds,
)
from axondist.backends.recording.recorder import FlightRecorder
from axondist.errors import CollectiveTimeoutError


class Request:
    """A fake request that completes after ``polls`` tests (or on a blocking wait)."""

    def __init__(self, polls: int) -> None:
        self.polls, self.tests, self.blocked = polls, 0, False

    def test(self) -> bool:
        self.tests += 1
        return self.blocked or self.tests > self.polls

    def block(self) -> None:
        self.blocked = True


@given(numel=st.integers(0, 10_000), itemsize=st.sampled_from([1, 2, 4, 8]),
       piece=st.one_of(st.none(), st.integers(1, 4096)))
def test_pieces_cover_the_buffer_in_order_within_the_size(numel, itemsize, piece):
    bounds = _piece_bounds(numel, itemsize, piece)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    if piece is None:
        assert bounds == [(0, numel)]
    elif numel:
        per = max(1, piece // itemsize)
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) <= per and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert len(bounds) == -(-numel // per)  # the fewest pieces


def test_polled_work_polls_until_done_then_finishes_once():
    req, finished = Request(polls=3), []
    work = PolledWork(req.test, req.block, result="out", what="all_reduce",
                      finish=lambda: finished.append(1))
    assert not work.is_completed() and not finished
    assert work.wait(timeout=5) == "out" and finished == [1]
    assert work.is_completed() and work.wait() == "out" and finished == [1]


def test_polled_work_times_out_naming_the_call_and_can_be_waited_again():
    req = Request(polls=10**9)
    work = PolledWork(req.test, req.block, result=7, what="all_reduce")
    with pytest.raises(CollectiveTimeoutError,
                       match=r"all_reduce did not complete within timeout=0.01 s; it is still "
                             r"running \(call wait\(\) again, or check that every rank started"):
        work.wait(timeout=0.01)
    assert work.wait() == 7 and req.blocked  # no timeout: blocks


def test_polled_work_records_its_wait_as_the_call_it_belongs_to():
    recorder = FlightRecorder(0, 2, "host")
    recorder.groups["world"] = (0, 1)
    req = Request(polls=0)
    PolledWork(req.test, req.block, what="all_reduce", record=(recorder, "world", 5)).wait(1.0)
    assert recorder.completed.get("world") == 5


def _handle(pieces: int, polls: int = 1):
    buf = np.arange(10.0)
    bounds = _piece_bounds(10, 8, None if pieces == 1 else 8 * (10 // pieces))
    started, freed = [], []

    def start(k: int):
        started.append(k)
        req = Request(polls)
        return PolledWork(req.test, req.block)

    return PersistentAllReduce(buf, bounds, start, lambda: freed.append(True)), started, freed


def test_a_handle_starts_pieces_refuses_a_restart_in_flight_and_frees_once():
    handle, started, freed = _handle(2, polls=10**9)
    assert handle.bounds == [(0, 5), (5, 10)]
    np.testing.assert_array_equal(handle.piece(1), np.arange(5.0, 10.0))
    handle.piece(0)[...] = -1  # a piece is a view: weighting it in place weights the buffer
    assert handle.buf[:5].tolist() == [-1] * 5
    work = handle.start(0)
    with pytest.raises(RuntimeError, match="piece 0 is still being reduced; wait"):
        handle.start(0)
    work.wait()
    handle.start(0)
    handle.start(1)
    assert started == [0, 0, 1]
    handle.free()  # waits for the pieces in flight, then frees
    handle.free()
    assert freed == [True] and handle.freed
    with pytest.raises(RuntimeError, match="the handle was freed"):
        handle.start(1)
    assert "freed" in repr(handle)


def test_a_handle_without_resources_frees_quietly():
    handle = PersistentAllReduce(np.zeros(3), [(0, 3)], lambda k: CompletedWork())
    handle.start(0)
    handle.free()
    assert handle.freed
