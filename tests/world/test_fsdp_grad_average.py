"""FSDP's gradient average taken by scaling while packing, against the collective's own.

Over a power-of-two shard group, float32/float64 NumPy gradients are scaled
by ``1 / shards`` as they are packed into the flat buffer and then summed;
elsewhere the collective averages. Either way each shard gradient must equal
the collective's average of the packed full gradients: bit for bit where the
reduction order is known (the mock world sums in rank order; two MPI ranks
add one pair), within rounding otherwise. No-sync accumulation is scaled the
same way, and the same files run under mpiexec.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import LAUNCHED, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist.fsdp import FSDP, MixedPrecision, ShardingStrategy
from axondist.ops import ReduceOp

SHAPES = [(3, 4), (5,), (2, 3, 2)]
STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
              ShardingStrategy.NO_SHARD]


def rank_grads(seed: int, rank: int, dtype: type, micro: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, rank, micro])
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def check_rank(world: ad.World, seed: int, strategy: ShardingStrategy, dtype: type,
               micro_batches: int, mixed: bool) -> None:
    params = [ad.Parameter(np.zeros(s, dtype), name=f"p{i}") for i, s in enumerate(SHAPES)]
    mp = MixedPrecision(reduce_dtype="float16") if mixed else None
    f = FSDP(params, world, sharding_strategy=strategy, units=[[0, 1], [2]], mixed_precision=mp)
    full = f.full_parameters()
    for micro in range(micro_batches):
        for p, g in zip(full, rank_grads(seed, world.rank, dtype, micro)):
            p.grad = g
        if micro < micro_batches - 1:
            with f.no_sync():
                f.sync_gradients()
        else:
            f.sync_gradients()
    exact = not LAUNCHED or world.world_size <= 2
    for st_, shard in zip(f.units, f.sharded_parameters()):
        local = np.zeros(st_.padded_numel, dtype)
        for micro in range(micro_batches):
            grads = rank_grads(seed, world.rank, dtype, micro)
            local[:st_.numel] += np.concatenate([grads[i].ravel() for i in st_.param_indices])
        if mixed:
            local = local.astype(np.float16)
        expected = comm.all_reduce(local, ReduceOp.AVERAGE, world).astype(dtype)
        lo, hi = st_.shard_bounds(f.shard_rank)
        mine = expected if strategy is ShardingStrategy.NO_SHARD else expected[lo:hi]
        assert shard.grad is not None and shard.grad.dtype == dtype
        if exact and not mixed:
            np.testing.assert_array_equal(shard.grad, mine)
        else:
            tol = 2e-3 if mixed else 1e-6
            np.testing.assert_allclose(shard.grad, mine, rtol=tol, atol=tol)
    f.close()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@settings(max_examples=8, deadline=None)
@given(world_size=world_sizes(1, 5), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([np.float32, np.float64]), micro_batches=st.integers(1, 3))
def test_shard_gradients_equal_the_collective_average(strategy, world_size, seed, dtype,
                                                      micro_batches):
    run_world(check_rank, world_size, seed, strategy, dtype, micro_batches, False)


@settings(max_examples=4, deadline=None)
@given(world_size=world_sizes(1, 4), seed=st.integers(0, 2**31))
def test_half_precision_reduction_still_averages_in_the_collective(world_size, seed):
    run_world(check_rank, world_size, seed, ShardingStrategy.FULL_SHARD, np.float32, 1, True)
