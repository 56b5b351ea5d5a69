"""Persistent all-reduces started with ``same_weight=True`` (a plain mean: the rings send no
weights round) sum like NumPy and, on one host where a piece asked for is capped at the
blocking weighted sum's pieces and ringed wherever that sum rings them, bit for bit like
the blocking weighted sum, also with several pieces and three or more ranks; OVERLAPPED
DDP keeps SYNCHRONOUS's bits on any number of ranks. Runs on the mock world (which
multiplies each piece first) and unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from harness import UNDER_MPI, current_size, mpi_world, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends._mpi_common import MPIOptions, piece_bounds
from axondist.backends.mpi import MPIBackend
from axondist.ddp import DDP, GradSyncStrategy
from axondist.parameter import Parameter

SYNC, OVER = GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED


def _backend(world: Any, chunk: int) -> Any:
    """The world's backend, or under MPI one over a duplicate communicator with pieces of
    ``chunk`` bytes (collective)."""
    if not UNDER_MPI:
        return world.backend
    base = mpi_world().backend
    return MPIBackend(base.comm.Dup(), MPIOptions(chunk_bytes=chunk), recorder=base.recorder,
                      group_name="world.units")


def _units(world, numel, dtype, chunk, per, weights, same, seed):
    backend = _backend(world, chunk)
    rng = np.random.default_rng([seed, world.rank])
    x = np.zeros(numel, dtype)
    handle = backend.persistent_all_reduce(x, piece_bytes=per * chunk)
    weight = weights[world.rank]
    results = []
    for step in range(2):  # the same requests, started again
        values = (rng.standard_normal(numel) * (step + 1)).astype(dtype)
        x[...] = values
        works = [handle.start(k, weight, same_weight=same) for k in range(len(handle.bounds))]
        for work in reversed(works):  # any wait order
            work.wait()
        blocking = values.copy()
        backend.scaled_sum_blocking(blocking, weight)
        results.append((values, x.copy(), blocking))
    bounds = list(handle.bounds)
    handle.free()
    rings = getattr(backend, "_ring_pieces", None)
    if UNDER_MPI:
        backend.close()
    return bounds, rings, results


@settings(max_examples=6, deadline=None)
@given(size=world_sizes(1, 4), numel=st.sampled_from([300_001, 700_000, 1_000_003]),
       dtype=st.sampled_from(["float32", "float64"]), per=st.integers(1, 4),
       same=st.booleans(), weight=st.sampled_from([1.0, 0.5, 0.3, 1 / 3]),
       others=st.lists(st.sampled_from([1.0, 0.5, 2.0]), min_size=4, max_size=4),
       seed=st.integers(0, 2**20))
def test_same_weight_rings_sum_like_numpy_and_the_blocking_sum(
        size, numel, dtype, per, same, weight, others, seed):
    size = current_size(size)
    chunk = 600_000  # above 512 KiB: every block rings
    weights = [weight] * size if same else [others[r % 4] for r in range(size)]
    out = run_world(_units, size, numel, dtype, chunk, per, weights, same, seed)
    if UNDER_MPI:
        every = [mpi_world().backend.comm.allgather(out[0][2][s][0]) for s in range(2)]
    else:
        every = [[r[2][s][0] for r in out] for s in range(2)]
    tol = 1e-5 * size if dtype == "float32" else 1e-12
    itemsize = np.dtype(dtype).itemsize
    for bounds, _, results in out:
        if UNDER_MPI and size > 1:  # one host: capped at the blocking sum's pieces
            assert bounds == piece_bounds(numel, itemsize, chunk)
        for s, (_, got, blocking) in enumerate(results):
            want = sum(w * a.astype(np.float64) for w, a in zip(weights, every[s]))
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            if UNDER_MPI and size > 1:
                np.testing.assert_array_equal(got, blocking)  # the same blocks, the same bits


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
    pieces = [len(h.bounds) for h in ddp.synchronizer.persistent]
    ddp.close()
    return [p.data.copy() for p in params], pieces


@settings(max_examples=4, deadline=None)
@given(size=world_sizes(1, 3), weighted=st.booleans())
def test_ddp_overlapped_keeps_synchronous_bits_with_default_pieces(size, weighted):
    """The default pieces (4 MiB asked, one host's 2 MiB given) on any number of ranks:
    OVERLAPPED's parameters equal SYNCHRONOUS's bit for bit, and both are single-process
    training on the weighted mean within float32's rounding."""
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
    for (a, pieces), (b, _) in zip(over, sync):
        if UNDER_MPI and size > 1:
            assert sum(pieces) >= sum(int(np.prod(s)) for s in SHAPES) * 4 / (2 << 20)
        for x, y, ref in zip(a, b, want):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5)


def test_same_weight_flag_reaches_a_handle_that_multiplies_first():
    """Backends that do not fuse the weight ignore ``same_weight``: the piece is multiplied
    before it starts, as without the flag."""
    size = current_size(2)

    def body(world):
        x = np.full(10, float(world.rank + 1))
        handle = world.backend.persistent_all_reduce(x, piece_bytes=40)
        for k in range(len(handle.bounds)):
            handle.start(k, 0.5, same_weight=True).wait()
        handle.free()
        return x.copy()

    for x in run_world(body, size):
        np.testing.assert_array_equal(x, np.full(10, 0.5 * size * (size + 1) / 2))

