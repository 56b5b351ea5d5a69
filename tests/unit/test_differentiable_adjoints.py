"""The adjoint table and the planning of traced collectives, without communication.

The table must have a row for every collective and reduce op, each either defined or refused
with a reason. A traced collective's result shape is settled while tracing: these tests plan
calls on a group whose backend answers the exchange of row counts from a table (and fails
when asked where no exchange is due), so every shape rule is checked against NumPy's
``array_split`` for any world size and rank.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import _jax_traced, comm
from axondist.differentiable import ADJOINTS, adjoint_of
from axondist.errors import CollectiveMismatchError, InvalidBufferError, UnsupportedDTypeError
from axondist.ops import ReduceOp
from axondist.process_group import ProcessGroup


class TableBackend:
    """A backend of ``world_size`` ranks seen from ``rank`` whose ``allgather_object``
    returns ``table`` (and counts the calls); nothing else is called while planning."""

    name = "table"

    def __init__(self, rank: int, world_size: int, table: list[Any] | None = None) -> None:
        self.rank, self.world_size, self.table, self.exchanges = rank, world_size, table, 0

    def allgather_object(self, value: Any) -> list[Any]:
        assert self.table is not None, "no exchange was due"
        assert self.table[self.rank] == value, (self.table, value)
        self.exchanges += 1
        return self.table


def group_of(backend: TableBackend) -> ProcessGroup:
    return ProcessGroup(backend, range(backend.world_size))  # type: ignore[arg-type]


def plan(name: str, shape: tuple[int, ...], backend: TableBackend, **kwargs: Any) -> Any:
    return _jax_traced.plan_call(getattr(comm, name), SimpleNamespace(shape=shape), (),
                                 {"group": group_of(backend), **kwargs})


# --- the table ------------------------------------------------------------------------

def test_every_reduce_op_has_a_row_defined_or_refused_with_a_reason() -> None:
    ops = {ReduceOp(m.value) for m in ReduceOp}
    for name in ("all_reduce", "reduce_scatter"):
        assert {op for n, op in ADJOINTS if n == name} == ops
    for name in ("all_gather", "broadcast", "all_to_all"):
        assert (name, None) in ADJOINTS
    for (name, op), row in ADJOINTS.items():
        assert (row.refused is None) == bool(row.backward), (name, op)
        if row.refused is None:
            assert adjoint_of(name, op) is row


@pytest.mark.parametrize("name, op, says", [
    ("all_reduce", "product", "PRODUCT has no gradient here: the gradient y / x_r is "
                              "undefined where x_r is 0; all_gather x"),
    ("reduce_scatter", "max", "MAX has no gradient here: use all_reduce MAX and slice"),
    ("reduce_scatter", "prod", "PRODUCT has no gradient here"),
])
def test_a_refused_op_says_why_and_what_to_do(name: str, op: str, says: str) -> None:
    with pytest.raises(UnsupportedDTypeError, match=f"differentiable.{name}: {says}"):
        adjoint_of(name, op)


def test_an_unknown_collective_lists_the_differentiable_ones() -> None:
    with pytest.raises(ValueError, match="'gather_tensor' .* they are all_gather, "
                                         "all_reduce, all_to_all, broadcast, reduce_scatter"):
        adjoint_of("gather_tensor")


def test_the_torch_and_jax_functions_cover_the_table() -> None:
    torch_functions = pytest.importorskip("axondist.differentiable.torch_functions")
    names = {n for n, _ in ADJOINTS}
    assert set(torch_functions.FUNCTIONS) == names
    assert names == set(_jax_traced.TRACED) - {"reduce"}


# --- shapes settled while tracing -----------------------------------------------------

@given(data=st.data(), n=st.integers(1, 6))
def test_an_all_gather_with_sizes_asks_no_one_and_sums_them(data: st.DataObject,
                                                             n: int) -> None:
    rank = data.draw(st.integers(0, n - 1))
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    call = plan("all_gather", (sizes[rank], 3), TableBackend(rank, n), sizes=sizes)
    assert call.rows_out == sum(sizes) and call.out_shape((sizes[rank], 3)) == (sum(sizes), 3)
    assert call.arguments["sizes"] == sizes


@given(data=st.data(), n=st.integers(1, 6))
def test_an_all_gather_without_sizes_exchanges_them_once(data: st.DataObject, n: int) -> None:
    rank = data.draw(st.integers(0, n - 1))
    rows = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    backend = TableBackend(rank, n, rows)
    call = plan("all_gather", (rows[rank],), backend)
    assert backend.exchanges == 1 and call.rows_out == sum(rows)
    assert call.arguments["sizes"] == rows  # the traced call passes them: no second exchange
    zero_d = plan("all_gather", (), TableBackend(rank, n, [1] * n))
    assert zero_d.out_shape(()) == (n,)


@given(data=st.data(), n=st.integers(1, 6), length=st.integers(1, 20))
def test_reduce_scatter_keeps_the_array_split_block(data: st.DataObject, n: int,
                                                    length: int) -> None:
    rank = data.draw(st.integers(0, n - 1))
    call = plan("reduce_scatter", (length, 2), TableBackend(rank, n))
    expected = len(np.array_split(np.arange(length), n)[rank])
    assert call.out_shape((length, 2)) == (expected, 2)


@given(data=st.data(), n=st.integers(1, 5))
def test_all_to_all_receives_the_column_of_the_send_table(data: st.DataObject, n: int) -> None:
    rank = data.draw(st.integers(0, n - 1))
    table = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for _ in range(n)]
    backend = TableBackend(rank, n, table)
    call = plan("all_to_all", (sum(table[rank]), 2), backend, send_sizes=table[rank])
    column = [t[rank] for t in table]
    assert call.arguments["recv_sizes"] == column and call.rows_out == sum(column)
    given_recv = plan("all_to_all", (sum(table[rank]),), TableBackend(rank, n),
                      send_sizes=table[rank], recv_sizes=column)
    assert given_recv.rows_out == sum(column)


def test_planning_refuses_what_has_no_traced_form_with_what_to_do() -> None:
    one = TableBackend(0, 2)
    with pytest.raises(InvalidBufferError, match="gather_tensor: has no form inside jax.jit"):
        plan("gather_tensor", (3,), one)
    with pytest.raises(InvalidBufferError, match="async_op=True has no meaning inside jax.jit"):
        plan("all_reduce", (3,), one, async_op=True)
    with pytest.raises(InvalidBufferError, match="reduce_scatter: a 0-d array has no axis"):
        plan("reduce_scatter", (), one)
    with pytest.raises(InvalidBufferError, match=r"send_sizes=\[1, 1\] must list 2 row counts"):
        plan("all_to_all", (3,), one, send_sizes=[1, 1])
    with pytest.raises(CollectiveMismatchError, match=r"sizes=\[2, 2\] must list 2 row counts "
                                                      r"with this rank's own \(3\) at index 0"):
        plan("all_gather", (3,), one, sizes=[2, 2])
    differentiating = type("JVPTracer", (), {"shape": (3,)})()
    with pytest.raises(InvalidBufferError, match="use axondist.differentiable.all_reduce"):
        _jax_traced.plan_call(comm.all_reduce, differentiating, (), {"group": group_of(one)})
    with pytest.raises(InvalidBufferError, match="out= cannot be given inside jax.jit"):
        _jax_traced.run_traced(comm.all_gather, SimpleNamespace(shape=(3,)), (), {},
                               out=np.zeros(6))


def test_differentiable_refuses_numpy_input_naming_the_plain_collective() -> None:
    from axondist import differentiable as dd

    with pytest.raises(TypeError, match="use axondist.broadcast"):
        dd.broadcast(np.ones(2), ad.World.mock())


def test_differentiable_all_to_all_checks_send_sizes_before_asking_anyone() -> None:
    from axondist.differentiable.adjoints import all_to_all_rows

    backend = TableBackend(1, 3)  # fails if asked
    with pytest.raises(InvalidBufferError, match=r"send_sizes=\[2, 2\] must list 3 row counts "
                                                 r">= 0 adding up to x's 5 rows"):
        all_to_all_rows(5, group_of(backend), [2, 2], None)
    assert all_to_all_rows(5, group_of(backend), [1, 1, 3], [2, 0, 1]) == ((1, 1, 3), (2, 0, 1))
