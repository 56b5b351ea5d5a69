"""On the MPI backend, float sums and means have the bits of MPI's own ``Allreduce``.

``ad.all_reduce`` with SUM gives exactly what mpi4py's ``Allreduce`` (SUM) gives on the
same inputs, and AVERAGE exactly that sum divided by the group size (``x / n``, which
equals ``x * (1/n)`` when n is a power of two), whatever algorithm the backend's table
chose (riding with the check, MPI's own, pieces): float32 and float64, sizes drawn
log-uniformly from one element to 4 MiB, always with the riding limit and its neighbours.
The inputs mix magnitudes, so a different order of summation changes bits (a test below
shows that such inputs tell orders apart). Up to 3 ranks, FSDP NO_SHARD and FULL_SHARD
train to the same bits. Runs only under ``mpiexec`` (``tests/world/test_mpi_launch.py``
launches it at 2, 3, 4 and 5 ranks); each verdict is reached by every rank together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world
from hypothesis import example, given
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.mpi.choose import PIECES_FROM_BYTES, RIDE_MAX_BYTES
from axondist.fsdp import FSDP, ShardingStrategy
from axondist.optim import SGD

mpi_only = pytest.mark.skipif(not UNDER_MPI, reason="compares with MPI's own Allreduce: run "
                                                    "under mpiexec (tests/world/test_mpi_launch.py "
                                                    "does)")
LARGEST = 4 << 20
#: Named sizes every run includes, in elements of the dtype.
EDGES = {"one": lambda item: 1, "ride-1": lambda item: RIDE_MAX_BYTES // item - 1,
         "ride": lambda item: RIDE_MAX_BYTES // item,
         "ride+1": lambda item: RIDE_MAX_BYTES // item + 1, "4MiB": lambda item: LARGEST // item}
#: A size: an edge's name, or a fraction f of the way from 1 element to 4 MiB on a log scale.
sizes = st.one_of(st.sampled_from(sorted(EDGES)), st.floats(0.0, 1.0))
seeds = st.integers(0, 2**31 - 1)


def elements(size: str | float, dtype: np.dtype) -> int:
    """Elements of ``dtype`` for a drawn ``size``."""
    if isinstance(size, str):
        return EDGES[size](dtype.itemsize)
    return max(1, round((LARGEST // dtype.itemsize) ** size))


def values(seed: int, rank: int, numel: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s input: normal values scaled over six decades, so that sums taken
    in different orders round differently."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(numel) * np.exp(rng.uniform(-7, 7, numel))).astype(dtype)


@pytest.fixture(scope="module")
def raw() -> Iterator[Any]:
    """A duplicate of ``COMM_WORLD`` for the reference calls (collective)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


def _mpi_reference(raw: Any, x: np.ndarray, average: bool, async_op: bool) -> np.ndarray:
    """MPI's own sum of ``x`` (``Iallreduce`` for a non-blocking call), divided by n for a
    mean."""
    from mpi4py import MPI

    y = x.copy()
    if async_op:
        raw.Iallreduce(MPI.IN_PLACE, y, MPI.SUM).Wait()
    else:
        raw.Allreduce(MPI.IN_PLACE, y, MPI.SUM)
    if average:
        np.divide(y, y.dtype.type(raw.Get_size()), out=y)
    return y


def _agree_bitwise(raw: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Every rank's verdict gathered: all raise, naming the ranks and first differences."""
    same = np.array_equal(got.view(np.uint8), want.view(np.uint8))
    detail = ""
    if not same:
        a, b = got.reshape(-1), want.reshape(-1)
        bad = np.flatnonzero(a.view(f"i{a.itemsize}") != b.view(f"i{b.itemsize}"))
        k = int(bad[0])
        ulps = np.abs(a.view(f"i{a.itemsize}").astype(np.int64)
                      - b.view(f"i{b.itemsize}").astype(np.int64)).max()
        detail = (f"{bad.size} of {a.size} elements differ, up to {ulps} ulp; first at "
                  f"{k}: {a[k]!r} against {b[k]!r}")
    verdicts = raw.allgather((same, detail))
    failed = {r: d for r, (ok, d) in enumerate(verdicts) if not ok}
    assert not failed, f"{what}: the bits differ on ranks {sorted(failed)}: {failed}"


@mpi_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@example(size="one", seed=1)
@example(size="ride-1", seed=2)
@example(size="ride", seed=3)
@example(size="ride+1", seed=4)
@example(size="4MiB", seed=5)
@given(size=sizes, seed=seeds)
def test_sum_and_average_have_the_bits_of_mpis_allreduce(raw, dtype, size, seed):
    world = mpi_world()
    dt = np.dtype(dtype)
    numel = elements(size, dt)
    x = values(seed, world.rank, numel, dt)
    for op in ("sum", "average"):
        for async_op in (False, True):
            want = _mpi_reference(raw, x, op == "average", async_op)
            got = x.copy()
            result = ad.all_reduce(got, op, async_op=async_op)
            if async_op:
                result = result.wait()
            assert result is got
            _agree_bitwise(raw, got, want, f"all_reduce {op} of {numel} {dtype} against "
                           f"MPI's (async_op={async_op}, {world.world_size} ranks)")


@mpi_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sums_in_pieces_have_the_bits_of_mpis_allreduce(raw, dtype):
    """From PIECES_FROM_BYTES the backend reduces in pieces on one node: each piece is
    MPI's Allreduce of its slice, and the whole still has the whole Allreduce's bits."""
    world = mpi_world()
    dt = np.dtype(dtype)
    numel = PIECES_FROM_BYTES // dt.itemsize + 3
    x = values(11, world.rank, numel, dt)
    for op in ("sum", "average"):
        want = _mpi_reference(raw, x, op == "average", False)
        got = ad.all_reduce(x.copy(), op)
        _agree_bitwise(raw, got, want, f"all_reduce {op} of {numel} {dtype} against "
                       f"MPI's ({world.world_size} ranks)")


def test_these_inputs_tell_summation_orders_apart():
    """The comparison can fail: with these inputs, three ranks' values summed in two
    orders differ in bits (in both dtypes), as MPI's order and another would."""
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        x0, x1, x2 = (values(7, r, 4096, dtype) for r in range(3))
        assert not np.array_equal(((x0 + x1) + x2).view(np.uint8), ((x0 + x2) + x1).view(np.uint8))
        assert not np.array_equal(((x0 + x1) + x2) / 3, (x0 + x1 + x2) * (1 / 3))


# --- FSDP: NO_SHARD and FULL_SHARD agree bit for bit ---------------------------------------

SHAPES = [(37, 11), (5,), (1000,), (64, 3)]


def _train(world: ad.World, strategy: ShardingStrategy, steps: int) -> list[np.ndarray]:
    """A few SGD steps of least squares on every parameter at once; the full parameters."""
    rng = np.random.default_rng(5)
    params = [ad.Parameter(rng.standard_normal(s).astype(np.float32), name=f"p{i}")
              for i, s in enumerate(SHAPES)]
    d = sum(math.prod(s) for s in SHAPES)
    f = FSDP(params, world, sharding_strategy=strategy)
    opt = SGD(f.sharded_parameters(), lr=0.05)

    def grad_fn(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list]:
        theta = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])
        r = x @ theta - y
        g = 2.0 / len(y) * (x.T @ r)
        offsets = np.cumsum([0] + [a.size for a in arrays])
        return float(np.mean(r * r)), [
            g[lo:hi].reshape(a.shape).astype(a.dtype)
            for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:])]

    for step in range(steps):
        batch = np.random.default_rng([step, world.rank])
        x = batch.standard_normal((8, d)) * np.exp(batch.uniform(-3, 3, (8, d)))
        f.step(grad_fn, x / math.sqrt(d), batch.standard_normal(8), optimizer=opt)
    f.gather_parameters()
    full = [np.array(p.data) for p in f.full_parameters()]
    f.reshard_parameters()
    f.close()
    return full


@mpi_only
def test_fsdp_no_shard_and_full_shard_train_to_the_same_bits(raw):
    """NO_SHARD averages gradients with an all-reduce, FULL_SHARD with a reduce-scatter;
    up to 3 ranks MPICH's ``Allreduce`` and ``Reduce_scatter_block`` sum each element in
    the same order. From 4 ranks on they do not (MPICH's own calls, without axondist,
    differ on about a third of the elements at 4 and 5 ranks), so neither can FSDP."""
    world = mpi_world()
    if world.world_size > 3:
        pytest.skip("MPICH's Allreduce and Reduce_scatter_block sum in different orders "
                    "from 4 ranks on")
    no_shard = _train(world, ShardingStrategy.NO_SHARD, 3)
    full_shard = _train(world, ShardingStrategy.FULL_SHARD, 3)
    for i, (a, b) in enumerate(zip(no_shard, full_shard)):
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape == SHAPES[i]
        _agree_bitwise(raw, b, a, f"FSDP parameter {i} {SHAPES[i]}: FULL_SHARD against "
                       f"NO_SHARD ({world.world_size} ranks)")
