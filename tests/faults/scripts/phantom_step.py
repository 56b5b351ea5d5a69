"""A checkpoint root copied without its newest step folder, each case a small per-rank
program: ``python phantom_step.py CASE mock N`` runs it on an N-rank mock world,
``mpiexec -n N python phantom_step.py CASE mpi`` on MPI, ``torchrun ... CASE torch`` on the
torch backend (see ``fault_cases.main``). The root is ``AXONDIST_TEST_ROOT``.

``copied_without_newest``: steps 1, 2 and 9 are saved with ``keep_last=3``, then step 9's
folder is removed (its checksum-valid ``latest`` still names it). Every rank then finds steps
[1, 2] on disk, loads step 2 as the latest, prints the error of a load of step 9, saves step
3 without losing step 1, and prints ``CASE OK``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_cases import main  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.checkpoint import Checkpointer, CheckpointError  # noqa: E402


def _params(value: float) -> list[ad.Parameter]:
    return [ad.Parameter(np.full((4, 3), value), "w"), ad.Parameter(np.full(5, -value), "b")]


def copied_without_newest(world: ad.World) -> None:
    root = Path(os.environ["AXONDIST_TEST_ROOT"])
    ckpt = Checkpointer(root, keep_last=3)
    for step in (1, 2, 9):
        ckpt.save(_params(float(step)), step=step)
    if world.rank == 0:
        shutil.rmtree(root / "step-00000009")
    ad.barrier()
    steps = ckpt.steps()
    assert steps == [1, 2] and ckpt.latest_step() == 2, f"rank {world.rank} sees steps {steps}"
    params = _params(0.0)
    ckpt.load(params)
    np.testing.assert_array_equal(params[0].data, np.full((4, 3), 2.0))
    try:
        ckpt.load(_params(0.0), step=9)
    except CheckpointError as exc:
        print(f"rank {world.rank}: CheckpointError: {exc}", flush=True)
    else:
        raise AssertionError("a load of the missing step 9 succeeded")
    ad.barrier()
    ckpt.save(_params(3.0), step=3)
    assert ckpt.steps() == [1, 2, 3], ckpt.steps()
    params = _params(0.0)
    ckpt.load(params, step=1)  # kept: the phantom did not count towards keep_last
    np.testing.assert_array_equal(params[1].data, np.full(5, -1.0))
    ad.barrier()
    print(f"copied_without_newest OK rank {world.rank}", flush=True)


if __name__ == "__main__":
    main({f.__name__: f for f in (copied_without_newest,)})
