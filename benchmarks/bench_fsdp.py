"""FSDP memory and step time per sharding strategy, at 2 and 4 ranks.

    python benchmarks/bench_fsdp.py [--json results.json] [--repeats N] [--quick]
    mpiexec -n 2 python benchmarks/bench_fsdp.py      (the MPI world's size instead)

Run with plain Python, it measures in-process mock worlds of 2 and 4 ranks
(:func:`axondist.spawn`, one thread per rank: the times show the library's
own overhead and NumPy's compute, not a network). Under mpiexec it measures
the MPI world. Rank 0 prints the table.

The model: an MLP of 8 layers of width 384 (a 384x384 matrix and a bias
each, 1.18M float32 parameters, 4.5 MiB), one FSDP unit per layer, Adam,
16 samples per rank; ``grad_fn`` runs the forward and backward passes in
NumPy. Each row is one strategy (HYBRID_SHARD with two nodes of half the
ranks each; ``FULL_SHARD bf16`` gathers bfloat16 parameters and reduces in
bfloat16), stepped with ``fsdp.step`` (gather every unit, compute, reshard,
reduce-scatter unit by unit, Adam on the shards).

Columns, per rank (the maximum over ranks):

* ``resident MiB``: measured (``memory_stats``) bytes of parameters, gradients
  and Adam state held between steps;
* ``peak MiB``: measured inside ``grad_fn``, every unit gathered and the full
  gradients just computed (the one-call step gathers the whole model);
* ``model MiB``: the ZeRO-accounting estimate (``memory_estimate``);
* ``vs NO_SHARD``: resident bytes / NO_SHARD's;
* ``step ms``: time per step, median (min-max) over the timed batches, each
  batch the slowest rank's (strategies timed in alternating batches, see
  ``_common.alternate``); ``time ratio``: paired ratio to NO_SHARD, the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)

import axondist as ad  # noqa: E402
from axondist import comm  # noqa: E402
from axondist.fsdp import FSDP, MixedPrecision, ShardingStrategy  # noqa: E402
from axondist.launch import launched_by_mpi  # noqa: E402
from axondist.optim import Adam  # noqa: E402

RUNNER = {"ranks": None, "quick_args": ["--quick"], "timeout": 600}

LAYERS, WIDTH, BATCH = 8, 384, 16
MIB = 2**20


class MLP:
    """``h = tanh(h @ W_l + b_l)`` for each layer; loss ``0.5 * mean |h_L - y|^2``."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.params = []
        for layer in range(LAYERS):
            w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            self.params += [ad.Parameter(w, f"l{layer}.w"),
                            ad.Parameter(np.zeros(WIDTH, np.float32), f"l{layer}.b")]

    def parameters(self) -> list[ad.Parameter]:
        return self.params

    def units(self) -> list[list[int]]:
        return [[2 * layer, 2 * layer + 1] for layer in range(LAYERS)]


def grad_fn(arrays: list[Any], x: np.ndarray, y: np.ndarray) -> tuple[float, list[Any]]:
    acts = [x]
    for layer in range(LAYERS):
        w, b = arrays[2 * layer], arrays[2 * layer + 1]
        acts.append(np.tanh(acts[-1] @ w.astype(np.float32) + b.astype(np.float32)))
    diff = acts[-1] - y
    loss = 0.5 * float(np.mean(np.sum(diff * diff, axis=1)))
    delta = diff / len(x)
    grads: list[Any] = [None] * len(arrays)
    for layer in reversed(range(LAYERS)):
        delta = delta * (1.0 - acts[layer + 1] ** 2)
        dtype = arrays[2 * layer].dtype
        grads[2 * layer] = (acts[layer].T @ delta).astype(dtype)
        grads[2 * layer + 1] = delta.sum(axis=0).astype(dtype)
        delta = delta @ arrays[2 * layer].astype(np.float32).T
    return loss, grads


def variants(world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "NO_SHARD": {"sharding_strategy": ShardingStrategy.NO_SHARD},
        "SHARD_GRAD_OP": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        "FULL_SHARD": {"sharding_strategy": ShardingStrategy.FULL_SHARD},
        "FULL_SHARD bf16": {"sharding_strategy": ShardingStrategy.FULL_SHARD,
                            "mixed_precision": MixedPrecision("bfloat16", "bfloat16")},
    }
    if world_size % 2 == 0 and world_size >= 4:
        out["HYBRID_SHARD"] = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD,
                               "ranks_per_node": world_size // 2}
    return out


def run_rank(world: ad.World, repeats: int, batch: int) -> list[dict[str, Any]] | None:
    """Every rank measures; rank 0 returns the rows (the per-rank maxima)."""
    rng = np.random.default_rng([1, world.rank])
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    setups: dict[str, tuple[FSDP, Adam, dict[str, int]]] = {}
    for name, kwargs in variants(world.world_size).items():
        f = FSDP(MLP(), world, **kwargs)
        opt = Adam(f.sharded_parameters(), lr=1e-3)
        f.register_optimizer(opt)
        setups[name] = (f, opt, {"peak": 0})

    def stepper(name: str) -> Any:
        f, opt, peak = setups[name]

        def measured_grad_fn(arrays: list[Any], xb: Any, yb: Any) -> Any:
            result = grad_fn(arrays, xb, yb)
            for p, g in zip(f.full_parameters(), result[1]):
                p.grad = g  # so memory_stats sees the full gradients too
            peak["peak"] = max(peak["peak"], f.memory_stats().total_bytes_per_rank)
            return result

        return lambda: f.step(measured_grad_fn, x, y, optimizer=opt)

    times = alternate({name: stepper(name) for name in setups}, batch=batch, repeats=repeats,
                      sync=lambda: comm.barrier(world))
    every = comm.all_gather_object(times, world)  # each batch: the slowest rank's time
    times = {k: [max(batch) for batch in zip(*(t[k] for t in every))] for k in times}
    rows = []
    base_resident = None
    for name, (f, _opt, peak) in setups.items():
        resident = f.memory_stats().total_bytes_per_rank
        mine = [resident, peak["peak"], f.memory_estimate().total_bytes_per_rank]
        worst = comm.all_gather_object(mine, world)
        resident, peak_b, model_b = (max(col) for col in zip(*worst))
        base_resident = base_resident or resident
        rows.append({"ranks": world.world_size, "strategy": name,
                     "resident MiB": resident / MIB, "peak MiB": peak_b / MIB,
                     "model MiB": model_b / MIB, "vs NO_SHARD": resident / base_resident,
                     "step ms": spread(times[name], 1e3),
                     "time ratio": ratio_spread(times[name], times["NO_SHARD"])})
    return rows if world.rank == 0 else None


HEADER = ["ranks", "strategy", "resident MiB", "peak MiB", "model MiB", "vs NO_SHARD",
          "step ms", "time ratio"]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per strategy")
    parser.add_argument("--batch", type=int, default=3, help="steps per timed batch")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 2 steps")
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    repeats, batch = (3, 2) if args.quick else (args.repeats, args.batch)
    rows: list[dict[str, Any]] = []
    if launched_by_mpi():
        world = ad.init("mpi")
        rows = run_rank(world, repeats, batch) or []
        is_root = world.rank == 0
    else:
        for size in (2, 4):
            rows += ad.spawn(run_rank, size, repeats, batch, timeout=600)[0]
        is_root = True
    if is_root:
        print(format_table(HEADER, [[format_spread(r[h]) if isinstance(r[h], dict) else r[h]
                                     for h in HEADER] for r in rows]))
        write_json(args.json, {"fsdp": rows})
    return rows


if __name__ == "__main__":
    main()
