"""Buffers in memory both ranks of a pair map (``Backend.shared_buffer``): where the group
can have them (the MPI backend, two ranks of one host) a weighted sum of them has the bits
of the ordinary path and DDP's buckets live there; elsewhere (the mock world, torchrun,
three ranks) there are none and DDP's buckets are ordinary. A shared buffer meeting an
ordinary one is named, and the mappings of the other rank's memory end with the buffers."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI, run_world, world_sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist.ddp import DistributedDataParallel
from axondist.errors import CollectiveMismatchError, WorldAbortedError


def _shares(world: ad.World) -> bool:
    return bool(getattr(world.backend, "shares_memory", False))


def _regions_mapped() -> int:
    return sum("axondist-region" in line for line in Path("/proc/self/maps").read_text()
               .splitlines())


def _sums(world, count, dtype, factors, lo, seed):
    backend = world.backend
    shared = backend.shared_buffer(count, dtype)
    if not _shares(world):
        assert shared is None
        return None
    assert shared is not None and shared.shape == (count,) and shared.dtype == dtype
    rng = np.random.default_rng([seed, world.rank])
    values = rng.standard_normal(count).astype(dtype)
    factor = factors[world.rank]
    ordinary = values.copy()
    shared[...] = values
    backend.scaled_sum_blocking(shared[lo:], factor)
    backend.scaled_sum_blocking(ordinary[lo:], factor)
    np.testing.assert_array_equal(shared, ordinary)  # the same bits, the head untouched
    every = [np.random.default_rng([seed, r]).standard_normal(count).astype(dtype)
             for r in range(world.world_size)]
    want = sum(factors[r] * every[r][lo:].astype(np.float64) for r in range(world.world_size))
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(shared[lo:], want, rtol=tol, atol=tol)
    return shared.tobytes()


@settings(max_examples=10, deadline=None)
@given(n=world_sizes(1, 3), count=st.sampled_from([1, 2, 3, 65_537, 300_001]),
       dtype=st.sampled_from(["float32", "float64"]),
       factors=st.sampled_from([(1.0, 1.0, 1.0), (0.5, 0.5, 0.5), (0.3, 1.7, 0.25)]),
       lo=st.sampled_from([0, 1]), seed=st.integers(0, 2**31 - 1))
def test_a_shared_weighted_sum_has_the_ordinary_paths_bits(n, count, dtype, factors, lo, seed):
    lo = min(lo, count - 1)
    run_world(_sums, n, count, dtype, factors, lo, seed)


def _ddp_buckets(world, steps):
    rng = np.random.default_rng(0)  # the same initial values on every rank
    params = [ad.Parameter(rng.standard_normal(shape).astype(np.float32))
              for shape in ((300, 200), (200,), (200, 10))]
    ddp = DistributedDataParallel(params)
    given_ = [state.bucket.given for state in ddp.synchronizer.buckets]
    assert given_ == [_shares(world)] * len(given_), given_
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
    ddp = _ddp_buckets(world, 2)
    if _shares(world):  # this rank's buckets and its mapping of the other's
        assert _regions_mapped() > before
    del ddp
    gc.collect()
    world.backend.barrier()  # both ranks dropped their DDP
    gc.collect()
    assert _regions_mapped() == before, Path("/proc/self/maps").read_text()


@given(n=world_sizes(1, 3))
@settings(max_examples=3, deadline=None)
def test_ddp_buckets_are_shared_where_the_group_shares_memory_and_freed_with_it(n):
    run_world(_ddp_then_freed, n)


def _mismatch(world):
    backend = world.backend
    shared = backend.shared_buffer(100_000, np.float32) if world.rank == 0 else None
    buf = shared if shared is not None else np.ones(100_000, np.float32)
    buf[...] = 1
    with pytest.raises(CollectiveMismatchError, match=r"disagree on memory \(rank 0: shared"):
        backend.scaled_sum_blocking(buf, 0.5)
    if shared is not None:
        assert (buf == 1).all()  # the shared side wrote nothing (the ordinary one weights first)
    after = np.ones(8, np.float32)
    ad.all_reduce(after)
    assert (after == world.world_size).all()


@pytest.mark.skipif(not UNDER_MPI, reason="a shared buffer exists only under mpiexec")
def test_a_shared_buffer_meeting_an_ordinary_one_is_named_and_the_next_call_works():
    world = ad.init()
    if not _shares(world):
        pytest.skip("this group cannot share memory (three ranks, or the host forbids it)")
    _mismatch(world)


@pytest.mark.skipif(not UNDER_MPI, reason="a shared buffer exists only under mpiexec")
def test_a_rank_that_cannot_map_the_other_is_named_and_nothing_hangs(monkeypatch):
    world = ad.init()
    if not _shares(world):
        pytest.skip("this group cannot share memory (three ranks, or the host forbids it)")
    from axondist.backends import shared_regions

    buf = world.backend.shared_buffer(50_001, np.float64)  # a shape no other test sums
    buf[...] = 1
    if world.rank == 1:
        def refused(locator):
            raise PermissionError(f"mapping {locator} refused (the test's)")
        monkeypatch.setattr(shared_regions, "map_region", refused)
        with pytest.raises(PermissionError, match="refused \\(the test's\\)"):
            world.backend.scaled_sum_blocking(buf, 1.0)
    else:
        with pytest.raises(WorldAbortedError,
                           match=r"all_reduce #\d+ \(memory=shared\): rank 1 of the group failed "
                                 r"to sum its half"):
            world.backend.scaled_sum_blocking(buf, 1.0)
    monkeypatch.undo()
    after = np.ones(8, np.float32)
    ad.all_reduce(after)
    assert (after == 2).all()
