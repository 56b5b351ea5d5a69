"""A rank of the mock world that ends the whole process (every rank is a thread of it) is
named, with how it ended it and what the other ranks were doing, as a launched world's peers
name a rank whose process ended: ``os._exit`` (status 0 too, which becomes 1: the job did not
finish), SIGKILL or SIGTERM sent to its own process, ``os.abort()``, and a segmentation fault
(whose crash dump shows the rank's frame). Each run of ``scripts/process_cases.py`` is a
subprocess under its own timeout (``faults.runner``), at 2 and 3 ranks.
"""

from __future__ import annotations

import functools
import re
import signal
from pathlib import Path

import pytest

from faults.runner import LIMIT, Outcome, run_case, start_all

SCRIPT = Path(__file__).resolve().parent / "scripts" / "process_cases.py"
RANKS = r"\[0(, 2)?\]"
NAMED = (r"\[axondist\] rank 1 of the mock world \(axondist\.spawn, \d ranks on threads of this "
         r"process\) ends the whole process: {how}\. Every rank of the mock world is a thread of "
         rf"this one process, so ranks {RANKS} end with it:\n\[axondist\]   rank 0 \(host "
         r"in-process, pid \d+\) waits in all_reduce #2 on world \(dtype=float32, shape=\[4\], "
         r"reduce_op=SUM\)")
#: case -> (its exit status, what it prints)
CASES: dict[str, tuple[int, str]] = {
    "hard_exit": (1, NAMED.format(how=r"it called os\._exit\(1\)")),
    "hard_exit_zero": (1, NAMED.format(how=r"it called os\._exit\(0\) \(the process exits with "
                                           r"status 1: ranks had not finished\)")),
    "kill_own_process": (-signal.SIGKILL, NAMED.format(how="it sent SIGKILL to its own process")),
    "term_own_process": (-signal.SIGTERM, NAMED.format(how="it sent SIGTERM to its own process")),
    "abort": (-signal.SIGABRT, NAMED.format(how=r"it called os\.abort\(\) \(SIGABRT\)")
              + r".*Fatal Python error: Aborted"),
    # the crashing thread's stack (the current one) holds the rank's frame
    "segfault": (-signal.SIGSEGV, r"Fatal Python error: Segmentation fault\n(?:[^\n]*\n)*?"
                                  r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n"
                                  r"(?:  File [^\n]*\n)*?  File [^\n]* in "
                                  r"rank_1_of_the_mock_world\n"),
}
RUNS = [(case, "mock", n) for case in CASES for n in (2, 3)]


@functools.cache
def _outcomes() -> dict:
    return start_all(RUNS, functools.partial(run_case, SCRIPT))


@pytest.mark.parametrize("case,mode,n", RUNS, ids=[f"{c}-{m}{n}" for c, m, n in RUNS])
def test_a_rank_that_ends_the_process_is_named(case: str, mode: str, n: int) -> None:
    outcome: Outcome = _outcomes()[(case, mode, n)].result()
    status, said = CASES[case]
    tail = outcome.output[-6000:]
    assert outcome.returncode == status, f"{case} ended with {outcome.returncode}:\n{tail}"
    assert outcome.seconds < LIMIT, f"{case} took {outcome.seconds:.1f} s:\n{tail}"
    assert re.search(said, outcome.output, re.S), f"no match for {said!r} in:\n{tail}"
    if n == 3 and case != "segfault":  # no Python code runs at a segmentation fault
        assert re.search(r"\[axondist\]   rank 2 \(host in-process", outcome.output), tail
