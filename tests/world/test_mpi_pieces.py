"""Means, weighted sums and reduce-scatters in pieces, on every rank count.

The public calls run on the mock world and, under ``mpiexec``, on MPI (big
odd-length buffers, so MPI splits them into pieces). The backend-level
properties need MPI itself and are skipped elsewhere: each builds a backend
with its own piece size on a duplicate of the world's communicator and
compares the average with the sum the same backend computes in pieces of the
same size, bit for bit (the sum's order is MPI's, the same in both).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp, _array
from axondist.backends._mpi_common import (
    MEAN_IN_BLOCKS_BYTES,
    MPIOptions,
    block_counts,
    mean_scaling,
    piece_bounds,
    piece_size,
)
from axondist.backends.mpi import MPIBackend

FLOATS = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-14,
       "complex64": 2e-6, "complex128": 1e-14}
seeds = st.integers(0, 2**31 - 1)
mpi_only = pytest.mark.skipif(not UNDER_MPI, reason="needs an MPI world (run under mpiexec; "
                                                    "tests/world/test_mpi_launch.py does)")


def values(seed: int, rank: int, numel: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input: standard normal values (complex: both parts)."""
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal(numel)
    if dtype.startswith("complex"):
        x = x + 1j * rng.standard_normal(numel)
    return x.astype(_array.dtype_named(dtype))


# --- public calls, every world ------------------------------------------------------------

@settings(max_examples=6)
@given(n=world_sizes(1, 4), seed=seeds, dtype=st.sampled_from(FLOATS),
       numel=st.sampled_from([1, 4097, 131_073, 300_001]))
def test_mean_of_big_odd_buffers_matches_numpy(n, seed, dtype, numel):
    """Above the 512 KiB piece size on MPI; float16/bfloat16 go through float32."""
    def body(world: ad.World) -> None:
        k = world.world_size
        inputs = [values(seed, r, numel, dtype) for r in range(k)]
        got = ad.all_reduce_mean(inputs[world.rank].copy())
        wide = np.stack(inputs).astype(np.complex128 if "complex" in dtype else np.float64)
        want = wide.mean(axis=0)
        assert got.dtype == inputs[0].dtype
        np.testing.assert_allclose(got.astype(want.dtype), want, rtol=TOL[dtype],
                                   atol=TOL[dtype])

    run_world(body, n)


@settings(max_examples=6)
@given(n=world_sizes(1, 4), seed=seeds, dtype=st.sampled_from(FLOATS + ["int32"]),
       rows=st.integers(0, 40), mean=st.booleans())
def test_reduce_scatter_of_uneven_and_even_rows_matches_numpy(n, seed, dtype, rows, mean):
    op = ReduceOp.AVERAGE if mean and dtype != "int32" else ReduceOp.SUM

    def body(world: ad.World) -> None:
        k = world.world_size
        inputs = [values(seed, r, rows * 3, dtype).reshape(rows, 3) for r in range(k)]
        got = ad.reduce_scatter(inputs[world.rank], op)
        wide = np.stack(inputs).astype(np.complex128 if "complex" in dtype else np.float64)
        want = np.array_split(wide.mean(axis=0) if mean and dtype != "int32"
                              else wide.sum(axis=0), k)[world.rank]
        assert got.shape == want.shape and got.dtype == inputs[0].dtype
        tol = TOL.get(dtype, 0) * k
        np.testing.assert_allclose(got.astype(want.dtype), want, rtol=tol, atol=tol)

    run_world(body, n)


# --- the MPI backend itself ---------------------------------------------------------------

def _backend(node_ids: list[int] | None = None, **options: Any) -> Any:
    """A backend over a duplicate of the MPI world's communicator (collective); with
    ``node_ids``, as if its ranks ran on those hosts."""
    world = mpi_world().backend
    return MPIBackend(world.comm.Dup(), MPIOptions(**options), recorder=world.recorder,
                      group_name="world.pieces", node_ids=node_ids)


@mpi_only
@given(seed=seeds, dtype=st.sampled_from(FLOATS), numel=st.integers(0, 700),
       piece=st.integers(1, 600))
def test_average_is_the_pieced_sum_divided_by_n_bit_for_bit(seed, dtype, numel, piece):
    """Every dtype, odd lengths, pieces of any size (a piece holds at least one element):
    the mean equals the sum of the same pieces divided by n, bit for bit, also where the
    division is a multiplication by an exact 1/n (n a power of two)."""
    b = _backend(piece_bytes=piece, chunk_bytes=piece)  # the sum's pieces: the same calls
    try:
        x = values(seed, b.rank, numel, dtype)
        total, mean = x.copy(), x.copy()
        b.all_reduce(total, ReduceOp.SUM)
        b.all_reduce(mean, ReduceOp.AVERAGE)
        np.testing.assert_array_equal(mean, np.divide(total, b.world_size))
        # The blocking entry point (small calls may sum in another order there, the same
        # for SUM and AVERAGE).
        total, mean = x.copy(), x.copy()
        b.all_reduce_blocking(total, ReduceOp.SUM)
        b.all_reduce_blocking(mean, ReduceOp.AVERAGE)
        np.testing.assert_array_equal(mean, np.divide(total, b.world_size))
    finally:
        b.close()


class _Calls:
    """A communicator proxy that records the names of the MPI calls made through it."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.names = comm, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.comm, name)
        if name[:1].isupper() and callable(attr):
            self.names.append(name)
        return attr


def _ring_mean(inputs: list[np.ndarray]) -> np.ndarray:
    """The ring's mean, in its order: block j starts from rank j's values, and each rank
    along the ring adds its own in front; the owner scales the sum (mean_scaling)."""
    n = len(inputs)
    counts = block_counts(inputs[0].size, n)
    starts = np.cumsum([0] + counts)
    want = np.empty_like(inputs[0])
    how, by = mean_scaling(n)
    for j in range(n):
        lo, hi = starts[j], starts[j + 1]
        acc = inputs[j][lo:hi].copy()
        for k in range(1, n):
            np.add(inputs[(j + k) % n][lo:hi], acc, out=acc)
        getattr(np, how)(acc, by, out=want[lo:hi], casting="unsafe")
    return want


@mpi_only
@settings(max_examples=12)
@given(seed=seeds, dtype=st.sampled_from(FLOATS), extra=st.integers(0, 5),
       chunk=st.sampled_from([0, 96 << 10, 200_003]))
def test_big_averages_run_as_a_ring_with_one_scaled_pass(seed, dtype, extra, chunk):
    """Above MEAN_IN_BLOCKS_BYTES, per ``chunk_bytes`` piece: no collective on the data's
    communicator (the ring's messages are point to point on the group's private one),
    every rank the same bits, each block summed in the ring's order and scaled once."""
    b = _backend(chunk_bytes=chunk)
    try:
        n = b.world_size
        dt = _array.dtype_named(dtype)
        numel = MEAN_IN_BLOCKS_BYTES // dt.itemsize + 1 + extra * 7
        x = values(seed, b.rank, numel, dtype)
        spy = b._comm = _Calls(b._comm)
        got = x.copy()
        b.all_reduce(got, ReduceOp.AVERAGE)
        b._comm = spy.comm
        if n > 1:
            assert spy.names == []
        inputs = [values(seed, r, numel, dtype) for r in range(n)]
        want = np.empty_like(x)
        for lo, hi in piece_bounds(numel, dt.itemsize, chunk or sys.maxsize):
            want[lo:hi] = _ring_mean([v[lo:hi] for v in inputs])
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        wide = np.complex128 if "complex" in dtype else np.float64
        exact = np.mean([values(seed, r, numel, dtype).astype(wide) for r in range(n)], axis=0)
        np.testing.assert_allclose(got.astype(wide), exact, rtol=TOL[dtype] * n,
                                   atol=TOL[dtype] * n)
    finally:
        b.close()


@mpi_only
@given(seed=seeds, dtype=st.sampled_from(FLOATS), numel=st.integers(0, 700),
       piece=st.integers(1, 600))
def test_scaled_sum_weights_each_rank_then_sums_bit_for_bit(seed, dtype, numel, piece):
    """Ranks pass different factors; each piece is weighted once, before its sum. The
    reference sums the weighted pieces with MPI's own all-reduce (a backend without
    checks: with them, a small all-reduce's data rides with its check and may sum in
    another order)."""
    b = _backend(piece_bytes=piece, chunk_bytes=piece)
    raw = _backend(piece_bytes=piece, chunk_bytes=piece, checks=False)
    try:
        x = values(seed, b.rank, numel, dtype)
        factor = (b.rank + 1) / 7
        want = np.multiply(x, factor, casting="unsafe").astype(x.dtype)
        raw.all_reduce(want, ReduceOp.SUM)
        got = x.copy()
        b.scaled_sum_blocking(got, factor)
        np.testing.assert_array_equal(got, want)
    finally:
        raw.close()
        b.close()


@mpi_only
@given(seed=seeds, dtype=st.sampled_from(FLOATS + ["int64", "bool"]),
       counts_seed=seeds, equal=st.booleans(), op=st.sampled_from(list(ReduceOp)))
def test_reduce_scatter_blocking_equals_the_general_call(seed, dtype, counts_seed, equal, op):
    """Equal counts (Reduce_scatter_block) and uneven ones; AVERAGE is the SUM divided."""
    b = _backend()
    try:
        n = b.world_size
        rng = np.random.default_rng(counts_seed)
        counts = [int(rng.integers(0, 9))] * n if equal else [int(c) for c in
                                                              rng.integers(0, 9, size=n)]
        x = values(seed, b.rank, sum(counts), dtype)
        if x.dtype not in b._plans_by_name[op.name]:
            with pytest.raises(ad.UnsupportedDTypeError, match="reduce_scatter"):
                b.reduce_scatter_blocking(x, np.zeros(counts[b.rank], x.dtype), counts, op)
            return
        fast = np.zeros(counts[b.rank], x.dtype)
        general = np.zeros(counts[b.rank], x.dtype)
        b.reduce_scatter_blocking(x, fast, counts, op)
        assert b.reduce_scatter(x, general, counts, op).wait() is general
        np.testing.assert_array_equal(fast, general)
        if op is ReduceOp.AVERAGE:
            total = np.zeros(counts[b.rank], x.dtype)
            b.reduce_scatter_blocking(x, total, counts, ReduceOp.SUM)
            np.testing.assert_array_equal(fast, np.divide(total, n).astype(x.dtype))
    finally:
        b.close()


@mpi_only
@pytest.mark.parametrize("piece", [None, 3, 1 << 40])
def test_weighted_sums_make_one_call_per_piece(piece):
    b = _backend(piece_bytes=piece, chunk_bytes=1000)
    try:
        x = values(7, b.rank, 1001, "float32")  # 4004 bytes
        spy = b._comm = _Calls(b._comm)
        b.scaled_sum_blocking(x, 0.5)
        b._comm = spy.comm
        pieces = piece_bounds(1001, 4, piece_size(piece, 1000))
        assert spy.names == ["Allreduce"] * len(pieces)
    finally:
        b.close()


@mpi_only
@settings(max_examples=16)
@given(seed=seeds, dtype=st.sampled_from(["float32", "float64", "int32", "int64"]),
       op=st.sampled_from(["SUM", "AVERAGE", "MAX", "MIN", "PRODUCT"]),
       extra=st.integers(0, 40), trailing=st.sampled_from([1, 3]))
def test_big_reduce_scatters_run_as_a_ring(seed, dtype, op, extra, trailing):
    """Above MEAN_IN_BLOCKS_BYTES a blocking reduce-scatter is a ring of point-to-point
    messages (no collective on the data's communicator): this rank's block of the
    reduction, uneven blocks too, and the input left as it was."""
    if op == "AVERAGE" and dtype.startswith("int"):
        op = "SUM"
    b = _backend()
    try:
        n = b.world_size
        itemsize = np.dtype(dtype).itemsize
        rows = MEAN_IN_BLOCKS_BYTES // (itemsize * trailing) + 1 + extra
        rngs = [np.random.default_rng([seed, r]) for r in range(n)]
        if op == "PRODUCT":
            inputs = [g.choice([-1, 1], size=(rows, trailing)).astype(dtype) for g in rngs]
        elif dtype.startswith("int"):
            inputs = [g.integers(-1000, 1000, size=(rows, trailing)).astype(dtype) for g in rngs]
        else:
            inputs = [g.standard_normal((rows, trailing)).astype(dtype) for g in rngs]
        x = inputs[b.rank].copy()
        blocks = np.array_split(np.arange(rows), n)
        counts = [len(k) * trailing for k in blocks]
        out = np.empty((counts[b.rank] // trailing, trailing), dtype)
        spy = b._comm = _Calls(b._comm)
        b.reduce_scatter(x, out, counts, ReduceOp[op])
        b._comm = spy.comm
        if n > 1:
            assert spy.names == []
        np.testing.assert_array_equal(x, inputs[b.rank])
        stack = np.stack(inputs).astype(np.float64 if dtype.startswith("float") else dtype)
        whole = {"SUM": stack.sum(0), "AVERAGE": stack.mean(0), "MAX": stack.max(0),
                 "MIN": stack.min(0), "PRODUCT": stack.prod(0)}[op]
        want = whole[blocks[b.rank]]
        if dtype.startswith("float"):
            tol = (1e-5 if dtype == "float32" else 1e-12) * n
            np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(out, want)
    finally:
        b.close()


@mpi_only
@settings(max_examples=10)
@given(seed=seeds, dtype=st.sampled_from(["float32", "float64"]), extra=st.integers(0, 40),
       weights=st.lists(st.sampled_from([1.0, 0.5, 0.25, 1 / 3, 2.0]), min_size=3, max_size=3))
def test_big_weighted_sums_run_as_a_weighted_ring(seed, dtype, extra, weights):
    """Above MEAN_IN_BLOCKS_BYTES a weighted sum (ranks' factors differ) is the weighted
    ring: no collective on the data's communicator, every rank the same bits, the sum
    of each rank's values times its own weight."""
    b = _backend()
    try:
        n = b.world_size
        numel = MEAN_IN_BLOCKS_BYTES // np.dtype(dtype).itemsize + 1 + extra
        inputs = [values(seed, r, numel, dtype) for r in range(n)]
        x = inputs[b.rank].copy()
        spy = b._comm = _Calls(b._comm)
        b.scaled_sum_blocking(x, weights[b.rank])
        b._comm = spy.comm
        if n > 1:
            assert spy.names == []
        want = sum(v.astype(np.float64) * w for v, w in zip(inputs, weights))
        tol = (1e-5 if dtype == "float32" else 1e-12) * n
        np.testing.assert_allclose(x, want, rtol=tol, atol=tol)
        everyone = mpi_world().backend_for("test").allgather_object(x.tobytes())
        assert all(e == everyone[0] for e in everyone), "ranks hold different sums"
    finally:
        b.close()


@mpi_only
@settings(max_examples=4)
@given(seed=seeds, dtype=st.sampled_from(["float32", "float64"]))
def test_across_hosts_big_blocking_reductions_use_mpis_own_collectives(seed, dtype):
    """A ring's 2 (n - 1) steps each wait for the link's latency across hosts: there the
    big weighted sum, mean and reduce-scatter are MPICH's own collectives (fewer rounds),
    with the same values."""
    n = mpi_world().world_size
    b = _backend(node_ids=[r % 2 for r in range(n)])  # every other rank on a second host
    try:
        numel = (MEAN_IN_BLOCKS_BYTES // np.dtype(dtype).itemsize + 1) * n
        inputs = [values(seed, r, numel, dtype) for r in range(n)]
        exact = sum(v.astype(np.float64) for v in inputs)
        tol = (1e-5 if dtype == "float32" else 1e-12) * n
        spy = b._comm = _Calls(b._comm)
        x = inputs[b.rank].copy()
        b.scaled_sum_blocking(x, 0.5)
        np.testing.assert_allclose(x, 0.5 * exact, rtol=tol, atol=tol)
        y = inputs[b.rank].copy()
        b.all_reduce(y, ReduceOp.AVERAGE)
        np.testing.assert_allclose(y, exact / n, rtol=tol, atol=tol)
        per = numel // n
        out = np.empty(per, dtype)
        b.reduce_scatter(inputs[b.rank].copy(), out, [per] * n, ReduceOp.SUM).wait()
        np.testing.assert_allclose(out, exact[b.rank * per:(b.rank + 1) * per], rtol=tol,
                                   atol=tol)
        b._comm = spy.comm
        if n > 1:
            assert {"Allreduce", "Reduce_scatter_block"} <= set(spy.names), spy.names
    finally:
        b.close()

