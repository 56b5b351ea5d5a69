"""Launch the world tests under torchrun (the torch backend), and check what only a real
torch.distributed job shows.

Plain pytest (one process) runs these tests; each starts ``python -m torch.distributed.run
--standalone --nproc-per-node K`` in a subprocess, with every rank's output in its own file
(torchrun's ``--log-dir``), and checks them all. Skipped inside a launched job (no
recursion) and when torch is missing.
The torch backend's own arrangements are a world test too (test_torch_backend.py): the
world runs here run them.

Environment: ``AXONDIST_TORCH_TEST_EXAMPLES`` (hypothesis examples in the launched world
tests, default 5).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
from launched_job import WORLD_RUN_SIZES, Launch, check_world_run, run_job, world_run_args
from rank_pytest import REPORT_DIR_VARIABLE

REPO = Path(__file__).resolve().parents[2]
#: The per-rank program of launched pytest runs (failures printed at once, the job ended).
RANK_PYTEST = Path(__file__).with_name("rank_pytest.py")
LAUNCH_TIMEOUT = 600.0


def _launched() -> bool:
    from axondist._environment import env_launch_size, launched_by_mpi

    return launched_by_mpi() or env_launch_size() is not None


pytestmark = [
    pytest.mark.skipif(_launched(), reason="already one rank of a launched job: the launcher "
                                           "does not recurse"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch is not installed (pip install '.[torch]')"),
]


def launch(tmp_path: Path, n: int, args: list[str], env: dict[str, str] | None = None,
           timeout: float = LAUNCH_TIMEOUT) -> Launch:
    """``torchrun --standalone --nproc-per-node n ARGS`` from the repository root; kill it all
    on timeout."""
    logs = tmp_path / f"n{n}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(n), "--log-dir", str(logs), "--redirects", "3", *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "AXONDIST_TIMEOUT": "30", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": path, **(env or {})}
    full_env.pop("AXONDIST_BACKEND", None)
    return run_job(command, full_env, lambda: [_rank_output(logs, r) for r in range(n)],
                   timeout, f"torchrun -n {n} {' '.join(args)}", "torchrun")


def _rank_output(logs: Path, rank: int) -> str:
    """Rank ``rank``'s stdout, then its stderr (torchrun's ``LOGDIR/RUN/attempt_0/RANK/``)."""
    return "".join(path.read_text(errors="replace")
                   for name in ("stdout.log", "stderr.log")
                   for path in sorted(logs.glob(f"*/attempt_*/{rank}/{name}")))


@pytest.mark.parametrize("n", WORLD_RUN_SIZES)
def test_world_tests_pass_under_torchrun(tmp_path: Path, n: int) -> None:
    """Every world test (collectives, groups, DDP, FSDP, ZeRO, pipeline, tensor parallel,
    checkpoints) on the torch backend at two ranks; at three, the tests a third rank adds to
    (tests/tiers.py's three_ranks). One job each: torch is imported once per rank."""
    args = [str(RANK_PYTEST), *world_run_args(n)]
    examples = os.environ.get("AXONDIST_TORCH_TEST_EXAMPLES", "5")
    temp = tmp_path / "temp"  # the ranks' system temp folder: left empty
    reports = tmp_path / "reports"  # each rank's JUnit report
    temp.mkdir()
    reports.mkdir()
    run = launch(tmp_path, n, args, {"AXONDIST_TEST_EXAMPLES": examples, "TMPDIR": str(temp),
                                     REPORT_DIR_VARIABLE: str(reports)})
    check_world_run(run, "torchrun", n, temp, reports)
