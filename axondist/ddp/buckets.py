"""Which gradients share a bucket (:func:`bucket_plan`, pure: sizes in, positions out) and
the flat buffer they are packed into (:class:`GradientBucket`); the
:class:`~axondist.ddp.GradientSynchronizer` builds its buckets from both.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from .. import _array

MiB = 1 << 20
#: MiB per DDP gradient bucket when none is given (torch DDP's 25).
DEFAULT_BUCKET_CAP_MB = 25.0


def bucket_plan(sizes_bytes: Sequence[int], cap_bytes: int,
                first_cap_bytes: int | None = None) -> list[list[int]]:
    """Split items, in the order given, into consecutive buckets of bounded size.

    Greedy: items join the current bucket while its total stays within the
    cap; the item that would overflow it starts the next bucket. The first
    bucket's cap is ``first_cap_bytes`` (a small first bucket lets
    communication start early), later ones ``cap_bytes``. An item larger
    than the cap gets a bucket of its own. Zero-size items join the current
    bucket.

    Args:
        sizes_bytes: each item's size, in bucket order (DDP passes the
            gradients in reverse parameter order, the order backward makes them).
        cap_bytes: the cap of every bucket but the first; > 0.
        first_cap_bytes: the first bucket's cap (``cap_bytes`` when None); > 0.

    Returns:
        Buckets as lists of positions into ``sizes_bytes``; concatenated they
        are ``0, 1, ..., len - 1``. No items give no buckets.

    Raises:
        ValueError: a cap <= 0 or a negative size.
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if cap_bytes <= 0 or first <= 0:
        raise ValueError(f"bucket_plan: caps must be > 0 bytes, got cap_bytes={cap_bytes}, "
                         f"first_cap_bytes={first_cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes_bytes):
        if size < 0:
            raise ValueError(f"bucket_plan: sizes_bytes[{i}] = {size} is negative")
        cap = first if not buckets else cap_bytes
        if current and used + size > cap:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        buckets.append(current)
    return buckets


class GradientBucket:
    """A flat buffer of ``capacity`` elements that gradients are packed into.

    The buffer is allocated once, at the first :meth:`add` or
    :meth:`reserve`, in the namespace of ``like`` (or of the first array
    added; NumPy for a bare :meth:`reserve`) and the bucket's dtype (given,
    else the first array's). :meth:`clear` forgets the contents, not the
    buffer.

    Args:
        capacity: number of elements the buffer holds.
        dtype: the buffer's dtype; the first added array's when None.
        like: an array whose namespace (NumPy/CuPy) the buffer takes.
        buffer: the zeroed flat buffer of ``capacity`` elements to use (a backend's
            :meth:`~axondist.backends.base.Backend.shared_buffer`); allocated when None.
    """

    def __init__(self, capacity: int, dtype: Any = None, *, like: Any = None,
                 buffer: Any = None) -> None:
        if int(capacity) < 0:
            raise ValueError(f"GradientBucket: capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.dtype: np.dtype | None = None if dtype is None else np.dtype(dtype)
        self._like = like
        self.buffer: Any = buffer
        #: Whether the buffer was given (a backend's shared memory) rather than allocated.
        self.given = buffer is not None
        if buffer is not None and (buffer.shape != (self.capacity,) or self.dtype is None
                                   or buffer.dtype != self.dtype):
            raise ValueError(f"GradientBucket: buffer must be 1-D of {self.capacity} elements "
                             f"of the bucket's dtype {self.dtype}, got {_array.describe(buffer)}")
        self._entries: list[tuple[int, tuple[int, ...]]] = []
        self.size = 0

    def _allocate(self, like: Any) -> None:
        if self.dtype is None:
            self.dtype = np.dtype(like.dtype) if like is not None else np.dtype(np.float32)
        source = self._like if self._like is not None else like
        xp = _array.namespace(source) if source is not None else np
        # Written once here, so no step pays the page faults of fresh memory.
        self.buffer = xp.empty(self.capacity, dtype=self.dtype)
        self.buffer[...] = 0

    def reserve(self, shape: Sequence[int], *, like: Any = None) -> Any:
        """Claim room for an array of ``shape``; return its (uninitialized) view, or None
        when it does not fit."""
        shape = tuple(int(d) for d in shape)
        n = prod(shape)
        if self.size + n > self.capacity:
            return None
        if self.buffer is None:
            self._allocate(like)
        view = self.buffer[self.size:self.size + n].reshape(shape)
        self._entries.append((self.size, shape))
        self.size += n
        return view

    def add(self, array: Any) -> bool:
        """Append ``array``'s values if they fit; return whether they did.

        Raises:
            TypeError: ``array`` is not floating point, or lives in the other
                namespace than the buffer.
        """
        array = _array.as_array(array)
        if not _array.is_floating(array.dtype):
            raise TypeError(f"GradientBucket.add: gradients must be floating point, got "
                            f"{_array.describe(array)}")
        if self.buffer is not None:
            _array.namespace(self.buffer, array)  # refuses NumPy/CuPy mixes
        view = self.reserve(array.shape, like=array)
        if view is None:
            return False
        view[...] = array
        return True

    def is_full(self) -> bool:
        """True when no room is left (``size == capacity``; a 0-capacity bucket is always full)."""
        return self.size == self.capacity

    def is_empty(self) -> bool:
        """True while it holds no element (before a non-empty :meth:`add`, after :meth:`clear`)."""
        return self.size == 0

    @property
    def data(self) -> Any:
        """The used part of the buffer (1-D; empty before the first add)."""
        if self.buffer is None:
            return np.empty(0, dtype=self.dtype or np.float32)
        return self.buffer[:self.size]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the arrays in the bucket, in the order they were added."""
        return [shape for _, shape in self._entries]

    def extract(self) -> list[Any]:
        """The added arrays, with their shapes, as views of the buffer (no copies)."""
        return [self.buffer[off:off + prod(shape)].reshape(shape) for off, shape in self._entries]

    def clear(self) -> None:
        """Forget the contents; keep the buffer for the next use."""
        self._entries.clear()
        self.size = 0

    def __repr__(self) -> str:
        return (f"GradientBucket({len(self._entries)} arrays, {self.size}/{self.capacity} "
                f"elements, dtype={self.dtype})")


__all__ = ["DEFAULT_BUCKET_CAP_MB", "MiB", "GradientBucket", "bucket_plan"]
