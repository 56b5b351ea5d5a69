"""OVERLAPPED pieces: each piece of a bucket starts once its gradients are in, and under
MPI each piece is a persistent all-reduce (``Allreduce_init``) started again every step.

Checked against NumPy: the synchronizer's averages for any gradient shapes, piece size,
order of arrival, sample weights and missing gradients (some gradients handed over as
their own bucket views, unweighted, others copied in and weighted); that no piece starts
before its gradients are in and that a backward pass in bucket order starts each piece
as soon as it is filled; the persistent pieces against NumPy's sum and, bit for bit on
two ranks, against the blocking weighted sum; DDP under OVERLAPPED against SYNCHRONOUS
(bit for bit on two ranks, where a sum of two values does not depend on the pieces) and
against single-process training; a piece's ``wait(timeout)`` while a peer has not
started it. Runs on the mock world and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import (
    LAUNCHED,
    UNDER_MPI,
    current_size,
    in_ordinary_memory,
    launched_world,
    run_world,
    world_sizes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import Parameter, tune
from axondist.backends.mpi.choose import NODE_CHUNK_BYTES
from axondist.ddp import DDP, DEFAULT_BUCKET_CAP_MB, GradientSynchronizer, GradSyncStrategy
from axondist.errors import CollectiveTimeoutError
from axondist.tune import SweepPoint, TuneSettings

OVER, SYNC = GradSyncStrategy.OVERLAPPED, GradSyncStrategy.SYNCHRONOUS
SHAPES = st.lists(st.lists(st.integers(1, 6), max_size=2).map(tuple), min_size=1, max_size=7)
mpi_only = pytest.mark.skipif(not UNDER_MPI, reason="needs an MPI world (run under mpiexec)")


def local_grads(shapes, seed, rank):
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(s) for s in shapes]


def started(sync: GradientSynchronizer) -> int:
    """Pieces started in the current step."""
    total = sum(len(h.bounds) for h in sync.persistent)
    return total - len(sync._queue)


@in_ordinary_memory  # these count the persistent pieces started
def _sync_step(world, shapes, seed, cap_elems, piece_elems, order_seed, weighted, missing,
               as_view):
    sync = GradientSynchronizer(OVER, bucket_size=cap_elems, group=world)
    sync.piece_bytes = piece_elems * 8
    sync.prepare(shapes, dtype=np.float64)
    grads = local_grads(shapes, seed, world.rank)
    order = list(range(len(shapes)))
    np.random.default_rng([order_seed, world.rank]).shuffle(order)  # per rank
    count = 2 + world.rank % 3 if weighted else None
    sync.start(world, num_samples=count)
    early = []
    for i in order:
        if i in missing:
            continue
        if as_view[i]:  # the gradient already is its slot: handed over unweighted
            sync.slot(i)[...] = grads[i]
            sync.add_gradient(i, sync.slot(i))
        else:
            sync.add_gradient(i, grads[i])
        early.append(started_ready(sync))
    out = [g.copy() for g in sync.finish()]
    sync.close()
    return out, early


def started_ready(sync: GradientSynchronizer) -> bool:
    """Every started piece holds only gradients that were added (checked per bucket)."""
    for state in sync.buckets:
        handle = state.persistent
        waiting = {k for s, k in sync._queue if s is state}
        for k, (lo, hi) in enumerate(handle.bounds):
            if k in waiting:
                continue
            for off, end, i in state.layout:
                if off < hi and end > lo and not sync.slots[i].ready:
                    return False
    return True


@settings(max_examples=25, deadline=None)
@given(size=world_sizes(1, 4), shapes=SHAPES, seed=st.integers(0, 2**20),
       cap_elems=st.integers(1, 40), piece_elems=st.integers(1, 9),
       order_seed=st.integers(0, 2**20), weighted=st.booleans(), data=st.data())
def test_pieces_start_once_filled_and_average_like_numpy(size, shapes, seed, cap_elems,
                                                         piece_elems, order_seed, weighted,
                                                         data):
    size = current_size(size)
    missing = set(data.draw(st.lists(st.integers(0, len(shapes) - 1), max_size=2)))
    as_view = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    counts = [2 + r % 3 if weighted else 1 for r in range(size)]
    weights = [c / sum(counts) for c in counts]
    every = [local_grads(shapes, seed, r) for r in range(size)]
    want = [sum(w * g[i] for w, g in zip(weights, every)) for i in range(len(shapes))]
    for i in missing:
        want[i] = np.zeros(shapes[i])
    for out, early in run_world(_sync_step, size, shapes, seed, cap_elems, piece_elems,
                                order_seed, weighted, missing, as_view):
        assert all(early)  # no piece ever started before its gradients were in
        for got, ref in zip(out, want):
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


@in_ordinary_memory
def _backward_order(world, shapes, piece_elems):
    sync = GradientSynchronizer(OVER, bucket_size=10**6, group=world)
    sync.piece_bytes = piece_elems * 8
    sync.prepare(shapes, dtype=np.float64)
    sync.start(world)
    seen = []
    for i in reversed(range(len(shapes))):  # the order a backward pass makes them
        sync.add_gradient(i, np.full(shapes[i], float(world.rank + i)))
        seen.append(started(sync))
    grads = [g.copy() for g in sync.finish()]
    sync.close()
    return seen, grads


def test_in_backward_order_each_piece_starts_as_soon_as_it_is_filled():
    """One bucket of five gradients, one piece per gradient: the i-th gradient handed over
    starts the i-th piece at once, so after the last gradient only the last piece is left
    (before, the whole bucket started only then)."""
    n = current_size(2)
    shapes = [(3,)] * 5
    for seen, grads in run_world(_backward_order, n, shapes, 3):
        assert seen == [1, 2, 3, 4, 5]
        for i, g in enumerate(grads):
            np.testing.assert_allclose(g, np.full(3, (n - 1) / 2 + i))
    # pieces cut across gradients: a piece starts once the gradients it overlaps are in
    for seen, _ in run_world(_backward_order, n, shapes, 4):  # [0, 3) [3, 7) [7, 11) [11, 15)
        assert seen == [1, 1, 2, 3, 4]


# --- DDP --------------------------------------------------------------------------------

BIG = [(300, 257), (70_001,), (2, 40_000)]  # 0.6-0.64 MB each: a piece each


def _train(world, strategy, steps, weighted):
    rng = np.random.default_rng(7)
    params = [Parameter(rng.standard_normal(s), name=f"p{i}") for i, s in enumerate(BIG)]
    ddp = DDP(params, world, strategy=strategy, bucket_cap_mb=1.5, first_bucket_mb=0.7)
    ddp.synchronizer.piece_bytes = 600_000
    for step in range(steps):
        grads = local_grads(BIG, 100 * step + 1, world.rank)
        for p, g in zip(params, grads):
            p.grad = g.copy()
        ddp.sync_gradients(num_samples=(1 + world.rank) if weighted else None)
        for p in params:
            p.data -= 0.1 * p.grad
    ddp.close()
    return [p.data.copy() for p in params]


@settings(max_examples=4, deadline=None)
@given(size=world_sizes(1, 3), weighted=st.booleans())
def test_ddp_overlapped_equals_synchronous_and_one_process(size, weighted):
    size = current_size(size)
    rng = np.random.default_rng(7)
    want = [rng.standard_normal(s) for s in BIG]
    counts = [1 + r if weighted else 1 for r in range(size)]
    for step in range(2):
        every = [local_grads(BIG, 100 * step + 1, r) for r in range(size)]
        for i in range(len(BIG)):
            want[i] = want[i] - 0.1 * sum(c / sum(counts) * g[i] for c, g in zip(counts, every))
    over = run_world(_train, size, OVER, 2, weighted)
    sync = run_world(_train, size, SYNC, 2, weighted)
    for a, b in zip(over, sync):
        for x, y, ref in zip(a, b, want):
            np.testing.assert_allclose(x, ref, rtol=1e-12, atol=1e-12)
            if size <= 2:
                np.testing.assert_array_equal(x, y)


def _tuned(world, path):
    made = {s.name: DDP([Parameter(np.zeros(4))], world, strategy=s, init_sync=False)
            for s in (SYNC, OVER)}
    made["OVERLAPPED tuned"] = DDP([Parameter(np.zeros(4))], world, strategy=OVER,
                                   init_sync=False, **tune.tuned_ddp_options(world))
    return {name: d.bucket_cap_mb for name, d in made.items()}


def test_ddp_reads_no_tune_file_and_takes_the_tuned_bucket_when_passed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP reads no settings file by itself: with one present, a DDP built without
    options keeps 25 MiB, and one given ``**tune.tuned_ddp_options(group)`` takes the size
    ``tune`` picked."""
    size = current_size(2)
    world = launched_world() if LAUNCHED else None
    folder = Path(world.backend.broadcast_object(str(tmp_path), 0)) if world else tmp_path
    path = folder / "tune.json"
    # the settings apply to the layout they were measured on: this one's hosts
    nodes = len(set(world.backend.allgather_object(world.node_info()[0]))) if world else 1
    if world is None or world.rank == 0:
        tune.save_settings(TuneSettings(2.0, size, nodes, 0.9,
                                        (SweepPoint(1 << 21, 0.01, 2e8),), 1e-4, 1e8), path)
    if world is not None:
        world.backend.barrier()
    monkeypatch.setenv("AXONDIST_TUNE_FILE", str(path))
    for caps in run_world(_tuned, size, path):
        assert caps == {"SYNCHRONOUS": DEFAULT_BUCKET_CAP_MB, "OVERLAPPED": DEFAULT_BUCKET_CAP_MB,
                        "OVERLAPPED tuned": 2.0}


# --- the persistent pieces ---------------------------------------------------------------

def _persistent_sum(world, numel, dtype, piece_bytes, factor, seed):
    backend = world.backend
    rng = np.random.default_rng([seed, world.rank])
    x = rng.standard_normal(numel).astype(dtype)
    handle = backend.persistent_all_reduce(x, piece_bytes=piece_bytes)
    results = []
    for step in range(2):  # the same requests, started again
        x[...] = rng.standard_normal(numel).astype(dtype) * (step + 1)
        mine = x.copy()
        blocking = x.copy()
        for k in range(len(handle.bounds)):
            piece = handle.piece(k)
            np.multiply(piece, factor, out=piece, casting="unsafe")
        works = [handle.start(k) for k in range(len(handle.bounds))]
        for work in reversed(works):  # any wait order
            work.wait()
        if hasattr(backend, "scaled_sum_blocking"):
            backend.scaled_sum_blocking(blocking, factor)
        else:
            blocking = None
        results.append((mine, x.copy(), blocking))
    handle.free()
    return len(handle.bounds), results


@settings(max_examples=8, deadline=None)
@given(size=world_sizes(1, 4), numel=st.sampled_from([131_073, 300_001, 600_000]),
       dtype=st.sampled_from(["float32", "float64"]), factor=st.sampled_from([1.0, 0.3]),
       seed=st.integers(0, 2**20))
def test_persistent_pieces_sum_like_numpy(size, numel, dtype, factor, seed):
    size = current_size(size)
    piece = NODE_CHUNK_BYTES  # one node's chunk: the blocking sum's pieces too
    out = run_world(_persistent_sum, size, numel, dtype, piece, factor, seed)
    if LAUNCHED:
        mine = [r[1][s][0] for r in out for s in range(2)]
        every = [launched_world().backend.allgather_object(m) for m in mine]
    else:
        every = [[r[1][s][0] for r in out] for s in range(2)]
    tol = 1e-5 * size if dtype == "float32" else 1e-12
    nbytes = numel * np.dtype(dtype).itemsize
    for pieces, results in out:
        assert pieces == -(-nbytes // piece)  # the fewest pieces of at most `piece` bytes
        for s, (_, got, blocking) in enumerate(results):
            want = sum(factor * a.astype(np.float64) for a in every[s])
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            if blocking is not None and size <= 2:  # a sum of two: the same bits any way
                np.testing.assert_array_equal(got, blocking)
            elif blocking is not None:
                np.testing.assert_allclose(blocking, want, rtol=tol, atol=tol)


def _piece_timeout(world):
    """wait(timeout) on a persistent piece times out while the peer has not started it, then
    completes once it has."""
    x = np.full(200_000, float(world.rank + 1))  # 1.6 MB: one persistent piece
    handle = world.backend.persistent_all_reduce(x, piece_bytes=2 << 20)
    timed_out = True
    if world.rank == 0:
        work = handle.start(0)
        try:
            work.wait(timeout=0.2)
            timed_out = False
        except CollectiveTimeoutError as exc:
            timed_out = "did not complete within timeout=0.2 s" in str(exc)
        ad.send(np.ones(1), dst=1)
        work.wait()
    else:
        if world.rank == 1:
            ad.recv(src=0)
        handle.start(0).wait()
    handle.free()
    return timed_out, x.copy()


@mpi_only
def test_a_persistent_piece_waits_with_a_timeout_for_a_late_peer():
    size = current_size(2)
    if size < 2:
        pytest.skip("needs two ranks")
    for timed_out, x in run_world(_piece_timeout, size):
        assert timed_out
        np.testing.assert_array_equal(x, np.full(200_000, size * (size + 1) / 2))
