"""What the fault tests share: a case script run in a subprocess on the mock world, under
``mpiexec -n N`` or under ``torchrun --nproc-per-node N``, each under its own ``timeout`` (a
hang fails the test instead of freezing the suite), with ``AXONDIST_TIMEOUT=10`` and MPICH's
waiting ranks yielding their core (the machines running the suite are small); a module's runs
start together, a few at a time, the first time one of its tests asks for them.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LIMIT = 30.0  # seconds a failing case may take, with AXONDIST_TIMEOUT=10
#: AXONDIST_TIMEOUT of the cases whose verdict is the timeout itself (a rank busy in its own
#: code): they wait it out, so it is as short as a loaded machine allows between ranks that
#: do join (their calls start together, right after ``init``'s own exchange).
SHORT_TIMEOUT = 5
HARD_LIMIT = 90.0  # the subprocess timeout: past it, a hang
#: Fault runs at once: 6 in all, shared by the suite's pytest-xdist workers.
PARALLEL = int(os.environ.get("AXONDIST_FAULT_PARALLEL", str(
    max(2, 6 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))))
ENV = {"AXONDIST_TIMEOUT": "10", "PYTHONPATH": str(REPO),
       "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
       "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1"}


@dataclass(frozen=True)
class Outcome:
    returncode: int  # -999: killed at HARD_LIMIT
    seconds: float
    output: str  # stdout, then stderr
    ended_at: float = 0.0  # time.time() when the run ended

    @property
    def fault_seconds(self) -> float:
        """Seconds from when every rank was ready (the ``CASE ready at T`` lines of a torch
        run, whose import of torch takes seconds per rank on a loaded machine) to the end;
        the whole run's seconds where the ranks print no such line."""
        ready = [float(t) for t in re.findall(r" ready at (\d+\.\d+)", self.output)]
        return self.ended_at - max(ready) if ready else self.seconds


def why_no_mpi() -> str | None:
    """Why the MPI runs cannot happen here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install '.[mpi]')"
    if not MPIEXEC.exists():
        return f"no mpiexec next to the Python interpreter ({MPIEXEC})"
    return None


def why_no_torch() -> str | None:
    """Why the torchrun runs cannot happen here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install '.[torch]')"
    return None


#: How each mode starts ``n`` ranks of ``python SCRIPT CASE MODE``.
LAUNCHERS: dict[str, Callable[[list[str], int], list[str]]] = {
    "mock": lambda command, n: [*command, str(n)],  # the script spawns a mock world
    "mpi": lambda command, n: [str(MPIEXEC), "-n", str(n), *command],
    "torch": lambda command, n: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", str(n), *command[1:]],
}
#: Why a mode cannot run here (None: it can).
MISSING: dict[str, Callable[[], str | None]] = {
    "mock": lambda: None, "mpi": lambda: why_no_mpi(), "torch": lambda: why_no_torch()}


def run_case(script: Path, case: str, mode: str, n: int,
             env: dict[str, str] | None = None, extra_args: Sequence[str] = (),
             hard_limit: float = HARD_LIMIT) -> Outcome:
    """``python SCRIPT CASE MODE [EXTRA_ARGS]`` on ``n`` ranks: under ``mpiexec -n n`` for
    ``mode`` "mpi", ``torchrun --nproc-per-node n`` for "torch", else with ``n`` as the last
    argument (the script spawns a mock world); killed after ``hard_limit`` seconds."""
    command = LAUNCHERS[mode]([sys.executable, str(script), case, mode, *extra_args], n)
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV, **(env or {})},
                              capture_output=True, text=True, timeout=hard_limit,
                              stdin=subprocess.DEVNULL)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = -999, f"HUNG: killed after {hard_limit:g} s\n{exc.stdout}{exc.stderr}"
    return Outcome(code, time.monotonic() - start, output, time.time())


def start_all(runs: Sequence[tuple[Any, ...]], run: Callable[..., Outcome],
              parallel: int = PARALLEL) -> dict[tuple[Any, ...], concurrent.futures.Future]:
    """Start ``run(*r)`` for every ``r`` of ``runs`` (tuples whose second item is the
    mode) on ``parallel`` threads; runs of a mode that cannot run here are left out."""
    pool = concurrent.futures.ThreadPoolExecutor(parallel)
    return {r: pool.submit(run, *r) for r in runs if MISSING[r[1]]() is None}
