"""Mismatches of all_gather without ``sizes=`` (whose row counts travel with the check on
MPI) and of all_gather and broadcast too big to ride with the check (sent point to point
after it in a group of two), each a small per-rank program: ``python blockwise_cases.py
CASE mock N`` on an N-rank mock world, ``mpiexec -n N python blockwise_cases.py CASE mpi``
on MPI.

A case that must fail ends non-zero with a message naming the operation and what the
ranks disagree on; a case that must not fail prints ``CASE OK`` on every rank.
"""

from __future__ import annotations

import numpy as np
from fault_cases import main  # this folder: python puts it on sys.path

import axondist as ad

#: Rows of float64 past what rides with the check (64 KiB).
BIG = 9000


def rows_dtype(world: ad.World) -> None:
    last = world.rank == world.world_size - 1
    ad.all_gather(np.ones((world.rank + 1, 3), np.float64 if last else np.float32))


def rows_trailing(world: ad.World) -> None:
    last = world.rank == world.world_size - 1
    ad.all_gather(np.ones((world.rank + 1,) + ((2, 2) if last else (3,))))


def rows_big_dtype(world: ad.World) -> None:
    # rank 0's rows do not ride with the check; the last rank's dtype differs
    last = world.rank == world.world_size - 1
    rows = BIG if world.rank == 0 else 2
    ad.all_gather(np.ones(rows, np.float32 if last else np.float64))


def rows_vs_sizes(world: ad.World) -> None:
    x = np.ones((2, 3))
    if world.rank == 0:
        ad.all_gather(x, sizes=[2] * world.world_size)
    else:
        ad.all_gather(x)


def rows_vs_broadcast(world: ad.World) -> None:
    x = np.ones(16, np.float32)
    if world.rank == 0:
        ad.all_gather(x)
    else:
        ad.broadcast(x, src=0)


def rows_mismatch_caught_then_good(world: ad.World) -> None:
    n, last = world.world_size, world.rank == world.world_size - 1
    for rows in (1, BIG):  # riding and not
        try:
            ad.all_gather(np.ones((rows, 2), np.int32 if last else np.int64))
        except ad.CollectiveMismatchError as exc:
            assert "all_gather: ranks disagree on dtype" in str(exc), exc
        else:
            raise AssertionError("a dtype mismatch passed")
        x = np.full((world.rank + rows, 2), world.rank, np.int64)
        got = ad.all_gather(x)
        want = np.concatenate([np.full((r + rows, 2), r, np.int64) for r in range(n)])
        np.testing.assert_array_equal(got, want)
    print(f"rows_mismatch_caught_then_good OK rank {world.rank}", flush=True)


def big_sizes_mismatch(world: ad.World) -> None:
    # every rank believes rank 0 sends BIG rows; rank 0 sends one more
    sizes = [BIG] * world.world_size
    x = np.ones(BIG + (world.rank == 0))
    ad.all_gather(x, sizes=[BIG + 1] + sizes[1:] if world.rank == 0 else sizes)


def big_src_mismatch(world: ad.World) -> None:
    ad.broadcast(np.full(BIG, float(world.rank)), src=min(world.rank, 1))


def big_gather_vs_broadcast(world: ad.World) -> None:
    x = np.ones(BIG)
    if world.rank == 0:
        ad.all_gather(x, sizes=[BIG] * world.world_size)
    else:
        ad.broadcast(x, src=0)


def big_mismatch_caught_then_good(world: ad.World) -> None:
    n, rank = world.world_size, world.rank
    try:
        ad.broadcast(np.full(BIG, float(rank)), src=min(rank, 1))
    except ad.CollectiveMismatchError as exc:
        assert "broadcast: ranks disagree on root" in str(exc), exc
    else:
        raise AssertionError("a root mismatch passed")
    x = np.full(BIG, float(rank))
    ad.broadcast(x, src=n - 1)
    np.testing.assert_array_equal(x, np.full(BIG, float(n - 1)))
    got = ad.all_gather(np.full(BIG, float(rank)), sizes=[BIG] * n)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=float), BIG))
    print(f"big_mismatch_caught_then_good OK rank {rank}", flush=True)


def ride_vs_exchange_caught_then_good(world: ad.World) -> None:
    # rank 0's reduce-scatter is small enough to ride with the check (two ranks on MPI); the
    # last rank's sends its block ahead of it: both name the shapes, and nothing is left
    n, rank, last = world.world_size, world.rank, world.rank == world.world_size - 1
    try:
        ad.reduce_scatter(np.ones(BIG if last else 8 * n))
    except ad.CollectiveMismatchError as exc:
        assert "reduce_scatter: ranks disagree on shape" in str(exc), exc
    else:
        raise AssertionError("a shape mismatch passed")
    got = ad.reduce_scatter(np.arange(8 * n, dtype=np.float64) + rank)
    whole = sum(np.arange(8 * n, dtype=np.float64) + r for r in range(n))
    np.testing.assert_array_equal(got, np.array_split(whole, n)[rank])
    got = ad.all_gather(np.full(3, float(rank)), sizes=[3] * n)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=float), 3))
    print(f"ride_vs_exchange_caught_then_good OK rank {rank}", flush=True)


CASES = {f.__name__: f for f in (rows_dtype, rows_trailing, rows_big_dtype, rows_vs_sizes,
                                  rows_vs_broadcast, rows_mismatch_caught_then_good,
                                  big_sizes_mismatch, big_src_mismatch, big_gather_vs_broadcast,
                                  big_mismatch_caught_then_good,
                                  ride_vs_exchange_caught_then_good)}


if __name__ == "__main__":
    main(CASES)
