"""OVERLAPPED DDP with its progress helper forced on, against single-process training.

The helper thread tests the persistent all-reduces in flight while the gradient function
computes (on by itself only in a group spanning hosts); here it runs on one host too,
with a short interval, so that its tests meet the caller's starts and waits as often as
possible. Runs on the mock world and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from harness import current_size, in_ordinary_memory, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ddp_persistent import (
    data,
    grads_of,
    reference,
    samples,
    start_params,
)

from axondist import Parameter
from axondist.ddp import DDP, GradSyncStrategy

SHAPES = st.lists(st.lists(st.integers(1, 6), max_size=2).map(tuple), min_size=1, max_size=6)
LR = 0.1
THREAD = "axondist-grad-progress"


@in_ordinary_memory  # the helper tests the persistent all-reduces
def train(world, shapes, seed, steps, weighted, cap_elems, piece_elems, pause):
    params = [Parameter(a.copy(), name=f"p{i}") for i, a in enumerate(start_params(shapes, seed))]

    def grad_fn(arrays, x, y):
        loss, g = grads_of(arrays, x, y)
        for i in reversed(range(len(g))):
            time.sleep(pause)  # "compute": the helper tests the pieces in flight meanwhile
            yield i, g[i]
        return loss

    ddp = DDP(params, strategy=GradSyncStrategy.OVERLAPPED, grad_fn=grad_fn,
              bucket_cap_mb=cap_elems * 8 / 2**20, first_bucket_mb=cap_elems * 8 / 2**20)
    ddp.synchronizer.progress_interval = 1e-5
    ddp.synchronizer.piece_bytes = None if piece_elems is None else piece_elems * 8
    helper_seen = False
    for step in range(steps):
        n = samples(world.rank, weighted) if weighted else None
        ddp.backward(*data(shapes, seed, world.rank, step, 0, weighted), num_samples=n)
        helper_seen = helper_seen or ddp.synchronizer._helper is not None
        for p in params:
            p.data -= LR * p.grad
        ddp.zero_grad(set_to_none=False)
    helper = ddp.synchronizer._helper
    ddp.close()
    stopped = helper is not None and not helper._thread.is_alive()
    return [p.data.copy() for p in params], helper_seen, stopped


@settings(max_examples=15)
@given(size=world_sizes(1, 4), shapes=SHAPES, seed=st.integers(0, 2**20),
       steps=st.integers(1, 3), weighted=st.booleans(), cap_elems=st.integers(1, 40),
       piece_elems=st.sampled_from([None, 1, 3]), pause=st.sampled_from([0.0, 1e-3]))
def test_overlapped_with_the_helper_matches_one_process(size, shapes, seed, steps, weighted,
                                                        cap_elems, piece_elems, pause):
    size = current_size(size)
    expected = reference(shapes, seed, size, steps, 1, weighted)
    for params, helper_seen, stopped in run_world(train, size, shapes, seed, steps, weighted,
                                                  cap_elems, piece_elems, pause):
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        assert helper_seen and stopped  # made with the persistent all-reduces, ended by close


def _default_helper(world):
    p = Parameter(np.zeros(5), name="w")
    with DDP([p], strategy=GradSyncStrategy.OVERLAPPED) as ddp:
        p.grad = np.full(5, float(world.rank))
        ddp.sync_gradients()
        made = ddp.synchronizer._helper is not None
    _, _, local_size = world.node_info()
    return made, local_size < world.world_size, p.grad.copy()


def test_by_default_a_helper_only_where_the_group_spans_hosts():
    n = current_size(2)
    before = {t.ident for t in threading.enumerate() if t.name == THREAD}
    for made, spans_hosts, grad in run_world(_default_helper, n):
        assert made == spans_hosts
        np.testing.assert_allclose(grad, np.full(5, (n - 1) / 2))
    assert {t.ident for t in threading.enumerate() if t.name == THREAD} <= before
