"""The array layer, Parameter and ReduceOp, without communication."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import _array
from axondist.ops import ReduceOp, combine_into

shape_lists = st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), max_size=6)


@given(shapes=shape_lists, dtype=st.sampled_from(["float32", "float64", "int64"]))
def test_flatten_unflatten_round_trip_with_views(shapes, dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    buffer, layout = ad.flatten(arrays, dtype=dtype)
    assert buffer.ndim == 1 and buffer.size == sum(a.size for a in arrays)
    views = ad.unflatten(buffer, layout)
    for a, v in zip(arrays, views):
        np.testing.assert_array_equal(a, v)
        assert v.base is buffer or v.size == 0 or np.shares_memory(v, buffer)
    if buffer.size:
        buffer[...] = 7
        assert all((v == 7).all() for v in views)


def test_flat_layout_refuses_wrong_sizes():
    layout = _array.FlatLayout.of([(2, 2), (3,)], np.float32)
    assert layout.numel == 7 and layout.offsets == (0, 4)
    with pytest.raises(ad.InvalidBufferError, match="buffer has 6 elements, layout needs 7"):
        layout.views(np.zeros(6, np.float32))
    with pytest.raises(ValueError, match=r"array of shape \(3, 2\)"):
        layout.pack([np.zeros((3, 2)), np.zeros(3)])


def test_namespace_is_numpy_for_host_arrays_and_rejects_unknown_dtypes():
    assert _array.namespace(np.ones(2)) is np
    assert _array.namespace() is np
    with pytest.raises(ad.UnsupportedDTypeError, match="dtype <U1 is not supported"):
        _array.check_dtype(np.array(["a"]).dtype, "test")
    assert _array.check_dtype("bfloat16" if _array.bfloat16 is None else _array.bfloat16, "t")


def test_dlpack_producers_come_in_without_copies():
    class Producer:  # any object speaking DLPack, as torch or jax tensors do
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    base = np.arange(6.0)
    got = ad.as_array(Producer(base))
    assert isinstance(got, np.ndarray) and np.shares_memory(got, base)
    assert ad.to_host(got) is got
    assert ad.as_array([1, 2]).tolist() == [1, 2]


def test_parameter_exposes_shape_dtype_size_and_models():
    p = ad.Parameter(np.zeros((2, 3), np.float32), name="w")
    assert p.shape == (2, 3) and p.dtype == np.float32 and p.size == 6 and p.grad is None
    assert "w" in repr(p)

    class Model:
        def parameters(self):
            return [p]

    assert ad.parameters_of(Model()) == [p]
    assert ad.parameters_of([p]) == [p]
    q = ad.Parameter(np.ones(1))
    assert ad.parameters_of({"bias": q}) == [q] and q.name == "bias"
    with pytest.raises(TypeError, match="model item 1 is a ndarray, not an axondist.Parameter"):
        ad.parameters_of([p, np.ones(2)])
    with pytest.raises(TypeError, match="expected a model"):
        ad.parameters_of(3)


@given(n=st.integers(1, 6), op=st.sampled_from(list(ReduceOp)))
def test_combine_into_reduces_in_list_order(n, op):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(5) for _ in range(n)]
    out = combine_into(np.empty(5), xs, op)
    want = {ReduceOp.SUM: np.sum, ReduceOp.AVERAGE: np.mean, ReduceOp.PRODUCT: np.prod,
            ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}[op](np.stack(xs), axis=0)
    np.testing.assert_allclose(out, want, rtol=1e-12)


def test_reduce_op_parses_names_and_integer_sums_wrap():
    assert ReduceOp.parse("mean", "all_reduce") is ReduceOp.AVERAGE
    assert ReduceOp.parse("MAX", "all_reduce") is ReduceOp.MAX
    big = np.array([2**62], dtype=np.int64)
    out = combine_into(big.copy(), [big, big, big], ReduceOp.SUM)  # documented wrap-around
    assert out[0] == np.int64(-(2**62))




@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       transpose=st.booleans())
def test_host_staging_helpers_copy_both_ways_on_host_arrays(shape, transpose):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    src = x.T if transpose else x  # a non-contiguous source too
    staged = _array.host_staging_buffer(src)
    assert staged.shape == src.shape and staged.dtype == src.dtype and staged is not src
    assert _array.copy_to_host(src, staged) is staged
    np.testing.assert_array_equal(staged, src)
    dst = np.zeros_like(src)
    _array.copy_from_host(dst, staged)
    np.testing.assert_array_equal(dst, src)
