"""Means around the size where a two-rank MPI group starts averaging in halves
(``HALVES_FROM_BYTES``), and two-rank reduce-scatters whose result overlaps their input:
equal on every rank, to a float64 NumPy reference, and under ``mpiexec -n 2`` to the bits of
MPI's own ``Allreduce`` SUM divided by two. Runs on the mock world too (where the sizes
are simply more cases); the overlapping reduce-scatter only in a two-rank MPI job.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world, run_world, world_sizes
from hypothesis import example, given
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.mpi.choose import HALVES_FROM_BYTES

DTYPES = ["float32", "float64"]
#: Sizes in elements, as offsets around the threshold and the odd sizes halves split unevenly.
OFFSETS = [-1, 0, 1, 3, 4097]


def _input(seed: int, rank: int, size: int, dtype: str) -> np.ndarray:
    """Values over six decades (different summation orders round differently), with the
    specials a mean must carry: infinities of one sign, a NaN, subnormals."""
    rng = np.random.default_rng([seed, rank])
    x = (rng.standard_normal(size) * np.exp(rng.uniform(-7, 7, size))).astype(dtype)
    if size > 8:
        tiny = np.finfo(dtype).smallest_subnormal
        x[:4] = [np.inf, tiny * (rank + 1), -tiny, 0.0]
        x[size // 2] = np.nan if rank == 0 else 1.0
    return x


def _body_mean(world: ad.World, seed: int, size: int, dtype: str) -> None:
    x = _input(seed, world.rank, size, dtype)
    got = ad.all_reduce_mean(x.copy())
    inputs = [_input(seed, r, size, dtype) for r in range(world.world_size)]
    wide = np.stack(inputs).astype(np.float64)
    want = wide.mean(0)
    finite = np.isfinite(want)
    # each rounding errs by at most eps of the largest magnitude summed (cancellation)
    bound = 4 * np.finfo(dtype).eps * np.abs(wide).max(0) + np.finfo(dtype).smallest_subnormal
    error = np.abs(got[finite].astype(np.float64) - want[finite])
    assert np.all(error <= bound[finite]), "the mean differs from NumPy's"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    everyone = ad.all_gather_object(got.tobytes())
    assert all(b == everyone[0] for b in everyone), "ranks hold different means"
    if UNDER_MPI:
        _bits_of_mpi(world, x, got)


def _bits_of_mpi(world: ad.World, x: np.ndarray, got: np.ndarray) -> None:
    """MPI's own SUM, divided by the group size, has exactly ``got``'s bits on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        want = x.copy()
        comm.Allreduce(MPI.IN_PLACE, want, MPI.SUM)
        np.divide(want, want.dtype.type(world.world_size), out=want)
        verdicts = comm.allgather(np.array_equal(got.view(np.uint8), want.view(np.uint8)))
    finally:
        comm.Free()
    assert all(verdicts), f"the mean's bits differ from MPI's SUM / n on ranks {verdicts}"


@example(n=2, seed=1, dtype="float32", offset=0)
@example(n=2, seed=2, dtype="float64", offset=4097)
@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       offset=st.sampled_from(OFFSETS))
def test_means_on_both_sides_of_the_halves_threshold(n, seed, dtype, offset):
    size = HALVES_FROM_BYTES // np.dtype(dtype).itemsize + offset
    run_world(_body_mean, n, seed, size, dtype)


@pytest.mark.parametrize("size", [1, 2, 3, (1 << 20) // 4 + 1])
def test_means_of_odd_and_tiny_sizes(size):
    n = mpi_world().world_size if UNDER_MPI else 2
    run_world(_body_mean, n, 7, size, "float32")


def _body_overlapping_scatter(world: ad.World, seed: int, rows: int, dtype: str,
                              op: str) -> None:
    n = world.world_size
    x = _input(seed, world.rank, rows * n, dtype)
    x[~np.isfinite(x)] = 1.0
    inputs = [np.where(np.isfinite(v), v, 1.0) for v in
              (_input(seed, r, rows * n, dtype) for r in range(n))]
    block = slice(world.rank * rows, (world.rank + 1) * rows)
    want = np.stack(inputs).astype(np.float64)
    want = (want.mean(0) if op == "average" else want.sum(0))[block]
    got = ad.reduce_scatter(x, op, out=x[block])  # the result lands on its own block
    assert np.shares_memory(got, x)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5,
                               atol=float(np.finfo(dtype).smallest_subnormal))
    fresh = ad.reduce_scatter(inputs[world.rank].copy(), op)  # into a new array
    np.testing.assert_array_equal(fresh.view(np.uint8), got.view(np.uint8))


@pytest.mark.skipif(not UNDER_MPI or mpi_world().world_size != 2,
                    reason="a result overlapping the input is only safe in the two-rank "
                           "exchange (MPI's own collectives forbid aliased buffers)")
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["sum", "average"]), extra=st.sampled_from([0, 1, 513]))
def test_a_pair_reduce_scatter_into_its_own_input_block(seed, dtype, op, extra):
    rows = (64 << 10) // np.dtype(dtype).itemsize // 2 + extra  # above and below the ahead limit
    run_world(_body_overlapping_scatter, 2, seed, rows, dtype, op)


def _body_refused_then_used(world: ad.World, extra: int, other: str) -> None:
    """Rank 1 makes another call than rank 0's two-rank mean (whose first block leaves
    ahead of its check): both raise the mismatch naming it, and the next mean of every rank
    finds no message of the refused call."""
    size = HALVES_FROM_BYTES // 4 + extra
    x = np.full(size, world.rank + 1.0, np.float32)
    with pytest.raises(ad.CollectiveMismatchError, match=other if other != "shape" else
                       r"ranks disagree on shape"):
        if world.rank == 0:
            ad.all_reduce_mean(x)
        elif other == "shape":
            ad.all_reduce_mean(np.ones(size + 7, np.float32))
        elif other == "broadcast":
            ad.broadcast(np.ones(16, np.float32), src=0)
        else:
            ad.all_reduce(np.ones(16, np.float32))
    np.testing.assert_array_equal(x, np.full(size, world.rank + 1.0, np.float32))
    ad.all_reduce_mean(x)
    np.testing.assert_array_equal(x, np.full(size, 1.5, np.float32))
    y = np.full(100, world.rank + 1.0, np.float32)
    ad.all_reduce(y)
    np.testing.assert_array_equal(y, np.full(100, 3.0, np.float32))


@pytest.mark.skipif(not UNDER_MPI or mpi_world().world_size != 2,
                    reason="the block sent ahead of the check is the two-rank MPI mean's")
@pytest.mark.parametrize("other", ["shape", "broadcast", "all_reduce"])
@pytest.mark.parametrize("extra", [0, HALVES_FROM_BYTES // 4 + 3])
def test_a_refused_mean_leaves_no_message_behind(other, extra):
    run_world(_body_refused_then_used, 2, extra, other)
