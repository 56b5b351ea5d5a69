"""A traced job where the last rank sleeps on purpose before some steps' all-reduce: the
straggler report must name it and the others' wait within 10% of the sleep.

Runs on the mock world and, through tests/world/test_mpi_launch.py, under mpiexec;
``test_straggler_under_mpiexec_3`` also launches ``mpiexec -n 3 python THIS_FILE DIR``
itself, traced through ``AXONDIST_TRACE``. A second subprocess crashes mid-run and its
trace is still read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness import LAUNCHED, run_world

import axondist as ad
from axondist.trace.report import format_report, straggler_report
from axondist.trace.timeline import read_timeline

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
STEPS = 8
SLEEPY_STEPS = (1, 4, 6)
SLEEP_S = 0.4
LAUNCH_TIMEOUT = 300


def straggler_job(world: ad.World, directory: str | None) -> None:
    """Every rank: trace ``STEPS`` steps (a span, a small all-reduce, a broadcast); the
    last rank sleeps ``SLEEP_S`` before the all-reduce of the ``SLEEPY_STEPS``."""
    ad.trace.start(directory)
    slow = world.world_size - 1
    x = np.arange(4096, dtype=np.float32)
    for step in range(STEPS):
        with ad.trace_span("step"):
            with ad.trace_span("forward"):
                if world.rank == slow and step in SLEEPY_STEPS:
                    time.sleep(SLEEP_S)
                y = x * (world.rank + 1)
            ad.all_reduce(y)
            ad.broadcast(y, src=0)
    ad.trace.stop()


def check_report(directory: str, world_size: int) -> str:
    """Read the trace and check the straggler; return the report's text."""
    timeline = read_timeline(directory)
    assert sorted(timeline.ranks) == list(range(world_size))
    report = straggler_report(timeline)
    text = format_report(report)
    slow, slept = world_size - 1, SLEEP_S * len(SLEEPY_STEPS)
    assert report.collectives == 2 * STEPS, text
    assert report.straggler == slow, text
    assert report.held_s(slow) == pytest.approx(slept, rel=0.10), text
    for rank, trace in timeline.ranks.items():
        spans = [s.name for s in trace.spans]
        assert spans.count("step") == STEPS and spans.count("forward") == STEPS
        assert len(trace.clocks) == 2, f"rank {rank}: clock exchanges {trace.clocks}"
    return text


def _body(world: ad.World, directory: str) -> None:
    # under MPI each rank has its own tmp_path: use rank 0's
    directory = ad.broadcast_object(directory, src=0)
    straggler_job(world, directory)
    ad.barrier()
    check_report(directory, world.world_size)
    ad.barrier()  # nobody deletes the folder while another rank reads it


def test_report_names_the_sleeping_rank(tmp_path: Path) -> None:
    run_world(_body, 3, str(tmp_path))


def _why_no_mpiexec() -> str | None:
    if LAUNCHED:
        return "already one rank of a launched job"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install '.[mpi]')"
    return None if MPIEXEC.exists() else f"no mpiexec next to {sys.executable}"


def _environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "AXONDIST_TIMEOUT": "60",
           "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
           "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1", **extra}
    env.pop("AXONDIST_BACKEND", None)
    return env


@pytest.mark.mpi
def test_straggler_under_mpiexec_3(tmp_path: Path) -> None:
    why = _why_no_mpiexec()
    if why:
        pytest.skip(why)
    proc = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable, __file__], cwd=REPO,
                          env=_environment(AXONDIST_TRACE=str(tmp_path)), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_report(str(tmp_path), 3)
    cli = subprocess.run([sys.executable, "-m", "axondist", "trace", str(tmp_path), "--no-png"],
                         cwd=REPO, env=_environment(), capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "rank 2 kept the others waiting" in cli.stdout
    assert (tmp_path / "trace.json").exists()


_CRASHING_JOB = """
import os, time, numpy as np, axondist as ad
def job(world):
    x = np.ones(16, np.float32)
    for _ in range(700):
        ad.all_reduce(x)
    ad.barrier()
    time.sleep(1.5)  # the writer's thread writes at least every second
    os._exit(3)  # no trace.stop, no atexit: what a crash leaves
ad.spawn(job, 2)
"""


def test_trace_of_a_crashed_run_is_readable(tmp_path: Path) -> None:
    if LAUNCHED:
        pytest.skip("runs its own mock world in a subprocess")
    proc = subprocess.run([sys.executable, "-c", _CRASHING_JOB], cwd=REPO,
                          env=_environment(AXONDIST_TRACE=str(tmp_path)), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 3, proc.stderr
    timeline = read_timeline(str(tmp_path))
    for trace in timeline.ranks.values():
        assert [(c.op, c.seq) for c in trace.calls] == (
            [("all_reduce", k) for k in range(1, 701)] + [("barrier", 701)])
    assert "no ping exchange recorded" in timeline.clock_note()


if __name__ == "__main__":  # one rank of `mpiexec -n K python THIS_FILE` (AXONDIST_TRACE set)
    straggler_job(ad.init(), None)
