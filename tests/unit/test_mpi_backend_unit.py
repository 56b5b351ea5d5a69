"""The MPI backend's pieces, without a multi-rank job.

Pure helpers (piece sizes, displacements, tags, the float16/bfloat16
reduction callbacks, options) need no MPI at all. The rest runs the backend
on a one-rank MPI world (``COMM_SELF``, which mpi4py starts without
mpiexec): argument checks, errors, and the host-staging path that CuPy
arrays take on an MPI that is not CUDA-aware, exercised with NumPy arrays
(``host_staging="always"``) and a spy on the communicator. Collectives
across ranks are tested under mpiexec by tests/world/test_mpi_launch.py.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp, _array
from axondist.backends.mpi.choose import PIECES_FROM_BYTES
from axondist.backends.mpi.transport import (
    HostStaging,
    MPIOptions,
    cuda_aware_from_alloc_kinds,
    displacements,
    numpy_reducer,
    piece_bounds,
    split_tag,
)

HALF_DTYPES = [np.dtype(np.float16), _array.bfloat16]


# --- pure helpers -------------------------------------------------------------------------

@given(numel=st.integers(0, 10_000), itemsize=st.sampled_from([1, 2, 4, 8, 16]),
       chunk=st.integers(1, 5_000))
def test_piece_bounds_cover_the_buffer_in_the_fewest_pieces_that_fit(numel, itemsize, chunk):
    bounds = piece_bounds(numel, itemsize, chunk)
    per = max(1, chunk // itemsize)  # elements per piece at most
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
    assert all(hi - lo <= per for lo, hi in bounds)
    assert len(bounds) == max(1, -(-numel // per))  # no more pieces than needed
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1  # near-equal


@given(counts=st.lists(st.integers(0, 50), max_size=9))
def test_displacements_are_the_running_sums(counts):
    displs = displacements(counts)
    assert displs == [sum(counts[:k]) for k in range(len(counts))]


@given(tag=st.integers(0, 2**20), other=st.integers(0, 2**20))
def test_split_tag_keeps_headers_and_data_apart(tag, other):
    data, header = split_tag(tag, 2**22)
    other_data, other_header = split_tag(other, 2**22)
    assert data != other_header and header != other_data  # never a header for data
    assert (data == other_data) == (tag == other)


@pytest.mark.parametrize("tag", [-1, 2**21, 1.5, True, "3"])
def test_split_tag_refuses_tags_outside_the_mpi_range(tag):
    with pytest.raises(ValueError, match=r"must be an int in 0\.\.2097151"):
        split_tag(tag, 2**22)


@pytest.mark.parametrize("kinds,aware", [
    ("mpi,system", False), ("mpi,system,cuda:device", True), ("cuda", True),
    ("system, CUDA:host", True), ("", False), ("rocm:device,system", False),
])
def test_cuda_awareness_from_the_memory_alloc_kinds_info(kinds, aware):
    assert cuda_aware_from_alloc_kinds(kinds) is aware


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("ufunc", [np.add, np.multiply, np.minimum, np.maximum],
                         ids=lambda u: u.__name__)
def test_numpy_reducer_combines_raw_buffers_like_numpy(dtype, ufunc):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(37).astype(dtype)
    b = rng.standard_normal(37).astype(dtype)
    inout = bytearray(b.tobytes())  # what MPI hands the callback: raw memory
    numpy_reducer(dtype, ufunc)(memoryview(a.tobytes()), memoryview(inout), None)
    got = np.frombuffer(inout, dtype=dtype)
    np.testing.assert_array_equal(got, ufunc(a, b))  # in the dtype itself, as the mock does


def test_host_staging_never_aliases_reuses_its_buffer_and_copies_back_in_place():
    staging = HostStaging()
    x = np.arange(6.0).reshape(2, 3)
    h = staging.to_host(x)
    assert not np.shares_memory(h, x)
    np.testing.assert_array_equal(h, x)
    h[...] = -1
    assert x[0, 0] == 0
    _array.copy_from_host(x, h)
    assert (x == -1).all()
    assert staging.to_host(np.zeros((2, 3))) is h  # one buffer per (shape, dtype)
    assert staging.buffer(np.zeros(6)) is not h
    staging.free()
    assert staging.buffer(x) is not h


def test_options_read_the_environment_then_the_arguments(monkeypatch):
    monkeypatch.setenv("AXONDIST_MPI_CHUNK_BYTES", "4096")
    monkeypatch.setenv("AXONDIST_MPI_HOST_STAGING", "ALWAYS")
    monkeypatch.setenv("AXONDIST_DEBUG", "1")
    assert MPIOptions.from_env() == MPIOptions(chunk_bytes=4096, host_staging="always",
                                               debug=True)
    assert MPIOptions.from_env(chunk_bytes=0).chunk_bytes == 0
    monkeypatch.delenv("AXONDIST_DEBUG")
    assert MPIOptions.from_env().debug is False


def test_options_refuse_bad_values_and_unknown_names():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['chunk'\]; valid options"):
        MPIOptions.from_env(chunk=3)
    with pytest.raises(ValueError, match="host_staging must be one of"):
        MPIOptions(host_staging="sometimes")
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 0, got -1"):
        MPIOptions(chunk_bytes=-1)


def test_missing_mpi4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now fails
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(ad.BackendUnavailableError,
                       match=r"pip install '\.\[mpi\]' from the axondist checkout"):
        ad.init("mpi")
    with pytest.raises(ImportError):  # also an ImportError, for code that expects one
        ad.init("mpi")


# --- one-rank MPI world -------------------------------------------------------------------

@pytest.fixture(scope="module")
def MPI() -> Any:
    return pytest.importorskip("mpi4py.MPI")


@pytest.fixture
def make(MPI: Any) -> Any:
    """``make(**options)``: a one-rank backend, closed after the test whatever happens (its
    datatypes and user-defined ops too: mpi4py allows 32 user ops per process)."""
    from axondist.backends.mpi import MPIBackend

    made: list[Any] = []

    def new(**options: Any) -> Any:
        made.append(MPIBackend(MPI.COMM_SELF.Dup(), MPIOptions(**options)))
        return made[-1]

    yield new
    for b in made:
        if isinstance(b._comm, _Spy):
            b._comm = b._comm.comm
        b.close()


class _Spy:
    """A communicator proxy that records the buffers handed to MPI calls."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.buffers = comm, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.comm, name)
        if not name[:1].isupper() or not callable(method):
            return method

        def call(*args: Any) -> Any:
            for a in args:
                spec = a[0] if isinstance(a, list) else a
                if isinstance(spec, np.ndarray):
                    self.buffers.append(spec)
            return method(*args)
        return call


def test_one_rank_collectives_are_identities_on_every_dtype(make):
    b = make()
    assert (b.rank, b.world_size, b.node_info()) == (0, 1, (0, 0, 1))
    for dtype in _array.SUPPORTED_DTYPES:
        x = (np.arange(6) % 3).astype(dtype)
        want = x.copy()
        for op in ReduceOp:
            if b.types.reduce[op.name].get(dtype) is None:
                continue
            y = x.copy()
            assert b.all_reduce(y, op).wait() is y
            np.testing.assert_array_equal(y, want)
        out = np.empty_like(x)
        b.all_gather(x, out, [6]).wait()
        np.testing.assert_array_equal(out, want)
    b.close()
    b.close()  # idempotent


@pytest.mark.parametrize("async_op", [False, True])
def test_host_staging_hands_mpi_a_copy_and_writes_back_on_completion(make, async_op):
    b = make(host_staging="always")
    spy = b._comm = _Spy(b._comm)
    x = np.arange(8.0)
    work = b.all_reduce(x, ReduceOp.SUM, async_op=async_op)
    (staged,) = spy.buffers
    assert not np.shares_memory(staged, x), "MPI must see the host copy, not the array"
    staged[...] = 42.0  # what a reduction over more ranks would leave in the copy
    if async_op:
        assert x[0] == 0.0, "copied back before wait()"
    assert work.wait() is x
    expected = 42.0 if async_op else np.arange(8.0)  # sync: copied back before we wrote
    np.testing.assert_array_equal(x, expected)


def test_without_staging_numpy_buffers_go_to_mpi_as_they_are(make):
    b = make()
    spy = b._comm = _Spy(b._comm)
    x = np.arange(8.0)
    b.all_reduce(x, ReduceOp.SUM)
    b.broadcast(x, 0)
    assert len(spy.buffers) == 2 and all(np.shares_memory(buf, x) for buf in spy.buffers)


def test_staged_calls_in_flight_at_once_keep_their_own_host_buffers(make):
    """Two non-blocking staged calls of one shape started before either is waited for (FSDP's
    micro-batches do this) each get their own values back, whatever order they finish in."""
    b = make(host_staging="always")
    xs = [np.full(8, float(k + 1), np.float32) for k in range(3)]
    works = [b.all_reduce(x, ReduceOp.SUM, async_op=True) for x in xs]
    outs = [np.zeros(8, np.float32) for _ in xs]
    gathers = [b.all_gather(x, out, [8], async_op=True) for x, out in zip(xs, outs)]
    for k in (2, 0, 1):
        works[k].wait()
        gathers[k].wait()
        np.testing.assert_array_equal(xs[k], k + 1)
        np.testing.assert_array_equal(outs[k], k + 1)


@pytest.mark.parametrize("async_op", [False, True])
def test_staged_collectives_return_the_callers_arrays(make, async_op):
    b = make(host_staging="always", chunk_bytes=16)
    x = np.arange(10, dtype=np.float32)
    for work, want in [
        (b.all_reduce(x, ReduceOp.AVERAGE, async_op=async_op), x),
        (b.broadcast(x, 0, async_op=async_op), x),
    ]:
        assert work.wait() is want
    out = np.zeros(10, np.float32)
    assert b.all_gather(x, out, [10], async_op=async_op).wait() is out
    np.testing.assert_array_equal(out, x)
    out = np.zeros(10, np.float32)
    assert b.reduce_scatter(x, out, [10], ReduceOp.SUM, async_op=async_op).wait() is out
    np.testing.assert_array_equal(out, x)
    out = np.zeros(10, np.float32)
    assert b.gather(x, out, [10], 0, async_op=async_op).wait() is out
    np.testing.assert_array_equal(out, x)
    out = np.zeros(10, np.float32)
    assert b.scatter(x, out, [10], 0, async_op=async_op).wait() is out
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    b.close()


@pytest.mark.parametrize("chunk, pieces", [(1 << 20, 32), (3 << 20, 11), (0, 1)])
def test_big_buffers_are_reduced_in_pieces_of_the_chunk_size(make, chunk, pieces):
    """From PIECES_FROM_BYTES (and twice the chunk) on: one Allreduce per piece of at most
    ``chunk_bytes``; AVERAGE divides once, over the whole (a one-rank mean is the input)."""
    b = make(chunk_bytes=chunk)
    spy = b._comm = _Spy(b._comm)
    x = np.arange(PIECES_FROM_BYTES // 8, dtype=np.float64)
    b.all_reduce(x, ReduceOp.AVERAGE)
    assert len(spy.buffers) == pieces, [buf.nbytes for buf in spy.buffers]
    assert all(buf.nbytes <= (chunk or x.nbytes) for buf in spy.buffers)
    assert all(np.shares_memory(buf, x) for buf in spy.buffers)
    np.testing.assert_array_equal(x, np.arange(PIECES_FROM_BYTES // 8, dtype=np.float64))
    spy.buffers.clear()
    y = np.arange(PIECES_FROM_BYTES // 8 - 1, dtype=np.float64)  # one element short: whole
    b.all_reduce(y, ReduceOp.SUM)
    assert len(spy.buffers) == 1


def test_counts_that_do_not_fit_are_refused_before_mpi(make):
    b = make()
    x = np.zeros(4)
    with pytest.raises(ad.CollectiveMismatchError, match=r"sizes=\[4, 4\] must list 1 row counts"):
        b.all_gather(x, np.zeros(8), [4, 4])
    with pytest.raises(ad.InvalidBufferError,
                       match=r"out is float64\[5\] \(numpy\) but the result is float64\[4\]"):
        b.all_gather(x, np.zeros(5), [4])
    with pytest.raises(ad.InvalidBufferError, match="send has 4 elements"):
        b.reduce_scatter(x, np.zeros(3), [3], ReduceOp.SUM)
    with pytest.raises(ad.InvalidBufferError, match="the root .rank 0. must pass a recv buffer"):
        b.gather(x, None, [4], 0)
    with pytest.raises(ad.RankError, match="broadcast: src=1 is outside the group of 1 ranks"):
        b.broadcast(x, 1)
    b.close()


def test_unsupported_dtypes_and_ops_name_the_problem(make):
    b = make()
    with pytest.raises(ad.UnsupportedDTypeError, match="dtype int16 is not supported"):
        b.all_reduce(np.zeros(3, np.int16), ReduceOp.SUM)
    with pytest.raises(ad.UnsupportedDTypeError,
                       match="AVERAGE is not defined for int32; use SUM and divide"):
        b.all_reduce(np.zeros(3, np.int32), ReduceOp.AVERAGE)
    with pytest.raises(ad.UnsupportedDTypeError,
                       match="MAX is not defined for complex dtype complex64"):
        b.all_reduce(np.zeros(3, np.complex64), ReduceOp.MAX)
    b.close()


def test_create_world_backend_refuses_unknown_options(MPI):
    from axondist.backends import mpi

    with pytest.raises(TypeError, match=r"unknown option\(s\) \['chunks'\]"):
        mpi.create_world_backend(chunks=2, abort_on_exception=False)


def test_the_abort_hook_defers_to_the_previous_hook_in_a_one_rank_job(MPI, monkeypatch):
    from axondist.backends import mpi
    from axondist.backends.mpi import world

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: seen.append(exc[0]))
    monkeypatch.setattr(world, "_HOOK_INSTALLED", False)
    mpi.install_abort_hook()
    mpi.install_abort_hook()  # once per process
    sys.excepthook(KeyError, KeyError("x"), None)
    assert seen == [KeyError]
