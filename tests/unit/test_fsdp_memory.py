"""The FSDP memory models without communication: the ZeRO paper's figures, the exact
per-unit footprint summed over every shard, the tally of held buffers, and the
strategy table they read."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist._array import bfloat16
from axondist.fsdp import CPUOffload, FSDPMemoryStats, ShardingStrategy
from axondist.fsdp.memory import Footprint, HeldBytes, OptimizerModel, unit_footprint
from axondist.fsdp.policies import SHARDING_SPECS, ShardingSpec, Span
from axondist.fsdp.sharding import FlatUnit
from axondist.optim import SGD, Adam, AdamW
from axondist.parameter import Parameter

# The ZeRO paper (Rajbhandari et al. 2020), figure 1: a 7.5B-parameter model on 64 GPUs,
# mixed-precision Adam (2 bytes of parameters, 2 of gradients, K = 12 of optimizer state).
PSI, N_D, K = 7_500_000_000, 64, 12
PAPER_GB = {
    ShardingStrategy.NO_SHARD: "120",  # baseline (DDP)
    ShardingStrategy.SHARD_OPTIMIZER: "31.4",  # P_os
    ShardingStrategy.SHARD_GRAD_OP: "16.6",  # P_os+g
    ShardingStrategy.FULL_SHARD: "1.88",  # P_os+g+p
}


@pytest.mark.parametrize("strategy", list(PAPER_GB))
def test_estimate_reproduces_the_zero_paper_figures(strategy: ShardingStrategy) -> None:
    est = FSDPMemoryStats.estimate(PSI, N_D, strategy, param_bytes=2, grad_bytes=2,
                                   optimizer_bytes=K)
    assert f"{est.total_bytes_per_rank / 1e9:.3g}" == PAPER_GB[strategy]
    assert est.no_shard_bytes_per_rank == 16 * PSI


def test_zero_stage_names() -> None:
    assert ShardingStrategy.parse("zero1") is ShardingStrategy.SHARD_OPTIMIZER
    assert ShardingStrategy.parse("ZeRO2") is ShardingStrategy.SHARD_GRAD_OP
    assert ShardingStrategy.parse("zero3") is ShardingStrategy.FULL_SHARD
    with pytest.raises(ValueError, match="FullyShardedDataParallel: sharding_strategy='zero4' "
                                         "is not one of ShardingStrategy's names"):
        ShardingStrategy.parse("zero4")


# --- the strategy table ---------------------------------------------------------------------

def test_every_strategy_has_one_spec_and_specs_are_nested() -> None:
    assert set(SHARDING_SPECS) == set(ShardingStrategy)
    for strategy, spec in SHARDING_SPECS.items():
        assert strategy.spec is spec
        assert strategy.shards_parameters == spec.parameters
        assert spec.optimizer_state >= spec.gradients >= spec.parameters
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.parameters = True  # type: ignore[misc]


def test_a_new_strategy_is_a_row() -> None:
    """ZeRO-2 within a node, replicated across nodes: a valid spec, no code needed."""
    spec = ShardingSpec(Span.NODE, Span.ACROSS_NODES, False, True, True)
    assert spec.uses_nodes and not spec.parameters


@pytest.mark.parametrize("args, message", [
    ((Span.GROUP, Span.NONE, True, False, True), "parameters imply gradients"),
    ((Span.GROUP, Span.NONE, False, True, False), "gradients imply optimizer_state"),
    ((Span.GROUP, Span.NONE, False, False, False), "at least the optimizer state"),
    ((Span.NONE, Span.GROUP, False, False, True), "shard_over=NONE shards nothing"),
    ((Span.GROUP, Span.GROUP, True, True, True), "one of shard_over and replicate_over"),
    ((Span.NODE, Span.GROUP, True, True, True), "go together"),
    ((Span.ACROSS_NODES, Span.NONE, True, True, True), "shard_over=ACROSS_NODES"),
])
def test_inconsistent_specs_are_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingSpec(*args)


# --- the exact footprint --------------------------------------------------------------------

DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([bfloat16] if bfloat16 else [])


@given(numel=st.integers(0, 200), shards=st.integers(1, 7),
       strategy=st.sampled_from([s for s in ShardingStrategy if s.spec.shard_over is Span.GROUP]),
       compute=st.sampled_from(DTYPES), states=st.integers(0, 2))
def test_footprints_of_all_shards_add_up_to_the_padded_unit(numel: int, shards: int,
                                                            strategy: ShardingStrategy,
                                                            compute: np.dtype,
                                                            states: int) -> None:
    flat = FlatUnit(0, (0,), ((numel,),), np.dtype(np.float32), shards)
    model = OptimizerModel(states)
    spec = strategy.spec
    per_rank = []
    for r in range(shards):
        out = Footprint()
        unit_footprint(flat, r, spec, compute, model, CPUOffload.NONE, out)
        per_rank.append(out)
    mixed = compute != np.float32
    total = Footprint()
    for out in per_rank:
        for name in ("params", "grads", "optim", "padding"):
            total.add(name, getattr(out, name))
    padded, pad, c = flat.padded_numel, flat.padding, compute.itemsize
    kept = not spec.parameters and (shards > 1 or mixed)  # a full copy beside the master
    sharded_grads = spec.gradients or shards == 1
    # master shards and optimizer state cover the padded unit once over all ranks;
    # full copies (parameters kept, unsharded gradients) once per rank
    assert total.params == (0 if mixed else 4 * padded) + (shards * padded * c if kept else 0)
    assert total.optim == (4 * padded if mixed else 0) + states * 4 * padded
    assert total.grads == 4 * padded * (1 if sharded_grads else shards)
    assert total.padding == (4 * pad + (shards * pad * c if kept else 0)
                             + 4 * pad * (1 if sharded_grads else shards) + states * 4 * pad)


def test_footprint_host_bytes_under_offload() -> None:
    flat = FlatUnit(0, (0,), ((10,),), np.dtype(np.float32), 4)
    out = Footprint()
    unit_footprint(flat, 3, ShardingStrategy.FULL_SHARD.spec, np.float32, OptimizerModel(2),
                   CPUOffload.PARAMS, out)
    # shard of 3 elements (1 real, 2 padding): master, grad and 2 states rest on the host
    assert out.params == 12 and out.grads == 12 and out.optim == 24
    assert out.host == 48 and out.padding == 4 * 2 * 4


def test_optimizer_model_reads_the_optimizer() -> None:
    p = [Parameter(np.zeros(3, np.float32))]
    assert OptimizerModel.of(None).states == 2
    assert OptimizerModel.of(SGD(p, lr=0.1)).states == 0
    assert OptimizerModel.of(SGD(p, lr=0.1, momentum=0.9)).states == 1
    assert OptimizerModel.of(Adam(p)).states == OptimizerModel.of(AdamW(p)).states == 2
    assert OptimizerModel(2).dtype_for(np.float16) == np.float32
    assert OptimizerModel(2).dtype_for(np.float64) == np.float64
    assert SGD(p, lr=0.1, momentum=0.9).state_names() == ("momentum_buffer",)
    assert Adam(p).state_names() == ("exp_avg", "exp_avg_sq")
    assert Adam.state_dtype("bfloat16" if bfloat16 else np.float16) == np.float32
    with pytest.raises(TypeError, match="cannot be trained"):
        Adam.state_dtype(np.int32)


# --- the tally of held buffers -----------------------------------------------------------------

def test_held_bytes_counts_each_buffer_once_and_views_by_their_base() -> None:
    flat = FlatUnit(0, (0,), ((10,),), np.dtype(np.float32), 4)  # padded 12, shards of 3
    full = np.zeros(12, np.float32)
    held = HeldBytes()
    held.add(full[3:6], "grads", flat, 1)  # a view keeps its whole base alive
    held.add(full, "params", flat, 1)  # already counted
    held.add(full[:10].reshape(2, 5), "params")
    held.add(None, "optim")
    shard = np.zeros(3, np.float32)
    held.add(shard, "optim", flat, 3, host=True)  # the last shard: 2 padding elements
    assert held.total.grads == 48 and held.total.params == 0 and held.total.optim == 12
    assert held.total.padding == 2 * 4 + 2 * 4 and held.total.host == 12


@given(p=st.integers(0, 10**12), n=st.integers(1, 1024))
def test_paper_estimate_is_monotone_in_the_stages(p: int, n: int) -> None:
    totals = [FSDPMemoryStats.estimate(p, n, s, 2, 2, 12).total_bytes_per_rank
              for s in ("no_shard", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)
    assert totals[3] == 16 * math.ceil(p / n)
