"""World tests that fail on purpose on some ranks (``AXONDIST_FAIL_RANKS``, a comma-separated
list), for the tests that check what a failing rank prints under mpiexec: a plain test, and
a hypothesis test that fails at one example (where hypothesis would go on to shrink and
replay it on the failing ranks alone). Not collected on their own (the file's name does
not start with ``test_``); both pass where the variable is unset."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad

FAILING = [int(r) for r in os.environ.get("AXONDIST_FAIL_RANKS", "").split(",") if r]


def test_one_rank_fails() -> None:
    world = ad.init()
    if world.rank in FAILING:
        assert world.rank not in FAILING, f"rank {world.rank} fails this test on purpose"
    ad.all_reduce(np.ones(3))  # the other ranks wait here until the abort ends them


@given(size=st.integers(1, 50))
def test_one_rank_fails_one_example(size: int) -> None:
    world = ad.init()
    ad.all_reduce(np.ones(3))  # one collective per example: the ranks must stay in step
    if world.rank in FAILING and size > 5:
        assert size <= 5, f"rank {world.rank} fails size={size} on purpose"
