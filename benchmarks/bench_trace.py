"""What tracing costs a DDP training step: the same step with the rank's trace writer
attached (``AXONDIST_TRACE``) and without, paired batch by batch.

    mpiexec -n 2 python benchmarks/bench_trace.py [--json results.json] [--repeats N]
    python benchmarks/bench_trace.py --backend mock [--world-size 2]

The step: every gradient of a DDP model (``--layers`` x 4 float32 arrays, 650K
values per layer) written, then ``DDP.sync_gradients()`` over buckets of
``--bucket-mb`` MiB (several all-reduces per step). Both variants run on every
rank, in alternating timed batches (``_common.alternate``) of one step by
default (a shared machine's load changes within seconds: many short pairs), each
timed on the slowest rank under MPI; the traced variant writes its files (batches of
records, every second at least) into a temporary folder. Reported: each
variant's step time and the paired ratio traced/plain, median (min-max) over
the batches. Target: the median ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
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
    target,
    verdict,
    write_json,
)

import axondist as ad  # noqa: E402
from axondist.backends.recording.recorder import FlightRecorder, describe_detail  # noqa: E402
from axondist.backends.recording.trace_file import TraceWriter  # noqa: E402

RUNNER = {"ranks": 2, "quick_args": ["--repeats", "20"], "timeout": 600}

LIMIT = 1.02


def model_shapes(layers: int) -> list[tuple[int, ...]]:
    """Four arrays per layer (two matrices, two vectors), 650K float32 values per layer."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(640, 512), (640,), (512, 576), (512,)]
    return shapes


def measure(world: ad.World, layers: int, bucket_mb: float, repeats: int, batch: int,
            directory: str, comm: Any = None) -> dict[str, list[float]]:
    """Per-step seconds of the plain and the traced step on this rank (every rank calls)."""
    params = [ad.Parameter(np.full(s, 0.01, np.float32)) for s in model_shapes(layers)]
    ddp = ad.DDP(params, bucket_cap_mb=bucket_mb, init_sync=False)
    recorder = world.backend_for("bench_trace").recorder
    writer = TraceWriter(directory, recorder, describe=describe_detail)
    grads = [np.full(p.shape, world.rank + 1.0, np.float32) for p in params]

    def step() -> None:
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g.copy()
            else:
                p.grad[...] = g
        ddp.sync_gradients()

    def plain() -> None:
        recorder.sink = None
        step()

    def traced() -> None:
        recorder.sink = writer
        step()

    try:
        # one step per timed batch, the variants alternating (a shared machine's load
        # changes within seconds): many short pairs, their ratios' median
        return alternate({"plain": plain, "traced": traced}, batch=batch, repeats=repeats,
                         sync=world.backend_for("bench_trace").barrier, comm=comm, prime=False)
    finally:
        recorder.sink = None
        writer.close()


def per_call(directory: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per recorded call (a flight-recorder begin and end) without and with the
    trace writer: what tracing adds to every collective, apart from the call itself."""
    recorder = FlightRecorder(0, 1)
    writer = TraceWriter(directory, recorder, describe=describe_detail)
    key = (np.dtype(np.float32), (1024,), "SUM", False)

    def calls(sink: Any) -> Any:
        def run() -> None:
            recorder.sink = sink
            begin, end = recorder.begin, recorder.end_blocking
            for seq in range(1, 1001):
                end(begin("world", seq, "all_reduce", key), "world", seq)
        return run

    try:
        times = alternate({"plain": calls(None), "traced": calls(writer)}, batch=1,
                          repeats=repeats)
    finally:
        writer.close()
    return {k: [t / 1000 for t in v] for k, v in times.items()}


def summarize(times: dict[str, list[float]], call_times: dict[str, list[float]],
              info: dict[str, Any]) -> dict[str, Any]:
    ratio = ratio_spread(times["traced"], times["plain"])
    added = [t - p for t, p in zip(call_times["traced"], call_times["plain"])]
    step = spread(times["plain"])["median"]
    implied = spread([1 + a * info["calls_per_step"] / step for a in added])
    return {**info, "step_ms": {k: spread(v, 1e3) for k, v in times.items()},
            "traced/plain": ratio,
            "call_us": {k: spread(v, 1e6) for k, v in call_times.items()},
            "added_us_per_call": spread(added, 1e6),
            "implied traced/plain": implied,
            "targets": [target("traced/plain step <= 1.02", ratio, LIMIT),
                        target("implied by the per-call cost <= 1.02", implied, LIMIT)]}


def report(summary: dict[str, Any]) -> str:
    rows = [[name, format_spread(stat)] for name, stat in summary["step_ms"].items()]
    ratio = summary["traced/plain"]
    rows.append(["traced/plain (paired)", format_spread(ratio)])
    rows.append(["traced/plain quartiles", f"{ratio['q1']:.3g}-{ratio['q3']:.3g}"])
    rows += [[f"one recorded call, {name} (us)", format_spread(stat)]
             for name, stat in summary["call_us"].items()]
    rows.append(["added per call (us)", format_spread(summary["added_us_per_call"])])
    rows.append(["implied step ratio (calls/step x added / step)",
                 format_spread(summary["implied traced/plain"])])
    head = (f"DDP step with and without tracing: {summary['backend']}, "
            f"{summary['world_size']} ranks, {summary['values'] / 1e6:.2f}M float32 values, "
            f"{summary['bucket_mb']:g} MiB buckets, {summary['calls_per_step']} calls/step, "
            f"{summary['repeats']} batches of {summary['batch']}")
    lines = [head, format_table(["variant", "median (min-max)"], rows)]
    lines += [f"target {t['target']}: {verdict(t)}" for t in summary["targets"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("auto", "mock", "mpi"), default="auto")
    parser.add_argument("--world-size", type=int, default=2, help="mock ranks (default 2)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=200, help="timed steps per variant")
    parser.add_argument("--batch", type=int, default=1, help="steps per timed batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "mpi" if ad.launch.launched_by_mpi() else "mock"
    values = sum(int(np.prod(s)) for s in model_shapes(args.layers))
    info = {"backend": backend, "values": values, "bucket_mb": args.bucket_mb,
            "repeats": args.repeats, "batch": args.batch,
            "calls_per_step": int(np.ceil(values * 4 / (args.bucket_mb * 2**20)))}
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as directory:
        if backend == "mpi":
            from mpi4py import MPI

            world = ad.init("mpi")
            shared = MPI.COMM_WORLD.bcast(directory, root=0)  # one folder for the job
            times = measure(world, args.layers, args.bucket_mb, args.repeats, args.batch,
                            shared, comm=MPI.COMM_WORLD)
            info["world_size"] = world.world_size
            rank = world.rank
        else:
            every = ad.spawn(measure, args.world_size, args.layers, args.bucket_mb,
                             args.repeats, args.batch, directory)
            times = {k: [max(v) for v in zip(*(t[k] for t in every))] for k in every[0]}
            info["world_size"] = args.world_size
            rank = 0
        call_times = per_call(directory, args.repeats) if rank == 0 else {}
    summary = summarize(times, call_times, info) if rank == 0 else {}
    if rank == 0:
        print(report(summary))
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
