"""The Python work of one warm 4 KiB all-reduce on a one-rank mock world, counted with
``sys.setprofile``: the key, the plan lookup, the plan's round and its rank-order sum. The
figure is deterministic at one rank (no thread waits for another), so it is pinned exactly
here; ``tests/world/test_call_cost.py`` bounds it at every size and under the launchers.
A change that adds a frame to every collective shows here first (raise the figure only with
a measured reason).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import axondist as ad

#: (Python functions, C functions) one warm 4 KiB SUM enters on a one-rank mock world (56 and
#: 30 when the plans still called the backend's methods).
BUDGET = (27, 18)


def _count(world: ad.World) -> tuple[int, int]:
    x = np.ones(1024, np.float32)
    for _ in range(3):  # the plan made and warm
        ad.all_reduce(x)
    calls = {"call": 0, "c_call": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in calls:
            calls[event] += 1

    sys.setprofile(profile)
    try:
        ad.all_reduce(x)
    finally:
        sys.setprofile(None)
    np.testing.assert_array_equal(x, 1.0)
    return calls["call"], calls["c_call"] - 1  # setprofile(None) itself is a C call


def test_a_warm_4_kib_all_reduce_on_one_mock_rank_stays_at_its_figure():
    python, c = ad.spawn(_count, 1)[0]
    assert python <= BUDGET[0] and c <= BUDGET[1], (
        f"one warm 4 KiB all_reduce entered {python} Python and {c} C functions on one mock "
        f"rank; the figure is {BUDGET}")
