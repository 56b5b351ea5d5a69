"""The weighted rings' arithmetic, without communication: ``weigh_and_add`` forms
``mine * weight + got * got_weight`` with each product rounded to the dtype, bit for bit
as a sender weighting its block before sending it and a receiver weighting its own
before adding would, in parts small enough to stay in cache; ``ScratchPool`` hands back
the buffer given back last, and keeps no more buffers than were out at once.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from axondist.backends._mpi_allreduce import _CACHED, ScratchPool, weigh_and_add

WEIGHTS = st.sampled_from([1.0, 0.5, 1 / 3, 0.3, 2.0, 0.0])


@settings(max_examples=40, deadline=None)
@given(numel=st.sampled_from([0, 1, 7, _CACHED - 1, _CACHED, _CACHED + 5, 3 * _CACHED + 11]),
       dtype=st.sampled_from(["float32", "float64", "float16", "int32", "int64"]),
       weight=WEIGHTS, got_weight=WEIGHTS, seed=st.integers(0, 2**20))
def test_weigh_and_add_is_two_rounded_products_and_a_sum(numel, dtype, weight, got_weight,
                                                           seed):
    rng = np.random.default_rng(seed)
    mine = (rng.standard_normal(numel) * 100).astype(dtype)
    got = (rng.standard_normal(numel) * 100).astype(dtype)
    # the reference: each rank weights its own values (rounded to the dtype), then the sum
    a, b = mine.copy(), got.copy()
    np.multiply(a, weight, out=a, casting="unsafe")
    np.multiply(b, got_weight, out=b, casting="unsafe")
    want = a + b
    weigh_and_add(mine, got, weight, got_weight)
    np.testing.assert_array_equal(mine, want)
    assert mine.dtype == np.dtype(dtype)


def test_unit_weights_add_only():
    mine, got = np.arange(5.0), np.full(5, 0.25)
    weigh_and_add(mine, got, 1.0, 1.0)
    np.testing.assert_array_equal(mine, np.arange(5.0) + 0.25)
    np.testing.assert_array_equal(got, np.full(5, 0.25))  # not scaled: weight 1


def test_scratch_pool_reuses_the_last_buffer_given_back():
    pool = ScratchPool()
    a = pool.take(100)
    b = pool.take(200)
    assert a.nbytes >= 100 and b.nbytes >= 200 and a is not b
    assert a.dtype == np.uint8 and not a.any()  # written once when made
    pool.give(a)
    pool.give(b)
    assert len(pool) == 2
    assert pool.take(50) is b  # the most recent that fits: still in cache
    bigger = pool.take(150)  # a is too small: a new buffer replaces it
    assert bigger is not a and bigger.nbytes >= 150 and len(pool) == 0
    pool.give(bigger)
    assert pool.take(100) is bigger
