"""Collectives inside ``jax.jit(jax.grad(f))``, called many times, where one rank goes
astray: ``python jit_cases.py CASE mock N`` on an N-rank mock world, ``mpiexec -n N python
jit_cases.py CASE mpi`` on MPI (see ``fault_cases.main``).

``different_collective``: from the fourth step on, rank 1 runs a step whose gradient
all-gathers where the others' all-reduce. ``different_shape``: rank 1's step all-reduces
a longer array from the fourth step on. ``agree``: every rank runs the same step eight
times. Each step is its own ``jax.jit`` of ``jax.grad``, made inside the rank's function.
``shared_jit``: one module-level jitted step for every rank (fine where each rank is a
process; on threads the trace of one rank would run on another, which is refused).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402
from axondist import differentiable as dd  # noqa: E402

STEPS = 8


def _steps(world: ad.World, astray: str) -> None:
    # importing JAX takes seconds on a loaded machine: the fault's clock starts here
    print(f"{astray or 'agree'} ready at {time.time():.3f}", flush=True)

    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(dd.all_reduce(x)))

    def other(x: jax.Array) -> jax.Array:
        if astray == "collective":
            return jnp.sum(jnp.sin(dd.all_gather(x)))
        return jnp.sum(jnp.sin(dd.all_reduce(jnp.concatenate([x, x]))))

    step, wrong = jax.jit(jax.grad(loss)), jax.jit(jax.grad(other))
    x = jnp.ones(4)
    for i in range(STEPS):
        use = wrong if astray and world.rank == 1 and i >= 3 else step
        x = x - 0.01 * use(x)
        x.block_until_ready()
    print(f"{astray or 'agree'} OK rank {world.rank}", flush=True)


@jax.jit
def _shared_step(x: jax.Array) -> jax.Array:
    return ad.all_reduce(x) * 2


def shared_jit(world: ad.World) -> None:
    """One jitted function for every rank: right under a launcher (a process per rank);
    on threads the first rank's trace would run on the others, which is refused."""
    print(f"shared ready at {time.time():.3f}", flush=True)
    x = jnp.ones(3) * world.rank
    for _ in range(STEPS):
        x = _shared_step(x) / (2 * world.world_size)
        x.block_until_ready()
    print(f"shared OK rank {world.rank}", flush=True)


def different_collective(world: ad.World) -> None:
    _steps(world, "collective")


def different_shape(world: ad.World) -> None:
    _steps(world, "shape")


def agree(world: ad.World) -> None:
    _steps(world, "")


if __name__ == "__main__":
    main({f.__name__: f for f in (different_collective, different_shape, agree,
                                 shared_jit)})
