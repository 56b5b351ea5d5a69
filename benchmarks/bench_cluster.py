"""Slow links: all-reduce and DDP on a simulated 2-host x 2-rank cluster with limited links.

    sudo python benchmarks/bench_cluster.py [--json results.json] [--repeats N] [--rate 1gbit]

Builds the simulated cluster of ``tests/cluster/simcluster.py`` (two network namespaces
on a bridge, ranks 0, 1 on node0 and 2, 3 on node1), limits what each host receives to
``--rate`` with a ``tbf`` queue on its switch port, and runs itself on the 4 ranks. Needs
root; prints why and exits 0 otherwise. Every figure is the median (min-max) over timed
batches, each the slowest rank's time, ratios paired batch by batch (``_common``).

* all-reduce of 4 KiB to 64 MiB float32: axondist vs raw mpi4py ``Allreduce`` (target:
  axondist <= 1.1x raw from 4 MiB), and a hierarchical all-reduce composed of groups
  (reduce-scatter within the host, all-reduce across hosts, all-gather within the host)
  vs the flat one: below 1 means a hierarchical all-reduce would win on these links.
* ``python -m axondist tune``'s sweep on the same links, and the bucket it picks.
* DDP on a 95 MiB model (160 arrays): gradient sync alone with 25 MiB buckets vs the
  tuned size (target: tuned <= 1.0x default), and a backward step whose compute (a sleep
  per array, as a GPU kernel leaves the CPU free) lasts as long as the sync:
  SYNCHRONOUS vs OVERLAPPED (target: OVERLAPPED step <= 1.25x max(compute, sync), where
  SYNCHRONOUS pays their sum).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_ROOT, _HERE, os.path.join(_ROOT, "tests")]  # axondist, _common, cluster

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)
from cluster.simcluster import SimCluster, why_no_cluster  # noqa: E402

import axondist as ad  # noqa: E402
from axondist import tune  # noqa: E402
from axondist.bucketing import GradSyncStrategy  # noqa: E402
from axondist.ddp import DDP  # noqa: E402

RUNNER = {"quick_args": ["--repeats", "3"], "timeout": 900}

DEFAULT_BUCKET_MB = 25.0
SIZES = [4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20]
TUNE_SIZES = [256 << 10 << k for k in range(9)]  # 256 KiB .. 64 MiB


def model_shapes(layers: int = 40) -> list[tuple[int, ...]]:
    """160 arrays, 24.95M float32 values (95 MiB), as bench_ddp's model."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(640, 512), (640,), (512, 576), (512,)]
    return shapes


# --- on every rank ----------------------------------------------------------------------

def _node_groups(world: ad.World) -> tuple[ad.ProcessGroup, ad.ProcessGroup]:
    """This rank's host group and its group of same-local-rank peers across hosts."""
    layout = ad.all_gather_object(world.node_info(), world)
    node, local, _ = layout[world.rank]
    mine = across = None
    for k in sorted({info[0] for info in layout}):  # every rank creates every group
        g = world.new_group([r for r, info in enumerate(layout) if info[0] == k])
        mine = g if k == node else mine
    for j in sorted({info[1] for info in layout}):
        g = world.new_group([r for r, info in enumerate(layout) if info[1] == j])
        across = g if j == local else across
    assert mine is not None and across is not None
    return mine, across


def all_reduce_part(world: ad.World, mpi: Any, repeats: int) -> list[dict[str, Any]]:
    comm = mpi.COMM_WORLD
    node, across = _node_groups(world)
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.ones(nbytes // 4, np.float32)

        def hierarchical(x: np.ndarray = x) -> None:
            part = ad.reduce_scatter(x, "sum", node)
            ad.all_reduce(part, "sum", across)
            ad.all_gather(part, node, out=x)

        batch = max(1, min(50, (16 << 20) // nbytes))
        times = alternate({"axondist": lambda x=x: ad.all_reduce(x),
                           "raw": lambda y=y: comm.Allreduce(mpi.IN_PLACE, y, mpi.SUM),
                           "hierarchical": hierarchical},
                          batch=batch, repeats=repeats, comm=comm)
        busbw = [tune.bus_bandwidth(nbytes, t, world.world_size) / 1e6 for t in times["raw"]]
        rows.append({"size": nbytes, "axondist_ms": spread(times["axondist"], 1e3),
                     "raw_ms": spread(times["raw"], 1e3), "raw_busbw_MBps": spread(busbw),
                     "axondist/raw": ratio_spread(times["axondist"], times["raw"]),
                     "hierarchical/flat": ratio_spread(times["hierarchical"],
                                                       times["axondist"])})
    return rows


def _ddp(shapes: list[tuple[int, ...]], strategy: GradSyncStrategy, bucket_mb: float,
         grad_fn: Any) -> DDP:
    params = [ad.Parameter(np.full(s, 0.01, np.float32)) for s in shapes]
    ddp = DDP(params, strategy=strategy, bucket_cap_mb=bucket_mb, grad_fn=grad_fn,
              init_sync=False)
    for p in params:
        p.grad = np.full(p.shape, ddp.process_group.rank + 1.0, np.float32)
    ddp.sync_gradients()  # packs once; every .grad becomes its bucket view
    n = ddp.process_group.world_size
    if not np.allclose(params[0].grad, (n + 1) / 2):
        raise RuntimeError("bench_cluster: DDP did not average the gradients")
    return ddp


def ddp_part(mpi: Any, repeats: int, tuned_mb: float) -> dict[str, Any]:
    comm = mpi.COMM_WORLD
    shapes = model_shapes()
    grads = [np.full(s, 0.5, np.float32) for s in shapes]
    pause = [0.0]  # seconds of "compute" per array, set once the sync time is known

    def grad_fn(arrays: list[Any]) -> Any:
        for i in reversed(range(len(arrays))):
            time.sleep(pause[0])
            yield i, grads[i]
        return 0.0

    alone = {f"sync {name}": _ddp(shapes, GradSyncStrategy.SYNCHRONOUS, mb, None).sync_gradients
             for name, mb in (("default", DEFAULT_BUCKET_MB), ("tuned", tuned_mb))}
    sync_times = alternate(alone, batch=1, repeats=repeats, comm=comm, prime=False)
    compute = float(np.median(sync_times["sync default"]))
    pause[0] = compute / len(shapes)
    steps: dict[str, Callable[[], None]] = {}
    for name, strategy, mb in (("sync default", GradSyncStrategy.SYNCHRONOUS, DEFAULT_BUCKET_MB),
                               ("overlapped default", GradSyncStrategy.OVERLAPPED,
                                DEFAULT_BUCKET_MB),
                               ("overlapped tuned", GradSyncStrategy.OVERLAPPED, tuned_mb)):
        ddp = _ddp(shapes, strategy, mb, grad_fn)

        def step(ddp: DDP = ddp) -> None:
            for p in ddp.parameters():
                p.grad[...] = 0
            ddp.backward()

        steps[name] = step

    def compute_only() -> None:
        for _ in grad_fn(grads):
            pass

    steps["compute only"] = compute_only
    step_times = alternate(steps, batch=1, repeats=repeats, comm=comm, prime=False)
    bound = [max(c, compute) for c in sync_times["sync default"]]
    return {
        "compute_s": compute, "tuned_mb": tuned_mb,
        "sync_s": {k: spread(v) for k, v in sync_times.items()},
        "step_s": {k: spread(v) for k, v in step_times.items()},
        "tuned/default sync": ratio_spread(sync_times["sync tuned"], sync_times["sync default"]),
        "sync step/max(compute, sync)": ratio_spread(step_times["sync default"], bound),
        "overlapped step/max(compute, sync)": ratio_spread(step_times["overlapped default"],
                                                           bound),
        "overlapped tuned/default step": ratio_spread(step_times["overlapped tuned"],
                                                      step_times["overlapped default"]),
    }


def rank_main(args: argparse.Namespace) -> None:
    from mpi4py import MPI  # noqa: PLC0415 - only the ranks load MPI

    world = ad.init()
    results: dict[str, Any] = {"world_size": world.world_size, "rate": args.rate,
                               "repeats": args.repeats}
    results["all_reduce"] = all_reduce_part(world, MPI, args.repeats)
    settings = tune.tune(world, TUNE_SIZES, repeats=3)
    results["tune"] = [{"size": p.nbytes, "busbw_MBps": p.busbw / 1e6} for p in settings.sweep]
    results["ddp"] = ddp_part(MPI, args.repeats, settings.bucket_cap_mb)
    if world.rank == 0:
        Path(args.rank_out).write_text(json.dumps(results))


# --- the driver (one process, root) ------------------------------------------------------

def _targets(results: dict[str, Any]) -> dict[str, bool]:
    ddp = results["ddp"]
    big = [r for r in results["all_reduce"] if r["size"] >= 4 << 20]
    return {
        "axondist all_reduce <= 1.1x raw from 4 MiB": all(r["axondist/raw"]["median"] <= 1.1
                                                          for r in big),
        "tuned buckets sync <= 1.0x default": ddp["tuned/default sync"]["median"] <= 1.0,
        "OVERLAPPED step <= 1.25x max(compute, sync)":
            ddp["overlapped step/max(compute, sync)"]["median"] <= 1.25,
    }


def report(results: dict[str, Any]) -> str:
    rows = [[format_size(r["size"]), format_spread(r["axondist_ms"]), format_spread(r["raw_ms"]),
             format_spread(r["axondist/raw"]), format_spread(r["raw_busbw_MBps"]),
             format_spread(r["hierarchical/flat"])] for r in results["all_reduce"]]
    ddp = results["ddp"]
    lines = [f"2 hosts x 2 ranks, each host receiving at most {results['rate']}; "
             f"{results['repeats']} timed batches per figure",
             format_table(["size", "axondist ms", "raw ms", "axondist/raw", "raw busbw MB/s",
                           "hierarchical/flat"], rows), "",
             "tune sweep: " + ", ".join(f"{format_size(p['size'])} {p['busbw_MBps']:.0f} MB/s"
                                        for p in results["tune"]),
             f"tuned bucket: {ddp['tuned_mb']:g} MiB (default {DEFAULT_BUCKET_MB:g})", "",
             format_table(["DDP 95 MiB", "seconds"],
                          [[k, format_spread(v)] for k, v in
                           {**ddp["sync_s"], **{f"step {k}": v
                                                for k, v in ddp["step_s"].items()}}.items()]),
             "", format_table(["ratio", "median (min-max)"],
                              [[k, format_spread(ddp[k])] for k in
                               ("tuned/default sync", "sync step/max(compute, sync)",
                                "overlapped step/max(compute, sync)",
                                "overlapped tuned/default step")]), ""]
    lines += [f"target {'met' if ok else 'MISSED'}: {name}"
              for name, ok in results["targets"].items()]
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    reason = why_no_cluster()
    if reason is not None:
        print(f"bench_cluster: skipped: {reason}")
        write_json(args.json, {"skipped": reason})
        return 0
    with SimCluster(hosts=2) as cluster:
        for h in range(2):  # shape what each host receives
            subprocess.run(["ip", "netns", "exec", cluster.switch, "tc", "qdisc", "add", "dev",
                            f"h{h}", "root", "tbf", "rate", args.rate, "burst", "128kb",
                            "latency", "100ms"], check=True, capture_output=True, text=True)
        out = cluster.workdir / "results.json"
        run = cluster.run([2, 2], ["-m", "mpi4py", os.path.abspath(__file__), "--rank",
                                   "--rank-out", str(out), "--repeats", str(args.repeats),
                                   "--rate", args.rate], timeout=args.timeout)
        if run.returncode != 0 or not out.exists():
            print(f"bench_cluster: the run failed (exit {run.returncode})\n{run.tail()}")
            return 1
        results = json.loads(out.read_text())
    results["targets"] = _targets(results)
    print(report(results))
    write_json(args.json, results)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per variant")
    parser.add_argument("--rate", default="1gbit", help="tbf rate per host (default 1gbit)")
    parser.add_argument("--timeout", type=float, default=800.0, help="seconds for the run")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
