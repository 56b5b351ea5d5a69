"""What the tests that launch a job (under mpiexec or torchrun) share: the job's outcome, a
run that kills the whole job on timeout, the summary line of a launched pytest run, and the
world runs (what each launcher reruns of tests/world, and what it must show)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Launch:
    """What a launched job left: exit code, seconds, each rank's output, the launcher's own."""

    returncode: int
    seconds: float
    ranks: list[str]
    launcher: str
    launcher_name: str = "launcher"
    timed_out: bool = False
    """The job ran past its limit and was killed."""

    def tail(self, chars: int = 3000) -> str:
        parts = [f"--- rank {r} ---\n{text[-chars:]}" for r, text in enumerate(self.ranks)]
        ended = f"exit status {self.returncode} after {self.seconds:.1f} s"
        return "\n".join(parts + [f"--- {self.launcher_name} ({ended}) ---\n"
                                   f"{self.launcher[-chars:]}"])


def run_job(command: list[str], env: dict[str, str], rank_outputs: Callable[[], list[str]],
            timeout: float, what: str, launcher_name: str) -> Launch:
    """Run the launcher ``command`` from the repository root in a session of its own, and
    kill that session (the launcher and every rank) on timeout, failing the test; then
    ``rank_outputs()`` reads each rank's output. ``what`` names the launch in messages,
    ``launcher_name`` the launcher in :meth:`Launch.tail`."""
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        launcher, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        launcher, _ = proc.communicate()
        timed_out = True
    result = Launch(proc.returncode, time.monotonic() - start, rank_outputs(), launcher or "",
                    launcher_name, timed_out)
    if timed_out:
        pytest.fail(f"{what} did not finish within {timeout:g} s (killed)\n{result.tail()}")
    return result


def pytest_summary(text: str) -> str | None:
    """The final ``N passed, M skipped in 1.2s`` line of a ``pytest -q`` run."""
    lines = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped).* in [\d.]+s.*?)=*$",
                       text, re.MULTILINE)
    return lines[-1] if lines else None


#: The launchers' world runs: every world test at the first size, at the second only the
#: tests a third rank adds to (tests/tiers.py's three_ranks).
WORLD_RUN_SIZES = (2, 3)


def world_run_args(ranks: int) -> list[str]:
    """The per-rank pytest arguments of a world run at ``ranks`` ranks. The three-rank run
    collects only the files that hold a three-rank test (each rank imports less)."""
    import tiers  # on pytest's path (tests/): test_mpi_launch.py also runs as a rank's script

    common = ["-q", "-p", "no:cacheprovider", "-x"]
    if ranks == WORLD_RUN_SIZES[0]:
        return ["tests/world", *common, "-m", "not gpu"]
    return [*tiers.three_rank_files(), *common, "-m", "three_ranks and not gpu"]


def passed_tests(report: Path) -> set[str]:
    """The ids of the tests that passed (neither skipped nor failed) in a JUnit report."""
    import xml.etree.ElementTree as ElementTree

    passed = set()
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        if any(child.tag in ("skipped", "failure", "error") for child in case):
            continue
        parts = case.get("classname", "").split(".")
        path = (f"{'/'.join(parts[:-1])}.py::{parts[-1]}" if parts[-1].startswith("Test")
                else f"{'/'.join(parts)}.py")
        passed.add(f"{path}::{case.get('name')}")
    return passed


def check_world_run(run: Launch, launcher: str, ranks: int, temp: Path, reports: Path) -> None:
    """A world run passed on every rank, every rank ran the same tests, each world test the
    coverage table names for this launcher and size passed on every rank, and no rank left
    its temporary folder in ``temp`` (the ranks' system temp folder)."""
    summaries = [pytest_summary(text) for text in run.ranks]
    for r, summary in enumerate(summaries):
        assert summary is not None, f"rank {r} printed no pytest summary\n{run.tail()}"
        assert "passed" in summary and "failed" not in summary and "error" not in summary, (
            f"rank {r}: {summary}\n{run.tail()}")
    assert run.returncode == 0, f"{launcher} exited with {run.returncode}\n{run.tail()}"
    counts = {re.sub(r" in [\d.]+s.*", "", s or "") for s in summaries}
    assert len(counts) == 1, f"ranks ran different tests: {summaries}"
    import coverage_table  # on pytest's path (tests/), as tiers above

    named = coverage_table.launched_world_cells(launcher, ranks)
    for r in range(ranks):
        passed = passed_tests(reports / f"rank{r}.xml")
        missing = sorted(test for test in named if not _covers(passed, test))
        assert not missing, (f"rank {r}: tests/coverage_table.py names for {launcher} at "
                             f"{ranks} ranks tests that did not pass here: {missing}")
    assert not list(temp.glob("axondist-rank*")), "a rank left its temporary folder behind"


def _covers(passed: set[str], test: str) -> bool:
    return test in passed or any(p.startswith(f"{test}[") for p in passed)
