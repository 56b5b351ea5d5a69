"""Per-rank programs of the cluster tests: ``python -m mpi4py rank_checks.py CHECK [ARGS]``.

Each check runs on every rank of an ``mpiexec`` job on the simulated cluster, asserts
what it can see from its own rank, and prints ``CHECK OK`` (or, for ``layout``, one
``LAYOUT {json}`` line the test compares with the placement it asked for).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import warnings

import numpy as np
from mpi4py import MPI

import axondist as ad
from axondist import demo
from axondist.fsdp import FullyShardedDataParallel, ShardingStrategy
from axondist.mesh import make_mesh
from axondist.optim import SGD


def layout() -> None:
    """What MPICH and axondist say about this rank's node."""
    world = ad.init()
    shared = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    info = {"rank": world.rank, "processor": MPI.Get_processor_name(),
            "hostname": socket.gethostname(), "shared_size": shared.Get_size(),
            "node_info": list(world.node_info())}
    shared.Free()
    print("LAYOUT " + json.dumps(info), flush=True)
    ad.barrier()


def big_all_reduce(mib: str = "64") -> None:
    """One all_reduce of ``mib`` MiB of float64 through axondist, checked."""
    world = ad.init()
    x = np.full((int(mib) << 20) // 8, float(world.rank + 1))
    ad.barrier()
    ad.all_reduce(x)
    n = world.world_size
    assert np.all(x == n * (n + 1) / 2), x[:4]


def hybrid_shard(steps: str = "8") -> None:
    """HYBRID_SHARD training, node layout detected, equal to single-process training."""
    world = ad.init()
    cfg = demo.DemoConfig(strategy="fsdp", world_size=world.world_size, steps=int(steps),
                          dtype="float64")
    ref = demo.train_reference(cfg)
    x, y = demo.make_data(cfg)
    params = demo.as_parameters(demo.init_weights(cfg))
    fsdp = FullyShardedDataParallel(params, world, units=[[2 * i, 2 * i + 1]
                                                          for i in range(cfg.depth)],
                                    sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    node, local_rank, local_size = world.node_info()
    assert fsdp.shard_group is not None and fsdp.shard_group.world_size == local_size, (
        fsdp.shard_group, local_size)
    assert fsdp.shard_group.rank == local_rank, (fsdp.shard_group.rank, local_rank)
    opt = SGD(fsdp.sharded_parameters(), lr=cfg.lr, momentum=cfg.momentum)
    for step in range(cfg.steps):
        idx = demo.batch_indices(cfg, step, world.rank, world.world_size)
        fsdp.step(demo.mse_grad_fn, x[idx], y[idx], optimizer=opt)
    fsdp.gather_parameters()
    full = [np.asarray(p.data, np.float64) for p in fsdp.full_parameters()]
    want = [a.astype(np.float64) for wb in ref.weights for a in wb]
    diff = max(float(np.max(np.abs(f - w))) for f, w in zip(full, want))
    print(f"HYBRID_SHARD node {node} local {local_rank}/{local_size} shard group "
          f"{fsdp.shard_group.world_size} max diff {diff:.3g}", flush=True)
    assert diff < 1e-10, diff


def all_reduce_forever() -> None:
    """All-reduce 8 MiB again and again (a fault test breaks the job meanwhile)."""
    world = ad.init()
    x = np.ones(1 << 20)
    ad.barrier()
    print(f"STARTED rank {world.rank} on {socket.gethostname()}", flush=True)
    while True:
        ad.all_reduce(x)
        x[:] = 1.0
        time.sleep(0.01)


def mesh_placement(tp: str = "2") -> None:
    """make_mesh's warnings (as text) on this placement, one line per warning."""
    world = ad.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = make_mesh(world, int(tp))
    for w in caught:
        print(f"WARNING {w.category.__name__}: {w.message}", flush=True)
    print(f"TP GROUP {mesh.groups('tp')}", flush=True)


CHECKS = {f.__name__: f for f in (layout, big_all_reduce, hybrid_shard, all_reduce_forever,
                                  mesh_placement)}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](*sys.argv[2:])
    print(f"{sys.argv[1]} OK", flush=True)
