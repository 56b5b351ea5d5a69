"""The simulated cluster itself: MPICH sees separate nodes, bytes cross the links, and
nothing is left behind (namespaces, files, processes), also when a test fails."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from cluster import simcluster
from cluster.simcluster import SimCluster

CHECKS = str(Path(__file__).resolve().parent / "rank_checks.py")


def _hosts_of(slots: list[int], n: int | None) -> list[int]:
    """Hydra's placement: ``slots[i]`` ranks on host i in turn, round-robin past the end."""
    order = [h for h, k in enumerate(slots) for _ in range(k)]
    return [order[r % len(order)] for r in range(n or len(order))]


def _expected_node_info(hosts: list[int]) -> list[tuple[int, int, int]]:
    """(node id, local rank, local size): nodes numbered in order of their lowest rank."""
    ids = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return [(ids[h], hosts[:r].count(h), hosts.count(h)) for r, h in enumerate(hosts)]


@pytest.mark.parametrize("slots, n", [([2, 2], None), ([1, 1], 4), ([2, 1], None)],
                         ids=["blocks-2x2", "interleaved-2x2", "uneven-2+1"])
def test_mpich_sees_each_host_as_a_node(cluster: SimCluster, slots: list[int],
                                        n: int | None) -> None:
    run = cluster.run(slots, ["-m", "mpi4py", CHECKS, "layout"], n=n, timeout=60)
    assert run.returncode == 0, run.tail()
    hosts = _hosts_of(slots, n)
    want = _expected_node_info(hosts)
    for r, text in enumerate(run.ranks):
        line = next((ln for ln in text.splitlines() if ln.startswith("LAYOUT ")), None)
        assert line is not None, f"rank {r} printed no layout\n{run.tail()}"
        got = json.loads(line[len("LAYOUT "):])
        assert got["rank"] == r
        assert got["processor"] == got["hostname"] == f"node{hosts[r]}", got
        assert got["shared_size"] == hosts.count(hosts[r]), got
        assert tuple(got["node_info"]) == want[r], (got, want[r])


def test_three_hosts_one_rank_each(cluster_ready: None) -> None:
    with SimCluster(hosts=3) as three:
        run = three.run([1, 1, 1], ["-m", "mpi4py", CHECKS, "layout"], timeout=60)
    assert run.returncode == 0, run.tail()
    for r, text in enumerate(run.ranks):
        got = json.loads(text.split("LAYOUT ", 1)[1].splitlines()[0])
        assert got["processor"] == f"node{r}" and got["shared_size"] == 1, got
        assert tuple(got["node_info"]) == (r, 0, 1), got


def test_a_large_all_reduce_crosses_each_hosts_link(cluster: SimCluster) -> None:
    before = [cluster.link_bytes(h) for h in range(2)]
    run = cluster.run([2, 2], ["-m", "mpi4py", CHECKS, "big_all_reduce", "64"], timeout=90)
    assert run.returncode == 0, run.tail()
    after = [cluster.link_bytes(h) for h in range(2)]
    for h in range(2):
        received, sent = (a - b for a, b in zip(after[h], before[h]))
        # each host holds half of the result's contributions: 64 MiB must go each way
        assert received >= 64 << 20 and sent >= 64 << 20, (h, received, sent)


def test_close_removes_everything_even_after_a_failure(cluster_ready: None) -> None:
    with pytest.raises(RuntimeError, match="a test failed"):
        with SimCluster(hosts=2) as c:
            sleeper = subprocess.Popen(
                ["ip", "netns", "exec", c.namespaces[1], "sleep", "600"])
            deadline = time.monotonic() + 10
            while not c.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.pids(), "the sleeper never showed up in the namespace"
            raise RuntimeError("a test failed")
    assert sleeper.wait(timeout=10) != 0  # killed
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in [*c.namespaces, c.switch]:
        assert ns not in listed.split(), listed
        assert not (simcluster.ETC_NETNS / ns).exists()
    assert not c.workdir.exists()


def test_hosts_resolve_each_other_by_name(cluster: SimCluster) -> None:
    done = cluster.on_host(1, ["python3", "-c", "import socket; print(socket.gethostname(), "
                               "socket.gethostbyname('node0'), socket.gethostbyname("
                               "socket.gethostname()))"], timeout=30)
    assert done.stdout.split() == ["node1", "10.99.0.1", "10.99.0.2"], done


def test_no_root_means_a_clear_skip_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simcluster.os, "geteuid", lambda: 1000)
    reason = simcluster.why_no_cluster()
    assert reason is not None and "needs root" in reason


def test_a_refused_namespace_means_a_clear_skip_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["ip", *args], 2, "", "Operation not permitted")

    monkeypatch.setattr(simcluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(simcluster.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(simcluster, "_ip", refuse)
    reason = simcluster.why_no_cluster()
    assert reason is not None and "'ip netns add' was refused: Operation not permitted" in reason
