"""A rank that ends its whole process, each case a small per-rank program: ``python
process_cases.py CASE mock N`` runs it on an N-rank mock world, whose ranks are threads of
one process (see ``fault_cases.main``).

After a barrier, rank 1 waits 0.3 s (the others are then waiting in all-reduce #2) and ends
the process: ``os._exit(1)``, ``os._exit(0)``, SIGKILL or SIGTERM sent to its own process,
``os.abort()``, or a segmentation fault (a read of address 0 through ctypes).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def _rank_1_then(end: Callable[[], object]) -> Callable[[ad.World], None]:
    def case(world: ad.World) -> None:
        ad.barrier()
        if world.rank == 1:
            time.sleep(0.3)
            end()
        ad.all_reduce(np.ones(4, np.float32))
        time.sleep(5)  # the process must end before this rank does

    return case


CASES = {
    "hard_exit": _rank_1_then(lambda: os._exit(1)),
    "hard_exit_zero": _rank_1_then(lambda: os._exit(0)),
    "kill_own_process": _rank_1_then(lambda: os.kill(os.getpid(), signal.SIGKILL)),
    "term_own_process": _rank_1_then(lambda: os.kill(os.getpid(), signal.SIGTERM)),
    "abort": _rank_1_then(lambda: os.abort()),
    "segfault": _rank_1_then(lambda: ctypes.string_at(0)),
}

if __name__ == "__main__":
    main(CASES)
