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

import numpy as np

from .. import _array, comm
from .._validate import positive_number
from ..errors import NonFiniteNormError
from ..ops import ReduceOp
from ..process_group import ProcessGroup

#: Added to the norm before dividing, so a zero gradient does not divide by zero.
CLIP_EPS = 1e-6


def check_max_norm(max_norm: Any, where: str) -> float:
    """``max_norm`` as a float > 0.

    Raises:
        TypeError: not a number.
        ValueError: NaN, infinite, zero or negative.
    """
    return positive_number(max_norm, where, "max_norm")


def check_norm_type(norm_type: float, where: str) -> float:
    """``norm_type`` as a float: a positive number or ``inf``.

    Raises:
        ValueError: not a number, NaN, zero, negative or ``-inf``.
    """
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: norm_type must be a number > 0 or inf (2.0 for the "
                         f"Euclidean norm), got {norm_type!r}") from None
    if not (p > 0 or math.isinf(p)) or math.isnan(p) or p == -math.inf:
        raise ValueError(f"{where}: norm_type must be > 0 or inf, got {norm_type!r}")
    return p


def local_norm_term(grads: Sequence[Any], norm_type: float) -> float:
    """``sum |g|**p`` over ``grads`` (or ``max |g|`` when p is inf), in float64.

    NaN anywhere gives NaN and an infinite element gives inf, for every ``p``
    (Python's ``max`` would drop a NaN; this does not).
    """
    total = 0.0
    for g in grads:
        if g.size == 0:
            continue
        xp = _array.namespace(g)
        a = xp.abs(g.astype("float64"))
        with np.errstate(invalid="ignore", over="ignore"):
            if math.isinf(norm_type):
                part = float(a.max())  # NaN when any element is NaN
                total = part if (math.isnan(part) or part > total) else total
            elif norm_type == 2.0:
                total += float(xp.dot(a, a))
            else:
                total += float((a**norm_type).sum())
    return total


def global_norm(grads: Sequence[Any], norm_type: float, group: ProcessGroup | None) -> float:
    """The norm of the gradient whose disjoint pieces ``grads`` the ranks of ``group`` hold.

    A NaN on any rank makes the norm NaN on every rank: the ranks reduce a
    NaN flag beside the term, since a backend's MAX need not propagate NaN.

    Args:
        grads: this rank's pieces (1-D arrays, padding already cut off).
        norm_type: p (> 0) or inf.
        group: the ranks holding the other pieces; None when this rank holds
            every piece (nothing is communicated). The two numbers travel in the
            group backend's :meth:`~axondist.backends.base.Backend.metadata_buffer`,
            wherever the pieces live (offloaded to the host, or none on this rank).

    Returns:
        The norm (a Python float, the same on every rank of ``group``).
    """
    term = local_norm_term(grads, norm_type)
    if group is not None and group.world_size > 1:
        nan = math.isnan(term)
        mine = np.array([0.0 if nan else term, 1.0 if nan else 0.0], dtype=np.float64)
        buf = group.backend_for("clip_grad_norm").metadata_buffer(mine)
        comm.all_reduce(buf, ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM, group)
        flag, value = _array.to_host(buf)[::-1].tolist()
        term = math.nan if flag > 0 else value
    return term if math.isinf(norm_type) else term ** (1.0 / norm_type)


def clip_coefficient(total_norm: float, max_norm: float) -> float | None:
    """The factor to scale gradients by, or None when they stay as they are.

    ``max_norm / (total_norm + CLIP_EPS)`` when that is below 1; NaN when the
    norm is NaN (torch scales by NaN then: every gradient becomes NaN); None
    otherwise (torch multiplies by 1.0, which changes nothing).
    """
    coef = float(max_norm) / (total_norm + CLIP_EPS)
    return coef if (coef < 1.0 or math.isnan(coef)) else None


def scale(grads: Sequence[Any], coef: float) -> None:
    """Multiply every gradient by ``coef`` in place; ``inf * 0`` becomes NaN without a warning."""
    with np.errstate(invalid="ignore", over="ignore"):
        for g in grads:
            g *= coef


def check_finite(total_norm: float, norm_type: float, where: str) -> None:
    """Refuse a NaN or infinite norm (``error_if_nonfinite=True``), as torch does.

    Raises:
        NonFiniteNormError: the norm is NaN or infinite (a RuntimeError).
    """
    if not math.isfinite(total_norm):
        raise NonFiniteNormError(
            f"{where}: the total norm of order {norm_type} of the gradients is {total_norm}, "
            "so they cannot be clipped; find the NaN/inf gradient (e.g. lower the learning "
            "rate or use loss scaling), or pass error_if_nonfinite=False to scale the "
            "gradients by the non-finite norm anyway")


__all__ = ["CLIP_EPS", "check_finite", "check_max_norm", "check_norm_type", "clip_coefficient",
           "global_norm", "local_norm_term", "scale"]
