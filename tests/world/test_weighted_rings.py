"""Weights that travel with the rings: a persistent all-reduce started with this rank's
weight (``start(k, weight)``, ranks with different weights) sums like NumPy, bit for bit
as weighting the piece first and starting it unweighted, and (one host, pieces as big as
the blocking sum's, or two ranks) as the blocking weighted sum with the same factors;
pieces too small for a ring are weighted before they start; the rings' receive buffers
come from one pool that holds no more buffers than rings were in flight at once. Runs on
the mock world (whose handles multiply a piece by the weight before it starts) and
unchanged under ``mpiexec -n K python -m pytest``.
"""

from __future__ import annotations

import numpy as np
from harness import UNDER_MPI, current_size, mpi_world, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends._mpi_allreduce import ScratchPool
from axondist.backends._mpi_common import NODE_CHUNK_BYTES


def _weighted(world, numel, dtype, piece_bytes, weights, seed):
    backend = world.backend
    rng = np.random.default_rng([seed, world.rank])
    x = np.zeros(numel, dtype)
    handle = backend.persistent_all_reduce(x, piece_bytes=piece_bytes)
    weight = weights[world.rank]
    fuses = handle.fuses_weight
    results = []
    for step in range(2):  # the same requests, started again
        values = (rng.standard_normal(numel) * (step + 1)).astype(dtype)
        # the reference: every piece weighted first, then started unweighted
        x[...] = values
        np.multiply(x, weight, out=x, casting="unsafe")
        for work in [handle.start(k) for k in range(len(handle.bounds))]:
            work.wait()
        first = x.copy()
        x[...] = values  # the weight passed with each start
        works = [handle.start(k, weight) for k in range(len(handle.bounds))]
        for work in reversed(works):  # any wait order
            work.wait()
        fused = x.copy()
        blocking = values.copy()
        backend.scaled_sum_blocking(blocking, weight)
        results.append((values, first, fused, blocking))
    handle.free()
    return fuses, results


@settings(max_examples=10, deadline=None)
@given(size=world_sizes(1, 4), numel=st.sampled_from([1_000, 131_073, 300_001, 700_000]),
       dtype=st.sampled_from(["float32", "float64"]),
       piece_bytes=st.sampled_from([600_000, 1 << 20, 8 << 20]),
       weights=st.lists(st.sampled_from([1.0, 0.5, 0.3, 1 / 3, 2.0]), min_size=4,
                        max_size=4),
       seed=st.integers(0, 2**20))
def test_weighted_start_sums_like_numpy_and_like_weighting_first(size, numel, dtype,
                                                                 piece_bytes, weights, seed):
    size = current_size(size)
    weights = [weights[r % 4] for r in range(size)]
    out = run_world(_weighted, size, numel, dtype, piece_bytes, weights, seed)
    if UNDER_MPI:
        every = [mpi_world().backend.comm.allgather(r[1][s][0]) for r in out for s in range(2)]
    else:
        every = [[r[1][s][0] for r in out] for s in range(2)]
    tol = 1e-5 * size if dtype == "float32" else 1e-12
    for fuses, results in out:
        assert fuses == (UNDER_MPI and size > 1)  # the mock world's handles multiply first
        for s, (_, first, fused, blocking) in enumerate(results):
            want = sum(w * a.astype(np.float64) for w, a in zip(weights, every[s]))
            np.testing.assert_allclose(first, want, rtol=tol, atol=tol)
            np.testing.assert_allclose(blocking, want, rtol=tol, atol=tol)
            np.testing.assert_array_equal(fused, first)
            if (UNDER_MPI and mpi_world().backend._blocking_rings
                    and (size <= 2 or piece_bytes >= NODE_CHUNK_BYTES)):
                # one host, pieces asked at least as big as the blocking sum's: capped to
                # them, so the same blocks and bits (two ranks: any blocks, the same bits)
                np.testing.assert_array_equal(first, blocking)


def _rings_in_turn(world, numel, starts):
    """Start the pieces of one persistent all-reduce ``starts`` at a time, waiting for
    each batch: the pool never holds more buffers than pieces were in flight."""
    backend = world.backend
    backend._ring_scratch = ScratchPool()  # this handle's rings share a fresh pool
    x = np.full(numel, float(world.rank + 1), np.float32)
    handle = backend.persistent_all_reduce(x, piece_bytes=1 << 20)
    pieces = len(handle.bounds)
    for k0 in range(0, pieces, starts):
        works = [handle.start(k, 0.5) for k in range(k0, min(pieces, k0 + starts))]
        for work in works:
            work.wait()
    pool = backend._ring_scratch
    handle.free()
    return pieces, len(pool), x.copy()


def test_ring_buffers_come_from_one_small_pool():
    size = current_size(2)
    if not UNDER_MPI or size < 2:
        return  # only MPI's persistent rings borrow buffers
    for starts in (1, 2):
        for pieces, pooled, x in run_world(_rings_in_turn, size, 6 * (1 << 18), starts):
            assert pieces == 6
            assert 1 <= pooled <= starts  # one per ring in flight, never one per piece
            np.testing.assert_array_equal(x, np.full(x.size, 0.5 * size * (size + 1) / 2,
                                                     np.float32))
