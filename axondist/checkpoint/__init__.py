"""Checkpoints in plain files (``.npy`` shards plus a checksummed JSON index), saved
atomically, optionally in the background, and loadable into any layout at any world size.

The format and the guarantees are described in ``docs/checkpoints.md``.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .api import Checkpointer, load_sharded_checkpoint, save_sharded_checkpoint, write_sharded
from .directory import LATEST, step_dir_name
from .files import file_sha256
from .full import full_state_of, load_full_checkpoint, load_full_state, save_full_checkpoint
from .index import FORMAT, INDEX_FILE, VERSION
from .layouts import optimizer_meta, optimizer_state_dict_from, optimizer_state_names
from .reader import CheckpointReader
from .recovery import Repaired, repair
from .save import SaveHandle
from .types import (
    FlatShard,
    ShardedOptimizer,
    ShardedState,
    TensorSpec,
    dtype_name,
    param_names,
)

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "LATEST",
    "VERSION",
    "CheckpointError",
    "CheckpointReader",
    "Checkpointer",
    "FlatShard",
    "Repaired",
    "SaveHandle",
    "ShardedOptimizer",
    "ShardedState",
    "TensorSpec",
    "dtype_name",
    "file_sha256",
    "full_state_of",
    "load_full_checkpoint",
    "load_full_state",
    "load_sharded_checkpoint",
    "optimizer_meta",
    "optimizer_state_dict_from",
    "optimizer_state_names",
    "param_names",
    "repair",
    "save_full_checkpoint",
    "save_sharded_checkpoint",
    "step_dir_name",
    "write_sharded",
]
