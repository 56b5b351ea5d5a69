"""What every all-gather of rows whose counts are not given shares, whichever layer runs
it: the fingerprint of dtype and trailing shape that ranks exchange beside their row
counts (equal calls give equal numbers on every rank), and the error naming what the
ranks' dtypes or trailing shapes differ in once they compared them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from math import prod
from typing import Any

from ..errors import CollectiveMismatchError


def row_fingerprint(dtype: Any, trailing: tuple[int, ...]) -> tuple[int, int, int]:
    """Three numbers that equal dtypes and trailing shapes share on every rank (a CRC of
    their text, the number of trailing axes, the row size)."""
    return zlib.crc32(f"{dtype}{trailing}".encode()), len(trailing), prod(trailing)


def rows_mismatch(what: str, metas: Sequence[tuple[Any, Any]]) -> CollectiveMismatchError | None:
    """The error naming the first of dtype and trailing shape in which the ranks'
    ``(dtype, trailing shape)`` pairs (one per rank, in rank order, as they should print)
    differ, or None where they all agree."""
    for field, idx in (("dtype", 0), ("trailing shape", 1)):
        values = [m[idx] for m in metas]
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {k}: {v}" for k, v in enumerate(values))
            return CollectiveMismatchError(f"{what}: ranks disagree on {field} ({detail})")
    return None
