"""Fully sharded data parallelism (ZeRO-1/2/3, hybrid sharding) over flat parameter units.

:class:`FullyShardedDataParallel` (alias :data:`FSDP`) shards a model's
parameters, gradients and optimizer state over a group; the policies
(:class:`ShardingStrategy` with its :class:`ShardingSpec`, :class:`CPUOffload`,
:class:`MixedPrecision`) are values; :mod:`~axondist.fsdp.sharding` holds the
pure padding and shard-bounds arithmetic; :class:`FSDPMemoryStats` models and
reports per-rank memory.
Checkpoints live in :mod:`axondist.checkpoint`.
"""

from .api import FSDP, FullyShardedDataParallel
from .memory import FSDPMemoryStats
from .policies import (
    SHARDING_SPECS,
    CPUOffload,
    MixedPrecision,
    ShardingSpec,
    ShardingStrategy,
    Span,
)
from .sharding import FlatUnit, padded_numel, shard_bounds, shard_size, valid_bounds

__all__ = [
    "SHARDING_SPECS",
    "CPUOffload",
    "FSDP",
    "FSDPMemoryStats",
    "FlatUnit",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardingSpec",
    "ShardingStrategy",
    "Span",
    "padded_numel",
    "shard_bounds",
    "shard_size",
    "valid_bounds",
]
