"""Per-rank programs of the slow-link and hierarchical tests: ``python -m mpi4py
slow_link_checks.py CHECK [ARGS]``; each prints ``CHECK OK`` when its assertions hold."""

from __future__ import annotations

import json
import sys

import numpy as np

import axondist as ad


def hierarchical_equals_flat(expect: str = "hierarchical") -> None:
    """The node layout as detected; HierarchicalAllReduce against the flat all_reduce for
    several sizes, dtypes and ops (``expect``: "hierarchical", or "flat" on uneven nodes)."""
    world = ad.init()
    with ad.HierarchicalAllReduce(world, min_bytes=0) as hier:
        assert hier.is_hierarchical == (expect == "hierarchical"), hier
        print("PLAN " + json.dumps([list(r) for r in hier.plan.within]), flush=True)
        rng = np.random.default_rng(world.rank)
        for n in (0, 1, 3, 1000, (1 << 20) + 7):
            for dtype, op in ((np.float64, "sum"), (np.float32, "average"), (np.int32, "max"),
                              (np.int64, "sum")):
                x = (rng.standard_normal(n) * 100).astype(dtype)
                flat = ad.all_reduce(x.copy(), op)
                got = hier(x, op)
                assert got is x
                if np.issubdtype(dtype, np.integer):
                    assert np.array_equal(x, flat), (n, dtype, op)
                else:
                    np.testing.assert_allclose(x, flat, rtol=1e-5, atol=1e-4,
                                               err_msg=f"{n} {dtype} {op}")
        ad.barrier()


def big_all_reduce(mib: str = "16") -> None:
    """One all_reduce of ``mib`` MiB of float64, checked (the slow links carry it)."""
    world = ad.init()
    x = np.full((int(mib) << 20) // 8, float(world.rank + 1))
    ad.all_reduce(x)
    n = world.world_size
    assert np.all(x == n * (n + 1) / 2), x[:4]


CHECKS = {f.__name__: f for f in (hierarchical_equals_flat, big_all_reduce)}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](*sys.argv[2:])
    print(f"{sys.argv[1]} OK", flush=True)
