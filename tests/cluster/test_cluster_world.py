"""World tests and training on a 2-host x 2-rank simulated cluster (ranks 0, 1 on node0).

The same world tests as under ``mpiexec`` on one machine, the MPI backend's own checks,
HYBRID_SHARD training (node layout detected, no ``ranks_per_node``) equal to
single-process training, and a world test failing on one rank (a plain test, and a
hypothesis example) printing its traceback while the job ends promptly.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from cluster.simcluster import Launch, SimCluster

HERE = Path(__file__).resolve().parent
CHECKS = str(HERE / "rank_checks.py")
MPI_LAUNCH = str(HERE.parent / "world" / "test_mpi_launch.py")
RANK_PYTEST = str(HERE.parent / "world" / "rank_pytest.py")
FAILING_TESTS = "tests/cluster/world_test_that_fails.py"
SLOTS = [2, 2]


def _assert_all_ok(run_text: list[str], word: str, tail: str) -> None:
    for r, text in enumerate(run_text):
        assert f"{word} OK" in text, f"rank {r} did not finish {word}\n{tail}"


# test_ddp_persistent.py: OVERLAPPED DDP's progress helper is on by itself across hosts;
# test_overlap_pieces.py: its persistent rings and early-starting pieces across a real link.
WORLD_TESTS = ["test_collectives.py", "test_ddp.py", "test_ddp_persistent.py",
               "test_ddp_progress.py", "test_overlap_pieces.py"]


@pytest.fixture(scope="module")
def world_tests_run(cluster: SimCluster) -> Launch:
    """One job on the two hosts running every file of :data:`WORLD_TESTS` (each rank
    imports pytest, NumPy and axondist once, not once per file)."""
    args = ["-m", "mpi4py", RANK_PYTEST, *(f"tests/world/{name}" for name in WORLD_TESTS),
            "-x", "-p", "no:cacheprovider", "-m", "not gpu"]
    return cluster.run(SLOTS, args, env={"AXONDIST_TEST_EXAMPLES": "3"},
                       timeout=120 * len(WORLD_TESTS))


@pytest.mark.parametrize("world_test", WORLD_TESTS)
def test_world_tests_pass_on_two_hosts(world_tests_run: Launch, world_test: str) -> None:
    run = world_tests_run
    for r, text in enumerate(run.ranks):
        assert re.search(rf"tests/world/{re.escape(world_test)} [.sx]+", text), (
            f"rank {r} did not run {world_test}, or not all passed\n{run.tail()}")
    assert run.returncode == 0, run.tail()
    summaries = [re.findall(r"(\d+ passed.* in [\d.]+s)", text) for text in run.ranks]
    for r, found in enumerate(summaries):
        assert found and "failed" not in found[-1], f"rank {r}: {found}\n{run.tail()}"


def test_mpi_backend_checks_on_two_hosts(cluster: SimCluster) -> None:
    run = cluster.run(SLOTS, ["-m", "mpi4py", MPI_LAUNCH, "backend"], timeout=120)
    assert run.returncode == 0, run.tail()
    _assert_all_ok(run.ranks, "backend", run.tail())


def test_hybrid_shard_on_detected_nodes_equals_one_process(cluster: SimCluster) -> None:
    run = cluster.run(SLOTS, ["-m", "mpi4py", CHECKS, "hybrid_shard", "8"], timeout=120)
    assert run.returncode == 0, run.tail()
    _assert_all_ok(run.ranks, "hybrid_shard", run.tail())
    for r, text in enumerate(run.ranks):
        assert f"node {r // 2} local {r % 2}/2 shard group 2" in text, run.tail()


@pytest.mark.parametrize("test, failing", [("test_one_rank_fails", 2),
                                           ("test_one_rank_fails_one_example", 2),
                                           ("test_one_rank_fails_one_example", 1)])
def test_a_failing_world_test_prints_its_traceback_and_ends_the_job(
        cluster: SimCluster, test: str, failing: int) -> None:
    """Rank 2 runs on node1, behind its own proxy; rank 1 beside mpiexec. A failing
    hypothesis example would be shrunk and replayed on the failing rank alone (a hang
    with no traceback): it ends the job at once, its traceback printed. The collective
    timeout (60 s) is longer than the bound, so only a prompt abort passes."""
    args = ["-m", "mpi4py", RANK_PYTEST, f"{FAILING_TESTS}::{test}", "-q", "-x",
            "-p", "no:cacheprovider"]
    run = cluster.run(SLOTS, args, env={"AXONDIST_FAIL_RANKS": str(failing),
                                        "AXONDIST_TEST_EXAMPLES": "3",
                                        "AXONDIST_TIMEOUT": "60"}, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.tail()
    assert run.seconds < 30, f"the job took {run.seconds:.0f} s to end\n{run.tail()}"
    text = run.ranks[failing]
    assert f"--- rank {failing}: {FAILING_TESTS}::{test} failed (call)" in text, run.tail()
    assert f"AssertionError: rank {failing} fails" in text, run.tail()
    for r, other in enumerate(run.ranks):
        assert r == failing or "failed" not in other, f"rank {r} was blamed\n{run.tail()}"
    deadline = time.monotonic() + 10  # a rank may still be exiting when mpiexec has ended
    while cluster.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cluster.pids(), f"left running: {cluster.pids()}"
