"""Reduction operators and their reference implementation on arrays."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from . import _array
from .errors import UnsupportedDTypeError


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values.

    Integer SUM and PRODUCT wrap around on overflow, as NumPy integer
    arithmetic does; AVERAGE is defined for floating and complex dtypes only
    (sum integers and divide where a rounded mean is wanted). On ``bool``, SUM
    and MAX are logical OR, PRODUCT and MIN logical AND.
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVERAGE = "average"
    #: torch.distributed's name for AVERAGE (the same member).
    AVG = "average"

    @classmethod
    def parse(cls, op: Any, where: str) -> ReduceOp:
        """The member ``op`` names: a ReduceOp, its name (``"sum"``, ``"mean"``, ``"avg"``
        ...) in any case, or a ``torch.distributed.ReduceOp`` member of the same meaning
        (recognized by its type, without importing torch).

        Args:
            op: what the caller passed as ``op``.
            where: the calling function, which the message names (``"all_reduce"``).

        Raises:
            ValueError: ``op`` names no reduction (None, a typo, torch's bitwise ops); the
                message names the argument and the valid ops.
        """
        if isinstance(op, cls):
            return op
        name = _torch_op_name(op) if not isinstance(op, str) else op.strip().lower()
        if name is not None:
            try:
                return cls(_ALIASES.get(name, name))
            except ValueError:
                pass
        valid = ", ".join(m.name for m in cls)
        raise ValueError(
            f"{where}: op={op!r} is an unknown reduce op; pass a "
            f"ReduceOp ({valid}), its name in any case ('sum', 'mean', 'avg', 'prod'...), or "
            "torch.distributed.ReduceOp.SUM/AVG/MIN/MAX/PRODUCT") from None


_ALIASES = {"mean": "average", "avg": "average", "prod": "product"}


def _torch_op_name(op: Any) -> str | None:
    """The lower-case name of a ``torch.distributed.ReduceOp`` member (``"sum"``), or None
    for anything else. Told by its type's module and name: torch is not imported."""
    kind = type(op)
    if kind.__module__.startswith("torch") and kind.__qualname__.startswith("ReduceOp"):
        name = getattr(op, "name", None)
        if isinstance(name, str) and name in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
            return name.lower()
    return None


def check_op_dtype(op: ReduceOp, dtype: Any, where: str) -> None:
    """Refuse combinations with no meaning (MIN on complex, AVERAGE on integers)."""
    dtype = _array.check_dtype(dtype, where)
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise UnsupportedDTypeError(f"{where}: {op.name} is not defined for complex dtype {dtype}")
    if op is ReduceOp.AVERAGE and dtype.kind in "biu":
        raise UnsupportedDTypeError(
            f"{where}: AVERAGE is not defined for {dtype}; use SUM and divide by the world size"
        )


def combine_into(out: Any, inputs: Sequence[Any], op: ReduceOp) -> Any:
    """``out = inputs[0] (op) inputs[1] (op) ...`` in list order, then /n for AVERAGE.

    The order is fixed, so a float reduction gives the same bits every run.
    ``out`` may be ``inputs[0]``, not any other input.
    """
    xp = _array.namespace(out)
    if out is not inputs[0]:
        out[...] = inputs[0]
    ufunc = getattr(xp, _UFUNCS[op._name_][out.dtype == bool])  # _name_: no enum hashing
    if op is ReduceOp.MIN or op is ReduceOp.MAX:
        with _array.quiet_nan_compare(out):  # they propagate NaN on purpose: no warning
            for x in inputs[1:]:
                ufunc(out, x, out=out)
    else:
        for x in inputs[1:]:
            ufunc(out, x, out=out)
    if op is ReduceOp.AVERAGE:
        xp.divide(out, len(inputs), out=out, casting="unsafe")
    return out


#: The ufunc of each reduction, by the op's name: ``(numbers, booleans)``.
_UFUNCS = {
    "SUM": ("add", "logical_or"),
    "AVERAGE": ("add", "add"),
    "PRODUCT": ("multiply", "logical_and"),
    "MIN": ("minimum", "minimum"),
    "MAX": ("maximum", "maximum"),
}
