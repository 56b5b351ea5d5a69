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
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ReduceOp or its name (``"sum"``, ``"mean"``, ``"avg"`` ...)."""
        if isinstance(op, cls):
            return op
        name = str(op).lower()
        aliases = {"mean": "average", "avg": "average", "prod": "product"}
        try:
            return cls(aliases.get(name, name))
        except ValueError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown reduce op {op!r}; use one of {valid}") from None


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
    is_bool = out.dtype == bool
    ufunc = {
        ReduceOp.SUM: xp.logical_or if is_bool else xp.add,
        ReduceOp.AVERAGE: xp.add,
        ReduceOp.PRODUCT: xp.logical_and if is_bool else xp.multiply,
        ReduceOp.MIN: xp.minimum,
        ReduceOp.MAX: xp.maximum,
    }[op]
    with _array.quiet_nan_compare(out):  # MIN/MAX propagate NaN on purpose: no warning
        for x in inputs[1:]:
            ufunc(out, x, out=out)
    if op is ReduceOp.AVERAGE:
        xp.divide(out, len(inputs), out=out, casting="unsafe")
    return out
