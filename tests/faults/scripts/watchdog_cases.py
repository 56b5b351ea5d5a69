"""Faults the watchdog must name, each a small per-rank program: ``python watchdog_cases.py
CASE mock N`` runs it on an N-rank mock world, ``mpiexec -n N python watchdog_cases.py CASE
mpi`` on MPI (see ``fault_cases.main``).

The cases cover what ends a job without the backend's own checks: a rank that skips a
call or leaves under ``AXONDIST_DEBUG=1``, a receive cycle through every rank, a rank
that ends with ``os._exit``, a message nobody receives, and a stuck rank with the
diagnostics server turned off (the timeout alone).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def skip_collective(world: ad.World) -> None:
    """Rank 1 skips the all-reduce and its script ends (run with AXONDIST_DEBUG=1)."""
    if world.rank != 1:
        ad.all_reduce(np.ones(4, np.float32))


def different_groups(world: ad.World) -> None:
    """Rank 0 all-reduces on a subgroup, the others on the world (run with AXONDIST_DEBUG=1)."""
    pair = world.new_group([0, 1])
    if world.rank == 0:
        ad.all_reduce(np.ones(4, np.float32), group=pair)
    else:
        ad.all_reduce(np.ones(4, np.float32))


def receive_cycle(world: ad.World) -> None:
    """Every rank receives from the next one first: 0 <- 1 <- ... <- N-1 <- 0, a wait cycle
    through all ranks (two ranks: the two-rank cycle)."""
    ad.recv(src=(world.rank + 1) % world.world_size)
    ad.send(np.ones(4), dst=(world.rank - 1) % world.world_size)


def hard_exit(world: ad.World) -> None:
    """Rank 1 ends its process with ``os._exit(1)``: no atexit hook runs, nothing announced."""
    ad.barrier()
    if world.rank == 1:
        sys.stdout.flush()
        os._exit(1)
    ad.all_reduce(np.ones(4, np.float32))


def unreceived_send(world: ad.World) -> None:
    """Rank 0 sends 16 bytes that rank 1 never receives; both then end normally (MPI buffers
    so small a message, so nothing waits)."""
    if world.rank == 0:
        ad.send(np.ones(4, np.float32), dst=1)
    ad.barrier()


def stuck_without_server(world: ad.World) -> None:
    """Rank 1 is busy in its own code past the timeout (run with the diagnostics server off:
    the timeout alone ends the job)."""
    if world.rank == 1:
        time.sleep(60)
    ad.all_reduce(np.ones(4, np.float32))


def all_reduce_forever(world: ad.World) -> None:
    """All-reduce until stopped, after printing ``RANK r PID p`` (a test kills a launcher)."""
    print(f"RANK {world.rank} PID {os.getpid()}", flush=True)
    while True:
        ad.all_reduce(np.ones(1024, np.float32))
        time.sleep(0.01)


def fail_with_stderr_gone(world: ad.World) -> None:
    """Rank 1 raises after its stderr became a pipe nobody reads (as when the launcher that
    forwarded it died): writing the traceback fails, and the rank must still abort the job,
    not go on to the interpreter's normal exit."""
    ad.barrier()
    if world.rank == 1:
        unread, write_end = os.pipe()
        os.close(unread)
        os.dup2(write_end, 2)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the process's stderr
        print("rank 1 raises")  # left in stdout's buffer: the abort flushes it
        raise RuntimeError("rank 1 fails")
    ad.all_reduce(np.ones(4, np.float32))


def exit_late(world: ad.World) -> None:
    """Rank 1 reaches the end of its script 4 s after rank 0 (run with AXONDIST_TIMEOUT=2):
    rank 0's exit waits for it that long only, and says what it did not check."""
    ad.barrier()
    if world.rank == 1:
        time.sleep(4.0)
    print(f"rank {world.rank} ends", flush=True)


CASES = {fn.__name__: fn for fn in (skip_collective, different_groups, receive_cycle, hard_exit,
                                    unreceived_send, stuck_without_server, all_reduce_forever,
                                    fail_with_stderr_gone, exit_late)}

if __name__ == "__main__":
    main(CASES)
