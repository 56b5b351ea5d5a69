"""One checkpoint format for every layout: DDP, FSDP, tensor parallel, a pipeline, one process.

A small ReLU MLP trains a step in one layout, is saved, loaded into the next
layout (another world size), trains a step there, and so on; at the end one
process holds what single-process training of the same steps holds,
parameters and Adam state. Runs on the mock world and under ``mpiexec``.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from harness import current_size, mock_only, run_world
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import comm
from axondist.checkpoint import CheckpointReader, load_sharded_checkpoint, save_sharded_checkpoint
from axondist.optim import Adam
from axondist.pipeline import Pipeline, PipelineStage
from axondist.tensor_parallel import TensorParallelMLP

IN, HIDDEN, OUT, ROWS = 5, 7, 3, 12
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
SHAPES = [(HIDDEN, IN), (HIDDEN,), (OUT, HIDDEN), (OUT,)]


def dense_params(seed: int) -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, 1])
    return [ad.Parameter(rng.standard_normal(s) / 2, n) for n, s in zip(NAMES, SHAPES)]


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([step, 7])
    return rng.standard_normal((ROWS, IN)), rng.standard_normal((ROWS, OUT))


def rows(step: int, rank: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = data(step)
    k = ROWS // ranks
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


def mlp_grad(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list]:
    """Loss and gradients of mean((relu(x W1^T + b1) W2^T + b2 - y)^2)."""
    w1, b1, w2, b2 = (np.asarray(a) for a in arrays)
    h = x @ w1.T + b1
    a = np.maximum(h, 0)
    r = a @ w2.T + b2 - y
    d = 2 * r / r.size
    dh = (d @ w2) * (h > 0)
    return float(np.mean(r * r)), [dh.T @ x, dh.sum(0), d.T @ a, d.sum(0)]


def reference(steps: int) -> tuple[list[ad.Parameter], Adam]:
    params = dense_params(0)
    opt = Adam(params, lr=0.05)
    for step in range(steps):
        _, grads = mlp_grad([p.data for p in params], *data(step))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt


def shared_dir(world: ad.World) -> str:
    path = tempfile.mkdtemp(prefix="ckpt-layouts-") if world.rank == 0 else None
    return world.backend.broadcast_object(path, 0)


def assert_matches_reference(params: list[ad.Parameter], opt: Adam, steps: int) -> None:
    want, want_opt = reference(steps)
    for p, w in zip(params, want):
        np.testing.assert_allclose(p.data, w.data, rtol=1e-12, atol=1e-14, err_msg=p.name)
    got_sd, want_sd = opt.state_dict(), want_opt.state_dict()
    assert got_sd["step_count"] == want_sd["step_count"] == steps
    for k, entry in want_sd["state"].items():
        assert got_sd["state"][k]["step"] == entry["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(got_sd["state"][k][key], entry[key], rtol=1e-12,
                                       atol=1e-16)


def ddp_fsdp_tp_single(world: ad.World) -> None:
    n = world.world_size
    path = shared_dir(world)
    # 1. DDP over every rank, one step, save
    params = dense_params(0)
    ddp = ad.DistributedDataParallel(params, world, grad_fn=mlp_grad)
    opt = Adam(ddp.parameters(), lr=0.05)
    ddp.backward(*rows(0, world.rank, n))
    opt.step()
    save_sharded_checkpoint(path, ddp, opt, step=1)
    # 2. FSDP FULL_SHARD over min(3, n) ranks: load, one step, save
    fsdp_group = world.new_group(range(min(3, n)))
    if fsdp_group.is_member:
        f = ad.FSDP(dense_params(1), fsdp_group, sharding_strategy="full_shard")
        opt = Adam(f.sharded_parameters(), lr=0.5)
        assert load_sharded_checkpoint(path, f, opt) == {}
        f.step(mlp_grad, *rows(1, fsdp_group.rank, fsdp_group.world_size), optimizer=opt)
        save_sharded_checkpoint(path, f, opt, step=2)
    comm.barrier(world)
    # 3. tensor parallel, TP=2 (or 1): load, one step on the full batch, save
    tp_group = world.new_group(range(min(2, n)))
    if tp_group.is_member:
        mlp = TensorParallelMLP(IN, HIDDEN, OUT, tp_group, activation="relu",
                                dtype=np.float64, seed=5)
        opt = Adam(mlp.parameters(), lr=0.5)
        load_sharded_checkpoint(path, mlp, opt)
        x, y = data(2)
        out = mlp.forward(x)
        mlp.backward(2 * (out - y) / out.size)
        opt.step()
        save_sharded_checkpoint(path, mlp, opt, step=3, keep_last=2)
    comm.barrier(world)
    # 4. one process: what single-process training of the three steps gives
    if world.rank == 0:
        assert CheckpointReader(path).world_size == min(2, n)
        single = dense_params(2)
        opt = Adam(single, lr=0.5)
        load_sharded_checkpoint(path, single, opt)
        assert_matches_reference(single, opt, 3)
        assert opt.hyperparameters()["lr"] == 0.05  # the saved hyper-parameters win
    comm.barrier(world)
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_ddp_to_fsdp_to_tensor_parallel_to_one_process() -> None:
    run_world(ddp_fsdp_tp_single, current_size(3))


def _pipeline(group: ad.ProcessGroup, seed: int) -> Pipeline:
    """Rank i of ``group`` holds layer i (fc1 then fc2) of the MLP of ``seed``."""
    i = group.rank
    params = dense_params(seed)[2 * i:2 * i + 2]

    def fwd(arrays: list, x: np.ndarray) -> tuple:
        h = x @ arrays[0].T + arrays[1]
        return (np.maximum(h, 0) if i == 0 else h), (x, h)

    def bwd(arrays: list, saved: tuple, gy: np.ndarray) -> tuple:
        x, h = saved
        if i == 0:
            gy = gy * (h > 0)
        return gy @ arrays[0], [gy.T @ x, gy.sum(0)]
    return Pipeline(PipelineStage(fwd, bwd, params), group, num_microbatches=2,
                    schedule="gpipe")


@pytest.mark.skipif(current_size(2) < 2, reason="a two-stage pipeline needs two ranks")
def test_pipeline_stages_save_and_load_by_name() -> None:
    """Each stage's rank writes its own parameters; one process and a pipeline read them back."""

    def body(world: ad.World) -> None:
        path = shared_dir(world)
        group = world.new_group([0, 1])
        if group.is_member:
            pipe = _pipeline(group, 0)
            save_sharded_checkpoint(path, pipe, step=0)
            pipe.close()
        comm.barrier(world)
        single = dense_params(3)
        load_sharded_checkpoint(path, single)
        for p, w in zip(single, dense_params(0)):
            np.testing.assert_array_equal(p.data, w.data)
        if group.is_member:
            pipe = _pipeline(group, 4)
            load_sharded_checkpoint(path, pipe)
            held = {p.name: p.data for p in pipe.parameters()}
            assert len(held) == 2
            for name, w in zip(NAMES, dense_params(0)):
                if name in held:
                    np.testing.assert_array_equal(held[name], w.data)
            pipe.close()
        comm.barrier(world)
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    run_world(body, current_size(2))


@mock_only
@given(save_tp=st.integers(1, 4), load_tp=st.integers(1, 4), seed=st.integers(0, 1000))
@settings(max_examples=8)
def test_tensor_parallel_at_any_degree_loads_at_any_other(save_tp: int, load_tp: int,
                                                          seed: int) -> None:
    """TP=a saves (column blocks written by their ranks, row blocks gathered), TP=b loads:
    every rank's shards and Adam state are the dense ones cut for it."""
    x, y = data(seed)

    def body(world: ad.World) -> None:
        path = shared_dir(world)
        group = world.new_group(range(save_tp))
        want = dense_params(seed)
        if group.is_member:
            mlp = TensorParallelMLP.from_dense(*(p.data for p in want), group, activation="relu")
            opt = Adam(mlp.parameters(), lr=0.1)
            out = mlp.forward(x)
            mlp.backward(2 * (out - y) / out.size)
            opt.step()
            save_sharded_checkpoint(path, mlp, opt, step=seed)
        comm.barrier(world)
        single = dense_params(seed + 1)
        single_opt = Adam(single)
        load_sharded_checkpoint(path, single, single_opt)
        group = world.new_group(range(load_tp))
        if group.is_member:
            mlp = TensorParallelMLP.from_dense(*(np.zeros(s) for s in SHAPES), group,
                                               activation="relu")
            opt = Adam(mlp.parameters())
            load_sharded_checkpoint(path, mlp, opt)
            for name, (w, b) in mlp.full_weights().items():
                i = NAMES.index(f"{name}.weight")
                np.testing.assert_array_equal(w, single[i].data)
                np.testing.assert_array_equal(b, single[i + 1].data)
            state, dense_state = opt.state_dict()["state"], single_opt.state_dict()["state"]
            for k, p in enumerate(mlp.parameters()):
                dense = dense_state[NAMES.index(p.name)]["exp_avg"]
                layer = mlp.fc1 if p.name.startswith("fc1") else mlp.fc2
                cut = dense
                if p.name == "fc1.weight" or p.name == "fc1.bias":
                    cut = dense[layer.shard]
                elif p.name == "fc2.weight":
                    cut = dense[:, layer.shard]
                np.testing.assert_array_equal(state[k]["exp_avg"], cut)
        comm.barrier(world)
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    run_world(body, max(save_tp, load_tp))
