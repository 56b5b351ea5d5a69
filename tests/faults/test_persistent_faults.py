"""A rank that never starts a bucket's persistent all-reduce is named, on the mock world,
under ``mpiexec -n 2/3`` and under ``torchrun --nproc-per-node 2/3`` (the torch backend,
whose watchdog is MPI's).

Runs ``scripts/fault_cases.py ddp_overlapped_stall`` (OVERLAPPED DDP; after one good step,
rank 1 stops in its own code before its first bucket) in subprocesses, each under its own
``timeout`` with ``AXONDIST_TIMEOUT=5`` (the case waits that out), and checks that the job
ends non-zero with a message naming the call the others wait in and rank 1 as the one missing.
In a checked MPI group of two on one host each bucket is a blocking mean rather than a
persistent request (``ddp/pieces.py``: ``_means_in_one_pass``), so there the call named is the
blocking ``all_reduce`` itself rather than the ``wait`` of its request.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import MISSING, SHORT_TIMEOUT, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fault_cases.py"
CASE = "ddp_overlapped_stall"
#: The seconds the timed-out call says it waited: the timeout, or up to 10 s more under load.
WAITED = rf"({'|'.join(map(str, range(SHORT_TIMEOUT, 10)))}|1\d)\.\d"
EXPECT = {
    "mpi": (rf"(wait )?all_reduce #\d+ on world( \([^)]*\))? timed out on rank \d of \d "
            rf"after {WAITED} s "
            rf"\(AXONDIST_TIMEOUT={SHORT_TIMEOUT} s\).*missing ranks: \[1\].*rank 1 \(host .*\) "
            r"is not in any axondist call"),
    "mock": (rf"all_reduce #\d+ on world .*ranks \[1\] of \d did not join within "
             rf"{SHORT_TIMEOUT} s; rank 1 .* is not in any axondist call"),
}
EXPECT["torch"] = EXPECT["mpi"]
RUNS = [(mode, n) for mode in ("mock", "mpi", "torch") for n in (2, 3)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="starts its own jobs")


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    """Every run, started together the first time a test asks (they mostly wait)."""
    run = functools.partial(run_case, SCRIPT, env={"AXONDIST_TIMEOUT": str(SHORT_TIMEOUT)})
    return start_all([(CASE, mode, n) for mode, n in RUNS], run, len(RUNS))


@pytest.mark.parametrize("mode,n", RUNS)
def test_a_rank_that_never_starts_a_bucket_is_named(mode: str, n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(CASE, mode, n)].result()
    code, output = outcome.returncode, outcome.output
    assert code != 0, f"{CASE} on {mode} -n {n} succeeded:\n{output[-3000:]}"
    assert not output.startswith("HUNG"), output[-3000:]
    assert re.search(EXPECT[mode], output, re.S), (
        f"{CASE} on {mode} -n {n}: the message does not name rank 1:\n{output[-3000:]}")
