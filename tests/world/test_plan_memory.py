"""The memory an FSDP wrapper's collectives leave behind: none. Under ``mpiexec`` the
backend's prepared calls outlive a wrapper (they are the group's, cached by call), so a plan
that kept a buffer (a two-rank reduce-scatter's receive buffer of a gradient shard, a riding
all-reduce's message) would hold it after the wrapper is gone, counted by neither
``memory_stats`` nor ``memory_estimate``. Here each rank traces (tracemalloc: NumPy reports
its buffers to it) three wrappers built, stepped and deleted, on shapes no earlier test
made plans for, and finds what it traced before them; no cached plan holds an array of
more than 1 KiB; and after each step ``memory_stats`` is what the estimate says. Runs only under
``mpiexec`` (``tests/world/test_mpi_launch.py`` launches the world tests at 2 and 3 ranks):
in the mock world every run makes its backends afresh.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world

import axondist as ad
from axondist.fsdp import FSDP, ShardingStrategy
from axondist.optim import SGD

mpi_only = pytest.mark.skipif(not UNDER_MPI, reason="plans outlive wrappers only in a "
                                                    "launched world: run under mpiexec")
#: The array bytes a rank may trace more after the wrappers are gone (NumPy's own tracemalloc
#: domain only: the cached plans' small Python objects for the new shapes, keys, hashes and
#: slices, are no buffer and came within 3% of this figure on a loaded machine): below one
#: unit's shard (150-300 KiB here), so one kept shard of three wrappers (at least 450 KiB)
#: cannot hide in it.
SLACK = 128 << 10


def _shapes(width: int) -> list[tuple[int, ...]]:
    """Two layers whose unit's shard is well above the two-rank exchange's 64 KiB, and a
    small vector whose gradient rides with its check."""
    return [(width, 256), (256,), (256, width), (width,), (300,)]


def _train(world: ad.World, strategy: ShardingStrategy, width: int) -> tuple[int, int]:
    """Build a wrapper, run backward and the optimizer's step twice, close it; memory_stats'
    and the estimate's totals right after the last step."""
    rng = np.random.default_rng([width, world.rank])
    params = [ad.Parameter(rng.standard_normal(s).astype(np.float32)) for s in _shapes(width)]
    f = FSDP(params, world, sharding_strategy=strategy)
    opt = SGD(f.sharded_parameters(), lr=0.01)

    def grad_fn(arrays: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        return 0.0, [np.full(a.shape, world.rank + 1.0, np.float32) for a in arrays]

    for _ in range(2):
        opt.zero_grad()
        f.backward(grad_fn)
        opt.step()
    figures = (f.memory_stats(opt).total_bytes_per_rank,
               f.memory_estimate(opt).total_bytes_per_rank)
    f.close()
    return figures


def _owner(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _kept_arrays(backend: object) -> list[str]:
    """Every NumPy array of more than 1 KiB a cached plan of ``backend`` holds (views of the
    two buffers a two-rank group's checks send and receive through, which live with the
    group, aside)."""
    guard = getattr(backend, "guard", None)
    shared = [getattr(guard, name, None) for name in ("received", "outgoing")]
    found = []
    for key, plan in (getattr(backend, "_call_plans", None) or {}).items():
        for cls in type(plan).__mro__:
            for name in getattr(cls, "__slots__", ()):
                value = getattr(plan, name, None)
                if (isinstance(value, np.ndarray) and value.nbytes > 1024
                        and not any(_owner(value) is buf for buf in shared)):
                    found.append(f"{type(plan).__name__}.{name} ({value.nbytes} B) for {key}")
    return found


def _traced() -> int:
    """Bytes of NumPy array data traced now (what a kept buffer is)."""
    gc.collect()
    arrays = tracemalloc.DomainFilter(inclusive=True, domain=np.lib.tracemalloc_domain)
    snapshot = tracemalloc.take_snapshot().filter_traces([arrays])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@mpi_only
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD,
                                      ShardingStrategy.SHARD_GRAD_OP])
def test_wrappers_leave_no_plan_buffers_and_count_what_they_hold(strategy):
    world = mpi_world()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        ad.barrier()
        base = _traced()
        figures = [_train(world, strategy, 601 + 2 * k + 40 * list(ShardingStrategy).index(
            strategy)) for k in range(3)]
        left = _traced() - base
    finally:
        if started:
            tracemalloc.stop()
    kept = _kept_arrays(world.backend)
    verdicts = ad.all_gather_object((left, figures, kept))
    for rank, (rank_left, rank_figures, rank_kept) in enumerate(verdicts):
        assert not rank_kept, f"rank {rank}: plans keep buffers: {rank_kept}"
        assert rank_left <= SLACK, (
            f"rank {rank}: three {strategy.name} wrappers left {rank_left} bytes of arrays "
            f"traced after they were closed and deleted (at most {SLACK}): a plan keeps a buffer")
        for stats, estimate in rank_figures:
            assert stats == estimate, (rank, stats, estimate)


@mpi_only
@pytest.mark.parametrize("numel", [300, 4099, 16384])
def test_collective_plans_keep_no_arrays(numel):
    """Every collective on shapes of its own: the plans cached afterwards hold no array of
    more than 1 KiB (a riding all-reduce builds its message in the group's buffer, a pair
    reduce-scatter receives into its result)."""
    world = mpi_world()
    n = world.world_size
    x = np.full(numel * n, world.rank + 1.0, np.float32)
    for op in ("sum", "average", "max"):
        ad.all_reduce(x[:numel].copy(), op)
        ad.reduce_scatter(x, op)
    ad.all_gather(x[:numel], sizes=[numel] * n)
    ad.broadcast(x[:numel].copy(), src=0)
    kept = ad.all_gather_object(_kept_arrays(world.backend))
    assert not any(kept), f"plans keep buffers: {kept}"
