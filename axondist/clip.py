"""Gradient clipping by the global norm, one set of functions for every wrapper (DDP, FSDP,
tensor parallel, pipeline), with the semantics of ``torch.nn.utils.clip_grad_norm_``.

The ranks of a group hold disjoint parts of the gradient (FSDP shards, pipeline stages,
tensor-parallel shards; DDP holds it all, with no group). The p-th power of the global
norm is the sum of each rank's term ``sum |g|**p``, the infinity norm the largest
``max |g|``: the terms are all-gathered and combined in rank order with ``math.fsum`` and a
maximum that propagates NaN, so every rank gets the same float and a NaN or inf anywhere
reaches the result.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _array, comm
from ._validate import positive_number
from .errors import NonFiniteNormError
from .process_group import ProcessGroup

#: Added to the norm before dividing (torch's 1e-6), so a zero gradient does not divide by zero.
CLIP_EPS = 1e-6


def check_max_norm(max_norm: Any, where: str) -> float:
    """``max_norm`` as a float > 0.

    Raises:
        TypeError: not a number.
        ValueError: NaN, infinite, zero or negative.
    """
    return positive_number(max_norm, where, "max_norm")


def check_norm_type(norm_type: Any, where: str) -> float:
    """``norm_type`` as a norm order: a number > 0, or ``inf`` (also the string ``"inf"``).

    Raises:
        ValueError: NaN, zero, negative, ``-inf`` or not a number.
    """
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return math.inf
    if (isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real)
            or not float(norm_type) > 0):
        raise ValueError(f"{where}: norm_type must be > 0 or inf (a number, 2.0 for the "
                         f"Euclidean norm), got {norm_type!r}")
    return float(norm_type)


def _nan_max(values: Sequence[float]) -> float:
    # Python's max() keeps the first of two values when one is NaN; torch's does not.
    if any(math.isnan(x) for x in values):
        return math.nan
    return max(values, default=0.0)


def local_norm_term(grads: Sequence[Any], norm_type: float) -> float:
    """This rank's term: ``sum |g|**p`` over ``grads`` in float64 (``math.fsum`` of each
    array's sum), or ``max |g|`` when p is inf.

    NaN anywhere gives NaN and an infinite element gives inf, for every ``p``.
    """
    terms = []
    for g in grads:
        if g.size == 0:
            continue
        xp = _array.namespace(g)
        a = xp.abs(g.astype("float64").reshape(-1))
        with np.errstate(invalid="ignore", over="ignore"):
            if math.isinf(norm_type):
                terms.append(float(a.max()))  # NumPy's and CuPy's max propagate NaN
            elif norm_type == 2.0:
                terms.append(float(xp.dot(a, a)))
            else:
                terms.append(float((a ** norm_type).sum()))
    return _nan_max(terms) if math.isinf(norm_type) else math.fsum(terms)


def global_norm(grads: Sequence[Any], norm_type: float, group: ProcessGroup | None) -> float:
    """The ``norm_type`` norm of the gradient whose disjoint parts ``grads`` and the other
    ranks of ``group`` hold.

    Args:
        grads: this rank's parts (arrays; padding already cut off).
        norm_type: p (> 0) or inf, as :func:`check_norm_type` returns it.
        group: the ranks holding the other parts; None when every part is here
            (nothing is communicated). The terms travel in the group backend's
            :meth:`~axondist.backends.base.Backend.metadata_buffer`, wherever the
            gradients live.

    Returns:
        The norm, a Python float, the same on every rank of ``group``. NaN anywhere
        gives NaN; an infinite element (and no NaN) gives inf.
    """
    term = local_norm_term(grads, norm_type)
    if group is not None and group.world_size > 1:
        mine = group.backend_for("clip_grad_norm").metadata_buffer(
            np.array([term], dtype=np.float64))
        terms = comm.all_gather(mine, group, sizes=[1] * group.world_size)
        values = _array.to_host(terms).tolist()
        term = _nan_max(values) if math.isinf(norm_type) else math.fsum(values)
    if math.isinf(norm_type) or math.isnan(term):
        return term
    return float(term ** (1.0 / norm_type))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``min(max_norm / (total_norm + CLIP_EPS), 1)``: NaN when the norm is NaN (torch
    scales by NaN then: every gradient becomes NaN) and 0 when it is inf."""
    coef = float(max_norm) / (total_norm + CLIP_EPS)
    return coef if math.isnan(coef) else min(coef, 1.0)


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
            "gradients by it anyway (as torch.nn.utils.clip_grad_norm_ does)")


def clip_grad_norm(grads: Sequence[Any], max_norm: Any, norm_type: Any = 2.0,
                   error_if_nonfinite: bool = False, *, group: ProcessGroup | None = None,
                   counted: Sequence[Any] | None = None,
                   where: str = "clip_grad_norm") -> float:
    """Scale ``grads`` in place so that the gradient's global norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: every gradient is multiplied by
    :func:`clip_coefficient` when it is below 1, also when the norm is NaN or inf (by
    NaN, or by 0), unless ``error_if_nonfinite``. Collective over ``group``: every rank
    calls it, with its own parts, and gets the same norm.

    Args:
        grads: this rank's gradient arrays, scaled in place.
        max_norm: the largest norm allowed (a finite number > 0).
        norm_type: the order p of the norm (> 0), or ``inf``.
        error_if_nonfinite: raise instead of scaling when the norm is NaN or inf.
        group: the ranks holding the other parts of the gradient; None when this
            rank holds all of it (nothing is communicated).
        counted: the arrays whose elements make up this rank's part of the norm,
            when they are not ``grads`` themselves (FSDP: shards without padding;
            tensor parallel: a replicated gradient on one rank only).
        where: the caller's name, which every error starts with.

    Returns:
        The norm before clipping, a float.

    Raises:
        NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite`` (on every
            rank alike; nothing is scaled).
        TypeError: ``max_norm`` is not a number.
        ValueError: ``max_norm`` is not a finite number > 0, or ``norm_type`` is not
            > 0 or inf.
    """
    limit = check_max_norm(max_norm, where)
    order = check_norm_type(norm_type, where)
    total = global_norm(grads if counted is None else counted, order, group)
    if error_if_nonfinite:
        check_finite(total, order, where)
    coef = clip_coefficient(total, limit)
    if coef != 1.0:  # also NaN, which compares unequal to everything
        scale(grads, coef)
    return total


__all__ = ["CLIP_EPS", "check_finite", "check_max_norm", "check_norm_type", "clip_coefficient",
           "clip_grad_norm", "global_norm", "local_norm_term", "scale"]
