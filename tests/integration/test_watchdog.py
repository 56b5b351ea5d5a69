"""The watchdog's logic and protocol without MPI: two ranks' watchdogs in one process,
talking over loopback."""

from __future__ import annotations

import threading
import time

import pytest

from axondist.backends import _watchdog
from axondist.backends._watchdog import GONE, Watchdog
from axondist.backends.recorder import FlightRecorder


def _pair(timeout: float = 30.0, stall: float = 20.0) -> tuple[list[Watchdog], list[str]]:
    """Rank 0's and rank 1's watchdogs of a 2-rank job; their abort messages land in a list."""
    ended: list[str] = []
    dogs = []
    for rank in range(2):
        rec = FlightRecorder(rank, 2, f"host{rank}")
        rec.groups["world"] = (0, 1)
        dogs.append(Watchdog(rec, timeout=timeout, stall=stall, abort=ended.append, token="t"))
    addresses = [d.address for d in dogs]
    for d in dogs:
        d.start(addresses)
    return dogs, ended


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_peer_answers_with_its_flight_recorder():
    dogs, _ = _pair()
    try:
        rec1 = dogs[1].recorder
        rec1.end(rec1.begin("world", 1, "all_reduce", None))
        status = dogs[0].query([1])[1]
        assert status["rank"] == 1 and status["host"] == "host1"
        assert status["completed"] == {"world": 1} and status["running"] == []
    finally:
        for d in dogs:
            d.stop()


def test_a_wrong_token_gets_no_answer_and_cannot_end_the_job():
    dogs, ended = _pair()
    try:
        dogs[0]._token = "other"
        assert dogs[0].query([1])[1] != GONE and not isinstance(dogs[0].query([1])[1], dict)
    finally:
        for d in dogs:
            d.stop()
    assert ended == []


def test_a_rank_that_left_before_the_call_ends_the_job_at_once():
    dogs, ended = _pair()
    try:
        dogs[0].recorder.begin("world", 1, "all_reduce", None)  # rank 0 waits in call #1
        dogs[1].announce_left()                                 # rank 1 leaves after none
        _wait_for(lambda: ended)
        assert "all_reduce #1 on world on rank 0 of 2 cannot complete: rank 1 (host host1" in \
            ended[0] and "left before any call" in ended[0]
    finally:
        for d in dogs:
            d.stop()


def test_a_rank_that_left_after_the_call_is_no_failure():
    dogs, ended = _pair()
    try:
        rec0, rec1 = dogs[0].recorder, dogs[1].recorder
        rec1.end(rec1.begin("world", 1, "all_reduce", None))   # rank 1 finished call #1
        rec0.begin("world", 1, "all_reduce", None)             # rank 0 still in it
        dogs[1].announce_left()
        _wait_for(lambda: 1 in dogs[0].left)
        time.sleep(0.6)  # a few monitor ticks
        assert ended == []
    finally:
        for d in dogs:
            d.stop()


def test_a_wait_cycle_through_this_rank_is_a_deadlock():
    dogs, ended = _pair()
    try:
        dogs[0].recorder.groups["world.0"] = (0, 1)
        dogs[1].recorder.groups["world.0"] = (0, 1)
        dogs[0].recorder.begin("world.0", 1, "all_reduce", None)  # rank 0 on a sub-group
        dogs[1].recorder.begin("world", 1, "barrier", None)       # rank 1 on the world
        _wait_for(lambda: ended, 15)  # either side may see the cycle first
        assert ("deadlock: rank 1 waits in barrier #1 on world, which needs this rank" in ended[0]
                or "deadlock: rank 0 waits in all_reduce #1 on world.0, which needs this rank"
                in ended[0]), ended[0]
    finally:
        for d in dogs:
            d.stop()


@pytest.mark.parametrize("stall", [0.5])
def test_a_stalled_call_warns_then_times_out_naming_the_missing_rank(stall, capsys, caplog):
    dogs, ended = _pair(timeout=2.0, stall=stall)
    try:
        dogs[0].recorder.begin("world", 1, "all_reduce", None)  # rank 1 never comes
        _wait_for(lambda: ended, 15)
        assert "timed out on rank 0 of 2" in ended[0]
        assert "missing ranks: [1]" in ended[0]
        assert "rank 1 (host host1" in ended[0] and "not in any axondist call" in ended[0]
        # to stderr, or to the logging handler pytest installs
        assert "stall: rank 0 has waited" in capsys.readouterr().err + caplog.text
    finally:
        for d in dogs:
            d.stop()


def test_a_closed_watchdog_leaves_no_thread_or_port_and_peers_see_it_gone():
    dogs, ended = _pair()
    try:
        before = {t.ident for t in threading.enumerate() if t.name.startswith("axondist-watchdog")}
        dogs[1].close()
        assert dogs[1] not in _watchdog._RUNNING
        _wait_for(lambda: dogs[0].query([1])[1] == GONE)
        _wait_for(lambda: len({t.ident for t in threading.enumerate()
                               if t.name.startswith("axondist-watchdog")}) == len(before) - 2)
        dogs[1].close()  # idempotent
    finally:
        for d in dogs:
            d.close()
    assert ended == []


def test_a_joined_call_that_does_not_finish_names_the_ranks_busy_in_their_own_code():
    dogs, _ = _pair()
    try:
        rec0, rec1 = dogs[0].recorder, dogs[1].recorder
        for rec in (rec0, rec1):  # both issued non-blocking call #1
            rec.end(rec.begin("world", 1, "all_reduce", None, False))
        rec0.begin("world", 1, "wait all_reduce", None)  # rank 0 waits; rank 1 computes
        call = rec0.running()[0]
        lines = dogs[0]._peer_lines(call, dogs[0].query([1]))
        assert "every rank has joined this call, but ranks [1] are not in any axondist" in lines[0]
        assert "rank 1 (host host1" in lines[1] and "busy in its own code" in lines[1]
        rec1.begin("world", 2, "barrier", None)  # now rank 1 waits in a call too
        lines = dogs[0]._peer_lines(call, dogs[0].query([1]))
        assert lines == ["  every rank has joined this call"]
    finally:
        for d in dogs:
            d.close()
