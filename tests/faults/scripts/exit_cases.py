"""Correct torch jobs that end by reaching the end of their script, as per-rank programs:
``torchrun --nproc-per-node N exit_cases.py CASE torch`` (see ``fault_cases.main``). Each
rank prints ``CASE OK`` last; the process must then exit with status 0, whatever threads
torch and axondist still hold.

``one_all_reduce``: ``init`` and one all-reduce. ``threads_and_groups``: also a
non-blocking all-reduce (a thread issues it), a small send and its receive (a thread sends
it), a group left undestroyed and a destroyed one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def one_all_reduce(world: ad.World) -> None:
    x = np.ones(4)
    ad.all_reduce(x)
    assert x[0] == world.world_size, x
    print(f"one_all_reduce OK rank {world.rank}", flush=True)


def threads_and_groups(world: ad.World) -> None:
    n, rank = world.world_size, world.rank
    kept = world.new_group(list(range(n)))  # never destroyed: the exit frees it
    with world.new_group(list(range(n))) as group:
        ad.all_reduce(np.ones(2), group=group)
    x = np.ones(8)
    ad.all_reduce(x, group=kept, async_op=True).wait()
    ad.send(np.full(3, float(rank)), dst=(rank + 1) % n)
    got = ad.recv(src=(rank - 1) % n)
    assert x[0] == n and got[0] == (rank - 1) % n, (x, got)
    print(f"threads_and_groups OK rank {rank}", flush=True)


CASES = {fn.__name__: fn for fn in (one_all_reduce, threads_and_groups)}

if __name__ == "__main__":
    main(CASES)
