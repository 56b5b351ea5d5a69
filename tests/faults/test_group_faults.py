"""Groups made and never destroyed: ``new_group`` refuses with an axondist error that says
how many groups are alive and how to free them, before the MPI library's own error, on the
mock world, under ``mpiexec -n 2`` and under ``torchrun --nproc-per-node 2``; a job that
catches it, destroys its groups and goes on works. Each run is a subprocess under its own
timeout (``faults.runner``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import LIMIT, MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "group_cases.py"
FREE = (r"Free the groups you no longer need: group.destroy\(\) \(every member calls it\), or "
        r"make them with `with world.new_group\(ranks\) as group:`")
CAP = 40  # AXONDIST_MAX_GROUPS for the capped runs

# (case, mode, ranks, AXONDIST_MAX_GROUPS or "" for MPICH's own limit)
RUNS = [("leak", "mock", 2, str(CAP)), ("leak", "mpi", 2, str(CAP)),
        ("leak_then_free", "mock", 2, str(CAP)), ("leak_then_free", "mpi", 2, ""),
        ("leak", "mpi", 2, ""), ("leak", "torch", 2, str(CAP)),
        ("leak_then_free", "torch", 2, str(CAP))]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


def _run(case: str, mode: str, n: int, cap: str) -> Outcome:
    return run_case(SCRIPT, case, mode, n, {"AXONDIST_MAX_GROUPS": cap})


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run)


def _said(cap: str, mode: str = "mpi") -> str:
    alive = str(CAP) if cap else r"10\d\d"  # MPICH: 2,048 communicators, two per group
    why = (rf"AXONDIST_MAX_GROUPS={CAP} allows no more" if cap else
           r"the MPI library has run out of communicators \(Too many communicators")
    holds = (r"on the torch backend each group holds a gloo process group" if mode == "torch"
             else r"on MPI each group holds two communicators")
    return (rf"new_group: cannot make another group: {alive} groups made by new_group are "
            rf"alive on this rank and {why}.*?{holds}.*?{FREE}")


@pytest.mark.parametrize("case,mode,n,cap", RUNS,
                         ids=[f"{c}-{m}{n}-{'cap' if k else 'mpich'}" for c, m, n, k in RUNS])
def test_new_group_refuses_with_the_live_count_and_the_fix(case: str, mode: str, n: int,
                                                           cap: str) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n, cap)].result()
    tail = outcome.output[-6000:]
    assert outcome.returncode != -999, tail
    assert "none refused" not in outcome.output, tail
    said = re.findall(_said(cap, mode), outcome.output)
    if case == "leak":  # uncaught: the job ends with it, and not with MPI's own error
        assert outcome.returncode not in (0, -999), tail
        assert said, f"no match for {_said(cap, mode)!r} in:\n{tail}"
        assert outcome.fault_seconds < LIMIT + (0 if cap else 30), tail  # MPICH's ~1,000 groups
        assert "MPI_Comm_split" not in outcome.output, tail
        return
    assert outcome.returncode == 0, tail
    assert len(said) == n, tail  # every rank caught it
    assert outcome.output.count("leak_then_free OK") == n, tail
