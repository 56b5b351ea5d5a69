"""Collectives as adjoint pairs: what a tensor-parallel forward pass applies, and the
collective its backward pass applies in its place.

Each function maps this rank's array to this rank's result. Where a forward value is
*replicated* (the same on every rank of the group), its gradient is too, and counts once;
where it is *split*, each rank holds the gradient of its own part. That is why these pairs
are not :mod:`axondist.differentiable`'s table, whose objective is the sum over ranks (there
an all-reduce's adjoint is an all-reduce; here it is the identity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import _array
from ..comm import all_gather, all_reduce_sum, reduce_scatter_sum, split_sizes
from ..process_group import ProcessGroup, resolve_group

Array = Any


def shard_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` when ``length`` items split over ``parts``
    (the :func:`numpy.array_split` rule)."""
    sizes = split_sizes(length, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def identity(x: Array, group: ProcessGroup | None = None) -> Array:
    """Forward of a replicated value into per-rank computations: returns ``x``.

    Adjoint: :func:`reduce_sum` (each rank's computation contributes a part
    of the gradient of the shared input).
    """
    return x


def reduce_sum(x: Array, group: ProcessGroup | None = None) -> Array:
    """Sum of every rank's ``x``, written into ``x`` (which must be writable) and returned.

    Adjoint: :func:`identity` (the sum's gradient is replicated, and passes
    unchanged to every rank's part).
    """
    return all_reduce_sum(x, group)


def split_last_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """This rank's block of the last axis of a replicated ``x`` (array_split rule; no
    communication). Returns a view.

    Adjoint: :func:`gather_last_axis`.
    """
    g = resolve_group(group)
    start, stop = shard_bounds(x.shape[-1], g.world_size, g.rank)
    return x[..., start:stop]


def gather_last_axis(x: Array, group: ProcessGroup | None = None,
                     sizes: Sequence[int] | None = None) -> Array:
    """Every rank's ``x`` concatenated along the last axis, in rank order, on every rank.

    Widths may differ between ranks (all other dimensions may not). Because
    the gather concatenates along axis 0, the last axis is moved to the
    front, gathered and moved back; passing ``sizes`` (every rank's width)
    saves the exchange of widths.

    Adjoint: :func:`split_last_axis` (when the widths follow the
    array_split rule, as the layers' shards do).
    """
    xp = _array.namespace(x)
    front = xp.ascontiguousarray(xp.moveaxis(x, -1, 0))
    gathered = all_gather(front, group, sizes=sizes)
    return xp.ascontiguousarray(xp.moveaxis(gathered, 0, -1))


def gather_first_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """Every rank's ``x`` concatenated along axis 0 (e.g. the sequence), on every rank.

    Adjoint: :func:`reduce_scatter_first_axis` (when the row counts follow the
    array_split rule): each rank's copy of the result feeds its own
    computation, so the gradients are summed and each rank keeps its rows.
    """
    return all_gather(x, group)


def reduce_scatter_first_axis(x: Array, group: ProcessGroup | None = None) -> Array:
    """Sum over the group, then this rank's block of rows (array_split rule).

    Adjoint: :func:`gather_first_axis`.
    """
    return reduce_scatter_sum(x, group)


#: forward collective -> the collective its backward pass applies.
ADJOINT: dict[Callable[..., Array], Callable[..., Array]] = {
    identity: reduce_sum,
    reduce_sum: identity,
    split_last_axis: gather_last_axis,
    gather_last_axis: split_last_axis,
    gather_first_axis: reduce_scatter_first_axis,
    reduce_scatter_first_axis: gather_first_axis,
}


def adjoint(fn: Callable[..., Array]) -> Callable[..., Array]:
    """The collective that back-propagates through ``fn`` (one of the six above)."""
    try:
        return ADJOINT[fn]
    except KeyError:
        names = ", ".join(f.__name__ for f in ADJOINT)
        raise ValueError(f"adjoint: {getattr(fn, '__name__', fn)!r} is not one of the paired "
                         f"collectives ({names})") from None

__all__ = [
    "ADJOINT",
    "adjoint",
    "gather_first_axis",
    "gather_last_axis",
    "identity",
    "reduce_scatter_first_axis",
    "reduce_sum",
    "shard_bounds",
    "split_last_axis",
]
