"""axondist's MPI backend vs raw mpi4py vs torch.distributed (gloo), in one launch.

    mpiexec -n 2 python benchmarks/bench_mpi_collectives.py [--json results.json]

For each collective and size, the three variants run on the same float32
NumPy buffers (gloo through ``torch.from_numpy``, sharing the memory) in
alternating timed batches (axondist, mpi4py, gloo, then the order rotates;
see ``_common.alternate``), each batch timed on the slowest rank; the table
gives microseconds per call and paired ratios (batch k of one variant over
batch k of the other), each as median (min-max) over the batches; the targets
read the medians. ``axondist/mpi4py`` below 1 and ``gloo/axondist`` above 1
mean axondist is faster. Sizes are each rank's input
buffer (``all_gather`` returns ``world_size`` times that).

Raw mpi4py is ``Allreduce(MPI.IN_PLACE, buf, MPI.SUM)``, ``Bcast(buf, 0)`` and
``Allgather(buf, out)`` on ``COMM_WORLD``. axondist is ``all_reduce(buf)``,
``broadcast(buf, src=0)`` and ``all_gather(buf, sizes=..., out=out)`` (``sizes``
skips the exchange of row counts, ``out`` reuses the result array as raw
mpi4py does: a fresh 32 MiB array per call costs as much again in page
faults). gloo is skipped, and named as not measured, when torch is not
importable. For ``all_gather`` the table also shows the call without
``sizes`` (``all_gather(buf, out=out)``, column ``no sizes``): leading sizes
may differ between ranks, so it first all-gathers every rank's size (one
small ``allgather`` of Python objects); the targets apply to the ``sizes=``
call.

Targets: axondist/mpi4py <= 1.05 from 1 MiB, and within max(1.5x, +2 us)
below; gloo/axondist >= 2 at 16 MiB and > 1 at every size.
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
    missing_peers,
    ratio_spread,
    spread,
    start_gloo,
    write_json,
)

import axondist as ad  # noqa: E402

# How benchmarks/run.py launches this file.
RUNNER = {"ranks": 2, "quick_args": ["--repeats", "3"], "timeout": 900}

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ("all_reduce", "broadcast", "all_gather")


def _variants(op: str, nbytes: int, comm: Any, mpi: Any, dist: Any) -> dict[str, Callable[[], Any]]:
    n = comm.size
    buf = np.zeros(nbytes // 4, np.float32)  # zeros: repeated sums stay finite
    fns: dict[str, Callable[[], Any]] = {}
    if op == "all_reduce":
        fns["axondist"] = lambda: ad.all_reduce(buf)
        fns["mpi4py"] = lambda: comm.Allreduce(mpi.IN_PLACE, buf, mpi.SUM)
    elif op == "broadcast":
        fns["axondist"] = lambda: ad.broadcast(buf, src=0)
        fns["mpi4py"] = lambda: comm.Bcast(buf, 0)
    else:
        out = np.zeros(buf.size * n, np.float32)
        sizes = [buf.size] * n
        fns["axondist"] = lambda: ad.all_gather(buf, sizes=sizes, out=out)
        fns["mpi4py"] = lambda: comm.Allgather(buf, out)
        fns["no sizes"] = lambda: ad.all_gather(buf, out=out)
    if dist is not None:
        import torch

        t = torch.from_numpy(buf)
        if op == "all_reduce":
            fns["gloo"] = lambda: dist.all_reduce(t)
        elif op == "broadcast":
            fns["gloo"] = lambda: dist.broadcast(t, 0)
        else:
            tout = torch.from_numpy(np.zeros(buf.size * n, np.float32))
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            fns["gloo"] = lambda: gather(tout, t)
    return fns


def run(sizes: list[int], repeats: int, use_torch: bool,
        ops: tuple[str, ...] = OPS) -> dict[str, Any]:
    """Time every op and size; returns the results (the same on every rank's call)."""
    from mpi4py import MPI

    ad.init("mpi")
    comm = MPI.COMM_WORLD
    dist = start_gloo(comm) if use_torch else None
    results: dict[str, Any] = {
        "world_size": comm.size, "repeats": repeats, "ops": {},
        "missing_peers": (missing_peers({"torch.distributed (gloo)": "torch"}) if use_torch
                          else {"torch.distributed (gloo)": "skipped (--no-torch)"})}
    for op in ops:
        rows = results["ops"][op] = []
        for nbytes in sizes:
            fns = _variants(op, nbytes, comm, MPI, dist)
            times = alternate(fns, batch=batch_for(nbytes, 32 << 20, hi=500), repeats=repeats,
                              comm=comm)  # each batch: the slowest rank's time
            row: dict[str, Any] = {"bytes": nbytes}
            row.update({f"{k}_us": spread(v, 1e6) for k, v in times.items()})
            row["axondist/mpi4py"] = ratio_spread(times["axondist"], times["mpi4py"])
            if "no sizes" in times:
                row["no sizes/mpi4py"] = ratio_spread(times["no sizes"], times["mpi4py"])
            if "gloo" in times:
                row["gloo/axondist"] = ratio_spread(times["gloo"], times["axondist"])
            row["meets_target"] = _meets_target(row)
            rows.append(row)
    if dist is not None:
        dist.destroy_process_group()
    return results


def _meets_target(row: dict[str, Any]) -> bool:
    """The targets, on the medians."""
    ratio = row["axondist/mpi4py"]["median"]
    ok = ratio <= 1.05 if row["bytes"] >= 1 << 20 else (
        ratio <= 1.5 or row["axondist_us"]["median"] <= row["mpi4py_us"]["median"] + 2.0)
    if "gloo/axondist" in row:
        gloo = row["gloo/axondist"]["median"]
        ok = ok and gloo > 1.0
        if row["bytes"] == 16 << 20:
            ok = ok and gloo >= 2.0
    return ok


def report(results: dict[str, Any]) -> str:
    """The ratio tables as text."""
    out = [f"world size {results['world_size']}; us per call, median (min-max) over "
           f"{results['repeats']} timed batches (the slowest rank's); ratios paired by batch"]
    for op, rows in results["ops"].items():
        gloo = any("gloo_us" in r for r in rows)
        nosizes = any("no sizes_us" in r for r in rows)
        header = ["size", "axondist", "mpi4py"] + (["gloo"] if gloo else []) + \
            ["axondist/mpi4py"] + (["gloo/axondist"] if gloo else []) + \
            (["no sizes", "no sizes/mpi4py"] if nosizes else []) + ["target"]
        table = []
        for r in rows:
            keys = (["axondist_us", "mpi4py_us"] + (["gloo_us"] if gloo else [])
                    + ["axondist/mpi4py"] + (["gloo/axondist"] if gloo else [])
                    + (["no sizes_us", "no sizes/mpi4py"] if nosizes else []))
            line = [format_size(r["bytes"]), *(format_spread(r[k]) for k in keys)]
            line += ["met" if r["meets_target"] else "MISSED"]
            table.append(line)
        title = op + (" (axondist: sizes= and out=; no sizes: out= only)" if nosizes else "")
        out += ["", title, format_table(header, table)]
    out += [f"not measured: {peer} ({why})" for peer, why in results["missing_peers"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                        help="buffer sizes in bytes (multiples of 4)")
    parser.add_argument("--repeats", type=int, default=18,
                        help="timed batches per variant (a multiple of 6 balances the order)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                        help="collectives to time")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed gloo")
    args = parser.parse_args(argv)
    results = run(args.sizes, args.repeats, not args.no_torch, tuple(args.ops))
    if ad.rank() == 0:
        print(report(results), flush=True)
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
