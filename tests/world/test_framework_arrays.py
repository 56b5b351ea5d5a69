"""Torch tensors and JAX arrays through the collectives and the wrappers, against NumPy.

Every rank runs each collective twice, on a NumPy array and on the same values as a torch
tensor or a JAX array, and the two results must agree bit for bit, come back in the
caller's framework, and (torch, in place) be the very tensor passed. The wrappers train
with gradient callables that hand their gradients over as torch tensors or JAX arrays, and
must end where the same training on NumPy gradients ends. Skipped where torch or JAX is not
installed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import pytest
from harness import current_size, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_toy import bwd, data, fwd, layer_params, mse

import axondist as ad
from axondist._array import SUPPORTED_DTYPES, bfloat16
from axondist._frameworks import framework_of
from axondist.ddp import DistributedDataParallel
from axondist.fsdp import FSDP
from axondist.optim import SGD
from axondist.pipeline import Pipeline, PipelineStage
from axondist.zero import ZeroRedundancyOptimizer

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

FRAMEWORKS = ("torch", "jax")
DTYPE_NAMES = [str(d) for d in SUPPORTED_DTYPES]


def _x64(framework: str) -> contextlib.AbstractContextManager[Any]:
    """JAX keeps 64-bit dtypes only with x64 enabled (per thread: each rank enters it)."""
    return jax.enable_x64(True) if framework == "jax" else contextlib.nullcontext()


def to_framework(a: np.ndarray, framework: str) -> Any:
    """``a``'s values as a torch tensor or JAX array, made without axondist."""
    if framework == "jax":
        return jnp.asarray(a)
    if a.dtype == bfloat16:
        return torch.tensor(a.astype(np.float32).tolist(), dtype=torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(x: Any) -> np.ndarray:
    """A framework array's values as NumPy, made without axondist."""
    if isinstance(x, torch.Tensor):
        if x.dtype is torch.bfloat16:
            return np.array(x.float().tolist(), dtype=np.float32).astype(bfloat16)
        return x.detach().numpy().copy()
    return np.array(x)


def same(got: Any, want: np.ndarray, framework: str) -> None:
    """``got`` is an array of ``framework`` holding ``want``'s exact bits."""
    assert isinstance(got, torch.Tensor if framework == "torch" else jax.Array), type(got)
    values = to_numpy(got)
    assert values.dtype == want.dtype and values.shape == want.shape, (values.dtype, want.dtype)
    assert values.tobytes() == want.tobytes(), (values, want)


def values_of(dtype: np.dtype, shape: tuple[int, ...], seed: int, rank: int) -> np.ndarray:
    """Small exact values for ``dtype`` (no overflow in a product over a few ranks)."""
    rng = np.random.default_rng([seed, rank])
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    ints = rng.integers(0 if dtype.kind == "u" else -2, 3, shape)
    if dtype.kind == "c":
        return (ints + 1j * rng.integers(-2, 3, shape)).astype(dtype)
    if dtype.kind in "iu":
        return ints.astype(dtype)
    return (ints / 2).astype(dtype)


def ops_for(dtype: np.dtype) -> list[str]:
    """The reduce ops defined for ``dtype`` (ops.check_op_dtype's rules)."""
    ops = ["sum", "product"]
    if dtype.kind != "c":
        ops += ["min", "max"]
    if dtype.kind not in "biu":
        ops.append("average")
    return ops


def _refuses_complex_product(world: ad.World) -> bool:
    """torch.distributed reduces complex tensors with SUM and AVERAGE only: the torch
    backend refuses a complex PRODUCT, by name."""
    return type(world.backend).__name__ == "TorchBackend"


def body_collectives(world: ad.World, framework: str, dtype_name: str, rows: int,
                     trailing: tuple[int, ...], seed: int, async_op: bool) -> bool:
    dtype = SUPPORTED_DTYPES[DTYPE_NAMES.index(dtype_name)]
    n, r = world.world_size, world.rank
    mine = values_of(dtype, (rows,) + trailing, seed, r)
    with _x64(framework):
        for op in ops_for(dtype):
            if op == "product" and dtype.kind == "c" and _refuses_complex_product(world):
                with pytest.raises(ad.UnsupportedDTypeError, match="cannot multiply complex"):
                    ad.all_reduce(to_framework(mine, framework), op, world)
                continue
            want = ad.all_reduce(mine.copy(), op, world)
            x = to_framework(mine, framework)
            got = ad.all_reduce(x, op, world, async_op=async_op)
            got = got.wait() if async_op else got
            same(got, want, framework)
            if framework == "torch":
                assert got is x, op
            else:  # a JAX input stays as it was; the result is new
                assert to_numpy(x).tobytes() == mine.tobytes()
        src = seed % n
        want = ad.broadcast(mine.copy(), world, src=src)
        x = to_framework(mine, framework)
        got = ad.broadcast(x, world, src=src)
        same(got, want, framework)
        assert (got is x) == (framework == "torch")
        same(ad.all_gather(to_framework(mine, framework), world), ad.all_gather(mine, world),
             framework)
        long = values_of(dtype, (rows * n,) + trailing, seed + 1, r)
        got = ad.reduce_scatter(to_framework(long, framework), "sum", world, async_op=async_op)
        same(got.wait() if async_op else got, ad.reduce_scatter(long, "sum", world), framework)
    return True


@settings(max_examples=30)
@given(size=world_sizes(1, 4), framework=st.sampled_from(FRAMEWORKS),
       dtype_name=st.sampled_from(DTYPE_NAMES), rows=st.integers(1, 3),
       trailing=st.sampled_from([(), (2,), (2, 3)]), seed=st.integers(0, 2**16),
       async_op=st.booleans())
def test_every_dtype_round_trips_through_the_collectives(size, framework, dtype_name, rows,
                                                          trailing, seed, async_op):
    assert all(run_world(body_collectives, size, framework, dtype_name, rows, trailing, seed,
                         async_op))


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_every_dtype_crosses_each_way_without_a_copy(dtype_name):
    """A torch tensor of every dtype is read and written through the NumPy view."""
    dtype = SUPPORTED_DTYPES[DTYPE_NAMES.index(dtype_name)]
    values = values_of(dtype, (2, 3), 0, 0)
    t = to_framework(values, "torch")
    view = ad.as_array(t)
    assert view.dtype == dtype and view.tobytes() == values.tobytes()
    view[...] = values_of(dtype, (2, 3), 1, 0)
    assert to_numpy(t).tobytes() == view.tobytes()  # written into the tensor's memory


# --- the wrappers take gradients as torch tensors or JAX arrays --------------------------

SHAPES = [(3, 2), (2,), (), (4,)]
STEPS = 3


def make_params() -> list[ad.Parameter]:
    rng = np.random.default_rng(7)
    return [ad.Parameter(rng.standard_normal(s).astype(np.float32), f"p{i}")
            for i, s in enumerate(SHAPES)]


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    d = sum(math.prod(s) for s in SHAPES)
    rng = np.random.default_rng([rank, step])
    return (rng.standard_normal((4, d)).astype(np.float32),
            rng.standard_normal(4).astype(np.float32))


def grad_fn_of(framework: str | None):
    """Linear regression over all parameters at once; gradients in ``framework``
    (torch tensors that require grad, JAX arrays, or NumPy when None)."""

    def grad_fn(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray):
        theta = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])
        err = x @ theta - y
        flat = (2.0 / len(y)) * (x.T @ err)
        grads, at = [], 0
        for a in arrays:
            g = flat[at:at + a.size].reshape(a.shape).astype(np.float32)
            at += a.size
            if framework == "torch":
                g = torch.from_numpy(g).requires_grad_(True)
            elif framework == "jax":
                g = jnp.asarray(g)
            grads.append(g)
        return float(np.mean(err * err)), grads

    return grad_fn


def train(world: ad.World, wrapper: str, framework: str | None) -> list[np.ndarray]:
    params = make_params()
    grad_fn = grad_fn_of(framework)
    if wrapper == "fsdp":
        model = FSDP(params, world, grad_fn=grad_fn)
        opt = SGD(model, lr=0.05)
        for step in range(STEPS):
            with model.no_sync():  # accumulation: read-only JAX views are added, never written
                model.backward(*batch(world.rank, 100 + step))
            model.step(*batch(world.rank, step), optimizer=opt)
        with model.summon_full_params():
            return [p.data.copy() for p in params]
    ddp = DistributedDataParallel(params, world, grad_fn=grad_fn)
    opt = (ZeroRedundancyOptimizer(params, SGD, world, lr=0.05) if wrapper == "zero"
           else SGD(params, lr=0.05))
    for step in range(STEPS):
        opt.zero_grad()
        with ddp.no_sync():
            ddp.backward(*batch(world.rank, 100 + step))
        ddp.backward(*batch(world.rank, step))
        opt.step()
    return [p.data.copy() for p in params]


def body_wrapper(world: ad.World, wrapper: str, framework: str) -> bool:
    want = train(world, wrapper, None)
    with _x64(framework):
        got = train(world, wrapper, framework)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes(), (wrapper, framework, g, w)
    return True


@pytest.mark.parametrize("wrapper", ["ddp", "zero", "fsdp"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_wrappers_take_framework_gradients(wrapper, framework):
    assert all(run_world(body_wrapper, current_size(2), wrapper, framework))


def stages_in(framework: str | None, p: int) -> list[PipelineStage]:
    """pipeline_toy's stages, whose backward hands its gradients over in ``framework``."""

    def backward(params, saved, gy):
        grad_x, grads = bwd(params, saved, gy)
        if framework is None:
            return grad_x, grads
        return (to_framework(grad_x, framework),
                [to_framework(np.asarray(g), framework) for g in grads])

    def forward(params, x):
        y, saved = fwd(params, x)
        return (y if framework is None else to_framework(y, framework)), saved

    dims = [3] * (p + 1)
    return [PipelineStage(forward, backward, layer_params(5, s, dims[s], dims[s + 1]))
            for s in range(p)]


def body_pipeline(world: ad.World, framework: str) -> bool:
    p, r = world.world_size, world.rank
    results = []
    for fw in (None, framework):
        with _x64(framework):
            stage = stages_in(fw, p)[r]
            pipe = Pipeline(stage, world, num_microbatches=2)
            opt = SGD(pipe, lr=0.1)
            for step in range(2):
                x, t = data(step, 4, 3, 3)
                pipe.train_step(x if r == 0 else None, t if r == p - 1 else None, mse)
                opt.step()
                opt.zero_grad()
            pipe.close()
            results.append([q.data.copy() for q in stage.params])
    for g, w in zip(*results):
        assert g.tobytes() == w.tobytes(), (framework, g, w)
    return True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pipeline_takes_framework_gradients(framework):
    assert all(run_world(body_pipeline, current_size(2), framework))


def body_grad_set_by_hand(world: ad.World, wrapper: str, framework: str) -> bool:
    """``.grad`` set by the user to a torch tensor or JAX array, then synced or stepped."""
    n, r = world.world_size, world.rank
    mine = np.arange(5, dtype=np.float32) * (r + 1)
    mean = np.arange(5, dtype=np.float32) * (n + 1) / 2
    params = [ad.Parameter(np.ones(5, np.float32), "w")]
    grad = to_framework(mine, framework)
    if wrapper.startswith("ddp"):
        ddp = DistributedDataParallel(params, world,
                                      gradient_as_bucket_view=wrapper == "ddp-bucket-view")
        params[0].grad = grad
        ddp.sync_gradients()
        got = params[0].grad
        # a torch .grad keeps its tensor, written in place, whatever the bucket setting (the
        # user's torch optimizer reads that tensor); a JAX .grad is a new JAX array
        assert (got is grad) == (framework == "torch")
        assert framework_of(got) is framework_of(grad)
        np.testing.assert_allclose(to_numpy(got), mean, rtol=1e-6)
        np.testing.assert_allclose(to_numpy(grad), mean if framework == "torch" else mine)
        return True
    if wrapper == "fsdp":
        model = FSDP(params, world)
        model.gather_parameters()
        params[0].grad = grad
        model.reshard_parameters()
        model.sync_gradients()
        opt: Any = SGD(model, lr=1.0)
        opt.step()
        with model.summon_full_params():
            np.testing.assert_allclose(params[0].data, 1.0 - mean, rtol=1e-6)
        return True
    opt = ZeroRedundancyOptimizer(params, SGD, world, lr=1.0)  # the ranks' grads agree
    params[0].grad = to_framework(mean, framework)
    opt.step()
    np.testing.assert_allclose(params[0].data, 1.0 - mean, rtol=1e-6)
    return True


@pytest.mark.parametrize("wrapper", ["ddp", "ddp-bucket-view", "fsdp", "zero"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_grad_set_by_hand_may_be_a_framework_array(wrapper, framework):
    assert all(run_world(body_grad_set_by_hand, current_size(2), wrapper, framework))
