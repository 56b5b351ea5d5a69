"""DDP gradients that cannot be averaged, and a rank leaving before DDP's or FSDP's gradient
sync, each a small per-rank program: ``python
ddp_cases.py CASE mock N`` runs it on an N-rank mock world, ``mpiexec -n N python
ddp_cases.py CASE mpi`` on MPI (see ``fault_cases.main``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402


def _ddp(world: ad.World, strategy: str) -> tuple[ad.DDP, list[ad.Parameter]]:
    params = [ad.Parameter(np.ones(4), name="w0"), ad.Parameter(np.ones(3), name="w1")]
    return ad.DDP(params, world, strategy=strategy, bucket_cap_mb=1e-5,
                  first_bucket_mb=1e-5), params


def object_grad_every_rank(world: ad.World) -> None:
    """Every rank sets an object-dtype ``.grad`` and syncs (OVERLAPPED, a bucket per array)."""
    ddp, params = _ddp(world, "overlapped")
    params[0].grad = np.ones(4)
    params[1].grad = np.array([1.0, None, 2.0], dtype=object)
    ddp.sync_gradients()


def object_grad_one_rank(world: ad.World) -> None:
    """Only the last rank's grad_fn returns an object-dtype gradient; the others step."""
    ddp, params = _ddp(world, "synchronous")

    def grad_fn(arrays: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        last = world.rank == world.world_size - 1
        bad = np.array([1.0, None, 2.0], dtype=object) if last else np.ones(3)
        return 0.0, [np.ones(4), bad]

    ddp.backward(grad_fn)


def last_rank_leaves_before_the_sync(world: ad.World) -> None:
    """The last rank leaves while the others wait in DDP's synchronous sum of a 1 MiB bucket
    (in memory both ranks map under ``mpiexec -n 2``: the sum's check and its done message)."""
    params = [ad.Parameter(np.ones((512, 512), np.float32), name="w0")]
    ddp = ad.DDP(params, world)
    if world.rank == world.world_size - 1:
        sys.exit(1)
    ddp.backward(lambda arrays: (0.0, [np.ones((512, 512), np.float32)]))


def last_rank_leaves_before_fsdps_sync(world: ad.World) -> None:
    """The last rank leaves while the others wait in FSDP's reduce-scatter of a 1 MiB unit
    (packed in memory both ranks map under ``mpiexec -n 2``: the reduce-scatter's check and
    its done message)."""
    from axondist.fsdp import FSDP

    params = [ad.Parameter(np.ones((512, 512), np.float32), name="w0")]
    f = FSDP(params, world)
    f.gather_parameters()
    params[0].grad = np.ones((512, 512), np.float32)
    f.reshard_parameters()
    if world.rank == world.world_size - 1:
        sys.exit(1)
    f.sync_gradients()


CASES = {f.__name__: f for f in (object_grad_every_rank, object_grad_one_rank,
                                 last_rank_leaves_before_the_sync,
                                 last_rank_leaves_before_fsdps_sync)}

if __name__ == "__main__":
    main(CASES)
