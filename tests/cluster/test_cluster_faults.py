"""Faults across hosts on a 2-host x 2-rank simulated cluster, with ``AXONDIST_TIMEOUT=10``
(and once with the default settings).

Every job runs in a subprocess under its own hard limit (``HARD_LIMIT``: past it, the job
and everything on the hosts is killed and the test fails as a hang). A fault must end the
job within ``LIMIT`` seconds of striking, say which ranks it lost, and leave no process
running on any host ``LIMIT`` seconds after it struck.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.simcluster import Launch, SimCluster

CHECKS = str(Path(__file__).resolve().parent / "rank_checks.py")
LIMIT = 30.0  # seconds from the fault to the job's end, and to the last process gone
HARD_LIMIT = 90.0
SLOTS = [2, 2]  # ranks 0, 1 on node0; ranks 2, 3 on node1


@dataclass(frozen=True)
class FaultRun:
    """A job broken on purpose: what it printed, how long it lasted after the fault, and
    what still ran on the hosts ``LIMIT`` seconds after the fault."""

    launch: Launch
    ended_after: float
    leftovers: tuple[str, ...]

    @property
    def text(self) -> str:
        return self.launch.launcher + "".join(self.launch.ranks)


def _rank_pid(cluster: SimCluster, rank: int) -> int:
    """The pid of MPI rank ``rank`` (read from the processes' environments)."""
    for pid in cluster.pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of rank {rank} in the cluster")


def _describe(cluster: SimCluster) -> tuple[str, ...]:
    found = []
    for pid in cluster.pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append(f"{pid}: {cmd[:120]}")
    return tuple(found)


def _launcher_pid(cluster: SimCluster, host: int) -> int:
    """The pid of the hydra proxy (the remote launcher) on ``host``."""
    for pid in cluster.pids(host):
        try:
            if b"hydra_pmi_proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no hydra_pmi_proxy on host {host}")


#: Every fault run the tests look at: (fault, hard limit, settings, settle seconds).
RUNS = [("link_down", HARD_LIMIT, "defaults", 60.0),  # the longest first
        ("link_down", HARD_LIMIT, "timeout 10", LIMIT),
        ("launcher_killed", LIMIT + 5, "timeout 10", LIMIT),  # a hang costs 35 s
        ("rank_killed", HARD_LIMIT, "timeout 10", LIMIT)]


@functools.cache
def _started() -> dict[tuple[str, float, str, float], concurrent.futures.Future[FaultRun]]:
    """Every run of ``RUNS``, two at a time on their own clusters, started when a test
    first asks for one."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    return {run: pool.submit(_fault_run, *run) for run in RUNS}


def fault_run(fault: str, hard_limit: float = HARD_LIMIT, settings: str = "timeout 10",
              settle: float = LIMIT) -> FaultRun:
    """The run of ``fault`` (one of ``RUNS``): see :func:`_fault_run`."""
    return _started()[(fault, hard_limit, settings, settle)].result()


def _fault_run(fault: str, hard_limit: float, settings: str, settle: float) -> FaultRun:
    """Start ranks all-reducing on a fresh cluster, strike ``fault`` once all run, and
    watch the job end, then up to ``settle`` seconds for its processes to go.
    ``settings``: ``"timeout 10"`` (AXONDIST_TIMEOUT=10) or ``"defaults"``."""
    env = {"AXONDIST_TIMEOUT": "10"} if settings == "timeout 10" else {}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that crashes (MPICH, SIGSEGV) shows where
    with SimCluster(hosts=2) as cluster:
        started = time.monotonic()
        proc, out = cluster.start(SLOTS, ["-m", "mpi4py", CHECKS, "all_reduce_forever"],
                                  env=env)
        files = [out / f"rank{r}.txt" for r in range(sum(SLOTS))]
        while sum(f.exists() and "STARTED" in f.read_text() for f in files) < len(files):
            if proc.poll() is not None or time.monotonic() - started > 60:
                launch = cluster.finish(proc, out, len(files), 1, started)
                raise AssertionError(f"the job did not start on every rank\n{launch.tail()}")
            time.sleep(0.1)
        time.sleep(1.0)  # several all_reduces done: the fault strikes mid-training
        struck = time.monotonic()
        if fault == "link_down":
            cluster.set_link(1, up=False)
        elif fault == "rank_killed":
            os.kill(_rank_pid(cluster, 2), signal.SIGKILL)
        elif fault == "launcher_killed":
            os.kill(_launcher_pid(cluster, 1), signal.SIGKILL)
        else:
            raise ValueError(f"fault_run: unknown fault {fault!r}")
        launch = cluster.finish(proc, out, len(files), hard_limit, struck)
        while cluster.pids() and time.monotonic() - struck < settle:
            time.sleep(0.2)
        return FaultRun(launch, launch.seconds, _describe(cluster))


@pytest.mark.parametrize("fault", ["link_down", "rank_killed"])
def test_a_fault_ends_the_job_in_time_and_leaves_nothing_running(
        cluster_ready: None, fault: str) -> None:
    run = fault_run(fault)
    assert not run.launch.timed_out, f"the job hung past {HARD_LIMIT:g} s\n{run.launch.tail()}"
    assert run.launch.returncode != 0, run.launch.tail()
    assert run.ended_after < LIMIT, f"ended {run.ended_after:.1f} s after the fault"
    assert not run.leftovers, (f"still running {LIMIT:g} s after the fault: {run.leftovers}\n"
                               f"{run.launch.tail()}")


def test_a_killed_remote_launcher_ends_the_job_and_its_ranks(cluster_ready: None) -> None:
    run = fault_run("launcher_killed", LIMIT + 5)
    assert not run.launch.timed_out, f"the job hung\n{run.launch.tail()}"
    assert run.launch.returncode != 0, run.launch.tail()
    assert run.ended_after < LIMIT, f"ended {run.ended_after:.1f} s after the fault"
    assert not run.leftovers, (f"still running {LIMIT:g} s after the fault: {run.leftovers}\n"
                               f"{run.launch.tail()}")
    assert "signal 11" not in run.text and "Segmentation fault" not in run.text, \
        run.launch.tail()
    # the ranks of node1 tell the others before they go; or mpiexec saw the proxy go first
    assert ("lost the launcher that started them (mpiexec's process manager on host node1 "
            "died, or was killed)" in run.text or "assert (!closed) failed" in run.text), \
        run.launch.tail()


def test_a_host_whose_link_goes_down_is_named_by_the_watchdog(cluster_ready: None) -> None:
    text = fault_run("link_down").text
    assert "all_reduce #" in text and "timed out on rank" in text, text[-3000:]
    assert "(AXONDIST_TIMEOUT=10 s)" in text and "missing ranks: [2, 3]" in text, text[-3000:]
    for r in (2, 3):
        assert f"rank {r}: no answer" in text or f"rank {r} (host node1" in text, text[-3000:]


def test_the_watchdog_names_the_cut_off_host(cluster_ready: None) -> None:
    text = fault_run("link_down").text
    assert "rank 2 (host node1" in text and "rank 3 (host node1" in text, text[-3000:]


def test_the_timeout_message_counts_from_the_last_sign_of_life(cluster_ready: None) -> None:
    run = fault_run("link_down")
    timed_out = re.search(r"timed out on rank ([01]) of 4 after (\d+\.\d) s", run.text)
    assert timed_out, run.text[-3000:]
    # that rank's own lines (other ranks' stall warnings, printed at other moments, interleave)
    own = "\n".join(line for line in run.text.splitlines()
                     if line.startswith(f"[axondist rank {timed_out[1]}/4]"))
    found = re.search(r"timed out on rank [01] of 4 after (\d+\.\d) s.*?rank [23] "
                      r"\(host node1\): no answer .*?its last sign of life was (\d+\.\d) s ago",
                      own, re.S)
    assert found, own[-3000:]
    assert float(found[2]) >= float(found[1]) - 0.5, found[0]


def test_a_cut_off_host_ends_the_job_within_a_minute_under_default_settings(
        cluster_ready: None) -> None:
    # AXONDIST_TIMEOUT stays at its 600 s: the host's silence (AXONDIST_CUT_OFF_TIMEOUT,
    # default 30 s from the last sign of life) ends the job, naming the host and its ranks
    run = fault_run("link_down", HARD_LIMIT, "defaults", 60.0)
    assert not run.launch.timed_out, f"the job hung past {HARD_LIMIT:g} s\n{run.launch.tail()}"
    assert run.launch.returncode != 0, run.launch.tail()
    assert 25.0 < run.ended_after < 60.0, f"ended {run.ended_after:.1f} s after the fault"
    assert re.search(r"cannot complete: host node1 \(ranks \[2, 3\]\) is cut off: none of its "
                     r"ranks has answered this rank \(host node0\) for [3-5]\d\.\d s, counted "
                     r"from their last sign of life \(AXONDIST_CUT_OFF_TIMEOUT=30 s\)",
                     run.text), run.launch.tail()
    assert not run.leftovers, f"still running 60 s after the fault: {run.leftovers}"


def _mpich_crashed_first(run: FaultRun) -> bool:
    """Whether a survivor on node0 crashed inside MPI's own Allreduce (SIGSEGV, its Python
    stack printed by the fault handler) and hydra reported that crash first."""
    first = next((ln for ln in run.text.splitlines() if "RUNNING AT" in ln), "")
    return (first.strip(" =").endswith("RUNNING AT node0") and "EXIT CODE: 11" in run.text
            and "Fatal Python error: Segmentation fault" in run.text
            and re.search(r"Current thread .*?plans\.py\", line \d+ in _move", run.text, re.S)
            is not None)


def test_a_killed_remote_rank_is_named_with_its_host(cluster_ready: None) -> None:
    run = fault_run("rank_killed")
    if _mpich_crashed_first(run):
        # MPICH itself sometimes segfaults in a survivor's Allreduce as the dead rank's
        # connection closes, and hydra then reports that crash first (a few runs in a hundred,
        # more on a loaded machine). That is MPICH's race, outside axondist: strike again.
        run = _fault_run("rank_killed", HARD_LIMIT, "timeout 10", LIMIT)
    # hydra ends the job at once, before any watchdog could speak; it names pid and host
    pid_line = next((ln for ln in run.text.splitlines() if "RUNNING AT" in ln), "")
    assert pid_line.strip(" =").endswith("RUNNING AT node1"), run.launch.tail()
    assert "EXIT CODE: 9" in run.text, run.launch.tail()


def test_a_host_that_cannot_be_reached_fails_the_launch_at_once(fresh_cluster: SimCluster
                                                                ) -> None:
    fresh_cluster.refuse_logins(1)
    run = fresh_cluster.run(SLOTS, ["-m", "mpi4py", CHECKS, "big_all_reduce", "1"],
                            env={"AXONDIST_TIMEOUT": "10"}, timeout=HARD_LIMIT)
    assert not run.timed_out and run.returncode != 0, run.tail()
    assert run.seconds < LIMIT, run.tail()
    assert "ssh: connect to host node1 port 22: No route to host" in run.launcher, run.tail()
    assert "Launch proxy failed" in run.launcher, run.tail()
    deadline = time.monotonic() + LIMIT
    while fresh_cluster.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not fresh_cluster.pids(), _describe(fresh_cluster)
