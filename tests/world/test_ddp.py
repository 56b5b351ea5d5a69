"""DistributedDataParallel against single-process training on the whole batch.

Every rank derives every rank's data from seeds, so each rank can compute the
single-process reference and check its own parameters. Runs on the mock
world and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from harness import current_size, mock_only, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist
from axondist import CollectiveMismatchError, Parameter
from axondist.ddp import (
    DDP,
    DistributedDataParallel,
    GradientSynchronizer,
    GradSyncStrategy,
    sum_hook,
)
from axondist.errors import NonFiniteNormError, UnsupportedDTypeError
from axondist.optim import SGD, Adam

SYNC, OVER = GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED
SHAPES = st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=6)


# --- the model: y_hat = tanh(phi . theta), theta = all parameters flattened --------------

def init_params(shapes, seed, rank, dtype=np.float64):
    rng = np.random.default_rng([seed, rank, 7])
    return [Parameter((0.3 * rng.standard_normal(s)).astype(dtype), name=f"p{i}")
            for i, s in enumerate(shapes)]


def batch(shapes, seed, rank, step, n, micro=0):
    dim = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng([seed, rank, step, micro, 11])
    return rng.standard_normal((n, dim)) / np.sqrt(dim), rng.standard_normal(n)


def loss_and_grads(arrays, x, y):
    """0.5 * mean((tanh(x @ theta) - y)**2) and its gradient per parameter."""
    theta = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    yh = np.tanh(x @ theta)
    r = yh - y
    g = x.T @ (r * (1 - yh * yh)) / len(y)
    grads, off = [], 0
    for a in arrays:
        grads.append(g[off:off + a.size].reshape(a.shape).astype(a.dtype))
        off += a.size
    return 0.5 * float(np.mean(r * r)), grads


def tuple_grad_fn(arrays, x, y):
    return loss_and_grads(arrays, x, y)


def generator_grad_fn(arrays, x, y):
    loss, grads = loss_and_grads(arrays, x, y)
    for i in reversed(range(len(grads))):
        yield i, grads[i]
    return loss


def batch_sizes(seed, world, weighted):
    if not weighted:
        return [3] * world
    return list(np.random.default_rng([seed, 5]).integers(1, 7, size=world))


def make_opt(kind, params):
    return SGD(params, lr=0.3, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.05)


def reference_training(shapes, seed, world, steps, opt_kind, weighted):
    """One process, the concatenation of every rank's batch, rank 0's initial values."""
    params = init_params(shapes, seed, 0)
    opt = make_opt(opt_kind, params)
    sizes = batch_sizes(seed, world, weighted)
    for step in range(steps):
        parts = [batch(shapes, seed, r, step, sizes[r]) for r in range(world)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        _, grads = loss_and_grads([p.data for p in params], x, y)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return [p.data for p in params]


CAPS = {"tiny": 1e-6, "mid": 2e-4, "huge": 1e3}


def ddp_training(world, shapes, seed, steps, opt_kind, weighted, strategy, style, cap, view,
                 set_to_none):
    rank, size = world.rank, world.world_size
    params = init_params(shapes, seed, rank)
    fn = generator_grad_fn if style == "generator" else tuple_grad_fn
    ddp = DDP(params, world, strategy=strategy, grad_fn=fn, bucket_cap_mb=CAPS[cap],
              first_bucket_mb=CAPS[cap] / 2, gradient_as_bucket_view=view)
    if cap == "tiny":
        assert len(ddp.bucket_indices) == len(shapes)
    if cap == "huge":
        assert ddp.bucket_indices == [list(reversed(range(len(shapes))))]
    opt = make_opt(opt_kind, ddp.parameters())
    sizes = batch_sizes(seed, size, weighted)
    n = sizes[rank] if weighted else None
    for step in range(steps):
        x, y = batch(shapes, seed, rank, step, sizes[rank])
        opt.zero_grad(set_to_none=set_to_none)
        if style == "manual":
            _, grads = loss_and_grads([p.data for p in params], x, y)
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad[...] = g  # in place: lands in the bucket when .grad is its view
            ddp.sync_gradients(num_samples=n)
        else:
            loss = ddp.backward(x, y, num_samples=n)
            assert np.isclose(loss, loss_and_grads([p.data for p in params], x, y)[0])
        opt.step()
    return [p.data for p in params]


@settings(max_examples=30)
@given(size=world_sizes(1, 5), shapes=SHAPES, seed=st.integers(0, 2**20),
       steps=st.integers(1, 3), opt_kind=st.sampled_from(["sgd", "adam"]),
       weighted=st.booleans(), strategy=st.sampled_from([SYNC, OVER]),
       style=st.sampled_from(["tuple", "generator", "manual"]),
       cap=st.sampled_from(sorted(CAPS)), view=st.booleans(), set_to_none=st.booleans())
def test_ddp_training_matches_one_process(size, shapes, seed, steps, opt_kind, weighted,
                                          strategy, style, cap, view, set_to_none):
    results = run_world(ddp_training, size, shapes, seed, steps, opt_kind, weighted, strategy,
                        style, cap, view, set_to_none)
    world = len(results) if len(results) > 1 else size
    expected = reference_training(shapes, seed, world, steps, opt_kind, weighted)
    for got in results:
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-11)


def test_unequal_batches_need_num_samples():
    """Without weights, unequal batches give the mean of means, not the full-batch mean."""
    shapes, seed = [(3,), (2, 2)], 4

    def body(world):
        if world.world_size == 1:
            return None
        sizes = [1 + 3 * r for r in range(world.world_size)]
        params = init_params(shapes, seed, world.rank)
        ddp = DDP(params, world, grad_fn=tuple_grad_fn)
        x, y = batch(shapes, seed, world.rank, 0, sizes[world.rank])
        ddp.backward(x, y)
        plain = [p.grad.copy() for p in params]
        for p in params:
            p.grad = None
        ddp.backward(x, y, num_samples=sizes[world.rank])
        parts = [batch(shapes, seed, r, 0, sizes[r]) for r in range(world.world_size)]
        full = loss_and_grads([p.data for p in params], np.concatenate([q[0] for q in parts]),
                              np.concatenate([q[1] for q in parts]))[1]
        means = [loss_and_grads([p.data for p in params], *q)[1] for q in parts]
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.grad, full[i], rtol=1e-10)
            np.testing.assert_allclose(plain[i], np.mean([m[i] for m in means], axis=0),
                                       rtol=1e-10)
            assert not np.allclose(plain[i], full[i])
        return True

    run_world(body, 3)


@settings(max_examples=10)
@given(size=world_sizes(1, 4), seed=st.integers(0, 2**20), k=st.integers(2, 4),
       strategy=st.sampled_from([SYNC, OVER]), view=st.booleans(),
       style=st.sampled_from(["tuple", "generator"]))
def test_no_sync_accumulation_equals_big_batch(size, seed, k, strategy, view, style):
    shapes = [(2, 3), (4,), ()]

    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params(shapes, seed, rank)
        fn = generator_grad_fn if style == "generator" else tuple_grad_fn
        ddp = DDP(params, world, grad_fn=fn, strategy=strategy, gradient_as_bucket_view=view,
                  bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
        local = [batch(shapes, seed, rank, 0, 4, micro=m) for m in range(k)]
        with ddp.no_sync():
            for x, y in local[:-1]:
                ddp.backward(x, y)
        # nothing was communicated: .grad is this rank's own sum so far
        own = [loss_and_grads([p.data for p in params], *b)[1] for b in local[:-1]]
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.grad, np.sum([o[i] for o in own], axis=0), rtol=1e-12)
        ddp.backward(*local[-1])
        every = [batch(shapes, seed, r, 0, 4, micro=m) for r in range(n) for m in range(k)]
        big = loss_and_grads([p.data for p in params], np.concatenate([b[0] for b in every]),
                             np.concatenate([b[1] for b in every]))[1]
        for p, g in zip(params, big):
            np.testing.assert_allclose(p.grad, k * g, rtol=1e-10, atol=1e-14)
        return True

    run_world(body, size)


def test_no_sync_strategy_never_communicates():
    def body(world):
        params = init_params([(3,)], 1, world.rank)
        ddp = DDP(params, world, strategy="no_sync", grad_fn=tuple_grad_fn, init_sync=False)
        x, y = batch([(3,)], 1, world.rank, 0, 5)
        ddp.backward(x, y)
        np.testing.assert_array_equal(params[0].grad,
                                      loss_and_grads([params[0].data], x, y)[1][0])
        ddp.sync_gradients()  # also local
        np.testing.assert_array_equal(params[0].grad,
                                      loss_and_grads([params[0].data], x, y)[1][0])
        assert not ddp.syncing
        return True

    run_world(body, 3)


def test_overlapped_issues_buckets_while_gradients_are_computed():
    shapes = [(5,), (6,), (7,)]
    nbytes = 6 * 8

    def body(world, strategy):
        params = init_params(shapes, 2, world.rank)
        seen = []
        ddp = None

        def grad_fn(arrays):
            for i in (2, 1, 0):
                yield i, np.full(shapes[i], float(world.rank))
                seen.append([s.launched for s in ddp.synchronizer.buckets])
            return 0.0

        ddp = DDP(params, world, grad_fn=grad_fn, strategy=strategy,
                  bucket_cap_mb=nbytes / 2**20, first_bucket_mb=nbytes / 2**20)
        assert ddp.bucket_indices == [[2], [1], [0]]
        ddp.backward()
        mean = (world.world_size - 1) / 2
        for p in params:
            np.testing.assert_allclose(p.grad, mean)
        return seen

    for got in run_world(body, 3, OVER):
        # after yielding gradient 2 its bucket is in flight; after 1, the second one
        assert got[0][0] and got[1][:2] == [True, True]
        assert got[1][2] is False
    for got in run_world(body, 3, SYNC):
        assert not any(any(s) for s in got)


def test_overlapped_launch_order_does_not_depend_on_yield_order():
    """Ranks yield in different orders; buckets still leave in the same order everywhere."""
    shapes = [(3,), (4,), (5,), (2,)]

    def body(world):
        rank = world.rank
        params = init_params(shapes, 3, rank)
        order = list(np.random.default_rng(rank).permutation(len(shapes)))

        def grad_fn(arrays):
            for i in order:
                yield int(i), np.full(shapes[i], float(rank + i))

        ddp = DDP(params, world, grad_fn=grad_fn, strategy=OVER, bucket_cap_mb=1e-6,
                  first_bucket_mb=1e-6)
        assert ddp.backward() is None
        n = world.world_size
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.grad, np.mean([r + i for r in range(n)]))
        return True

    run_world(body, 3)


def test_bucket_views_alias_grad_and_skip_packing():
    shapes = [(4, 3), (5,), (2, 2, 2)]

    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params(shapes, 5, rank)
        ddp = DDP(params, world, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
        sync = ddp.synchronizer
        for i, p in enumerate(params):
            p.grad = np.full(p.shape, float(rank + i))
        ddp.sync_gradients()
        assert sync.copies == len(params)  # first step: packed
        buffers = [s.bucket.buffer for s in sync.buckets]
        for i, p in enumerate(params):
            assert p.grad is sync.slot(i)
            assert any(np.shares_memory(p.grad, b) for b in buffers)
            np.testing.assert_allclose(p.grad, np.mean([r + i for r in range(n)]))
        # in-place writes land in the bucket: no packing copy next step
        for i, p in enumerate(params):
            p.grad[...] = float(2 * rank - i)
        ddp.sync_gradients()
        assert sync.copies == 0
        assert [s.bucket.buffer for s in sync.buckets] == buffers  # allocated once
        for i, p in enumerate(params):
            np.testing.assert_allclose(p.grad, np.mean([2 * r - i for r in range(n)]))
        # a new array is copied in (and .grad becomes the view again)
        params[1].grad = np.full(shapes[1], float(rank))
        ddp.sync_gradients()
        assert sync.copies == 1 and params[1].grad is sync.slot(1)
        # weighted during its copy (1) and in place (0, 2): every value is right
        np.testing.assert_allclose(params[1].grad, (n - 1) / 2)
        for i in (0, 2):
            np.testing.assert_allclose(params[i].grad, np.mean([2 * r - i for r in range(n)]))
        return True

    run_world(body, 3)


def test_without_bucket_views_grad_arrays_are_kept():
    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params([(3,), (2, 2)], 5, rank)
        ddp = DDP(params, world, gradient_as_bucket_view=False)
        held = [np.full(p.shape, float(rank)) for p in params]
        for p, h in zip(params, held):
            p.grad = h
        ddp.sync_gradients()
        for i, (p, h) in enumerate(zip(params, held)):
            assert p.grad is h  # averaged in place into the user's array
            assert not np.shares_memory(p.grad, ddp.synchronizer.slot(i))
            np.testing.assert_allclose(h, (n - 1) / 2)
        params[0].grad = np.broadcast_to(np.float64(rank), (3,))  # read-only: replaced
        ddp.sync_gradients()
        np.testing.assert_allclose(params[0].grad, (n - 1) / 2)
        return True

    run_world(body, 2)


@settings(max_examples=8)
@given(size=world_sizes(1, 4), seed=st.integers(0, 2**20), strategy=st.sampled_from([SYNC, OVER]),
       view=st.booleans())
def test_missing_grads_count_as_zeros(size, seed, strategy, view):
    shapes = [(3,), (2,), (4,), (1,)]

    def has(rank, i):
        return (rank + i) % 3 != 0

    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params(shapes, seed, rank)
        ddp = DDP(params, world, strategy=strategy, gradient_as_bucket_view=view,
                  bucket_cap_mb=1e-5, first_bucket_mb=1e-5)
        for i, p in enumerate(params):
            p.grad = np.full(p.shape, 1.0 + rank * 10 + i) if has(rank, i) else None
        ddp.sync_gradients()
        for i, p in enumerate(params):
            expected = sum(1.0 + r * 10 + i for r in range(n) if has(r, i)) / n
            np.testing.assert_allclose(p.grad, expected)
        return True

    run_world(body, size)


def test_missing_grads_error_mode():
    shapes = [(3,), (2,), (4,)]

    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params(shapes, 1, rank)
        ddp = DDP(params, world, missing_grad="error", strategy=OVER, bucket_cap_mb=1e-5,
                  first_bucket_mb=1e-5)
        # parameter 2 unused everywhere: fine, and keeps grad=None
        params[0].grad, params[1].grad = np.ones(3), np.ones(2)
        ddp.sync_gradients()
        assert params[2].grad is None
        np.testing.assert_allclose(params[0].grad, 1.0)
        # rank 0 lacks parameter 1: every rank raises, naming it
        for p in params:
            p.grad = None
        params[0].grad = np.ones(3)
        if rank != 0:
            params[1].grad = np.ones(2)
        if n == 1:
            ddp.sync_gradients()
            return True
        with pytest.raises(CollectiveMismatchError, match=r"parameter 1 \(p1\) has no gradient "
                                                          r"on ranks \[0\]"):
            ddp.sync_gradients()
        # the step was closed cleanly: the next one works
        params[1].grad = np.ones(2)
        ddp.sync_gradients()
        return True

    run_world(body, 3)


@pytest.mark.parametrize("compression,narrow,rtol", [("fp16", np.float16, 2e-3),
                                                      ("bf16", axondist._array.bfloat16, 2e-2)])
def test_compression_within_tolerance(compression, narrow, rtol):
    shapes = [(40,), (7, 3)]

    def body(world):
        rank, n = world.rank, world.world_size
        params = init_params(shapes, 0, rank, dtype=np.float32)
        ddp = DDP(params, world, compression=compression)
        grads = [np.random.default_rng([r, 3]).standard_normal(sum(np.prod(s) for s in shapes))
                 for r in range(n)]
        mine = grads[rank].astype(np.float32)
        params[0].grad = mine[:40].copy()
        params[1].grad = mine[40:].reshape(7, 3).copy()
        ddp.sync_gradients()
        exact = np.mean(grads, axis=0)
        got = np.concatenate([p.grad.ravel() for p in params])
        np.testing.assert_allclose(got, exact, rtol=rtol, atol=rtol * np.abs(exact).max())
        # the values went through the narrow dtype
        np.testing.assert_array_equal(got.astype(narrow).astype(np.float32), got)
        # later steps reuse each bucket's narrow buffer
        scratch = dict(ddp.synchronizer.hook._scratch)
        for _ in range(3):
            ddp.sync_gradients()
        assert ddp.synchronizer.hook._scratch.keys() == scratch.keys()
        assert len(scratch) == len(ddp.bucket_indices)
        return True

    run_world(body, 3)


def test_custom_reduction_hook_is_called_per_bucket():
    def body(world):
        calls = []

        def hook(flat, group, async_op):
            calls.append((flat.size, async_op))
            return sum_hook(flat, group, async_op)

        params = init_params([(3,), (4,), (5,)], 0, world.rank)
        ddp = DDP(params, world, compression=hook, strategy=OVER, bucket_cap_mb=1e-6,
                  first_bucket_mb=1e-6)
        for p in params:
            p.grad = np.full(p.shape, float(world.rank))
        ddp.sync_gradients()
        assert calls == [(5, True), (4, True), (3, True)]
        for p in params:
            np.testing.assert_allclose(p.grad, (world.world_size - 1) / 2)
        return True

    run_world(body, 2)


def test_sync_parameters_and_buffers():
    shapes = [(3, 2), (5,), ()]

    def body(world):
        rank = world.rank
        params = init_params(shapes, 9, rank)
        p32 = Parameter(np.full(4, float(rank), dtype=np.float32))
        running = np.full(3, float(rank))
        counter = Parameter(np.full(2, float(rank)))
        ddp = DDP(params + [p32], world, buffers=[running, counter], bucket_cap_mb=1e-5)
        ref = init_params(shapes, 9, 0)
        for p, r in zip(params, ref):
            np.testing.assert_array_equal(p.data, r.data)
        np.testing.assert_array_equal(p32.data, 0.0)
        np.testing.assert_array_equal(running, 0.0)
        np.testing.assert_array_equal(counter.data, 0.0)
        # each step re-broadcasts buffers from rank 0 (after local updates)
        running += rank + 1
        for p in ddp.parameters():
            p.grad = np.zeros(p.shape, p.dtype)
        ddp.sync_gradients()
        np.testing.assert_array_equal(running, 1.0)
        # broadcast_buffers=False leaves them alone
        other = np.full(2, float(rank))
        DDP(init_params(shapes, 9, rank), world, buffers=[other], broadcast_buffers=False)
        np.testing.assert_array_equal(other, float(rank))
        # init_sync=False: no broadcast in the constructor
        mine = init_params(shapes, 9, rank)
        lazy = DDP(mine, world, init_sync=False)
        np.testing.assert_array_equal(mine[0].data, init_params(shapes, 9, rank)[0].data)
        lazy.sync_parameters()
        np.testing.assert_array_equal(mine[0].data, ref[0].data)
        return True

    run_world(body, 3)


def test_mixed_dtypes_and_float32_training():
    def body(world):
        params = [Parameter(np.full((3,), float(world.rank), dtype=np.float32)),
                  Parameter(np.full((2,), float(world.rank))),
                  Parameter(np.full((4,), float(world.rank), dtype=np.float16))]
        ddp = DDP(params, world, init_sync=False)
        assert sorted(len(b) for b in ddp.bucket_indices) == [1, 1, 1]
        for p in params:
            p.grad = p.data * 2
        ddp.sync_gradients()
        for p in params:
            assert p.grad.dtype == p.dtype
            np.testing.assert_allclose(p.grad.astype(np.float64), world.world_size - 1,
                                       rtol=1e-3)
        return True

    run_world(body, 3)


def test_subgroup():
    def body(world):
        members = list(range(0, world.world_size, 2))
        group = world.new_group(members)
        if not group.is_member:
            return None
        params = init_params([(3,)], 0, world.rank)
        ddp = DDP(params, group)
        assert ddp.process_group is group
        params[0].grad = np.full(3, float(world.rank))
        ddp.sync_gradients()
        np.testing.assert_allclose(params[0].grad, np.mean(members))
        return True

    run_world(body, 3)


def test_forward():
    class Model:
        def __init__(self, rank):
            self.w = Parameter(np.full(2, float(rank)))

        def parameters(self):
            return [self.w]

        def forward(self, x):
            return self.w.data * x

    def body(world):
        m = Model(world.rank)
        ddp = DistributedDataParallel(m, world)
        assert ddp.module is m and ddp.parameters() == [m.w]
        np.testing.assert_array_equal(ddp(3.0), 0.0)
        with_fn = DDP([Parameter(np.ones(2))], world, forward_fn=lambda ps, x: ps[0] + x)
        np.testing.assert_array_equal(with_fn.forward(1.0), 2.0)
        with pytest.raises(TypeError, match="forward_fn"):
            DDP([Parameter(np.ones(2))], world).forward(1.0)
        assert "DistributedDataParallel(1 parameters" in repr(ddp)
        return True

    run_world(body, 2)


def test_errors():
    def body(world):
        rank = world.rank
        params = init_params([(3,), (2,)], 0, rank)
        with pytest.raises(TypeError, match="no grad_fn"):
            DDP(params, world).backward()
        with pytest.raises(ValueError, match="missing_grad"):
            DDP(params, world, missing_grad="skip")
        with pytest.raises(TypeError, match="int32; only floating-point"):
            DDP([Parameter(np.zeros(2, np.int32))], world)
        ddp = DDP(params, world, grad_fn=lambda ps: (0.0, [None]))
        with pytest.raises(ValueError, match="returned 1 gradients for 2 parameters"):
            ddp.backward()

        def twice(ps):
            yield 1, np.ones(2)
            yield 1, np.ones(2)

        ddp.grad_fn = twice
        with pytest.raises(ValueError, match="yielded parameter 1 twice"):
            ddp.backward()
        ddp.grad_fn = lambda ps: 3
        with pytest.raises(TypeError, match=r"\(loss, grads\)"):
            ddp.backward()
        with pytest.raises(RuntimeError, match="start_grad_sync"):
            ddp.add_gradient(0, np.ones(3))
        ddp.start_grad_sync()
        with pytest.raises(ValueError, match=r"has shape \(2,\), the parameter has \(3,\)"):
            ddp.add_gradient(0, np.ones(2))
        with pytest.raises(IndexError, match="out of range"):
            ddp.add_gradient(5, np.ones(2))
        with pytest.raises(RuntimeError, match="already in progress"):
            ddp.start_grad_sync()
        ddp.finish_grad_sync()
        # every rank passes 0 samples: every rank raises
        for p in params:
            p.grad = np.ones(p.shape)
        with pytest.raises(ValueError, match="add up to 0"):
            ddp.sync_gradients(num_samples=0)
        ddp.sync_gradients(num_samples=1)  # and the DDP still works
        # models that differ between ranks are refused on every rank
        if world.world_size > 1:
            with pytest.raises(CollectiveMismatchError, match="models differ"):
                DDP(init_params([(3,), (2 + (rank == 1),)], 0, rank), world)
        return True

    run_world(body, 2)


@settings(max_examples=8)
@given(size=world_sizes(1, 4), seed=st.integers(0, 2**20), shapes=SHAPES,
       strategy=st.sampled_from(list(GradSyncStrategy)), elements=st.integers(1, 30))
def test_gradient_synchronizer_on_its_own(size, seed, shapes, strategy, elements):
    """The reference's usage: prepare, add_gradient per index, sync_all(group), clear."""

    def grads_of(rank):
        rng = np.random.default_rng([seed, rank])
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def body(world):
        sync = GradientSynchronizer(strategy, elements, first_bucket_size=max(1, elements // 3))
        plan = sync.prepare(shapes)
        assert sorted(i for b in plan for i in b) == list(range(len(shapes)))
        for step in range(2):
            mine = grads_of(world.rank + step)
            for i in np.random.default_rng(step).permutation(len(shapes)):
                sync.add_gradient(int(i), mine[i])
            out = sync.sync_all(world)
            for i, g in enumerate(out):
                if strategy is GradSyncStrategy.NO_SYNC:
                    np.testing.assert_array_equal(g, mine[i])
                else:
                    every = [grads_of(r + step)[i] for r in range(world.world_size)]
                    np.testing.assert_allclose(g, np.mean(every, axis=0), rtol=1e-5, atol=1e-6)
            sync.clear()
        with pytest.raises(RuntimeError, match="no step in progress"):
            sync.finish()
        return True

    run_world(body, size)


# --- clip_grad_norm: the global norm of the averaged gradients ------------------------------

@settings(max_examples=20)
@given(size=world_sizes(1, 4), shapes=SHAPES, seed=st.integers(0, 2**20),
       norm_type=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
       max_norm=st.floats(1e-3, 10.0), strategy=st.sampled_from([SYNC, OVER]))
def test_clip_grad_norm_is_the_norm_of_the_whole_averaged_gradient(size, shapes, seed,
                                                                     norm_type, max_norm,
                                                                     strategy):
    world_n = current_size(size)
    parts = [batch(shapes, seed, r, 0, 3) for r in range(world_n)]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    _, full = loss_and_grads([p.data for p in init_params(shapes, seed, 0)], x, y)
    flat = np.concatenate([g.ravel() for g in full])
    want = float(np.max(np.abs(flat))) if math.isinf(norm_type) else \
        float(np.sum(np.abs(flat) ** norm_type) ** (1 / norm_type))
    coef = min(1.0, max_norm / (want + 1e-6))

    def body(world):
        params = init_params(shapes, seed, world.rank)
        ddp = DDP(params, world, grad_fn=tuple_grad_fn, strategy=strategy)
        ddp.backward(*batch(shapes, seed, world.rank, 0, 3))
        got = ddp.clip_grad_norm(max_norm, norm_type)
        assert got == pytest.approx(want, rel=1e-9)
        for p, g in zip(params, full):
            np.testing.assert_allclose(p.grad, g * coef, rtol=1e-9, atol=1e-14)
        return got

    norms = run_world(body, size)
    assert len(set(norms)) == 1  # the same float on every rank


def test_clip_grad_norm_nan_and_inf_on_one_rank_reach_every_rank():
    def body(world):
        params = init_params([(3,), (2,)], 0, world.rank)
        ddp = DDP(params, world)
        for p in params:
            p.grad = np.ones(p.shape)
        if world.rank == world.world_size - 1:
            params[1].grad[0] = math.inf
        ddp.sync_gradients()
        with pytest.raises(NonFiniteNormError, match="is inf.*error_if_nonfinite=False"):
            ddp.clip_grad_norm(1.0, error_if_nonfinite=True)
        assert np.isfinite(params[0].grad).all()  # refused: nothing scaled
        assert ddp.clip_grad_norm(1.0) == math.inf
        np.testing.assert_array_equal(params[0].grad, np.zeros(3))  # scaled by 0
        assert math.isnan(params[1].grad[0])  # inf * 0, as torch
        params[0].grad[1] = math.nan
        assert math.isnan(ddp.clip_grad_norm(1.0, math.inf))  # max() must not drop the NaN
        assert all(np.isnan(p.grad).all() for p in params)
        return True

    assert all(run_world(body, current_size(3)))


# --- bad input -------------------------------------------------------------------------------

def test_bad_arguments_are_named_with_what_came_and_what_to_pass():
    def body(world):
        params = init_params([(3,), (2,)], 0, world.rank)
        with pytest.raises(TypeError, match=r"DistributedDataParallel: bucket_cap_mb \(MiB per "
                                            r"bucket, e.g. 25\) must be a number, got str '25'"):
            DDP(params, world, bucket_cap_mb="25")
        with pytest.raises(ValueError, match="first_bucket_mb .* must be a finite number > 0"):
            DDP(params, world, first_bucket_mb=0)
        with pytest.raises(ValueError, match=r"DistributedDataParallel: piece_bytes \(bytes per "
                                             r"OVERLAPPED piece, e.g. 4 MiB: 4194304\)=-1 must "
                                             "be a finite number > 0"):
            DDP(params, world, piece_bytes=-1)
        assert DDP(params, world, piece_bytes=1000.4).synchronizer.piece_bytes == 1000
        with pytest.raises(TypeError, match="grad_fn must be a callable"):
            DDP(params, world, grad_fn=3)
        ddp = DDP(params, world)
        for p in params:
            p.grad = np.full(p.shape, float(world.rank))
        with pytest.raises(TypeError, match=r"sync_gradients: num_samples must be None or this "
                                            r"rank's sample count .*got list .*call "
                                            r"axondist.sync_gradients\(grads\)"):
            ddp.sync_gradients([p.grad for p in params])
        with pytest.raises(TypeError, match="num_samples must be None .*got str '3'"):
            ddp.sync_gradients("3")
        with pytest.raises(ValueError, match="num_samples must be a sample count >= 0, got -1"):
            ddp.sync_gradients(-1)
        ddp.sync_gradients(None)  # None is the plain mean, and the DDP still works
        mean = (world.world_size - 1) / 2
        for p in params:
            np.testing.assert_allclose(p.grad, np.full(p.shape, mean))
        return True

    assert all(run_world(body, current_size(2)))


@pytest.mark.parametrize("strategy", [SYNC, OVER])
@pytest.mark.parametrize("path", ["backward", "sync_gradients", "no_sync"])
def test_complex_gradients_are_refused_not_cast_to_real(strategy, path):
    def complex_grads(arrays, x, y):
        loss, grads = loss_and_grads(arrays, x, y)
        return loss, [g * (1 + 1j) for g in grads]

    def body(world):
        params = init_params([(3,), (2,)], 0, world.rank)
        ddp = DDP(params, world, grad_fn=complex_grads, strategy=strategy)
        x, y = batch([(3,), (2,)], 0, world.rank, 0, 3)
        refused = pytest.raises(UnsupportedDTypeError,
                                match=r"the gradient of parameter 1 \(p1\) is complex128; "
                                      "complex gradients are not supported")
        if path == "backward":
            with refused:
                ddp.backward(x, y)
        elif path == "no_sync":
            with ddp.no_sync(), refused:
                ddp.backward(x, y)
        else:
            params[0].grad = np.ones(3)
            params[1].grad = np.ones(2) * 1j
            with pytest.raises(UnsupportedDTypeError, match=r"parameter 1 \(p1\) is complex128"):
                ddp.sync_gradients()
        for p in params:
            p.grad = None
        ddp.grad_fn = tuple_grad_fn
        ddp.backward(x, y)  # the wrapper is still usable
        return True

    assert all(run_world(body, 2))


@pytest.mark.parametrize("strategy", [SYNC, OVER])
@pytest.mark.parametrize("path", ["backward", "sync_gradients", "add_gradient"])
def test_an_object_gradient_is_refused_by_name_before_any_communication(strategy, path):
    """A gradient of object dtype gets an UnsupportedDTypeError naming the parameter and
    the dtype (not NumPy's TypeError from inside the packing copy), and the step issues no
    collective: sync_gradients checks every .grad before the step starts, the other paths
    each gradient before it joins its bucket (parameter 1 is the first handed over; a
    good step first sets up OVERLAPPED's persistent all-reduces, which a step's start
    makes once)."""
    def object_grads(arrays, x, y):
        loss, grads = loss_and_grads(arrays, x, y)
        return loss, [grads[0], np.array([None, 1.0], dtype=object)]

    def last_seq(world):
        return max((e["seq"] for e in axondist.flight_recorder(world)), default=0)

    def body(world):
        params = init_params([(3,), (2,)], 0, world.rank)
        ddp = DDP(params, world, grad_fn=object_grads, strategy=strategy,
                  bucket_cap_mb=1e-5, first_bucket_mb=1e-5)  # one bucket per parameter
        x, y = batch([(3,), (2,)], 0, world.rank, 0, 3)
        if path != "sync_gradients":
            ddp.backward(tuple_grad_fn, x, y)
            ddp.zero_grad()
        where = {"backward": "add_gradient"}.get(path, path)
        before = last_seq(world)
        with pytest.raises(UnsupportedDTypeError,
                           match=rf"^DistributedDataParallel.{where}: the gradient of parameter "
                                 r"1 \(p1\) has dtype object; a gradient must be an array of "
                                 "real numbers"):
            if path == "backward":
                ddp.backward(x, y)
            elif path == "sync_gradients":
                params[0].grad = np.ones(3)
                params[1].grad = np.array([None, 1.0], dtype=object)
                ddp.sync_gradients()
            else:
                ddp.start_grad_sync()
                ddp.add_gradient(1, np.array([None, 1.0], dtype=object))
        assert last_seq(world) == before  # nothing was communicated
        ddp.close()  # leaves the step add_gradient refused
        for p in params:
            p.grad = None
        ddp.grad_fn = tuple_grad_fn
        ddp.backward(x, y)  # the wrapper is still usable
        ddp.close()
        return True

    assert all(run_world(body, current_size(2)))


@mock_only
def test_construction_logs_the_bucket_plan(caplog):
    shapes = [(300,), (4, 5), (2,)]
    with caplog.at_level(logging.INFO, logger="axondist.ddp"):
        ad_results = axondist.spawn(
            lambda w: DDP(init_params(shapes, 0, w.rank), w, bucket_cap_mb=0.001,
                          first_bucket_mb=0.0001).bucket_indices, 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "axondist.ddp"]
    assert len(lines) == 2
    buckets = len(ad_results[0])
    for line in lines:
        assert "cap 0.001 MiB (first 0.0001 MiB), strategy SYNCHRONOUS" in line
        assert all(f"bucket {b}: " in line for b in range(buckets))
        assert f"bucket {buckets}: " not in line
        assert "p0" in line and "float64" in line and "MiB" in line
