"""FSDP state dicts and checkpoints: moving shards to and from full tensors and files.

Functions over a :class:`~axondist.fsdp.FullyShardedDataParallel` (its methods
of the same names call them). A unit's parameters map onto the rank's shard
through :meth:`FlatUnit.pieces`, so any full tensor, or any element range of
one read from a checkpoint, can be cut into the shard whatever the world
size or unit layout that produced it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _array, comm
from ..checkpoint import (
    CheckpointError,
    CheckpointReader,
    FlatShard,
    ShardedState,
    TensorSpec,
    dtype_name,
    optimizer_meta,
    optimizer_state_dict_from,
    optimizer_state_names,
)

if TYPE_CHECKING:
    from .api import FullyShardedDataParallel, _Unit


def _owns_rank0(f: FullyShardedDataParallel) -> bool:
    """True when this rank's shard group includes group rank 0 (it gathers for rank 0)."""
    if f.shard_group is None:
        return f.group.rank == 0
    return f.shard_group.contains(f.group.ranks[0])


def full_state_dict(f: FullyShardedDataParallel) -> dict[str, Any] | None:
    """See :meth:`FullyShardedDataParallel.full_state_dict`."""
    out: dict[str, Any] | None = {} if f.group.rank == 0 else None
    if not _owns_rank0(f):
        return out
    for st in f._units:
        flat = st.flat
        if f.shard_group is not None:
            full = comm.gather_tensor(f._to_compute(st.shard.data), f.shard_group, dst=0)
        else:
            full = st.shard.data
        if out is not None:
            host = _array.to_host(full)[:flat.numel]
            for i, view in zip(flat.param_indices, flat.layout.views(host)):
                out[f._names[i]] = view.copy()
    return out


def fill_shard(f: FullyShardedDataParallel, st: _Unit, target: Any,
               piece: Callable[[int, int, int], Any]) -> None:
    """Write each parameter piece of this rank's shard of ``st`` into ``target`` (padding 0).

    ``piece(position, start, stop)`` returns elements ``[start, stop)`` of the
    flattened parameter at ``position`` in the unit.
    """
    shard = np.zeros(st.flat.shard_size, dtype=target.dtype)
    for pc in st.flat.pieces(f._shard_rank):
        shard[pc.shard_offset:pc.shard_offset + pc.size] = piece(
            pc.position, pc.param_start, pc.param_stop)
    target[...] = _array.namespace(target).asarray(shard)


def load_full_state_dict(f: FullyShardedDataParallel, state: dict[str, Any]) -> None:
    """See :meth:`FullyShardedDataParallel.load_full_state_dict`."""
    for st in f._units:
        def piece(pos: int, lo: int, hi: int, st: _Unit = st) -> Any:
            i = st.flat.param_indices[pos]
            name = f._names[i]
            if name not in state:
                raise CheckpointError(f"load_full_state_dict: the state has no tensor {name!r}")
            value = state[name]
            if tuple(value.shape) != f._shapes[i]:
                raise CheckpointError(f"load_full_state_dict: tensor {name!r} has shape "
                                      f"{tuple(value.shape)}, the parameter has {f._shapes[i]}")
            return _array.to_host(value).reshape(-1)[lo:hi]
        fill_shard(f, st, st.shard.data, piece)
        f._release(st)


def sharded_checkpoint_state(f: FullyShardedDataParallel, optimizer: Any = None
                             ) -> ShardedState:
    """See :meth:`FullyShardedDataParallel.sharded_checkpoint_state`."""
    writes = f.replica_group is None or f.replica_group.rank == 0
    tensors, shards = [], []
    for u, st in enumerate(f._units):
        flat = st.flat
        for i, off in zip(flat.param_indices, flat.offsets):
            tensors.append(TensorSpec(f._names[i], f._shapes[i], dtype_name(flat.dtype),
                                      f"unit{u}", off))
        if writes:
            start, _ = flat.shard_bounds(f._shard_rank)
            shards.append(FlatShard(f"unit{u}", flat.padded_numel, start, st.shard.data))
    opt_meta = None
    if optimizer is not None:
        unit_of = f._check_optimizer(optimizer, "save_sharded_checkpoint")
        sd = optimizer.state_dict()
        steps = {}
        for k, entry in sd["state"].items():
            u = unit_of[int(k)]
            flat = f._units[u].flat
            start, _ = flat.shard_bounds(f._shard_rank)
            for i in flat.param_indices:
                steps[f._names[i]] = int(entry.get("step", 0))
            for key in sorted(entry):
                if key == "step":
                    continue
                arr, flat_name = entry[key], f"unit{u}.{key}"
                for i, off in zip(flat.param_indices, flat.offsets):
                    tensors.append(TensorSpec(f"optim/{f._names[i]}/{key}", f._shapes[i],
                                              dtype_name(arr.dtype), flat_name, off))
                if writes:
                    shards.append(FlatShard(flat_name, flat.padded_numel, start, arr))
        opt_meta = optimizer_meta(sd, steps)
    return ShardedState(tensors, shards, opt_meta)


def load_sharded_checkpoint_state(f: FullyShardedDataParallel, reader: CheckpointReader,
                                  optimizer: Any = None) -> None:
    """See :meth:`FullyShardedDataParallel.load_sharded_checkpoint_state`."""
    for st in f._units:
        for i in st.flat.param_indices:
            spec = reader.spec(f._names[i])
            if tuple(spec.shape) != f._shapes[i]:
                raise CheckpointError(f"load_sharded_checkpoint: tensor {spec.name!r} has shape "
                                      f"{tuple(spec.shape)} in the checkpoint, {f._shapes[i]} "
                                      "in the model")

        def piece(pos: int, lo: int, hi: int, st: _Unit = st) -> Any:
            return reader.read(f._names[st.flat.param_indices[pos]], lo, hi)
        fill_shard(f, st, st.shard.data, piece)
        f._release(st)
    if optimizer is not None:
        _load_optimizer(f, reader, optimizer)


def _load_optimizer(f: FullyShardedDataParallel, reader: CheckpointReader,
                    optimizer: Any) -> None:
    """Cut each unit's optimizer state arrays out of the per-parameter saved ones."""
    unit_of = f._check_optimizer(optimizer, "load_sharded_checkpoint")
    steps = (reader.optimizer or {}).get("steps", {})
    state: dict[int, dict[str, Any]] = {}
    for k, u in unit_of.items():
        st = f._units[u]
        names = [f._names[i] for i in st.flat.param_indices]
        keys = optimizer_state_names(reader, names[0])
        if not keys:
            continue
        # a unit's shard has one step count; parameters saved with different counts
        # (some never had a gradient) take the largest
        entry: dict[str, Any] = {"step": max(int(steps.get(n, 0)) for n in names)}
        for key in keys:
            def piece(pos: int, lo: int, hi: int, key: str = key, names: list[str] = names) -> Any:
                saved = f"optim/{names[pos]}/{key}"
                if saved not in reader.index["tensors"]:
                    return 0.0  # that parameter had no state: zeros
                return reader.read(saved, lo, hi)
            dtype = _array.dtype_named(reader.spec(f"optim/{names[0]}/{key}").dtype)
            arr = np.zeros(st.flat.shard_size, dtype=dtype)
            fill_shard(f, st, arr, piece)
            entry[key] = arr
        state[k] = entry
    optimizer.load_state_dict(optimizer_state_dict_from(reader, optimizer, state))


__all__ = [
    "fill_shard",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_checkpoint_state",
    "sharded_checkpoint_state",
]
