"""A collective inside ``jax.jit`` against the same call outside, on JAX arrays, in one launch.

    mpiexec -n 2 python benchmarks/bench_jit_collectives.py [--repeats 9] [--json FILE]

Inside ``jit`` a collective is an ordered host callback that runs the eager collective on
the callback's NumPy view (``axondist._jax_traced``); outside, ``ad.all_reduce(x)`` reads the
JAX array through DLPack and wraps the result as a new JAX array. For ``all_reduce`` and
``all_gather`` of float32 arrays, four variants run in alternating timed batches (the order
rotates, see ``_common.alternate``), each batch timed on the slowest rank and ended by
``block_until_ready``:

* ``jit``: ``jax.jit(lambda x: ad.all_reduce(x))(x)``;
* ``eager``: ``ad.all_reduce(x)`` on the JAX array;
* ``numpy``: the same collective on a NumPy array (a fresh copy for the all-reduce,
  as the other two make a new array), the floor;
* ``mpi4jax``: ``mpi4jax.allreduce``/``allgather`` inside ``jit``, where mpi4jax imports
  (its absence is printed and recorded under ``missing_peers``).

Columns: microseconds per call, median (min-max) over the batches, and paired ratios
(batch k over batch k). ``jit/eager`` is the cost of the callback route; ``jit/numpy`` what
a jitted collective costs over the bare collective. No target: the figures are reported.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    batch_for,
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)

import axondist as ad  # noqa: E402

RUNNER = {"needs": ["jax"], "quick_args": ["--repeats", "3", "--sizes", "4096", "1048576"]}
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]


def _mpi4jax() -> tuple[Any, str | None]:
    try:
        import mpi4jax
    except Exception as exc:  # ImportError, or its XLA extension failing to load
        return None, f"mpi4jax is not importable here ({type(exc).__name__}: {exc})"
    return mpi4jax, None


def _variants(op: str, nbytes: int, world: ad.World, mpi4jax: Any) -> dict[str, Callable]:
    import jax
    import jax.numpy as jnp

    rows = max(1, nbytes // 4 // 16)
    host = np.random.default_rng(world.rank).standard_normal((rows, 16)).astype(np.float32)
    x = jnp.asarray(host)
    call = (lambda v: ad.all_reduce(v, group=world)) if op == "all_reduce" else (
        lambda v: ad.all_gather(v, world, sizes=[rows] * world.world_size))
    jitted = jax.jit(call)
    variants = {
        "jit": lambda: jitted(x).block_until_ready(),
        "eager": lambda: call(x).block_until_ready(),
        "numpy": (lambda: ad.all_reduce(host.copy(), group=world)) if op == "all_reduce" else (
            lambda: ad.all_gather(host, world, sizes=[rows] * world.world_size)),
    }
    if mpi4jax is not None:
        from mpi4py import MPI

        theirs = jax.jit((lambda v: mpi4jax.allreduce(v, op=MPI.SUM)[0]) if op == "all_reduce"
                         else (lambda v: mpi4jax.allgather(v)[0]))
        variants["mpi4jax"] = lambda: theirs(x).block_until_ready()
    np.testing.assert_allclose(np.asarray(jitted(x)), np.asarray(call(x)), rtol=0)
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per rank")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        import jax  # noqa: F401
    except ImportError:
        print("bench_jit_collectives.py: JAX is not installed; skipping (pip install jax)")
        return 0
    from mpi4py import MPI

    world = ad.init()
    mpi4jax, why_not = _mpi4jax()
    rows: list[dict[str, Any]] = []
    table = []
    for op in ("all_reduce", "all_gather"):
        for nbytes in args.sizes:
            variants = _variants(op, nbytes, world, mpi4jax)
            times = alternate(variants, batch=batch_for(nbytes, hi=100), repeats=args.repeats,
                              comm=MPI.COMM_WORLD)
            row: dict[str, Any] = {"op": op, "size": nbytes}
            row.update({f"{k}_us": spread(v, 1e6) for k, v in times.items()})
            row["jit/eager"] = ratio_spread(times["jit"], times["eager"])
            row["jit/numpy"] = ratio_spread(times["jit"], times["numpy"])
            if "mpi4jax" in times:
                row["jit/mpi4jax"] = ratio_spread(times["jit"], times["mpi4jax"])
            rows.append(row)
            table.append([op, format_size(nbytes)] + [
                format_spread(row[f"{k}_us"]) for k in variants] + [
                format_spread(row[k]) for k in row if "/" in k])
    if world.rank == 0:
        names = ["jit", "eager", "numpy"] + (["mpi4jax"] if mpi4jax is not None else [])
        ratios = ["jit/eager", "jit/numpy"] + (["jit/mpi4jax"] if mpi4jax is not None else [])
        print(f"{world.world_size} ranks ({world.backend_for('bench').name}); JAX "
              f"{sys.modules['jax'].__version__}; microseconds per call, median (min-max) "
              f"over {args.repeats} batches")
        if why_not:
            print(f"mpi4jax not compared: {why_not}")
        print(format_table(["op", "size"] + [f"{n} us" for n in names] + ratios, table))
    write_json(args.json if world.rank == 0 else None, {
        "rows": rows, "missing_peers": {"mpi4jax": why_not} if why_not else {}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
