"""Each algorithm the MPI backend's table keeps, against the plain checked MPI call.

    mpiexec -n 2 python benchmarks/bench_algorithms.py [--repeats 6] [--json out.json]
    sudo python benchmarks/bench_algorithms.py --cluster [--delay-ms 5]

For every row of ``axondist.backends.mpi.choose.TABLE`` that is not MPI's own
collective, the plan of that algorithm runs against the plan of the plain MPI
collective (the same check, the same buffers) and against raw mpi4py, in
alternating batches; the table gives microseconds per call and the paired ratio
``algorithm/mpi`` as median (min-max) over the batches. A row is worth keeping where
that ratio is below 0.95 at a size where the table applies it. ``--cluster`` runs the
same on the simulated 2-host cluster of ``tests/cluster/simcluster.py`` (2 ranks per
host, links delayed ``--delay-ms`` one way; needs root).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_ROOT, _HERE, os.path.join(_ROOT, "tests")]

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
from axondist.backends.mpi import plans  # noqa: E402
from axondist.backends.mpi.algorithms import pair_exchange, pair_ride, pieces  # noqa: E402
from axondist.backends.plan import CallKey  # noqa: E402

#: (name, the algorithm's plan, the plain plan, collective, sizes in bytes)
CASES = (
    ("pair_ride", "PairRidePlan", "AllReducePlan", "all_reduce",
     (64, 1 << 10, 4 << 10, 16 << 10, 32 << 10, 64 << 10)),
    ("pieces (all_reduce)", "AllReducePiecesPlan", "AllReducePlan", "all_reduce",
     (8 << 20, 16 << 20, 32 << 20, 64 << 20)),
    ("pair_exchange (all_gather)", "PairAllGatherPlan", "AllGatherPlan", "all_gather",
     (4 << 10, 64 << 10, 1 << 20, 16 << 20)),
    ("pair_exchange (reduce_scatter)", "PairReduceScatterPlan", "ReduceScatterPlan",
     "reduce_scatter", (4 << 10, 64 << 10, 1 << 20, 16 << 20)),
)


def _plan_class(name: str) -> Any:
    for module in (plans, pair_ride, pieces, pair_exchange):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def measure(repeats: int) -> list[dict[str, Any]]:
    """Every case's rows on this job's world (every rank calls it)."""
    from mpi4py import MPI

    world = ad.init()
    backend: Any = world.backend
    comm = MPI.COMM_WORLD
    rows = []
    for name, algorithm, plain, collective, sizes in CASES:
        if name.startswith("pair") and world.world_size != 2:
            continue
        n = world.world_size
        for nbytes in sizes:
            x = np.zeros(nbytes // 4, np.float32)
            out = np.zeros(x.size * n if collective == "all_gather" else x.size // n, x.dtype)
            extra: dict[str, Any] = {
                "all_reduce": {"reduce_op": "SUM"}, "reduce_scatter": {"reduce_op": "SUM"},
                "all_gather": {"counts": (x.size,) * n}}[collective]
            key = CallKey.of(collective, x, **extra)
            fast, slow = _plan_class(algorithm)(backend, key), _plan_class(plain)(backend, key)
            raw: Callable[[], Any] = {
                "all_reduce": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
                "all_gather": lambda x=x, out=out: comm.Allgather(x, out),
                "reduce_scatter": lambda x=x, out=out: comm.Reduce_scatter_block(x, out,
                                                                                 MPI.SUM),
            }[collective]
            recv = None if collective == "all_reduce" else out
            variants = {"algorithm": lambda f=fast, x=x, r=recv: f.run(x, r),
                        "mpi": lambda s=slow, x=x, r=recv: s.run(x, r), "raw": raw}
            times = alternate(variants, batch=batch_for(nbytes, hi=200), repeats=repeats,
                              comm=comm)
            fast.free()
            slow.free()
            rows.append({"case": name, "size": nbytes,
                         "algorithm_us": spread(times["algorithm"], 1e6),
                         "mpi_us": spread(times["mpi"], 1e6),
                         "raw_us": spread(times["raw"], 1e6),
                         "algorithm/mpi": ratio_spread(times["algorithm"], times["mpi"]),
                         "mpi/raw": ratio_spread(times["mpi"], times["raw"])})
    return rows


def report(rows: list[dict[str, Any]], where: str) -> str:
    table = [(r["case"], format_size(r["size"]), format_spread(r["algorithm_us"]),
              format_spread(r["mpi_us"]), format_spread(r["raw_us"]),
              format_spread(r["algorithm/mpi"]), format_spread(r["mpi/raw"]))
             for r in rows]
    return (f"{where}; us per call, median (min-max) over timed batches, ratios paired\n"
            + format_table(("case", "size", "algorithm", "mpi (checked)", "raw mpi4py",
                            "algorithm/mpi", "mpi/raw"), table))


def cluster_driver(args: argparse.Namespace) -> int:
    from cluster.simcluster import SimCluster, SlowLinks, why_no_cluster

    reason = why_no_cluster()
    if reason is not None:
        print(f"bench_algorithms --cluster: skipped: {reason}")
        return 0
    with SimCluster(hosts=2, links=SlowLinks(delay_ms=args.delay_ms)) as cluster:
        out = cluster.workdir / "algorithms.json"
        run = cluster.run([2, 2], ["-m", "mpi4py", os.path.abspath(__file__), "--rank-out",
                                   str(out), "--repeats", str(args.repeats)],
                          timeout=args.timeout)
        if run.returncode != 0 or not out.exists():
            print(f"bench_algorithms: the run failed (exit {run.returncode})\n{run.tail()}")
            return 1
        rows = json.loads(out.read_text())
    print(report(rows, f"simulated 2 hosts x 2 ranks, {args.delay_ms:g} ms links"))
    write_json(args.json, rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cluster:
        return cluster_driver(args)
    rows = measure(args.repeats)
    world = ad.init()
    if world.rank == 0:
        if args.rank_out:
            Path(args.rank_out).write_text(json.dumps(rows))
        else:
            print(report(rows, f"one host, {world.world_size} ranks"))
            write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
