"""Correct torch jobs end with status 0, every time: 50 jobs of two small scripts
(``scripts/exit_cases.py``) on 2 ranks, each rank of each job exiting through the
interpreter's own finalization. No rank may die of SIGABRT after its script ended
("terminate called without an active exception": torch's threads still inside gloo as the
interpreter finalizes), nor be ended at exit because its peer's last message was still
landing (the peer's watchdog naming it "left", or the peer naming its send unreceived).

What needs many runs is the exit (it failed 1-3 times in 12), not the import of torch: each
``torchrun --nproc-per-node 2`` launch runs :data:`ROUNDS` jobs one after another, the
first ones in processes its ranks fork before touching torch.distributed and the last in the
ranks themselves (see ``exit_cases.rounds``); :data:`LAUNCHES` launches run side by side.
Each launch runs under its own limit.
"""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import HARD_LIMIT, MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_cases.py"
LAUNCHES = 2
ROUNDS = 25  # per launch: LAUNCHES * ROUNDS jobs, the two cases in turn
RUNS = [("rounds", "torch", 2, k) for k in range(LAUNCHES)]
CASES = ("one_all_reduce", "threads_and_groups")

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own jobs")


def _run(case: str, mode: str, n: int, launch: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="axondist-exit-") as ports:
        return run_case(SCRIPT, case, mode, n, extra_args=(str(ROUNDS), ports),
                        hard_limit=HARD_LIMIT + 10 * ROUNDS)


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run, parallel=LAUNCHES, share_torch=False)  # its own rounds


def test_every_launch_of_a_correct_job_exits_cleanly() -> None:
    if MISSING["torch"]() is not None:
        pytest.skip(MISSING["torch"]() or "")
    failed = []
    for run, future in _outcomes().items():
        n, launch = run[2], run[3]
        outcome = future.result()
        counts = {case: outcome.output.count(f"{case} OK") for case in CASES}
        wanted = {case: n * len(range(k, ROUNDS, len(CASES))) for k, case in enumerate(CASES)}
        rounds_failed = re.findall(r"round \d+ \(\w+\) of rank \d: exit status -?\d+",
                                   outcome.output)
        if (outcome.returncode != 0 or counts != wanted or rounds_failed
                or outcome.output.count("rounds OK") != n or "terminate called" in outcome.output):
            failed.append(f"launch {launch}: status {outcome.returncode}, {counts} of {wanted} "
                          f"jobs said OK, {rounds_failed}\n{outcome.output[-3000:]}")
    assert not failed, (f"{len(failed)} of {LAUNCHES} launches ({ROUNDS} jobs each) failed:\n"
                        + "\n".join(failed))
