"""A rank that strays inside ``jax.jit(jax.grad(f))`` (another collective, another shape)
is caught by the cross-rank check on the mock world and under ``mpiexec -n 2``: the job ends
non-zero within the fault limit with the mismatch named, never a hang. One jitted function
shared by every rank works under mpiexec and is refused, with what to do, where the ranks
are threads. Each run is a subprocess under its own timeout (``faults.runner``)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import LIMIT, MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "jit_cases.py"
SAID = {
    "different_collective": r"CollectiveMismatchError: \w+: ranks called different "
                            r"collectives at the same point \(rank 0 called all_reduce, rank 1 "
                            r"called allgather_object",
    "different_shape": r"CollectiveMismatchError: all_reduce: ranks disagree on shape "
                       r"\(rank 0: \(4,\), rank 1: \(8,\)",
}
RUNS = [(case, mode, n) for case in (*SAID, "agree") for mode, n in
        (("mock", 2), ("mock", 3), ("mpi", 2))] + [("shared_jit", "mock", 2),
                                                   ("shared_jit", "mpi", 2)]
#: One jitted function shared by ranks that are threads: the trace of one runs on another.
SHARED_ON_THREADS = (r"CollectiveMismatchError: all_reduce inside jax.jit: the jitted function "
                     r"was traced on rank \d and now runs on rank \d; ranks that are threads "
                     r"of one process \(axondist.spawn\) share JAX's trace cache, so make the "
                     r"jitted function inside each rank's function")

pytestmark = [pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs"),
              pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="JAX is not installed")]


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, run_case_of_script)


def run_case_of_script(case: str, mode: str, n: int) -> Outcome:
    return run_case(SCRIPT, case, mode, n)


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_a_rank_that_strays_inside_jit_is_named_and_nothing_hangs(case: str, mode: str,
                                                                  n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    tail = outcome.output[-6000:]
    assert outcome.returncode != -999, tail
    if case == "agree" or (case == "shared_jit" and mode != "mock"):
        assert outcome.returncode == 0, tail
        assert outcome.output.count(" OK rank") == n, tail
        return
    assert outcome.returncode != 0, tail
    assert outcome.fault_seconds < LIMIT, tail
    assert re.search(SAID.get(case, SHARED_ON_THREADS), outcome.output), tail
    assert "OK rank" not in outcome.output, tail
