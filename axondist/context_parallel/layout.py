"""Which global token positions each rank holds, and moving a sequence into and out of them.

A layout maps ``(seq_len, world_size, rank)`` to the sorted global positions rank
``rank`` holds. ``"contiguous"`` gives rank r the r-th of ``W`` runs; ``"zigzag"``
cuts the sequence into ``2W`` chunks and gives rank r chunks ``r`` and ``2W-1-r``,
so under a causal mask every rank has the same amount of work. Chunks follow the
:func:`numpy.array_split` rule, so any length works (short sequences leave some
ranks with fewer, or no, tokens); :func:`pad` rounds a length up to one that splits
evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _array
from .._frameworks import framework_of
from .._validate import as_rank
from ..errors import InvalidBufferError


def _check_sizes(seq_len: Any, world_size: Any, where: str) -> tuple[int, int]:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
        raise ValueError(f"{where}: seq_len={seq_len!r} must be an int >= 0")
    if (isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer))
            or world_size < 1):
        raise ValueError(f"{where}: world_size={world_size!r} must be an int >= 1")
    return int(seq_len), int(world_size)


def _chunk_bounds(seq_len: int, chunks: int) -> np.ndarray:
    """Start of each of ``chunks`` array_split chunks of ``seq_len``, and the end."""
    base, extra = divmod(seq_len, chunks)
    sizes = np.full(chunks, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def zigzag_indices(seq_len: int, world_size: int, rank: int) -> np.ndarray:
    """Global positions rank ``rank`` holds in the balanced causal layout, ascending.

    The sequence is cut into ``2 * world_size`` chunks (array_split rule); rank r
    holds chunk r and chunk ``2W-1-r``: ``zigzag_indices(8, 2, 0)`` is ``[0, 1, 6, 7]``.

    Raises:
        ValueError: ``seq_len`` or ``world_size`` is not a non-negative (positive) int.
        RankError: ``rank`` is outside ``0 .. world_size - 1``.
    """
    seq_len, world_size = _check_sizes(seq_len, world_size, "zigzag_indices")
    rank = as_rank(rank, world_size, "zigzag_indices", "rank")
    bounds = _chunk_bounds(seq_len, 2 * world_size)
    late = 2 * world_size - 1 - rank
    return np.concatenate([np.arange(bounds[rank], bounds[rank + 1]),
                           np.arange(bounds[late], bounds[late + 1])]).astype(np.int64)


def contiguous_indices(seq_len: int, world_size: int, rank: int) -> np.ndarray:
    """Global positions rank ``rank`` holds when the sequence is cut into ``world_size``
    runs (array_split rule): ``contiguous_indices(8, 2, 0)`` is ``[0, 1, 2, 3]``.

    Raises:
        ValueError, RankError: as :func:`zigzag_indices`.
    """
    seq_len, world_size = _check_sizes(seq_len, world_size, "contiguous_indices")
    rank = as_rank(rank, world_size, "contiguous_indices", "rank")
    bounds = _chunk_bounds(seq_len, world_size)
    return np.arange(bounds[rank], bounds[rank + 1], dtype=np.int64)


@dataclass(frozen=True)
class Layout:
    """A way to split a sequence over ranks.

    Attributes:
        name: the name ``attention`` and the helpers take (``"zigzag"``...).
        indices: ``indices(seq_len, world_size, rank)`` -> that rank's sorted positions.
        multiple: lengths that are a multiple of ``multiple * world_size`` give every
            rank the same number of tokens (what :func:`pad` rounds up to).
    """

    name: str
    indices: Callable[[int, int, int], np.ndarray]
    multiple: int


#: Every layout, by name.
LAYOUTS: dict[str, Layout] = {
    "zigzag": Layout("zigzag", zigzag_indices, 2),
    "contiguous": Layout("contiguous", contiguous_indices, 1),
}


def layout_named(name: Any, where: str = "layout") -> Layout:
    """The :class:`Layout` called ``name``.

    Raises:
        ValueError: no layout has that name (the message lists them).
    """
    layout = LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise ValueError(f"{where}: layout={name!r} is not one of {', '.join(LAYOUTS)}")
    return layout


def layout_indices(seq_len: int, world_size: int, rank: int,
                   layout: str = "zigzag") -> np.ndarray:
    """The positions rank ``rank`` holds in ``layout`` (see :data:`LAYOUTS`)."""
    return layout_named(layout, "layout_indices").indices(seq_len, world_size, rank)


def token_counts(seq_len: int, world_size: int, layout: str = "zigzag") -> list[int]:
    """How many tokens each rank holds, in rank order."""
    chosen = layout_named(layout, "token_counts")
    return [len(chosen.indices(seq_len, world_size, r)) for r in range(world_size)]


def _like(result: Any, original: Any) -> Any:
    """``result`` as an array of ``original``'s framework (torch, JAX), or itself."""
    framework = framework_of(original)
    return result if framework is None else framework.wrap(
        _array.namespace(result).ascontiguousarray(result), original)


def shard(x: Any, world_size: int, rank: int, layout: str = "zigzag", axis: int = -2) -> Any:
    """Rank ``rank``'s tokens of the whole sequence ``x`` (tokens along ``axis``), in
    the layout's order; a new array of ``x``'s library or framework.

    Raises:
        InvalidBufferError: ``x`` has no axis ``axis``.
    """
    given, x = x, _array.as_array(x)
    if not -x.ndim <= axis < x.ndim:
        raise InvalidBufferError(f"shard: x of shape {tuple(x.shape)} has no axis {axis}; "
                                 "pass the token axis (-2 for (..., T, d))")
    idx = layout_indices(x.shape[axis], world_size, rank, layout)
    xp = _array.namespace(x)
    return _like(xp.take(x, xp.asarray(idx), axis=axis), given)


def unshard(shards: Sequence[Any], layout: str = "zigzag", axis: int = -2) -> Any:
    """The whole sequence from every rank's tokens (``shards[r]`` from rank r), the
    inverse of :func:`shard`.

    Raises:
        InvalidBufferError: the shards' token counts are not the layout's for their total.
    """
    if not shards:
        raise InvalidBufferError("unshard: shards is empty; pass one array per rank")
    arrays = [_array.as_array(s) for s in shards]
    counts = [a.shape[axis] for a in arrays]
    total, world_size = sum(counts), len(arrays)
    expected = token_counts(total, world_size, layout)
    if counts != expected:
        raise InvalidBufferError(
            f"unshard: the shards hold {counts} tokens, but the {layout} layout of {total} "
            f"tokens over {world_size} ranks gives {expected}; pass every rank's shard in "
            "rank order")
    xp = _array.namespace(*arrays)
    order = np.concatenate([layout_indices(total, world_size, r, layout)
                            for r in range(world_size)])
    joined = xp.concatenate(arrays, axis=axis)
    return _like(xp.take(joined, xp.asarray(np.argsort(order)), axis=axis), shards[0])


def padded_length(seq_len: int, world_size: int, layout: str = "zigzag") -> int:
    """The smallest length >= ``seq_len`` that gives every rank as many tokens."""
    seq_len, world_size = _check_sizes(seq_len, world_size, "padded_length")
    step = layout_named(layout, "padded_length").multiple * world_size
    return -(-seq_len // step) * step


def pad(x: Any, world_size: int, layout: str = "zigzag", axis: int = -2) -> tuple[Any, int]:
    """``x`` with zero tokens appended along ``axis`` up to :func:`padded_length`, and the
    true length.

    Pass ``cu_seqlens=[0, true_length]`` (or the documents' boundaries) to
    :func:`~axondist.context_parallel.attention`: the padded tokens then attend to
    nothing and nothing attends to them, so their outputs and gradients are exact zeros.
    """
    given, x = x, _array.as_array(x)
    if not -x.ndim <= axis < x.ndim:
        raise InvalidBufferError(f"pad: x of shape {tuple(x.shape)} has no axis {axis}; "
                                 "pass the token axis (-2 for (..., T, d))")
    length = int(x.shape[axis])
    extra = padded_length(length, world_size, layout) - length
    xp = _array.namespace(x)
    shape = list(x.shape)
    shape[axis] = extra
    return _like(xp.concatenate([x, xp.zeros(shape, dtype=x.dtype)], axis=axis), given), length


__all__ = ["LAYOUTS", "Layout", "contiguous_indices", "layout_indices", "layout_named", "pad",
           "padded_length", "shard", "token_counts", "unshard", "zigzag_indices"]
