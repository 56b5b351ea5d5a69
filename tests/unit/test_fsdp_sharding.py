"""The pure parts of FSDP: padding and shard bounds, unit plans, node layouts,
the memory model, the policies and the norm helpers. No communication."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist._array import bfloat16
from axondist.fsdp import CPUOffload, FSDPMemoryStats, MixedPrecision, ShardingStrategy
from axondist.fsdp.sharding import (
    FlatUnit,
    hybrid_groups,
    node_of_ranks,
    overlap,
    padded_numel,
    plan_units,
    shard_bounds,
    shard_size,
    unit_indices,
    valid_bounds,
)

shapes_st = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=6)


# --- padding and bounds -------------------------------------------------------------------

@given(numel=st.integers(0, 500), shards=st.integers(1, 9))
def test_shards_are_equal_contiguous_and_cover_the_padded_buffer(numel: int, shards: int) -> None:
    padded = padded_numel(numel, shards)
    assert padded % shards == 0 and numel <= padded < numel + shards
    size = shard_size(numel, shards)
    assert size * shards == padded
    bounds = [shard_bounds(numel, shards, r) for r in range(shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == padded
    for (a, b), (c, d) in zip(bounds, bounds[1:]):
        assert b == c and b - a == size == d - c
    # the valid parts partition the real elements
    valid = [valid_bounds(numel, shards, r) for r in range(shards)]
    covered = [i for lo, hi in valid for i in range(lo, hi)]
    assert covered == list(range(numel))
    # against numpy: pad then split
    flat = np.arange(padded)
    for r, part in enumerate(np.split(flat, shards)):
        lo, hi = bounds[r]
        assert part.tolist() == list(range(lo, hi))


def test_padding_example_from_the_docstring() -> None:
    assert padded_numel(10, 4) == 12 and shard_size(10, 4) == 3
    assert shard_bounds(10, 4, 3) == (9, 12) and valid_bounds(10, 4, 3) == (9, 10)
    assert valid_bounds(2, 4, 3) == (2, 2)  # a shard of pure padding


def test_bounds_errors() -> None:
    with pytest.raises(ValueError, match="shards must be a positive int"):
        padded_numel(4, 0)
    with pytest.raises(ValueError, match="rank=4 is not in 0..3"):
        shard_bounds(10, 4, 4)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        padded_numel(-1, 2)


@given(a=st.tuples(st.integers(0, 20), st.integers(0, 20)),
       b=st.tuples(st.integers(0, 20), st.integers(0, 20)))
def test_overlap_is_set_intersection(a: tuple[int, int], b: tuple[int, int]) -> None:
    got = overlap(a, b)
    want = set(range(*a)) & set(range(*b))
    assert (set(range(*got)) if got else set()) == want


@given(shapes=shapes_st, shards=st.integers(1, 7), seed=st.integers(0, 1000))
def test_unit_pieces_rebuild_every_parameter(shapes: list, shards: int, seed: int) -> None:
    unit = FlatUnit(0, tuple(range(len(shapes))), tuple(shapes), np.dtype(np.float32), shards)
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in shapes]
    padded = np.zeros(unit.padded_numel)
    padded[:unit.numel] = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else []
    rebuilt = [np.full(a.size, np.nan) for a in arrays]
    for r in range(shards):
        lo, hi = unit.shard_bounds(r)
        shard = padded[lo:hi]
        for pc in unit.pieces(r):
            rebuilt[pc.position][pc.param_start:pc.param_stop] = \
                shard[pc.shard_offset:pc.shard_offset + pc.size]
    for a, b in zip(arrays, rebuilt):
        np.testing.assert_array_equal(a.reshape(-1), b)
    assert unit.padding == unit.padded_numel - unit.numel < shards or unit.numel == 0


# --- unit plans ---------------------------------------------------------------------------

@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
       kinds=st.lists(st.sampled_from(["float32", "float16"]), min_size=12, max_size=12),
       limit=st.integers(1, 1000))
def test_default_plan_is_ordered_within_limits_and_one_dtype(sizes: list, kinds: list,
                                                             limit: int) -> None:
    dtypes = kinds[:len(sizes)]
    plan = plan_units(sizes, dtypes, None, limit)
    assert [i for u in plan for i in u] == list(range(len(sizes)))
    for u in plan:
        assert len({dtypes[i] for i in u}) == 1
        nbytes = sum(sizes[i] * np.dtype(dtypes[i]).itemsize for i in u)
        assert nbytes <= limit or len(u) == 1
    # greedy: a unit closes only when the next parameter would not fit, or the dtype changes
    for u, nxt in zip(plan, plan[1:]):
        j = nxt[0]
        nbytes = sum(sizes[i] * np.dtype(dtypes[i]).itemsize for i in u)
        assert dtypes[j] != dtypes[u[0]] or nbytes + sizes[j] * np.dtype(dtypes[j]).itemsize > limit


def test_explicit_plan_errors() -> None:
    f32 = ["float32"] * 3
    assert plan_units([1, 2, 3], f32, [[2, 0], [1]]) == [[2, 0], [1]]
    with pytest.raises(ValueError, match="parameters \\[2\\] are in no unit"):
        plan_units([1, 2, 3], f32, [[0, 1]])
    with pytest.raises(ValueError, match="parameter 1 is in unit 0 and unit 1"):
        plan_units([1, 2, 3], f32, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="names parameter 5, but the model has 3"):
        plan_units([1, 2, 3], f32, [[0, 1, 2, 5]])
    with pytest.raises(ValueError, match="unit 1 is empty"):
        plan_units([1, 2, 3], f32, [[0, 1, 2], []])
    with pytest.raises(ValueError, match="mixes dtypes"):
        plan_units([1, 2], ["float32", "float16"], [[0, 1]])


def test_model_units_as_indices() -> None:
    params = [object(), object(), object()]
    assert unit_indices([[params[2]], [0, np.int64(1)]], params) == [[2], [0, 1]]
    with pytest.raises(ValueError, match="names a Parameter that model.parameters\\(\\) does not"):
        unit_indices([[object()]], params)


# --- node layouts -------------------------------------------------------------------------

@given(nodes=st.integers(1, 4), per_node=st.integers(1, 4))
def test_hybrid_groups_from_ranks_per_node(nodes: int, per_node: int) -> None:
    n = nodes * per_node
    shard, replica = hybrid_groups(node_of_ranks(n, per_node))
    assert shard == [list(range(k * per_node, (k + 1) * per_node)) for k in range(nodes)]
    assert replica == [list(range(j, n, per_node)) for j in range(per_node)]
    # every rank is in exactly one shard group and one replica group, and they meet once
    for s in shard:
        for r in replica:
            assert len(set(s) & set(r)) == 1


def test_hybrid_groups_from_interleaved_node_labels() -> None:
    shard, replica = hybrid_groups(["a", "b", "a", "b"])
    assert shard == [[0, 2], [1, 3]] and replica == [[0, 1], [2, 3]]


def test_node_layout_errors() -> None:
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the group of 4 ranks"):
        node_of_ranks(4, 3)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        node_of_ranks(4, 0)
    with pytest.raises(ValueError, match="nodes hold different numbers of ranks"):
        hybrid_groups([0, 0, 1])


# --- the memory model ---------------------------------------------------------------------

@given(p=st.integers(0, 10**9), n=st.integers(1, 64))
def test_zero_paper_accounting_mixed_precision_adam(p: int, n: int) -> None:
    def est(strategy: str) -> FSDPMemoryStats:
        return FSDPMemoryStats.estimate(p, n, strategy, param_bytes=2, grad_bytes=2,
                                        optimizer_bytes=12)

    shard = math.ceil(p / n)
    assert est("no_shard").total_bytes_per_rank == 16 * p
    assert est("shard_grad_op").total_bytes_per_rank == 2 * p + 14 * shard
    assert est("full_shard").total_bytes_per_rank == 16 * shard
    for s in ("no_shard", "shard_grad_op", "full_shard"):
        assert est(s).no_shard_bytes_per_rank == 16 * p
    if p:
        assert est("full_shard").memory_savings() == pytest.approx(100 * (1 - shard / p))
        assert est("no_shard").memory_savings() == 0


def test_estimate_hybrid_offload_and_units() -> None:
    hy = FSDPMemoryStats.estimate(1000, 8, ShardingStrategy.HYBRID_SHARD, ranks_per_node=4)
    assert hy.world_size == 4 and hy.total_bytes_per_rank == 250 * 16
    off = FSDPMemoryStats.estimate(1000, 4, "full_shard", cpu_offload=CPUOffload.PARAMS)
    assert off.host_bytes_per_rank == off.total_bytes_per_rank and off.device_bytes_per_rank == 0
    st_ = FSDPMemoryStats.estimate(2**20, 1, "no_shard", 4, 4, 8)
    assert st_.total_memory_mb() == 16.0
    assert st_.as_dict()["sharding_strategy"] == "NO_SHARD"
    assert "NO_SHARD over 1 (estimated)" in str(st_)
    with pytest.raises(ValueError, match="world_size >= 1"):
        FSDPMemoryStats.estimate(10, 0)
    with pytest.raises(ValueError, match="FSDPMemoryStats.estimate: sharding_strategy='zero-7' "
                       "is not one of ShardingStrategy's names; use one of 'full_shard'"):
        FSDPMemoryStats.estimate(10, 2, "zero-7")


# --- policies --------------------------------------------------------------------------------

def test_mixed_precision_policy() -> None:
    mp = MixedPrecision(param_dtype="bfloat16")
    assert mp.param_dtype == bfloat16 and mp.compute_dtype(np.float32) == bfloat16
    assert mp.communication_dtype(np.float32) == bfloat16  # follows param_dtype
    mp2 = MixedPrecision(reduce_dtype=np.float16)
    assert mp2.compute_dtype(np.float32) == np.float32
    assert mp2.communication_dtype(np.float32) == np.float16
    assert MixedPrecision().communication_dtype(np.float64) == np.float64
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = np.float16  # type: ignore[misc]
    with pytest.raises(ValueError, match="param_dtype=int32 is not a floating dtype"):
        MixedPrecision(param_dtype="int32")


def test_offload_and_strategy_parsing() -> None:
    assert CPUOffload.OPTIMIZER_STATES is CPUOffload.PARAMS
    assert CPUOffload.parse(True) is CPUOffload.PARAMS
    assert CPUOffload.parse(None) is CPUOffload.NONE
    assert CPUOffload.parse("optimizer_states") is CPUOffload.PARAMS
    assert CPUOffload.parse("full").offloads_accumulation
    with pytest.raises(ValueError, match="cpu_offload=.gpu. is not one of CPUOffload.s names"):
        CPUOffload.parse("gpu")
    assert ShardingStrategy.parse("FULL_SHARD") is ShardingStrategy.FULL_SHARD
    assert ShardingStrategy.HYBRID_SHARD.shards_parameters
    assert not ShardingStrategy.SHARD_GRAD_OP.shards_parameters
