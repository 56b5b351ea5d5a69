"""The benchmark's ``protocol`` column (``benchmarks/_pair_protocols.py``) does the work of
the call it stands for: under ``mpiexec -n 2`` each floor gives the collective's values
(NumPy's sum block, the rank-ordered concatenation, the root's values), on both sides of
the sizes where the table switches from riding to sending ahead, and exists exactly where
the table picks a two-rank ride or exchange. A floor that skipped a message or the local
work would time less than the call costs and fail here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI, mpi_world
from hypothesis import example, given
from hypothesis import strategies as st

from axondist.backends.mpi.choose import (
    EXCHANGE_RIDE_MAX_BYTES,
    PAIR_BROADCAST_MAX_BYTES,
    PAIR_GATHER_MAX_BYTES,
    Algorithm,
    choose,
)

pytestmark = pytest.mark.skipif(not UNDER_MPI or mpi_world().world_size != 2,
                                reason="the protocol floors are the two-rank MPI plans'")

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_protocols():
    spec = importlib.util.spec_from_file_location("bench_pair_protocols",
                                                  _BENCH / "_pair_protocols.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def protocols():
    return _load_protocols()


@pytest.fixture(scope="module")
def pair():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    yield comm, MPI
    comm.Free()


LIMITS = [EXCHANGE_RIDE_MAX_BYTES, PAIR_BROADCAST_MAX_BYTES, PAIR_GATHER_MAX_BYTES]


@given(op=st.sampled_from(["reduce_scatter", "all_gather", "broadcast"]),
       limit=st.sampled_from(LIMITS), offset=st.integers(-2, 2), seed=st.integers(0, 99))
@example(op="reduce_scatter", limit=2 * EXCHANGE_RIDE_MAX_BYTES, offset=0, seed=0)
@example(op="reduce_scatter", limit=2 * EXCHANGE_RIDE_MAX_BYTES, offset=1, seed=0)
@example(op="all_gather", limit=EXCHANGE_RIDE_MAX_BYTES, offset=1, seed=0)
@example(op="broadcast", limit=PAIR_BROADCAST_MAX_BYTES, offset=1, seed=0)
def test_each_floor_gives_the_calls_values(pair, protocols, op, limit, offset, seed):
    comm, mpi = pair
    world = mpi_world()
    rank = world.rank
    count = max(2, limit // 4 + 2 * offset)  # float32 values, even: blocks split evenly
    count += count % 2
    inputs = [np.random.default_rng([seed, r]).standard_normal(count).astype(np.float32)
              for r in range(2)]
    send = inputs[rank].copy()
    out = {"reduce_scatter": np.full(count // 2, np.nan, np.float32),
           "all_gather": np.full(2 * count, np.nan, np.float32)}.get(op)
    key = protocols.key_of(op, send, count)
    found = protocols.floor_of(op, key, world.backend.layout, comm, mpi, send, out)
    chosen = choose(key, world.backend.layout)
    assert (found is not None) == (chosen in (Algorithm.PAIR_RIDE, Algorithm.PAIR_EXCHANGE))
    if found is None:
        return
    run, free = found
    try:
        for _ in range(2):  # a second run reuses the persistent requests
            run()
    finally:
        free()
    halves = [slice(0, count // 2), slice(count // 2, count)]
    if op == "reduce_scatter":
        np.testing.assert_array_equal(out, (inputs[0] + inputs[1])[halves[rank]])
    elif op == "all_gather":
        np.testing.assert_array_equal(out, np.concatenate(inputs))
    else:
        np.testing.assert_array_equal(send, inputs[0])
