"""Gradients through the collectives (axondist.differentiable), torch autograd and JAX grad,
eager and inside ``jax.jit``, against a one-process reference and finite differences.

Every rank's input and loss weights derive from a seed and the rank, so each rank can compute
the whole job's objective ``J = sum_r sum(w_r * cos(y_r))`` on its own, with no collective
(the one-process reference, differentiated by ``jax.grad`` in float64), and check its own
gradient against it. Finite differences perturb every rank's input along a seeded direction
at once and compare ``J(x + hv) - J(x - hv)`` with the gradients' inner product with ``v``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from harness import current_size, run_world, world_sizes
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import differentiable as dd

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

NAMES = ("all_reduce_sum", "all_reduce_average", "all_reduce_max", "all_reduce_min",
         "all_gather", "reduce_scatter_sum", "reduce_scatter_average", "broadcast",
         "all_to_all", "all_to_all_sizes")
WIDTH = 2  # trailing size of every input


def rows_of(case: str, rank: int, n: int, seed: int) -> int:
    """Leading size of rank ``rank``'s input: uneven across ranks for the gathers."""
    if case == "all_gather":
        return int(np.random.default_rng([seed, 7, rank]).integers(0, 4))
    return 5


def send_table(n: int, seed: int) -> list[list[int]]:
    """Rows each rank sends to each (row r: rank r's send_sizes, adding up to 5)."""
    rng = np.random.default_rng([seed, 11])
    return [list(rng.multinomial(5, [1 / n] * n)) for _ in range(n)]


def inputs(case: str, rank: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal((rows_of(case, rank, n, seed), WIDTH))
    if case in ("all_reduce_max", "all_reduce_min"):
        x[0] = np.arange(WIDTH)  # the same on every rank: ties share the gradient
    return x


def weights(shape: tuple[int, ...], rank: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 99, rank]).standard_normal(shape)


def direction(case: str, rank: int, n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng([seed, 5, rank]).standard_normal(
        inputs(case, rank, n, seed).shape)
    if case in ("all_reduce_max", "all_reduce_min"):
        v[0] = 0  # a tie has no derivative: finite differences stay off it
    return v


# --- the one-process reference -------------------------------------------------------

def reference_outputs(case: str, xs: list[Any], n: int, seed: int) -> list[Any]:
    """Every rank's result of the collective, computed in one process from all inputs."""
    stacked = jnp.stack(xs) if case.startswith("all_reduce") or "scatter" in case else None
    if case == "all_reduce_sum":
        return [stacked.sum(0)] * n
    if case == "all_reduce_average":
        return [stacked.mean(0)] * n
    if case == "all_reduce_max":
        return [stacked.max(0)] * n
    if case == "all_reduce_min":
        return [stacked.min(0)] * n
    if case == "all_gather":
        return [jnp.concatenate(xs)] * n
    if case.startswith("reduce_scatter"):
        total = stacked.sum(0) if case.endswith("sum") else stacked.mean(0)
        return jnp.array_split(total, n)
    if case == "broadcast":
        return [xs[n - 1]] * n
    table = send_table(n, seed) if case == "all_to_all_sizes" else [
        ad.comm.split_sizes(5, n)] * n
    blocks = [np.split(np.arange(5), np.cumsum(t)[:-1]) for t in table]
    return [jnp.concatenate([xs[k][blocks[k][r]] for k in range(n)]) for r in range(n)]


def objective(ys: list[Any], seed: int) -> Any:
    return sum(jnp.sum(jnp.asarray(weights(tuple(y.shape), r, seed)) * jnp.cos(y))
               for r, y in enumerate(ys))


def reference_grad(case: str, n: int, seed: int, me: int) -> np.ndarray:
    xs = [jnp.asarray(inputs(case, r, n, seed)) for r in range(n)]
    grads = jax.grad(lambda xs: objective(reference_outputs(case, xs, n, seed), seed))(xs)
    return np.asarray(grads[me])


# --- the collective under test ---------------------------------------------------------

def collective(case: str, n: int, seed: int, me: int) -> Callable[[Any], Any]:
    """This rank's differentiable call for ``case``."""
    if case.startswith("all_reduce"):
        op = case.split("_")[-1]
        return lambda x: dd.all_reduce(x, op)
    if case == "all_gather":
        return dd.all_gather
    if case.startswith("reduce_scatter"):
        op = case.split("_")[-1]
        return lambda x: dd.reduce_scatter(x, op)
    if case == "broadcast":
        return lambda x: dd.broadcast(x, src=n - 1)
    if case == "all_to_all_sizes":
        table = send_table(n, seed)
        return lambda x: dd.all_to_all(x, send_sizes=table[me])
    return dd.all_to_all


def local_loss(y: Any, xp: Any, rank: int, seed: int) -> Any:
    w = weights(tuple(y.shape), rank, seed)
    w = torch.from_numpy(w) if xp is torch else jnp.asarray(w)
    return (w * xp.cos(y)).sum()


def grad_of(case: str, framework: str, x: np.ndarray, world: ad.World, seed: int) -> Any:
    """This rank's gradient of ``J`` with respect to its input, through the framework."""
    me, n = world.rank, world.world_size
    call = collective(case, n, seed, me)
    if framework == "torch":
        t = torch.from_numpy(x.copy()).requires_grad_(True)
        local_loss(call(t), torch, me, seed).backward()
        assert isinstance(t.grad, torch.Tensor) and t.grad.dtype == torch.float64
        return t.grad.numpy()
    g = jax.grad(lambda v: local_loss(call(v), jnp, me, seed))(jnp.asarray(x))
    assert isinstance(g, jax.Array) and g.dtype == jnp.float64
    return np.asarray(g)


def distributed_objective(case: str, framework: str, x: np.ndarray, world: ad.World,
                          seed: int) -> float:
    """``J`` with this rank's input ``x``, every rank evaluating its share (no gradient)."""
    call = collective(case, world.world_size, seed, world.rank)
    xp, arr = (torch, torch.from_numpy(x.copy())) if framework == "torch" else (
        jnp, jnp.asarray(x))
    mine = float(local_loss(call(arr), xp, world.rank, seed))
    return float(ad.all_reduce(np.array([mine]))[0])


def _check_gradient(world: ad.World, case: str, framework: str, seed: int) -> None:
    me, n = world.rank, world.world_size
    with jax.enable_x64(True):
        x = inputs(case, me, n, seed)
        got = grad_of(case, framework, x, world, seed)
        np.testing.assert_allclose(got, reference_grad(case, n, seed, me), rtol=1e-10,
                                   atol=1e-12)
        v, h = direction(case, me, n, seed), 1e-6
        slope = (distributed_objective(case, framework, x + h * v, world, seed)
                 - distributed_objective(case, framework, x - h * v, world, seed)) / (2 * h)
        predicted = float(ad.all_reduce(np.array([np.sum(got * v)]))[0])
        assert abs(slope - predicted) <= 1e-5 * (1 + abs(predicted)), (slope, predicted)


@given(size=world_sizes(1, 3), case=st.sampled_from(NAMES),
       framework=st.sampled_from(("torch", "jax")), seed=st.integers(0, 2**16))
def test_gradients_match_one_process_and_finite_differences(size: int, case: str,
                                                             framework: str,
                                                             seed: int) -> None:
    run_world(_check_gradient, size, case, framework, seed)


@pytest.mark.parametrize("n", [2, 3])
def test_every_case_at_two_and_three_ranks_in_both_frameworks(n: int) -> None:
    if current_size(n) != n:  # a launched world of another size would rerun [its size]
        pytest.skip(f"a world of {n} ranks: this launched world has {current_size(n)}")
    def body(world: ad.World) -> None:
        for case in NAMES:
            for framework in ("torch", "jax"):
                _check_gradient(world, case, framework, seed=n)

    run_world(body, n)


# --- inside jax.jit -------------------------------------------------------------------

def _jit_grad_many_times(world: ad.World, case: str, calls: int) -> None:
    me, n = world.rank, world.world_size
    with jax.enable_x64(True):
        call = collective(case, n, 0, me)
        step = jax.jit(jax.grad(lambda v: local_loss(call(v), jnp, me, 0)))
        forward = jax.jit(lambda v: call(v))  # a function of this rank (see autodiff.md)
        x = inputs(case, me, n, 0)
        for _ in range(calls):
            got = step(jnp.asarray(x))
            assert isinstance(got, jax.Array)
            np.testing.assert_allclose(np.asarray(got), grad_of(case, "jax", x, world, 0),
                                       rtol=1e-12, atol=1e-14)
            np.testing.assert_array_equal(np.asarray(forward(jnp.asarray(x))),
                                          np.asarray(call(jnp.asarray(x))))
        np.testing.assert_allclose(np.asarray(got), reference_grad(case, n, 0, me),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", NAMES)
def test_jit_of_grad_called_many_times_equals_eager(case: str) -> None:
    run_world(_jit_grad_many_times, current_size(3), case, 4)


def _vmap_of_grad(world: ad.World, case: str) -> None:
    me, n = world.rank, world.world_size
    with jax.enable_x64(True):
        call = collective(case, n, 0, me)
        grad = jax.grad(lambda v: local_loss(call(v), jnp, me, 0))
        x = jnp.asarray(inputs(case, me, n, 0))
        batch = jnp.stack([x, 2 * x, x - 1])
        per_example = np.stack([np.asarray(grad(b)) for b in batch])
        got = jax.jit(jax.vmap(grad))(batch)
        np.testing.assert_allclose(np.asarray(got), per_example, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", ["all_reduce_sum", "all_reduce_max", "all_gather",
                                  "reduce_scatter_average", "broadcast", "all_to_all_sizes"])
def test_jit_of_vmap_of_grad_equals_the_per_example_gradients(case: str) -> None:
    run_world(_vmap_of_grad, current_size(2), case)


def _plain_collectives_in_jit(world: ad.World) -> None:
    me, n = world.rank, world.world_size
    x = jnp.asarray(np.random.default_rng(me).standard_normal((4, 3)), dtype=jnp.float32)
    calls = {
        "all_reduce": lambda v: ad.all_reduce(v),
        "all_reduce_max": lambda v: ad.all_reduce(v, "max"),
        "all_gather_uneven": lambda v: ad.all_gather(v[: me % 3 + 1]),
        "all_gather_sizes": lambda v: ad.all_gather(
            v[: me % 3 + 1], sizes=[r % 3 + 1 for r in range(n)]),
        "all_gather_0d": lambda v: ad.all_gather(v[0, 0]),
        "reduce_scatter": lambda v: ad.reduce_scatter(v),
        "broadcast": lambda v: ad.broadcast(v, src=n - 1),
        "reduce": lambda v: ad.reduce(v, n - 1),
        "all_to_all": lambda v: ad.all_to_all(v),
    }
    for name, fn in calls.items():
        eager = fn(x)
        jitted = jax.jit(fn)
        for _ in range(2):
            got = jitted(x)
            assert isinstance(got, jax.Array) and got.dtype == eager.dtype, name
            np.testing.assert_array_equal(np.asarray(got), np.asarray(eager), err_msg=name)
        batch = jnp.stack([x, 2 * x, -x])
        stacked = jnp.stack([fn(b) for b in batch])
        np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(fn))(batch)),
                                   np.asarray(stacked), rtol=1e-6, err_msg=name)


def test_plain_collectives_inside_jit_and_vmap_equal_the_eager_call() -> None:
    run_world(_plain_collectives_in_jit, current_size(3))


# --- refusals -------------------------------------------------------------------------

def _refusals(world: ad.World) -> None:
    x = jnp.ones((4, 2))
    with pytest.raises(ad.UnsupportedDTypeError, match="PRODUCT has no gradient here"):
        dd.all_reduce(x, "product")
    with pytest.raises(ad.UnsupportedDTypeError, match="MAX has no gradient here.*all_reduce"):
        dd.reduce_scatter(torch.ones(4, 2), "max")
    with pytest.raises(TypeError, match="x must be a torch tensor or a JAX array, got ndarray"):
        dd.all_reduce(np.ones(3))
    with pytest.raises(ad.InvalidBufferError, match="scatter_tensor: has no form inside jax"):
        jax.jit(lambda v: ad.scatter_tensor(v))(x)
    with pytest.raises(ad.InvalidBufferError, match="async_op=True has no meaning inside jax"):
        jax.jit(lambda v: ad.all_reduce(v, async_op=True))(x)
    with pytest.raises(ad.InvalidBufferError, match="differentiable.all_reduce"):
        jax.grad(lambda v: ad.all_reduce(v).sum())(x)
    with pytest.raises(ad.InvalidBufferError, match="got a JAX tracer .inside jax.jit"):
        jax.jit(lambda v: ad.sync_gradients([v])[0])(x)
    with pytest.raises(ad.CollectiveMismatchError, match="with this rank's own"):
        jax.jit(lambda v: ad.all_gather(v, sizes=[9] * world.world_size))(x)


def test_what_has_no_gradient_or_no_traced_form_is_refused_with_what_to_do() -> None:
    run_world(_refusals, current_size(2))
