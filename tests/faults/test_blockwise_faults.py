"""Every mismatch of ``scripts/blockwise_cases.py`` (all_gather without ``sizes=``; all_gather
and broadcast past the size that rides with the check) on the mock world and under
``mpiexec -n 2/3``.

Each run is a subprocess under its own ``timeout`` (a hang fails the test instead of
freezing the suite) with ``AXONDIST_TIMEOUT=10``; a case that must fail must end
non-zero within 30 s with the message given for it, which names the operation and
what the ranks disagree on. The runs start together, a few at a time, when the
module's tests first ask for them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axondist.launch import launched_by_mpi

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "blockwise_cases.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LIMIT = 30.0  # seconds a failing case may take, with AXONDIST_TIMEOUT=10
HARD_LIMIT = 90.0  # the subprocess timeout: past it, a hang
PARALLEL = int(os.environ.get("AXONDIST_FAULT_PARALLEL", "6"))
ENV = {"AXONDIST_TIMEOUT": "10", "PYTHONPATH": str(REPO),
       # waiting MPICH ranks yield their core (the machines running this are small)
       "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
       "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}

_DTYPE = r"all_gather: ranks disagree on dtype \(rank 0: float32, .*rank \d: float64\)"
#: case -> (the message under MPI, the message on the mock world); None: must succeed.
CASES: dict[str, tuple[str, str] | None] = {
    "rows_dtype": (_DTYPE, _DTYPE),
    "rows_trailing": (r"all_gather: ranks disagree on trailing shape \(rank 0: \[3\], .*"
                      r"rank \d: \[2, 2\]\)",
                      r"all_gather: ranks disagree on trailing shape \(rank 0: \(3,\), .*"
                      r"rank \d: \(2, 2\)\)"),
    "rows_big_dtype": (r"all_gather: ranks disagree on dtype \(rank 0: float64, .*rank \d: "
                       r"float32\)",
                       r"all_gather: ranks disagree on dtype \(rank 0: float64, .*rank \d: "
                       r"float32\)"),
    # the mock world exchanges the counts as an int64 all-gather of its own
    "rows_vs_sizes": (r"all_gather: ranks disagree on counts \(rank 0: \[6, 6(, 6)?\], "
                      r"rank 1: not given",
                      r"all_gather: ranks disagree on dtype \(rank 0: float64, rank 1: int64"),
    "rows_vs_broadcast": (r"ranks called different collectives at the same point \(rank 0 "
                          r"called all_gather, rank 1 called broadcast",
                          r"ranks called different collectives at the same point \(rank 0 "
                          r"called all_gather, rank 1 called broadcast"),
    "rows_mismatch_caught_then_good": None,
    "big_sizes_mismatch": (r"all_gather: ranks disagree on counts \(rank 0: \[9001, 9000",
                           r"all_gather: ranks disagree on counts \(rank 0: \(9001, 9000"),
    "big_src_mismatch": (r"broadcast: ranks disagree on root \(rank 0: 0, rank 1: 1",
                         r"broadcast: ranks disagree on root \(rank 0: 0, rank 1: 1"),
    "big_gather_vs_broadcast": (r"ranks called different collectives .*rank 0 called all_gather, "
                                r"rank 1 called broadcast",
                                r"ranks called different collectives .*rank 0 called all_gather, "
                                r"rank 1 called broadcast"),
    "big_mismatch_caught_then_good": None,
}
RUNS = [(case, mode, n) for case in CASES for mode in ("mock", "mpi") for n in (2, 3)]


def _why_no_mpi() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'axondist[mpi]')"
    if not MPIEXEC.exists():
        return f"no mpiexec next to the Python interpreter ({MPIEXEC})"
    return None


def _run(case: str, mode: str, n: int) -> tuple[int, float, str]:
    command = [sys.executable, str(SCRIPT), case, mode]
    command = [str(MPIEXEC), "-n", str(n), *command] if mode == "mpi" else [*command, str(n)]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                              text=True, timeout=HARD_LIMIT, stdin=subprocess.DEVNULL)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = -999, f"HUNG: killed after {HARD_LIMIT:g} s\n{exc.stdout}{exc.stderr}"
    return code, time.monotonic() - start, output


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    runs = [r for r in RUNS if r[1] == "mock" or _why_no_mpi() is None]
    pool = concurrent.futures.ThreadPoolExecutor(PARALLEL)
    return {run: pool.submit(_run, *run) for run in runs}


pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_blockwise_mismatch(case: str, mode: str, n: int) -> None:
    if mode == "mpi" and _why_no_mpi() is not None:
        pytest.skip(_why_no_mpi() or "")
    code, seconds, output = _outcomes()[(case, mode, n)].result()
    tail = output[-6000:]
    expect = CASES[case]
    if expect is None:
        assert code == 0, f"{case} must succeed, ended with {code}:\n{tail}"
        assert output.count(f"{case} OK") == n, tail
        return
    assert code not in (0, -999), f"{case} must fail, ended with {code}:\n{tail}"
    assert seconds < LIMIT, f"{case} took {seconds:.1f} s:\n{tail}"
    pattern = expect[0] if mode == "mpi" else expect[1]
    assert re.search(pattern, output, re.S), f"no match for {pattern!r} in:\n{tail}"
