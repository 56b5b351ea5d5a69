"""Attention of one block of queries against one block of keys, at global positions.

Every method reduces to these pieces: :func:`block_mask` says which (query, key)
pairs may attend (causal order, same document, neither one padding) and trims the
block to the rows and columns that have any; :func:`block_forward` gives the
block's output and log-sum-exp; :func:`merge` folds a block into the running
output (``O = sum_b exp(lse_b - lse) O_b``, ``lse = log sum_b exp(lse_b)``);
:func:`block_backward` gives the block's dQ, dK, dV from the saved ``lse`` and
``D = rowsum(dO * O)``. Arrays here are grouped: queries ``(*L, G, T, d)`` and
keys ``(*L, 1, S, d)``, ``G`` query heads sharing each key head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _array

Array = Any


@dataclass(frozen=True)
class MaskRule:
    """Which pairs may attend.

    Attributes:
        causal: a query at position t sees keys at positions <= t.
        bounds: the packed documents' boundaries ``[0, e1, ..., en]`` (None: one
            document, no padding); a pair must lie in one document, and positions at
            or past ``en`` are padding that attends to nothing.
    """

    causal: bool
    bounds: tuple[int, ...] | None = None

    def documents(self, positions: np.ndarray) -> np.ndarray | None:
        """Each position's document (-1 for padding), or None without documents."""
        if self.bounds is None:
            return None
        doc = np.searchsorted(np.asarray(self.bounds), positions, side="right") - 1
        return np.where(positions >= self.bounds[-1], -1, doc)


@dataclass(frozen=True)
class BlockMask:
    """The part of a (queries x keys) block with any pair that may attend.

    Attributes:
        rows: the queries to compute (a slice of the block's rows).
        cols: the keys to compute.
        allowed: a boolean (rows, cols) array of the pairs that may attend, on the
            arrays' device; None when every pair in the rectangle may.
    """

    rows: slice
    cols: slice
    allowed: Array | None

    @property
    def empty(self) -> bool:
        """No pair may attend: the block contributes nothing."""
        return self.rows.stop <= self.rows.start or self.cols.stop <= self.cols.start


def block_mask(rule: MaskRule, q_pos: np.ndarray, k_pos: np.ndarray, xp: Any) -> BlockMask:
    """The :class:`BlockMask` of queries at ``q_pos`` against keys at ``k_pos``."""
    allowed = np.ones((len(q_pos), len(k_pos)), dtype=bool)
    if rule.causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    q_doc, k_doc = rule.documents(q_pos), rule.documents(k_pos)
    if q_doc is not None and k_doc is not None:
        allowed &= (q_doc[:, None] == k_doc[None, :]) & (q_doc[:, None] >= 0)
    rows = np.flatnonzero(allowed.any(axis=1))
    cols = np.flatnonzero(allowed.any(axis=0))
    if len(rows) == 0:
        return BlockMask(slice(0, 0), slice(0, 0), None)
    r, c = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    inside = allowed[r, c]
    return BlockMask(r, c, None if inside.all() else xp.asarray(inside))


def compute_dtype(dtype: Any) -> np.dtype:
    """float64 for float64 inputs, else float32: blocks are merged in float32 or wider."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _masked_scores(q: Array, k: Array, mask: BlockMask, scale: float) -> Array:
    xp = _array.namespace(q)
    scores = (q @ xp.swapaxes(k, -1, -2)) * scale
    if mask.allowed is not None:
        scores = xp.where(mask.allowed, scores, -xp.inf)
    return scores


def block_forward(q: Array, k: Array, v: Array, mask: BlockMask,
                  scale: float) -> tuple[Array, Array]:
    """Output ``(*L, G, R, dv)`` and log-sum-exp ``(*L, G, R)`` of the mask's rows, in
    the inputs' dtype (the compute dtype). Rows with no key have output 0 and lse -inf.

    ``q`` is the mask's rows of the queries, ``k`` and ``v`` its columns of the keys.
    """
    xp = _array.namespace(q)
    scores = _masked_scores(q, k, mask, scale)
    top = scores.max(axis=-1)
    top = xp.where(xp.isfinite(top), top, 0)
    weights = xp.exp(scores - top[..., None])
    total = weights.sum(axis=-1)
    seen = total > 0
    safe = xp.where(seen, total, 1)
    out = (weights @ v) / safe[..., None]
    lse = xp.where(seen, xp.log(safe) + top, -xp.inf)
    return out, lse


def merge(out: Array, lse: Array, block_out: Array, block_lse: Array) -> None:
    """Fold a block's ``(block_out, block_lse)`` into ``(out, lse)`` in place (views of
    the same rows)."""
    xp = _array.namespace(out)
    new = xp.logaddexp(lse, block_lse)
    base = xp.where(xp.isfinite(new), new, 0)
    out *= xp.exp(lse - base)[..., None]
    out += block_out * xp.exp(block_lse - base)[..., None]
    lse[...] = new


def block_backward(q: Array, k: Array, v: Array, grad_out: Array, lse: Array, delta: Array,
                   mask: BlockMask, scale: float) -> tuple[Array, Array, Array]:
    """The block's ``(dQ, dK, dV)``: dQ ``(*L, G, R, d)`` for the mask's rows, dK and dV
    ``(*L, 1, C, .)`` for its columns, summed over the ``G`` query heads.

    With P = exp(S - lse) (masked pairs 0): dV = P^T dO; dS = P * (dO V^T - D);
    dQ = scale dS K; dK = scale dS^T Q. ``lse``, ``delta`` and ``grad_out`` are the
    mask's rows.
    """
    xp = _array.namespace(q)
    scores = _masked_scores(q, k, mask, scale)
    base = xp.where(xp.isfinite(lse), lse, 0)
    weights = xp.exp(scores - base[..., None])
    grad_v = (xp.swapaxes(weights, -1, -2) @ grad_out).sum(axis=-3, keepdims=True)
    grad_s = weights * (grad_out @ xp.swapaxes(v, -1, -2) - delta[..., None])
    grad_q = (grad_s @ k) * scale
    grad_k = (xp.swapaxes(grad_s, -1, -2) @ q).sum(axis=-3, keepdims=True) * scale
    return grad_q, grad_k, grad_v


__all__ = ["BlockMask", "MaskRule", "block_backward", "block_forward", "block_mask",
           "compute_dtype", "merge"]
