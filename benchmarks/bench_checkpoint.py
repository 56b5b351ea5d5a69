"""How long a sharded checkpoint save blocks training: asynchronous vs blocking, in one launch.

    mpiexec -n 2 python benchmarks/bench_checkpoint.py [--json results.json] [--repeats N]
                                                        [--mib M ...]

The model: FSDP FULL_SHARD over float32 parameters of M MiB in all (default 16
and 64), with Adam (two state arrays), so a checkpoint holds 3M MiB, each
rank writing its shard of each. Per repeat, in alternating order:

* ``blocking``: ``save_sharded_checkpoint(...)``, from a barrier until the
  slowest rank returns: the whole save (files, fsyncs, index, verification,
  commit).
* ``async blocked``: ``save_sharded_checkpoint(..., async_save=True)`` until
  the slowest rank returns: the host copy and the lock; the files are written
  on a background thread.
* ``async + train``: then a stand-in training step (NumPy matrix products
  for as long as the blocking save took), then ``wait()``; reported is the
  time ``wait()`` blocked (zero when the writer finished during the step).

Figures are the median (min-max) over repeats, taken on the slowest rank;
ratios are paired repeat by repeat. Target: the asynchronous save blocks a
training step for at most 0.3x the time of a blocking save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import format_spread, format_table, ratio_spread, spread, write_json  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.checkpoint import save_sharded_checkpoint  # noqa: E402
from axondist.optim import Adam  # noqa: E402

RUNNER = {"ranks": 2, "quick_args": ["--repeats", "3", "--mib", "16"], "timeout": 900}
TARGET = 0.3


def _model(world: ad.World, mib: int) -> tuple[Any, Adam]:
    per = (mib << 20) // 4 // 8  # eight arrays
    params = [ad.Parameter(np.full(per, float(i), np.float32), f"layer{i}") for i in range(8)]
    f = ad.FSDP(params, world, sharding_strategy="full_shard")
    opt = Adam(f.sharded_parameters(), lr=1e-3)
    for p in f.sharded_parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    return f, opt


def _slowest(world: ad.World, seconds: float) -> float:
    return max(world.backend.allgather_object(seconds))


def _train_for(seconds: float) -> None:
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a.T / 256)


def run(world: ad.World, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="bench-ckpt-") if world.rank == 0 else None
    root = world.backend.broadcast_object(root, 0)
    rows = []
    try:
        for mib in sizes:
            f, opt = _model(world, mib)
            times: dict[str, list[float]] = {"blocking": [], "async": [], "wait": []}
            step = 0
            for r in range(repeats + 1):  # the first round warms up and is discarded
                for kind in (("blocking", "async") if r % 2 else ("async", "blocking")):
                    step += 1
                    ad.barrier(world)
                    t0 = time.perf_counter()
                    handle = save_sharded_checkpoint(root, f, opt, step=step, keep_last=2,
                                                     async_save=kind == "async")
                    took = _slowest(world, time.perf_counter() - t0)
                    waited = 0.0
                    if kind == "async":
                        _train_for(times["blocking"][-1] if times["blocking"] else took * 4)
                        t1 = time.perf_counter()
                        handle.wait()
                        waited = _slowest(world, time.perf_counter() - t1)
                    if r:
                        times[kind].append(took)
                        if kind == "async":
                            times["wait"].append(waited)
            rows.append({
                "checkpoint MiB": 3 * mib,
                "blocking ms": spread(times["blocking"], 1e3),
                "async blocked ms": spread(times["async"], 1e3),
                "wait after step ms": spread(times["wait"], 1e3),
                "async / blocking": ratio_spread(times["async"], times["blocking"]),
                "target met": bool(np.median(times["async"]) <= TARGET *
                                   np.median(times["blocking"])),
            })
    finally:
        ad.barrier(world)
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def report(rows: list[dict[str, Any]], world_size: int) -> str:
    header = ["ckpt MiB", "blocking ms", "async blocked ms", "wait after step ms",
              "async/blocking", f"<= {TARGET}x"]
    body = [[r["checkpoint MiB"], format_spread(r["blocking ms"]),
             format_spread(r["async blocked ms"]), format_spread(r["wait after step ms"]),
             format_spread(r["async / blocking"]), r["target met"]] for r in rows]
    return (f"sharded checkpoint saves, FSDP FULL_SHARD + Adam, {world_size} ranks "
            f"(median (min-max) over repeats, slowest rank)\n" + format_table(header, body))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--repeats", type=int, default=6, help="timed saves of each kind")
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64],
                        help="parameter MiB (the checkpoint is 3x: Adam's two states)")
    args = parser.parse_args(argv)
    world = ad.init()
    rows = run(world, args.mib, args.repeats)
    if world.rank == 0:
        print(report(rows, world.world_size), flush=True)
        write_json(args.json, {"saves": rows, "world_size": world.world_size,
                               "targets": {"async blocks <= 0.3x a blocking save":
                                           all(r["target met"] for r in rows)}})
    return rows


if __name__ == "__main__":
    main()
