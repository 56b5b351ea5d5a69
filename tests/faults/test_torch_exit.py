"""Correct torch jobs end with status 0, every time: 50 launches of two small scripts
(``scripts/exit_cases.py``) under ``torchrun --nproc-per-node 2``, a few at a time, each
under its own limit. No rank may die of SIGABRT after its script ended ("terminate called
without an active exception": torch's threads still inside gloo as the interpreter
finalizes), nor be ended at exit because its peer's last message was still landing (the
peer's watchdog naming it "left", or the peer naming its send unreceived).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_cases.py"
LAUNCHES = 50
RUNS = [(("one_all_reduce", "threads_and_groups")[k % 2], "torch", 2, k)
        for k in range(LAUNCHES)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own jobs")


def _run(case: str, mode: str, n: int, launch: int) -> Outcome:
    return run_case(SCRIPT, case, mode, n)


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run, parallel=4)


def test_every_launch_of_a_correct_job_exits_cleanly() -> None:
    if MISSING["torch"]() is not None:
        pytest.skip(MISSING["torch"]() or "")
    failed = []
    for run, future in _outcomes().items():
        case, _, n, launch = run
        outcome = future.result()
        if (outcome.returncode != 0 or outcome.output.count(f"{case} OK") != n
                or "terminate called" in outcome.output):
            failed.append(f"launch {launch} ({case}): status {outcome.returncode}\n"
                          f"{outcome.output[-3000:]}")
    assert not failed, f"{len(failed)} of {LAUNCHES} launches failed:\n" + "\n".join(failed[:3])
