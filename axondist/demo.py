"""The demo behind ``python -m axondist demo``."""

from __future__ import annotations

import numpy as np

from . import comm
from .launch import spawn
from .process_group import World


def _rank_gradient(world: World) -> np.ndarray:
    rng = np.random.default_rng(world.rank)
    grad = rng.standard_normal(4).astype(np.float32)
    local = grad.copy()
    comm.all_reduce_mean(grad)
    return np.stack([local, grad])


def run_demo(world_size: int = 4) -> int:
    """Average per-rank gradients on a mock world and check them against NumPy."""
    results = spawn(_rank_gradient, world_size)
    for r, pair in enumerate(results):
        print(f"rank {r}: local grad {np.round(pair[0], 4)} -> averaged {np.round(pair[1], 4)}")
    expected = np.mean([pair[0] for pair in results], axis=0)
    ok = all(np.allclose(pair[1], expected, rtol=1e-6) for pair in results)
    print("all ranks agree with numpy.mean:", "yes" if ok else "NO")
    return 0 if ok else 1
