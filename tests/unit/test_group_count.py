"""The count of live groups that ``new_group`` keeps per world, and its refusal past
``AXONDIST_MAX_GROUPS`` (a one-rank mock world: no communication)."""

from __future__ import annotations

import pytest

import axondist as ad
from axondist.errors import TooManyGroupsError
from axondist.process_group import MAX_GROUPS_ENV


def test_groups_count_from_creation_to_destroy(monkeypatch) -> None:
    monkeypatch.delenv(MAX_GROUPS_ENV, raising=False)
    world = ad.World.mock()
    a, b = world.new_group([0]), world.new_group([0])
    c = a.new_group([0])  # a group of a group counts in the same world
    assert world._live.count == 3
    with world.new_group([0]):
        assert world._live.count == 4
    assert world._live.count == 3
    b.destroy()
    b.destroy()  # idempotent: counted once
    assert world._live.count == 2
    c.destroy()
    a.destroy()
    assert world._live.count == 0
    assert ad.World.mock()._live.count == 0  # each world counts its own


def test_max_groups_refuses_the_next_group_and_says_how_to_free(monkeypatch) -> None:
    monkeypatch.setenv(MAX_GROUPS_ENV, "2")
    world = ad.World.mock()
    groups = [world.new_group([0]) for _ in range(2)]
    with pytest.raises(TooManyGroupsError, match=r"^new_group: cannot make another group: 2 "
                                                 r"groups made by new_group are alive on this "
                                                 r"rank and AXONDIST_MAX_GROUPS=2 allows no more"
                                                 r".*group.destroy\(\)"):
        world.new_group([0])
    groups.pop().destroy()
    world.new_group([0]).destroy()  # one freed: room for one more


@pytest.mark.parametrize("raw", ["many", "-1", "1.5"])
def test_a_bad_max_groups_is_named(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(MAX_GROUPS_ENV, raw)
    with pytest.raises(ValueError, match=f"AXONDIST_MAX_GROUPS='{raw}' must be an int >= 0"):
        ad.World.mock().new_group([0])
