"""Gradients from ``jax.grad``, averaged by axondist: by DistributedDataParallel, and
straight from a JAX training loop.

    python examples/jax_grad.py                   # 4 ranks of the in-process mock world
    axondist run -n 2 examples/jax_grad.py        # 2 processes (or mpiexec -n 2 python ...)

Two ways, each checked against training in one process:

* **DDP, weights kept in NumPy.** The weights live in axondist Parameters
  (NumPy arrays the optimizer updates in place). Each step JAX reads them
  through DLPack (``jnp.from_dlpack``: no copy when the array is 64-byte
  aligned, as JAX on the CPU requires; a copy otherwise),
  ``jax.value_and_grad`` computes the loss and gradients, and DDP takes the
  JAX gradients as they are, reading each through DLPack (no copy) on its way
  into the gradient bucket, the one copy data parallelism needs anyway.
* **A plain JAX loop, weights kept in JAX.** ``axondist.sync_gradients(grads)``
  takes the list ``jax.grad`` returned and gives back a list of new JAX
  arrays, the averages over the ranks (JAX arrays are immutable, so the
  averaging cannot happen inside them, unlike the torch example's), and the
  SGD step stays in JAX.

Each prints the largest parameter difference from one process trained on the
full batches (exit status 1 if one exceeds the tolerance). Without JAX
installed it prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    print("jax_grad.py: JAX is not installed; skipping (pip install jax)")
    sys.exit(0)

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist.data import DistributedSampler
from axondist.ddp import DistributedDataParallel
from axondist.optim import Adam

SAMPLES, BATCH_PER_RANK, STEPS, LR, SGD_LR = 512, 16, 30, 0.02, 0.1
TOLERANCE = 1e-5


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 5)).astype(np.float32)
    y = (np.tanh(x @ rng.standard_normal((5, 3))) + 0.1 * x[:, :3]).astype(np.float32)
    return x, y


def init_params() -> list[ad.Parameter]:
    rng = np.random.default_rng(1)
    shapes = {"w1": (5, 24), "b1": (24,), "w2": (24, 3), "b2": (3,)}
    return [ad.Parameter((0.3 * rng.standard_normal(s)).astype(np.float32), name)
            for name, s in shapes.items()]


def loss(params: list[jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    w1, b1, w2, b2 = params
    return jnp.mean((jnp.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2)


value_and_grad = jax.jit(jax.value_and_grad(loss))


def grad_fn(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list]:
    """DDP's gradient callable: NumPy weights in, JAX gradients out (DDP takes them as they
    are)."""
    params = [jnp.from_dlpack(a) for a in arrays]  # NumPy -> JAX
    value, grads = value_and_grad(params, jnp.asarray(x), jnp.asarray(y))
    return float(value), list(grads)


def batch_of(step: int, rank: int, world_size: int) -> np.ndarray:
    sampler = DistributedSampler(SAMPLES, world_size, rank, seed=5)
    per_epoch = len(sampler) // BATCH_PER_RANK
    sampler.set_epoch(step // per_epoch)
    k = step % per_epoch
    return sampler.indices()[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]


def train(world: ad.World) -> list[np.ndarray]:
    x, y = make_data()
    params = init_params()
    ddp = DistributedDataParallel(params, world, grad_fn=grad_fn)
    opt = Adam(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        idx = batch_of(step, world.rank, world.world_size)
        opt.zero_grad(set_to_none=False)
        ddp.backward(x[idx], y[idx])
        opt.step()
    return [p.data.copy() for p in params]


def train_jax_loop(world: ad.World | None, world_size: int) -> list[np.ndarray]:
    """SGD with the weights in JAX; on ``world``, sync_gradients averages jax.grad's list
    (None: one process on the full batches, the reference)."""
    x, y = make_data()
    params = [jnp.asarray(p.data) for p in init_params()]
    for step in range(STEPS):
        if world is None:
            idx = np.concatenate([batch_of(step, r, world_size) for r in range(world_size)])
        else:
            idx = batch_of(step, world.rank, world_size)
        _, grads = value_and_grad(params, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
        if world is not None:
            grads = ad.sync_gradients(grads, world)  # new JAX arrays: the ranks' average
        params = [p - SGD_LR * g for p, g in zip(params, grads)]
    return [np.asarray(p) for p in params]


def train_single_process(world_size: int) -> list[np.ndarray]:
    x, y = make_data()
    params = init_params()
    opt = Adam(params, lr=LR)
    for step in range(STEPS):
        idx = np.concatenate([batch_of(step, r, world_size) for r in range(world_size)])
        _, grads = grad_fn([p.data for p in params], x[idx], y[idx])
        for p, g in zip(params, grads):
            p.grad = ad.as_array(g)  # JAX -> NumPy through DLPack: a read-only view, no copy
        opt.step()
    return [p.data for p in params]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world ranks")
    args = parser.parse_args(argv)
    # python jax_grad.py: --world-size threads; axondist run -n K: this process's rank of K
    return ad.run(check, args.world_size)[0]


def check(world: ad.World) -> int:
    """Train both ways on every rank; rank 0 compares with single-process training. The exit
    status."""
    params = train(world)
    loop_params = train_jax_loop(world, world.world_size)
    if world.rank != 0:
        return 0
    print(f"jax {jax.__version__}: {world.world_size} ranks, {STEPS} steps on gradients from "
          "jax.value_and_grad")
    worst = 0.0
    for what, got, reference in (
            ("DDP + Adam", params, train_single_process(world.world_size)),
            ("JAX loop + sync_gradients", loop_params, train_jax_loop(None, world.world_size))):
        diff = max(float(np.max(np.abs(p - r))) for p, r in zip(got, reference))
        worst = max(worst, diff)
        print(f"{what}: max |parameter - single-process parameter| = {diff:.2e} "
              f"({'OK' if diff <= TOLERANCE else 'FAILED'})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
