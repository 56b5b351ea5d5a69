"""The watchdog keeps its clock with a rank frozen by SIGSTOP (``scripts/stop_cases.py``)
under ``mpiexec -n 2/3`` and ``torchrun --nproc-per-node 2``, with ``AXONDIST_TIMEOUT=3``
(5 for a brief stop) and ``AXONDIST_STALL_WARNING=1``.

A frozen rank's diagnostics port takes connections but never answers, so every question
to it costs the asker the whole wait for a reply. Still: the stall warning comes within a
second of its setting, the job ends within the timeout + 2 s of the stop (before the rank
is continued), the message quotes the time the call waited on the same clock as the
frozen rank's last sign of life, and a stop shorter than the timeout ends nothing. Each
run is a subprocess under its own limit; each line's clock is when it reached the test.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from axondist.launching.worlds import launched_by_mpi
from faults.runner import ENV, HARD_LIMIT, LAUNCHERS, MISSING, REPO

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stop_cases.py"
STALL = 1.0
#: Each case's AXONDIST_TIMEOUT and how long its frozen rank stays stopped: past the timeout,
#: or well between the stall warning and the timeout.
TIMEOUT = {"stopped": 3.0, "stopped_briefly": 5.0}
STOP = {"stopped": 8.0, "stopped_briefly": 2.5}
RUNS = [("stopped", "mpi", 2), ("stopped", "mpi", 3), ("stopped", "torch", 2),
        ("stopped_briefly", "mpi", 2), ("stopped_briefly", "torch", 2)]

pytestmark = pytest.mark.skipif(launched_by_mpi(), reason="launches its own jobs")


def _launch(case: str, mode: str, n: int) -> tuple[int, list[tuple[float, str]]]:
    """Run the case; its exit status (-999: killed at ``HARD_LIMIT``) and every line it
    printed (stdout and stderr merged) with ``time.time()`` when it arrived."""
    command = LAUNCHERS[mode]([sys.executable, str(SCRIPT), case, mode], n)
    env = {**os.environ, **ENV, "AXONDIST_TIMEOUT": f"{TIMEOUT[case]:g}",
           "AXONDIST_STALL_WARNING": f"{STALL:g}", "AXONDIST_TEST_STOP_SECONDS": f"{STOP[case]:g}"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(HARD_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        code = -999
    reader.join(10)
    proc.stdout.close()  # type: ignore[union-attr]  # a pipe: Popen made it
    return code, lines


@functools.cache
def _outcomes() -> dict[tuple[str, str, int], concurrent.futures.Future]:
    pool = concurrent.futures.ThreadPoolExecutor(3)
    return {run: pool.submit(_launch, *run) for run in RUNS if MISSING[run[1]]() is None}


def _first(lines: list[tuple[float, str]], pattern: str) -> tuple[float, re.Match[str]] | None:
    for at, line in lines:
        found = re.search(pattern, line)
        if found:
            return at, found
    return None


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_a_frozen_rank_is_warned_of_and_timed_out_on_time(case: str, mode: str, n: int) -> None:
    if MISSING[mode]() is not None:
        pytest.skip(MISSING[mode]() or "")
    code, lines = _outcomes()[(case, mode, n)].result()
    text = "".join(line for _, line in lines)
    tail = text[-6000:]
    assert code != -999, f"hung:\n{tail}"
    stopped = _first(lines, r"STOPPED at (\d+\.\d+)")
    assert stopped, tail
    at = float(stopped[1][1])
    warned = _first(lines, r"stall: rank \d+ has waited (\d+\.\d) s in all_reduce #6 on world")
    assert warned, f"no stall warning:\n{tail}"
    assert STALL <= float(warned[1][1]) < STALL + 1.0, tail  # quoted: within 1 s of the setting
    assert warned[0] - at < STALL + 1.0, f"warned {warned[0] - at:.1f} s after the stop\n{tail}"
    if case == "stopped_briefly":  # the call completed: nothing may end the job
        assert code == 0, f"ended with {code}:\n{tail}"
        assert text.count("stopped_briefly OK") == n, tail
        assert "timed out" not in text, tail
        return
    assert code != 0, f"must fail:\n{tail}"
    frozen, timeout = n - 1, TIMEOUT[case]
    message = (rf"all_reduce #6 on world .*timed out on rank \d+ of {n} after (\d+\.\d) s "
               rf"\(AXONDIST_TIMEOUT={timeout:g} s\)")
    ended = _first(lines, message)
    assert ended, f"no match for {message!r} in:\n{tail}"
    assert timeout <= float(ended[1][1]) < timeout + 1.0, tail
    assert ended[0] - at < timeout + 2.0, f"ended {ended[0] - at:.1f} s after the stop\n{tail}"
    continued = _first(lines, r"CONTINUED at")
    assert continued is None or continued[0] > ended[0], f"ended after the rank went on\n{tail}"
    said = re.search(rf"timed out on rank \d+ of {n} after (\d+\.\d) s.*missing ranks: "
                     rf"\[{frozen}\]\n.*rank {frozen} \(host [^)]*\): no answer .*its last sign "
                     rf"of life was (\d+\.\d) s ago", text, re.S)
    assert said, tail
    assert abs(float(said[2]) - float(said[1])) <= 0.5, said[0]  # one clock for both
