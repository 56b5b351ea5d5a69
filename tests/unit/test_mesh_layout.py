"""The mesh layout arithmetic, without communication.

Reference: ``numpy.arange(N).reshape(shape)``: the groups along an axis are
the lines of that array along the axis.
"""

from __future__ import annotations

import re
from math import prod

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.mesh import mesh_groups, mesh_layout

mesh_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


@given(shape=mesh_shapes, data=st.data())
def test_mesh_groups_are_the_lines_of_the_rank_grid(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    grid = np.arange(prod(shape)).reshape(shape)
    lines = np.moveaxis(grid, axis, -1).reshape(-1, shape[axis])
    want = sorted(line.tolist() for line in lines)
    got = mesh_groups(shape, axis)
    assert got == want
    assert sorted(r for g in got for r in g) == list(range(prod(shape)))


@given(shape=mesh_shapes)
def test_groups_of_two_axes_cross_at_most_once(shape):
    for a in range(len(shape)):
        for b in range(a + 1, len(shape)):
            crossings = [len(set(ga) & set(gb))
                         for ga in mesh_groups(shape, a) for gb in mesh_groups(shape, b)]
            assert max(crossings) == 1
            # every rank is one crossing: its own group along a meets its group along b there
            assert sum(crossings) == prod(shape)


@given(dp=st.integers(1, 8), tp=st.integers(1, 8))
def test_tp_groups_are_consecutive_and_dp_groups_strided(dp, tp):
    n = dp * tp
    layout = mesh_layout(n, tp)
    assert layout.world_size == n and layout.tp_size == tp and layout.dp_size == dp
    assert layout.tp_groups == tuple(tuple(range(k * tp, (k + 1) * tp)) for k in range(dp))
    assert layout.dp_groups == tuple(tuple(range(j, n, tp)) for j in range(tp))
    for rank in range(n):
        (tp_group,) = [g for g in layout.tp_groups if rank in g]
        (dp_group,) = [g for g in layout.dp_groups if rank in g]
        assert set(tp_group) & set(dp_group) == {rank}
        assert layout.coords(rank) == (dp_group.index(rank), tp_group.index(rank))


def test_the_issue_examples():
    layout = mesh_layout(4, 2)
    assert layout.tp_groups == ((0, 1), (2, 3))
    assert layout.dp_groups == ((0, 2), (1, 3))
    layout = mesh_layout(6, 3)
    assert layout.tp_groups == ((0, 1, 2), (3, 4, 5))
    assert layout.dp_groups == ((0, 3), (1, 4), (2, 5))


@given(n=st.integers(1, 30), tp=st.integers(1, 31))
def test_tp_that_does_not_divide_the_world_is_refused(n, tp):
    if n % tp == 0:
        assert mesh_layout(n, tp).dp_size == n // tp
        return
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    want = f"mesh_layout: tp_size={tp} does not divide the world size {n}; choose one of {divisors}"
    with pytest.raises(ValueError, match=re.escape(want)):
        mesh_layout(n, tp)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="tp_size=0 does not divide"):
        mesh_layout(4, 0)
    with pytest.raises(ValueError, match="world_size=0 must be positive"):
        mesh_layout(0, 1)
    with pytest.raises(ValueError, match="axis=2 is not an axis of a 2-D mesh"):
        mesh_groups((2, 2), 2)
    with pytest.raises(ValueError, match="positive sizes"):
        mesh_groups((2, 0), 0)
    with pytest.raises(ValueError, match="rank=4 is outside 0..3"):
        mesh_layout(4, 2).coords(4)
