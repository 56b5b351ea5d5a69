"""DistributedSampler reading its rank and size from a world or a group (mock world)."""

from __future__ import annotations

import pytest
from harness import mock_only

import axondist as ad
from axondist.data import DistributedSampler

pytestmark = mock_only


def test_defaults_come_from_the_current_world_or_a_group():
    def body(world):
        s = DistributedSampler(11)
        sub = world.new_group([1, 2])
        in_sub = DistributedSampler(11, group=sub) if sub.is_member else None
        return (s.rank, s.num_replicas,
                None if in_sub is None else (in_sub.rank, in_sub.num_replicas))

    results = ad.spawn(body, 3)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert [r[2] for r in results] == [None, (0, 2), (1, 2)]


def test_non_member_must_pass_rank():
    def body(world):
        sub = world.new_group([0])
        if sub.is_member:
            return DistributedSampler(4, group=sub).rank
        with pytest.raises(ValueError, match="not a member"):
            DistributedSampler(4, group=sub)
        return DistributedSampler(4, group=sub, rank=0).num_replicas

    assert ad.spawn(body, 2) == [0, 1]
