"""Every fault of ``scripts/fault_cases.py`` on the mock world, under ``mpiexec -n 2/3`` and
under ``torchrun --nproc-per-node 2/3`` (the torch backend).

Each run is a subprocess under its own ``timeout`` (a hang fails the test instead of
freezing the suite) with ``AXONDIST_TIMEOUT=10``, or 5 where the timeout itself is the
verdict (:data:`WAITS_OUT_THE_TIMEOUT`); a case that must fail must end non-zero within 30 s
with a message naming the operation and the ranks. The runs are
started together, a few at a time, when the module's tests first ask for them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import (
    ENV,
    HARD_LIMIT,
    LIMIT,
    MISSING,
    MPIEXEC,
    REPO,
    SHORT_TIMEOUT,
    Outcome,
    run_case,
    start_all,
    why_no_mpi,
)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fault_cases.py"
WATCHDOG_SCRIPT = SCRIPT.with_name("watchdog_cases.py")


@dataclass(frozen=True)
class Expect:
    """What a case must print: a regex for MPI runs and one for mock runs (None: must
    succeed, printing ``CASE OK``)."""

    mpi: str | None
    mock: str | None


LEFT_MPI = r"all_reduce #1 on world .*cannot complete: rank 1 \(host .*\) left before any call"
#: The mock world's text for ranks in different groups: a wait cycle, named at once.
WRONG_GROUP_ON_MOCK = (r"all_reduce #(1 on world\.0|2 on world) .*: deadlock: rank [01] waits in "
                       r"all_reduce #(2 on world|1 on world\.0) .*\(wait cycle rank [01] -> ")
#: The seconds a timed-out call says it waited: the timeout, or up to 10 s more on a loaded
#: machine.
WAITED = rf"({'|'.join(map(str, range(SHORT_TIMEOUT, 10)))}|1\d)\.\d"
CASES: dict[str, Expect] = {
    "skip_collective": Expect(LEFT_MPI, r"all_reduce #1 on world .*rank 1 left before making "
                                        r"any call \(its function returned\)"),
    "exit0": Expect(LEFT_MPI, r"rank 1 left before making any call \(it called sys.exit\(0\)\)"),
    "exit1": Expect(LEFT_MPI, r"rank 1 left before making any call \(it called sys.exit\(1\)\)"),
    "finally_barrier": Expect(*[r"ranks called different collectives at the same point \("
                                r"rank 0 called all_reduce, rank 1 called barrier"] * 2),
    # run with AXONDIST_TIMEOUT=SHORT_TIMEOUT (WAITS_OUT_THE_TIMEOUT)
    "stuck": Expect(rf"all_reduce #1 on world .*timed out on rank \d of \d after {WAITED} s "
                    rf"\(AXONDIST_TIMEOUT={SHORT_TIMEOUT} s\).*missing ranks: \[1\].*rank 1 "
                    r"\(host .*\) is not in any axondist call",
                    rf"all_reduce #1 on world .*ranks \[1\] of \d did not join within "
                    rf"{SHORT_TIMEOUT} s; rank 1 .* is not in any axondist call"),
    "monitored": Expect(r"monitored_barrier: ranks \[1\] of group world did not arrive at barrier "
                        r"#1: rank 1 \(host .*\) is not in any axondist call",
                        r"barrier #1 on world .*ranks \[1\] of \d did not join within 3 s"),
    "wrong_group": Expect(r"cannot complete: deadlock: rank [01] waits in all_reduce "
                          r"#(2 on world|1 on world\.0) ", WRONG_GROUP_ON_MOCK),
    "send_no_recv": Expect(r"deadlock: rank [01] waits in (barrier #1 on world|send #2 on "
                           r"world:p2p \(peer=1, tag=0, bytes=4194304\))",
                           r"messages were sent but never received: 1 from rank 0 to rank 1 "
                           r"\(tag 0\)"),
    "recv_no_send": Expect(r"deadlock: rank \d waits in (barrier #1 on world|recv #1 on "
                           r"world:p2p \(peer=0)",
                           r"(barrier #1 on world .*: deadlock: rank 1 waits in recv #1 on "
                           r"world:p2p \(peer=0, tag=0\)|recv on rank 1 from rank 0 \(tag 0\): "
                           r"deadlock: rank 0 waits in barrier #1 on world)"),
    "recv_recv": Expect(r"recv #1 on world:p2p \(peer=[01], tag=0\) .*deadlock: rank [01] waits "
                        r"in recv #1 on world:p2p",
                        r"deadlock: every rank in the cycle rank [01] -> rank [01] -> rank [01] "
                        r"waits to receive"),
    "dtype_same_bytes": Expect(*[r"all_reduce: ranks disagree on dtype \(rank 0: float32, "
                                 r"rank 1: float64"] * 2),
    "int_vs_float": Expect(*[r"all_reduce: ranks disagree on dtype \(rank 0: float32, "
                             r"rank 1: int32"] * 2),
    "op_mismatch": Expect(*[r"all_reduce: ranks disagree on reduce_op \(rank 0: SUM, .*MAX\)"] * 2),
    "sizes_mismatch": Expect(*[r"all_gather: ranks disagree on counts \(rank 0: \[2, 2.*"
                               r"rank 1: \[1, 2"] * 2),
    "src_mismatch": Expect(*[r"broadcast: ranks disagree on root \(rank 0: 0, rank 1: 1"] * 2),
    "gather_vs_broadcast": Expect(*[r"ranks called different collectives .*rank 0 called "
                                    r"all_gather, rank 1 called broadcast"] * 2),
    "scatter_op_mismatch": Expect(*[r"reduce_scatter: ranks disagree on reduce_op \(rank 0: "
                                    r"SUM, .*MAX\)"] * 2),
    "shape_mismatch_small": Expect(*[r"all_reduce: ranks disagree on shape \(rank 0: .1024,?., "
                                     r"rank 1: .2048,?."] * 2),
    "small_vs_large": Expect(*[r"all_reduce: ranks disagree on shape \(rank 0: .1024,?., "
                               r"rank 1: .1048576,?."] * 2),
    "async_mismatch": Expect(r"ranks called different collectives as call #1 on world: rank 0: "
                             r"all_reduce \(.*blocking\); rank 1: all_reduce \(.*async_op=True\)",
                             r"all_reduce: ranks disagree on async_op \(rank 0: False, "
                             r"rank 1: True"),
    "mismatch_caught_then_good": Expect(None, None),
    "ddp_num_samples": Expect(*[r"all_reduce: ranks disagree on dtype \(rank 0: float64, "
                                r"rank 1: float32"] * 2),
    "recv_wrong_out_then_good": Expect(None, None),
    "many_groups": Expect(None, None),
}
MPI_ONLY = {"killed": r"rank 1 .*|KILLED BY SIGNAL: 9|signal 9"}
#: Where the torch backend (under torchrun) says it differently from MPI (same meaning).
TORCH: dict[str, str | None] = {
    # gloo's send waits for its receive, so the sender is still in the header's send
    "send_no_recv": r"deadlock: rank [01] waits in (barrier #1 on world|send #[12] on "
                    r"world:p2p \(peer=1, tag=0)",
    # the check runs before either call starts, blocking or not: the arguments differ
    "async_mismatch": CASES["async_mismatch"].mock,
    # the peers' calls fail at once, naming the rank whose process is gone; torchrun ends
    # the job at the first exit it sees (either survivor's, or the killed rank's own, before a
    # survivor could print: then torchrun's report names it as the root cause)
    "killed": r"all_reduce on rank [02] of \d \(group world\) cannot complete: ranks? (\d, )*1"
              r"(, \d)* ended|Root Cause \(first observed failure\):\s*\[0\]:[^[]*rank\s*: 1 "
              r"\(local_rank: 1\)\s*exitcode\s*: -9",
}
#: The cases run at 3 ranks as well as 2: those a third rank changes (a rank that is not part
#: of the fault, a cycle or a group of two among three). The rest (a rank leaving, one key
#: that differs) shows nothing new at three: the check of a group over two compares every
#: rank's call at once, whichever field differs (tests/faults/test_mismatch_texts.py runs its
#: texts at 2 and 3 ranks). Each torchrun run imports torch in every process: seconds of CPU
#: each on a 2-core machine.
THREE_RANK_CASES = frozenset({"stuck", "monitored", "wrong_group", "recv_recv", "killed",
                              "sizes_mismatch", "many_groups"})
#: And under mpiexec and on the mock world, what the MPI check of a group over two does its own
#: way (two-rank groups swap their calls with the one peer): a non-blocking call's check, calls
#: on both sides of the riding limit, and the next call after a mismatch was caught.
MPI_THREE_RANK_CASES = THREE_RANK_CASES | {"async_mismatch", "small_vs_large",
                                           "mismatch_caught_then_good"}
RUNS = ([(case, "mock", n) for case in CASES for n in (2, 3)
         if n == 2 or case in MPI_THREE_RANK_CASES]
        + [(case, "mpi", n) for case in [*CASES, *MPI_ONLY] for n in (2, 3)
           if n == 2 or case in MPI_THREE_RANK_CASES]
        + [(case, "torch", n) for case in [*CASES, *MPI_ONLY] for n in (2, 3)
           if n == 2 or case in THREE_RANK_CASES])


def expected(case: str, mode: str) -> str | None:
    """What a run of ``case`` must print on ``mode`` (None: it must succeed)."""
    if mode == "torch" and case in TORCH:
        return TORCH[case]
    if case in MPI_ONLY:
        return MPI_ONLY[case]
    return getattr(CASES[case], "mock" if mode == "mock" else "mpi")


@dataclass(frozen=True)
class WatchdogCase:
    """A case of ``scripts/watchdog_cases.py``: what it must print on MPI (and on torch,
    whose watchdog is MPI's) and on mock (None: not run there), how soon MPI and torch must
    name it, and under which settings."""

    mpi: str
    mock: str | None
    named_within: float | None = None
    """On MPI and torch, the most seconds the failing call may have waited when the watchdog named
    the fault (its flight recorder says: ``RUNNING for N s``): long before the timeout."""
    env: tuple[tuple[str, str], ...] = ()


DEBUG = (("AXONDIST_DEBUG", "1"),)
CYCLE = (r"recv #1 on world:p2p \(peer=\d, tag=0\) on rank \d of \d cannot complete: deadlock: "
         r"rank \d waits in recv #1 on world:p2p .*\(wait cycle rank (\d) -> rank \d -> ")
WATCHDOG_CASES: dict[str, WatchdogCase] = {
    # the hang protection holds under AXONDIST_DEBUG=1 too
    "skip_collective": WatchdogCase(LEFT_MPI, CASES["skip_collective"].mock, env=DEBUG),
    "different_groups": WatchdogCase(CASES["wrong_group"].mpi, WRONG_GROUP_ON_MOCK, env=DEBUG),
    # a wait cycle through every rank is named at once, long before AXONDIST_TIMEOUT=10
    "receive_cycle": WatchdogCase(CYCLE, r"deadlock: every rank in the cycle rank \d -> rank \d "
                                         r"-> rank \d", named_within=8.0),
    "hard_exit": WatchdogCase(r"all_reduce #2 on world .* cannot complete: rank 1 \(host .*\) left "
                              r"after barrier #1 on world: its process exited \(it called "
                              r"os\._exit\(1\)\)", None, named_within=8.0),
    "unreceived_send": WatchdogCase(*[r"messages were sent but never received: \d+ from rank 0 to "
                                      r"rank 1 \(tag 0\)"] * 2),
    "stuck_without_server": WatchdogCase(
        rf"all_reduce #1 on world .*timed out on rank \d of \d after {WAITED} s \(AXONDIST_TIMEOUT"
        rf"={SHORT_TIMEOUT} s\).*rank 1 \(host .*\): no diagnostics server \(it runs with "
        r"AXONDIST_DIAGNOSTICS=off", None,
        env=(("AXONDIST_DIAGNOSTICS", "off"), ("AXONDIST_TIMEOUT", str(SHORT_TIMEOUT)))),
}
WATCHDOG_RUNS = [(case, mode, n) for case, expect in WATCHDOG_CASES.items()
                 for mode in ("mock", "mpi", "torch")
                 if getattr(expect, "mock" if mode == "mock" else "mpi") is not None
                 for n in (2, 3) if mode != "torch" or n == 2 or case == "receive_cycle"]


#: Settings of the torch runs: 200 groups made and destroyed (MPICH's limit on communicators,
#: which the 2,100 of the other runs pass, is not gloo's; each gloo group connects its ranks
#: anew, ~40 ms).
TORCH_ENV = {"AXONDIST_FAULT_GROUPS": "200"}
#: The runs whose verdict is the timeout itself (no event ends them sooner): they run with
#: AXONDIST_TIMEOUT=SHORT_TIMEOUT. Elsewhere the watchdog's event ends the case; its 10 s
#: timeout only bounds a regression.
WAITS_OUT_THE_TIMEOUT = {("stuck", "mock"), ("stuck", "mpi"), ("stuck", "torch")}


def _run(case: str, mode: str, n: int) -> Outcome:
    env = dict(TORCH_ENV) if mode == "torch" else {}
    if (case, mode) in WAITS_OUT_THE_TIMEOUT:
        env["AXONDIST_TIMEOUT"] = str(SHORT_TIMEOUT)
    return run_case(SCRIPT, case, mode, n, env)


def _run_watchdog_case(case: str, mode: str, n: int) -> Outcome:
    return run_case(WATCHDOG_SCRIPT, case, mode, n, dict(WATCHDOG_CASES[case].env))


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    return start_all(RUNS, _run)


@functools.cache
def _watchdog_outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    return start_all(WATCHDOG_RUNS, _run_watchdog_case)


pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own mpiexec jobs")


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_fault_case(case: str, mode: str, n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _outcomes()[(case, mode, n)].result()
    pattern = expected(case, mode)
    tail = outcome.output[-6000:]
    if pattern is None:
        assert outcome.returncode == 0, (
            f"{case} must succeed, ended with {outcome.returncode}:\n{tail}")
        assert outcome.output.count(f"{case} OK") == n, tail
        return
    assert outcome.returncode not in (0, -999), (
        f"{case} must fail, ended with {outcome.returncode}:\n{tail}")
    assert outcome.fault_seconds < LIMIT, f"{case} took {outcome.fault_seconds:.1f} s:\n{tail}"
    assert re.search(pattern, outcome.output, re.S), f"no match for {pattern!r} in:\n{tail}"


@pytest.mark.parametrize("case,mode,n", WATCHDOG_RUNS,
                         ids=[f"{c}-{m}{n}" for c, m, n in WATCHDOG_RUNS])
def test_watchdog_case(case: str, mode: str, n: int) -> None:
    """The watchdog is the same on MPI and torch: the same messages."""
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    outcome = _watchdog_outcomes()[(case, mode, n)].result()
    expect = WATCHDOG_CASES[case]
    pattern = expect.mock if mode == "mock" else expect.mpi
    tail = outcome.output[-6000:]
    assert outcome.returncode not in (0, -999), (
        f"{case} must fail, ended with {outcome.returncode}:\n{tail}")
    assert outcome.fault_seconds < LIMIT, f"{case} took {outcome.fault_seconds:.1f} s:\n{tail}"
    match = re.search(pattern, outcome.output, re.S)
    assert match, f"no match for {pattern!r} in:\n{tail}"
    if expect.named_within is not None and mode != "mock":
        waited = re.search(r"RUNNING for (\d+\.\d) s", outcome.output[match.start():])
        assert waited and float(waited[1]) < expect.named_within, tail
    if case == "receive_cycle" and mode != "mock":  # the cycle goes through every rank
        ring = re.search(r"\(wait cycle ((rank \d -> )+rank \d)\)", outcome.output)
        assert ring and len(set(ring[1].split(" -> "))) == n, tail


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _session_processes(session: int) -> list[str]:
    """``pid state command`` of each process of ``session`` (``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            if int(fields[3]) == session:
                found.append(f"{stat.parent.name} {fields[0]} "
                             f"{(stat.parent / 'cmdline').read_bytes()[:80]!r}")
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.parametrize("n", [2, 3])
def test_a_failing_rank_whose_stderr_is_gone_still_aborts_the_job(n: int) -> None:
    """A rank's uncaught exception where stderr is a pipe nobody reads (its launcher died):
    the traceback cannot be written, and the rank still calls MPI_Abort and ends, instead
    of reaching the interpreter's exit, whose hooks wait for ranks that wait for it."""
    if why_no_mpi() is not None:
        pytest.skip(why_no_mpi() or "")
    command = [str(MPIEXEC), "-n", str(n), sys.executable, str(WATCHDOG_SCRIPT),
               "fail_with_stderr_gone", "mpi"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                          text=True, timeout=HARD_LIMIT, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    # rank 1's stdout, flushed before the abort (its stderr, and MPICH's abort line, are lost)
    assert output.startswith("rank 1 raises\n"), output
    # ended by the abort: not a rank that merely left, nor the timeout
    for not_said in ("left after", "stall", "timed out"):
        assert not_said not in output, output
    assert time.monotonic() - started < LIMIT, output


@pytest.mark.parametrize("n", [2, 3])
def test_an_exit_waits_for_the_other_ranks_exits_only_until_the_timeout(n: int) -> None:
    """The exit's exchange of message counts (to name unreceived sends) waits for the other
    ranks to reach their exit at most AXONDIST_TIMEOUT seconds, then says what it skipped;
    the job still ends well."""
    if why_no_mpi() is not None:
        pytest.skip(why_no_mpi() or "")
    command = [str(MPIEXEC), "-n", str(n), sys.executable, str(WATCHDOG_SCRIPT), "exit_late",
               "mpi"]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV, "AXONDIST_TIMEOUT": "2"},
                          capture_output=True, text=True, timeout=HARD_LIMIT,
                          stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 0 ends" in output and "rank 1 ends" in output, output
    assert re.search(rf"\[axondist rank 0/{n}\] some ranks did not reach the end of their script "
                     r"within 2 s of this rank's \(AXONDIST_TIMEOUT\): this rank exits without "
                     r"checking that every message sent to it was received", output), output
    assert f"rank 1/{n}] some ranks" not in output, output  # rank 1 found the others waiting


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_whose_launcher_is_killed_exit(n: int) -> None:
    """SIGKILL of hydra's proxy (the ranks' parent, which MPI_Abort needs): every rank
    notices and exits within a few seconds, and mpiexec ends with an error."""
    if why_no_mpi() is not None:
        pytest.skip(why_no_mpi() or "")
    command = [str(MPIEXEC), "-n", str(n), sys.executable, str(WATCHDOG_SCRIPT),
               "all_reduce_forever", "mpi"]
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            # ranks print at once: two lines can arrive run together
            pids += [int(pid) for pid in re.findall(r"RANK \d+ PID (\d+)", line)]
            if len(pids) == n:
                break
        parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
                   for pid in pids}
        assert len(pids) == n and len(parents) == 1, (pids, parents)
        os.kill(parents.pop(), signal.SIGKILL)
        killed = time.monotonic()
        while any(map(_alive, pids)) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        alive = [pid for pid in pids if _alive(pid)]
        try:
            proc.communicate(timeout=HARD_LIMIT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"mpiexec still ran {HARD_LIMIT:g} s after its proxy was killed; ranks "
                        f"alive 10 s after the kill: {alive}; the job's processes now: "
                        f"{_session_processes(proc.pid)}; it printed:\n{exc.output!r}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)  # reaped and its pipe closed: nothing left for a later test
        if proc.stdout is not None:
            proc.stdout.close()
    assert not alive, f"ranks {alive} still run 10 s after their launcher was killed"
    assert proc.returncode != 0
