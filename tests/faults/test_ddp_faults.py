"""A DDP gradient of object dtype ends the job with an axondist error naming the parameter
and the dtype, on the mock world, under ``mpiexec -n 2/3`` and under ``torchrun
--nproc-per-node 2/3`` (the torch backend): when every rank has one
(each refuses it before communicating) and when only the last rank has one (the others,
waiting in the step's all-reduce, are ended by that rank's failure, not by a hang). A rank
that leaves before DDP's or FSDP's gradient sync is named by the others, also where the
bucket or the packed gradients lie in memory both ranks map (``mpiexec -n 2``).
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
#: A rank leaving before DDP's or FSDP's sync: the others' text.
LEAVING = {"last_rank_leaves_before_the_sync": (r"all_reduce #3 on world .*rank \d .*left after "
                                                r"broadcast #2 on world \(dtype=float32, "
                                                r"shape=\[262144\], root=0\)"),
           "last_rank_leaves_before_fsdps_sync": (r"reduce_scatter #4 on world .*rank \d .*left "
                                                  r"after (wait )?all_gather #3 on world")}
RUNS = [(case, mode, n) for case in (*EXPECT, *LEAVING) for mode in ("mock", "mpi", "torch")
        for n in (2, 3)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="starts its own jobs")


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    """Every run, started together the first time a test asks."""
    return start_all(RUNS, functools.partial(run_case, SCRIPT))


def _failed_naming(case: str, mode: str, n: int, pattern: str) -> str:
    """The run's output, once it failed in time printing ``pattern``."""
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    output = outcome.output
    assert outcome.returncode != 0, f"{case} on {mode} -n {n} succeeded:\n{output[-3000:]}"
    assert not output.startswith("HUNG"), output[-3000:]
    assert outcome.fault_seconds < LIMIT, (
        f"{case} on {mode} -n {n} took {outcome.fault_seconds:.1f} s")
    assert re.search(pattern, output), (
        f"{case} on {mode} -n {n}: no named error:\n{output[-3000:]}")
    return output


@pytest.mark.parametrize("case,mode,n", [r for r in RUNS if r[0] in EXPECT])
def test_an_object_gradient_ends_the_job_with_a_named_error(case: str, mode: str,
                                                            n: int) -> None:
    output = _failed_naming(case, mode, n, EXPECT[case])
    assert "TypeError: unsupported operand" not in output, output[-3000:]


@pytest.mark.parametrize("case,mode,n", [r for r in RUNS if r[0] in LEAVING])
def test_a_rank_leaving_before_the_sync_is_named_by_the_others(case: str, mode: str,
                                                               n: int) -> None:
    output = _failed_naming(case, mode, n, LEAVING[case])
    if (mode, n) == ("mpi", 2):
        assert "memory=shared" in output, output[-3000:]  # the shared call was the one waiting
