"""What a writer hands over (tensor specs, flat shards) and the dtype conventions of the files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .. import _array
from ..errors import CheckpointError
from ..parameter import Parameter


@dataclass(frozen=True)
class TensorSpec:
    """Where logical tensor ``name`` lives: ``shape`` elements from ``offset`` of ``flat``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    flat: str
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements, the product of ``shape`` (1 for a scalar)."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class FlatShard:
    """Elements ``[start, start + data.size)`` of flat buffer ``flat`` (of ``numel`` in all)."""

    flat: str
    numel: int
    start: int
    data: Any
    owned: bool = False
    """``data`` is a private copy (an optimizer ``state_dict()`` array): an
    asynchronous save need not copy it again."""


@dataclass
class ShardedState:
    """One rank's contribution to a sharded checkpoint.

    Attributes:
        tensors: the logical tensors this rank knows of (the index holds the
            union over ranks; a name given by two ranks must agree).
        shards: the flat pieces this rank writes (empty on ranks that hold
            only replicas of pieces another rank writes).
        optimizer: optimizer description for the index (JSON-able: class,
            hyper-parameters, step counts per parameter name), or None; the
            ranks' ``steps`` are merged.
        extra: accepted for compatibility and ignored (the index schema is fixed).
    """

    tensors: list[TensorSpec]
    shards: list[FlatShard]
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer that holds the state of element ranges of its parameters
    (:class:`~axondist.zero.ZeroRedundancyOptimizer`): checkpoints save and load each
    rank's ranges, in the format of the wrapped ``optimizer_class``."""

    optimizer_class: type
    params: list[Parameter]

    def state_ranges(self) -> dict[int, tuple[int, int]]:
        """``{parameter index: (start, stop)}`` of the flattened elements held here."""
        ...

    def sharded_state_dict(self) -> dict[str, Any]:
        """A state dict whose arrays are 1-D, the ranges of :meth:`state_ranges`."""
        ...

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the format of :meth:`sharded_state_dict`."""
        ...


def optimizer_class_name(optimizer: Any) -> str:
    """The optimizer class a checkpoint records: the wrapped one for a :class:`ShardedOptimizer`."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.optimizer_class.__name__
    return type(optimizer).__name__


def dtype_name(dtype: Any) -> str:
    """The dtype's name as the index stores it (``"bfloat16"`` included)."""
    return str(np.dtype(dtype)) if not is_bf16(dtype) else "bfloat16"


def is_bf16(dtype: Any) -> bool:
    """True for the bfloat16 dtype."""
    return np.dtype(dtype).name == "bfloat16"


def storable(a: Any) -> np.ndarray:
    """``a`` as a host array ``.npy`` can hold (bfloat16 as its uint16 bits)."""
    h = np.ascontiguousarray(_array.to_host(a))
    return h.view(np.uint16) if is_bf16(h.dtype) else h


def restore(a: np.ndarray, name: str) -> np.ndarray:
    """Undo :func:`storable`'s bfloat16 bit view."""
    return a.view(_array.dtype_named(name)) if name == "bfloat16" else a


def param_names(params: Sequence[Parameter]) -> list[str]:
    """Each parameter's name, ``param{i}`` for unnamed ones; refuses duplicates."""
    names = [p.name or f"param{i}" for i, p in enumerate(params)]
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            raise CheckpointError(f"checkpoint: parameters {seen[n]} and {i} are both named {n!r}; "
                                  "checkpoints key tensors by name, so names must be unique")
        seen[n] = i
    return names


__all__ = ["FlatShard", "ShardedOptimizer", "ShardedState", "TensorSpec", "dtype_name", "is_bf16",
           "optimizer_class_name", "param_names", "restore", "storable"]
