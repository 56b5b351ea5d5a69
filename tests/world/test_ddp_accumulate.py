"""Accumulating into a bucket view weights the sum in the same pass
(``GradientSynchronizer.accumulate``), with the arithmetic of ``slot += grad`` followed by
``add_gradient(slot)``: bit for bit, for every block size, strategy, dtype mix and weight.
Runs on the mock world and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import current_size, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist import Parameter
from axondist.ddp import DDP, GradientSynchronizer, GradSyncStrategy

SHAPES = st.lists(st.lists(st.integers(1, 9), max_size=2).map(tuple), min_size=1, max_size=5)


def _both_ways(world, shapes, seed, strategy, block, weighted, wide_grads):
    rng = np.random.default_rng([seed, world.rank])
    old = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float64 if wide_grads else np.float32)
             for s in shapes]
    n = float(1 + world.rank) if weighted else None
    results = []
    for fused in (True, False):
        sync = GradientSynchronizer(strategy, bucket_size=7)
        sync.ACCUMULATE_BLOCK = block
        sync.prepare([np.zeros(s, np.float32) for s in shapes])
        for i in range(len(shapes)):
            sync.slot(i)[...] = old[i]
        sync.start(world, num_samples=n)
        for i in reversed(range(len(shapes))):
            if fused:
                sync.accumulate(i, grads[i])
            else:
                view = sync.slot(i)
                view += grads[i]
                sync.add_gradient(i, view)
        results.append([g.copy() for g in sync.finish()])
        sync.close()
    return results


@settings(max_examples=25)
@given(size=world_sizes(1, 4), shapes=SHAPES, seed=st.integers(0, 2**20),
       strategy=st.sampled_from(["synchronous", "overlapped", "no_sync"]),
       block=st.integers(1, 20), weighted=st.booleans(), wide_grads=st.booleans())
def test_accumulate_equals_add_then_hand_over_bit_for_bit(size, shapes, seed, strategy, block,
                                                          weighted, wide_grads):
    size = current_size(size)
    for fused, plain in run_world(_both_ways, size, shapes, seed, strategy, block, weighted,
                                  wide_grads):
        for a, b in zip(fused, plain):
            np.testing.assert_array_equal(a, b)


def _ddp_micro_batches(world, block):
    """Two micro-batches under no_sync, then a synchronized one, into bucket views."""
    params = [Parameter(np.zeros((300, 7), np.float32), name="w"),
              Parameter(np.zeros(5, np.float32), name="b")]

    def grad_fn(arrays, micro):
        for i in reversed(range(len(arrays))):
            yield i, np.full(arrays[i].shape, (world.rank + 1.0) * micro, np.float32)
        return 0.0

    ddp = DDP(params, bucket_cap_mb=0.004, grad_fn=grad_fn)
    ddp.synchronizer.ACCUMULATE_BLOCK = block
    for _ in range(2):
        ddp.zero_grad(set_to_none=False)
        for micro in (1, 2):
            with ddp.no_sync():
                ddp.backward(micro)
        ddp.backward(3)
    views = [p.grad is ddp.synchronizer.slot(i) for i, p in enumerate(params)]
    ddp.close()
    return [p.grad.copy() for p in params], views


@pytest.mark.parametrize("block", [1, 64, 1 << 16])
def test_ddp_accumulates_micro_batches_into_bucket_views(block):
    n = current_size(3)
    want = (1 + 2 + 3) * (n + 1) / 2  # each rank adds (rank + 1) * (1 + 2 + 3); the mean
    for out, views in run_world(_ddp_micro_batches, n, block):
        assert all(views)
        for g in out:
            np.testing.assert_allclose(g, want, rtol=1e-6)


def test_accumulate_refuses_a_second_hand_over_and_a_wrong_shape():
    def body(world):
        sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, group=world)
        sync.prepare([(3,), (2,)])
        sync.accumulate(0, np.ones(3))
        with pytest.raises(ValueError, match=r"GradientSynchronizer.accumulate: gradient 0 was "
                                             r"already added in this step"):
            sync.accumulate(0, np.ones(3))
        with pytest.raises(ValueError, match=r"GradientSynchronizer.accumulate: gradient 1 has "
                                             r"shape \(3,\), its parameter has \(2,\)"):
            sync.accumulate(1, np.ones(3))
        with pytest.raises(IndexError, match="GradientSynchronizer.accumulate: gradient index 5"):
            sync.accumulate(5, np.ones(3))
        with pytest.raises(TypeError, match="accumulate"):
            sync.accumulate(1, np.ones(2, np.complex64))

    run_world(body, 1)
