"""OVERLAPPED DDP on persistent all-reduces against single-process training.

Every bucket's all-reduce is set up once (``Backend.persistent_all_reduce``:
under MPI, rings of persistent point-to-point requests for big pieces and MPI-4
``Allreduce_init`` for small ones; an ordinary non-blocking all-reduce per piece
elsewhere) and started piece by piece each step, each piece weighted just
before it starts. Each rank derives every rank's data from seeds and
checks its own parameters against the full-batch reference. Runs on the mock
world and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import numpy as np
from harness import current_size, in_ordinary_memory, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist
from axondist import Parameter
from axondist.backends.base import PersistentAllReduce
from axondist.ddp import DDP, GradSyncStrategy
from axondist.errors import CollectiveTimeoutError

OVER = GradSyncStrategy.OVERLAPPED
SHAPES = st.lists(st.lists(st.integers(1, 5), max_size=2).map(tuple), min_size=1, max_size=6)
LR = 0.1


def samples(rank: int, weighted: bool) -> int:
    """Rank ``rank``'s batch size: unequal when the average is sample-weighted."""
    return 2 + rank % 3 if weighted else 3


def data(shapes, seed, rank, step, micro, weighted):
    dim = sum(int(np.prod(s)) for s in shapes)
    n = samples(rank, weighted)
    rng = np.random.default_rng([seed, rank, step, micro])
    return rng.standard_normal((n, dim)) / np.sqrt(dim), rng.standard_normal(n)


def grads_of(arrays, x, y):
    """0.5 * mean((tanh(x @ theta) - y)**2) and its gradient, per parameter."""
    theta = np.concatenate([np.asarray(a).ravel() for a in arrays])
    yh = np.tanh(x @ theta)
    r = yh - y
    g = x.T @ (r * (1 - yh * yh)) / len(y)
    out, off = [], 0
    for a in arrays:
        out.append(g[off:off + a.size].reshape(a.shape))
        off += a.size
    return 0.5 * float(np.mean(r * r)), out


def start_params(shapes, seed):
    rng = np.random.default_rng([seed, 99])
    return [0.5 * rng.standard_normal(s) for s in shapes]


def reference(shapes, seed, size, steps, micro, weighted):
    """Single-process training: per step, the weighted average over ranks of each rank's
    gradient summed over its micro-batches, then an SGD step."""
    params = start_params(shapes, seed)
    counts = [samples(r, weighted) for r in range(size)]
    weights = [c / sum(counts) if weighted else 1 / size for c in counts]
    for step in range(steps):
        total = [np.zeros(s) for s in shapes]
        for r in range(size):
            for m in range(micro):
                _, g = grads_of(params, *data(shapes, seed, r, step, m, weighted))
                for t, gi in zip(total, g):
                    t += weights[r] * gi
        params = [p - LR * t for p, t in zip(params, total)]
    return params


def make_grad_fn(order_seed):
    """A generator grad_fn yielding the gradients in an order of its own (per rank)."""
    def grad_fn(arrays, x, y):
        loss, g = grads_of(arrays, x, y)
        order = np.random.default_rng(order_seed).permutation(len(g))
        for i in order:
            yield int(i), g[i]
        return loss
    return grad_fn


@in_ordinary_memory
def train(world, shapes, seed, steps, micro, weighted, cap_elems, piece_elems, view,
          generator):
    params = [Parameter(a.copy(), name=f"p{i}") for i, a in enumerate(start_params(shapes, seed))]
    grad_fn = make_grad_fn([seed, world.rank]) if generator else (
        lambda arrays, x, y: grads_of(arrays, x, y))
    ddp = DDP(params, strategy=OVER, bucket_cap_mb=cap_elems * 8 / 2**20,
              first_bucket_mb=cap_elems * 8 / 2**20, gradient_as_bucket_view=view,
              grad_fn=grad_fn)
    ddp.synchronizer.piece_bytes = None if piece_elems is None else piece_elems * 8
    handles = None
    for step in range(steps):
        for m in range(micro - 1):
            with ddp.no_sync():
                ddp.backward(*data(shapes, seed, world.rank, step, m, weighted))
        n = samples(world.rank, weighted) if weighted else None
        ddp.backward(*data(shapes, seed, world.rank, step, micro - 1, weighted), num_samples=n)
        for p in params:
            p.data -= LR * p.grad
        ddp.zero_grad(set_to_none=not view)
        if handles is None:
            handles = ddp.synchronizer.persistent
    made = [h is g for h, g in zip(handles or [], ddp.synchronizer.persistent)]
    buckets = len(ddp.synchronizer.buckets)
    ddp.close()
    freed = [h.freed for h in handles or []]
    return [p.data.copy() for p in params], made, buckets, freed, ddp.synchronizer.persistent


@settings(max_examples=25)
@given(size=world_sizes(1, 4), shapes=SHAPES, seed=st.integers(0, 2**20),
       steps=st.integers(1, 3), micro=st.integers(1, 3), weighted=st.booleans(),
       cap_elems=st.integers(1, 40), piece_elems=st.sampled_from([None, 1, 2, 3, 7]),
       view=st.booleans(), generator=st.booleans())
def test_overlapped_persistent_training_matches_one_process(size, shapes, seed, steps, micro,
                                                           weighted, cap_elems, piece_elems,
                                                           view, generator):
    size = current_size(size)
    expected = reference(shapes, seed, size, steps, micro, weighted)
    results = run_world(train, size, shapes, seed, steps, micro, weighted, cap_elems,
                        piece_elems, view, generator)
    for params, made, buckets, freed, after in results:
        for got, want in zip(params, expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        # one handle per bucket, made on the first step and reused by the later ones
        assert len(made) == buckets and all(made)
        # close() freed them all
        assert all(freed) and after == []


@in_ordinary_memory
def _after_close(world):
    p = Parameter(np.zeros(6), name="w")
    ddp = DDP([p], strategy=OVER)
    ddp.synchronizer.piece_bytes = 16
    for step in range(2):
        p.grad = np.full(6, float(world.rank + step))
        ddp.sync_gradients()
        if step == 0:
            first = ddp.synchronizer.persistent
            ddp.close()
            ddp.close()  # idempotent
    again = ddp.synchronizer.persistent
    out = p.grad.copy()
    ddp.close()
    return first, again, out


def test_close_frees_and_the_next_step_sets_up_again():
    n = current_size(3)
    for first, again, out in run_world(_after_close, n):
        assert all(h.freed for h in first)
        assert again and all(h.freed for h in again)  # the second close freed the new ones
        assert not any(a is b for a in first for b in again)
        np.testing.assert_allclose(out, np.full(6, (n - 1) / 2 + 1))
        with np.testing.assert_raises_regex(RuntimeError, "the handle was freed"):
            first[0].start(0)


@in_ordinary_memory
def _with_block(world):
    p = Parameter(np.zeros(4), name="w")
    with DDP([p], strategy=OVER) as ddp:
        p.grad = np.full(4, float(world.rank))
        ddp.sync_gradients()
        handles = ddp.synchronizer.persistent
    return [h.freed for h in handles], p.grad.copy()


def test_leaving_a_with_block_closes():
    n = current_size(2)
    for freed, grad in run_world(_with_block, n):
        assert freed and all(freed)
        np.testing.assert_allclose(grad, np.full(4, (n - 1) / 2))


def _handle_rules(world):
    """A handle refuses to restart a piece in flight; wait(timeout) times out while a peer
    has not started the piece, then completes once it has."""
    backend = world.backend
    x = np.full(10, float(world.rank + 1))
    handle = backend.persistent_all_reduce(x, piece_bytes=40)
    assert isinstance(handle, PersistentAllReduce) and len(handle.bounds) == 2
    assert handle.bounds == [(0, 5), (5, 10)]
    timed_out = False
    if world.rank == 0 and world.world_size > 1:
        work = handle.start(0)
        try:
            work.wait(timeout=0.2)  # rank 1 starts only after our signal
        except CollectiveTimeoutError as exc:
            timed_out = "did not complete within timeout=0.2 s" in str(exc)
        try:
            handle.start(0)
        except RuntimeError as exc:
            refused = "still being reduced" in str(exc)
        else:
            refused = False
        axondist.send(np.ones(1), dst=1)
        work.wait()
        second = handle.start(1)
    else:
        refused = True
        if world.rank == 1:
            axondist.recv(src=0)
        work = handle.start(0)
        work.wait()
        second = handle.start(1)
    second.wait()
    handle.free()
    handle.free()
    return timed_out or world.rank != 0 or world.world_size == 1, refused, x.copy()


def test_a_handle_refuses_a_restart_in_flight_and_wait_times_out():
    size = current_size(2)
    for timed_out, refused, x in run_world(_handle_rules, size):
        assert timed_out and refused
        np.testing.assert_array_equal(x, np.full(10, size * (size + 1) / 2))


def _body_destroy_frees(world):
    buf = np.arange(8, dtype=np.float64)
    with world.new_group(list(range(world.world_size))) as group:
        handle = group.backend.persistent_all_reduce(buf)
        handle.start(0).wait()
        np.testing.assert_array_equal(buf, np.arange(8) * world.world_size)
    # Under MPI destroying the group freed the MPI requests its owner left behind;
    # elsewhere nothing was set up to free.
    assert handle.freed or world.backend.name != "mpi"


def test_destroying_a_group_frees_its_persistent_all_reduces():
    run_world(_body_destroy_frees, current_size(2))
