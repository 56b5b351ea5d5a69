"""The flight recorder's ring when slots are reused: a slot's end time from its previous
call never marks the call now in it as done (no communication), and details shorter than
their op's field list are named by its first fields."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.backends.recording.recorder import FlightRecorder, describe_detail


@given(capacity=st.sampled_from([1, 2, 4, 8]),
       plan=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), min_size=1, max_size=40))
def test_reused_slots_report_their_own_call(capacity, plan):
    # plan: per call, whether it ends, and how many calls later (threads overlap calls)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("AXONDIST_FLIGHT_RECORDER", str(capacity))
        rec = FlightRecorder(0, 2, "h")
    slots: dict[int, int] = {}
    pending: list[tuple[int, int]] = []  # (when to end, seq)
    ended: set[int] = set()
    for seq, (ends, delay) in enumerate(plan, start=1):
        slots[seq] = rec.begin("world", seq, "all_reduce", None, blocking=False)
        if ends:
            pending.append((seq + delay, seq))
        for due, done in [p for p in pending if p[0] <= seq]:
            # a slot reused since its call began belongs to a newer call: not ended here
            if seq - done < capacity:
                rec.end(slots[done])
                ended.add(done)
            pending.remove((due, done))
    calls = len(plan)
    kept = list(range(max(1, calls - capacity + 1), calls + 1))
    entries = rec.entries()
    assert [e["seq"] for e in entries] == kept
    for e in entries:
        assert e["state"] == ("done" if e["seq"] in ended else "running"), (e, ended)
    newest_done = [s for s in kept if s in ended]
    last = rec.last_completed()
    assert (last is None) if not newest_done else last["seq"] == newest_done[-1]
    assert [e["seq"] for e in rec.entries(last=2)] == kept[-2:]
    assert rec.entries(last=0) == []


def test_a_key_shorter_than_its_fields_is_named_by_the_first_ones():
    sized = describe_detail(("float32", (6, 6), False), "all_gather")
    unsized = describe_detail(("float32", "not given", False, (3,)), "all_gather")
    assert sized == "dtype=float32, counts=[6, 6]"
    assert unsized == "dtype=float32, counts=not given, trailing shape=[3]"
    # details given as (name, value) pairs name themselves
    assert describe_detail((("peer", 1), ("tag", 0)), "all_gather") == "peer=1, tag=0"
