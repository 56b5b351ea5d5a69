"""Collectives that carry gradients: torch autograd and JAX ``grad`` (under ``jit`` too).

``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` and ``all_to_all`` take a
torch tensor or a JAX array and return a new one of the same framework, recorded so that
backward applies the collective's adjoint (:mod:`~axondist.differentiable.adjoints`; the
gradients are of the sum over ranks of what each rank computes). None of them writes into
its input. The frameworks' modules load on first use: importing this package imports
neither torch nor JAX.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from .._frameworks import framework_of
from ..ops import ReduceOp
from ..process_group import ProcessGroup, resolve_group
from .adjoints import ADJOINTS, Adjoint, CallContext, adjoint_of, all_gather_rows, all_to_all_rows


def _apply(name: str, x: Any, call: CallContext) -> Any:
    framework = framework_of(x)
    if framework is None:
        raise TypeError(
            f"axondist.differentiable.{name}: x must be a torch tensor or a JAX array, got "
            f"{type(x).__name__}; for arrays without gradients use axondist.{name}")
    module = importlib.import_module(f"{__name__}.{framework.name}_functions")
    return module.apply(name, x, call)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(x, "shape", ()))


def all_reduce(x: Any, op: ReduceOp | str = ReduceOp.SUM,
               group: ProcessGroup | None = None) -> Any:
    """``x`` reduced over the group, as a new array; backward: the table's row for ``op``.

    Raises:
        UnsupportedDTypeError: ``op`` is PRODUCT (its gradient is refused; see the table).
    """
    op = ReduceOp.parse(op, "differentiable.all_reduce")
    adjoint_of("all_reduce", op)
    g = resolve_group(group)
    return _apply("all_reduce", x, CallContext(g, _shape(x), op=op))


def all_gather(x: Any, group: ProcessGroup | None = None, *,
               sizes: Sequence[int] | None = None) -> Any:
    """Every rank's ``x`` concatenated along axis 0 (leading sizes may differ; ``sizes``,
    when given, lists them and saves their exchange); backward: a reduce-scatter."""
    g = resolve_group(group)
    shape = _shape(x)
    rows = all_gather_rows(shape[0] if shape else 1, g, sizes)
    return _apply("all_gather", x, CallContext(g, shape, rows=rows))


def reduce_scatter(x: Any, op: ReduceOp | str = ReduceOp.SUM,
                   group: ProcessGroup | None = None) -> Any:
    """Block r (array_split rule, axis 0) of ``x`` reduced over the group, on rank r;
    backward: an all-gather. ``op`` is SUM or AVERAGE."""
    op = ReduceOp.parse(op, "differentiable.reduce_scatter")
    adjoint_of("reduce_scatter", op)
    g = resolve_group(group)
    return _apply("reduce_scatter", x, CallContext(g, _shape(x), op=op))


def broadcast(x: Any, group: ProcessGroup | None = None, *, src: int = 0) -> Any:
    """Rank ``src``'s ``x`` on every rank; backward: the cotangents summed on ``src``."""
    g = resolve_group(group)
    return _apply("broadcast", x, CallContext(g, _shape(x), src=src))


def all_to_all(x: Any, group: ProcessGroup | None = None, *,
               send_sizes: Sequence[int] | None = None,
               recv_sizes: Sequence[int] | None = None) -> Any:
    """Row block k of ``x`` to rank k, the blocks received concatenated in rank order;
    backward: the all-to-all that sends each block back."""
    g = resolve_group(group)
    shape = _shape(x)
    send, recv = all_to_all_rows(shape[0] if shape else 0, g, send_sizes, recv_sizes)
    return _apply("all_to_all", x, CallContext(g, shape, rows=send, recv_rows=recv))


__all__ = ["ADJOINTS", "Adjoint", "adjoint_of", "all_gather", "all_reduce", "all_to_all",
           "broadcast", "reduce_scatter"]
