"""Groups on the torch backend, as a per-rank program: ``torchrun --nproc-per-node N
torch_group_cases.py CASE torch`` (see ``fault_cases.main``).

``threads_per_group``: 30 groups of every rank, each used once by a blocking and a
non-blocking all-reduce and left alive; prints ``THREADS r: before after groups`` (the
process's threads, from /proc) and ``threads_per_group OK``.
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

GROUPS = 30


def _threads() -> int:
    """The process's OS threads once those ending have gone: the fewest of ten looks 20 ms
    apart (a thread that was joined can stay in ``/proc/self/task`` for a moment)."""
    counts = []
    for _ in range(10):
        counts.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
        time.sleep(0.02)
    return min(counts)


def threads_per_group(world: ad.World) -> None:
    members = list(range(world.world_size))
    x = np.ones(4)
    ad.all_reduce(x, async_op=True).wait()  # the world's own threads, if any, start first
    before = _threads()
    groups = [world.new_group(members) for _ in range(GROUPS)]
    for group in groups:
        ad.all_reduce(x, group=group)
        ad.all_reduce(x, group=group, async_op=True).wait()
    print(f"THREADS {world.rank}: {before} {_threads()} {GROUPS}", flush=True)
    for group in groups:
        group.destroy()
    print(f"threads_per_group OK rank {world.rank}", flush=True)


if __name__ == "__main__":
    main({threads_per_group.__name__: threads_per_group})
