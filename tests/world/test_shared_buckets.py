"""Buffers in memory both ranks of a pair map (``Backend.shared_buffer``): where the group
can have them (the MPI backend, two ranks of one host) a weighted sum and a weighted
reduce-scatter of them have the bits of the ordinary path, DDP's buckets and FSDP's
gradient packing live there; elsewhere (the mock world, torchrun, three ranks) there are
none, the same calls take the ordinary path, and the wrappers' buffers are ordinary. A
shared buffer meeting an ordinary one is named, and the mappings of the other rank's
memory end with the buffers."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI, current_size, run_world, world_sizes
from hypothesis import example, given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.backends.mpi.algorithms.pair_shared import (
    REDUCE_SCATTER_FROM_BYTES,
    SUM_FROM_BYTES,
)
from axondist.ddp import DistributedDataParallel
from axondist.errors import CollectiveMismatchError, WorldAbortedError
from axondist.fsdp import FSDP
from axondist.optim import Adam


def _shares(world: ad.World) -> bool:
    return bool(getattr(world.backend, "shares_memory", False))


def _regions_mapped() -> set[int]:
    """The inodes of the shared regions mapped into this process (its own and the other
    rank's): other tests' wrappers may still be collected meanwhile, so a test compares
    the regions it made, not a count."""
    return {int(line.split()[4]) for line in Path("/proc/self/maps").read_text().splitlines()
            if "axondist-region" in line}


def _mapped_then_gone(world, before: set[int], holder: list) -> None:
    """Where the group shares memory, the wrapper in ``holder`` mapped regions since
    ``before`` (its own and the other rank's); once both ranks dropped it, none is left."""
    if _shares(world):
        made = _regions_mapped() - before
        assert len(made) >= 2, made  # this rank's and the other rank's
    holder.clear()
    gc.collect()
    world.backend.barrier()  # both ranks dropped their wrapper
    gc.collect()
    assert not (_regions_mapped() - before), Path("/proc/self/maps").read_text()


def _last_detail() -> str:
    """The detail of this rank's last recorded call on the world group."""
    return [e for e in ad.flight_recorder() if e["group"] == "world"][-1]["detail"]


def _region_view(backend, count, dtype, lo, collective):
    """``count + lo`` elements of ``dtype`` in a shared region (a view of a buffer large
    enough for ``collective``'s shared plan, so the small counts lie there too), or None
    where the group shares no memory."""
    floor = (SUM_FROM_BYTES if collective == "all_reduce" else REDUCE_SCATTER_FROM_BYTES)
    room = max(count + lo, floor // np.dtype(dtype).itemsize)
    whole = backend.shared_buffer(room, dtype, collective)
    return None if whole is None else whole[:count + lo]


def _sums(world, count, dtype, factors, lo, seed):
    backend = world.backend
    shared = _region_view(backend, count, dtype, lo, "all_reduce")
    if not _shares(world):
        assert shared is None and backend.shared_buffer(1 << 20, dtype) is None
        return None
    assert shared is not None and shared.dtype == dtype
    rng = np.random.default_rng([seed, world.rank])
    values = rng.standard_normal(count + lo).astype(dtype)
    factor = factors[world.rank]
    ordinary = values.copy()
    shared[...] = values
    backend.scaled_sum_blocking(shared[lo:], factor)
    # the shared plan from SUM_FROM_BYTES, the ordinary path below (a region or not)
    large = count * np.dtype(dtype).itemsize >= SUM_FROM_BYTES
    assert ("memory=shared" in _last_detail()) == large, _last_detail()
    backend.scaled_sum_blocking(ordinary[lo:], factor)
    np.testing.assert_array_equal(shared, ordinary)  # the same bits, the head untouched
    every = [np.random.default_rng([seed, r]).standard_normal(count + lo).astype(dtype)
             for r in range(world.world_size)]
    want = sum(factors[r] * every[r][lo:].astype(np.float64) for r in range(world.world_size))
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(shared[lo:], want, rtol=tol, atol=tol)
    return shared.tobytes()


@settings(max_examples=12, deadline=None)
@given(n=world_sizes(1, 3),
       count=st.sampled_from([1, 3, SUM_FROM_BYTES // 8 - 1, SUM_FROM_BYTES // 8,
                              SUM_FROM_BYTES // 4 - 1, SUM_FROM_BYTES // 4, 300_001]),
       dtype=st.sampled_from(["float32", "float64"]),
       factors=st.sampled_from([(1.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.3, 1.7, 0.25)]),
       lo=st.sampled_from([0, 1]), seed=st.integers(0, 2**31 - 1))
@example(n=current_size(2), count=SUM_FROM_BYTES // 4 - 1, dtype="float32",
         factors=(0.5, 0.5, 0.5), lo=0, seed=1)  # just below the shared plan's size: ordinary
@example(n=current_size(2), count=SUM_FROM_BYTES // 4, dtype="float32",
         factors=(0.3, 1.7, 0.25), lo=1, seed=2)  # at it: shared
def test_a_shared_weighted_sum_has_the_ordinary_paths_bits(n, count, dtype, factors, lo, seed):
    run_world(_sums, n, count, dtype, factors, lo, seed)


def _scatters(world, rows, tail, dtype, factors, lo, seed):
    backend = world.backend
    row = int(np.prod(tail, dtype=np.int64))
    every = [np.random.default_rng([seed, r]).standard_normal((rows + lo) * row).astype(dtype)
             for r in range(world.world_size)]
    values = every[world.rank]
    factor = factors[world.rank]
    ordinary = values.reshape((rows + lo,) + tail)[lo:].copy()
    got = backend.scaled_reduce_scatter_blocking(ordinary.copy(), factor)
    mine = np.array_split(np.arange(rows), world.world_size)[world.rank]  # rows kept here
    want = sum(factors[r] * every[r].reshape((rows + lo,) + tail)[lo:].astype(np.float64)
               for r in range(world.world_size))[mine]
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, want.shape)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    shared = _region_view(backend, (rows + lo) * row - lo * row, dtype, lo * row,
                          "reduce_scatter")
    if shared is None:
        assert not _shares(world)
        return None
    shared[...] = values
    view = shared.reshape((rows + lo,) + tail)[lo:]
    from_shared = backend.scaled_reduce_scatter_blocking(view, factor)
    large = view.nbytes >= REDUCE_SCATTER_FROM_BYTES
    assert ("memory=shared" in _last_detail()) == large, _last_detail()
    np.testing.assert_array_equal(from_shared, got)  # the ordinary path's bits
    assert from_shared.shape == got.shape
    if large:
        np.testing.assert_array_equal(shared, values)  # neither buffer is written
    return from_shared.tobytes()


@settings(max_examples=12, deadline=None)
@given(n=world_sizes(1, 3),
       rows=st.sampled_from([2, 3, 5, REDUCE_SCATTER_FROM_BYTES // 8,
                             REDUCE_SCATTER_FROM_BYTES // 4 - 1,
                             REDUCE_SCATTER_FROM_BYTES // 4, 300_001]),
       tail=st.sampled_from([(), (3,), (2, 5)]), dtype=st.sampled_from(["float32", "float64"]),
       factors=st.sampled_from([(1.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.3, 1.7, 0.25)]),
       lo=st.sampled_from([0, 1]), seed=st.integers(0, 2**31 - 1))
@example(n=current_size(2), rows=REDUCE_SCATTER_FROM_BYTES // 4 - 1, tail=(), dtype="float32",
         factors=(1.0, 1.0, 1.0), lo=0, seed=1)  # just below the shared plan's size
@example(n=current_size(2), rows=REDUCE_SCATTER_FROM_BYTES // 4, tail=(), dtype="float32",
         factors=(0.3, 1.7, 0.25), lo=1, seed=2)  # at it
def test_a_shared_weighted_reduce_scatter_has_the_ordinary_paths_bits(n, rows, tail, dtype,
                                                                      factors, lo, seed):
    if rows >= 65_536 and tail:
        tail = ()  # bound the work: the long buffers are one-dimensional
    run_world(_scatters, n, rows, tail, dtype, factors, lo, seed)


def _fsdp_packs(world):
    before = _regions_mapped()
    rng = np.random.default_rng(0)  # the same initial values on every rank
    params = [ad.Parameter(rng.standard_normal(shape).astype(dtype))
              for shape, dtype in (((400, 200), np.float32), ((200,), np.float32),
                                   ((40, 10), np.float64))]
    f = FSDP(params, units=[[0, 1], [2]])
    # the float32 unit is large enough for the shared reduce-scatter; the float64 one is
    # not, so no buffer is made for it (its sync takes the ordinary path)
    assert f._units[0].flat.padded_numel * 4 >= REDUCE_SCATTER_FROM_BYTES
    assert f._units[1].flat.padded_numel * 8 < REDUCE_SCATTER_FROM_BYTES
    assert sorted(str(d) for d in f._packs) == (["float32"] if _shares(world) else [])
    opt = Adam(f.sharded_parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        f.gather_parameters()
        grads = [np.full(p.shape, world.rank + step + 1.0, p.dtype) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        f.reshard_parameters()
        f.sync_gradients()
        mean = sum(r + step + 1.0 for r in range(world.world_size)) / world.world_size
        for unit in f._units:
            lo, hi = unit.flat.valid_bounds(f.shard_rank)
            np.testing.assert_array_equal(unit.shard.grad[:hi - lo], mean)
        opt.step()
    stats, estimate = f.memory_stats(opt), f.memory_estimate(opt)
    assert {**stats.as_dict(), "measured": None} == {**estimate.as_dict(), "measured": None}
    packed = sum(b.nbytes for b in f._packs.values())  # the largest unit of each dtype
    assert packed == (f._units[0].flat.padded_numel * 4 if _shares(world) else 0)
    assert stats.buffer_bytes_per_rank == packed  # counted, and apart from the gradients
    holder = [f]
    del f, opt, params
    _mapped_then_gone(world, before, holder)


@given(n=world_sizes(1, 3))
@settings(max_examples=3, deadline=None)
def test_fsdp_packs_gradients_in_shared_memory_where_it_can_counted_and_freed(n):
    run_world(_fsdp_packs, n)


def _to_framework(values: np.ndarray, framework: str):
    if framework == "torch":
        import torch
        return torch.from_numpy(values.copy())
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.asarray(values)
    return values


def _fsdp_framework_grads(world, framework):
    """One unit large enough for the shared reduce-scatter, its gradient set as a torch
    tensor or a JAX array: the shard gradient is the NumPy gradient's, bit for bit."""
    got = []
    for kind in ("numpy", framework):
        params = [ad.Parameter(np.zeros((400, 200), np.float32), "w")]
        f = FSDP(params, world)
        assert bool(f._packs) == _shares(world)
        f.gather_parameters()
        grad = np.random.default_rng([7, world.rank]).standard_normal((400, 200))
        params[0].grad = _to_framework(grad.astype(np.float32), kind)
        f.reshard_parameters()
        f.sync_gradients()
        got.append(np.array(f._units[0].shard.grad))
        f.close()
    np.testing.assert_array_equal(got[1], got[0])
    every = [np.random.default_rng([7, r]).standard_normal((400, 200)).astype(np.float32)
             for r in range(world.world_size)]
    full = (sum(g.astype(np.float64) for g in every) / world.world_size).reshape(-1)
    shard = got[0]
    valid = full[world.rank * shard.size:][:shard.size]  # this rank's shard, padding cut
    np.testing.assert_allclose(shard[:valid.size], valid, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_fsdp_packs_torch_and_jax_gradients_as_numpy_ones(framework):
    pytest.importorskip(framework)
    run_world(_fsdp_framework_grads, current_size(2), framework)


def _ddp_buckets(world, steps):
    rng = np.random.default_rng(0)  # the same initial values on every rank
    params = [ad.Parameter(rng.standard_normal(shape).astype(np.float32))
              for shape in ((300, 200), (200,), (200, 10))]
    ddp = DistributedDataParallel(params)
    given_ = [state.bucket.given for state in ddp.synchronizer.buckets]
    large = [state.bucket.capacity * 4 >= SUM_FROM_BYTES for state in ddp.synchronizer.buckets]
    assert given_ == [_shares(world) and big for big in large], (given_, large)
    for step in range(steps):
        grads = [np.full(p.data.shape, world.rank + step, np.float32) for p in params]
        ddp.zero_grad(set_to_none=False)
        ddp.backward(lambda _params, g=grads: (0.0, g))
        mean = sum(r + step for r in range(world.world_size)) / world.world_size
        for p in params:
            np.testing.assert_array_equal(p.grad, np.float32(mean))
    return ddp


def _ddp_then_freed(world):
    before = _regions_mapped()
    _mapped_then_gone(world, before, [_ddp_buckets(world, 2)])


@given(n=world_sizes(1, 3))
@settings(max_examples=3, deadline=None)
def test_ddp_buckets_are_shared_where_the_group_shares_memory_and_freed_with_it(n):
    run_world(_ddp_then_freed, n)


#: The two shared calls: a name in their errors, and how each is made.
CALLS = {"all_reduce": lambda backend, buf, w: backend.scaled_sum_blocking(buf, w),
         "reduce_scatter": lambda backend, buf, w: backend.scaled_reduce_scatter_blocking(buf, w)}


def _mismatch(world, call):
    backend = world.backend
    shared = backend.shared_buffer(100_000, np.float32) if world.rank == 0 else None
    buf = shared if shared is not None else np.ones(100_000, np.float32)
    buf[...] = 1
    with pytest.raises(CollectiveMismatchError, match=r"disagree on memory \(rank 0: shared"):
        CALLS[call](backend, buf, 0.5)
    if shared is not None:
        assert (buf == 1).all()  # the shared side wrote nothing (the ordinary one weights first)
    after = np.ones(8, np.float32)
    ad.all_reduce(after)
    assert (after == world.world_size).all()


@pytest.mark.skipif(not UNDER_MPI, reason="a shared buffer exists only under mpiexec")
@pytest.mark.parametrize("call", list(CALLS))
def test_a_shared_buffer_meeting_an_ordinary_one_is_named_and_the_next_call_works(call):
    world = ad.init()
    if not _shares(world):
        pytest.skip("this group cannot share memory (three ranks, or the host forbids it)")
    _mismatch(world, call)


@pytest.mark.skipif(not UNDER_MPI, reason="a shared buffer exists only under mpiexec")
@pytest.mark.parametrize("call", list(CALLS))
def test_a_rank_that_cannot_map_the_other_is_named_and_nothing_hangs(monkeypatch, call):
    world = ad.init()
    if not _shares(world):
        pytest.skip("this group cannot share memory (three ranks, or the host forbids it)")
    from axondist.backends import shared_regions

    buf = world.backend.shared_buffer(50_001, np.float64)  # a shape no other test uses
    buf[...] = 1
    if world.rank == 1:
        def refused(locator):
            raise PermissionError(f"mapping {locator} refused (the test's)")
        monkeypatch.setattr(shared_regions, "map_region", refused)
        with pytest.raises(PermissionError, match="refused \\(the test's\\)"):
            CALLS[call](world.backend, buf, 1.0)
    else:
        with pytest.raises(WorldAbortedError,
                           match=rf"{call} #\d+ \(memory=shared\): rank 1 of the group failed "
                                 r"to combine its half"):
            CALLS[call](world.backend, buf, 1.0)
    monkeypatch.undo()
    after = np.ones(8, np.float32)
    ad.all_reduce(after)
    assert (after == 2).all()
