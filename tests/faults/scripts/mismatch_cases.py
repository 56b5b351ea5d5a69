"""Mistakes whose messages must read the same on every backend, each a small per-rank
program: ``python mismatch_cases.py CASE mock N`` runs it on an N-rank mock world,
``mpiexec -n N python mismatch_cases.py CASE mpi`` on MPI, ``torchrun ... CASE torch`` on the
torch backend (see ``fault_cases.main``).

Ranks that call different collectives (the last rank calls another one), a mismatched shape,
``sizes=`` given on one rank only, ``op=None``, torch's own ReduceOp members, sends that are
never received (one and three), and a rank waiting in an all-reduce whose description the
error prints. A case that must fail ends non-zero naming the mistake; one that must not
prints ``CASE OK`` on every rank.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def _last(world: ad.World) -> bool:
    return world.rank == world.world_size - 1


def reduce_vs_broadcast(world: ad.World) -> None:
    x = np.ones(16, np.float32)
    if _last(world):
        ad.broadcast(x, src=0)
    else:
        ad.all_reduce(x)


def reduce_vs_gather(world: ad.World) -> None:
    x = np.ones(16, np.float32)
    if _last(world):
        ad.all_gather(x)
    else:
        ad.all_reduce(x)


def reduce_vs_reduce_scatter(world: ad.World) -> None:
    """Equal dtype, shape and op: only the collectives differ."""
    x = np.ones(6 * world.world_size, np.float32)
    if _last(world):
        ad.reduce_scatter(x)
    else:
        ad.all_reduce(x)


def shape_mismatch(world: ad.World) -> None:
    ad.all_reduce(np.ones(3 + world.rank, np.float32))


def sizes_on_one_rank(world: ad.World) -> None:
    x = np.ones((2, 3))
    if world.rank == 0:
        ad.all_gather(x, sizes=[2] * world.world_size)
    else:
        ad.all_gather(x)


def op_none(world: ad.World) -> None:
    ad.all_reduce(np.ones(4, np.float32), op=None)  # type: ignore[arg-type]


def torch_ops(world: ad.World) -> None:
    """torch.distributed.ReduceOp members are taken as ours."""
    import torch.distributed as dist

    n = world.world_size
    x = np.arange(4, dtype=np.float64) * (world.rank + 1)
    ad.all_reduce(x, op=dist.ReduceOp.MAX)
    np.testing.assert_array_equal(x, np.arange(4) * n)
    y = np.full(2 * n, world.rank + 1.0)
    block = ad.reduce_scatter(y, op=dist.ReduceOp.AVG)
    np.testing.assert_allclose(block, np.full(2, (n + 1) / 2))
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        z = np.full(3, world.rank + 2.0)
        ad.all_reduce(z, op=op)
        want = {"SUM": sum, "MIN": min, "PRODUCT": np.prod}[op.name](
            [r + 2.0 for r in range(n)])
        np.testing.assert_array_equal(z, np.full(3, want))
    try:
        ad.all_reduce(np.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as exc:
        print(f"rank {world.rank}: {exc}", flush=True)
    else:
        raise AssertionError("torch's BAND was accepted")
    print(f"torch_ops OK rank {world.rank}", flush=True)


def one_unreceived_send(world: ad.World) -> None:
    if world.rank == 0:
        ad.send(np.ones(4, np.float32), dst=1)
    ad.barrier()


def three_unreceived_sends(world: ad.World) -> None:
    if world.rank == 0:
        for k in range(3):
            ad.send(np.full(k + 1, 1.0), dst=1)
    ad.barrier()


def send_after_the_peer_left(world: ad.World) -> None:
    """Rank 0 sends once rank 1 has gone to its exit, where nothing will receive it: rank 1's
    exit still names the message (it learns what it is owed, it does not look for a while)."""
    ad.barrier()
    if world.rank == 0:
        time.sleep(0.3)  # the others are at their exit by now (on a loaded host, maybe not)
        ad.send(np.ones(2), dst=1)


def waits_in_all_reduce(world: ad.World) -> None:
    """Rank 0 waits to receive from rank 1, which waits in an all-reduce for rank 0: the
    error describes rank 1's call, each field once."""
    if world.rank == 0:
        ad.recv(src=1)
    else:
        ad.all_reduce(np.ones(4, np.float32), op="max")


CASES = {f.__name__: f for f in (
    reduce_vs_broadcast, reduce_vs_gather, reduce_vs_reduce_scatter, shape_mismatch,
    sizes_on_one_rank, op_none, torch_ops, one_unreceived_send, three_unreceived_sends,
    send_after_the_peer_left, waits_in_all_reduce)}

if __name__ == "__main__":
    main(CASES)
