"""All-reduces around the size where the MPI backend's cross-rank check stops riding in
the message itself (``RIDE_MAX_BYTES``): the same values on both sides of it, for
every op and dtype the riding path takes, equal on every rank and to NumPy's.
Runs on the mock world too (where the sizes are simply more cases).
"""

from __future__ import annotations

import numpy as np
from harness import run_world, world_sizes
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist._array import dtype_named
from axondist.backends.base import PLAN_CACHE_LIMIT as _RIDERS_LIMIT
from axondist.backends.mpi.choose import EXCHANGE_RIDE_MAX_BYTES, RIDE_MAX_BYTES

OPS = ["sum", "average", "max", "min", "product"]
DTYPES = ["float32", "float64", "int32", "int64"]


def _input(seed: int, rank: int, size: int, dtype: str, op: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if op == "product":
        return rng.choice([-1, 1, 2], size=size).astype(dtype)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, size=size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def _reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(inputs)
    wide = stack.astype(np.float64) if stack.dtype.kind == "f" else stack
    return {"sum": wide.sum(0), "average": wide.mean(0), "max": wide.max(0),
            "min": wide.min(0), "product": wide.prod(0)}[op]


def _body(world: ad.World, seed: int, size: int, dtype: str, op: str) -> np.ndarray:
    x = _input(seed, world.rank, size, dtype, op)
    ad.all_reduce(x, op)
    want = _reference([_input(seed, r, size, dtype, op) for r in range(world.world_size)], op)
    if x.dtype.kind == "f":
        tol = (1e-5 if dtype == "float32" else 1e-12) * world.world_size
        np.testing.assert_allclose(x.astype(np.float64), want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(x, want)
    # every rank holds the same bits: the ranks' results gathered and compared
    everyone = ad.all_gather_object(x.tobytes())
    assert all(b == everyone[0] for b in everyone), "ranks hold different results"
    return x


@given(n=world_sizes(1, 5), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(OPS), offset=st.sampled_from([-1, 0, 1]))
def test_all_reduce_on_both_sides_of_the_riding_limit(n, seed, dtype, op, offset):
    if op == "average" and dtype.startswith("int"):
        op = "sum"
    size = RIDE_MAX_BYTES // np.dtype(dtype).itemsize + offset
    run_world(_body, n, seed, size, dtype, op)


@given(n=world_sizes(1, 5), seed=st.integers(0, 2**31 - 1), size=st.integers(0, 40),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS))
def test_small_all_reduces_match_numpy_on_every_rank(n, seed, size, dtype, op):
    if op == "average" and dtype.startswith("int"):
        op = "sum"
    run_world(_body, n, seed, size, dtype, op)


class _Tagged(np.ndarray):
    """A NumPy subclass, as arrays from memory maps or other libraries often are."""


def _body_subclass_on_some_ranks(world: ad.World, seed: int, size: int) -> None:
    x = _input(seed, world.rank, size, "float64", "sum")
    if world.rank % 2:
        x = x.view(_Tagged)  # takes the general path, not the exact-ndarray one
    ad.all_reduce(x)
    want = _reference([_input(seed, r, size, "float64", "sum")
                       for r in range(world.world_size)], "sum")
    np.testing.assert_allclose(np.asarray(x), want, rtol=1e-12 * world.world_size)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1), size=st.integers(1, 64))
def test_ranks_passing_array_subclasses_still_agree(n, seed, size):
    # Once, a rank whose first call passed a subclass decided not to let the data ride
    # while the others did: they returned their own values and that rank hung.
    run_world(_body_subclass_on_some_ranks, n, seed, size)


def _body_many_shapes(world: ad.World, seed: int, count: int) -> None:
    rng = np.random.default_rng(seed)  # the same shapes on every rank
    for k in range(count):
        shape = tuple(int(d) for d in rng.integers(1, 13, size=int(rng.integers(1, 4))))
        x = np.full(shape, world.rank + k, np.float64)
        ad.all_reduce(x)
        n = world.world_size
        np.testing.assert_array_equal(x, np.full(shape, n * k + n * (n - 1) / 2))


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1))
def test_more_shapes_than_the_plan_cache_holds(n, seed):
    # Multi-dimensional buffers ride in their own shape; past the cache's limit the
    # plans (and their persistent sends) are dropped and made again.
    run_world(_body_many_shapes, n, seed, _RIDERS_LIMIT + 40)


# --- the carried collectives: in a group of two, small all_gather, reduce_scatter and
# broadcast send their data with the check (every size here runs on any group size)

MOVE_DTYPES = ["float32", "float64", "int32", "int64", "bool", "float16", "bfloat16", "uint8"]


def _moved(seed: int, rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = np.random.default_rng([seed, rank]).integers(-40, 40, size=shape)
    return values.astype(dtype_named(dtype))


def _body_gather(world: ad.World, seed: int, rows: list[int], trailing: tuple[int, ...],
                 dtype: str, give_sizes: bool) -> None:
    n = world.world_size
    counts = [rows[r % len(rows)] for r in range(n)]
    x = _moved(seed, world.rank, (counts[world.rank],) + trailing, dtype)
    got = ad.all_gather(x, sizes=counts if give_sizes else None)
    want = np.concatenate([_moved(seed, r, (counts[r],) + trailing, dtype) for r in range(n)])
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1),
       rows=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       trailing=st.sampled_from([(), (3,), (2, 2)]), dtype=st.sampled_from(MOVE_DTYPES),
       give_sizes=st.booleans())
def test_small_all_gathers_match_numpy(n, seed, rows, trailing, dtype, give_sizes):
    run_world(_body_gather, n, seed, rows, trailing, dtype, give_sizes)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1), offset=st.sampled_from([-1, 0, 1]),
       dtype=st.sampled_from(["float32", "float64"]),
       limit=st.sampled_from([EXCHANGE_RIDE_MAX_BYTES, RIDE_MAX_BYTES]))
def test_all_gather_on_both_sides_of_the_riding_limit(n, seed, offset, dtype, limit):
    rows = limit // np.dtype(dtype).itemsize + offset
    run_world(_body_gather, n, seed, [rows], (), dtype, True)


def _body_scatter(world: ad.World, seed: int, rows: int, dtype: str, op: str) -> None:
    n = world.world_size
    x = _input(seed, world.rank, rows * 3, dtype, op).reshape(rows, 3)
    got = ad.reduce_scatter(x, op)
    whole = _reference([_input(seed, r, rows * 3, dtype, op).reshape(rows, 3)
                        for r in range(n)], op)
    want = np.array_split(whole, n)[world.rank]
    if got.dtype.kind == "f":
        tol = (1e-5 if dtype == "float32" else 1e-12) * n
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(OPS), rows=st.one_of(st.integers(0, 9),
                                              st.sampled_from([341, 342, 682, 683,
                                                               2 * 1365, 2 * 1366 + 1])))
def test_small_reduce_scatters_match_numpy(n, seed, dtype, op, rows):
    # rows of 3 values about the two-rank ride's limit (EXCHANGE_RIDE_MAX_BYTES sent, half
    # the input: 341 and 342 rows of float64, 682 and 683 of float32) and RIDE_MAX_BYTES
    if op == "average" and dtype.startswith("int"):
        op = "sum"
    run_world(_body_scatter, n, seed, rows, dtype, op)


def _body_broadcast(world: ad.World, seed: int, shape: tuple[int, ...], dtype: str,
                    src: int) -> None:
    src %= world.world_size
    x = _moved(seed, world.rank, shape, dtype)
    ad.broadcast(x, src=src)
    want = _moved(seed, src, shape, dtype)
    np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8))


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1),
       shape=st.sampled_from([(0,), (1,), (7,), (3, 5), (8192,), (8193,), (2, 4096)]),
       dtype=st.sampled_from(MOVE_DTYPES), src=st.integers(0, 3))
def test_small_broadcasts_match_the_source(n, seed, shape, dtype, src):
    run_world(_body_broadcast, n, seed, shape, dtype, src)
