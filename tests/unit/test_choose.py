"""The MPI backend's algorithm table, read without MPI.

Keys are built by hand (collective, dtype, shape, array library, reduce op, async) and
layouts too (ranks, nodes, checks, chunk size); hypothesis draws sizes on and around
every threshold. Each rule applies exactly where its boundaries say, the table is total
(its last row matches every call), and every algorithm it can choose for a collective
has a plan class in :data:`axondist.backends.mpi.backend.PLANS`. Nothing here starts
MPI: a test in a fresh interpreter proves that reading the table imports no mpi4py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist import _array
from axondist.backends.mpi import guard
from axondist.backends.mpi.backend import PLANS, UNSIZED_GATHER_PLANS
from axondist.backends.mpi.choose import (
    EXCHANGE_RIDE_MAX_BYTES,
    HALVES_DTYPES,
    HALVES_FROM_BYTES,
    NODE_CHUNK_BYTES,
    PAIR_BROADCAST_MAX_BYTES,
    PAIR_GATHER_MAX_BYTES,
    PIECES_FROM_BYTES,
    RIDE_DTYPES,
    RIDE_MAX_BYTES,
    RIDE_OPS,
    TABLE,
    Algorithm,
    Layout,
    choose,
    nbytes,
)
from axondist.backends.plan import CallKey

#: The collectives that run as prepared calls (every one builds a CallKey).
PLANNED = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce")
#: Those and names the table has never heard of: the last row still takes them.
COLLECTIVES = PLANNED + ("gather", "scatter", "all_to_all", "barrier")
OPS = ("SUM", "AVERAGE", "MIN", "MAX", "PRODUCT")
DTYPES = tuple(_array.SUPPORTED_DTYPES)


def _near(limit: int) -> st.SearchStrategy[int]:
    """Byte counts on and a little around ``limit``."""
    return st.integers(max(0, limit - 64), limit + 64)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    world_size = draw(st.integers(1, 64))
    nodes = draw(st.integers(1, min(world_size, 8)))
    chunk = draw(st.none() | st.just(0) | st.sampled_from([NODE_CHUNK_BYTES, 4 << 20, 8 << 20])
                 | st.integers(1, 64 << 20))
    return Layout(world_size, nodes, draw(st.booleans()), chunk)


@st.composite
def keys(draw: st.DrawFn, layout: Layout | None = None) -> CallKey:
    """A call's key, its size drawn log-uniformly or on a threshold (of ``layout``'s too)."""
    collective = draw(st.sampled_from(COLLECTIVES))
    dtype = draw(st.sampled_from(DTYPES))
    limits = [RIDE_MAX_BYTES, PIECES_FROM_BYTES, PAIR_BROADCAST_MAX_BYTES,
              PAIR_GATHER_MAX_BYTES, HALVES_FROM_BYTES]
    if layout is not None and layout.chunk:
        limits.append(2 * layout.chunk)
    target = draw(st.one_of(st.integers(0, 40).map(lambda e: int(2 ** (e * 0.7)) - 1),
                            st.sampled_from(limits).flatmap(_near)))
    numel = max(0, target // dtype.itemsize + draw(st.integers(-1, 1)))
    shape: tuple[int, ...] = (numel,)
    if numel == 1 and draw(st.booleans()):
        shape = ()
    elif numel % 4 == 0 and numel and draw(st.booleans()):
        shape = (numel // 4, 2, 2)
    reduction = collective in ("all_reduce", "reduce_scatter", "reduce")
    op = draw(st.sampled_from(OPS)) if reduction else None
    root = draw(st.integers(0, 3)) if collective in ("broadcast", "reduce") else None
    counts = None
    if collective == "all_gather" and shape and draw(st.booleans()):
        counts = (shape[0],) * (layout.world_size if layout is not None else 2)
    return CallKey(collective, dtype, shape, draw(st.sampled_from(["numpy", "cupy"])),
                   reduce_op=op, root=root, counts=counts, async_op=draw(st.booleans()))


def _rides(key: CallKey, layout: Layout) -> bool:
    """The riding rule, spelled out: two ranks, checks on, blocking NumPy all-reduce of
    at most RIDE_MAX_BYTES in a ride dtype and op."""
    return (key.collective == "all_reduce" and layout.world_size == 2 and layout.checks
            and not key.async_op and key.library == "numpy" and key.dtype in RIDE_DTYPES
            and key.reduce_op in RIDE_OPS and nbytes(key) <= RIDE_MAX_BYTES)


def _exchange_rides(key: CallKey, layout: Layout) -> bool:
    """The riding rule of the other collectives: two checked ranks (on any nodes), blocking
    NumPy; a reduce-scatter in a ride dtype and op whose half input is at most
    EXCHANGE_RIDE_MAX_BYTES, an all-gather with sizes whose largest block is at most that."""
    row_bytes = key.dtype.itemsize * int(np.prod(key.shape[1:]))
    if key.collective == "reduce_scatter":
        fits = (key.dtype in RIDE_DTYPES and key.reduce_op in RIDE_OPS
                and nbytes(key) // 2 <= EXCHANGE_RIDE_MAX_BYTES)
    else:
        fits = (key.collective == "all_gather" and key.counts is not None
                and max(key.counts) * row_bytes <= EXCHANGE_RIDE_MAX_BYTES)
    return (fits and layout.world_size == 2 and layout.checks and not key.async_op
            and key.library == "numpy")


def _in_pieces(key: CallKey, layout: Layout) -> bool:
    """The pieces rule: blocking all-reduce of at least PIECES_FROM_BYTES and twice the
    chunk, where the layout cuts pieces at all."""
    return (key.collective == "all_reduce" and not key.async_op
            and layout.chunk > 0 and nbytes(key) >= max(PIECES_FROM_BYTES, 2 * layout.chunk))


def _halves(key: CallKey, layout: Layout) -> bool:
    """The halves rule: a blocking float32/64 NumPy AVERAGE all-reduce of two checked
    ranks on one node, from HALVES_FROM_BYTES up to (not including) PIECES_FROM_BYTES."""
    return (key.collective == "all_reduce" and key.reduce_op == "AVERAGE"
            and layout.world_size == 2 and layout.nodes == 1 and layout.checks
            and not key.async_op and key.library == "numpy" and key.dtype in HALVES_DTYPES
            and HALVES_FROM_BYTES <= nbytes(key) < PIECES_FROM_BYTES)


def _exchanges(key: CallKey, layout: Layout) -> bool:
    """The pair-exchange rule: two checked ranks on one node, blocking NumPy; a
    reduce-scatter in a ride dtype and op at any size, an all-gather with sizes up to
    PAIR_GATHER_MAX_BYTES, one without sizes at any size (the plan tells the blocks in the
    check), a broadcast up to PAIR_BROADCAST_MAX_BYTES."""
    size = nbytes(key)
    if key.collective == "reduce_scatter":
        fits = key.dtype in RIDE_DTYPES and key.reduce_op in RIDE_OPS
    elif key.collective == "all_gather":  # the largest rank's block: every rank alike
        row_bytes = key.dtype.itemsize * int(np.prod(key.shape[1:]))
        fits = key.counts is None or max(key.counts) * row_bytes <= PAIR_GATHER_MAX_BYTES
    else:
        fits = key.collective == "broadcast" and size <= PAIR_BROADCAST_MAX_BYTES
    return (fits and layout.world_size == 2 and layout.nodes == 1 and layout.checks
            and not key.async_op and key.library == "numpy")


def _point_to_point(key: CallKey, layout: Layout) -> bool:
    """The all-to-all rule: blocking, host memory, the check on (whatever the counts)."""
    return (key.collective == "all_to_all" and layout.world_size > 1 and layout.checks
            and not key.async_op and key.library == "numpy")


def _expected(key: CallKey, layout: Layout) -> Algorithm:
    if _point_to_point(key, layout):
        return Algorithm.POINT_TO_POINT
    if _rides(key, layout) or _exchange_rides(key, layout):
        return Algorithm.PAIR_RIDE
    if _halves(key, layout):
        return Algorithm.PAIR_HALVES
    if _in_pieces(key, layout):
        return Algorithm.PIECES
    if _exchanges(key, layout):
        return Algorithm.PAIR_EXCHANGE
    return Algorithm.MPI


@given(data=st.data(), layout=layouts())
def test_each_call_takes_the_first_rule_whose_boundaries_it_meets(data, layout):
    key = data.draw(keys(layout))
    assert choose(key, layout) is _expected(key, layout), (key, layout, nbytes(key))


@given(data=st.data(), layout=layouts())
def test_the_table_is_total_its_last_row_takes_every_call(data, layout):
    key = data.draw(keys(layout))
    last = TABLE[-1]
    assert last.algorithm is Algorithm.MPI and last.applies(key, layout)
    assert choose(key, layout) in set(Algorithm)


@given(data=st.data(), layout=layouts())
def test_every_choice_for_a_planned_collective_has_a_plan_class(data, layout):
    key = data.draw(keys(layout).filter(lambda k: k.collective in PLANNED))
    if key.collective == "all_gather" and key.counts is None:
        assert choose(key, layout) in UNSIZED_GATHER_PLANS
    else:
        assert (key.collective, choose(key, layout)) in PLANS


def test_every_rules_algorithm_has_a_plan_for_the_collectives_it_applies_to():
    """Each rule, tried on every planned collective at sizes on its thresholds: wherever
    it applies, the backend has that collective's plan class for its algorithm."""
    layout = Layout(2)
    applied = set()
    for rule in TABLE:
        for collective, op in [(c, o) for c in PLANNED for o in ("SUM", "AVERAGE")]:
            for size in (4, RIDE_MAX_BYTES, HALVES_FROM_BYTES,
                         PIECES_FROM_BYTES, 2 * PIECES_FROM_BYTES):
                key = CallKey(collective, np.dtype(np.float32), (size // 4,), "numpy",
                              reduce_op=op if collective in ("all_reduce", "reduce_scatter",
                                                             "reduce") else None,
                              root=0 if collective in ("broadcast", "reduce") else None,
                              counts=(size // 4,) * 2 if collective == "all_gather" else None)
                if rule.applies(key, layout):
                    applied.add((collective, rule.algorithm))
    assert applied == {("all_reduce", Algorithm.PAIR_RIDE), ("all_reduce", Algorithm.PIECES),
                       ("all_reduce", Algorithm.PAIR_HALVES),
                       ("all_gather", Algorithm.PAIR_EXCHANGE),
                       ("broadcast", Algorithm.PAIR_EXCHANGE),
                       ("reduce_scatter", Algorithm.PAIR_EXCHANGE),
                       ("all_gather", Algorithm.PAIR_RIDE),
                       ("reduce_scatter", Algorithm.PAIR_RIDE)} | {
                           (c, Algorithm.MPI) for c in PLANNED}
    assert applied <= set(PLANS)
    assert {algorithm for _, algorithm in PLANS} == set(Algorithm)  # no algorithm unplanned


# --- each rule's boundaries, one at a time -------------------------------------------------

def _all_reduce(dtype: str, numel: int, **fields) -> CallKey:
    return CallKey("all_reduce", np.dtype(dtype), (numel,), "numpy", reduce_op="SUM")._replace(
        **fields)


@pytest.mark.parametrize("dtype", sorted(str(d) for d in RIDE_DTYPES))
def test_riding_ends_at_ride_max_bytes(dtype):
    numel = RIDE_MAX_BYTES // np.dtype(dtype).itemsize
    pair = Layout(2)
    assert choose(_all_reduce(dtype, numel), pair) is Algorithm.PAIR_RIDE
    assert choose(_all_reduce(dtype, numel + 1), pair) is Algorithm.MPI
    assert choose(_all_reduce(dtype, 0), pair) is Algorithm.PAIR_RIDE
    assert choose(_all_reduce(dtype, 1)._replace(shape=()), pair) is Algorithm.PAIR_RIDE


@pytest.mark.parametrize("change, why", [
    ({"world_size": 1}, "one rank"), ({"world_size": 3}, "three ranks"),
    ({"checks": False}, "no check to ride"), ({"nodes": 2, "world_size": 2}, None),
])
def test_riding_needs_two_ranks_and_the_check(change, why):
    layout = Layout(**{"world_size": 2, **change})
    key = _all_reduce("float32", 8)
    want = Algorithm.PAIR_RIDE if why is None else Algorithm.MPI  # two hosts ride too
    assert choose(key, layout) is want


@pytest.mark.parametrize("field, value", [
    ("async_op", True), ("library", "cupy"), ("collective", "reduce"),
    ("collective", "broadcast"), ("collective", "reduce_scatter"), ("collective", "all_gather"),
])
def test_riding_is_for_blocking_numpy_calls_that_need_no_root_or_sizes_exchanged(field, value):
    """Small two-rank reduce-scatters ride with the check as all-reduces do, and
    broadcasts and all-gathers without sizes exchange point to point (their data ahead of
    the check, an all-gather's sizes told in it); a reduce, a non-blocking or a device call
    is MPI's."""
    key = _all_reduce("float32", 8)._replace(**{field: value})
    if value == "broadcast":
        key = key._replace(reduce_op=None, root=0)
    want = {"reduce_scatter": Algorithm.PAIR_RIDE, "broadcast": Algorithm.PAIR_EXCHANGE,
            "all_gather": Algorithm.PAIR_EXCHANGE}.get(value, Algorithm.MPI)
    assert choose(key, Layout(2)) is want


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_other_collectives_ride_up_to_their_limit_then_exchange_on_one_node(collective):
    def key(numel: int) -> CallKey:
        return CallKey(collective, np.dtype(np.float32), (numel,), "numpy",
                       reduce_op="SUM" if collective == "reduce_scatter" else None,
                       counts=(numel, 1) if collective == "all_gather" else None)
    # the data sent: half a reduce-scatter's input, an all-gather's largest block
    limit = EXCHANGE_RIDE_MAX_BYTES // 4 * (2 if collective == "reduce_scatter" else 1)
    assert choose(key(limit), Layout(2)) is Algorithm.PAIR_RIDE
    assert choose(key(limit), Layout(2, nodes=2)) is Algorithm.PAIR_RIDE
    assert choose(key(limit + 2), Layout(2)) is Algorithm.PAIR_EXCHANGE
    assert choose(key(limit), Layout(3)) is Algorithm.MPI
    assert choose(key(limit), Layout(2, checks=False)) is Algorithm.MPI


def test_riding_dtypes_and_ops_are_those_numpy_combines_as_mpi_does():
    pair = Layout(2)
    for dtype in DTYPES:
        for op in OPS:
            key = CallKey("all_reduce", dtype, (4,), "numpy", reduce_op=op)
            rides = dtype in RIDE_DTYPES and op in RIDE_OPS
            assert (choose(key, pair) is Algorithm.PAIR_RIDE) == rides, (dtype, op)
    assert RIDE_DTYPES == {np.dtype(t) for t in ("float32", "float64", "int32", "int64")}
    assert RIDE_OPS == set(OPS)


@pytest.mark.parametrize("dtype", sorted(str(d) for d in HALVES_DTYPES))
def test_halves_take_two_rank_means_from_halves_from_bytes_to_pieces(dtype):
    itemsize = np.dtype(dtype).itemsize
    pair = Layout(2)
    mean = _all_reduce(dtype, HALVES_FROM_BYTES // itemsize)._replace(reduce_op="AVERAGE")
    assert choose(mean, pair) is Algorithm.PAIR_HALVES
    assert choose(mean._replace(shape=(HALVES_FROM_BYTES // itemsize - 1,)), pair) \
        is Algorithm.MPI
    last = mean._replace(shape=(PIECES_FROM_BYTES // itemsize - 1,))
    assert choose(last, pair) is Algorithm.PAIR_HALVES
    assert choose(last._replace(shape=(PIECES_FROM_BYTES // itemsize,)), pair) \
        is Algorithm.PIECES
    assert choose(mean._replace(reduce_op="SUM"), pair) is Algorithm.MPI  # a sum: MPI's


@pytest.mark.parametrize("change", [
    {"world_size": 3}, {"checks": False}, {"nodes": 2}, {"async_op": True},
    {"library": "cupy"}, {"dtype": np.dtype("float16")}, {"dtype": np.dtype("int64")},
])
def test_halves_need_two_checked_ranks_on_one_node_and_a_blocking_numpy_float(change):
    layout = Layout(**{"world_size": 2, **{k: v for k, v in change.items()
                                           if k in ("world_size", "checks", "nodes")}})
    key = _all_reduce("float32", (1 << 20) // 4)._replace(
        reduce_op="AVERAGE", **{k: v for k, v in change.items()
                                if k in ("async_op", "library", "dtype")})
    assert choose(key, layout) is Algorithm.MPI


def test_a_riding_message_fits_the_checks_receive_buffer():
    assert guard.RIDE_ROOM >= RIDE_MAX_BYTES


@pytest.mark.parametrize("collective", ["all_reduce"])
@pytest.mark.parametrize("chunk, limit", [
    (None, PIECES_FROM_BYTES), (1 << 20, PIECES_FROM_BYTES),
    (PIECES_FROM_BYTES, 2 * PIECES_FROM_BYTES), (24 << 20, 48 << 20),
])
def test_pieces_start_at_pieces_from_bytes_and_twice_the_chunk(collective, chunk, limit):
    layout = Layout(3, 1, True, chunk)
    for dtype in ("float32", "float64", "int8", "float16"):
        numel = limit // np.dtype(dtype).itemsize
        key = CallKey(collective, np.dtype(dtype), (numel,), "numpy",
                      reduce_op="SUM" if collective == "all_reduce" else None,
                      root=0 if collective == "broadcast" else None)
        assert choose(key, layout) is Algorithm.PIECES
        assert choose(key._replace(shape=(numel - 1,)), layout) is Algorithm.MPI
        assert choose(key._replace(async_op=True), layout) is Algorithm.MPI


def test_pieces_on_one_node_only_unless_a_chunk_is_set():
    key = _all_reduce("float32", PIECES_FROM_BYTES)
    assert choose(key, Layout(4, nodes=1)) is Algorithm.PIECES
    assert choose(key, Layout(4, nodes=2)) is Algorithm.MPI  # whole across nodes
    assert choose(key, Layout(4, nodes=1, chunk_bytes=0)) is Algorithm.MPI  # 0: never
    assert choose(key, Layout(4, nodes=2, chunk_bytes=1 << 20)) is Algorithm.PIECES
    assert Layout(4, nodes=1).chunk == NODE_CHUNK_BYTES and Layout(4, nodes=3).chunk == 0


def test_big_two_rank_all_reduces_go_in_pieces_not_riding():
    key = _all_reduce("float64", PIECES_FROM_BYTES // 8)
    assert choose(key, Layout(2)) is Algorithm.PIECES
    assert choose(key, Layout(2, checks=False)) is Algorithm.PIECES


def test_reduce_is_mpis_at_every_size_and_broadcast_beyond_the_pair_exchange():
    for size in (0, 8, RIDE_MAX_BYTES, PIECES_FROM_BYTES, 4 * PIECES_FROM_BYTES):
        key = CallKey("reduce", np.dtype(np.float32), (size // 4,), "numpy", reduce_op="SUM",
                      root=0)
        for layout in (Layout(1), Layout(2), Layout(5)):
            assert choose(key, layout) is Algorithm.MPI
    for size in (PAIR_BROADCAST_MAX_BYTES + 4, PIECES_FROM_BYTES):
        key = CallKey("broadcast", np.dtype(np.float32), (size // 4,), "numpy", root=1)
        for layout in (Layout(1), Layout(2), Layout(5)):
            assert choose(key, layout) is Algorithm.MPI


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "broadcast"])
def test_two_rank_gathers_scatters_and_broadcasts_go_point_to_point_where_measured(collective):
    def key(size: int, **fields) -> CallKey:
        made = CallKey(collective, np.dtype(np.float32), (size // 4,), "numpy",
                       reduce_op="SUM" if collective == "reduce_scatter" else None,
                       root=0 if collective == "broadcast" else None,
                       counts=(size // 4,) * 2 if collective == "all_gather" else None)
        return made._replace(**fields)

    pair, above_ride = Layout(2), 2 * EXCHANGE_RIDE_MAX_BYTES + 8
    small = Algorithm.PAIR_EXCHANGE if collective == "broadcast" else Algorithm.PAIR_RIDE
    for size in (0, 4, EXCHANGE_RIDE_MAX_BYTES):  # small: in the check's message
        assert choose(key(size), pair) is small
    for size in (above_ride, PAIR_BROADCAST_MAX_BYTES):
        assert choose(key(size), pair) is Algorithm.PAIR_EXCHANGE
    big = PAIR_GATHER_MAX_BYTES + 4
    want_big = Algorithm.PAIR_EXCHANGE if collective == "reduce_scatter" else Algorithm.MPI
    assert choose(key(big), pair) is want_big
    for other in (Layout(3), Layout(2, checks=False), Layout(2, nodes=2)):
        assert choose(key(above_ride), other) is Algorithm.MPI
    rides_across_nodes = small is Algorithm.PAIR_RIDE  # the exchange stays on one node
    assert choose(key(4 << 10), Layout(2, nodes=2)) is (
        Algorithm.PAIR_RIDE if rides_across_nodes else Algorithm.MPI)
    for size in (4 << 10, above_ride):
        assert choose(key(size, async_op=True), pair) is Algorithm.MPI
        assert choose(key(size, library="cupy"), pair) is Algorithm.MPI
        if collective == "all_gather":  # without sizes: the exchange, whatever the size
            assert choose(key(size, counts=None), pair) is Algorithm.PAIR_EXCHANGE
            assert choose(key(size, counts=None, async_op=True), pair) is Algorithm.MPI
            for other in (Layout(3), Layout(2, checks=False), Layout(2, nodes=2)):
                assert choose(key(size, counts=None), other) is Algorithm.MPI
    if collective == "all_gather":
        assert choose(key(big, counts=None), pair) is Algorithm.PAIR_EXCHANGE


@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64, np.int8]),
       layout=st.sampled_from([Layout(2), Layout(3), Layout(2, nodes=2)]))
def test_no_ranks_own_block_changes_an_all_gathers_choice(data, dtype, layout):
    """Property: the keys of one all-gather differ between ranks only in the leading size
    (each rank's own rows, drawn about the pair exchange's limit); every rank's key
    chooses the same algorithm."""
    limit = PAIR_GATHER_MAX_BYTES // (2 * np.dtype(dtype).itemsize)  # rows of two values
    rows = st.sampled_from([0, 1, limit - 1, limit, limit + 1, 3 * limit])
    counts = tuple(data.draw(st.lists(rows, min_size=layout.world_size,
                                      max_size=layout.world_size)))
    keys_ = [CallKey("all_gather", np.dtype(dtype), (r, 2), "numpy", counts=counts)
             for r in counts]
    assert len({choose(key, layout) for key in keys_}) == 1, (counts, layout)


def test_an_all_gathers_choice_is_the_same_on_every_rank_whatever_its_own_block():
    """Each rank's key holds its own block's shape: ranks whose blocks fall on both sides of
    PAIR_GATHER_MAX_BYTES must still choose alike (the largest block decides), or one
    would exchange point to point while the other waits in Allgatherv."""
    small, big = PAIR_GATHER_MAX_BYTES // 8, 3 * PAIR_GATHER_MAX_BYTES // 8  # float64 rows
    for counts in ((small, big), (big, small), (small, small), (big, big), (0, big)):
        chosen = {choose(CallKey("all_gather", np.dtype(np.float64), (rows,), "numpy",
                                 counts=counts), Layout(2)) for rows in counts}
        assert len(chosen) == 1, (counts, chosen)
        want = Algorithm.PAIR_EXCHANGE if max(counts) == small else Algorithm.MPI
        assert chosen == {want}, counts


def test_the_rows_state_the_thresholds_they_use():
    """A reader of one row's reason sees the sizes the code uses."""
    ride, exchange_ride, halves, pieces, exchange, point_to_point, last = TABLE
    assert ride.algorithm is Algorithm.PAIR_RIDE and f"<= {RIDE_MAX_BYTES >> 10} KiB" in ride.why
    assert exchange_ride.algorithm is Algorithm.PAIR_RIDE
    assert f"<= {EXCHANGE_RIDE_MAX_BYTES >> 10} KiB" in exchange_ride.why
    assert EXCHANGE_RIDE_MAX_BYTES <= RIDE_MAX_BYTES  # the guard's room for a riding message
    assert halves.algorithm is Algorithm.PAIR_HALVES
    assert f"{HALVES_FROM_BYTES >> 10} KiB to {PIECES_FROM_BYTES >> 20} MiB" in halves.why
    assert HALVES_FROM_BYTES > RIDE_MAX_BYTES  # a mean the ride takes never gets here
    assert pieces.algorithm is Algorithm.PIECES
    assert f">= {PIECES_FROM_BYTES >> 20} MiB" in pieces.why
    assert f"{NODE_CHUNK_BYTES >> 20} MiB pieces" in pieces.why
    assert exchange.algorithm is Algorithm.PAIR_EXCHANGE
    assert f"<= {PAIR_GATHER_MAX_BYTES >> 20} MiB" in exchange.why
    assert f"<= {PAIR_BROADCAST_MAX_BYTES >> 10} KiB" in exchange.why
    assert point_to_point.algorithm is Algorithm.POINT_TO_POINT
    assert "all-to-all" in point_to_point.why
    assert last.algorithm is Algorithm.MPI


def test_a_blocking_all_to_all_of_host_memory_goes_point_to_point_at_every_size():
    """Every rank's all-to-all key holds its own counts, so the row asks nothing of them:
    every size, even or not, any group, as long as the checks' communicator exists."""
    for n in (2, 3, 64):
        for counts in ((1,) * 2 * n, tuple(range(2 * n)), (0,) * 2 * n, (1 << 22,) * 2 * n):
            key = CallKey("all_to_all", np.dtype(np.float32), (sum(counts[:n]),), "numpy",
                          counts=counts)
            for layout in (Layout(n), Layout(n, nodes=min(n, 2))):
                assert choose(key, layout) is Algorithm.POINT_TO_POINT
            assert choose(key, Layout(n, checks=False)) is Algorithm.MPI  # no communicator
            assert choose(key._replace(async_op=True), Layout(n)) is Algorithm.MPI
            assert choose(key._replace(library="cupy"), Layout(n)) is Algorithm.MPI
    one = CallKey("all_to_all", np.dtype(np.float32), (3,), "numpy", counts=(3, 3))
    assert choose(one, Layout(1)) is Algorithm.MPI  # a group of one has no checks' communicator


def test_reading_the_table_imports_no_mpi4py():
    code = ("import sys\n"
            "from axondist.backends.mpi.backend import PLANS\n"
            "from axondist.backends.mpi.choose import Layout, choose\n"
            "from axondist.backends.plan import CallKey\n"
            "import numpy as np\n"
            "key = CallKey('all_reduce', np.dtype('float32'), (4,), 'numpy', reduce_op='SUM')\n"
            "assert (key.collective, choose(key, Layout(2))) in PLANS\n"
            "assert 'mpi4py' not in sys.modules, sorted(m for m in sys.modules if 'mpi' in m)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
