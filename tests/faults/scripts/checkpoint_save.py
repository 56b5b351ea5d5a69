"""One save of an FSDP model (every rank writes shards) into a checkpoint root, under mpiexec.

``python checkpoint_save.py ROOT SEED STEP [FAULT_RANK FAULT]``: builds the model of
``SEED`` with an Adam step taken, and saves it as step ``STEP``. With ``FAULT`` (for
example ``kill:3``), rank ``FAULT_RANK`` alone gets ``AXONDIST_CHECKPOINT_FAULT=FAULT``.
Prints ``saved``, or ``CheckpointError: ...`` and exits 3. Also prints ``pid=...`` and, when
a fault was set but did not fire, ``events=N`` (how many changes the rank made).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import axondist as ad
from axondist.checkpoint import files, save_sharded_checkpoint
from axondist.errors import CheckpointError
from axondist.optim import Adam

SHAPES = [(6, 5), (6,), (3, 6), (3,)]
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def dense(seed: int) -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, 11])
    return [ad.Parameter(rng.standard_normal(s), n) for n, s in zip(NAMES, SHAPES)]


def main() -> int:
    root, seed, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    world = ad.init()
    if len(sys.argv) > 5 and world.rank == int(sys.argv[4]):
        os.environ[files.FAULT_ENV] = sys.argv[5]
    print(f"pid={os.getpid()}", flush=True)
    f = ad.FSDP(dense(seed), world, sharding_strategy="full_shard")
    opt = Adam(f.sharded_parameters(), lr=0.1)
    for p in f.sharded_parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    try:
        save_sharded_checkpoint(root, f, opt, step=step, metadata={"seed": seed})
    except CheckpointError as exc:
        print(f"CheckpointError: {exc}", flush=True)
        return 3
    if os.environ.get(files.FAULT_ENV):
        print(f"events={next(files._events) - 1}", flush=True)
    print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
