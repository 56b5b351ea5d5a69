"""Expert parallelism's exchange: all-to-all throughput against an all-gather of the same
bytes, and the MoE dispatch against a bare all-to-all, in one launch.

    mpiexec -n 2 python benchmarks/bench_expert_parallel.py [--json results.json]

Every rank holds ``size`` bytes of float32 rows and each variant leaves ``size`` bytes of
rows on every rank: the same bytes in, the same bytes out.

* ``all_to_all``: ``ad.all_to_all(buf, send_sizes=..., recv_sizes=...)``, an equal block to
  every rank (what a balanced MoE dispatch sends);
* ``mpi4py``: raw ``COMM_WORLD.Alltoall`` on the same buffers, the floor;
* ``all_gather``: ``ad.all_gather(block, sizes=..., out=...)`` of a ``size / W`` block, so
  each rank receives ``size`` bytes too; what an expert layer without all-to-all would
  gather (every token to every rank);
* ``dispatch``: one MoE dispatch of the same bytes: :func:`plan_dispatch` (the routing's
  counts exchanged by a small all-to-all) then :func:`dispatch`, for tokens routed at
  random to top-2 of ``4 W`` experts.

The variants run in alternating timed batches (the order rotates, see
``_common.alternate``), each batch timed on the slowest rank; the table gives
microseconds per call as median (min-max), the throughput ``size / median time`` per
rank, and paired ratios (batch k over batch k). ``all_to_all/all_gather`` below 1 means
the all-to-all moves the same bytes faster; ``dispatch/all_to_all`` is what planning and
the count exchange add. No targets: a measurement.

Without mpi4py or an MPI launch of two or more ranks the benchmark prints why it is
skipped and exits with status 0.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    format_figure,
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)

import axondist as ad  # noqa: E402
from axondist._environment import launched_by_mpi  # noqa: E402
from axondist.expert_parallel import dispatch, pack, plan_dispatch  # noqa: E402

# How benchmarks/run.py launches this file.
RUNNER = {"ranks": 2, "quick_args": ["--quick"], "timeout": 600}

DEFAULT_SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [64 << 10, 1 << 20]
ROW = 256  # floats per row (1 KiB): a token's hidden state
TOP_K = 2
RATIOS = [("all_to_all", "all_gather"), ("all_to_all", "mpi4py"), ("dispatch", "all_to_all")]


def why_skipped() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install '.[mpi]')"
    launch = "launch it with mpiexec -n 2 python benchmarks/bench_expert_parallel.py"
    if not launched_by_mpi():
        return f"it needs several ranks and an MPI launcher: {launch}"
    from mpi4py import MPI

    if MPI.COMM_WORLD.size < 2:
        return f"one rank has nothing to exchange: {launch}"
    return None


def _variants(nbytes: int, comm: Any, world: ad.World) -> dict[str, Callable[[], Any]]:
    n = comm.size
    rows = max(n, nbytes // (4 * ROW) // n * n)  # splits evenly over the ranks
    buf = np.zeros((rows, ROW), np.float32)
    out = np.empty_like(buf)
    even = [rows // n] * n
    block = np.zeros((rows // n, ROW), np.float32)
    gathered = np.empty_like(buf)
    # the same bytes as a MoE dispatch: rows / k tokens, each to k random distinct experts
    experts = 4 * n
    tokens = rows // TOP_K
    rng = np.random.default_rng(comm.rank)
    choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :TOP_K]
    x = np.zeros((tokens, ROW), np.float32)

    def moe_dispatch() -> Any:
        plan = plan_dispatch(choice, experts, world, row_bytes=4 * ROW)
        return dispatch(pack(x, plan), plan, world)

    return {
        "all_to_all": lambda: ad.all_to_all(buf, world, send_sizes=even, recv_sizes=even),
        "mpi4py": lambda: comm.Alltoall(buf, out),
        "all_gather": lambda: ad.all_gather(block, world, sizes=even, out=gathered),
        "dispatch": moe_dispatch,
    }


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Time every variant at every size (collective); the same results on every rank."""
    from mpi4py import MPI

    world = ad.init("mpi")
    comm = MPI.COMM_WORLD
    backend: Any = world.backend
    results: dict[str, Any] = {"world_size": comm.size, "repeats": repeats,
                               "checks": bool(backend.options.checks), "rows": []}
    for nbytes in sizes:
        times = alternate(_variants(nbytes, comm, world), repeats=repeats, comm=comm,
                          batch=batch_for(nbytes, 32 << 20, hi=200))
        row: dict[str, Any] = {"bytes": nbytes}
        row.update({f"{k}_us": spread(v, 1e6) for k, v in times.items()})
        for k, v in times.items():
            row[f"{k}_GBps"] = nbytes / spread(v)["median"] / 1e9
        for num, den in RATIOS:
            row[f"{num}/{den}"] = ratio_spread(times[num], times[den])
        results["rows"].append(row)
    return results


def report(results: dict[str, Any]) -> str:
    """The table as text."""
    rows = results["rows"]
    names = [k[:-3] for k in rows[0] if k.endswith("_us")]
    ratios = [f"{a}/{b}" for a, b in RATIOS]
    header = ["size", *(f"{k} us" for k in names), *(f"{k} GB/s" for k in names), *ratios]
    table = [[format_size(r["bytes"]), *(format_spread(r[f"{k}_us"]) for k in names),
              *(format_figure(r[f"{k}_GBps"]) for k in names),
              *(format_spread(r[k]) for k in ratios)] for r in rows]
    return "\n".join([
        f"world size {results['world_size']}, checks {'on' if results['checks'] else 'off'}; "
        f"us per call, median (min-max) over {results['repeats']} timed batches (the slowest "
        "rank's); GB/s = bytes each rank ends with / median time; ratios paired by batch",
        format_table(header, table)])


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="bytes each rank sends and receives")
    parser.add_argument("--repeats", type=int, default=12,
                        help="timed batches per variant (a multiple of 4 balances the order)")
    parser.add_argument("--quick", action="store_true", help="two sizes, 4 repeats")
    args = parser.parse_args(argv)
    why = why_skipped()
    if why:
        print(f"bench_expert_parallel skipped: {why}")
        return None
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    results = run(sizes, 4 if args.quick else args.repeats)
    if ad.rank() == 0:
        print(report(results), flush=True)
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
