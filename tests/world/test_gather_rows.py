"""all_gather without ``sizes=``: every rank's row count may differ (and be drawn on each
side of ``RIDE_MAX_BYTES``, where the MPI backend's rows stop riding with the check),
dtype and trailing shape agree; the result equals NumPy's concatenation on every rank,
with and without ``out``. Under ``mpiexec -n 2`` the counts travel with the check, so
each call is one recorded exchange, and blocks on either side of the pair exchange's limit
meet. Runs on the mock world too.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_MPI, run_world, world_sizes
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist._array import dtype_named
from axondist.backends.base import PLAN_CACHE_LIMIT as _RIDERS_LIMIT
from axondist.backends.mpi.choose import RIDE_MAX_BYTES

DTYPES = ["float32", "float64", "int32", "int64", "bool", "float16", "bfloat16", "uint8"]
TRAILING = [(), (3,), (2, 2), (0,)]


def _rows(dtype: str, trailing: tuple[int, ...], where: str, offset: int) -> int:
    """A row count: small, or just under/at/over the riding limit for this row size."""
    if where == "small":
        return offset + 1  # 0..2
    row_bytes = max(1, int(np.prod(trailing, dtype=int))) * np.dtype(dtype_named(dtype)).itemsize
    return max(0, RIDE_MAX_BYTES // row_bytes + offset)


def _local(seed: int, rank: int, rows: int, trailing: tuple[int, ...], dtype: str) -> np.ndarray:
    values = np.random.default_rng([seed, rank]).integers(-40, 40, size=(rows,) + trailing)
    return values.astype(dtype_named(dtype))


def _body(world: ad.World, seed: int, plan: list[tuple[str, int]], trailing: tuple[int, ...],
          dtype: str, give_out: bool, async_op: bool) -> None:
    n = world.world_size
    counts = [_rows(dtype, trailing, *plan[r % len(plan)]) for r in range(n)]
    x = _local(seed, world.rank, counts[world.rank], trailing, dtype)
    want = np.concatenate([_local(seed, r, counts[r], trailing, dtype) for r in range(n)])
    out = np.full_like(want, 7) if give_out else None
    got = ad.all_gather(x, out=out, async_op=async_op)
    if async_op:
        got = got.wait()
    if give_out:
        assert got is out
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1),
       plan=st.lists(st.tuples(st.sampled_from(["small", "limit"]), st.integers(-1, 1)),
                     min_size=1, max_size=4),
       trailing=st.sampled_from(TRAILING), dtype=st.sampled_from(DTYPES),
       give_out=st.booleans(), async_op=st.booleans())
def test_unsized_all_gathers_match_numpy(n, seed, plan, trailing, dtype, give_out, async_op):
    run_world(_body, n, seed, plan, trailing, dtype, give_out, async_op)


def _body_repeated(world: ad.World, seed: int, counts_per_call: list[list[int]]) -> None:
    # the same call site with counts that change from call to call (the MPI backend keeps
    # one carrier per row count) and a multi-dimensional out reused
    for k, rows in enumerate(counts_per_call):
        counts = [rows[r % len(rows)] for r in range(world.world_size)]
        x = _local(seed + k, world.rank, counts[world.rank], (3,), "float64")
        got = ad.all_gather(x)
        want = np.concatenate([_local(seed + k, r, counts[r], (3,), "float64")
                               for r in range(world.world_size)])
        np.testing.assert_array_equal(got, want)


@given(n=world_sizes(1, 4), seed=st.integers(0, 2**31 - 1),
       counts_per_call=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=3),
                                min_size=2, max_size=6))
def test_row_counts_that_change_between_calls(n, seed, counts_per_call):
    run_world(_body_repeated, n, seed, counts_per_call)


def _world_calls(after: int) -> list[dict]:
    """This rank's recorded calls on the world group numbered after ``after``."""
    return [e for e in ad.flight_recorder() if e["group"] == "world" and e["seq"] > after]


def _body_one_exchange(world: ad.World) -> None:
    x = np.arange(3 * (world.rank + 1), dtype=np.float32).reshape(-1, 3)
    before = max([0] + [e["seq"] for e in _world_calls(0)])
    ad.all_gather(x)
    calls = [(e["op"], e["detail"]) for e in _world_calls(before)]
    if world.backend.name == "mpi":
        # one call: the counts are exchanged inside it, after its check
        assert calls == [("all_gather", "dtype=float32, trailing shape=[3], counts=not given")]
    else:
        assert calls and calls[-1][0] == "all_gather"


def test_an_unsized_all_gather_is_recorded_as_one_call():
    run_world(_body_one_exchange, 2)


def _body_bad_out_then_good(world: ad.World) -> None:
    n = world.world_size
    x = np.full((world.rank + 1, 2), float(world.rank))
    total = n * (n + 1) // 2
    with pytest.raises(ad.InvalidBufferError, match=r"all_gather: out is .* but the result is "
                                                    rf"float64\[{total}, 2\]"):
        ad.all_gather(x, out=np.empty((total + 1, 2)))
    got = ad.all_gather(x)  # the ranks are still in step
    want = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(n)])
    np.testing.assert_array_equal(got, want)


@given(n=world_sizes(1, 4))
def test_a_wrong_out_on_every_rank_raises_and_the_next_call_works(n):
    run_world(_body_bad_out_then_good, n)


def test_a_read_only_out_is_refused_before_any_exchange():
    def body(world: ad.World) -> None:
        out = np.empty(world.world_size)
        out.flags.writeable = False
        with pytest.raises(ad.InvalidBufferError, match="all_gather"):
            ad.all_gather(np.ones(1), out=out)
        ad.barrier()

    run_world(body, 2)


def _body_many_plans(world: ad.World, count: int) -> None:
    # more distinct calls than the MPI backend keeps plans for: row counts, and big
    # broadcasts and all-gathers (sent point to point after their check in a group of
    # two); past the limit the plans and their persistent requests are dropped
    n, rank = world.world_size, world.rank
    big = RIDE_MAX_BYTES // 8 + 1
    for k in range(count):
        got = ad.all_gather(np.full(k % 7 + rank + k, float(k)))
        assert got.shape == (sum(k % 7 + r + k for r in range(n)),) and (got == k).all()
        if k % 16 == 0:
            x = np.full(big + k, float(rank))
            ad.broadcast(x, src=k % n)
            np.testing.assert_array_equal(x, float(k % n))
            got = ad.all_gather(np.full(big + rank, float(rank)),
                                sizes=[big + r for r in range(n)])
            np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=float),
                                                         [big + r for r in range(n)]))


def test_more_plans_than_the_guard_keeps():
    run_world(_body_many_plans, 2, _RIDERS_LIMIT + 40)


def _body_strided_out(world: ad.World, give_sizes: bool) -> None:
    n = world.world_size
    x = np.full((2, 3), float(world.rank))
    out = np.zeros((2 * n, 6))[:, ::2]  # writable, of the result's shape, not contiguous
    with pytest.raises(ad.InvalidBufferError, match="all_gather: .* not C-contiguous"):
        ad.all_gather(x, sizes=[2] * n if give_sizes else None, out=out)
    ad.barrier()


@pytest.mark.parametrize("give_sizes", [True, False])
def test_a_strided_out_is_refused_before_any_exchange(give_sizes):
    run_world(_body_strided_out, 2, give_sizes)


def _body_blocks_on_both_sides_of_the_pair_limit(world: ad.World) -> None:
    from axondist.backends.mpi.choose import EXCHANGE_RIDE_MAX_BYTES, PAIR_GATHER_MAX_BYTES

    n, me = world.world_size, world.rank
    small, big = PAIR_GATHER_MAX_BYTES // 8, PAIR_GATHER_MAX_BYTES // 8 * 3  # float64 rows
    tiny = EXCHANGE_RIDE_MAX_BYTES // 8  # rides in the check's message with sizes
    for sizes in ([small] + [big] * (n - 1), [big] * (n - 1) + [small], [0] + [big] * (n - 1),
                  [big] * n, [big + 1] + [big] * (n - 1), [0] * n, [small] * n,
                  [tiny] + [small] * (n - 1), [big] * (n - 1) + [tiny], [tiny + 1] * n,
                  [tiny] + [tiny - 1] * (n - 1), [0] + [tiny] * (n - 1)):
        x = np.full(sizes[me], me + 0.5)
        want = np.repeat(np.arange(n) + 0.5, sizes)
        np.testing.assert_array_equal(ad.all_gather(x, sizes=sizes), want)
        np.testing.assert_array_equal(ad.all_gather(x), want)  # each rank knows its own


def test_blocks_on_both_sides_of_the_pair_exchange_limit_meet():
    """A rank's own block of 1 MiB where another's is 3 MiB: the MPI backend's two-rank
    exchange ends at 2 MiB, and every rank must make the same choice (the largest block
    decides) or they wait in different calls; without sizes each rank's block leaves
    ahead of the check or after it by its own size, and both move it the same way once
    the check told them both sizes."""
    run_world(_body_blocks_on_both_sides_of_the_pair_limit, 2)


def _body_wrong_out_on_one_rank(world: ad.World) -> None:
    from axondist.backends.mpi.choose import PAIR_GATHER_MAX_BYTES

    big = PAIR_GATHER_MAX_BYTES // 8 + 5
    for rows in ((3, 4), (big, 2), (2, big), (big, big + 1), (3000, 2)):
        x = np.full((rows[world.rank], 2), float(world.rank))
        want = np.concatenate([np.full((r, 2), float(k)) for k, r in enumerate(rows)])
        if world.rank == 0:  # a wrong out here, none on rank 1
            with pytest.raises(ad.InvalidBufferError, match=r"all_gather: out is float64\["):
                ad.all_gather(x, out=np.empty((sum(rows) + 1, 2)))
        else:
            np.testing.assert_array_equal(ad.all_gather(x), want)
        np.testing.assert_array_equal(ad.all_gather(x), want)  # nothing left behind


@pytest.mark.skipif(not UNDER_MPI, reason="the two-rank MPI exchange runs under mpiexec")
def test_a_wrong_out_on_one_rank_of_a_pair_is_named_there_and_the_other_gets_its_result():
    """Under MPI two ranks learn each other's rows inside the check, so a rank's ``out`` of
    the wrong shape is known only after the blocks started to move: they still move (the
    refused rank's into a temporary), that rank raises, the other has its result, and the
    next call works. (On three ranks, and on the other backends, a rank that refuses its
    ``out`` leaves the others in the call: the watchdog names it.)"""
    world = ad.init()
    if world.world_size != 2:
        pytest.skip("the two-rank MPI exchange")
    _body_wrong_out_on_one_rank(world)
