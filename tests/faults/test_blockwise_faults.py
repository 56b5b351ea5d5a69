"""Every mismatch of ``scripts/blockwise_cases.py`` (all_gather without ``sizes=``; all_gather
and broadcast past the size that rides with the check) on the mock world, under
``mpiexec -n 2/3`` and under ``torchrun --nproc-per-node 2`` (the torch backend, whose
checks are MPI's).

Each run is a subprocess under its own ``timeout`` (a hang fails the test instead of
freezing the suite) with ``AXONDIST_TIMEOUT=10``; a case that must fail must end
non-zero within 30 s with the message given for it, which names the operation and
what the ranks disagree on. The runs start together, a few at a time, when the
module's tests first ask for them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import LIMIT, MISSING, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "blockwise_cases.py"

_DTYPE = r"all_gather: ranks disagree on dtype \(rank 0: float32, .*rank \d: float64\)"
#: case -> (the message under MPI, the message on the mock world); None: must succeed.
CASES: dict[str, tuple[str, str] | None] = {
    "rows_dtype": (_DTYPE, _DTYPE),
    "rows_trailing": (r"all_gather: ranks disagree on trailing shape \(rank 0: \(3,\), .*"
                      r"rank \d: \(2, 2\)\)",) * 2,
    "rows_big_dtype": (r"all_gather: ranks disagree on dtype \(rank 0: float64, .*rank \d: "
                       r"float32\)",
                       r"all_gather: ranks disagree on dtype \(rank 0: float64, .*rank \d: "
                       r"float32\)"),
    "rows_vs_sizes": (r"all_gather: ranks disagree on counts \(rank 0: \[2, 2(, 2)?\], "
                      r"rank 1: not given",) * 2,
    "rows_vs_broadcast": (r"ranks called different collectives at the same point \(rank 0 "
                          r"called all_gather, rank 1 called broadcast",
                          r"ranks called different collectives at the same point \(rank 0 "
                          r"called all_gather, rank 1 called broadcast"),
    "rows_mismatch_caught_then_good": None,
    "big_sizes_mismatch": (r"all_gather: ranks disagree on counts \(rank 0: \[9001, 9000",) * 2,
    "big_src_mismatch": (r"broadcast: ranks disagree on root \(rank 0: 0, rank 1: 1",
                         r"broadcast: ranks disagree on root \(rank 0: 0, rank 1: 1"),
    "big_gather_vs_broadcast": (r"ranks called different collectives .*rank 0 called all_gather, "
                                r"rank 1 called broadcast",
                                r"ranks called different collectives .*rank 0 called all_gather, "
                                r"rank 1 called broadcast"),
    "big_mismatch_caught_then_good": None,
    "ride_vs_exchange_caught_then_good": None,
}
#: Where the torch backend says it differently: it exchanges the row counts as a checked int64
#: all-gather of its own (MPI's counts ride with the check, the mock world's round compares the
#: caller's call).
TORCH = {"rows_vs_sizes": r"all_gather: ranks disagree on dtype \(rank 0: float64, rank 1: int64"}
RUNS = ([(case, mode, n) for case in CASES for mode in ("mock", "mpi") for n in (2, 3)]
        + [(case, "torch", 2) for case in CASES])


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    return start_all(RUNS, functools.partial(run_case, SCRIPT))


pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_blockwise_mismatch(case: str, mode: str, n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    code, output = outcome.returncode, outcome.output
    tail = output[-6000:]
    expect = CASES[case]
    if expect is None:
        assert code == 0, f"{case} must succeed, ended with {code}:\n{tail}"
        assert output.count(f"{case} OK") == n, tail
        return
    assert code not in (0, -999), f"{case} must fail, ended with {code}:\n{tail}"
    assert outcome.fault_seconds < LIMIT, f"{case} took {outcome.fault_seconds:.1f} s:\n{tail}"
    pattern = TORCH[case] if mode == "torch" and case in TORCH else expect[mode == "mock"]
    assert re.search(pattern, output, re.S), f"no match for {pattern!r} in:\n{tail}"
