"""A rank frozen by SIGSTOP in the middle of training, as a per-rank program:
``mpiexec -n N python stop_cases.py CASE mpi`` or ``torchrun --nproc-per-node N
stop_cases.py CASE torch`` (see ``fault_cases.main``).

Every rank all-reduces in a loop; after a few steps the last rank prints ``STOPPED at T``
(``time.time()``) and stops itself with SIGSTOP. A helper process (started before, so the
stop lasts what it is told) continues it ``AXONDIST_TEST_STOP_SECONDS`` later (default 60),
unless the rank ended first: the helper dies with it. ``stopped``: the stop outlasts
``AXONDIST_TIMEOUT`` (the job must end, naming the frozen rank). ``stopped_briefly``: the
stop is shorter than the timeout (the job must go on and end well, every rank printing
``stopped_briefly OK``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402

STEPS = 40  # all-reduces after the stop, so the others wait in one for the frozen rank
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _waker(seconds: float) -> subprocess.Popen[bytes]:
    """A process that sends this one SIGCONT ``seconds`` after it reads a byte; it is
    killed when this process ends (its parent-death signal)."""
    wake = (f"import os, signal, sys, time; sys.stdin.buffer.read(1); time.sleep({seconds}); "
            f"os.kill({os.getpid()}, signal.SIGCONT)")
    return subprocess.Popen([sys.executable, "-c", wake], preexec_fn=_die_with_parent,
                            stdin=subprocess.PIPE)


def _stop(waker: subprocess.Popen[bytes]) -> None:
    """Freeze this process (SIGSTOP) until the waker continues it."""
    print(f"STOPPED at {time.time():.3f}", flush=True)
    assert waker.stdin is not None
    waker.stdin.write(b"go")
    waker.stdin.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
    print(f"CONTINUED at {time.time():.3f}", flush=True)


def _train(world: ad.World) -> None:
    last = world.rank == world.world_size - 1
    waker = _waker(float(os.environ.get("AXONDIST_TEST_STOP_SECONDS", "60"))) if last else None
    x = np.ones(256, np.float32)
    for step in range(5 + STEPS):
        if step == 5 and waker is not None:
            _stop(waker)
        x[...] = 1.0
        ad.all_reduce(x)
        assert x[0] == world.world_size, x[:4]


def stopped(world: ad.World) -> None:
    _train(world)
    print(f"stopped: no rank ended the job (rank {world.rank})", flush=True)


def stopped_briefly(world: ad.World) -> None:
    _train(world)
    ad.barrier()
    print(f"stopped_briefly OK rank {world.rank}", flush=True)


CASES = {fn.__name__: fn for fn in (stopped, stopped_briefly)}

if __name__ == "__main__":
    main(CASES)
