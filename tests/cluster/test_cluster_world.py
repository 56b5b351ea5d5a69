"""World tests and training on a 2-host x 2-rank simulated cluster (ranks 0, 1 on node0).

The same world tests as under ``mpiexec`` on one machine, the MPI backend's own checks,
and HYBRID_SHARD training (node layout detected, no ``ranks_per_node``) equal to
single-process training.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.simcluster import SimCluster

HERE = Path(__file__).resolve().parent
CHECKS = str(HERE / "rank_checks.py")
MPI_LAUNCH = str(HERE.parent / "world" / "test_mpi_launch.py")
SLOTS = [2, 2]


def _assert_all_ok(run_text: list[str], word: str, tail: str) -> None:
    for r, text in enumerate(run_text):
        assert f"{word} OK" in text, f"rank {r} did not finish {word}\n{tail}"


# test_ddp_persistent.py: OVERLAPPED DDP's progress helper is on by itself across hosts;
# test_overlap_pieces.py: its persistent rings and early-starting pieces across a real link.
@pytest.mark.parametrize("world_test", ["test_collectives.py", "test_ddp.py",
                                        "test_ddp_persistent.py", "test_ddp_progress.py",
                                        "test_overlap_pieces.py"])
def test_world_tests_pass_on_two_hosts(cluster: SimCluster, world_test: str) -> None:
    args = ["-m", "mpi4py", MPI_LAUNCH, "pytest", f"tests/world/{world_test}", "-q", "-x",
            "-p", "no:cacheprovider", "-m", "not gpu"]
    run = cluster.run(SLOTS, args, env={"AXONDIST_TEST_EXAMPLES": "3"}, timeout=240)
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
