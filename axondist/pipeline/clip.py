"""Gradient-norm clipping over the stages of a pipeline, with torch's NaN and inf semantics.

Each pipeline rank holds the gradients of its own stages, so the global norm
combines one term per rank: the sum of ``|g|**p`` (or, for ``p = inf``, the
largest ``|g|``). The terms are all-gathered and combined in rank order on
every rank, with a maximum that propagates NaN, so every rank gets the same
float and a NaN or inf anywhere reaches the result, as in
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from axondist import _array, comm
from axondist._validate import positive_number
from axondist.errors import NonFiniteNormError
from axondist.process_group import ProcessGroup

__all__ = ["CLIP_EPS", "clip_coefficient", "clip_gradients", "norm_type_of", "total_norm"]

#: Added to the norm before dividing (torch's 1e-6), so a zero gradient does not divide by zero.
CLIP_EPS = 1e-6


def norm_type_of(value: Any, what: str) -> float:
    """``value`` as a norm order: a number > 0, or ``inf`` (also the string ``"inf"``).

    Raises:
        ValueError: NaN, zero, negative, ``-inf`` or not a number.
    """
    if isinstance(value, str) and value.strip().lower() == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(f"{what}: norm_type must be a number > 0 or inf (2.0 for the "
                         f"Euclidean norm), got {value!r}")
    return float(value)


def _nan_max(values: Sequence[float]) -> float:
    # Python's max() keeps the first of two values when one is NaN; torch's does not.
    if any(math.isnan(x) for x in values):
        return math.nan
    return max(values, default=0.0)


def _local_term(grads: Sequence[Any], norm_type: float) -> float:
    """This rank's term: ``sum |g|**p`` in float64, or the NaN-propagating ``max |g|``."""
    terms = []
    for g in grads:
        if g.size == 0:
            continue
        xp = _array.namespace(g)
        a = xp.abs(g.astype("float64").reshape(-1))
        if math.isinf(norm_type):
            terms.append(float(a.max()))  # NumPy's and CuPy's max propagate NaN
        elif norm_type == 2.0:
            terms.append(float(xp.dot(a, a)))
        else:
            terms.append(float((a ** norm_type).sum()))
    return _nan_max(terms) if math.isinf(norm_type) else math.fsum(terms)


def total_norm(grads: Sequence[Any], norm_type: float, group: ProcessGroup | None) -> float:
    """The ``norm_type`` norm of all gradients, those here and those of ``group``'s other ranks.

    Collective over ``group`` (None: every gradient is here). NaN anywhere gives NaN; an
    infinite element (and no NaN) gives inf.
    """
    term = _local_term(grads, norm_type)
    if group is not None and group.world_size > 1:
        mine = group.backend_for("clip_grad_norm").metadata_buffer(
            np.array([term], dtype=np.float64))
        terms = comm.all_gather(mine, group, sizes=[1] * group.world_size)
        values = _array.to_host(terms).tolist()
        term = _nan_max(values) if math.isinf(norm_type) else math.fsum(values)
    if math.isinf(norm_type) or math.isnan(term):
        return term
    return float(term ** (1.0 / norm_type))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """``min(max_norm / (norm + CLIP_EPS), 1)``, NaN when ``norm`` is NaN and 0 when it is inf."""
    coef = max_norm / (norm + CLIP_EPS)
    return coef if math.isnan(coef) else min(coef, 1.0)


def clip_gradients(grads: Sequence[Any], max_norm: Any, norm_type: Any,
                   error_if_nonfinite: bool, group: ProcessGroup | None, what: str) -> float:
    """Scale ``grads`` in place by :func:`clip_coefficient` of their global norm; return the norm.

    As ``torch.nn.utils.clip_grad_norm_``: the gradients are multiplied even
    when the norm is NaN or inf (by NaN, or by 0), unless ``error_if_nonfinite``.

    Raises:
        NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite`` is True
            (on every rank alike; nothing is scaled).
        ValueError: a bad ``max_norm`` or ``norm_type``.
    """
    limit = positive_number(max_norm, what, "max_norm")
    order = norm_type_of(norm_type, what)
    norm = total_norm(grads, order, group)
    if error_if_nonfinite and not math.isfinite(norm):
        raise NonFiniteNormError(
            f"{what}: the total norm of order {order} of the gradients is {norm}, so it cannot "
            "be clipped; find the NaN/inf gradient, or pass error_if_nonfinite=False to scale "
            "the gradients by it anyway (as torch.nn.utils.clip_grad_norm_)")
    coef = clip_coefficient(norm, limit)
    if coef != 1.0:  # also NaN, which compares unequal to everything
        with np.errstate(invalid="ignore"):  # inf * 0 is NaN, as in torch, without a warning
            for g in grads:
                g *= coef
    return norm
