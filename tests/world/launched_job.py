"""What the tests that launch a job (under mpiexec or torchrun) share: the job's outcome, a
run that kills the whole job on timeout, and the summary line of a launched pytest run."""

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
        return "\n".join(parts + [f"--- {self.launcher_name} ---\n{self.launcher[-chars:]}"])


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
