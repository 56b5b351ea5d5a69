"""A DDP gradient of object dtype ends the job with an axondist error naming the parameter
and the dtype, on the mock world, under ``mpiexec -n 2/3`` and under ``torchrun
--nproc-per-node 2/3`` (the torch backend): when every rank has one
(each refuses it before communicating) and when only the last rank has one (the others,
waiting in the step's all-reduce, are ended by that rank's failure, not by a hang).
Each run is a subprocess under its own timeout with ``AXONDIST_TIMEOUT=10``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import LIMIT, MISSING, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_cases.py"
EXPECT = {
    "object_grad_every_rank": (r"UnsupportedDTypeError: DistributedDataParallel.sync_gradients: "
                               r"the gradient of parameter 1 \(w1\) has dtype object; a gradient "
                               r"must be an array of real numbers"),
    "object_grad_one_rank": (r"UnsupportedDTypeError: DistributedDataParallel.add_gradient: the "
                             r"gradient of parameter 1 \(w1\) has dtype object; a gradient must "
                             r"be an array of real numbers"),
}
RUNS = [(case, mode, n) for case in EXPECT for mode in ("mock", "mpi", "torch") for n in (2, 3)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="starts its own jobs")


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    """Every run, started together the first time a test asks."""
    return start_all(RUNS, functools.partial(run_case, SCRIPT))


@pytest.mark.parametrize("case,mode,n", RUNS)
def test_an_object_gradient_ends_the_job_with_a_named_error(case: str, mode: str,
                                                            n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    output = outcome.output
    assert outcome.returncode != 0, f"{case} on {mode} -n {n} succeeded:\n{output[-3000:]}"
    assert not output.startswith("HUNG"), output[-3000:]
    assert outcome.fault_seconds < LIMIT, (
        f"{case} on {mode} -n {n} took {outcome.fault_seconds:.1f} s")
    assert re.search(EXPECT[case], output), (
        f"{case} on {mode} -n {n}: no named error:\n{output[-3000:]}")
    assert "TypeError: unsupported operand" not in output, output[-3000:]
