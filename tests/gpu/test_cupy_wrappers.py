"""The wrappers on CuPy arrays against the same training on NumPy arrays.

Each test trains twice inside ``run_world`` from the same seeds, once with
parameters and batches in the device namespace (CuPy) and once in NumPy,
and checks that the two runs agree (float64 to ~1e-12, float32 to ~1e-5,
bfloat16 to its own tolerance), that the NumPy run equals single-process
training, and that every array is where it should be: CuPy arrays stay on
the device, CPU-offloaded FSDP state rests in NumPy. The hand-written
forward and gradient callables take their namespace from their arguments
(``xp = ad.namespace(x)``), so one body serves both runs. Skipped at
collection without CuPy or a CUDA device; ``AXONDIST_TEST_FAKE_DEVICE_XP=numpy``
makes the "device" namespace NumPy (the checks that an array is a CuPy one
are then skipped) so the logic runs anywhere, on the mock world and under
``mpiexec``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from harness import current_size, run_world, why_no_gpu, world_sizes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import GradSyncStrategy, _array, comm
from axondist.checkpoint import (
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
)
from axondist.ddp import DistributedDataParallel
from axondist.fsdp import FSDP, CPUOffload, MixedPrecision, ShardingStrategy
from axondist.optim import SGD, Adam
from axondist.pipeline import SCHEDULES, Pipeline, PipelineSchedule, PipelineStage
from axondist.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP

FAKE_ENV = "AXONDIST_TEST_FAKE_DEVICE_XP"
FAKE = os.environ.get(FAKE_ENV, "") == "numpy"
if os.environ.get(FAKE_ENV, "") not in ("", "numpy"):
    raise ValueError(f"{FAKE_ENV}={os.environ[FAKE_ENV]!r}: the only fake device namespace is "
                     "'numpy' (or leave it unset to use CuPy)")


REASON = None if FAKE else why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

#: The "device" namespace: CuPy, or NumPy in fake mode (None when the file is skipped).
DXP: ModuleType | None = np if FAKE else sys.modules.get("cupy") if REASON is None else None

F64 = {"rtol": 1e-12, "atol": 1e-13}
F32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
REUSED_FIXTURE = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def tol(dtype: Any) -> dict[str, float]:
    """Agreement expected between the two runs for arrays of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return F64
    return F32 if dtype == np.float32 else BF16


# --- where arrays live -------------------------------------------------------------------

def on_device(*arrays: Any) -> None:
    """Each array is in the device namespace (a ``cupy.ndarray``; NumPy in fake mode)."""
    for a in arrays:
        assert a is not None
        assert ad.namespace(a) is DXP, f"{_array.describe(a)} is not on the device"
        if not FAKE:
            assert _array.is_cupy(a), f"{type(a).__name__} is not a cupy.ndarray"


def where_computed(xp: ModuleType, *arrays: Any) -> None:
    """Each array lives where the run computes: the device in the device run, else NumPy."""
    if xp is np:
        for a in arrays:
            assert type(a) is np.ndarray, f"{type(a).__name__} in the NumPy run"
    else:
        on_device(*arrays)


def on_host(*arrays: Any) -> None:
    """Each array is a NumPy array (host memory)."""
    for a in arrays:
        assert type(a) is np.ndarray, f"{type(a).__name__} is not in host memory"


def host(a: Any) -> np.ndarray:
    """A NumPy copy of ``a`` (device or host)."""
    return np.array(ad.to_host(a), copy=True)


def both_runs(body: Any, size: int, *args: Any) -> tuple[list[Any], list[Any]]:
    """``body(world, xp, *args)`` on every rank, with the device namespace then NumPy."""
    return run_world(body, size, DXP, *args), run_world(body, size, np, *args)


def assert_runs_agree(dev: Any, ref: Any, dtype: Any) -> None:
    """Two nested lists/tuples of host arrays (or floats) are equal within ``dtype``'s
    tolerance."""
    if isinstance(dev, (list, tuple)):
        assert len(dev) == len(ref)
        for a, b in zip(dev, ref):
            assert_runs_agree(a, b, dtype)
        return
    np.testing.assert_allclose(np.asarray(dev, np.float64), np.asarray(ref, np.float64),
                               **tol(dtype))


# --- a model every rank can train alone: 0.5 * mean((tanh(x . theta) - y)^2) -------------

SHAPES = [(3, 4), (5,), (2, 3), (), (4, 2)]


def numel() -> int:
    return sum(math.prod(s) for s in SHAPES)


def init_values(seed: int, rank: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, rank, 1])
    return [0.4 * rng.standard_normal(s) for s in SHAPES]


def make_params(xp: ModuleType, seed: int, dtype: Any, rank: int = 0) -> list[ad.Parameter]:
    return [ad.Parameter(xp.asarray(v.astype(dtype)), name=f"p{i}")
            for i, v in enumerate(init_values(seed, rank))]


def local_batch(seed: int, rank: int, step: int, rows: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, rank, step, 2])
    return rng.standard_normal((rows, numel())) / math.sqrt(numel()), rng.standard_normal(rows)


def grad_fn(arrays: list[Any], x: Any, y: Any) -> tuple[float, list[Any]]:
    """Loss and gradients in float64, in the arrays' namespace, cast to each array's dtype."""
    xp = ad.namespace(*arrays, x, y)
    theta = xp.concatenate([a.astype(xp.float64).reshape(-1) for a in arrays])
    yh = xp.tanh(x @ theta)
    r = yh - y
    g = x.T @ (r * (1.0 - yh * yh)) / len(y)
    grads, off = [], 0
    for a in arrays:
        grads.append(g[off:off + a.size].reshape(a.shape).astype(a.dtype))
        off += a.size
    return 0.5 * float(xp.mean(r * r)), grads


def rows_of(rank: int, weighted: bool) -> int:
    """Rows of ``rank``'s batch: 3 everywhere, or unequal (weighted by ``num_samples``)."""
    return 2 + rank % 3 if weighted else 3


def reference(seed: int, ranks: int, steps: int, dtype: Any, weighted: bool = False,
              micro: int = 1, lr: float = 0.3, momentum: float = 0.9) -> list[np.ndarray]:
    """One process, NumPy, every rank's batch concatenated, SGD with momentum; with
    ``micro`` > 1 each step sums the gradients of ``micro`` such batches."""
    params = make_params(np, seed, dtype)
    opt = SGD(params, lr=lr, momentum=momentum)
    for step in range(steps):
        total: list[Any] = [0.0] * len(params)
        for m in range(micro):
            parts = [local_batch(seed, r, step + 100 * m, rows_of(r, weighted))
                     for r in range(ranks)]
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
            _, grads = grad_fn([p.data for p in params], x, y)
            total = [t + g for t, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = np.asarray(g, dtype=p.dtype)
        opt.step()
    return [np.asarray(p.data) for p in params]


# --- DDP with gradients as views into the buckets -----------------------------------------

def ddp_body(world: ad.World, xp: ModuleType, seed: int, dtype: str, strategy: GradSyncStrategy,
             manual: bool, weighted: bool) -> tuple[list[float], list[np.ndarray]]:
    params = make_params(xp, seed, dtype, world.rank)  # rank 0's values are broadcast
    ddp = DistributedDataParallel(params, world, strategy=strategy, grad_fn=grad_fn,
                                  bucket_cap_mb=48 / 2**20, first_bucket_mb=24 / 2**20,
                                  gradient_as_bucket_view=True)
    sync = ddp.synchronizer
    assert len(ddp.bucket_indices) >= 3  # several buckets
    where_computed(xp, *(state.bucket.buffer for state in sync.buckets))
    opt = SGD(ddp.parameters(), lr=0.3, momentum=0.9)
    losses = []
    for step in range(3):
        rows = rows_of(world.rank, weighted)
        x, y = (xp.asarray(a) for a in local_batch(seed, world.rank, step, rows))
        n = rows if weighted else None
        opt.zero_grad(set_to_none=False)
        if manual:  # in place: lands in the bucket without a packing copy
            loss, grads = grad_fn([p.data for p in params], x, y)
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad[...] = g
            ddp.sync_gradients(num_samples=n)
            if step > 0:
                assert sync.copies == 0
        else:
            loss = ddp.backward(x, y, num_samples=n)
        losses.append(loss)
        for i, p in enumerate(params):
            assert p.grad is sync.slot(i)  # .grad is the bucket's view
            where_computed(xp, p.grad, p.data)
        opt.step()
        for i in opt.state:
            where_computed(xp, opt.state[i]["momentum_buffer"])
    ddp.close()
    return losses, [host(p.data) for p in params]


@given(size=world_sizes(1, 3), seed=st.integers(0, 2**20),
       dtype=st.sampled_from(["float64", "float32"]),
       strategy=st.sampled_from([GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED]),
       manual=st.booleans(), weighted=st.booleans())
@settings(max_examples=8)
def test_ddp_bucket_views_on_device_equal_numpy(size: int, seed: int, dtype: str,
                                                strategy: GradSyncStrategy, manual: bool,
                                                weighted: bool) -> None:
    dev, ref = both_runs(ddp_body, size, seed, dtype, strategy, manual, weighted)
    want = reference(seed, current_size(size), 3, dtype, weighted)
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, dtype)
        assert_runs_agree(r[1], want, dtype)


# --- FSDP FULL_SHARD with CPU offload: where each array lives, step by step ---------------

def located_grad_fn(xp: ModuleType) -> Any:
    """:func:`grad_fn`, checking first that the parameters and batch it gets live where the
    run computes."""
    def checked(arrays: list[Any], x: Any, y: Any) -> tuple[float, list[Any]]:
        where_computed(xp, *arrays, x, y)
        assert all(a.size > 0 for a in arrays)  # gathered
        return grad_fn(arrays, x, y)
    return checked


def check_offloaded_resting(f: FSDP, xp: ModuleType) -> None:
    """Between steps: shards (and their gradients) on the host, the model's Parameters 0-size
    placeholders where the run computes."""
    for shard in f.sharded_parameters():
        on_host(shard.data)
        if shard.grad is not None:
            on_host(shard.grad)
    for p in f.full_parameters():
        assert p.data.size == 0
        where_computed(xp, p.data)


def micro_batch(xp: ModuleType, seed: int, rank: int, step: int, m: int) -> tuple[Any, Any]:
    """Micro-batch ``m`` of ``rank``'s batch at ``step``, in ``xp`` (``m=0``: the whole batch
    of an unaccumulated step)."""
    return tuple(xp.asarray(a) for a in local_batch(seed, rank, step + 100 * m))


def manual_backward(f: FSDP, xp: ModuleType, x: Any, y: Any) -> float:
    """gather, gradients, reshard, sync, checking where each array lives on the way."""
    f.gather_parameters()
    full = f.full_parameters()
    where_computed(xp, *(p.data for p in full))
    assert [p.shape for p in full] == SHAPES
    loss, grads = grad_fn([p.data for p in full], x, y)
    where_computed(xp, *grads)
    for p, g in zip(full, grads):
        p.grad = g
    f.reshard_parameters()
    f.sync_gradients()
    assert all(p.grad is None for p in full)
    return loss


def check_accumulation(f: FSDP, xp: ModuleType) -> None:
    """no_sync buffers rest on the host under CPUOffload.FULL, else where the run computes."""
    buffers = [st.accum for st in f._units]  # private: FSDP has no public view of them
    assert all(b is not None for b in buffers)
    if f.cpu_offload.offloads_accumulation:
        on_host(*buffers)
    else:
        where_computed(xp, *buffers)


def fsdp_offload_body(world: ad.World, xp: ModuleType, seed: int, dtype: str,
                      units: list[list[int]] | None, offload: CPUOffload,
                      micro: int) -> tuple[list[float], list[np.ndarray]]:
    f = FSDP(make_params(xp, seed, dtype, world.rank), world,
             sharding_strategy=ShardingStrategy.FULL_SHARD, cpu_offload=offload, units=units)
    opt = SGD(f.sharded_parameters(), lr=0.3, momentum=0.9)
    f.register_optimizer(opt)
    losses = []
    for step in range(3):
        check_offloaded_resting(f, xp)
        for u in range(len(f.units)):  # what the all-gather is given: on the device
            where_computed(xp, f.communication_shard(u))
        for m in range(micro - 1):  # accumulated locally, reduced with the last one
            with f.no_sync():
                if step == 2:
                    f.backward(located_grad_fn(xp), *micro_batch(xp, seed, world.rank, step, m))
                else:
                    manual_backward(f, xp, *micro_batch(xp, seed, world.rank, step, m))
            check_accumulation(f, xp)
            check_offloaded_resting(f, xp)
        x, y = micro_batch(xp, seed, world.rank, step, micro - 1)
        if step == 2:  # the one-call step too, its gradient function seeing device arrays
            losses.append(f.step(located_grad_fn(xp), x, y, optimizer=opt))
        else:
            losses.append(manual_backward(f, xp, x, y))
            on_host(*(s.grad for s in f.sharded_parameters()))
            opt.step()
            opt.zero_grad()
        on_host(*(opt.state[i]["momentum_buffer"] for i in opt.state))
        assert f.memory_stats().host_bytes_per_rank >= sum(
            s.data.nbytes for s in f.sharded_parameters())
    check_offloaded_resting(f, xp)
    state = f.state_dict()  # NumPy, master dtype, every rank
    on_host(*state.values())
    return losses, [state[f"p{i}"] for i in range(len(SHAPES))]


@given(size=world_sizes(1, 3), seed=st.integers(0, 2**20),
       dtype=st.sampled_from(["float64", "float32"]),
       units=st.sampled_from([None, [[0, 1], [2, 3, 4]], [[i] for i in range(len(SHAPES))]]),
       offload=st.sampled_from([CPUOffload.PARAMS, CPUOffload.FULL]), micro=st.integers(1, 2))
@settings(max_examples=8)
def test_fsdp_full_shard_cpu_offload_on_device_equals_numpy(size: int, seed: int, dtype: str,
                                                            units: Any, offload: CPUOffload,
                                                            micro: int) -> None:
    dev, ref = both_runs(fsdp_offload_body, size, seed, dtype, units, offload, micro)
    want = reference(seed, current_size(size), 3, dtype, micro=micro)
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, dtype)
        assert_runs_agree(r[1], want, dtype)


# --- mixed precision: bfloat16 compute parameters ------------------------------------------

def device_has_bfloat16() -> bool:
    """Whether the device namespace holds and converts bfloat16 arrays (CuPy >= 14)."""
    if DXP is None or _array.bfloat16 is None:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = DXP.asarray(np.array([1.5, -2.25], np.float32)).astype(_array.bfloat16)
            back = ad.to_host(a.astype(np.float32))
        return a.dtype == _array.bfloat16 and back.tolist() == [1.5, -2.25]
    except Exception:
        return False


def fsdp_bf16_body(world: ad.World, xp: ModuleType, seed: int, reduce_dtype: str | None,
                   strategy: ShardingStrategy) -> tuple[list[float], list[np.ndarray]]:
    mp = MixedPrecision(param_dtype="bfloat16", reduce_dtype=reduce_dtype)
    f = FSDP(make_params(xp, seed, "float32", world.rank), world, sharding_strategy=strategy,
             mixed_precision=mp)
    opt = SGD(f.sharded_parameters(), lr=0.3, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = (xp.asarray(a) for a in local_batch(seed, world.rank, step))
        f.gather_parameters()
        full = f.full_parameters()
        assert all(p.dtype == _array.bfloat16 for p in full)  # the compute parameters
        where_computed(xp, *(p.data for p in full))
        loss, grads = grad_fn([p.data for p in full], x, y)
        assert all(g.dtype == _array.bfloat16 for g in grads)
        for p, g in zip(full, grads):
            p.grad = g
        f.reshard_parameters()
        f.sync_gradients()
        for s in f.sharded_parameters():  # float32 masters and their gradients
            assert s.dtype == np.float32 and s.grad.dtype == np.float32
            where_computed(xp, s.data, s.grad)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    state = f.state_dict()
    assert all(v.dtype == np.float32 for v in state.values())
    return losses, [state[f"p{i}"] for i in range(len(SHAPES))]


@given(size=world_sizes(1, 3), seed=st.integers(0, 2**20),
       reduce_dtype=st.sampled_from([None, "float32"]),
       strategy=st.sampled_from([ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                                 ShardingStrategy.NO_SHARD]))
@settings(max_examples=5)
def test_fsdp_bfloat16_on_device_equals_numpy(size: int, seed: int, reduce_dtype: str | None,
                                              strategy: ShardingStrategy) -> None:
    if not device_has_bfloat16():
        pytest.skip("the device namespace has no bfloat16 (CuPy >= 14 has)")
    dev, ref = both_runs(fsdp_bf16_body, size, seed, reduce_dtype, strategy)
    ranks = current_size(size)
    want = reference(seed, ranks, 3, "float32")
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, _array.bfloat16)
        for got, expected in zip(r[1], want):
            np.testing.assert_allclose(got, expected, rtol=5e-2, atol=5e-2)


# --- the pipeline: affine + tanh stages, one (or two) per rank ----------------------------

def stage_fwd(params: list[Any], x: Any) -> tuple[Any, Any]:
    w, b = params
    xp = ad.namespace(w, x)
    y = xp.tanh(x @ w + b)
    return y, (x, y)


def stage_bwd(params: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    w, _ = params
    x, y = saved
    gz = gy * (1.0 - y * y)
    return gz @ w.T, [x.T @ gz, gz.sum(axis=0)]


def mse(y: Any, t: Any) -> tuple[float, Any]:
    d = y - t
    xp = ad.namespace(d)
    return 0.5 * float(xp.sum(d * d)) / y.shape[0], d / y.shape[0]


def stage_params(xp: ModuleType, seed: int, s: int, d_in: int, d_out: int) -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, s, 3])
    return [ad.Parameter(xp.asarray(rng.standard_normal((d_in, d_out)) / math.sqrt(d_in)),
                         f"W{s}"),
            ad.Parameter(xp.asarray(0.1 * rng.standard_normal(d_out)), f"b{s}")]


def pipeline_data(seed: int, step: int, rows: int, d_in: int,
                  d_out: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, step, 4])
    return rng.standard_normal((rows, d_in)), rng.standard_normal((rows, d_out))


def sequential_grads(seed: int, dims: list[int], x: np.ndarray,
                     t: np.ndarray, values: list[list[np.ndarray]]) -> tuple[float, list]:
    """One process, NumPy: the loss and every stage's gradients on the whole batch."""
    saved, h = [], x
    for w, b in values:
        h, sv = stage_fwd([w, b], h)
        saved.append(sv)
    loss, g = mse(h, t)
    grads: list[Any] = [None] * len(values)
    for s in reversed(range(len(values))):
        g, grads[s] = stage_bwd(values[s], saved[s], g)
    return loss, grads


def pipeline_body(world: ad.World, xp: ModuleType, seed: int, kind: PipelineSchedule,
                  micro: int) -> tuple[list[float], list[np.ndarray], list[np.ndarray]]:
    p, r = world.world_size, world.rank
    chunks = 2 if SCHEDULES[kind].multi_chunk else 1
    dims = [3 + (s % 3) for s in range(p * chunks + 1)]
    mine = [c * p + r for c in range(chunks)]  # virtual stages r, r + p, ...

    def fwd(params: list[Any], x: Any) -> tuple[Any, Any]:
        where_computed(xp, x, *params)  # activations arrive where the run computes
        return stage_fwd(params, x)

    def bwd(params: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
        where_computed(xp, gy)  # and so do the gradients sent back
        return stage_bwd(params, saved, gy)

    stages = [PipelineStage(fwd, bwd, stage_params(xp, seed, s, dims[s], dims[s + 1]))
              for s in mine]
    last = (p * chunks - 1) % p
    pipe = Pipeline(stages, world, num_microbatches=micro, schedule=kind, chunks=chunks)
    opt = SGD(pipe, lr=0.1, momentum=0.9)
    losses, grads = [], []
    for step in range(2):
        x, t = (xp.asarray(a) for a in pipeline_data(seed, step, 2 * micro + 1, dims[0],
                                                     dims[-1]))
        loss = pipe.train_step(x if r == 0 else None, t if r == last else None, mse)
        losses.append(loss)
        for stage in stages:
            for prm in stage.params:
                where_computed(xp, prm.grad, prm.data)
                grads.append(host(prm.grad))
        opt.step()
        for i in opt.state:
            where_computed(xp, opt.state[i]["momentum_buffer"])
    x, _ = pipeline_data(seed, 9, micro, dims[0], dims[-1])
    y = pipe.forward(xp.asarray(x) if r == 0 else None)
    if r == last:
        where_computed(xp, y)
    pipe.close()
    finals = [host(prm.data) for stage in stages for prm in stage.params]
    return losses, grads, finals + ([host(y)] if r == last else [])


@given(size=world_sizes(1, 4), seed=st.integers(0, 2**20),
       kind=st.sampled_from([PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE,
                             PipelineSchedule.INTERLEAVED_ONE_F_ONE_B]),
       micro=st.integers(1, 4))
@settings(max_examples=8)
def test_pipeline_on_device_equals_numpy(size: int, seed: int, kind: PipelineSchedule,
                                         micro: int) -> None:
    dev, ref = both_runs(pipeline_body, size, seed, kind, micro)
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, np.float64)
    # The NumPy run's first step equals one process on the whole batch.
    n = current_size(size)
    chunks = 2 if SCHEDULES[kind].multi_chunk else 1
    dims = [3 + (s % 3) for s in range(n * chunks + 1)]
    values = [[p.data for p in stage_params(np, seed, s, dims[s], dims[s + 1])]
              for s in range(n * chunks)]
    x, t = pipeline_data(seed, 0, 2 * micro + 1, dims[0], dims[-1])
    want_loss, _ = sequential_grads(seed, dims, x, t, values)
    for losses, _, _ in ref:
        assert losses[0] == pytest.approx(want_loss, rel=1e-12)


# --- tensor parallel: an MLP, and a gathered column layer into a row layer ----------------

def dense_mlp(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 5])
    return [rng.standard_normal((7, 4)) / 2, 0.1 * rng.standard_normal(7),
            rng.standard_normal((3, 7)) / 2, 0.1 * rng.standard_normal(3)]


def tp_body(world: ad.World, xp: ModuleType, seed: int, layout: str,
            dtype: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    w1, b1, w2, b2 = (xp.asarray(a.astype(dtype)) for a in dense_mlp(seed))
    if layout == "mlp":
        mlp = TensorParallelMLP.from_dense(w1, b1, w2, b2, world, activation="gelu")
        params = mlp.parameters()

        def forward(x: Any) -> Any:
            return mlp.forward(x)

        def backward(g: Any) -> Any:
            return mlp.backward(g)
    else:  # Y = relu(X A^T + a) gathered on every rank, then a row layer that splits it
        col = ColumnParallelLinear.from_dense(w1, b1, world, gather_output=True)
        row = RowParallelLinear.from_dense(w2, b2, world, input_is_parallel=False)
        params = col.parameters() + row.parameters()
        saved: dict[str, Any] = {}

        def forward(x: Any) -> Any:
            h = col.forward(x)
            saved["h"] = h
            return row.forward(h * (h > 0))

        def backward(g: Any) -> Any:
            h = saved["h"]
            return col.backward(row.backward(g) * (h > 0))
    where_computed(xp, *(p.data for p in params))
    opt = SGD(params, lr=0.05, momentum=0.9)
    outs = []
    for step in range(2):
        rng = np.random.default_rng([seed, step, 6])
        x = xp.asarray(rng.standard_normal((2, 3, 4)).astype(dtype))
        gy = xp.asarray(rng.standard_normal((2, 3, 3)).astype(dtype))
        y = forward(x)
        dx = backward(gy)
        where_computed(xp, y, dx, *(p.grad for p in params))
        outs += [host(y), host(dx)] + [host(p.grad) for p in params]
        opt.step()
        opt.zero_grad()
    return outs, [host(p.data) for p in params]


def gelu(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (h + 0.044715 * h**3))
    return 0.5 * h * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * c * (
        1.0 + 3 * 0.044715 * h * h)


@given(size=world_sizes(1, 4), seed=st.integers(0, 2**20),
       layout=st.sampled_from(["mlp", "gathered"]),
       dtype=st.sampled_from(["float64", "float32"]))
@settings(max_examples=8)
def test_tensor_parallel_on_device_equals_numpy(size: int, seed: int, layout: str,
                                                dtype: str) -> None:
    dev, ref = both_runs(tp_body, size, seed, layout, dtype)
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, dtype)
    if layout != "mlp":
        return
    # The NumPy run's first output equals the dense MLP's.
    w1, b1, w2, b2 = dense_mlp(seed)
    x = np.random.default_rng([seed, 0, 6]).standard_normal((2, 3, 4))
    act, _ = gelu(x @ w1.T + b1)
    want = act @ w2.T + b2
    for outs, _ in ref:
        np.testing.assert_allclose(outs[0], want, rtol=1e-4 if dtype == "float32" else 1e-10,
                                   atol=1e-5 if dtype == "float32" else 1e-10)


# --- checkpoints from a device-resident FSDP ----------------------------------------------

def shared_dir(world: ad.World, base: str) -> str:
    """A fresh directory under rank 0's ``base``, the same path on every rank."""
    path = tempfile.mkdtemp(prefix="cupy-ckpt-", dir=base) if world.rank == 0 else None
    return comm.broadcast_object(path, world, src=0)


def full_values(f: FSDP) -> list[np.ndarray]:
    f.gather_parameters()
    values = [host(p.data) for p in f.full_parameters()]
    f.reshard_parameters()
    return values


def checkpoint_body(world: ad.World, xp: ModuleType, base: str, seed: int,
                    offload: CPUOffload) -> list[Any]:
    d = shared_dir(world, base)
    sharded, full_file = os.path.join(d, "sharded"), os.path.join(d, "full.npz")

    def wrap(target_xp: ModuleType, values_seed: int) -> tuple[FSDP, Adam]:
        f = FSDP(make_params(target_xp, values_seed, "float32", world.rank), world,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, cpu_offload=offload,
                 units=[[0, 1], [2, 3, 4]])
        return f, Adam(f.sharded_parameters(), lr=0.05)

    def rests(f: FSDP, opt: Adam, target_xp: ModuleType) -> None:
        shards = [s.data for s in f.sharded_parameters()]
        state = [v for i in opt.state for k, v in opt.state[i].items() if k != "step"]
        if offload.offloads_shards:
            on_host(*shards, *state)
        else:
            where_computed(target_xp, *shards, *state)

    def train(f: FSDP, opt: Adam, step: int) -> None:
        x, y = (xp.asarray(a) for a in local_batch(seed, world.rank, step))
        f.step(located_grad_fn(xp), x, y, optimizer=opt)

    f, opt = wrap(xp, seed)
    for step in range(2):
        train(f, opt, step)
    rests(f, opt, xp)
    save_sharded_checkpoint(sharded, f, opt, metadata={"step": 2})
    save_full_checkpoint(full_file, f, metadata={"step": 2})
    saved = full_values(f)
    train(f, opt, 2)
    after = full_values(f)

    g, g_opt = wrap(xp, seed + 1)  # other values: the load must replace them
    assert load_sharded_checkpoint(sharded, g, g_opt) == {"step": 2}
    rests(g, g_opt, xp)
    g.gather_parameters()
    where_computed(xp, *(p.data for p in g.full_parameters()))
    g.reshard_parameters()
    assert_runs_agree(full_values(g), saved, np.float32)
    train(g, g_opt, 2)  # the optimizer state came back too
    assert_runs_agree(full_values(g), after, np.float32)

    n, n_opt = wrap(np, seed + 1)  # the same checkpoint into a NumPy FSDP
    load_sharded_checkpoint(sharded, n, n_opt)
    rests(n, n_opt, np)
    assert_runs_agree(full_values(n), saved, np.float32)

    h, _ = wrap(xp, seed + 2)
    loaded = load_full_checkpoint(full_file, h)
    on_host(*loaded.values())
    assert_runs_agree(full_values(h), saved, np.float32)
    assert_runs_agree([loaded[f"p{i}"] for i in range(len(SHAPES))], saved, np.float32)
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    return [saved, after]


@given(size=world_sizes(1, 3), seed=st.integers(0, 2**20),
       offload=st.sampled_from([CPUOffload.NONE, CPUOffload.PARAMS]))
@settings(max_examples=4, suppress_health_check=REUSED_FIXTURE)
def test_checkpoint_round_trip_from_device_fsdp(tmp_path: Path, size: int, seed: int,
                                                offload: CPUOffload) -> None:
    dev, ref = both_runs(checkpoint_body, size, str(tmp_path), seed, offload)
    for d, r in zip(dev, ref):
        assert_runs_agree(d, r, np.float32)
