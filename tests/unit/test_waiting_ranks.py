"""The preloaded ``sched_yield`` of tests/waiting_ranks.py: a long wait costs its process
little CPU, MPICH's waiting ranks use it, and nothing is preloaded where nothing was built."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import waiting_ranks

MPIEXEC = Path(sys.executable).parent / "mpiexec"
#: A process that yields in a loop for one second of wall time (as MPICH's waiting rank
#: does), then prints the CPU seconds it used.
YIELD_LOOP = """
import ctypes, time
libc = ctypes.CDLL(None)
cpu, end = time.process_time(), time.monotonic() + 1.0
while time.monotonic() < end:
    libc.sched_yield()
print(time.process_time() - cpu)
"""
#: Rank 0 waits a second in a receive that rank 1 sends late; rank 0 prints its CPU seconds.
LATE_SEND = """
import time
import numpy as np
from mpi4py import MPI
comm, box = MPI.COMM_WORLD, np.zeros(4)
comm.Barrier()
if comm.rank == 1:
    time.sleep(1.0)
    comm.Send(np.ones(4), dest=0)
else:
    cpu = time.process_time()
    comm.Recv(box, source=1)
    print(time.process_time() - cpu, box.sum())
"""
MPICH_YIELDS = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> str:
    built = waiting_ranks.build(str(tmp_path_factory.mktemp("waiting")))
    if built is None:
        pytest.skip("no C compiler here: the suite runs without the preloaded wait")
    return built


def _run(command: list[str], library: str, extra: dict[str, str] | None = None) -> str:
    env = {**os.environ, **(extra or {}), "LD_PRELOAD": library}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cannot be preloaded" not in done.stderr, done.stderr
    return done.stdout


def test_a_second_of_yielding_costs_a_small_share_of_a_core(library: str) -> None:
    cpu = float(_run([sys.executable, "-c", YIELD_LOOP], library))
    assert cpu < 0.3, f"a 1 s wait used {cpu:.2f} CPU-s with the sleeping yield preloaded"


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or not MPIEXEC.exists(),
                    reason="needs mpi4py and the mpiexec next to Python")
def test_an_mpich_rank_waiting_a_second_for_a_message_sleeps_through_it(library: str) -> None:
    out = _run([str(MPIEXEC), "-n", "2", sys.executable, "-c", LATE_SEND], library,
               MPICH_YIELDS)
    cpu, received = out.split()
    assert float(received) == 4.0
    assert float(cpu) < 0.3, f"rank 0 used {float(cpu):.2f} CPU-s waiting 1 s for its message"


def test_nothing_is_built_without_a_compiler_and_a_users_preload_is_kept(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert waiting_ranks.build(str(tmp_path)) is None
    monkeypatch.setenv("LD_PRELOAD", "/their/own.so")
    assert waiting_ranks.preload_for_children() is None
    assert os.environ["LD_PRELOAD"] == "/their/own.so"
