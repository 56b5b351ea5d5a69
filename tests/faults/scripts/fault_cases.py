"""Fault cases, each a small per-rank program: ``python fault_cases.py CASE mock N`` runs it
on an N-rank mock world, ``mpiexec -n N python fault_cases.py CASE mpi`` on MPI,
``torchrun --nproc-per-node N fault_cases.py CASE torch`` on the torch backend.

A case that must fail ends non-zero with a message naming the operation and the
ranks; a case that must not fail prints ``CASE OK`` on every rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np

import axondist as ad


def skip_collective(world: ad.World) -> None:
    if world.rank != 1:  # rank 1 skips the all_reduce and its function (script) ends
        ad.all_reduce(np.ones(4, np.float32))


def exit0(world: ad.World) -> None:
    if world.rank == 1:
        sys.exit(0)
    ad.all_reduce(np.ones(4, np.float32))


def exit1(world: ad.World) -> None:
    if world.rank == 1:
        sys.exit(1)
    ad.all_reduce(np.ones(4, np.float32))


def finally_barrier(world: ad.World) -> None:
    if world.rank == 1:
        try:
            raise ValueError("boom in rank 1's step")
        finally:
            ad.barrier()
    ad.all_reduce(np.ones(4, np.float32))


def stuck(world: ad.World) -> None:
    if world.rank == 1:
        time.sleep(60)  # busy in its own code past the timeout
    ad.all_reduce(np.ones(4, np.float32))


def monitored(world: ad.World) -> None:
    if world.rank == 1:
        time.sleep(60)
    ad.monitored_barrier(timeout=3)


def killed(world: ad.World) -> None:
    ad.barrier()
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ad.all_reduce(np.ones(4, np.float32))


def wrong_group(world: ad.World) -> None:
    pair = world.new_group([0, 1])
    if world.rank == 0:
        ad.all_reduce(np.ones(4, np.float32), group=pair)
    else:
        ad.all_reduce(np.ones(4, np.float32))


def send_no_recv(world: ad.World) -> None:
    if world.rank == 0:
        ad.send(np.ones(1 << 20, np.float32), dst=1)  # 4 MiB: MPI waits for the receive
    ad.barrier()


def recv_no_send(world: ad.World) -> None:
    if world.rank == 1:
        ad.recv(src=0)
    ad.barrier()


def recv_recv(world: ad.World) -> None:
    if world.rank in (0, 1):
        ad.recv(src=1 - world.rank)
        ad.send(np.ones(4), dst=1 - world.rank)


def dtype_same_bytes(world: ad.World) -> None:
    x = np.ones(1, np.float64) if world.rank == 1 else np.ones(2, np.float32)
    ad.all_reduce(x)


def int_vs_float(world: ad.World) -> None:
    x = np.ones(4, np.int32) if world.rank == 1 else np.ones(4, np.float32)
    ad.all_reduce(x)


def op_mismatch(world: ad.World) -> None:
    x = np.arange(4, dtype=np.float32) + world.rank
    ad.all_reduce(x, op="max" if world.rank == world.world_size - 1 else "sum")


def sizes_mismatch(world: ad.World) -> None:
    n = world.world_size
    rows = [2] * n
    if world.rank == 1:
        rows[0] = 1  # rank 1 believes rank 0 sends one row; rank 0 sends two
    x = np.full((rows[world.rank], 3), float(world.rank))
    ad.all_gather(x, sizes=rows)


def src_mismatch(world: ad.World) -> None:
    # each rank believes it is the source: two small broadcasts that must not both "win"
    ad.broadcast(np.full(16, float(world.rank)), src=min(world.rank, 1))


def gather_vs_broadcast(world: ad.World) -> None:
    x = np.ones(16, np.float32)
    if world.rank == 0:
        ad.all_gather(x, sizes=[16] * world.world_size)
    else:
        ad.broadcast(x, src=0)


def scatter_op_mismatch(world: ad.World) -> None:
    x = np.ones(4 * world.world_size, np.float32)
    ad.reduce_scatter(x, op="max" if world.rank == world.world_size - 1 else "sum")


def shape_mismatch_small(world: ad.World) -> None:
    ad.all_reduce(np.ones(1024 if world.rank == 0 else 2048, np.float32))


def small_vs_large(world: ad.World) -> None:
    ad.all_reduce(np.ones(1024 if world.rank == 0 else 1 << 20, np.float32))


def async_mismatch(world: ad.World) -> None:
    x = np.ones(4, np.float32)
    if world.rank == 0:
        ad.all_reduce(x)
    else:
        ad.all_reduce(x, async_op=True).wait()


def mismatch_caught_then_good(world: ad.World) -> None:
    """Must not fail: after a caught shape mismatch the next all-reduce is right."""
    try:
        ad.all_reduce(np.ones(8 if world.rank == 0 else 9, np.float32))
    except ad.CollectiveMismatchError as exc:
        assert "disagree on shape" in str(exc), exc
    else:
        raise AssertionError("a shape mismatch was accepted")
    x = np.full(1000, world.rank + 1.0)
    ad.all_reduce(x)
    assert (x == world.world_size * (world.world_size + 1) / 2).all(), x[:4]
    print(f"mismatch_caught_then_good OK rank {world.rank}", flush=True)


def ddp_num_samples(world: ad.World) -> None:
    p = ad.Parameter(np.ones(8, np.float32), name="w")
    ddp = ad.DDP([p])
    p.grad = np.full(8, float(world.rank), np.float32)
    ddp.sync_gradients(num_samples=10 if world.rank == 0 else None)


def recv_wrong_out_then_good(world: ad.World) -> None:
    """Must not fail: a receive into a wrong buffer is refused, the next one is right."""
    if world.rank == 0:
        ad.send(np.arange(3, dtype=np.float32), dst=1)
        ad.send(np.arange(5, dtype=np.float32), dst=1)
    elif world.rank == 1:
        try:
            ad.recv(0, out=np.empty(4, np.float32))
        except ad.CollectiveMismatchError as exc:
            assert "float32[3]" in str(exc), exc
        else:
            raise AssertionError("a receive into a buffer of the wrong size was accepted")
        got = ad.recv(0)
        np.testing.assert_array_equal(got, np.arange(5, dtype=np.float32))
    ad.barrier()
    print(f"recv_wrong_out_then_good OK rank {world.rank}", flush=True)


def many_groups(world: ad.World) -> None:
    """Must not fail: groups created and destroyed 2,100 times (``AXONDIST_FAULT_GROUPS``):
    past MPICH's 2,048 communicators even at one per group (a group holds two, so ~1,020
    groups never freed exhaust them). A bound on the work, not on the time: under load
    each creation takes longer, not more of them are needed."""
    members = list(range(world.world_size))
    for _ in range(int(os.environ.get("AXONDIST_FAULT_GROUPS", "2100"))):
        with world.new_group(members) as group:
            pass
        assert not group.is_member
    x = np.ones(2)
    with world.new_group(members) as group:
        ad.all_reduce(x, group=group)
    assert x[0] == world.world_size
    print(f"many_groups OK rank {world.rank}", flush=True)


CASES = {f.__name__: f for f in (
    skip_collective, exit0, exit1, finally_barrier, stuck, monitored, killed, wrong_group,
    send_no_recv, recv_no_send, recv_recv, dtype_same_bytes, int_vs_float, op_mismatch,
    sizes_mismatch, src_mismatch, gather_vs_broadcast, scatter_op_mismatch,
    shape_mismatch_small, small_vs_large, async_mismatch, mismatch_caught_then_good,
    ddp_num_samples, recv_wrong_out_then_good, many_groups)}


def ddp_overlapped_stall(world: ad.World) -> None:
    """After a first good step, rank 1 stops in its own code before its first bucket of
    the next: it never starts that bucket's persistent all-reduce, and the ranks waiting
    for it name it."""
    params = [ad.Parameter(np.zeros(1000, np.float32), name=f"w{i}") for i in range(2)]
    ddp = ad.DDP(params, strategy="overlapped", bucket_cap_mb=0.001, first_bucket_mb=0.001)
    steps = iter(range(2))

    def grad_fn(arrays: list) -> object:
        if next(steps) == 1 and world.rank == 1:
            time.sleep(60)
        yield 1, np.ones(1000, np.float32)
        yield 0, np.ones(1000, np.float32)
        return 0.0

    for _ in range(2):
        ddp.backward(grad_fn)


CASES[ddp_overlapped_stall.__name__] = ddp_overlapped_stall


def main(cases: dict[str, Any]) -> None:
    """Run case ``argv[1]`` of ``cases`` on the world ``argv[2]`` names: ``mpi`` or
    ``torch`` (this process is one rank under mpiexec or torchrun) or ``mock`` with
    ``argv[3]`` ranks."""
    case, mode = sys.argv[1], sys.argv[2]
    fn = cases[case]
    if mode in ("mpi", "torch"):
        world = ad.init(mode)
        if mode == "torch":  # importing torch takes seconds: the fault's clock starts here
            print(f"{case} ready at {time.time():.3f}", flush=True)
        fn(world)
    else:
        ad.spawn(fn, int(sys.argv[3]))


if __name__ == "__main__":
    main(CASES)
