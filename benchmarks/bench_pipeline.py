"""Pipeline schedules on a cost model: measured step time and bubble vs simulate() and formulas.

    python benchmarks/bench_pipeline.py                     # mock world, 4 ranks on threads
    mpiexec -n 4 python benchmarks/bench_pipeline.py        # MPI, one rank per process
    mpiexec -n 4 python benchmarks/bench_pipeline.py --with-mock   # both tables

(``--with-mock`` under MPI: after the MPI table, rank 0 runs the mock world
while the other ranks wait without spinning.)

Every stage sleeps a fixed time: ``F`` = ``--forward-ms``, ``B`` =
``--backward-ms`` (the zero-bubble halves ``I`` and ``W`` half of that each),
divided by ``chunks`` for interleaved stages so every schedule has the same
work per rank, ``m * (F + B)``.  Sleeping releases the GIL and the CPU, so
threads and processes overlap like devices would, even on a small machine.
Each schedule runs ``--repeats`` (at least 3) timed steps after one warm-up
(barrier before each step); each step's time is the slowest rank's, and the
table gives the median (min-max) over the steps:

* ``formula``: the textbook bubble, ``(p - 1) / (m + p - 1)`` for GPipe and
  1F1B, ``(p - 1) / (v * m + p - 1)`` for interleaved 1F1B (none for ZB-H1);
  the lean interleaved variant reaches it only when ``p`` divides ``m``
  (``--microbatches 6`` shows the difference);
* ``simulated``: ``simulate(schedule, costs)`` -- bubble and step time
  predicted from the same costs, with free communication;
* ``measured``: bubble = ``1 - busy / step`` averaged over ranks (busy: time
  inside stage callables, from ``Pipeline.last_stats``), and the wall time
  of ``train_step``; ``ratio`` = measured / simulated step time (runtime
  overhead: messages, Python, sleep overshoot).

Only rank 0 prints; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import format_spread, format_table, median, spread, write_json  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.launching.worlds import launched_by_mpi  # noqa: E402
from axondist.pipeline import (  # noqa: E402
    SCHEDULES,
    Pipeline,
    PipelineMemoryStats,
    PipelineSchedule,
    PipelineStage,
    simulate,
)

#: How benchmarks/run.py runs this file: both tables in one MPI launch.
RUNNER = {"ranks": 4, "args": ["--with-mock"], "quick_args": ["--repeats", "3"]}

WIDTH = 8
KINDS = ("F", "B", "I", "W")


def sleeping_stage(seed: int, forward_s: float, backward_s: float) -> PipelineStage:
    """A stage that passes its input through (plus a bias) and sleeps for its cost."""
    bias = ad.Parameter(np.random.default_rng(seed).standard_normal(WIDTH) * 0.01)

    def forward(params: list[Any], x: Any) -> tuple[Any, Any]:
        time.sleep(forward_s)
        return x + params[0], None

    def backward(params: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
        time.sleep(backward_s)
        return gy, [gy.sum(axis=0)]

    def backward_input(params: list[Any], saved: Any, gy: Any) -> tuple[Any, Any]:
        time.sleep(backward_s / 2)
        return gy, None

    def backward_weight(params: list[Any], saved: Any, gy: Any, extra: Any) -> list[Any]:
        time.sleep(backward_s / 2)
        return [gy.sum(axis=0)]

    return PipelineStage(forward, backward, [bias], backward_input=backward_input,
                         backward_weight=backward_weight)


def mse(y: Any, t: Any) -> tuple[float, Any]:
    d = y - t
    return 0.5 * float(np.sum(d * d)) / y.shape[0], d / y.shape[0]


def variants(chunks: int) -> list[tuple[PipelineSchedule, int]]:
    """Every kind of the SCHEDULES table; the interleaved ones with ``chunks`` stages per rank."""
    return [(kind, chunks if spec.interleaved else 1) for kind, spec in SCHEDULES.items()]


def run(world: ad.World, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank runs this; returns the table rows (the same on every rank)."""
    p, r = world.world_size, world.rank
    m = args.microbatches
    tf, tb = args.forward_ms / 1e3, args.backward_ms / 1e3
    rows: list[dict[str, Any]] = []
    x = np.zeros((args.rows, WIDTH))
    t = np.ones((args.rows, WIDTH))
    for kind, v in variants(args.chunks):
        stages = [sleeping_stage(c * p + r, tf / v, tb / v) for c in range(v)]
        pipe = Pipeline(stages, world, num_microbatches=m, schedule=kind, chunks=v)
        last = (p * v - 1) % p
        steps, idle = [], []
        durations: dict[str, list[float]] = {k: [] for k in KINDS}
        for rep in range(1 + args.repeats):
            ad.barrier(world)
            start = time.perf_counter()
            pipe.train_step(x if r == 0 else None, t if r == last else None, mse)
            elapsed = time.perf_counter() - start
            if rep:  # the first step is a warm-up
                steps.append(elapsed)
                idle.append(1.0 - pipe.last_stats.busy[r] / elapsed)
                for ta in pipe.last_stats.timeline[r]:
                    durations[ta.action.kind.value].append(ta.end - ta.start)
        mine = np.array([[median(steps), median(idle), pipe.last_stats.peak_activations[r]]
                         + [median(durations[k]) if durations[k] else 0.0 for k in KINDS]
                         + steps + idle])
        table = ad.all_gather(mine, world, sizes=[1] * p)  # every rank's medians and steps
        every_step = table[:, 3 + len(KINDS):3 + len(KINDS) + args.repeats]
        every_idle = table[:, 3 + len(KINDS) + args.repeats:]
        slowest = every_step.max(axis=0)  # per step, the slowest rank's time
        costs = {"F": tf / v, "B": tb / v, "I": tb / (2 * v), "W": tb / (2 * v)}
        sim = simulate(pipe.schedule, costs)
        # The same schedule with each rank's measured action times (sleep overshoots):
        # what is left between it and the measured step is the runtime's own overhead.
        calibrated = simulate(
            pipe.schedule,
            lambda a, table=table: float(table[a.rank, 3 + KINDS.index(a.kind.value)]))
        formula = (None if SCHEDULES[kind].split_backward
                   else PipelineMemoryStats.bubble_fraction(p, m, v))
        rows.append({
            "schedule": kind.value, "ranks": p, "microbatches": m, "chunks": v,
            "bubble_formula": formula, "bubble_simulated": sim.bubble_fraction,
            "bubble_measured": spread(every_idle.mean(axis=0).tolist()),
            "step_ms_simulated": sim.makespan * 1e3,
            "step_ms_measured": spread(slowest.tolist(), 1e3),
            "step_ms_calibrated": calibrated.makespan * 1e3,
            "ratio_nominal": spread((slowest / sim.makespan).tolist()),
            "ratio_calibrated": spread((slowest / calibrated.makespan).tolist()),
            "peak_activations_measured": [int(v) for v in table[:, 2]],
            "peak_activations_simulated": list(sim.peak_activations),
        })
        pipe.close()
    return rows


def report(rows: list[dict[str, Any]], backend: str, args: argparse.Namespace) -> str:
    head = (f"pipeline on {backend}: {rows[0]['ranks']} ranks, {args.microbatches} microbatches, "
            f"F={args.forward_ms:g} ms, B={args.backward_ms:g} ms per stage "
            f"(divided by chunks); measured: median (min-max) over {args.repeats} steps, "
            "each the slowest rank's")
    table = format_table(
        ["schedule", "v", "bubble formula", "simulated", "measured",
         "step ms simulated", "calibrated", "measured", "ratio nominal", "calibrated",
         "peak act/rank"],  # measured (equal to simulate()'s; the tests check it)
        [[row["schedule"], row["chunks"],
          "-" if row["bubble_formula"] is None else f"{row['bubble_formula']:.3f}",
          f"{row['bubble_simulated']:.3f}", format_spread(row["bubble_measured"]),
          f"{row['step_ms_simulated']:.1f}", f"{row['step_ms_calibrated']:.1f}",
          format_spread(row["step_ms_measured"]), format_spread(row["ratio_nominal"]),
          format_spread(row["ratio_calibrated"]), str(row["peak_activations_measured"])]
         for row in rows])
    return head + "\n" + table


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="mock world size (MPI: the job's)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2, help="stages per rank for interleaved")
    # Long enough that thread wake-ups and message latency (~0.1-1 ms on a busy
    # machine) stay small against the work.
    ap.add_argument("--forward-ms", type=float, default=10.0)
    ap.add_argument("--backward-ms", type=float, default=20.0)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (>= 3)")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    ap.add_argument("--with-mock", action="store_true",
                    help="under MPI, also run the mock world on rank 0 afterwards")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error(f"--repeats must be at least 3 (a median and a spread), got {args.repeats}")
    results: dict[str, list[dict[str, Any]]] = {}
    rank = 0
    if launched_by_mpi():
        world = ad.init("mpi")
        rank = world.rank
        results["mpi"] = run(world, args)
        if rank == 0:
            print(report(results["mpi"], "MPI", args), flush=True)
        if args.with_mock:
            _on_rank0_while_others_idle(lambda: results.setdefault(
                "mock", ad.spawn(run, args.ranks, args)[0]))
    else:
        results["mock"] = ad.spawn(run, args.ranks, args)[0]
    if rank == 0:
        if "mock" in results:
            print(report(results["mock"], "the mock world", args), flush=True)
        write_json(args.json, results)
    return results


def _on_rank0_while_others_idle(fn: Any) -> None:
    """Run ``fn`` on MPI rank 0; the other ranks wait in a sleeping loop (a blocking
    MPI barrier would spin and steal the CPU from the mock world's threads)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        fn()
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


if __name__ == "__main__":
    main()
