"""Means, weighted sums and reduce-scatters, on every rank count; big all-reduces and
broadcasts in pieces on one node and whole across nodes.

The public calls run on the mock world and, under ``mpiexec``, on MPI. The backend-level
properties need MPI itself and are skipped elsewhere: each builds a backend with its own
options on a duplicate of the world's communicator (sharing the world's datatypes) and
compares a mean with the sum the same backend computes, bit for bit, or counts the MPI
calls a big all-reduce makes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp, _array
from axondist.backends.mpi import MPIBackend, MPIOptions
from axondist.backends.mpi.choose import PIECES_FROM_BYTES
from axondist.backends.mpi.transport import piece_bounds

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
    """float16/bfloat16 go through float32."""
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
                      group_name="world.pieces", node_ids=node_ids, types=world.types)


@mpi_only
@given(seed=seeds, dtype=st.sampled_from(FLOATS), numel=st.integers(0, 700),
       checks=st.booleans())
def test_average_is_the_sum_divided_by_n_bit_for_bit(seed, dtype, numel, checks):
    """Every dtype, odd lengths, riding or not: the mean equals the same backend's sum
    divided by n, bit for bit, also where the division is a multiplication by an exact
    1/n (n a power of two); float16/bfloat16 are summed in float32, so only close."""
    b = _backend(checks=checks)
    try:
        x = values(seed, b.rank, numel, dtype)
        for async_op in (False, True):
            total, mean = x.copy(), x.copy()
            b.all_reduce(total, ReduceOp.SUM, async_op=async_op).wait()
            b.all_reduce(mean, ReduceOp.AVERAGE, async_op=async_op).wait()
            if dtype in ("float16", "bfloat16"):
                wide = np.divide(total.astype(np.float64), b.world_size)
                np.testing.assert_allclose(mean.astype(np.float64), wide, rtol=TOL[dtype] * 4,
                                           atol=TOL[dtype] * 4)
            else:
                np.testing.assert_array_equal(mean, np.divide(total, b.world_size))
    finally:
        b.close()


@mpi_only
@given(seed=seeds, dtype=st.sampled_from(FLOATS), numel=st.integers(0, 700))
def test_scaled_sum_weights_each_rank_then_sums_bit_for_bit(seed, dtype, numel):
    """Ranks pass different factors; each rank's values are weighted once, before the
    sum. The reference sums the weighted values with MPI's own all-reduce (a backend
    without checks: with them, a small all-reduce of two ranks rides with its check)."""
    b = _backend()
    raw = _backend(checks=False)
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
       counts_seed=seeds, equal=st.booleans(), op=st.sampled_from(list(ReduceOp)),
       async_op=st.booleans())
def test_reduce_scatter_average_is_the_sum_divided(seed, dtype, counts_seed, equal, op,
                                                   async_op):
    """Equal counts (Reduce_scatter_block) and uneven ones; AVERAGE is the SUM divided;
    a dtype and op without a reduction is refused naming the call."""
    b = _backend()
    try:
        n = b.world_size
        rng = np.random.default_rng(counts_seed)
        counts = [int(rng.integers(0, 9))] * n if equal else [int(c) for c in
                                                              rng.integers(0, 9, size=n)]
        x = values(seed, b.rank, sum(counts), dtype)
        if x.dtype not in b.types.reduce[op.name]:
            with pytest.raises(ad.UnsupportedDTypeError, match="reduce_scatter"):
                b.reduce_scatter(x, np.zeros(counts[b.rank], x.dtype), counts, op)
            return
        out = np.zeros(counts[b.rank], x.dtype)
        assert b.reduce_scatter(x, out, counts, op, async_op=async_op).wait() is out
        total = np.zeros(counts[b.rank], x.dtype)
        b.reduce_scatter(x, total, counts, ReduceOp.SUM)
        if op is ReduceOp.SUM:
            np.testing.assert_array_equal(out, total)
        if op is ReduceOp.AVERAGE and dtype not in ("float16", "bfloat16"):
            np.testing.assert_array_equal(out, np.divide(total, n).astype(x.dtype))
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


def _spied(node_ids: list[int] | None = None, **options: Any) -> tuple[Any, _Calls]:
    """A backend whose plans will call MPI through a spy (set before any plan is made)."""
    b = _backend(node_ids, **options)
    spy = b._comm = _Calls(b._comm)
    return b, spy


def _close(b: Any, spy: _Calls) -> None:
    b._comm = spy.comm
    b.close()


@mpi_only
@settings(max_examples=4)
@given(seed=seeds, dtype=st.sampled_from(["float32", "float64"]), extra=st.integers(0, 5))
def test_big_all_reduces_go_in_pieces_on_one_node_and_broadcasts_whole(seed, dtype, extra):
    """From PIECES_FROM_BYTES on one node: one Allreduce per piece of at most the chunk
    (NODE_CHUNK_BYTES by default), the values of one whole call; a broadcast as big is one
    Bcast (in pieces it measured slower)."""
    n = mpi_world().world_size
    b, spy = _spied(node_ids=[0] * n)
    try:
        itemsize = np.dtype(dtype).itemsize
        numel = PIECES_FROM_BYTES // itemsize + extra
        pieces = piece_bounds(numel, itemsize, b.layout.chunk)
        assert len(pieces) > 1
        inputs = [values(seed, r, numel, dtype) for r in range(n)]
        x = inputs[b.rank].copy()
        b.all_reduce(x, ReduceOp.SUM)
        assert spy.names == ["Allreduce"] * len(pieces), spy.names
        tol = (1e-5 if dtype == "float32" else 1e-12) * n
        np.testing.assert_allclose(x, np.sum([v.astype(np.float64) for v in inputs], 0),
                                   rtol=tol, atol=tol)
        spy.names.clear()
        root = seed % n
        y = inputs[b.rank].copy()
        b.broadcast(y, root)
        assert spy.names == ["Bcast"], spy.names
        np.testing.assert_array_equal(y, inputs[root])
    finally:
        _close(b, spy)


@mpi_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=1)  # 32 MiB a rank per call: one seed a dtype shows the one call
@given(seed=seeds)
def test_across_hosts_big_reductions_are_one_mpi_call(seed, dtype):
    """Across hosts every piece would wait for the link's latency: there a big all-reduce,
    broadcast, mean and reduce-scatter are each one call of MPICH's own collective, with
    the same values."""
    n = mpi_world().world_size
    b, spy = _spied(node_ids=[r % 2 for r in range(n)])  # every other rank on a second host
    try:
        numel = -(-PIECES_FROM_BYTES // np.dtype(dtype).itemsize // n) * n  # n equal blocks
        inputs = [values(seed, r, numel, dtype) for r in range(n)]
        exact = sum(v.astype(np.float64) for v in inputs)
        tol = (1e-5 if dtype == "float32" else 1e-12) * n
        x = inputs[b.rank].copy()
        b.all_reduce(x, ReduceOp.SUM)
        np.testing.assert_allclose(x, exact, rtol=tol, atol=tol)
        y = inputs[b.rank].copy()
        b.all_reduce(y, ReduceOp.AVERAGE)
        np.testing.assert_allclose(y, exact / n, rtol=tol, atol=tol)
        z = inputs[b.rank].copy()
        b.broadcast(z, n - 1)
        np.testing.assert_array_equal(z, inputs[n - 1])
        per = numel // n
        out = np.empty(per, dtype)
        b.reduce_scatter(inputs[b.rank].copy(), out, [per] * n, ReduceOp.SUM).wait()
        np.testing.assert_allclose(out, exact[b.rank * per:(b.rank + 1) * per], rtol=tol,
                                   atol=tol)
        assert spy.names == ["Allreduce", "Allreduce", "Bcast", "Reduce_scatter_block"], (
            spy.names)
    finally:
        _close(b, spy)


@mpi_only
@settings(max_examples=6)
@given(seed=seeds, dtype=st.sampled_from(["float32", "float64", "int32", "int64"]),
       kib=st.sampled_from([32, 64, 65, 1024, 2048, 2049]), mean=st.booleans())
def test_gathers_and_reduce_scatters_give_mpis_bits_on_both_sides_of_the_pair_exchange(
        seed, dtype, kib, mean):
    """All-gathers with sizes and reduce-scatters around the sizes where two ranks on one
    node exchange point to point (PAIR_FROM_BYTES, PAIR_GATHER_MAX_BYTES): the bits of
    mpi4py's own Allgather and Reduce_scatter_block on the same inputs (a mean: that sum
    divided by n)."""
    from mpi4py import MPI

    world = mpi_world()
    n, comm = world.world_size, world.backend.comm
    numel = kib * 1024 // np.dtype(dtype).itemsize // n * n
    x = values(seed, world.rank, numel, dtype) * (100 if dtype.startswith("int") else 1)
    x = x.astype(dtype)
    got = ad.all_gather(x, sizes=[numel] * n)
    want = np.empty(numel * n, dtype)
    comm.Allgather(x, want)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    op = ReduceOp.AVERAGE if mean and dtype.startswith("float") else ReduceOp.SUM
    block = ad.reduce_scatter(x, op)
    total = np.empty(numel // n, dtype)
    comm.Reduce_scatter_block(x, total, MPI.SUM)
    if op is ReduceOp.AVERAGE:
        total = np.divide(total, n).astype(dtype)
    np.testing.assert_array_equal(block.view(np.uint8), total.view(np.uint8))
