"""``out=`` of reduce_scatter: the block lands in the caller's array, and arrays that
cannot hold it are refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist.errors import InvalidBufferError


def _scatter_into(world: ad.World, rows: int, trailing: tuple[int, ...]) -> None:
    n = world.world_size
    x = np.arange(rows * int(np.prod(trailing, dtype=int)), dtype=np.float64)
    x = x.reshape((rows,) + trailing) + world.rank
    block = np.array_split(np.arange(rows), n)[world.rank].size
    out = np.full((block,) + trailing, np.nan)
    got = ad.reduce_scatter(x, out=out)
    assert got is out
    whole = sum(x - world.rank + r for r in range(n))
    np.testing.assert_array_equal(out, np.array_split(whole, n)[world.rank])


@given(n=st.integers(1, 4), rows=st.integers(0, 12), trailing=st.sampled_from([(), (3,)]))
def test_reduce_scatter_writes_the_block_into_out(n, rows, trailing):
    ad.spawn(_scatter_into, n, rows, trailing)


@pytest.mark.parametrize("bad, reason", [
    (np.zeros(3, np.float32), r"float32\[3\]"),
    (np.zeros(8, np.float64)[::2], r"shape \(4,\) is not C-contiguous"),
    (np.zeros(5), r"float64\[5\]"),
    ([0.0, 0.0], r"a list"),
])
def test_reduce_scatter_refuses_an_out_that_cannot_hold_the_block(bad, reason):
    def body(world: ad.World) -> None:
        with pytest.raises(InvalidBufferError, match=r"reduce_scatter: .*" + reason):
            ad.reduce_scatter(np.ones(4 * world.world_size), out=bad)

    ad.spawn(body, 2 if not isinstance(bad, np.ndarray) or bad.size != 3 else 1)


def test_reduce_scatter_refuses_a_read_only_out():
    def body(world: ad.World) -> None:
        out = np.zeros(4)
        out.flags.writeable = False
        with pytest.raises(InvalidBufferError, match="read-only"):
            ad.reduce_scatter(np.ones(4 * world.world_size), out=out)

    ad.spawn(body, 2)
