"""The global norm of gradients split into shards, and clipping by it.

Each element of the model's gradient lives in exactly one shard of the shard
group, so the p-th power of the global norm is the SUM over the group of each
rank's local sum of ``|g|**p`` (padding elements excluded), and the infinity
norm is the MAX of the local maxima. Replicas (NO_SHARD, the other nodes of
HYBRID_SHARD) hold identical shards and are not counted again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .. import _array, comm
from ..ops import ReduceOp
from ..process_group import ProcessGroup

#: Added to the norm before dividing, so a zero gradient does not divide by zero.
CLIP_EPS = 1e-6


def check_norm_type(norm_type: float, where: str) -> float:
    """``norm_type`` as a float: a positive number or ``inf``."""
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)) or math.isnan(p) or p == -math.inf:
        raise ValueError(f"{where}: norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def local_norm_term(grads: Sequence[Any], norm_type: float) -> float:
    """``sum |g|**p`` over ``grads`` (or ``max |g|`` when p is inf), in float64."""
    total = 0.0
    for g in grads:
        if g.size == 0:
            continue
        xp = _array.namespace(g)
        a = xp.abs(g.astype("float64"))
        if math.isinf(norm_type):
            total = max(total, float(a.max()))
        elif norm_type == 2.0:
            total += float(xp.dot(a, a))
        else:
            total += float((a**norm_type).sum())
    return total


def global_norm(grads: Sequence[Any], norm_type: float, group: ProcessGroup | None,
                xp: Any) -> float:
    """The norm of the gradient whose disjoint pieces ``grads`` the ranks of ``group`` hold.

    Args:
        grads: this rank's pieces (1-D arrays, padding already cut off).
        norm_type: p (> 0) or inf.
        group: the ranks holding the other pieces; None when this rank holds
            every piece (nothing is communicated).
        xp: the array namespace the scalar is reduced in (where the backend
            expects buffers).
    """
    term = local_norm_term(grads, norm_type)
    if group is not None and group.world_size > 1:
        buf = xp.asarray([term], dtype="float64")
        comm.all_reduce(buf, ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM, group)
        term = float(buf[0])
    return term if math.isinf(norm_type) else term ** (1.0 / norm_type)


def clip_coefficient(total_norm: float, max_norm: float) -> float | None:
    """``max_norm / (total_norm + CLIP_EPS)`` when that is below 1, else None (no clipping)."""
    coef = float(max_norm) / (total_norm + CLIP_EPS)
    return coef if coef < 1.0 else None


__all__ = ["CLIP_EPS", "check_norm_type", "clip_coefficient", "global_norm", "local_norm_term"]
