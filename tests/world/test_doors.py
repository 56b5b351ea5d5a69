"""Every door with every array framework: the right numbers in the caller's own objects, or
our own error.

One table: the doors (the collectives, ``sync_gradients``, DDP with and without bucket views)
by the frameworks a user brings (NumPy, torch, JAX). Each cell runs on the mock world here and
on the launched worlds when tests/world is rerun under ``mpiexec`` and ``torchrun``
(tests/world/test_mpi_launch.py, tests/world/test_torch_launch.py); the launchers' own doors
(``ad.run``, ``ad.spawn``, ``ad.init``) are tests/integration/test_launch_doors.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from harness import current_size, run_world

import axondist as ad
from axondist.ddp import DistributedDataParallel

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

FRAMEWORKS = ("numpy", "torch", "jax")


def make(values: np.ndarray, framework: str) -> Any:
    """``values`` as an array of ``framework``, made without axondist."""
    if framework == "torch":
        return torch.tensor(values)
    if framework == "jax":
        return jnp.asarray(values)
    return np.array(values)


def numpy_of(x: Any) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def same_framework(got: Any, given: Any) -> bool:
    return type(got) is type(given) or (isinstance(got, jax.Array)
                                        and isinstance(given, jax.Array))


def rank_values(rank: int, n: int = 6) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) + 1) * (rank + 1)


# --- the collectives ------------------------------------------------------------------------

def body_collectives(world: ad.World, framework: str) -> bool:
    n, r = world.world_size, world.rank
    total = sum(rank_values(k) for k in range(n))
    x = make(rank_values(r), framework)
    got = ad.all_reduce(x)
    assert same_framework(got, x)
    np.testing.assert_allclose(numpy_of(got), total, rtol=1e-6)
    if framework == "torch":  # written in place: the caller's tensor holds the sum
        assert got is x
    b = make(rank_values(r), framework)
    got = ad.broadcast(b, src=n - 1)
    np.testing.assert_array_equal(numpy_of(got), rank_values(n - 1))
    gathered = ad.all_gather(make(rank_values(r, r + 1), framework))
    assert same_framework(gathered, x)
    np.testing.assert_array_equal(numpy_of(gathered),
                                  np.concatenate([rank_values(k, k + 1) for k in range(n)]))
    block = ad.reduce_scatter(make(np.tile(rank_values(r, 2), (n, 1)), framework))
    np.testing.assert_allclose(numpy_of(block), np.tile(sum(rank_values(k, 2)
                                                            for k in range(n)), (1, 1)),
                               rtol=1e-6)
    return True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_collectives_give_results_in_the_callers_framework(framework: str) -> None:
    assert all(run_world(body_collectives, current_size(2), framework))


def body_list_refused(world: ad.World, framework: str) -> bool:
    arrays = [make(rank_values(world.rank, 2), framework), make(rank_values(world.rank, 3),
                                                                 framework)]
    before = [numpy_of(a).copy() for a in arrays]
    calls = {
        "all_reduce": lambda: ad.all_reduce(arrays),
        "broadcast": lambda: ad.broadcast(arrays),
        "all_gather": lambda: ad.all_gather(arrays),
        "reduce_scatter": lambda: ad.reduce_scatter(arrays),
        "all_to_all": lambda: ad.all_to_all(arrays),
        "reduce": lambda: ad.reduce(arrays),
        "gather_tensor": lambda: ad.gather_tensor(arrays),
    }
    for name, call in calls.items():
        with pytest.raises(ad.InvalidBufferError, match=rf"^{name}: x is a list of 2 arrays; "
                                                          r".*ad\.sync_gradients\(grads\)"):
            call()
    with pytest.raises(ad.InvalidBufferError, match="cannot be written in place"):
        ad.all_reduce([1.0, 2.0])
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(numpy_of(a), b)
    ad.barrier()
    return True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_list_of_arrays_is_refused_naming_sync_gradients(framework: str) -> None:
    assert all(run_world(body_list_refused, current_size(2), framework))


# --- sync_gradients -------------------------------------------------------------------------

def body_sync_structures(world: ad.World, framework: str) -> bool:
    n, r = world.world_size, world.rank
    mean = sum(rank_values(k) for k in range(n)) / n
    grads = {"fc": {"weight": make(rank_values(r), framework),
                    "bias": make(rank_values(r, 2), framework)},
             "out": [make(rank_values(r, 3), framework), make(rank_values(r, 4), framework)]}
    # a torch state_dict-like dict filled in another order on odd ranks: keys match by name
    if r % 2:
        grads = {"out": grads["out"], "fc": {"bias": grads["fc"]["bias"],
                                             "weight": grads["fc"]["weight"]}}
    got = ad.sync_gradients(grads)
    assert list(got) == list(grads) and list(got["fc"]) == list(grads["fc"])
    assert isinstance(got["out"], list) and len(got["out"]) == 2
    for key, size in (("weight", 6), ("bias", 2)):
        assert same_framework(got["fc"][key], grads["fc"][key])
        np.testing.assert_allclose(numpy_of(got["fc"][key]), mean[:size] * 1, rtol=1e-6)
    for i, size in enumerate((3, 4)):
        np.testing.assert_allclose(numpy_of(got["out"][i]), mean[:size], rtol=1e-6)
    if framework != "jax":  # averaged in place: the caller's own objects hold the mean
        assert got["fc"]["weight"] is grads["fc"]["weight"]
        np.testing.assert_allclose(numpy_of(grads["fc"]["weight"]), mean, rtol=1e-6)
    tup = ad.sync_gradients((make(rank_values(r, 2), framework),))
    assert isinstance(tup, tuple)
    return True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sync_gradients_keeps_the_structure_it_is_given(framework: str) -> None:
    assert all(run_world(body_sync_structures, current_size(2), framework))


def body_jax_grad_pytree(world: ad.World) -> bool:
    n, r = world.world_size, world.rank
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    x = jnp.asarray(rank_values(r, 3).reshape(1, 3))

    def loss(p: dict[str, Any]) -> Any:
        return jnp.sum((x @ p["w"] + p["b"]) ** 2)

    grads = ad.sync_gradients(jax.grad(loss)(params))
    want = [jax.grad(lambda p, k=k: jnp.sum((jnp.asarray(rank_values(k, 3).reshape(1, 3))
                                             @ p["w"] + p["b"]) ** 2))(params)
            for k in range(n)]
    for key in params:
        np.testing.assert_allclose(np.asarray(grads[key]),
                                   sum(np.asarray(g[key]) for g in want) / n, rtol=1e-5)
    return True


def test_sync_gradients_takes_what_jax_grad_returns() -> None:
    assert all(run_world(body_jax_grad_pytree, current_size(2)))


def body_missing(world: ad.World, framework: str) -> bool:
    n, r = world.world_size, world.rank
    grads = [make(rank_values(r), framework), None]
    with pytest.raises(ad.InvalidBufferError, match=r"grads\[1\] is None: no gradient yet .*"
                                                    r"missing_grad='zeros'"):
        ad.sync_gradients(grads)
    # rank 0 has a gradient for the second parameter, the others none: they count as zeros
    second = make(rank_values(0, 3), framework) if r == 0 else None
    got = ad.sync_gradients([make(rank_values(r), framework), second, None],
                            missing_grad="zeros")
    np.testing.assert_allclose(numpy_of(got[1]), rank_values(0, 3) / n, rtol=1e-6)
    assert got[2] is None  # no rank has it
    return True


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_none_gradient_is_named_or_counted_as_zero(framework: str) -> None:
    assert all(run_world(body_missing, current_size(2), framework))


# --- DDP with a torch optimizer ---------------------------------------------------------------

def _torch_model() -> Any:
    """The same weights on every rank and in the one-process run, drawn from NumPy (torch's
    global generator is shared by the mock world's rank threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.tensor(rng.uniform(-0.5, 0.5, tuple(p.shape)), dtype=p.dtype))
    return model


def _batch(rank: int) -> tuple[Any, Any]:
    rng = np.random.default_rng([7, rank])
    return (torch.tensor(rng.standard_normal((5, 4)), dtype=torch.float32),
            torch.tensor(rng.standard_normal((5, 1)), dtype=torch.float32))


def body_ddp_torch_optimizer(world: ad.World, bucket_view: bool) -> list[np.ndarray]:
    """Wrap a torch module's weights, set ``.grad`` to torch's own, step torch's SGD."""
    model = _torch_model()
    params = [ad.Parameter(p.data) for p in model.parameters()]
    ddp = DistributedDataParallel(params, world, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        x, y = _batch(world.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p, t in zip(params, model.parameters()):
            p.grad = t.grad
        ddp.sync_gradients()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def one_process(n: int) -> list[np.ndarray]:
    """The same training in one process on the whole batch (the ranks' equal shares)."""
    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        batches = [_batch(k) for k in range(n)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_leaves_the_average_in_torchs_own_grad(bucket_view: bool) -> None:
    n = current_size(2)
    want = one_process(n)
    for got in run_world(body_ddp_torch_optimizer, n, bucket_view):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def body_ddp_jax_grad(world: ad.World, bucket_view: bool) -> bool:
    n, r = world.world_size, world.rank
    params = [ad.Parameter(np.zeros(6, np.float32), "w")]
    ddp = DistributedDataParallel(params, world, gradient_as_bucket_view=bucket_view)
    given = jnp.asarray(rank_values(r))
    params[0].grad = given
    ddp.sync_gradients()
    got = params[0].grad
    assert isinstance(got, jax.Array)  # a JAX .grad is replaced by a new JAX array
    np.testing.assert_allclose(np.asarray(got), sum(rank_values(k) for k in range(n)) / n,
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(given), rank_values(r))
    return True


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_replaces_a_jax_grad_by_the_average(bucket_view: bool) -> None:
    assert all(run_world(body_ddp_jax_grad, current_size(2), bucket_view))


def body_ddp_refuses_torch_module(world: ad.World) -> bool:
    with pytest.raises(TypeError, match=r"torch\.nn\.parameter\.Parameter .*ad\.Parameter\(p\."
                                        r"data\) shares the tensor's memory"):
        DistributedDataParallel(torch.nn.Linear(2, 2), world)
    return True


def test_ddp_of_a_torch_module_says_how_to_wrap_it() -> None:
    assert all(run_world(body_ddp_refuses_torch_module, current_size(2)))


def body_torch_names(world: ad.World) -> bool:
    import torch.distributed as dist

    x = np.ones(2) * (world.rank + 1)
    group = dist.group.WORLD if dist.is_initialized() else None
    ad.all_reduce(x, group=group)
    np.testing.assert_array_equal(x, np.ones(2) * sum(range(1, world.world_size + 1)))
    return True


def test_torchs_default_group_means_the_world() -> None:
    assert all(run_world(body_torch_names, current_size(2)))
