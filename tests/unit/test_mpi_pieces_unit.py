"""The MPI backend's fused pieces and lean reduce-scatter, without a multi-rank job.

Pure helpers (the piece size a group picks, how a sum becomes a mean, the
``AXONDIST_PIECE_MB`` setting) need no MPI; the rest runs the backend on a
one-rank MPI world (``COMM_SELF``) with a spy on the communicator that
records which MPI calls each collective makes. Several ranks: see
``tests/world/test_mpi_pieces.py``.
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
from axondist.backends._mpi_common import (
    NODE_CHUNK_BYTES,
    MPIOptions,
    block_counts,
    chunk_for,
    mean_scaling,
    piece_bounds,
    piece_bytes_from_env,
    piece_size,
)

# --- pure helpers -------------------------------------------------------------------------


@given(option=st.none() | st.integers(1, 1 << 30), chunk=st.integers(0, 1 << 30))
def test_piece_size_is_the_option_at_most_the_chunk(option, chunk):
    limit = chunk or sys.maxsize
    got = piece_size(option, chunk)
    assert 1 <= got <= limit
    assert got == (limit if option is None else min(option, limit))


def test_a_95_mib_model_takes_few_round_trips_unless_asked_for_small_pieces():
    nbytes = 95 << 20
    assert len(piece_bounds(nbytes // 4, 4, piece_size(None, 16 << 20))) == 6
    assert len(piece_bounds(nbytes // 4, 4, piece_size(512 << 10, 16 << 20))) == 190


@given(numel=st.integers(0, 10_000), n=st.integers(1, 64))
def test_block_counts_split_like_array_split_and_never_overlap_the_first(numel, n):
    counts = block_counts(numel, n)
    assert counts == [len(b) for b in np.array_split(np.arange(numel), n)]
    starts = np.cumsum([0] + counts[:-1])
    assert all(start >= counts[0] for start in starts[1:])  # the scaled move never overlaps


@given(n=st.integers(1, 64))
def test_mean_scaling_multiplies_only_by_exact_reciprocals(n):
    how, by = mean_scaling(n)
    if n & (n - 1) == 0:
        assert how == "multiply" and by * n == 1.0
    else:
        assert (how, by) == ("divide", float(n))


@given(k=st.integers(0, 6), dtype=st.sampled_from(["float16", "float32", "float64"]),
       values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=16), min_size=1,
                       max_size=40))
def test_multiplying_by_a_power_of_two_reciprocal_equals_dividing(k, dtype, values):
    """The reason mean_scaling may multiply: bit for bit the same, subnormals included."""
    x = np.array(values, dtype=dtype)
    n = 2 ** k
    how, by = mean_scaling(n)
    got = getattr(np, how)(x, by, casting="unsafe")
    np.testing.assert_array_equal(got, np.divide(x, n))


@pytest.mark.parametrize("text, want", [("0.5", 512 << 10), ("16", 16 << 20), ("1e-9", 1),
                                        (" 2 ", 2 << 20)])
def test_piece_mb_reads_mib(text, want):
    assert piece_bytes_from_env(text) == want


@pytest.mark.parametrize("text, match", [
    ("abc", r"AXONDIST_PIECE_MB='abc' is not a number; set it to a size in MiB > 0"),
    ("0", r"AXONDIST_PIECE_MB=0.0 must be a finite number > 0"),
    ("-1", r"AXONDIST_PIECE_MB=-1.0 must be a finite number > 0"),
    ("nan", r"AXONDIST_PIECE_MB=nan must be a finite number > 0"),
    ("inf", r"AXONDIST_PIECE_MB=inf must be a finite number > 0"),
])
def test_bad_piece_mb_is_refused_naming_the_variable(text, match):
    with pytest.raises(ValueError, match=match):
        piece_bytes_from_env(text)


def test_options_read_the_piece_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("AXONDIST_PIECE_MB", raising=False)
    assert MPIOptions.from_env().piece_bytes is None
    monkeypatch.setenv("AXONDIST_PIECE_MB", "")
    assert MPIOptions.from_env().piece_bytes is None  # empty: unset
    monkeypatch.setenv("AXONDIST_PIECE_MB", "4")
    assert MPIOptions.from_env().piece_bytes == 4 << 20
    assert MPIOptions.from_env(piece_bytes=100).piece_bytes == 100  # arguments win
    monkeypatch.setenv("AXONDIST_PIECE_MB", "four")
    with pytest.raises(ValueError, match="AXONDIST_PIECE_MB='four' is not a number"):
        MPIOptions.from_env()


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "1"])
def test_options_refuse_a_bad_piece_size(bad):
    with pytest.raises(ValueError, match=r"piece_bytes must be an int >= 1 or None .the size "
                                         rf"picked by the layout., got {bad!r}"):
        MPIOptions(piece_bytes=bad)


# --- one-rank MPI world -------------------------------------------------------------------

@pytest.fixture(scope="module")
def MPI() -> Any:
    return pytest.importorskip("mpi4py.MPI")


def _backend(MPI: Any, **options: Any) -> Any:
    from axondist.backends.mpi import MPIBackend

    return MPIBackend(MPI.COMM_SELF.Dup(), MPIOptions(**options))


class _Calls:
    """A communicator proxy that records each MPI call's name and first buffer's bytes."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.calls = comm, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.comm, name)
        if not name[:1].isupper() or not callable(method):
            return method

        def call(*args: Any) -> Any:
            spec = args[0] if not isinstance(args[0], list) else args[0][0]
            if not isinstance(spec, np.ndarray):  # IN_PLACE: the data is the next argument
                spec = args[1][0] if isinstance(args[1], list) else args[1]
            self.calls.append((name, spec.nbytes))
            return method(*args)
        return call


@pytest.mark.parametrize("piece, chunk", [(64, 0), (64, 1 << 20), (1 << 20, 64), (None, 0)])
def test_weighted_sums_run_in_pieces_of_the_piece_size_at_most_the_chunk(MPI, piece, chunk):
    b = _backend(MPI, piece_bytes=piece, chunk_bytes=chunk)
    spy = b._comm = _Calls(b._comm)
    x = np.arange(101, dtype=np.float64)  # 808 bytes
    b.scaled_sum_blocking(x, 0.5)
    size = piece_size(piece, chunk)
    assert [c[0] for c in spy.calls] == ["Allreduce"] * len(piece_bounds(101, 8, size))
    assert all(c[1] <= size for c in spy.calls)
    np.testing.assert_array_equal(x, np.arange(101.0) / 2)
    spy.comm.Free()


def test_one_rank_averages_with_one_all_reduce_whatever_the_size(MPI):
    b = _backend(MPI)
    spy = b._comm = _Calls(b._comm)
    x = np.arange(300_001, dtype=np.float32)  # above the size where n > 1 ranks use blocks
    b.all_reduce(x, ReduceOp.AVERAGE)
    assert [c[0] for c in spy.calls] == ["Allreduce"]
    np.testing.assert_array_equal(x, np.arange(300_001, dtype=np.float32))
    spy.comm.Free()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64"])
def test_scaled_sum_weights_every_piece_once(MPI, dtype):
    b = _backend(MPI, piece_bytes=16)
    spy = b._comm = _Calls(b._comm)
    dt = _array.dtype_named(dtype)
    x = np.arange(37).astype(dt)
    b.scaled_sum_blocking(x, 0.25)
    np.testing.assert_array_equal(x, np.multiply(np.arange(37).astype(dt), 0.25,
                                                 casting="unsafe").astype(dt))
    assert len(spy.calls) == len(piece_bounds(37, dt.itemsize, 16))
    spy.comm.Free()


def test_equal_counts_take_reduce_scatter_block(MPI):
    b = _backend(MPI)
    spy = b._comm = _Calls(b._comm)
    x, out = np.arange(6.0), np.zeros(6)
    b.reduce_scatter_blocking(x, out, [6], ReduceOp.AVERAGE)
    assert b.reduce_scatter(x, out, [6], ReduceOp.SUM).wait() is out
    assert [c[0] for c in spy.calls] == ["Reduce_scatter_block"] * 2
    np.testing.assert_array_equal(out, x)
    spy.comm.Free()


def test_reduce_scatter_refuses_a_result_of_another_dtype(MPI):
    b = _backend(MPI)
    with pytest.raises(ad.InvalidBufferError, match="reduce_scatter: recv has dtype float32 "
                                                    "but send has float64; pass a recv of"):
        b.reduce_scatter_blocking(np.zeros(4), np.zeros(4, np.float32), [4], ReduceOp.SUM)
    with pytest.raises(ad.UnsupportedDTypeError, match="AVERAGE is not defined for dtype int32"):
        b.reduce_scatter(np.zeros(4, np.int32), np.zeros(4, np.int32), [4], ReduceOp.AVERAGE)
    b.close()


@given(option=st.one_of(st.none(), st.integers(0, 1 << 30)), nodes=st.integers(1, 64))
def test_big_messages_go_in_pieces_on_one_node_and_whole_across_nodes(option, nodes):
    chunk = chunk_for(option, nodes)
    if option is not None:
        assert chunk == option  # a set size holds for every group
    else:
        assert chunk == (NODE_CHUNK_BYTES if nodes == 1 else 0)
