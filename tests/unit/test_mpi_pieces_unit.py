"""The MPI backend's pieces, means and reduce-scatters, without a multi-rank job.

Pure helpers (the chunk a group's layout picks, how a sum becomes a mean, the
``AXONDIST_PIECE_MB`` setting) need no MPI; the rest runs the backend on a
one-rank MPI world (``COMM_SELF``) with a spy on the communicator that
records which MPI calls each collective makes. Several ranks: see
``tests/world/test_mpi_pieces.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import ReduceOp, _array
from axondist.backends.mpi.choose import NODE_CHUNK_BYTES, Layout
from axondist.backends.mpi.transport import MPIOptions, mean_scaling, piece_bytes_from_env

# --- pure helpers -------------------------------------------------------------------------


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
    with pytest.raises(ValueError, match="AXONDIST_PIECE_MB='four' must be a number of MiB > 0"):
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


@pytest.fixture
def make(MPI: Any) -> Any:
    """``make(**options)``: a one-rank backend, closed after the test whatever happens."""
    from axondist.backends.mpi import MPIBackend

    made: list[Any] = []

    def new(**options: Any) -> Any:
        made.append(MPIBackend(MPI.COMM_SELF.Dup(), MPIOptions(**options)))
        return made[-1]

    yield new
    for b in made:
        if isinstance(b._comm, _Calls):
            b._comm = b._comm.comm
        b.close()


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


def test_one_rank_averages_with_one_all_reduce(make):
    b = make()
    spy = b._comm = _Calls(b._comm)
    x = np.arange(300_001, dtype=np.float32)  # 1.2 MB: a mean is the sum, then one division
    b.all_reduce(x, ReduceOp.AVERAGE)
    assert [c[0] for c in spy.calls] == ["Allreduce"]
    np.testing.assert_array_equal(x, np.arange(300_001, dtype=np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "complex64"])
def test_scaled_sum_weights_once_then_sums(make, dtype):
    b = make()
    spy = b._comm = _Calls(b._comm)
    dt = _array.dtype_named(dtype)
    x = np.arange(37).astype(dt)
    b.scaled_sum_blocking(x, 0.25)
    np.testing.assert_array_equal(x, np.multiply(np.arange(37).astype(dt), 0.25,
                                                 casting="unsafe").astype(dt))
    assert [c[0] for c in spy.calls] == ["Allreduce"]


def test_equal_counts_take_reduce_scatter_block(make):
    b = make()
    spy = b._comm = _Calls(b._comm)
    x, out = np.arange(6.0), np.zeros(6)
    assert b.reduce_scatter(x, out, [6], ReduceOp.AVERAGE).wait() is out
    assert b.reduce_scatter(x, out, [6], ReduceOp.SUM, async_op=True).wait() is out
    assert [c[0] for c in spy.calls] == ["Reduce_scatter_block", "Ireduce_scatter_block"]
    np.testing.assert_array_equal(out, x)


def test_reduce_scatter_refuses_a_result_of_another_dtype(make):
    b = make()
    with pytest.raises(ad.InvalidBufferError, match=r"reduce_scatter: out is float32\[4\] "
                                                    r"\(numpy\) but the result is float64\[4\]"):
        b.reduce_scatter(np.zeros(4), np.zeros(4, np.float32), [4], ReduceOp.SUM)
    with pytest.raises(ad.UnsupportedDTypeError, match="AVERAGE is not defined for int32"):
        b.reduce_scatter(np.zeros(4, np.int32), np.zeros(4, np.int32), [4], ReduceOp.AVERAGE)


@given(option=st.one_of(st.none(), st.integers(0, 1 << 30)), nodes=st.integers(1, 64),
       size=st.integers(1, 64))
def test_big_messages_go_in_pieces_on_one_node_and_whole_across_nodes(option, nodes, size):
    chunk = Layout(size, nodes, chunk_bytes=option).chunk
    if option is not None:
        assert chunk == option  # a set size holds for every group
    else:
        assert chunk == (NODE_CHUNK_BYTES if nodes == 1 else 0)
