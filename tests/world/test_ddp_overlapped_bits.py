"""DDP's OVERLAPPED strategy (persistent all-reduces started piece by piece) trains to
SYNCHRONOUS's bits, equal or sample-weighted means. Runs on the mock world and unchanged
under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import numpy as np
from harness import current_size, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.ddp import DDP, GradSyncStrategy
from axondist.parameter import Parameter

SYNC, OVER = GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED


SHAPES = [(700, 1000), (700,), (900, 1100), (50,), (1200, 800)]  # 2.8-4 MB each


def _train(world, strategy, weighted):
    rng = np.random.default_rng(11)
    params = [Parameter(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
    ddp = DDP(params, world, strategy=strategy, init_sync=False)
    for step in range(2):
        g = np.random.default_rng([step, world.rank])
        for p in params:
            p.grad = g.standard_normal(p.shape).astype(np.float32)
        ddp.sync_gradients(num_samples=(1 + world.rank) if weighted else None)
        for p in params:
            p.data -= 0.1 * p.grad
    ddp.close()
    return [p.data.copy() for p in params]


@settings(max_examples=4, deadline=None)
@given(size=world_sizes(1, 3), weighted=st.booleans())
def test_ddp_overlapped_keeps_synchronous_bits_with_default_pieces(size, weighted):
    """With the default pieces, on any number of ranks: OVERLAPPED's parameters equal
    SYNCHRONOUS's bit for bit, and both are single-process training on the weighted mean
    within float32's rounding."""
    size = current_size(size)
    over = run_world(_train, size, OVER, weighted)
    sync = run_world(_train, size, SYNC, weighted)
    counts = [1 + r if weighted else 1 for r in range(size)]
    rng = np.random.default_rng(11)
    want = [rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in SHAPES]
    for step in range(2):
        every = []
        for r in range(size):
            g = np.random.default_rng([step, r])
            every.append([g.standard_normal(s).astype(np.float32) for s in SHAPES])
        for i in range(len(SHAPES)):
            want[i] = want[i] - 0.1 * sum(c / sum(counts) * e[i].astype(np.float64)
                                          for c, e in zip(counts, every))
    for a, b in zip(over, sync):
        for x, y, ref in zip(a, b, want):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5)
