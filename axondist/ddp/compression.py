"""How one flat, already-weighted gradient bucket is summed over a group: the
:class:`ReductionHook` protocol, the default :func:`sum_hook`, :class:`CastCompression`
(the sum in a 16-bit float dtype) and :func:`resolve_compression`, which turns a
``compression=`` argument into a hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .. import _array
from ..backends.base import Work
from ..comm import all_reduce
from ..ops import ReduceOp
from ..process_group import ProcessGroup


class ReductionHook(Protocol):
    """Sums one flat, already-weighted bucket over the group, in place.

    Called as ``hook(flat, group, async_op)``; must leave in ``flat`` the
    element-wise sum over the group's ranks once done, and return a
    :class:`~axondist.Work` when ``async_op`` is true (None or a Work when
    false, having finished). Every rank calls it for the same buckets in the
    same order.
    """

    def __call__(self, flat: Any, group: ProcessGroup, async_op: bool) -> Work | None: ...


def sum_hook(flat: Any, group: ProcessGroup, async_op: bool) -> Work | None:
    """The default reduction: an in-place SUM all-reduce in the bucket's own dtype."""
    result = all_reduce(flat, ReduceOp.SUM, group, async_op=async_op)
    return result if async_op else None


class CastCompression:
    """All-reduce a bucket in a narrower floating dtype, then cast back.

    Halves (float16/bfloat16 from float32) or quarters (from float64) the
    bytes sent. Accuracy: each rank's weighted gradient is rounded to the
    narrow dtype (relative error up to 2**-11 for float16, 2**-8 for
    bfloat16), and so is every partial sum of the reduction. float16 flushes
    magnitudes below ~6e-8 to zero and overflows above 65504 (weighting
    before the sum keeps each value within the largest input's magnitude);
    bfloat16 has float32's range but fewer digits. Buckets whose dtype is no
    wider than the narrow one are reduced as they are.

    Args:
        dtype: ``"float16"`` or ``"bfloat16"``.
    """

    def __init__(self, dtype: str) -> None:
        self.name = str(dtype)
        self.dtype = _array.dtype_named(self.name)
        if not _array.is_floating(self.dtype) or self.dtype.itemsize != 2:
            raise ValueError(f"CastCompression: dtype must be float16 or bfloat16, got {dtype!r}")
        # id(flat) -> (flat, narrow copy). The synchronizer passes the same array
        # object for a bucket every step, so each bucket allocates its narrow copy
        # once; holding ``flat`` keeps its id from being reused by another array.
        self._scratch: dict[int, tuple[Any, Any]] = {}

    #: arrays remembered at most (a caller passing fresh arrays each time
    #: would otherwise grow the cache without bound).
    max_cached = 256

    def __call__(self, flat: Any, group: ProcessGroup, async_op: bool) -> Work | None:
        if flat.dtype.itemsize <= self.dtype.itemsize:
            return sum_hook(flat, group, async_op)
        entry = self._scratch.get(id(flat))
        if entry is None or entry[0] is not flat:
            if len(self._scratch) >= self.max_cached:
                self._scratch.clear()  # buffers in flight stay alive through their Work
            entry = (flat, _array.namespace(flat).empty(flat.size, self.dtype))
            self._scratch[id(flat)] = entry
        narrow = entry[1]
        narrow[...] = flat
        work = all_reduce(narrow, ReduceOp.SUM, group, async_op=async_op)

        def widen() -> None:
            flat[...] = narrow

        if not async_op:
            widen()
            return None
        return _ThenWork(work, widen)

    def __repr__(self) -> str:
        return f"CastCompression({self.name!r})"


class _ThenWork(Work):
    """A Work that runs ``then`` once, after ``inner`` completed."""

    __slots__ = ("_done", "_inner", "_then")

    def __init__(self, inner: Work, then: Callable[[], None]) -> None:
        self._inner, self._then, self._done = inner, then, False

    def wait(self, timeout: float | None = None) -> Any:
        result = self._inner.wait(timeout)
        if not self._done:
            self._then()
            self._done = True
        return result

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


def resolve_compression(compression: str | ReductionHook | None) -> ReductionHook:
    """``None`` -> :func:`sum_hook`; ``"fp16"``/``"bf16"`` -> :class:`CastCompression`;
    a callable is used as it is."""
    if compression is None:
        return sum_hook
    if callable(compression):
        return compression
    names = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    try:
        return CastCompression(names[str(compression).lower()])
    except KeyError:
        raise ValueError(f"compression={compression!r} is not known; use None, 'fp16', 'bf16' "
                         "or a callable hook(flat, group, async_op)") from None


__all__ = ["CastCompression", "ReductionHook", "resolve_compression", "sum_hook"]
