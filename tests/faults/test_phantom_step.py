"""A checkpoint root copied without its newest step folder: its checksum-valid ``latest``
names a step that is not on disk. The steps come from the disk (the pointer is a hint,
checked): ``steps()`` leaves the missing step out, a load without a step reads the newest
complete one, a load of the missing step names the steps there are, and ``keep_last`` never
removes a real step to keep the missing one. On the mock world, under ``mpiexec -n 2/3`` and
under ``torchrun --nproc-per-node 2``, each run a subprocess under its own timeout
(``faults.runner``).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import MISSING, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "phantom_step.py"
CASE = "copied_without_newest"
RUNS = [(CASE, "mock", 2), (CASE, "mock", 3), (CASE, "mpi", 2), (CASE, "mpi", 3),
        (CASE, "torch", 2)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


def _run(case: str, mode: str, n: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="axondist-phantom-") as root:
        out = run_case(SCRIPT, case, mode, n, {"AXONDIST_TEST_ROOT": root})
        left = sorted(os.listdir(root))
    return Outcome(out.returncode, out.seconds, f"{out.output}\nLEFT {left}", out.ended_at)


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run, share_torch=False)  # _run reads the folder after the run


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_a_pointer_naming_a_missing_step_is_checked_against_the_disk(case: str, mode: str,
                                                                     n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    tail = outcome.output[-6000:]
    assert outcome.returncode == 0, tail
    assert outcome.output.count(f"{case} OK") == n, tail
    said = (r"rank \d: CheckpointError: load_sharded_checkpoint: \S+ holds no checkpoint of "
            r"step 9; it holds steps \[1, 2\]")
    assert len(re.findall(said, outcome.output)) == n, tail  # every rank names them
    assert "LEFT ['latest', 'step-00000001', 'step-00000002', 'step-00000003']" in tail, tail
