"""The flight recorder on its own: what it keeps, counts and says (no communication)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.backends.recording.recorder import (
    FlightRecorder,
    describe_call,
    describe_detail,
    describe_status,
    format_entries,
)


@given(calls=st.integers(1, 40), capacity=st.sampled_from([1, 4, 8, 32]))
def test_the_ring_keeps_the_newest_calls_and_counts_every_one(calls, capacity):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("AXONDIST_FLIGHT_RECORDER", str(capacity))
        rec = FlightRecorder(0, 2, "h")
    for seq in range(1, calls):  # one call after another, as one thread makes them
        rec.end(rec.begin("world", seq, "all_reduce", None))
    rec.begin("world", calls, "all_reduce", None)  # the last one still waits
    entries = rec.entries()
    assert len(entries) == min(calls, capacity)
    assert [e["seq"] for e in entries] == list(range(calls - len(entries) + 1, calls + 1))
    assert entries[-1]["state"] == "running" and rec.running()[-1]["seq"] == calls
    assert rec.issued["world"] == calls
    assert rec.completed.get("world", 0) == calls - 1
    assert rec.entries(last=1)[0]["seq"] == calls


def test_async_calls_are_not_running_and_count_when_waited():
    rec = FlightRecorder(1, 2, "h")
    rec.end(rec.begin("world", 1, "all_reduce", None, blocking=False))
    assert rec.running() == [] and rec.issued["world"] == 1 and "world" not in rec.completed
    rec.complete("world", 1)
    assert rec.completed["world"] == 1


def test_descriptions_name_the_fields_and_the_peer():
    key = (np.dtype("float32"), (4, 2), "SUM", False)
    assert describe_detail(key, "all_reduce") == "dtype=float32, shape=[4, 2], reduce_op=SUM"
    rec = FlightRecorder(0, 2, "node0")
    rec.end(rec.begin("world", 1, "all_reduce", key))
    rec.begin("world:p2p", 1, "recv", (("peer", 1), ("tag", 3)))
    entries = rec.entries()
    assert entries[1]["peer"] == 1
    assert describe_call(entries[0]) == ("all_reduce #1 on world (dtype=float32, shape=[4, 2], "
                                         "reduce_op=SUM)")
    status = rec.status()
    text = describe_status(status)
    assert text.startswith("rank 0 (host node0")
    assert "waits in recv #1 on world:p2p (peer=1, tag=3)" in text
    assert "its last completed call was all_reduce #1 on world" in text
    assert "RUNNING for" in format_entries(entries) and "done in" in format_entries(entries)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_capacity_is_named(value, monkeypatch):
    monkeypatch.setenv("AXONDIST_FLIGHT_RECORDER", value)
    with pytest.raises(ValueError, match="AXONDIST_FLIGHT_RECORDER"):
        FlightRecorder(0, 1)
