"""Two-rank calls whose data leaves ahead of the cross-rank check (reduce-scatter,
all-gather with sizes and broadcast up to the ahead limit, and the mean in halves): when
the other rank makes another call, both raise the mismatch naming it, the caller's buffers
hold what they held, and the next calls of every rank find no message of the refused one.
Under ``mpiexec -n 2`` only (the mock world sends nothing ahead).
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world, run_world

import axondist as ad

pytestmark = pytest.mark.skipif(not UNDER_MPI or mpi_world().world_size != 2,
                                reason="data sent ahead of the check is the two-rank MPI "
                                       "exchange's")

#: rank 0's call, by name, on ``x`` (its input, of ``2 * rows`` float32 values).
CALLS = {
    "reduce_scatter": lambda x: ad.reduce_scatter(x),
    "all_gather": lambda x: ad.all_gather(x, sizes=[x.shape[0]] * 2),
    "broadcast": lambda x: ad.broadcast(x, src=0),
}
#: rank 1's other call, and the words the error must hold.
OTHERS = {
    "all_reduce": (lambda x: ad.all_reduce(np.ones(8, np.float32)), "rank 1 called all_reduce"),
    "barrier": (lambda x: ad.barrier(), "rank 1 called barrier"),
    "shape": (lambda x: None, "ranks disagree on (shape|counts)"),
}


def _body(world: ad.World, call: str, other: str, rows: int) -> None:
    x = np.full(2 * rows, world.rank + 1.0, np.float32)
    before = x.copy()
    mine = CALLS[call]
    theirs, words = OTHERS[other]
    if other == "shape":
        theirs = lambda x: mine(np.ones(2 * rows + 2, np.float32))  # noqa: E731
    with pytest.raises(ad.CollectiveMismatchError, match=words):
        (mine if world.rank == 0 else theirs)(x)
    np.testing.assert_array_equal(x, before)
    # the same call on both ranks now: right values, and nothing left over from the refused
    got = mine(x)
    want = {"reduce_scatter": np.full(rows, 3.0, np.float32),
            "all_gather": np.repeat(np.array([1.0, 2.0], np.float32), 2 * rows),
            "broadcast": np.full(2 * rows, 1.0, np.float32)}[call]
    np.testing.assert_array_equal(got, want)
    y = np.full(5, world.rank + 1.0, np.float32)
    ad.all_reduce(y)
    np.testing.assert_array_equal(y, np.full(5, 3.0, np.float32))


@pytest.mark.parametrize("other", sorted(OTHERS))
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("rows", [3, 1024, 8192, 300_000])
def test_a_refused_exchange_leaves_no_message_behind(call, other, rows):
    run_world(_body, 2, call, other, rows)
