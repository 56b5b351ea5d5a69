"""A rank that never starts a bucket's persistent all-reduce is named, on the mock world and
under ``mpiexec -n 2/3``.

Runs ``scripts/fault_cases.py ddp_overlapped_stall`` (OVERLAPPED DDP; after one good step,
rank 1 stops in its own code before its first bucket) in subprocesses, each under its own
``timeout`` with ``AXONDIST_TIMEOUT=10``, and checks that the job ends non-zero with a
message naming the call the others wait in and rank 1 as the one missing.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from axondist.launch import launched_by_mpi

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "fault_cases.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
HARD_LIMIT = 90.0  # the subprocess timeout: past it, a hang
ENV = {"AXONDIST_TIMEOUT": "10", "PYTHONPATH": str(REPO),
       "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
       "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}
CASE = "ddp_overlapped_stall"
EXPECT = {
    "mpi": (r"wait all_reduce #\d+ on world timed out on rank \d of \d after 1\d\.\d s "
            r"\(AXONDIST_TIMEOUT=10 s\).*missing ranks: \[1\].*rank 1 \(host .*\) is not in any "
            r"axondist call"),
    "mock": (r"all_reduce #\d+ on world .*ranks \[1\] of \d did not join within 10 s; rank 1 "
             r".* is not in any axondist call"),
}
RUNS = [(mode, n) for mode in ("mock", "mpi") for n in (2, 3)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="starts its own jobs")


def _run(mode: str, n: int) -> tuple[int, str]:
    command = [sys.executable, str(SCRIPT), CASE, mode]
    command = [str(MPIEXEC), "-n", str(n), *command] if mode == "mpi" else [*command, str(n)]
    try:
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                              text=True, timeout=HARD_LIMIT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return -999, f"HUNG: killed after {HARD_LIMIT:g} s\n{exc.stdout}{exc.stderr}"
    return proc.returncode, proc.stdout + proc.stderr


@functools.cache
def _outcomes() -> dict[tuple[str, int], concurrent.futures.Future]:
    """Every run, started together the first time a test asks (they mostly wait)."""
    pool = concurrent.futures.ThreadPoolExecutor(len(RUNS))
    return {run: pool.submit(_run, *run) for run in RUNS}


@pytest.mark.parametrize("mode,n", RUNS)
def test_a_rank_that_never_starts_a_bucket_is_named(mode: str, n: int) -> None:
    if mode == "mpi":
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            pytest.skip("mpi4py is not installed")
        if not MPIEXEC.exists():
            pytest.skip(f"no mpiexec next to the Python interpreter ({MPIEXEC})")
    code, output = _outcomes()[(mode, n)].result()
    assert code != 0, f"{CASE} on {mode} -n {n} succeeded:\n{output[-3000:]}"
    assert not output.startswith("HUNG"), output[-3000:]
    assert re.search(EXPECT[mode], output, re.S), (
        f"{CASE} on {mode} -n {n}: the message does not name rank 1:\n{output[-3000:]}")
