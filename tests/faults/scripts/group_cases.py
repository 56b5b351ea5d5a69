"""Groups made and never destroyed, each a small per-rank program: ``python group_cases.py
CASE mock N`` runs it on an N-rank mock world, ``mpiexec -n N python group_cases.py CASE
mpi`` on MPI (see ``fault_cases.main``).

``leak``: groups of every rank made in a loop, never destroyed, until ``new_group``
refuses (``AXONDIST_MAX_GROUPS``, or MPICH's own limit of about a thousand groups); the
error is not caught. ``leak_then_free``: the same, caught; every group is destroyed and a
new group's all-reduce works. Both make at most ``AXONDIST_TEST_GROUPS`` groups (default
1,200: past MPICH's limit).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.errors import TooManyGroupsError  # noqa: E402

BOUND = int(os.environ.get("AXONDIST_TEST_GROUPS", "1200"))


def _leak(world: ad.World, groups: list[ad.ProcessGroup]) -> None:
    members = list(range(world.world_size))
    for _ in range(BOUND):
        groups.append(world.new_group(members))
    print(f"rank {world.rank}: {BOUND} groups made, none refused", flush=True)


def leak(world: ad.World) -> None:
    _leak(world, [])


def leak_then_free(world: ad.World) -> None:
    groups: list[ad.ProcessGroup] = []
    try:
        _leak(world, groups)
    except TooManyGroupsError as exc:
        print(f"rank {world.rank} refused after {len(groups)} groups: {exc}", flush=True)
    for group in groups:
        group.destroy()
    x = np.ones(2)
    with world.new_group(list(range(world.world_size))) as group:
        ad.all_reduce(x, group=group)
    assert x[0] == world.world_size
    print(f"leak_then_free OK rank {world.rank}", flush=True)


if __name__ == "__main__":
    main({f.__name__: f for f in (leak, leak_then_free)})
