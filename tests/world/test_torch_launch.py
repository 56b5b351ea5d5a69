"""Launch the world tests under torchrun (the torch backend), and check what only a real
torch.distributed job shows.

Plain pytest (one process) runs these tests; each starts ``python -m torch.distributed.run
--standalone --nproc-per-node K`` in a subprocess, with every rank's output in its own file
(torchrun's ``--log-dir``), and checks them all. Skipped inside a launched job (no
recursion) and when torch is missing.

This file is also the per-rank program of the torch-only checks: ``torchrun
--nproc-per-node K tests/world/test_torch_launch.py CHECK`` runs ``CHECKS[CHECK]`` on every
rank, which prints ``CHECK OK``.

Environment: ``AXONDIST_TORCH_TEST_EXAMPLES`` (hypothesis examples in the launched world
tests, default 5).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("n", [2, 3])
def test_torch_backend_checks(tmp_path: Path, n: int) -> None:
    run = launch(tmp_path, n, [__file__, "backend"], timeout=300)
    assert run.returncode == 0, run.tail()
    for r, text in enumerate(run.ranks):
        assert "backend OK" in text, f"rank {r}\n{run.tail()}"


# --- the per-rank checks (run under torchrun by the tests above) ----------------------------

def _backend() -> None:
    """What the torch backend arranges for gloo, and where it refuses, on every rank."""
    import torch
    import torch.distributed as dist

    import axondist as ad

    world = ad.init()  # picked from torchrun's variables
    n, rank = world.world_size, world.rank
    assert world.backend.name == "torch" and n == dist.get_world_size()
    assert world.node_info() == (0, rank, n)  # torchrun --standalone: one host
    # uneven blocks (gloo moves equal ones): padded and unpadded again
    rows = [r + 1 for r in range(n)]
    xs = [np.full((rows[r], 3), r, np.float32) for r in range(n)]
    np.testing.assert_array_equal(ad.all_gather(xs[rank]), np.concatenate(xs))
    big = np.arange(2 * n + 1, dtype=np.float64) + rank
    want = np.array_split(sum(np.arange(2 * n + 1.0) + r for r in range(n)), n)[rank]
    np.testing.assert_array_equal(ad.reduce_scatter(big), want)
    gathered = ad.gather_tensor(xs[rank], dst=n - 1)
    assert (gathered is None) == (rank != n - 1)
    # a receive of the wrong size raises, drops the message, and the next one arrives
    backend = world.backend
    if rank == 0:
        backend.send(np.arange(4.0), 1, tag=5)
        backend.send(np.arange(3.0), 1, tag=5)
    elif rank == 1:
        with pytest.raises(ad.CollectiveMismatchError, match="the message has 32 bytes but "
                                                             "the buffer holds 24"):
            backend.recv(np.empty(3), 0, tag=5)
        again = np.empty(3)
        backend.recv(again, 0, tag=5)
        np.testing.assert_array_equal(again, np.arange(3.0))
    # torch.distributed multiplies no complex values: our message, not torch's
    with pytest.raises(ad.UnsupportedDTypeError, match="cannot multiply complex values"):
        ad.all_reduce(np.ones(2, np.complex64), "product")
    # the torch tensor a caller passes is the one reduced, in place
    t = torch.full((3,), float(rank + 1))
    assert ad.all_reduce(t) is t
    torch.testing.assert_close(t, torch.full((3,), n * (n + 1) / 2))
    ad.barrier()


CHECKS = {"backend": _backend}

if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # the checkout's axondist
    CHECKS[sys.argv[1]]()
    print(f"{sys.argv[1]} OK", flush=True)
