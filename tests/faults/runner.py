"""What the fault tests share: a case script run in a subprocess on the mock world, under
``mpiexec -n N`` or under ``torchrun --nproc-per-node N``, each under its own ``timeout`` (a
hang fails the test instead of freezing the suite), with ``AXONDIST_TIMEOUT=10`` and MPICH's
waiting ranks yielding their core (the machines running the suite are small); a module's runs
start together, a few at a time, the first time one of its tests asks for them.

Importing torch takes seconds of CPU in every process of a torchrun job, more than most
cases take. So :func:`start_all` runs a module's torch cases of one size a few to a job
(``scripts/torch_cases.py``): each rank imports torch once and forks a process per case,
which joins a world of its own; the rank kills it past its limit and stops it when a peer's
failed, as torchrun's agent does.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
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


#: Torch cases per torchrun job (:func:`start_all`).
TORCH_CASES_PER_JOB = 6
TORCH_CASES_SCRIPT = Path(__file__).resolve().parent / "scripts" / "torch_cases.py"


@dataclass(frozen=True)
class TorchCase:
    """A torch run :func:`run_case` was asked for while :func:`start_all` collects them."""

    script: Path
    case: str
    n: int
    env: dict[str, str]
    extra_args: tuple[str, ...]
    hard_limit: float


_collecting = threading.local()  # .cases: the TorchCase list start_all fills, or absent


def run_case(script: Path, case: str, mode: str, n: int,
             env: dict[str, str] | None = None, extra_args: Sequence[str] = (),
             hard_limit: float = HARD_LIMIT) -> Outcome:
    """``python SCRIPT CASE MODE [EXTRA_ARGS]`` on ``n`` ranks: under ``mpiexec -n n`` for
    ``mode`` "mpi", ``torchrun --nproc-per-node n`` for "torch", else with ``n`` as the last
    argument (the script spawns a mock world); killed after ``hard_limit`` seconds. Inside
    :func:`start_all`'s collection a torch run is only noted (its job runs it)."""
    collected = getattr(_collecting, "cases", None)
    if mode == "torch" and collected is not None:
        collected.append(TorchCase(script, case, n, dict(env or {}), tuple(extra_args),
                                   hard_limit))
        return Outcome(0, 0.0, "")
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
              parallel: int = PARALLEL, share_torch: bool = True,
              ) -> dict[tuple[Any, ...], concurrent.futures.Future]:
    """Start ``run(*r)`` for every ``r`` of ``runs`` (tuples whose second item is the
    mode) on ``parallel`` threads; runs of a mode that cannot run here are left out.

    With ``share_torch``, ``run`` must return :func:`run_case`'s outcome as it is: each torch
    run's ``run`` is called to learn its case, and the cases of one size run
    :data:`TORCH_CASES_PER_JOB` to a torchrun job."""
    pool = concurrent.futures.ThreadPoolExecutor(parallel)
    runnable = [r for r in runs if MISSING[r[1]]() is None]
    shared = [r for r in runnable if share_torch and r[1] == "torch"]
    futures = {r: pool.submit(run, *r) for r in runnable if r not in shared}
    by_size: dict[int, list[tuple[tuple[Any, ...], TorchCase]]] = {}
    for r in shared:
        _collecting.cases = []
        try:
            run(*r)
            (case,) = _collecting.cases
        finally:
            del _collecting.cases
        by_size.setdefault(case.n, []).append((r, case))
    for n, cases in by_size.items():
        jobs = -(-len(cases) // TORCH_CASES_PER_JOB)
        for j in range(jobs):
            job = cases[j::jobs]  # as even as the count allows
            job_future = pool.submit(_run_torch_job, n, [case for _, case in job])
            for k, (r, _) in enumerate(job):
                futures[r] = _item(job_future, k)
    return futures


def _item(job: concurrent.futures.Future, k: int) -> concurrent.futures.Future:
    """A future of the ``k``-th outcome of ``job``'s list."""
    item: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        if f.exception() is not None:
            item.set_exception(f.exception())
        else:
            item.set_result(f.result()[k])

    job.add_done_callback(done)
    return item


def _run_torch_job(n: int, cases: list[TorchCase]) -> list[Outcome]:
    """``cases`` in one ``torchrun --nproc-per-node n`` job (``scripts/torch_cases.py``):
    each one's outcome as if torchrun had run it alone (exit status 1 when a rank failed,
    -999 when one hung; every rank's output, in rank order)."""
    with tempfile.TemporaryDirectory(prefix="axondist-torch-cases-") as folder:
        out = Path(folder)
        (out / "cases.json").write_text(json.dumps([
            {"script": str(c.script), "case": c.case, "args": list(c.extra_args), "env": c.env,
             "limit": c.hard_limit} for c in cases]))
        command = LAUNCHERS["torch"]([sys.executable, str(TORCH_CASES_SCRIPT),
                                      str(out / "cases.json"), folder], n)
        limit = sum(c.hard_limit for c in cases) + HARD_LIMIT
        try:
            proc = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV},
                                  capture_output=True, text=True, timeout=limit,
                                  stdin=subprocess.DEVNULL)
            job_output = f"torchrun exited with {proc.returncode}\n{proc.stdout}{proc.stderr}"
        except subprocess.TimeoutExpired as exc:
            job_output = f"HUNG: the job was killed after {limit:g} s\n{exc.stdout}{exc.stderr}"
        return [_torch_outcome(out / str(k), n, job_output) for k in range(len(cases))]


def _torch_outcome(folder: Path, n: int, job_output: str) -> Outcome:
    ends = []
    for r in range(n):
        path = folder / f"rank{r}.json"
        ends.append(json.loads(path.read_text()) if path.exists() else None)
    output = "".join((folder / f"rank{r}.txt").read_text(errors="replace")
                     if (folder / f"rank{r}.txt").exists() else "" for r in range(n))
    if any(end is None for end in ends):  # the job ended before the case did
        return Outcome(-999, 0.0, f"{output}\nthe case did not end on every rank\n{job_output}")
    if any(end["hung"] for end in ends):
        code = -999
    else:
        code = 0 if all(end["status"] == 0 for end in ends) else 1
    started = min(end["started"] for end in ends)
    ended = max(end["ended"] for end in ends)
    statuses = ", ".join(f"rank {r}: {end['status']}" for r, end in enumerate(ends))
    return Outcome(code, ended - started,
                   f"{output}\nexit statuses: {statuses}\n{_root_cause(ends)}", ended)


def _root_cause(ends: list[dict[str, Any]]) -> str:
    """What torchrun's agent prints when it stopped ranks for another's failure: the rank that
    failed first on its own (the one-job stand-in must say it too, since a survivor stopped
    before it could print leaves only this)."""
    own = [(end["ended"], r, end["status"]) for r, end in enumerate(ends)
           if end["status"] != 0 and not end["stopped"]]
    if not own or not any(end["stopped"] for end in ends):
        return ""
    _, rank, status = min(own)
    return (f"Root Cause (first observed failure):\n[0]:\n  rank      : {rank} "
            f"(local_rank: {rank})\n  exitcode  : {status}\n")
