"""The Python work of one warm 4 KiB all-reduce on a one-rank mock world, counted with
``sys.setprofile``: the key, the plan lookup, the plan's round and its rank-order sum. The
figure is deterministic at one rank (no thread waits for another), so it is pinned exactly
here; ``tests/world/test_call_cost.py`` bounds it at every size and under the launchers.
A change that adds a frame to every collective shows here first (raise the figure only with
a measured reason).
"""

from __future__ import annotations

import gc

from harness import calls_in_a_warm_all_reduce

import axondist as ad

#: (Python functions, C functions) one warm 4 KiB SUM enters on a one-rank mock world (56 and
#: 30 when the plans still called the backend's methods).
BUDGET = (27, 18)


def test_a_warm_4_kib_all_reduce_on_one_mock_rank_stays_at_its_figure():
    names: list[str] = []
    python, c = ad.spawn(calls_in_a_warm_all_reduce, 1, names)[0]
    assert python <= BUDGET[0] and c <= BUDGET[1], (
        f"one warm 4 KiB all_reduce entered {python} Python and {c} C functions on one mock "
        f"rank; the figure is {BUDGET}; they were:\n" + "\n".join(names))


def test_the_figure_counts_the_call_not_a_collection_that_lands_inside_it():
    """A collection inside the count would add its callbacks (some libraries register
    ``gc.callbacks``) and the finalizers of what earlier tests left; the count excludes it."""
    def collected(phase: str, info: dict) -> None:
        pass

    def body(world):
        threshold = gc.get_threshold()
        gc.callbacks.append(collected)
        gc.set_threshold(1)  # a collection at every allocation
        try:
            return calls_in_a_warm_all_reduce(world)
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(collected)

    assert ad.spawn(body, 1)[0] == BUDGET
