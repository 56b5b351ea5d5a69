"""axondist's MPI backend vs raw mpi4py (and torch.distributed gloo), in one launch.

    mpiexec -n 2 python benchmarks/bench_mpi_collectives.py [--json results.json]

For each collective and size the variants run on the same float32 NumPy
buffers in alternating timed batches (the order rotates; see
``_common.alternate``), each batch timed on the slowest rank; the table gives
microseconds per call and paired ratios (batch k of one variant over batch k
of the other), each as median (min-max) over the batches; the targets read
the medians. A ratio ``axondist/X`` below 1 means axondist is faster. Sizes
are each rank's input buffer. The header says whether the cross-rank checks
were on (run once with ``AXONDIST_CHECKS=0`` to time the calls without them).

Rows (raw mpi4py on ``COMM_WORLD``, with the buffers axondist gets):

* ``all_reduce``: ``all_reduce(buf)`` vs ``Allreduce(IN_PLACE, buf, SUM)``; column
  ``prepared`` is the same call prepared once (``ad.prepare``), without finding its plan.
* ``all_reduce_mean``: ``all_reduce_mean(buf)`` vs the raw SUM, and vs the raw
  SUM followed by ``np.divide(buf, n, out=buf)`` (column ``sum+divide``); column
  ``MPI plan`` is the table's last row forced (the checked ``Allreduce`` then the mean's
  pass), so ``axondist/MPI plan`` is what the table's choice gains.
* ``scaled_sum``: the world backend's ``scaled_sum_blocking(buf, 1/n)``
  (DDP's weighted gradient sum) vs the raw SUM and vs ``sum+divide``.
* ``reduce_scatter``: ``reduce_scatter(buf, out=mine)`` vs ``Reduce_scatter_block``
  into the same preallocated result; column ``prepared`` is the call prepared once.
* ``all_gather``: ``all_gather(buf, sizes=..., out=out)`` vs ``Allgather``;
  column ``no sizes`` is ``all_gather(buf, out=out)``, which exchanges the row
  counts first.
* ``broadcast``: ``broadcast(buf, src=0)`` vs ``Bcast(buf, 0)``;
* ``all_to_all``: the backend's ``all_to_all`` of equal blocks, the counts known (what
  ``ad.all_to_all`` runs after its exchange of sizes) vs ``Alltoall``, and raw
  ``Alltoallv`` of the same blocks beside them.

gloo (``all_reduce``, ``broadcast``, ``all_gather``) is skipped, and named as
not measured, when torch is not importable.

Column ``protocol`` (two ranks; reduce-scatter, all-gather with sizes and broadcast, at
the sizes where the table picks a two-rank ride or exchange): the messages that call's
plan exchanges, sent by plain mpi4py on a communicator of their own (``_pair_protocols``).
It is the floor of a checked call on this host, so ``axondist/protocol`` is what the
library itself adds (finding the plan, numbering and recording the call, checking its
buffers) and ``protocol/mpi4py`` what the check's messages cost against MPI's own call.

Targets: every ``axondist/mpi4py`` (and ``no sizes/mpi4py``) ratio <= 1.05
from 1 MiB and within max(1.5x, +3 us) below; ``all_reduce_mean`` <= 1.05x
the raw SUM from 1 MiB; ``scaled_sum`` <= 1.05x ``sum+divide`` from 1 MiB;
gloo/axondist >= 2 at 16 MiB and > 1 at every size.
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
from _pair_protocols import floor_of, key_of  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.process_group import current_world  # noqa: E402

# How benchmarks/run.py launches this file.
RUNNER = {"ranks": 2, "quick_args": ["--repeats", "3"], "timeout": 900}

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ("all_reduce", "all_reduce_mean", "scaled_sum", "reduce_scatter", "all_gather",
       "broadcast", "all_to_all")
#: op -> the (numerator, denominator) ratios its table shows.
RATIOS: dict[str, list[tuple[str, str]]] = {
    "all_reduce": [("axondist", "mpi4py"), ("prepared", "mpi4py"), ("gloo", "axondist")],
    "all_reduce_mean": [("axondist", "mpi4py"), ("axondist", "sum+divide"),
                        ("MPI plan", "mpi4py"), ("axondist", "MPI plan")],
    "scaled_sum": [("axondist", "mpi4py"), ("axondist", "sum+divide")],
    "reduce_scatter": [("axondist", "mpi4py"), ("prepared", "mpi4py"),
                       ("protocol", "mpi4py"), ("axondist", "protocol")],
    "all_gather": [("axondist", "mpi4py"), ("no sizes", "mpi4py"), ("gloo", "axondist"),
                   ("protocol", "mpi4py"), ("axondist", "protocol")],
    "broadcast": [("axondist", "mpi4py"), ("gloo", "axondist"), ("protocol", "mpi4py"),
                  ("axondist", "protocol")],
    "all_to_all": [("axondist", "mpi4py"), ("axondist", "Alltoallv"), ("Alltoallv", "mpi4py")],
}


def _variants(op: str, nbytes: int, comm: Any, mpi: Any, dist: Any,
              pair: Any = None) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The timed variants of ``op`` at ``nbytes``, and what frees what they hold (``pair``:
    a two-rank communicator of the benchmark's own, for the ``protocol`` column)."""
    n = comm.size
    buf = np.zeros(nbytes // 4, np.float32)  # zeros: repeated sums stay finite
    backend: Any = current_world().backend
    raw_sum = lambda: comm.Allreduce(mpi.IN_PLACE, buf, mpi.SUM)  # noqa: E731

    def sum_divide() -> None:
        comm.Allreduce(mpi.IN_PLACE, buf, mpi.SUM)
        np.divide(buf, n, out=buf)

    fns: dict[str, Callable[[], Any]] = {}
    result: np.ndarray | None = None  # a reduce-scatter's block, an all-gather's output
    if op == "all_reduce":
        prepared_sum = ad.prepare("all_reduce", buf)
        fns["axondist"] = lambda: ad.all_reduce(buf)
        fns["mpi4py"] = raw_sum
        fns["prepared"] = lambda: prepared_sum(buf)
    elif op == "all_reduce_mean":
        fns["axondist"] = lambda: ad.all_reduce_mean(buf)
        fns["mpi4py"] = raw_sum
        fns["sum+divide"] = sum_divide
        plain = _plain_mean_plan(backend, buf)
        fns["MPI plan"] = lambda: plain.run(buf)
    elif op == "scaled_sum":
        fns["axondist"] = lambda: backend.scaled_sum_blocking(buf, 1.0 / n)
        fns["mpi4py"] = raw_sum
        fns["sum+divide"] = sum_divide
    elif op == "reduce_scatter":
        buf = np.zeros(max(n, nbytes // 4 // n * n), np.float32)  # splits evenly
        mine = result = np.zeros(buf.size // n, np.float32)
        prepared_block = ad.prepare("reduce_scatter", buf)
        fns["axondist"] = lambda: ad.reduce_scatter(buf, out=mine)
        fns["mpi4py"] = lambda: comm.Reduce_scatter_block(buf, mine, mpi.SUM)
        fns["prepared"] = lambda: prepared_block(buf, mine)
    elif op == "all_gather":
        out = result = np.zeros(buf.size * n, np.float32)
        sizes = [buf.size] * n
        fns["axondist"] = lambda: ad.all_gather(buf, sizes=sizes, out=out)
        fns["mpi4py"] = lambda: comm.Allgather(buf, out)
        fns["no sizes"] = lambda: ad.all_gather(buf, out=out)
    elif op == "all_to_all":
        buf = np.zeros(max(n, nbytes // 4 // n * n), np.float32)  # equal blocks
        out = np.zeros_like(buf)
        counts = [buf.size // n] * n
        at = [k * counts[0] for k in range(n)]
        fns["axondist"] = lambda: backend.all_to_all(buf, out, counts, counts).wait()
        fns["mpi4py"] = lambda: comm.Alltoall(buf, out)
        fns["Alltoallv"] = lambda: comm.Alltoallv([buf, counts, at, mpi.FLOAT],
                                                  [out, counts, at, mpi.FLOAT])
    else:
        fns["axondist"] = lambda: ad.broadcast(buf, src=0)
        fns["mpi4py"] = lambda: comm.Bcast(buf, 0)
    if dist is not None and op in ("all_reduce", "broadcast", "all_gather"):
        fns["gloo"] = _gloo(op, dist, buf, n)
    free: Callable[[], None] = lambda: None  # noqa: E731
    if pair is not None and op in ("reduce_scatter", "all_gather", "broadcast"):
        found = floor_of(op, key_of(op, buf, buf.size), backend.layout, pair, mpi, buf,
                         result)
        if found is not None:
            fns["protocol"], free = found
    return fns, free


def _plain_mean_plan(backend: Any, buf: np.ndarray) -> Any:
    """The table's last row for a mean of ``buf`` whatever the table chose: the checked
    ``Allreduce`` then the division's pass (what a two-rank mean ran before PAIR_HALVES)."""
    from axondist.backends.mpi.plans import AllReducePlan
    from axondist.backends.plan import CallKey

    key = CallKey("all_reduce", buf.dtype, buf.shape, "numpy", reduce_op="AVERAGE")
    return AllReducePlan(backend, key)


def _gloo(op: str, dist: Any, buf: np.ndarray, n: int) -> Callable[[], Any]:
    import torch  # only when start_gloo found it

    t = torch.from_numpy(buf)
    if op == "all_reduce":
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        return lambda: dist.broadcast(t, 0)
    tout = torch.from_numpy(np.zeros(buf.size * n, np.float32))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: gather(tout, t)


def run(sizes: list[int], repeats: int, use_torch: bool,
        ops: tuple[str, ...] = OPS) -> dict[str, Any]:
    """Time every op and size; returns the results (the same on every rank's call)."""
    ad.init("mpi")  # first: MPI starts as axondist starts it (MPICH's single copy where allowed)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    dist = start_gloo(comm) if use_torch else None
    backend: Any = current_world().backend
    results: dict[str, Any] = {
        "world_size": comm.size, "repeats": repeats,
        "checks": bool(backend.options.checks), "ops": {},
        "missing_peers": (missing_peers({"torch.distributed (gloo)": "torch"}) if use_torch
                          else {"torch.distributed (gloo)": "skipped (--no-torch)"})}
    pair = comm.Dup() if comm.size == 2 else None  # the protocol column's own messages
    for op in ops:
        rows = results["ops"][op] = []
        for nbytes in sizes:
            fns, free = _variants(op, nbytes, comm, MPI, dist, pair)
            times = alternate(fns, batch=batch_for(nbytes, 32 << 20, hi=500), repeats=repeats,
                              comm=comm)  # each batch: the slowest rank's time
            free()
            row: dict[str, Any] = {"bytes": nbytes}
            row.update({f"{k}_us": spread(v, 1e6) for k, v in times.items()})
            for num, den in RATIOS[op]:
                if num in times and den in times:
                    row[f"{num}/{den}"] = ratio_spread(times[num], times[den])
            row["meets_target"] = meets_target(op, row)
            rows.append(row)
    if pair is not None:
        pair.Free()
    if dist is not None:
        dist.destroy_process_group()
    return results


def _within(row: dict[str, Any], num: str, den: str, limit: float) -> bool:
    """``num/den`` <= ``limit`` from 1 MiB; below, <= max(1.5x, ``den`` + 3 us)."""
    ratio = row[f"{num}/{den}"]["median"]
    if row["bytes"] >= 1 << 20:
        return bool(ratio <= limit)
    return bool(ratio <= 1.5 or row[f"{num}_us"]["median"] <= row[f"{den}_us"]["median"] + 3.0)


def meets_target(op: str, row: dict[str, Any]) -> bool:
    """The targets of ``op`` (see the module docstring), on the medians of ``row``."""
    ok = _within(row, "axondist", "mpi4py", 1.05)
    if op == "scaled_sum":
        ok = _within(row, "axondist", "sum+divide", 1.05)  # its floor is a sum and a pass
    if op == "all_gather":
        ok = ok and _within(row, "no sizes", "mpi4py", 1.05)
    if "gloo/axondist" in row:
        gloo = row["gloo/axondist"]["median"]
        ok = ok and gloo > 1.0 and (row["bytes"] != 16 << 20 or gloo >= 2.0)
    return ok


def report(results: dict[str, Any]) -> str:
    """The ratio tables as text."""
    out = [f"world size {results['world_size']}, checks {'on' if results['checks'] else 'off'}; "
           f"us per call, median (min-max) over {results['repeats']} timed batches (the "
           "slowest rank's); ratios paired by batch"]
    for op, rows in results["ops"].items():
        keys = list(dict.fromkeys(k for r in rows for k in r))  # a column some rows lack
        names = [k[:-3] for k in keys if k.endswith("_us")]
        ratios = [f"{a}/{b}" for a, b in RATIOS[op] if f"{a}/{b}" in keys]
        header = ["size", *names, *ratios, "target"]
        table = [[format_size(r["bytes"]),
                  *(format_spread(r[k]) if k in r else "-"
                    for k in [f"{name}_us" for name in names] + ratios),
                  "met" if r["meets_target"] else "MISSED"] for r in rows]
        out += ["", op, format_table(header, table)]
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
