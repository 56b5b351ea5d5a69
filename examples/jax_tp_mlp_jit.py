"""A tensor-parallel MLP in JAX whose whole training step (forward, ``jax.grad``, the
collectives of both passes, the SGD update) is one ``jax.jit``.

    python examples/jax_tp_mlp_jit.py                 # 3 ranks of the in-process mock world
    mpiexec -n 2 python examples/jax_tp_mlp_jit.py    # 2 processes (or axondist run -n 2)

The MLP ``y = gelu(x W1 + b1) W2 + b2`` is split Megatron-style over the ranks: rank r
holds columns r of ``W1`` and ``b1`` (the :func:`numpy.array_split` rule, so the hidden width
need not divide the world size) and the matching rows of ``W2``; ``b2`` is replicated. The
forward pass sums the ranks' partial outputs with ``axondist.differentiable.all_reduce``,
whose backward pass sums the cotangents. The gradients are of the sum over ranks of what
each rank computes, so each rank's copy of the (replicated) loss is divided by the world
size, and the replicated ``b2``'s gradient is summed over the ranks with ``axondist.all_reduce``
inside the same jitted step. After training, the shards gathered must equal one process
trained on the full weights (exit status 1 otherwise). Without JAX it prints a note and
exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    print("jax_tp_mlp_jit.py: JAX is not installed; skipping (pip install jax)")
    sys.exit(0)

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist import differentiable as dd

IN, HIDDEN, OUT, BATCH, LR = 6, 10, 3, 32, 0.1
TOLERANCE = 2e-5
Params = dict[str, Any]


def full_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w1": 0.4 * rng.standard_normal((IN, HIDDEN)), "b1": 0.1 * rng.standard_normal(HIDDEN),
            "w2": 0.4 * rng.standard_normal((HIDDEN, OUT)), "b2": 0.1 * rng.standard_normal(OUT)}


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng([1, step])
    x = rng.standard_normal((BATCH, IN))
    return jnp.asarray(x, jnp.float32), jnp.asarray(np.sin(x[:, :OUT]) + 0.1, jnp.float32)


def shard(full: dict[str, np.ndarray], rank: int, size: int) -> Params:
    """Rank ``rank``'s columns of w1 and b1, rows of w2, and all of b2."""
    cols = np.array_split(np.arange(HIDDEN), size)[rank]
    parts = {"w1": full["w1"][:, cols], "b1": full["b1"][cols], "w2": full["w2"][cols],
             "b2": full["b2"]}
    return {k: jnp.asarray(v, jnp.float32) for k, v in parts.items()}


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def make_step(world: ad.World) -> Any:
    """The jitted training step of this rank (made inside the rank's function: ranks that
    are threads of one process must not share a jitted function, see docs/autodiff.md)."""
    n = world.world_size

    def local_objective(p: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        partial = jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]
        pred = dd.all_reduce(partial, group=world) + p["b2"]
        return mse(pred, y) / n  # every rank holds the same loss: count it once in all

    @jax.jit
    def step(p: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(local_objective)(p, x, y)
        grads["b2"] = ad.all_reduce(grads["b2"], group=world)  # replicated: sum the shares
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), loss * n

    return step


def train(world: ad.World, steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    params = shard(full_weights(), world.rank, world.world_size)
    step = make_step(world)
    losses = []
    for i in range(steps):
        params, loss = step(params, *batch(i))
        losses.append(float(loss))
    gathered = {  # the shards back into full weights, to compare with one process
        "w1": np.asarray(ad.all_gather(params["w1"].T, world)).T,
        "b1": np.asarray(ad.all_gather(params["b1"], world)),
        "w2": np.asarray(ad.all_gather(params["w2"], world)), "b2": np.asarray(params["b2"])}
    return losses, gathered


def train_single_process(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    params = {k: jnp.asarray(v, jnp.float32) for k, v in full_weights().items()}

    def loss_of(p: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return mse(jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], y)

    @jax.jit
    def step(p: Params, x: jax.Array, y: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), loss

    losses = []
    for i in range(steps):
        params, loss = step(params, *batch(i))
        losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in params.items()}


def check(world: ad.World, steps: int) -> int:
    """Train on every rank; rank 0 compares with one process. The exit status."""
    losses, weights = train(world, steps)
    if world.rank != 0:
        return 0
    ref_losses, ref_weights = train_single_process(steps)
    worst = max(float(np.max(np.abs(weights[k] - ref_weights[k]))) for k in ref_weights)
    ok = worst <= TOLERANCE and losses[-1] < losses[0]
    print(f"{world.world_size} ranks: tensor-parallel MLP, each step one jax.jit; loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f} (one process: {ref_losses[-1]:.4f})")
    print(f"single-process training: largest weight difference {worst:.2e} "
          f"(tolerance {TOLERANCE:g}): {'yes (OK)' if ok else 'NO (FAILED)'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3,
                        help="ranks on threads when not launched (a launcher decides otherwise)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    return ad.run(check, args.world_size, args.steps)[0]


if __name__ == "__main__":
    sys.exit(main())
