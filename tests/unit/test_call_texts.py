"""The pure pieces behind one mistake's one message: :meth:`ReduceOp.parse` (our names in any
case; torch.distributed's members told by their type alone, so no torch is needed here, while
the cases of ``tests/faults/test_mismatch_texts.py`` pass torch's own; an error naming ``op``
and the valid ops for anything else, None included), and
:func:`checks.raise_if_different` with :func:`checks.printable` (ranks that called
different collectives are told so whatever their keys hold; dtypes by name, shapes as NumPy
prints them, row counts as lists; a field named twice is named once). No communication.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import differentiable
from axondist.backends.checks import printable, raise_if_different
from axondist.errors import CollectiveMismatchError, InvalidBufferError
from axondist.ops import ReduceOp

ALIASES = {"mean": ReduceOp.AVERAGE, "avg": ReduceOp.AVERAGE, "prod": ReduceOp.PRODUCT}
NAMES = {**{m.name.lower(): m for m in ReduceOp}, **{str(m.value): m for m in ReduceOp},
         **ALIASES}


def _torch_like(name: str) -> object:
    """An object typed as torch.distributed.ReduceOp.SUM is (``RedOpType`` of torch's C module),
    made without torch."""
    kind = type("RedOpType", (), {"__module__": "torch._C._distributed_c10d",
                                  "__qualname__": "ReduceOp.RedOpType"})
    member = kind()
    member.name = name  # type: ignore[attr-defined]
    return member


@given(st.sampled_from(sorted(NAMES)), st.sampled_from([str.lower, str.upper, str.title]),
       st.sampled_from(["", " "]))
def test_a_name_in_any_case_parses(name: str, case, pad: str) -> None:
    assert ReduceOp.parse(pad + case(name) + pad, "all_reduce") is NAMES[name]


@pytest.mark.parametrize(("torch_name", "ours"), [
    ("SUM", ReduceOp.SUM), ("AVG", ReduceOp.AVERAGE), ("MIN", ReduceOp.MIN),
    ("MAX", ReduceOp.MAX), ("PRODUCT", ReduceOp.PRODUCT)])
def test_torch_members_map_to_ours(torch_name: str, ours: ReduceOp) -> None:
    assert ReduceOp.parse(_torch_like(torch_name), "all_reduce") is ours


@pytest.mark.parametrize("op", [None, "median", 3, 1.5, ["sum"], _torch_like("BAND"),
                                _torch_like("PREMUL_SUM"), object()])
def test_anything_else_names_the_argument_and_the_valid_ops(op: object) -> None:
    with pytest.raises(ValueError) as info:
        ReduceOp.parse(op, "reduce_scatter")
    assert str(info.value).startswith(f"reduce_scatter: op={op!r} is an unknown reduce op; "
                                      "pass a ReduceOp (SUM, PRODUCT, MIN, MAX, AVERAGE)")
    assert "torch.distributed.ReduceOp.SUM/AVG/MIN/MAX/PRODUCT" in str(info.value)


# --- the cross-rank message -------------------------------------------------------------

shapes = st.lists(st.integers(0, 9), max_size=3).map(tuple)
dtypes = st.sampled_from([np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)])
ops = st.sampled_from(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce"])


@st.composite
def keys(draw) -> tuple:
    key = [("dtype", draw(dtypes)), ("shape", draw(shapes))]
    if draw(st.booleans()):
        key.append(("reduce_op", draw(st.sampled_from(["SUM", "MAX"]))))
    if draw(st.booleans()):
        key.append(("counts", tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))))
    return tuple(key)


@given(st.lists(st.tuples(ops, keys()), min_size=2, max_size=4))
def test_different_collectives_are_named_whatever_the_keys_hold(calls: list) -> None:
    names = [op for op, _ in calls]
    if len(set(names)) == 1:
        return
    with pytest.raises(CollectiveMismatchError) as info:
        raise_if_different(names[0], calls)
    detail = ", ".join(f"rank {r} called {op}" for r, op in enumerate(names))
    assert str(info.value) == (
        f"{names[0]}: ranks called different collectives at the same point ({detail}); every "
        "rank must make the same collective calls in the same order")


@given(keys(), keys())
def test_a_field_that_differs_is_named_with_every_ranks_value(a: tuple, b: tuple) -> None:
    if dict(a) == dict(b) or set(dict(a)) != set(dict(b)):
        return
    with pytest.raises(CollectiveMismatchError) as info:
        raise_if_different("all_reduce", [a, b])  # bare keys: both ranks' own op
    field = next(name for name, value in a if dict(b)[name] != value)
    shown = [dict(printable(k))[field] for k in (a, b)]
    assert str(info.value) == (f"all_reduce: ranks disagree on {field} (rank 0: {shown[0]}, "
                               f"rank 1: {shown[1]})")


def test_printable_forms() -> None:
    key = (("dtype", np.dtype(np.float32)), ("shape", (3,)), ("trailing shape", [2, 2]),
           ("counts", (2, 2)), ("reduce_op", "SUM"), ("reduce_op", "MAX"))
    assert printable(key) == (("dtype", "float32"), ("shape", (3,)), ("trailing shape", (2, 2)),
                              ("counts", [2, 2]), ("reduce_op", "MAX"))
    assert printable(printable(key)) == printable(key)


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter"])
def test_an_unknown_op_names_the_function_it_was_passed_to(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^differentiable.{name}: op='median' is an unknown"):
        getattr(differentiable, name)(np.ones(2), "median")


def test_a_list_given_to_the_hierarchical_all_reduce_is_refused_naming_it() -> None:
    """A list cannot be reduced in place: refused, not copied and left as it was."""
    from axondist.hierarchical import HierarchicalAllReduce

    def body(world: ad.World) -> None:
        values = [1.0, 2.0]
        with pytest.raises(InvalidBufferError, match=r"^HierarchicalAllReduce: x is a list of 2 "
                                                     "numbers; a Python container cannot be "
                                                     "written in place"):
            HierarchicalAllReduce(world, min_bytes=0)(values)

    ad.spawn(body, 2)
