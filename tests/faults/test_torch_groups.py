"""Groups on the torch backend under ``torchrun --nproc-per-node 2``: a leak ends at the
backend's own limit with ``TooManyGroupsError`` naming what a torch group holds (not MPI's
communicators), and a group costs only gloo's own threads (two workers and a socket loop),
none of axondist's once its calls were issued. Each run is a subprocess under its own
timeout (``faults.runner``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from axondist.backends.torch.backend import MAX_GROUPS
from axondist.launching.worlds import launched_by_mpi
from faults.runner import MISSING, Outcome, run_case, start_all

HERE = Path(__file__).resolve().parent / "scripts"
GLOO_THREADS = 3  # per gloo process group: two workers and the socket loop of its device
RUNS = [("leak", "torch", 2), ("threads_per_group", "torch", 2)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own jobs")


def _run(case: str, mode: str, n: int) -> Outcome:
    script = HERE / ("group_cases.py" if case == "leak" else "torch_group_cases.py")
    return run_case(script, case, mode, n, {"AXONDIST_TEST_GROUPS": str(MAX_GROUPS + 50)})


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, _run)


def _outcome(case: str) -> Outcome:
    if MISSING["torch"]() is not None:
        pytest.skip(MISSING["torch"]() or "")
    return _outcomes()[(case, "torch", 2)].result()


def test_a_group_leak_ends_at_the_torch_backends_limit_naming_its_resource() -> None:
    outcome = _outcome("leak")
    tail = outcome.output[-6000:]
    assert outcome.returncode not in (0, -999), tail
    assert "none refused" not in outcome.output, tail
    said = (rf"new_group: cannot make another group: {MAX_GROUPS} groups made by new_group "
            rf"are alive on this rank and the torch backend allows at most {MAX_GROUPS} \(on "
            r"the torch backend each group holds a gloo process group: three threads and a "
            r"connection to every other member\)\. Free the groups you no longer need: "
            r"group\.destroy\(\)")
    assert re.search(said, outcome.output), f"no match for {said!r} in:\n{tail}"
    assert "communicator" not in outcome.output, tail


def test_a_group_costs_gloos_threads_and_none_of_ours() -> None:
    outcome = _outcome("threads_per_group")
    tail = outcome.output[-6000:]
    assert outcome.returncode == 0, tail
    counts = re.findall(r"THREADS \d: (\d+) (\d+) (\d+)", outcome.output)
    assert len(counts) == 2, tail
    for before, after, groups in counts:
        assert int(after) - int(before) <= GLOO_THREADS * int(groups), (before, after, tail)
