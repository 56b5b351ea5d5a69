"""Every pipeline schedule for one shape: validated, simulated, drawn, then run and measured.

    python examples/pipeline_schedules.py                      # p=4, m=8, v=2 on the mock world
    python examples/pipeline_schedules.py -p 3 -m 5 -v 3 --out /tmp/pictures
    axondist run -n 4 examples/pipeline_schedules.py           # one pipeline rank per process
    python examples/pipeline_schedules.py --out docs/img       # the guide's pictures

For ``p`` ranks, ``m`` microbatches and ``v`` chunks per rank, every kind of
``axondist.pipeline.SCHEDULES`` (the interleaved ones with ``v`` chunks) is
built, validated, dry-run on the stages' costs and drawn to
``OUT/pipeline_KIND.png`` (needs matplotlib), then run for real by a
``Pipeline`` whose stages sleep for their cost; the measured timeline is drawn
next to it (``pipeline_KIND_measured.png``). The table gives three bubbles:
simulated (nominal costs), replayed (the dry run with the durations the
actions really took: sleeps overshoot on a busy machine) and measured; the
exit status is 1 when a schedule fails validation or a rank's peak activations
differ from the dry run's. A measured bubble more than ``--tolerance`` from its
replayed one is reported as a timing difference and passes (a busy machine
makes it; ``--strict-timing`` fails on it). ``docs/examples.md`` shows a run and
the pictures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's axondist comes first

import axondist as ad
from axondist import comm
from axondist.errors import ScheduleError
from axondist.pipeline import (
    SCHEDULES,
    ActionKind,
    Pipeline,
    PipelineSchedule,
    PipelineStage,
    Schedule,
    SimulationResult,
    TimedAction,
    build_schedule,
    render_image,
    simulate,
    validate,
)

WIDTH = 4  # features of the array passed between stages
ROWS = 16  # rows of the batch (split into the microbatches)


@dataclass(frozen=True)
class Planned:
    """One schedule kind for the shape: the validated schedule and its dry run (or the error)."""

    kind: PipelineSchedule
    chunks: int
    costs: dict[ActionKind | str, float]  # milliseconds per action kind
    schedule: Schedule | None = None
    simulated: SimulationResult | None = None
    error: str | None = None


def stage_costs(forward_ms: float, backward_ms: float,
                chunks: int) -> dict[ActionKind | str, float]:
    """Milliseconds of each action kind on one chunk: the rank's work split over its chunks."""
    f, b = forward_ms / chunks, backward_ms / chunks
    return {"F": f, "B": b, "I": b / 2, "W": b / 2}


def plan(kind: PipelineSchedule, p: int, m: int, v: int, forward_ms: float,
         backward_ms: float) -> Planned:
    """Build, validate and dry-run one kind; a validation failure is returned, not raised."""
    chunks = v if SCHEDULES[kind].interleaved else 1
    costs = stage_costs(forward_ms, backward_ms, chunks)
    try:
        schedule = build_schedule(kind, p, m, chunks)
        validate(schedule)
    except ScheduleError as err:
        return Planned(kind, chunks, costs, error=str(err))
    return Planned(kind, chunks, costs, schedule, simulate(schedule, costs))


def sleeping_stage(forward_s: float, backward_s: float) -> PipelineStage:
    """A stage that adds a bias and sleeps for its cost (the split halves half each)."""
    bias = ad.Parameter(np.full(WIDTH, 0.01))

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


def mse(y: Any, target: Any) -> tuple[float, Any]:
    d = y - target
    return 0.5 * float(np.sum(d * d)) / y.shape[0], d / y.shape[0]


def measure(world: ad.World, planned: Planned, repeats: int) -> list[SimulationResult]:
    """Run ``planned`` on ``world`` (every rank calls this): each timed step, every rank's part.

    Each step is a SimulationResult in milliseconds, built from every rank's
    measured timeline (times since that rank's step began, right after a
    barrier), so its bubble is computed exactly as the dry run's:
    ``sum(idle) / (p * makespan)``.
    """
    assert planned.schedule is not None
    r = world.rank
    f_s, b_s = planned.costs["F"] / 1e3, planned.costs["B"] / 1e3
    stages = [sleeping_stage(f_s, b_s) for _ in range(planned.chunks)]
    pipe = Pipeline(stages, world, schedule=planned.schedule)
    x, target = np.zeros((ROWS, WIDTH)), np.ones((ROWS, WIDTH))
    mine = []
    try:
        for rep in range(1 + repeats):
            ad.barrier(world)
            pipe.train_step(x if pipe.holds_first_stage else None,
                            target if pipe.holds_last_stage else None, mse)
            stats = pipe.last_stats
            assert stats is not None
            if rep:  # the first step warms up
                mine.append((stats.timeline[r], stats.peak_activations[r]))
    finally:
        pipe.close()
    ranks = comm.all_gather_object(mine, world)
    return [measured_result(planned.schedule, [ranks[q][k] for q in range(len(ranks))])
            for k in range(repeats)]


def measured_result(schedule: Schedule,
                    ranks: list[tuple[tuple[TimedAction, ...], int]]) -> SimulationResult:
    """One measured step as a SimulationResult in milliseconds (bubble, render_image)."""
    rows = tuple(tuple(TimedAction(t.action, t.start * 1e3, t.end * 1e3) for t in timeline)
                 for timeline, _ in ranks)
    return SimulationResult(
        schedule=schedule, comm=0.0, timeline=rows,
        makespan=max((row[-1].end for row in rows if row), default=0.0),
        busy=tuple(sum(t.end - t.start for t in row) for row in rows),
        peak_activations=tuple(peak for _, peak in ranks))


Runs = list[list[SimulationResult] | None]
"""Per planned schedule, its timed steps (None when it failed validation)."""


def run_all(world: ad.World, plans: list[Planned], repeats: int) -> Runs:
    """Every valid schedule in turn on ``world``; None for the ones that failed validation."""
    return [measure(world, pl, repeats) if pl.error is None else None for pl in plans]


def replayed(measured: SimulationResult) -> SimulationResult:
    """The dry run of the schedule with the durations every action really took.

    Sleeps overshoot (by several milliseconds on a busy machine), so the
    nominal dry run is not what ran; replaying the measured durations leaves
    only the runtime's own waiting (messages, thread wake-ups) between this
    and the measured step.
    """
    took = {t.action: t.end - t.start for row in measured.timeline for t in row}
    return simulate(measured.schedule, lambda a: took[a])


def gap(measured: SimulationResult) -> float:
    """Measured bubble minus the replayed dry run's."""
    return measured.bubble_fraction - replayed(measured).bubble_fraction


def median_step(steps: list[SimulationResult]) -> SimulationResult:
    """The step whose gap to its replayed dry run is the median (the lower middle one)."""
    ordered = sorted(steps, key=gap)
    return ordered[(len(ordered) - 1) // 2]


TIMING = "(timing)"
"""Ends a verdict's part that only the machine's speed caused: reported, not a failure."""


def verdict(pl: Planned, steps: list[SimulationResult] | None, tolerance: float) -> str:
    """``"OK"`` or what is wrong with one schedule's run; a bubble off by more than
    ``tolerance`` is a timing difference, marked :data:`TIMING`."""
    if pl.error is not None:
        return "FAILED validation"
    assert pl.simulated is not None and steps is not None
    problems = []
    off = gap(median_step(steps))
    if abs(off) > tolerance:
        problems.append(f"bubble off by {off:+.3f} {TIMING}")
    if any(s.peak_activations != pl.simulated.peak_activations for s in steps):
        problems.append("peak activations DIFFER")
    return "; ".join(problems) or "OK"


def passes(verdict_text: str, strict_timing: bool = False) -> bool:
    """Whether a verdict passes: every part OK, or (unless ``strict_timing``) timing only."""
    return all(part == "OK" or (part.endswith(TIMING) and not strict_timing)
               for part in verdict_text.split("; "))


def report(plans: list[Planned], runs: Runs, tolerance: float,
           strict_timing: bool = False) -> tuple[str, bool]:
    """The table and whether every schedule passed."""
    header = ("schedule", "v", "bubble: simulated", "replayed", "measured", "step ms: simulated",
              "replayed", "measured", "peak act/rank", "verdict")
    lines, ok = [], True
    for pl, steps in zip(plans, runs):
        verdict_text = verdict(pl, steps, tolerance)
        ok = ok and passes(verdict_text, strict_timing)
        if pl.simulated is None or steps is None:
            lines.append((pl.kind.value, str(pl.chunks), *["-"] * 7, verdict_text))
            continue
        sim, measured = pl.simulated, median_step(steps)
        replay = replayed(measured)
        lines.append((
            pl.kind.value, str(pl.chunks), f"{sim.bubble_fraction:.3f}",
            f"{replay.bubble_fraction:.3f}", f"{measured.bubble_fraction:.3f}",
            f"{sim.makespan:.0f}", f"{replay.makespan:.0f}", f"{measured.makespan:.0f}",
            str(list(sim.peak_activations)).replace(" ", ""), verdict_text))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    text = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in [header, *lines])
    errors = [f"{pl.kind.value}: {pl.error}" for pl in plans if pl.error is not None]
    return "\n".join([text, *errors]), ok


def draw(plans: list[Planned], runs: Runs, out: Path) -> list[Path]:
    """PNG pictures of every simulated and measured timeline; [] (and a note) without matplotlib."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for pl, steps in zip(plans, runs):
            if pl.simulated is None or steps is None:
                continue
            path = out / f"pipeline_{pl.kind.value}.png"
            render_image(pl.simulated, path, title=_title(pl, pl.simulated, "simulated"))
            written.append(path)
            measured = median_step(steps)
            path = out / f"pipeline_{pl.kind.value}_measured.png"
            render_image(measured, path, title=_title(pl, measured, "measured"))
            written.append(path)
    except ImportError as err:
        if created and not written:
            out.rmdir()
        print(f"matplotlib is not installed; skipping the pictures ({err})")
    return written


def _title(pl: Planned, result: SimulationResult, what: str) -> str:
    s = result.schedule
    return (f"{pl.kind.value}, {what}: {s.num_ranks} ranks, {s.num_microbatches} microbatches, "
            f"{s.chunks} chunk(s), bubble {result.bubble_fraction:.1%} (times in ms)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-p", "--ranks", type=int, default=4,
                        help="pipeline ranks on the mock world (under mpiexec: the job's size)")
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("-v", "--chunks", type=int, default=2,
                        help="chunks per rank for the interleaved schedules")
    parser.add_argument("--forward-ms", type=float, default=10.0, help="forward time per rank")
    parser.add_argument("--backward-ms", type=float, default=20.0, help="backward time per rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--tolerance", type=float, default=0.15,
                        help="largest |measured - replayed| bubble reported as OK; a larger "
                             "one is reported as a timing difference")
    parser.add_argument("--strict-timing", action="store_true",
                        help="fail when a bubble is off by more than --tolerance (for a "
                             "quiet machine: on a busy one sleeps and messages run late)")
    parser.add_argument("--out", type=Path, default=Path("build/pipeline_schedules"),
                        help="folder for the pictures")
    parser.add_argument("--no-pictures", action="store_true", help="draw nothing")
    args = parser.parse_args(argv)
    for name in ("ranks", "microbatches", "chunks", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: pass at least 1")
    for name in ("forward_ms", "backward_ms", "tolerance"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} {value}: pass a positive number")
    return args


def check_all(world: ad.World, args: argparse.Namespace) -> int:
    """Every schedule on ``world``'s ranks; rank 0 prints the table and draws. The exit status."""
    p = world.world_size
    plans = [plan(kind, p, args.microbatches, args.chunks, args.forward_ms, args.backward_ms)
             for kind in SCHEDULES]
    runs = run_all(world, plans, args.repeats)
    table, ok = report(plans, runs, args.tolerance, args.strict_timing)
    timing = any(TIMING in verdict(pl, steps, args.tolerance)
                 for pl, steps in zip(plans, runs) if steps is not None)
    under_mpi = world.backend is not None and world.backend.name == "mpi"
    if world.rank == 0:
        backend = f"MPI, {p} processes" if under_mpi else f"the mock world, {p} threads"
        print(f"pipeline schedules on {backend}: {args.microbatches} microbatches, "
              f"F={args.forward_ms:g} ms, B={args.backward_ms:g} ms per rank (divided by its "
              f"chunks), median of {args.repeats} steps, bubble tolerance {args.tolerance:g}")
        print(table)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if under_mpi and cores is not None and p > cores:
            print(f"note: {p} processes share {cores} cores; a rank waiting in MPI's recv keeps "
                  "its core busy, so messages wait for a free core and the measured bubble grows")
        if timing:
            print(f"note: a measured bubble is off by more than {args.tolerance:g} from its "
                  "replayed dry run; a busy machine stretches sleeps and delays messages, so this "
                  "is reported, not failed" + (" (--strict-timing: failed)"
                                               if args.strict_timing else ""))
        if not args.no_pictures:
            written = draw(plans, runs, args.out)
            if written:
                print(f"{len(written)} pictures in {os.fspath(args.out)}")
        print("every schedule valid and measured as simulated: "
              + ("yes" if ok else "no (FAILED)"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # python: args.ranks threads; axondist run -n P / mpiexec: this process's rank of P
    return ad.run(check_all, args.ranks, args)[0]


if __name__ == "__main__":
    sys.exit(main())
