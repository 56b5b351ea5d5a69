"""The torch backend's algorithm table, read without torch.

Keys are built by hand (collective, dtype, shape, array library, reduce op, row counts,
async) and layouts too (ranks); hypothesis draws them. Each rule applies exactly where its
boundaries say, the table is total (its last row matches every call), and every algorithm
it can choose for a collective has a plan class in
:data:`axondist.backends.torch.plans.PLANS`. Nothing here starts torch.distributed: a test
in a fresh interpreter proves that reading the table imports no torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist import _array
from axondist.backends.plan import CallKey, element_counts
from axondist.backends.torch.choose import (
    BLOCKED,
    COMPARISONS,
    SUMS,
    TABLE,
    Algorithm,
    Layout,
    choose,
)
from axondist.backends.torch.plans import PLANS

#: The collectives that run as the torch backend's prepared calls.
PLANNED = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather",
           "scatter", "all_to_all")
#: Those and a name the table has never heard of: the last row still takes it.
COLLECTIVES = PLANNED + ("barrier",)
OPS = ("SUM", "AVERAGE", "MIN", "MAX", "PRODUCT")
DTYPES = tuple(_array.SUPPORTED_DTYPES)
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


def _floating(dtype: np.dtype) -> bool:
    """float16/32/64 and bfloat16, spelled out (not through axondist)."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


@st.composite
def keys(draw: st.DrawFn, world_size: int) -> CallKey:
    """A call's key for a group of ``world_size`` ranks; row counts even or not."""
    collective = draw(st.sampled_from(COLLECTIVES))
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(0, 3 * world_size + 2))
    trailing = draw(st.sampled_from([(), (1,), (3,), (2, 2), (0,)]))
    shape: tuple[int, ...] = (rows,) + trailing
    if collective in ("all_reduce", "broadcast", "reduce") and draw(st.booleans()):
        shape = ()
    counts = None
    if collective == "all_gather" and draw(st.booleans()):
        counts = tuple(draw(st.lists(st.integers(0, 4), min_size=world_size,
                                     max_size=world_size)))
    if collective in ("reduce_scatter", "scatter") and (
            collective == "scatter" or draw(st.booleans())):
        cut = sorted(draw(st.lists(st.integers(0, rows), min_size=world_size - 1,
                                   max_size=world_size - 1)))
        counts = tuple(b - a for a, b in zip([0] + cut, cut + [rows]))
    if collective == "gather":
        counts = tuple(draw(st.lists(st.integers(0, 4), min_size=world_size,
                                     max_size=world_size)))
    if collective == "all_to_all":
        counts = tuple(draw(st.lists(st.integers(0, 4), min_size=world_size ** 2,
                                     max_size=world_size ** 2)))
    return CallKey(collective, dtype, shape, draw(st.sampled_from(["numpy", "cupy"])),
                   reduce_op=draw(st.sampled_from(OPS)) if collective in REDUCTIONS else None,
                   root=draw(st.integers(0, world_size - 1))
                   if collective in ("broadcast", "reduce", "gather", "scatter") else None,
                   counts=counts, async_op=draw(st.booleans()),
                   layout=draw(st.sampled_from(["ok", "read-only", "strided"])))


def _rank_order(key: CallKey, layout: Layout) -> bool:
    """Sums of floats or complex values over 3 ranks or more, all-reduce or reduce-scatter."""
    return (key.collective in ("all_reduce", "reduce_scatter") and layout.world_size >= 3
            and key.reduce_op in ("SUM", "AVERAGE")
            and (_floating(key.dtype) or key.dtype.kind == "c"))


def _nans(key: CallKey, layout: Layout) -> bool:
    """MIN or MAX of floats, any reduction, any group."""
    return key.collective in REDUCTIONS and key.reduce_op in ("MIN", "MAX") \
        and _floating(key.dtype)


def _uneven(key: CallKey, layout: Layout) -> bool:
    """An all-gather, reduce-scatter, gather or scatter whose ranks' element counts are not
    all equal (an all-to-all's split sizes may differ)."""
    if key.collective not in ("all_gather", "reduce_scatter", "gather", "scatter") \
            or not key.shape:
        return False
    return len(set(element_counts(key, layout.world_size))) > 1


def _host_memory_on_sockets(key: CallKey, layout: Layout) -> bool:
    """A NumPy array in a group with its own sockets, whatever its layout (read-only or
    strided inputs may differ between ranks, which must all choose alike)."""
    return layout.wired and key.library == "numpy"


def _on_wires(key: CallKey, layout: Layout) -> bool:
    """A broadcast, all-gather, gather, scatter or all-to-all (blocks of any size) of host
    memory on sockets."""
    return key.collective in ("broadcast", "all_gather", "gather", "scatter", "all_to_all") \
        and _host_memory_on_sockets(key, layout)


def _pair_on_wires(key: CallKey, layout: Layout) -> bool:
    """In a group of exactly two, of host memory on sockets: a SUM or AVERAGE all-reduce or
    reduce-scatter of float32/64 or int32/64."""
    if not (layout.world_size == 2 and _host_memory_on_sockets(key, layout)):
        return False
    return key.collective in ("all_reduce", "reduce_scatter") \
        and key.reduce_op in ("SUM", "AVERAGE") \
        and key.dtype.name in ("float32", "float64", "int32", "int64")


def _expected(key: CallKey, layout: Layout) -> Algorithm:
    if _pair_on_wires(key, layout) and not _uneven(key, layout):
        return Algorithm.PAIR_WIRES
    if key.collective in REDUCTIONS and layout.world_size >= 2 \
            and _host_memory_on_sockets(key, layout):
        return Algorithm.RANK_ORDER_WIRES
    if _rank_order(key, layout):
        return Algorithm.RANK_ORDER_SUM
    if _nans(key, layout):
        return Algorithm.NAN_RESTORE
    if _on_wires(key, layout):
        return Algorithm.WIRES
    if _uneven(key, layout):
        return Algorithm.PADDED
    return Algorithm.TORCH


sizes = st.integers(1, 9)


@given(data=st.data(), n=sizes)
def test_each_call_takes_the_first_rule_whose_boundaries_it_meets(data, n):
    layout = Layout(n, wired=data.draw(st.booleans()))
    key = data.draw(keys(n))
    assert choose(key, layout) is _expected(key, layout), key


@given(data=st.data(), n=sizes)
def test_a_ranks_input_layout_never_changes_the_choice(data, n):
    """A rank may pass a read-only or strided input where the others pass ordinary arrays
    (calls that do not write their input accept them): every rank still chooses alike."""
    layout = Layout(n, wired=data.draw(st.booleans()))
    key = data.draw(keys(n))
    chosen = {choose(key._replace(layout=kind), layout) for kind in ("ok", "read-only", "strided")}
    assert len(chosen) == 1, (key, chosen)


@given(data=st.data(), n=sizes)
def test_the_table_is_total_its_last_row_takes_every_call(data, n):
    key = data.draw(keys(n))
    last = TABLE[-1]
    assert last.algorithm is Algorithm.TORCH and last.applies(key, Layout(n))


@given(data=st.data(), n=sizes)
def test_every_choice_for_a_planned_collective_has_a_plan_class(data, n):
    key = data.draw(keys(n).filter(lambda k: k.collective in PLANNED))
    wired = data.draw(st.booleans())
    assert (key.collective, choose(key, Layout(n, wired=wired))) in PLANS


def test_every_algorithm_has_a_plan_and_every_plan_a_row():
    assert {algorithm for _, algorithm in PLANS} == set(Algorithm)
    assert [rule.algorithm for rule in TABLE] == [
        Algorithm.PAIR_WIRES, Algorithm.RANK_ORDER_WIRES, Algorithm.RANK_ORDER_SUM,
        Algorithm.NAN_RESTORE, Algorithm.WIRES, Algorithm.PADDED, Algorithm.TORCH]
    for rule in TABLE:
        assert rule.why.strip(), rule


# --- each rule's boundaries, one at a time -------------------------------------------------

def _key(collective: str, dtype: str = "float32", rows: int = 6, **fields) -> CallKey:
    key = CallKey(collective, np.dtype(dtype), (rows,), "numpy",
                  reduce_op="SUM" if collective in REDUCTIONS else None,
                  root=0 if collective in ("broadcast", "reduce") else None,
                  counts=(rows // 2, rows - rows // 2) if collective == "all_gather" else None)
    return key._replace(**fields)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("op", sorted(SUMS))
def test_float_sums_add_in_rank_order_from_three_ranks(collective, op):
    key = _key(collective, rows=12, reduce_op=op)
    assert choose(key, Layout(2)) is Algorithm.TORCH  # one pair: the same either way
    for n in (3, 4, 7):
        assert choose(key, Layout(n)) is Algorithm.RANK_ORDER_SUM
    assert choose(key._replace(async_op=True, library="cupy"), Layout(3)) \
        is Algorithm.RANK_ORDER_SUM
    for dtype in ("float16", "float64", "complex64", "complex128"):
        assert choose(key._replace(dtype=np.dtype(dtype)), Layout(3)) \
            is Algorithm.RANK_ORDER_SUM, dtype


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_rank_order_sums_of_host_memory_take_the_groups_sockets(collective):
    for rows in (0, 1, 5, 1 << 20):
        for op in sorted(SUMS):
            key = _key(collective, rows=rows, reduce_op=op)
            for n in (3, 4, 7):
                assert choose(key, Layout(n, wired=True)) is Algorithm.RANK_ORDER_WIRES
                assert choose(key._replace(async_op=True), Layout(n, wired=True)) \
                    is Algorithm.RANK_ORDER_WIRES
                assert choose(key, Layout(n)) is Algorithm.RANK_ORDER_SUM  # no sockets
                for layout in ("read-only", "strided"):  # a rank's input: not asked
                    assert choose(key._replace(layout=layout), Layout(n, wired=True)) \
                        is Algorithm.RANK_ORDER_WIRES
                assert choose(key._replace(library="cupy"), Layout(n, wired=True)) \
                    is Algorithm.RANK_ORDER_SUM  # device memory: the process group's
    for dtype in ("float16", "bfloat16", "complex128", "int32", "int8", "uint8", "bool"):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):  # every reduction, as the mock world's
            key = _key(collective, dtype, rows=12, reduce_op=op)
            assert choose(key, Layout(3, wired=True)) is Algorithm.RANK_ORDER_WIRES, dtype
    for op in ("MIN", "MAX"):
        assert choose(_key(collective, rows=12, reduce_op=op), Layout(3)) \
            is Algorithm.NAN_RESTORE  # without sockets: gloo's, the NaNs put back
        assert choose(_key(collective, rows=12, reduce_op=op), Layout(2, wired=True)) \
            is Algorithm.RANK_ORDER_WIRES  # two ranks: what the pair's row does not take
    for dtype in ("float16", "bfloat16", "int8", "bool"):
        assert choose(_key(collective, dtype, rows=12, reduce_op="SUM"), Layout(2, wired=True)) \
            is Algorithm.RANK_ORDER_WIRES
    assert choose(_key(collective, rows=5, reduce_op="SUM"), Layout(2, wired=True)) \
        is (Algorithm.PAIR_WIRES if collective == "all_reduce" else Algorithm.RANK_ORDER_WIRES)
    assert choose(_key(collective, "int32", rows=12, reduce_op="SUM"), Layout(3)) \
        is Algorithm.TORCH
    for n in (2, 3):
        assert choose(_key("reduce", rows=12), Layout(n, wired=True)) \
            is Algorithm.RANK_ORDER_WIRES
        assert choose(_key("reduce", rows=12), Layout(n)) is Algorithm.TORCH


def test_integer_sums_products_and_reduces_are_torchs():
    for dtype in ("int8", "int32", "int64", "uint8"):
        assert choose(_key("all_reduce", dtype), Layout(4)) is Algorithm.TORCH
    assert choose(_key("all_reduce", reduce_op="PRODUCT"), Layout(4)) is Algorithm.TORCH
    assert choose(_key("reduce"), Layout(4)) is Algorithm.TORCH  # a rooted sum: torch's


@pytest.mark.parametrize("collective", REDUCTIONS)
@pytest.mark.parametrize("op", sorted(COMPARISONS))
def test_float_min_and_max_put_nans_back_at_every_size(collective, op):
    for n in (1, 2, 3, 5):
        key = _key(collective, rows=10 * n, reduce_op=op)
        assert choose(key, Layout(n)) is Algorithm.NAN_RESTORE
        assert choose(key._replace(dtype=np.dtype("int32")), Layout(n)) is Algorithm.TORCH


def test_nans_come_before_padding():
    key = _key("reduce_scatter", rows=5, reduce_op="MAX")  # 5 rows over 2 ranks: uneven
    assert _uneven(key, Layout(2))
    assert choose(key, Layout(2)) is Algorithm.NAN_RESTORE
    assert choose(key._replace(dtype=np.dtype("int64")), Layout(2)) is Algorithm.PADDED


@pytest.mark.parametrize("collective", sorted(BLOCKED))
def test_uneven_blocks_are_padded_and_even_ones_are_not(collective):
    even = _key(collective, rows=6, counts=(3, 3) if collective == "all_gather" else None)
    uneven = _key(collective, rows=5, counts=(2, 3) if collective == "all_gather" else None)
    assert choose(even, Layout(2)) is Algorithm.TORCH
    assert choose(uneven, Layout(2)) is Algorithm.PADDED
    if collective == "reduce_scatter":  # counts given: their sizes decide, not the rule
        assert choose(even._replace(counts=(2, 4)), Layout(2)) is Algorithm.PADDED
        assert choose(uneven._replace(counts=(5, 0)), Layout(2)) is Algorithm.PADDED
    zero_width = even._replace(shape=(6, 0))  # rows of no elements: every block is empty
    assert choose(zero_width, Layout(2)) is Algorithm.TORCH


@pytest.mark.parametrize("collective", ["gather", "scatter"])
def test_rooted_calls_pad_only_uneven_blocks(collective):
    key = _key(collective, rows=6, root=1, counts=(3, 3))
    assert choose(key, Layout(2)) is Algorithm.TORCH
    assert choose(key._replace(counts=(2, 4)), Layout(2)) is Algorithm.PADDED
    assert choose(key._replace(counts=(1, 1, 4)), Layout(3)) is Algorithm.PADDED


def test_all_to_all_is_torchs_whatever_its_split_sizes():
    key = _key("all_to_all", rows=3, counts=(1, 2, 0, 3))
    assert choose(key, Layout(2)) is Algorithm.TORCH
    assert choose(key._replace(counts=(3, 3, 3, 3), shape=(6,)), Layout(2)) is Algorithm.TORCH


def test_broadcast_of_host_memory_takes_the_groups_sockets_at_every_size():
    for n in (2, 3, 8):
        for rows in (0, 1, 1 << 20):
            key = _key("broadcast", rows=rows)
            assert choose(key, Layout(n, wired=True)) is Algorithm.WIRES
            assert choose(key, Layout(n)) is Algorithm.TORCH  # no sockets: gloo's
            assert choose(key._replace(library="cupy"), Layout(n, wired=True)) \
                is Algorithm.TORCH  # device memory: the process group's (NCCL)
            assert choose(key._replace(async_op=True), Layout(n, wired=True)) \
                is Algorithm.WIRES


def test_a_sum_of_two_members_of_host_memory_takes_the_groups_sockets_at_every_size():
    for rows in (0, 1, 1 << 20):
        for op in ("SUM", "AVERAGE"):
            key = _key("all_reduce", "float64", rows=rows, reduce_op=op)
            assert choose(key, Layout(2, wired=True)) is Algorithm.PAIR_WIRES
            assert choose(key._replace(async_op=True), Layout(2, wired=True)) \
                is Algorithm.PAIR_WIRES
            assert choose(key, Layout(2)) is Algorithm.TORCH  # no sockets: gloo's
            assert choose(key, Layout(3, wired=True)) is Algorithm.RANK_ORDER_WIRES
            assert choose(key._replace(library="cupy"), Layout(2, wired=True)) \
                is Algorithm.TORCH  # device memory: the process group's (NCCL)
            assert choose(key._replace(layout="strided"), Layout(2, wired=True)) \
                is Algorithm.PAIR_WIRES  # a rank's input: not asked
    for dtype in ("float16", "bfloat16", "complex64", "int8", "uint8", "bool"):
        key = _key("all_reduce", dtype, reduce_op="SUM")  # the next row's, combined in order
        assert choose(key, Layout(2, wired=True)) is Algorithm.RANK_ORDER_WIRES, dtype
        assert choose(key, Layout(2)) is Algorithm.TORCH, dtype
    key = _key("all_reduce", "int32", reduce_op="PRODUCT")
    assert choose(key, Layout(2, wired=True)) is Algorithm.RANK_ORDER_WIRES


def test_even_blocks_of_two_members_take_the_pairs_row_uneven_ones_the_rank_order():
    for rows in (0, 2, 1 << 20):
        key = _key("reduce_scatter", "float64", rows=rows)
        assert choose(key, Layout(2, wired=True)) is Algorithm.PAIR_WIRES
        assert choose(key, Layout(2)) is Algorithm.TORCH
        assert choose(key._replace(library="cupy"), Layout(2, wired=True)) is Algorithm.TORCH
    uneven = _key("reduce_scatter", rows=5)
    assert choose(uneven, Layout(2, wired=True)) is Algorithm.RANK_ORDER_WIRES
    assert choose(uneven, Layout(2)) is Algorithm.PADDED  # no sockets: gloo's, padded
    int8 = _key("reduce_scatter", "int8", rows=4)
    assert choose(int8, Layout(2, wired=True)) is Algorithm.RANK_ORDER_WIRES
    assert choose(int8, Layout(2)) is Algorithm.TORCH


def test_an_all_gather_of_host_memory_takes_the_groups_sockets_even_or_not():
    for n in (2, 3, 5):
        for counts in ((2,) * n, (0,) * (n - 1) + (3,), tuple(range(n))):
            for dtype in ("float64", "int8", "bool", "bfloat16"):
                key = _key("all_gather", dtype, rows=counts[0], counts=counts)
                assert choose(key, Layout(n, wired=True)) is Algorithm.WIRES
                assert choose(key._replace(async_op=True), Layout(n, wired=True)) \
                    is Algorithm.WIRES
                assert choose(key._replace(library="cupy"), Layout(n, wired=True)) \
                    is not Algorithm.WIRES
                assert choose(key._replace(layout="strided"), Layout(n, wired=True)) \
                    is Algorithm.WIRES  # a rank's input: not asked
                assert choose(key, Layout(n)) is (  # no sockets: gloo's, padded if uneven
                    Algorithm.TORCH if len(set(counts)) == 1 else Algorithm.PADDED)


def test_reading_the_table_imports_no_torch():
    code = ("import sys\n"
            "import numpy as np\n"
            "from axondist.backends.plan import CallKey\n"
            "from axondist.backends.torch.choose import Layout, choose\n"
            "from axondist.backends.torch.plans import PLANS\n"
            "key = CallKey('all_reduce', np.dtype('float32'), (4,), 'numpy', reduce_op='SUM')\n"
            "assert (key.collective, choose(key, Layout(3))) in PLANS\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
