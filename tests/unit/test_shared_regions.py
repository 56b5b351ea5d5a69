"""Shared regions (:mod:`axondist.backends.shared_regions`): memory found again from any
view of it, mapped through its locator, and gone (its descriptor closed, not found) with its
last array."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.backends import shared_regions
from axondist.backends.mpi.single_copy import why_not_permitted

needs_proc_fd = pytest.mark.skipif(why_not_permitted() is not None,
                                   reason=f"the host forbids mapping: {why_not_permitted()}")


@given(count=st.integers(1, 5000), dtype=st.sampled_from(["float32", "float64"]),
       data=st.data())
def test_a_view_of_a_region_is_located_at_its_offset(count, dtype, data):
    array = shared_regions.allocate(count * np.dtype(dtype).itemsize, dtype)
    assert array.shape == (count,) and array.dtype == dtype and not array.any()
    lo = data.draw(st.integers(0, count - 1))
    hi = data.draw(st.integers(lo + 1, count))
    locator, offset = shared_regions.locate(array[lo:hi])
    assert offset == lo * array.itemsize
    assert locator.pid == os.getpid() and locator.nbytes >= array.nbytes


def test_ordinary_and_strided_arrays_are_not_located():
    array = shared_regions.allocate(4096, np.float32)
    assert shared_regions.locate(np.zeros(1024, np.float32)) is None
    assert shared_regions.locate(array[::2]) is None  # not contiguous: no plan may use it


@needs_proc_fd
def test_a_mapping_through_the_locator_is_the_same_memory():
    array = shared_regions.allocate(8000, np.float64)
    locator, _ = shared_regions.locate(array)
    mapped = shared_regions.map_region(locator).view(np.float64)
    mapped[7] = 2.5
    array[9] = -1.0
    assert array[7] == 2.5 and mapped[9] == -1.0


@needs_proc_fd
def test_a_region_is_gone_with_its_last_array():
    array = shared_regions.allocate(4096, np.float32)
    view = array[10:20]
    locator, _ = shared_regions.locate(view)
    del array
    gc.collect()
    assert shared_regions.locate(view) is not None  # a view keeps the region
    del view
    gc.collect()
    assert shared_regions.region_array(locator) is None
    with pytest.raises(RuntimeError, match=r"shared region .* is gone: process \d+ ended or "
                                           r"freed it|reused its file descriptor"):
        shared_regions.map_region(locator)


@needs_proc_fd
def test_a_reused_descriptor_is_not_taken_for_the_region_it_named():
    array = shared_regions.allocate(4096, np.float32)
    locator, _ = shared_regions.locate(array)
    del array
    gc.collect()
    other = os.open(os.devnull, os.O_RDONLY)  # likely the freed number again
    try:
        stale = locator._replace(fd=other)
        with pytest.raises(RuntimeError, match="reused its file descriptor"):
            shared_regions.map_region(stale)
    finally:
        os.close(other)
