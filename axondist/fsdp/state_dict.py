"""FSDP state dicts and checkpoints: moving shards to and from full tensors and files.

Functions over any :class:`ShardedModule` (FSDP's methods of the same names
call them), which they reach only through that protocol's public members. A
unit's parameters map onto the rank's shard through :meth:`FlatUnit.pieces`,
so any full tensor, or element range of one read from a checkpoint, can be
cut into the shard whatever the world size or unit layout that produced it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from .. import _array, comm
from .._validate import check_state_names
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
from ..parameter import Parameter
from ..process_group import ProcessGroup
from .sharding import FlatUnit


class ShardedModule(Protocol):
    """What the state-dict functions need from a sharded wrapper (FSDP provides it).

    ``shard_group`` splits each unit (None: not split), ``replica_group`` holds
    copies of the same shards (None: no copies); unit ``u``'s master shard is
    ``sharded_parameters()[u]``, laid out as ``units[u]`` at ``shard_rank``.
    """

    group: ProcessGroup
    shard_group: ProcessGroup | None
    replica_group: ProcessGroup | None

    @property
    def units(self) -> list[FlatUnit]: ...

    @property
    def shard_rank(self) -> int: ...

    @property
    def param_shapes(self) -> list[tuple[int, ...]]: ...

    def parameter_names(self) -> list[str]: ...

    def sharded_parameters(self) -> list[Parameter]: ...

    def communication_shard(self, unit: int) -> Any: ...

    def release_parameters(self, unit: int | None = None) -> None: ...

    def optimizer_units(self, optimizer: Any, where: str = ...) -> dict[int, int]: ...


def _owns_rank0(f: ShardedModule) -> bool:
    """True when this rank's shard group includes group rank 0 (it gathers for rank 0)."""
    if f.shard_group is None:
        return f.group.rank == 0
    return f.shard_group.contains(f.group.ranks[0])


def full_state_dict(f: ShardedModule) -> dict[str, Any] | None:
    """See :meth:`ShardedModule.full_state_dict`."""
    out: dict[str, Any] | None = {} if f.group.rank == 0 else None
    if not _owns_rank0(f):
        return out
    names, shards = f.parameter_names(), f.sharded_parameters()
    for u, flat in enumerate(f.units):
        if f.shard_group is not None:
            full = comm.gather_tensor(f.communication_shard(u), f.shard_group, dst=0)
        else:
            full = shards[u].data
        if out is not None:
            host = _array.to_host(full)[:flat.numel]
            for i, view in zip(flat.param_indices, flat.layout.views(host)):
                out[names[i]] = view.copy()
    return out


def gathered_state_dict(f: ShardedModule) -> dict[str, Any]:
    """See :meth:`FullyShardedDataParallel.state_dict` (every rank gets every array)."""
    names = f.parameter_names()
    out: dict[str, Any] = {}
    for u, flat in enumerate(f.units):
        full = f.communication_shard(u)
        if f.shard_group is not None:
            full = comm.all_gather(full, f.shard_group,
                                   sizes=[flat.shard_size] * f.shard_group.world_size)
        full = _array.to_host(full[:flat.numel])
        for i, view in zip(flat.param_indices, flat.layout.views(full)):
            out[names[i]] = view.copy()
    return {name: out[name] for name in names}


def load_state_dict(f: ShardedModule, state: Mapping[str, Any], where: str) -> None:
    """See :meth:`FullyShardedDataParallel.load_state_dict`; ``where`` names it in errors.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a name missing or unknown, or an array of another shape.
    """
    names = f.parameter_names()
    check_state_names(state, names, where)
    for name, shape in zip(names, f.param_shapes):
        got = tuple(np.shape(state[name]))
        if got != shape:  # checked here: a rank only reads the parameters in its shards
            raise ValueError(f"{where}: {name!r} has shape {got}, the parameter has {shape}")
    try:
        load_full_state_dict(f, dict(state))
    except CheckpointError as exc:
        raise ValueError(f"{where}: {exc}") from None


def fill_shard(f: ShardedModule, flat: FlatUnit, target: Any,
               piece: Callable[[int, int, int], Any]) -> None:
    """Write each parameter piece of this rank's shard of ``flat`` into ``target`` (padding 0).

    ``piece(position, start, stop)`` returns elements ``[start, stop)`` of the
    flattened parameter at ``position`` in the unit.
    """
    shard = np.zeros(flat.shard_size, dtype=target.dtype)
    for pc in flat.pieces(f.shard_rank):
        shard[pc.shard_offset:pc.shard_offset + pc.size] = piece(
            pc.position, pc.param_start, pc.param_stop)
    target[...] = _array.namespace(target).asarray(shard)


def load_full_state_dict(f: ShardedModule, state: dict[str, Any]) -> None:
    """See :meth:`ShardedModule.load_full_state_dict`."""
    names, shapes, shards = f.parameter_names(), f.param_shapes, f.sharded_parameters()
    for u, flat in enumerate(f.units):
        def piece(pos: int, lo: int, hi: int, flat: FlatUnit = flat) -> Any:
            i = flat.param_indices[pos]
            name = names[i]
            if name not in state:
                raise CheckpointError(f"load_full_state_dict: the state has no tensor {name!r}")
            value = state[name]
            if tuple(value.shape) != shapes[i]:
                raise CheckpointError(f"load_full_state_dict: tensor {name!r} has shape "
                                      f"{tuple(value.shape)}, the parameter has {shapes[i]}")
            return _array.to_host(value).reshape(-1)[lo:hi]
        fill_shard(f, flat, shards[u].data, piece)
        f.release_parameters(u)


def sharded_checkpoint_state(f: ShardedModule, optimizer: Any = None
                             ) -> ShardedState:
    """See :meth:`ShardedModule.sharded_checkpoint_state`."""
    writes = f.replica_group is None or f.replica_group.rank == 0
    names, shapes, units = f.parameter_names(), f.param_shapes, f.units
    tensors, shards = [], []
    for u, (flat, shard) in enumerate(zip(units, f.sharded_parameters())):
        for i, off in zip(flat.param_indices, flat.offsets):
            tensors.append(TensorSpec(names[i], shapes[i], dtype_name(flat.dtype),
                                      f"unit{u}", off))
        if writes:
            start, _ = flat.shard_bounds(f.shard_rank)
            shards.append(FlatShard(f"unit{u}", flat.padded_numel, start, shard.data))
    opt_meta = None
    if optimizer is not None:
        unit_of = f.optimizer_units(optimizer, "save_sharded_checkpoint")
        sd = optimizer.state_dict()
        steps = {}
        for k, entry in sd["state"].items():
            u = unit_of[int(k)]
            flat = units[u]
            start, _ = flat.shard_bounds(f.shard_rank)
            for i in flat.param_indices:
                steps[names[i]] = int(entry.get("step", 0))
            for key in sorted(entry):
                if key == "step":
                    continue
                arr, flat_name = entry[key], f"unit{u}.{key}"
                for i, off in zip(flat.param_indices, flat.offsets):
                    tensors.append(TensorSpec(f"optim/{names[i]}/{key}", shapes[i],
                                              dtype_name(arr.dtype), flat_name, off))
                if writes:  # state_dict() arrays are copies: an async save keeps them as is
                    shards.append(FlatShard(flat_name, flat.padded_numel, start, arr, owned=True))
        updated = [names[i] for u in sorted(set(unit_of.values()))
                   for i in units[u].param_indices]
        opt_meta = optimizer_meta(sd, steps, params=updated)
    return ShardedState(tensors, shards, opt_meta)


def load_sharded_checkpoint_state(f: ShardedModule, reader: CheckpointReader,
                                  optimizer: Any = None, strict: bool = True) -> None:
    """See :meth:`ShardedModule.load_sharded_checkpoint_state`."""
    names, shapes, shards = f.parameter_names(), f.param_shapes, f.sharded_parameters()
    for u, flat in enumerate(f.units):
        for i in flat.param_indices:
            spec = reader.spec(names[i])
            if tuple(spec.shape) != shapes[i]:
                raise CheckpointError(f"load_sharded_checkpoint: tensor {spec.name!r} has shape "
                                      f"{tuple(spec.shape)} in the checkpoint, {shapes[i]} "
                                      "in the model")

        def piece(pos: int, lo: int, hi: int, flat: FlatUnit = flat) -> Any:
            return reader.read(names[flat.param_indices[pos]], lo, hi)
        fill_shard(f, flat, shards[u].data, piece)
        f.release_parameters(u)
    if optimizer is not None:
        _load_optimizer(f, reader, optimizer, strict)


def _load_optimizer(f: ShardedModule, reader: CheckpointReader, optimizer: Any,
                    strict: bool) -> None:
    """Cut each unit's optimizer state arrays out of the per-parameter saved ones.

    A parameter the checkpoint lists as updated but without state (it never
    had a gradient) contributes zeros, as a fresh state would; one the
    checkpoint does not list at all is refused unless ``strict`` is False.
    """
    meta = reader.optimizer
    if meta is None:
        raise CheckpointError(f"load_sharded_checkpoint: checkpoint {reader.path} holds no "
                              "optimizer state; pass optimizer=None or save it with one")
    unit_of = f.optimizer_units(optimizer, "load_sharded_checkpoint")
    steps = meta.get("steps", {})
    listed = set(meta.get("params", steps))
    state: dict[int, dict[str, Any]] = {}
    all_names = f.parameter_names()
    for k, u in unit_of.items():
        flat = f.units[u]
        names = [all_names[i] for i in flat.param_indices]
        saved = {n: optimizer_state_names(reader, n) for n in names}
        with_state = [n for n in names if n in steps or saved[n]]  # SGD's state: a step only
        missing = [n for n in names if n not in with_state and n not in listed]
        if missing and strict:
            raise CheckpointError(f"load_sharded_checkpoint: checkpoint {reader.path} has no "
                                  f"optimizer entry for parameter(s) {missing}; pass "
                                  "strict=False to start their optimizer state fresh")
        if not with_state:
            continue
        # a unit's shard has one step count; parameters saved with different counts
        # (some never had a gradient) take the largest
        entry: dict[str, Any] = {"step": max(int(steps.get(n, 0)) for n in with_state)}
        for key in sorted({key for n in with_state for key in saved[n]}):
            def piece(pos: int, lo: int, hi: int, key: str = key, names: list[str] = names,
                      saved: dict[str, list[str]] = saved) -> Any:
                if key not in saved[names[pos]]:
                    return 0.0  # no state (never updated, or not saved and not strict)
                return reader.read(f"optim/{names[pos]}/{key}", lo, hi)
            first = next(n for n in with_state if key in saved[n])
            dtype = _array.dtype_named(reader.spec(f"optim/{first}/{key}").dtype)
            arr = np.zeros(flat.shard_size, dtype=dtype)
            fill_shard(f, flat, arr, piece)
            entry[key] = arr
        state[k] = entry
    optimizer.load_state_dict(optimizer_state_dict_from(reader, optimizer, state))


__all__ = [
    "ShardedModule",
    "fill_shard",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_checkpoint_state",
    "sharded_checkpoint_state",
]
