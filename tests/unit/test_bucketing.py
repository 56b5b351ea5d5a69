"""Bucket plans and gradient buckets, without communication."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist import Parameter
from axondist._validate import check_real_gradient
from axondist.ddp import (
    CastCompression,
    GradientBucket,
    GradientSynchronizer,
    GradSyncStrategy,
    bucket_plan,
    resolve_compression,
    sum_hook,
)
from axondist.ddp.synchronizer import check_gradient
from axondist.errors import UnsupportedDTypeError
from axondist.process_group import World

SIZES = st.lists(st.integers(0, 300), max_size=40)
CAPS = st.integers(1, 400)


@given(sizes=SIZES, cap=CAPS, first=CAPS)
def test_bucket_plan_properties(sizes, cap, first):
    plan = bucket_plan(sizes, cap, first)
    # a partition of 0..n-1 into consecutive runs, in order, with no empty bucket
    assert [i for b in plan for i in b] == list(range(len(sizes)))
    assert all(b for b in plan)
    for k, b in enumerate(plan):
        limit = first if k == 0 else cap
        total = sum(sizes[i] for i in b)
        # within the cap, unless one oversized item stands alone
        assert total <= limit or (len(b) == 1 and sizes[b[0]] > limit)
        # greedy: the next bucket's first item did not fit in this one
        if k + 1 < len(plan):
            assert total + sizes[plan[k + 1][0]] > limit


@given(sizes=SIZES, cap=CAPS)
def test_bucket_plan_extremes(sizes, cap):
    # one huge cap: one bucket; caps of 1 byte with positive sizes: one item each
    assert bucket_plan(sizes, 10**9) == ([list(range(len(sizes)))] if sizes else [])
    positive = [s + 1 for s in sizes]
    assert bucket_plan(positive, 1) == [[i] for i in range(len(positive))]
    assert bucket_plan(sizes, cap) == bucket_plan(sizes, cap, cap)


def test_bucket_plan_first_bucket_is_small():
    mib = 1 << 20
    sizes = [mib // 2] * 6
    assert bucket_plan(sizes, 2 * mib, mib) == [[0, 1], [2, 3, 4, 5]]


def test_bucket_plan_errors():
    with pytest.raises(ValueError, match="caps must be > 0"):
        bucket_plan([1], 0)
    with pytest.raises(ValueError, match="caps must be > 0"):
        bucket_plan([1], 4, 0)
    with pytest.raises(ValueError, match=r"sizes_bytes\[1\] = -2"):
        bucket_plan([1, -2], 4)


@given(shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), max_size=8),
       capacity=st.integers(0, 120), seed=st.integers(0, 2**31))
def test_gradient_bucket_add_extract(shapes, capacity, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    bucket = GradientBucket(capacity)
    assert bucket.is_empty() and bucket.capacity == capacity
    kept = []
    for a in arrays:
        fits = bucket.size + a.size <= capacity
        assert bucket.add(a) is fits
        if fits:
            kept.append(a)
    assert bucket.size == sum(a.size for a in kept)
    assert bucket.is_full() == (bucket.size == capacity)
    assert bucket.is_empty() == (bucket.size == 0)
    np.testing.assert_array_equal(
        bucket.data, np.concatenate([a.ravel() for a in kept]) if kept else np.empty(0))
    out = bucket.extract()
    assert [o.shape for o in out] == [a.shape for a in kept] == bucket.shapes
    for o, a in zip(out, kept):
        np.testing.assert_array_equal(o, a)
        if o.size:
            assert np.shares_memory(o, bucket.buffer)  # views, not copies
    buffer = bucket.buffer
    bucket.clear()
    assert bucket.is_empty() and bucket.extract() == [] and bucket.buffer is buffer


def test_gradient_bucket_dtype_and_errors():
    b = GradientBucket(10)
    assert b.add(np.ones(3, dtype=np.float64))
    assert b.dtype == np.float64 and b.buffer.size == 10
    assert b.add(np.ones(2, dtype=np.float32))  # cast into the bucket's dtype
    assert b.data.dtype == np.float64
    with pytest.raises(TypeError, match="floating point"):
        b.add(np.ones(2, dtype=np.int32))
    assert not b.add(np.ones(6))
    with pytest.raises(ValueError, match="capacity"):
        GradientBucket(-1)
    view = GradientBucket(4, np.float16).reserve((2, 2))
    assert view.shape == (2, 2) and view.dtype == np.float16
    assert GradientBucket(3).reserve((4,)) is None
    assert "2 arrays" in repr(b)


def test_strategy_parse():
    assert GradSyncStrategy.parse("overlapped") is GradSyncStrategy.OVERLAPPED
    assert GradSyncStrategy.parse("NO_SYNC") is GradSyncStrategy.NO_SYNC
    assert GradSyncStrategy.parse(GradSyncStrategy.SYNCHRONOUS) is GradSyncStrategy.SYNCHRONOUS
    with pytest.raises(ValueError, match="SYNCHRONOUS, OVERLAPPED, NO_SYNC"):
        GradSyncStrategy.parse("fast")


def test_synchronizer_plan_groups_dtypes_in_reverse_order():
    params = [Parameter(np.zeros(4, dtype=np.float32)), Parameter(np.zeros(4)),
              Parameter(np.zeros(4, dtype=np.float32)), Parameter(np.zeros(4)),
              Parameter(np.zeros(4, dtype=np.float32))]
    sync = GradientSynchronizer(bucket_bytes=32, first_bucket_bytes=16)
    plan = sync.prepare(params)
    # float32: 4,2,0 (16 B each): first cap 16 B -> [4], then [2, 0]
    # float64: 3,1 (32 B each): [3], [1]; ordered by first index, descending
    assert plan == [[4], [3], [2, 0], [1]]
    for indices, state in zip(plan, sync.buckets):
        assert state.bucket.dtype == params[indices[0]].dtype
        assert state.bucket.capacity == sum(params[i].size for i in indices)
    for i in range(5):
        assert sync.slot(i).shape == (4,) and sync.slot(i).dtype == params[i].dtype
    with pytest.raises(TypeError, match="only floating-point"):
        GradientSynchronizer().prepare([np.zeros(3, dtype=np.int64)])


def test_synchronizer_shapes_and_element_caps():
    sync = GradientSynchronizer(GradSyncStrategy.NO_SYNC, 6, first_bucket_size=2)
    assert sync.prepare([(3,), (2,), (1,), (2, 2)], dtype=np.float64) == [[3], [2, 1, 0]]
    assert sync.slot(3).dtype == np.float64
    with pytest.raises(IndexError, match="out of range 0..3"):
        sync.slot(4)
    with pytest.raises(RuntimeError, match="prepare"):
        GradientSynchronizer().slot(0)
    with pytest.raises(ValueError, match="bucket_size must be > 0"):
        GradientSynchronizer(bucket_size=0)


def test_compression_resolution():
    assert resolve_compression(None) is sum_hook
    assert isinstance(resolve_compression("fp16"), CastCompression)
    assert resolve_compression("bf16").name == "bfloat16"

    def hook(flat, group, async_op):
        return None

    assert resolve_compression(hook) is hook
    with pytest.raises(ValueError, match="'fp16', 'bf16'"):
        resolve_compression("int8")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        CastCompression("float32")


@given(kind=st.sampled_from(["float16", "float32", "float64", "complex64", "complex128",
                             "int32"]), index=st.integers(0, 9))
def test_check_real_gradient_refuses_exactly_complex(kind, index):
    grad = np.zeros(2, dtype=kind)
    if np.dtype(kind).kind == "c":
        with pytest.raises(UnsupportedDTypeError, match=rf"f: the gradient of parameter "
                                                        rf"{index} \(w\) is {kind}; complex"):
            check_real_gradient(grad, "f", index, "w")
    else:
        check_real_gradient(grad, "f", index, "w")


def test_synchronizer_refuses_a_complex_gradient_instead_of_dropping_its_imaginary_part():
    sync = GradientSynchronizer()
    sync.prepare([(3,), (2,)], dtype=np.float64)
    sync.start(World.mock())
    with pytest.raises(TypeError, match="GradientSynchronizer.add_gradient: the gradient of "
                                        "parameter 1 is complex128"):
        sync.add_gradient(1, np.ones(2) * 1j)
    sync.add_gradient(1, np.ones(2))  # the slot is still free: the bad one was not taken
    sync.add_gradient(0, np.ones(3))
    assert [g.tolist() for g in sync.finish()] == [[1.0, 1.0, 1.0], [1.0, 1.0]]


@given(kind=st.sampled_from(["float16", "float32", "float64", "int8", "int64", "uint16", "bool",
                             "object", "U3", "S2", "datetime64[s]", "timedelta64[s]", "V4"]),
       index=st.integers(0, 9), name=st.sampled_from([None, "w"]))
def test_check_gradient_refuses_every_dtype_that_is_not_a_real_number(kind, index, name):
    grad = np.zeros(2, dtype=kind)
    if np.dtype(kind).kind in "biuf":
        check_gradient(grad, "f", index, name)
        return
    label = re.escape(f"parameter {index}" + (f" ({name})" if name else ""))
    dtype = re.escape(str(np.dtype(kind)))
    with pytest.raises(UnsupportedDTypeError, match=rf"^f: the gradient of {label} has dtype "
                                                    rf"{dtype}; a gradient must be an array of "
                                                    r"real numbers .* np\.asarray"):
        check_gradient(grad, "f", index, name)


@pytest.mark.parametrize("how", ["add_gradient", "accumulate"])
def test_synchronizer_refuses_an_object_gradient_before_touching_its_slot(how):
    sync = GradientSynchronizer()
    sync.prepare([(3,), (2,)], dtype=np.float64)
    sync.start(World.mock())
    bad = np.array([1.0, None], dtype=object)
    with pytest.raises(UnsupportedDTypeError, match=f"GradientSynchronizer.{how}: the gradient "
                                                    "of parameter 1 has dtype object"):
        getattr(sync, how)(1, bad)
    assert sync.missing() == [0, 1]  # nothing was taken
    sync.add_gradient(1, np.ones(2))
    sync.add_gradient(0, np.ones(3))
    assert [g.tolist() for g in sync.finish()] == [[1.0, 1.0, 1.0], [1.0, 1.0]]
