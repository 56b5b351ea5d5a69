"""Every collective and ReduceOp against a NumPy reference, on random worlds.

Each rank derives every rank's input from (seed, rank), so it can compute the
expected result locally and check its own output; the same bodies run on the
mock world and, under ``mpiexec``, on MPI.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_MPI, launched_world, run_world, world_sizes
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp
from axondist._array import bfloat16

DTYPES = ["float16", "float32", "float64", "int32", "int64", "bool", "bfloat16"]
FLOAT_TOL = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}


def _dtype(name: str) -> np.dtype:
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def make_input(seed: int, rank: int, shape: tuple[int, ...], dtype: str,
               op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank ``rank``'s input: small values, so integer sums never overflow."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if op is ReduceOp.PRODUCT:
        values = rng.choice([-1.0, 1.0, 2.0, 0.5], size=shape)
        if dtype.startswith("int"):
            values = rng.choice([-1, 1, 2], size=shape)
    elif dtype.startswith("int"):
        values = rng.integers(-50, 50, size=shape)
    else:
        values = rng.standard_normal(shape)
    return np.asarray(values).astype(_dtype(dtype))


def reference_reduce(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The expected reduction, computed in float64 (or exactly, for ints and bools)."""
    stack = np.stack([np.asarray(x) for x in inputs])
    dtype = inputs[0].dtype
    if dtype == np.bool_:
        fn = {ReduceOp.SUM: np.any, ReduceOp.MAX: np.any,
              ReduceOp.PRODUCT: np.all, ReduceOp.MIN: np.all}[op]
        return fn(stack, axis=0)
    wide = stack.astype(np.float64) if dtype.kind == "f" or dtype == bfloat16 else stack
    out = {
        ReduceOp.SUM: lambda: wide.sum(axis=0),
        ReduceOp.AVERAGE: lambda: wide.mean(axis=0),
        ReduceOp.PRODUCT: lambda: wide.prod(axis=0),
        ReduceOp.MIN: lambda: wide.min(axis=0),
        ReduceOp.MAX: lambda: wide.max(axis=0),
    }[op]()
    return np.asarray(out)


def assert_matches(got: np.ndarray, want: np.ndarray, dtype: str, n_terms: int = 1) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    if dtype in FLOAT_TOL:
        tol = FLOAT_TOL[dtype] * max(1, n_terms)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)


def pick_members(seed: int, n: int, use_subgroup: bool) -> list[int]:
    """A seeded non-empty subset of 0..n-1 (every rank draws the same one)."""
    if not use_subgroup:
        return list(range(n))
    rng = np.random.default_rng([seed, 999])
    k = int(rng.integers(1, n + 1))
    return sorted(int(r) for r in rng.choice(n, size=k, replace=False))


def on_group(world: ad.World, members: list[int]) -> ad.ProcessGroup | None:
    """The sub-group of ``members`` (None on ranks outside it); every rank calls this."""
    if members == list(range(world.world_size)):
        return world
    group = world.new_group(members)
    return group if group.is_member else None


# --- all_reduce ---------------------------------------------------------------------

def _body_all_reduce(world, seed, shape, dtype, op, use_subgroup):
    members = pick_members(seed, world.world_size, use_subgroup)
    group = on_group(world, members)
    if group is None:
        return None
    x = make_input(seed, world.rank, shape, dtype, op)
    out = ad.all_reduce(x, op, group)
    assert out is x, "all_reduce must work in place and return its input"
    want = reference_reduce([make_input(seed, r, shape, dtype, op) for r in members], op)
    assert_matches(x, want, dtype, len(members))
    return x


def _valid(op: ReduceOp, dtype: str) -> bool:
    return not (op is ReduceOp.AVERAGE and dtype in ("int32", "int64", "bool"))


@given(n=world_sizes(), seed=seeds, shape=shapes, dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(list(ReduceOp)), use_subgroup=st.booleans())
def test_all_reduce_matches_numpy(n, seed, shape, dtype, op, use_subgroup):
    if not _valid(op, dtype):
        op = ReduceOp.SUM
    run_world(_body_all_reduce, n, seed, shape, dtype, op, use_subgroup)


def _body_named_reductions(world, seed):
    x = make_input(seed, world.rank, (3, 2), "float64")
    inputs = [make_input(seed, r, (3, 2), "float64") for r in range(world.world_size)]
    for fn, op in [(ad.all_reduce_sum, ReduceOp.SUM), (ad.all_reduce_mean, ReduceOp.AVERAGE),
                   (ad.all_reduce_min, ReduceOp.MIN), (ad.all_reduce_max, ReduceOp.MAX),
                   (ad.all_reduce_product, ReduceOp.PRODUCT)]:
        y = fn(x.copy())
        np.testing.assert_allclose(y, reference_reduce(inputs, op), rtol=1e-12)
    # names are accepted too, and a default group
    y = ad.all_reduce(x.copy(), "mean")
    np.testing.assert_allclose(y, reference_reduce(inputs, ReduceOp.AVERAGE), rtol=1e-12)


@given(n=world_sizes(), seed=seeds)
def test_named_reductions_use_the_default_group(n, seed):
    run_world(_body_named_reductions, n, seed)


def _body_deterministic(world, seed):
    x = make_input(seed, world.rank, (70_000,), "float32")
    a = ad.all_reduce(x.copy())
    b = ad.all_reduce(x.copy())
    np.testing.assert_array_equal(a, b)
    want = make_input(seed, 0, (70_000,), "float32")
    for r in range(1, world.world_size):
        want = want + make_input(seed, r, (70_000,), "float32")
    if world.backend.name == "mock":
        # rank-order summation: bit-identical to a sequential float32 sum over ranks
        np.testing.assert_array_equal(a, want)
    else:
        np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-5)


@given(n=world_sizes(2, 6), seed=seeds)
def test_float_sums_are_reproducible(n, seed):
    run_world(_body_deterministic, n, seed)


# --- broadcast ----------------------------------------------------------------------

def _body_broadcast(world, seed, shape, dtype, src_pick, use_subgroup):
    members = pick_members(seed, world.world_size, use_subgroup)
    group = on_group(world, members)
    if group is None:
        return
    src = src_pick % len(members)
    x = make_input(seed, world.rank, shape, dtype)
    out = ad.broadcast(x, group, src=src)
    assert out is x
    assert_matches(x, make_input(seed, members[src], shape, dtype), dtype)
    y = ad.broadcast_from(make_input(seed, world.rank, shape, dtype), group, src)
    assert_matches(y, make_input(seed, members[src], shape, dtype), dtype)


@given(n=world_sizes(), seed=seeds, shape=shapes, dtype=st.sampled_from(DTYPES),
       src_pick=st.integers(0, 7), use_subgroup=st.booleans())
def test_broadcast_copies_the_source(n, seed, shape, dtype, src_pick, use_subgroup):
    run_world(_body_broadcast, n, seed, shape, dtype, src_pick, use_subgroup)


# --- all_gather / gather / scatter / reduce_scatter -------------------------------

def _rows(seed: int, rank: int, max_rows: int) -> int:
    return int(np.random.default_rng([seed, rank, 7]).integers(0, max_rows + 1))


def _body_all_gather(world, seed, trailing, dtype, use_subgroup, zero_d):
    members = pick_members(seed, world.world_size, use_subgroup)
    group = on_group(world, members)
    if group is None:
        return
    def local(r):
        shape = () if zero_d else (_rows(seed, r, 4),) + trailing
        return make_input(seed, r, shape, dtype)

    got = ad.all_gather(local(world.rank), group)
    want = np.stack([local(r) for r in members]) if zero_d else np.concatenate(
        [local(r) for r in members])
    assert_matches(got, want, dtype)
    sizes = [1 if zero_d else _rows(seed, r, 4) for r in members]
    got2 = ad.all_gather(local(world.rank), group, sizes=sizes)
    assert_matches(got2, want, dtype)


@given(n=world_sizes(), seed=seeds, trailing=st.lists(st.integers(0, 3), max_size=2).map(tuple),
       dtype=st.sampled_from(DTYPES), use_subgroup=st.booleans(), zero_d=st.booleans())
def test_all_gather_concatenates_uneven_rows(n, seed, trailing, dtype, use_subgroup, zero_d):
    run_world(_body_all_gather, n, seed, trailing, dtype, use_subgroup, zero_d)


def _body_gather(world, seed, dtype, dst_pick):
    n = world.world_size
    dst = dst_pick % n

    def local(r):
        return make_input(seed, r, (_rows(seed, r, 3), 2), dtype)

    got = ad.gather_tensor(local(world.rank), world, dst)
    if world.rank == dst:
        assert_matches(got, np.concatenate([local(r) for r in range(n)]), dtype)
    else:
        assert got is None


@given(n=world_sizes(), seed=seeds, dtype=st.sampled_from(DTYPES), dst_pick=st.integers(0, 7))
def test_gather_tensor_lands_on_dst_only(n, seed, dtype, dst_pick):
    run_world(_body_gather, n, seed, dtype, dst_pick)


def _body_scatter(world, seed, rows, dtype, src_pick, use_subgroup):
    members = pick_members(seed, world.world_size, use_subgroup)
    group = on_group(world, members)
    if group is None:
        return
    src = src_pick % len(members)
    full = make_input(seed, 1000, (rows, 3), dtype)
    got = ad.scatter_tensor(full if group.rank == src else None, group, src)
    assert_matches(got, np.array_split(full, len(members))[group.rank], dtype)


@given(n=world_sizes(), seed=seeds, rows=st.integers(0, 11), dtype=st.sampled_from(DTYPES),
       src_pick=st.integers(0, 7), use_subgroup=st.booleans())
def test_scatter_tensor_splits_like_array_split(n, seed, rows, dtype, src_pick, use_subgroup):
    run_world(_body_scatter, n, seed, rows, dtype, src_pick, use_subgroup)


def _body_reduce_scatter(world, seed, rows, dtype, mean, use_subgroup):
    members = pick_members(seed, world.world_size, use_subgroup)
    group = on_group(world, members)
    if group is None:
        return
    shape = (rows, 2)
    x = make_input(seed, world.rank, shape, dtype)
    got = (ad.reduce_scatter_mean if mean else ad.reduce_scatter_sum)(x, group)
    op = ReduceOp.AVERAGE if mean else ReduceOp.SUM
    full = reference_reduce([make_input(seed, r, shape, dtype) for r in members], op)
    assert_matches(got, np.array_split(full, len(members))[group.rank], dtype, len(members))


@given(n=world_sizes(), seed=seeds, rows=st.integers(0, 13),
       dtype=st.sampled_from(["float32", "float64", "int64", "bfloat16"]), mean=st.booleans(),
       use_subgroup=st.booleans())
def test_reduce_scatter_matches_numpy(n, seed, rows, dtype, mean, use_subgroup):
    if mean and dtype == "int64":
        mean = False
    run_world(_body_reduce_scatter, n, seed, rows, dtype, mean, use_subgroup)


# --- point to point, barrier, async -------------------------------------------------

def _body_ring(world, seed, shape, dtype):
    n, r = world.world_size, world.rank
    if n == 1:
        return
    # Even ranks send first, odd ranks receive first: no rank waits on itself.
    right, left = (r + 1) % n, (r - 1) % n
    mine = make_input(seed, r, shape, dtype)
    if r % 2 == 0:
        ad.send(mine, right, tag=3)
        got = ad.recv(left, tag=3)
    else:
        got = ad.recv(left, tag=3)
        ad.send(mine, right, tag=3)
    assert_matches(got, make_input(seed, left, shape, dtype), dtype)
    # receive into a preallocated array
    out = np.empty(shape, dtype=_dtype(dtype))
    if r == 0:
        ad.send(mine, n - 1)
    if r == n - 1:
        ad.recv(0, out=out)
        assert_matches(out, make_input(seed, 0, shape, dtype), dtype)


@given(n=world_sizes(), seed=seeds, shape=shapes, dtype=st.sampled_from(DTYPES))
def test_send_recv_carries_shape_and_dtype(n, seed, shape, dtype):
    run_world(_body_ring, n, seed, shape, dtype)


def _body_async(world, seed):
    n = world.world_size
    xs = [make_input(seed, world.rank, (100 + i,), "float64") for i in range(3)]
    works = [ad.all_reduce(x, ReduceOp.SUM, async_op=True) for x in xs]
    gathered = ad.all_gather(np.array([world.rank]), async_op=True)
    for i, (w, x) in enumerate(zip(works, xs)):
        assert w.wait() is x
        assert w.is_completed()
        want = reference_reduce([make_input(seed, r, (100 + i,), "float64") for r in range(n)],
                                ReduceOp.SUM)
        np.testing.assert_allclose(x, want, rtol=1e-12)
    np.testing.assert_array_equal(gathered.wait(), np.arange(n))
    rs = ad.reduce_scatter_sum(np.ones((n * 2,)), async_op=True).wait()
    np.testing.assert_array_equal(rs, np.full(2, float(n)))
    ad.barrier()


@given(n=world_sizes(), seed=seeds)
def test_async_handles_complete_with_results(n, seed):
    run_world(_body_async, n, seed)


def _body_queries(world):
    assert ad.rank() == world.rank and ad.world_size() == world.world_size
    assert ad.is_main_process() == (world.rank == 0)
    grads = [make_input(5, world.rank, (3,), "float64"), make_input(6, world.rank, (2, 2),
                                                                    "float32")]
    ad.sync_gradients(grads)
    for seed, g, shape, dt in [(5, grads[0], (3,), "float64"), (6, grads[1], (2, 2), "float32")]:
        want = np.mean([make_input(seed, r, shape, dt) for r in range(world.world_size)], axis=0)
        np.testing.assert_allclose(g, want, rtol=1e-5)
    g = make_input(7, world.rank, (4,), "float64")
    ad.sync_gradient(g)
    np.testing.assert_allclose(
        g, np.mean([make_input(7, r, (4,), "float64") for r in range(world.world_size)], axis=0))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_queries_and_gradient_sync(n):
    run_world(_body_queries, n)


# --- bad input that every backend must refuse locally ------------------------------

def _body_bad_local_input(world):
    n = world.world_size
    with pytest.raises(ad.InvalidBufferError, match="read-only"):
        x = np.ones(3)
        x.flags.writeable = False
        ad.all_reduce(x)
    with pytest.raises(ad.InvalidBufferError, match="not C-contiguous"):
        ad.broadcast(np.ones((4, 4))[:, ::2])
    with pytest.raises(ad.UnsupportedDTypeError, match="MIN is not defined for complex"):
        ad.all_reduce(np.ones(2, dtype=complex), ReduceOp.MIN)
    with pytest.raises(ad.UnsupportedDTypeError, match="AVERAGE is not defined for int64"):
        ad.all_reduce_mean(np.ones(2, dtype=np.int64))
    with pytest.raises(ad.UnsupportedDTypeError, match="not supported"):
        ad.all_reduce(np.array(["a"]))
    with pytest.raises(ad.RankError, match=f"src={n}"):
        ad.broadcast(np.ones(2), src=n)
    with pytest.raises(ad.RankError, match="dst=-1"):
        ad.gather_tensor(np.ones(2), dst=-1)
    with pytest.raises(ValueError, match="unknown reduce op"):
        ad.all_reduce(np.ones(2), "median")
    with pytest.raises(ad.InvalidBufferError, match="0-d"):
        ad.reduce_scatter_sum(np.ones(()))
    with pytest.raises(ad.RankError, match="itself"):
        ad.send(np.ones(1), world.rank)
    if n >= 2:
        group = world.new_group([0])
        if world.rank != 0:
            assert not group.is_member and group.rank == -1
            with pytest.raises(ad.NotAMemberError,
                               match=r"not a member of the group of ranks \[0\]"):
                ad.all_reduce(np.ones(1), group=group)
    with pytest.raises(ad.RankError, match="outside the group"):
        world.new_group([n])
    ad.barrier()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_bad_local_input_gets_clear_errors(n):
    run_world(_body_bad_local_input, n)


# --- numbers at the edges: half-precision means, NaN in MIN/MAX ---------------------------

HALF_LIMITS = {"float16": 65504.0, "bfloat16": 3.3895e38}


@given(n=world_sizes(2, 8), seed=seeds, dtype=st.sampled_from(sorted(HALF_LIMITS)),
       scatter=st.booleans(), tiny=st.booleans())
def test_half_precision_average_never_overflows_or_underflows(n, seed, dtype, scatter, tiny):
    """Values near the dtype's largest (or smallest) magnitude: their sum leaves the dtype's
    range, their mean does not, and the mean is what every rank gets (rounded once)."""
    def body(world):
        k = world.world_size
        limit = HALF_LIMITS[dtype]

        def values(rank: int) -> np.ndarray:
            rng = np.random.default_rng([seed, rank])
            scale = 2.0 ** -20 if tiny else limit * 0.9
            sign = 1.0 if tiny else rng.choice([-1.0, 1.0])
            return (rng.uniform(0.5, 1.0, size=(2 * k, 3)) * scale * sign).astype(_dtype(dtype))

        inputs = [values(r) for r in range(k)]
        want = np.mean(np.stack(inputs).astype(np.float64), axis=0)
        if scatter:
            got = ad.reduce_scatter(inputs[world.rank], "average")
            want = np.array_split(want, k)[world.rank]
        else:
            got = ad.all_reduce(inputs[world.rank].copy(), "average")
        assert got.dtype == _dtype(dtype)
        assert np.isfinite(got.astype(np.float64)).all()
        np.testing.assert_array_equal(got, want.astype(_dtype(dtype)))

    run_world(body, n)


@given(n=world_sizes(1, 6), seed=seeds, dtype=st.sampled_from(
    ["float16", "float32", "float64", "bfloat16"]), op=st.sampled_from(["min", "max"]),
    nan_rank=st.integers(0, 7), nan_at=st.integers(0, 4))
def test_min_max_propagate_nan_whichever_rank_holds_it(n, seed, dtype, op, nan_rank, nan_at):
    def body(world):
        k = world.world_size
        inputs = [make_input(seed, r, (5,), dtype) for r in range(k)]
        inputs[nan_rank % k][nan_at] = np.nan
        ufunc = np.minimum if op == "min" else np.maximum
        want = inputs[0].astype(np.float64)
        with np.errstate(invalid="ignore"):
            for x in inputs[1:]:
                want = ufunc(want, x.astype(np.float64))
        got = ad.all_reduce(inputs[world.rank].copy(), op)
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), np.isnan(want))
        np.testing.assert_array_equal(got.astype(np.float64), want)

    run_world(body, n)


# --- reduce, all_to_all, objects, monitored_barrier, groups ----------------------------------

@given(n=world_sizes(1, 6), seed=seeds, dtype=st.sampled_from(["float32", "float64", "int64"]),
       op=st.sampled_from([ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]), dst=st.integers(0, 7))
def test_reduce_matches_numpy_on_the_destination_only(n, seed, dtype, op, dst):
    def body(world):
        k = world.world_size
        root = dst % k
        inputs = [make_input(seed, r, (3, 2), dtype, op) for r in range(k)]
        mine = inputs[world.rank].copy()
        got = ad.reduce(mine, root, op)
        assert got is mine
        if world.rank == root:
            assert_matches(got, reference_reduce(inputs, op).astype(got.dtype), dtype, k)
        else:
            np.testing.assert_array_equal(got, inputs[world.rank])

    run_world(body, n)


@given(n=world_sizes(1, 6), seed=seeds,
       dtype=st.sampled_from(["float32", "int32", "bool", "bfloat16", "complex128"]),
       trailing=st.lists(st.integers(1, 3), max_size=2).map(tuple), even=st.booleans())
def test_all_to_all_matches_numpy_with_uneven_splits(n, seed, dtype, trailing, even):
    def body(world):
        k = world.world_size

        def sizes_of(rank: int) -> list[int]:
            rng = np.random.default_rng([seed, rank, 7])
            return [2] * k if even else [int(v) for v in rng.integers(0, 4, size=k)]

        def data_of(rank: int) -> np.ndarray:
            return make_input(seed, rank, (sum(sizes_of(rank)),) + trailing, dtype)

        got = ad.all_to_all(data_of(world.rank), send_sizes=sizes_of(world.rank))
        blocks = []
        for src in range(k):
            bounds = np.cumsum([0] + sizes_of(src))
            blocks.append(data_of(src)[bounds[world.rank]:bounds[world.rank + 1]])
        np.testing.assert_array_equal(got, np.concatenate(blocks))

    run_world(body, n)


@pytest.mark.skipif(not UNDER_MPI, reason="the MPI backend's point-to-point all-to-all "
                                          "(run under mpiexec)")
def test_an_all_to_all_whose_counts_disagree_names_the_sender_and_the_next_call_works():
    """The backend's call takes each rank's counts as given (``ad.all_to_all`` exchanges
    them first). Rank 0 expects three elements from rank 1, which sends two: rank 0 raises,
    naming rank 1 and both counts; no message is left behind, so the next call is right."""
    world = launched_world()
    n, me, backend = world.world_size, world.rank, world.backend
    sent, came = [2] * n, [2] * n
    if me == 0:
        came[1] = 3
    x = np.arange(2 * n, dtype=np.float32) + 100 * me
    out = np.zeros(sum(came), np.float32)
    if me == 0:
        with pytest.raises(ad.CollectiveMismatchError, match=r"all_to_all: rank 1 sent this "
                                                             r"rank 2 elements where this "
                                                             r"rank's counts expect 3"):
            backend.all_to_all(x, out, sent, came).wait()
    else:
        backend.all_to_all(x, out, sent, came).wait()
        np.testing.assert_array_equal(out, np.concatenate(
            [np.arange(2 * me, 2 * me + 2, dtype=np.float32) + 100 * r for r in range(n)]))
    got = ad.all_to_all(np.full((n, 3), me, np.int64))
    np.testing.assert_array_equal(got, np.repeat(np.arange(n), 3).reshape(n, 3))


@given(n=world_sizes(1, 5), src=st.integers(0, 7))
def test_object_collectives_match_their_definitions(n, src):
    def body(world):
        k, r = world.world_size, world.rank
        root = src % k
        assert ad.all_gather_object({"rank": r}) == [{"rank": q} for q in range(k)]
        assert ad.broadcast_object(("from", r), src=root) == ("from", root)
        items = [r, "x"]
        assert ad.broadcast_object_list(items, src=root) == [root, "x"]
        gathered = ad.gather_object(r * 10, dst=root)
        assert gathered == ([q * 10 for q in range(k)] if r == root else None)
        scattered = ad.scatter_object_list([f"item{q}" for q in range(k)] if r == root else None,
                                           src=root)
        assert scattered == f"item{r}"
        with pytest.raises(ValueError, match="one object per rank"):
            ad.scatter_object_list(["only one"] * (k + 1) if r == root else None, src=root)

    run_world(body, n)


@given(n=world_sizes(1, 4))
def test_monitored_barrier_passes_when_all_arrive_and_groups_are_freed(n):
    def body(world):
        ad.monitored_barrier(timeout=30)
        with world.new_group(list(range(world.world_size))) as group:
            x = np.ones(2)
            ad.all_reduce(x, group=group)
            assert x[0] == world.world_size
        assert not group.is_member
        with pytest.raises(ad.NotAMemberError):
            ad.all_reduce(np.ones(1), group=group)
        records = ad.flight_recorder()
        assert records and records[-1]["state"] == "done"
        assert {"group", "seq", "op", "detail", "started_s_ago"} <= set(records[-1])

    run_world(body, n)


@given(n=world_sizes(2, 4))
def test_ranks_may_be_numpy_integers_and_torch_habits_get_hints(n):
    def body(world):
        x = np.arange(3.0) + world.rank
        ad.broadcast(x, src=np.int64(1))
        np.testing.assert_array_equal(x, np.arange(3.0) + 1)
        with pytest.raises(TypeError, match=r"broadcast\(x, src=1\)"):
            ad.broadcast(x, 1)
        assert ad.ReduceOp.AVG is ad.ReduceOp.AVERAGE
        with pytest.raises(ad.RankError, match="ranks must be a list of ranks"):
            world.new_group(None)
        with pytest.raises(ad.RankError, match=r"ranks\[\]=0.7 is not a rank"):
            world.new_group([0.7, 1.2])

    run_world(body, n)


@given(n=world_sizes(2, 4), src=st.integers(0, 7), bad=st.sampled_from(["none", "0-d", "dtype"]))
def test_scatter_tensor_refuses_bad_input_on_every_rank(n, src, bad):
    """The source checks its input before the exchange and shares the verdict: every rank
    raises the same error instead of waiting for data that never comes."""
    def body(world):
        root = src % world.world_size
        x = {"none": None, "0-d": np.array(1.0),
             "dtype": np.array(["a", "b"])}[bad] if world.rank == root else None
        error = ad.UnsupportedDTypeError if bad == "dtype" else ad.InvalidBufferError
        with pytest.raises(error, match=rf"raised on the source, rank {root}"):
            ad.scatter_tensor(x, src=root)
        ad.barrier()  # the world is still usable

    run_world(body, n)
