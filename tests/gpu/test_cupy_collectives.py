"""Every collective on CuPy arrays, checked against NumPy references on the host.

Plain pytest runs the bodies on the mock world (one thread per rank, all on
GPU 0); ``mpiexec -n K python tests/world/test_mpi_launch.py pytest
tests/gpu/test_cupy_collectives.py`` runs them on the MPI backend, every rank
on the same GPU (``test_cupy_mpi_launch.py`` does that at K = 2 and 4). There
the device arrays go through host copies unless the MPI library reports
CUDA support. Skipped, at collection, without CuPy or a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_MPI, current_size, mpi_world, run_world, why_no_gpu
from hypothesis import given, settings
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp
from axondist._array import bfloat16

REASON = why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]
TOL = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}
SIZES = [2, 3]
"""Mock world sizes; under mpiexec the job's size is used instead."""

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)


def _dtype(name: str) -> np.dtype:
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def host_input(seed: int, rank: int, shape: tuple[int, ...], dtype: str,
               op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank ``rank``'s input on the host: small values, so integer sums and products fit."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if op is ReduceOp.PRODUCT:
        values = rng.choice([-1, 1, 2], size=shape)
    elif dtype.startswith("int"):
        values = rng.integers(-50, 50, size=shape)
    else:
        values = rng.standard_normal(shape)
    return np.asarray(values).astype(_dtype(dtype))


def device(x: np.ndarray):
    import cupy

    return cupy.asarray(x)


def reduced(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The expected reduction: exact for integers and bools, in float64 for floats."""
    stack = np.stack(inputs)
    if stack.dtype == np.bool_:
        any_or_all = np.any if op in (ReduceOp.SUM, ReduceOp.MAX) else np.all
        return any_or_all(stack, axis=0)
    if stack.dtype.kind == "f" or stack.dtype == bfloat16:
        stack = stack.astype(np.float64)
    return {ReduceOp.SUM: np.sum, ReduceOp.AVERAGE: np.mean, ReduceOp.PRODUCT: np.prod,
            ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}[op](stack, axis=0)


def on_gpu_matching(got, want: np.ndarray, dtype: str, terms: int = 1) -> None:
    """``got`` is a CuPy array equal to ``want`` (to the dtype's rounding over ``terms``)."""
    import cupy

    assert isinstance(got, cupy.ndarray), f"expected a CuPy array, got {type(got).__name__}"
    host = cupy.asnumpy(got)
    assert host.shape == want.shape, (host.shape, want.shape)
    if dtype in TOL:
        tol = TOL[dtype] * terms
        np.testing.assert_allclose(host.astype(np.float64), np.asarray(want, np.float64),
                                   rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(host, want.astype(host.dtype))


def sizes_to_run() -> list[int]:
    return [current_size(0)] if UNDER_MPI else SIZES


# --- reductions ---------------------------------------------------------------------

def _body_all_reduce(world, seed, shape, dtype, op, async_op):
    n = world.world_size
    x = device(host_input(seed, world.rank, shape, dtype, op))
    result = ad.all_reduce(x, op, async_op=async_op)
    if async_op:
        result = result.wait()
    assert result is x, "all_reduce works in place on the device array"
    on_gpu_matching(x, reduced([host_input(seed, r, shape, dtype, op) for r in range(n)], op),
                    dtype, n)


@settings(max_examples=25, deadline=None)
@given(seed=seeds, shape=shapes, dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(list(ReduceOp)), async_op=st.booleans())
def test_all_reduce_every_op_and_dtype(seed, shape, dtype, op, async_op):
    if op is ReduceOp.AVERAGE and dtype in ("int32", "int64", "bool"):
        op = ReduceOp.SUM
    for n in sizes_to_run():
        run_world(_body_all_reduce, n, seed, shape, dtype, op, async_op)


def _body_reduce_family(world, seed, rows_per_rank, dtype):
    n, me = world.world_size, world.rank
    shape = (rows_per_rank * n, 3)
    inputs = [host_input(seed, r, shape, dtype) for r in range(n)]
    total = reduced(inputs, ReduceOp.SUM)
    block = slice(me * rows_per_rank, (me + 1) * rows_per_rank)
    on_gpu_matching(ad.reduce_scatter(device(inputs[me])), total[block], dtype, n)
    out = device(np.zeros((rows_per_rank, 3), _dtype(dtype)))
    assert ad.reduce_scatter(device(inputs[me]), out=out) is out
    on_gpu_matching(out, total[block], dtype, n)
    if dtype != "bool" and not dtype.startswith("int"):
        mean = ad.reduce_scatter(device(inputs[me]), ReduceOp.AVERAGE, async_op=True).wait()
        on_gpu_matching(mean, reduced(inputs, ReduceOp.AVERAGE)[block], dtype, n)
    dst = n - 1
    x = device(inputs[me])
    assert ad.reduce(x, dst) is x
    if me == dst:
        on_gpu_matching(x, total, dtype, n)


@settings(max_examples=10, deadline=None)
@given(seed=seeds, rows_per_rank=st.integers(0, 4), dtype=st.sampled_from(DTYPES))
def test_reduce_scatter_and_reduce(seed, rows_per_rank, dtype):
    for n in sizes_to_run():
        run_world(_body_reduce_family, n, seed, rows_per_rank, dtype)


# --- moves --------------------------------------------------------------------------

def _body_moves(world, seed, dtype):
    import cupy

    n, me = world.world_size, world.rank
    rows = [r + 1 for r in range(n)]  # uneven on purpose
    mine = host_input(seed, me, (rows[me], 2), dtype)
    every = [host_input(seed, r, (rows[r], 2), dtype) for r in range(n)]
    on_gpu_matching(ad.all_gather(device(mine), sizes=rows), np.concatenate(every), dtype)
    even = [host_input(seed + 1, r, (2, 2), dtype) for r in range(n)]
    on_gpu_matching(ad.all_gather(device(even[me])), np.concatenate(even), dtype)
    gathered = ad.gather_tensor(device(mine), dst=0)
    if me == 0:
        on_gpu_matching(gathered, np.concatenate(every), dtype)
    else:
        assert gathered is None

    src = n - 1
    x = device(host_input(seed, me, (3, 4), dtype))
    assert ad.broadcast(x, src=src) is x
    on_gpu_matching(x, host_input(seed, src, (3, 4), dtype), dtype)
    y = device(host_input(seed, me, (5,), dtype))
    ad.broadcast(y, src=0, async_op=True).wait()
    on_gpu_matching(y, host_input(seed, 0, (5,), dtype), dtype)

    whole = host_input(seed, 0, (2 * n + 1, 3), dtype)
    piece = ad.scatter_tensor(device(whole) if me == 0 else None, src=0)
    on_gpu_matching(piece, np.array_split(whole, n)[me], dtype)

    # row block k of rank r's input goes to rank k: rank me receives every rank's block me
    sent = [host_input(seed + 2, r, (n, 2), dtype) for r in range(n)]
    got = ad.all_to_all(device(sent[me]))
    on_gpu_matching(got, np.stack([sent[r][me] for r in range(n)]), dtype)

    # a ring of sends: rank r sends to r+1 and receives from r-1, device arrays both ways
    nxt, prev = (me + 1) % n, (me - 1) % n
    if me % 2 == 0:
        ad.send(device(host_input(seed, me, (4,), dtype)), nxt)
        out = ad.recv(prev, out=device(np.zeros(4, _dtype(dtype))))
    else:
        out = ad.recv(prev, out=device(np.zeros(4, _dtype(dtype))))
        ad.send(device(host_input(seed, me, (4,), dtype)), nxt)
    on_gpu_matching(out, host_input(seed, prev, (4,), dtype), dtype)
    assert isinstance(out, cupy.ndarray)
    ad.barrier()


@settings(max_examples=6, deadline=None)
@given(seed=seeds, dtype=st.sampled_from(DTYPES))
def test_gathers_broadcasts_scatters_all_to_all_and_point_to_point(seed, dtype):
    for n in sizes_to_run():
        run_world(_body_moves, n, seed, dtype)


def _body_objects_and_gradients(world, seed):
    n, me = world.world_size, world.rank
    assert ad.all_gather_object({"rank": me}) == [{"rank": r} for r in range(n)]
    grads = [device(host_input(seed, me, shape, "float32")) for shape in [(3,), (2, 2), ()]]
    synced = ad.sync_gradients(grads)
    for shape, g in zip([(3,), (2, 2), ()], synced):
        want = reduced([host_input(seed, r, shape, "float32") for r in range(n)],
                       ReduceOp.AVERAGE)
        on_gpu_matching(g, want, "float32", n)


@settings(max_examples=4, deadline=None)
@given(seed=seeds)
def test_objects_and_gradient_sync_on_device_arrays(seed):
    for n in sizes_to_run():
        run_world(_body_objects_and_gradients, n, seed)


def _body_mixed(world):
    import cupy

    x = cupy.ones(3, cupy.float32) if world.rank == 0 else np.ones(3, np.float32)
    if not UNDER_MPI:
        with pytest.raises(ad.InvalidBufferError, match=r"all_reduce: the ranks passed arrays "
                           r"of different libraries \(rank 0: cupy, rank 1: numpy"):
            ad.all_reduce(x)
        return
    ad.all_reduce(x)  # MPI moves bytes: each rank keeps its own array library
    assert float(ad.to_host(x).sum()) == 3.0 * world.world_size
    assert isinstance(x, cupy.ndarray) == (world.rank == 0)


def test_ranks_mixing_host_and_device_arrays_work_on_mpi_and_are_refused_on_the_mock():
    for n in sizes_to_run():
        run_world(_body_mixed, n)


# --- the MPI backend's handling of device memory ------------------------------------

needs_mpi = pytest.mark.skipif(not UNDER_MPI, reason="the MPI backend: run under mpiexec")


@needs_mpi
def test_cuda_awareness_is_detected_and_reported():
    from mpi4py import MPI

    backend = mpi_world().backend
    query = getattr(MPI, "Query_cuda_support", None)
    info = backend.comm.Get_info()
    try:
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()
    print(f"\nMPI: {MPI.Get_library_version().splitlines()[0]}; Query_cuda_support="
          f"{query() if query else 'absent'}; mpi_memory_alloc_kinds={kinds!r}; "
          f"cuda_aware={backend.cuda_aware}; host_staging={backend.options.host_staging}")
    if query is not None:
        assert backend.cuda_aware == bool(query())
    else:
        assert backend.cuda_aware == ("cuda" in kinds)


def _body_big(world, seed):
    """Messages past the small-message paths: the ring mean, the reduce-scatter ring,
    pieced broadcasts (several MiB each)."""
    n, me = world.world_size, world.rank
    rows = 1 << 18  # x 4 float32 columns: 4 MiB per rank
    inputs = [host_input(seed, r, (rows, 4), "float32") for r in range(n)]
    mean = ad.all_reduce(device(inputs[me]), ReduceOp.AVERAGE)
    on_gpu_matching(mean, reduced(inputs, ReduceOp.AVERAGE), "float32", n)
    per = rows // n
    block = ad.reduce_scatter(device(inputs[me][:per * n]))
    on_gpu_matching(block, reduced([x[:per * n] for x in inputs], ReduceOp.SUM)
                    [me * per:(me + 1) * per], "float32", n)
    x = device(inputs[me])
    ad.broadcast(x, src=n - 1)
    on_gpu_matching(x, inputs[n - 1], "float32")
    gathered = ad.all_gather(device(inputs[me][:per]))
    on_gpu_matching(gathered, np.concatenate([x[:per] for x in inputs]), "float32")


def test_messages_of_several_mib():
    for n in sizes_to_run():
        run_world(_body_big, n, 7)


@needs_mpi
def test_host_staging_mode_is_the_one_asked_for():
    import os

    backend = mpi_world().backend
    asked = os.environ.get("AXONDIST_MPI_HOST_STAGING", "auto").lower()
    assert backend.options.host_staging == asked
    staged = backend._host(device(np.zeros(2, np.float32)))
    assert staged == (asked == "always" or not backend.cuda_aware)
