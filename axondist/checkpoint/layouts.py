"""How models that are not FSDP map onto the checkpoint format, and back.

Every parameter (and each optimizer state array, which has its parameter's
shape) is one logical tensor in a flat of its own. A rank holds it whole
(a plain model, DDP, a pipeline rank's stages) or holds a block of rows of it
(a column-parallel weight or bias) or of columns (a row-parallel weight). The
lowest rank holding a given whole tensor or row block writes it; a block of
columns is first gathered over its tensor-parallel group, since it is not a
contiguous range of the flattened tensor. Loading reads what this rank holds.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _array
from ..comm import all_gather
from ..errors import CheckpointError
from ..parameter import Parameter, parameters_of
from ..process_group import ProcessGroup
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from .reader import CheckpointReader
from .types import (
    FlatShard,
    ShardedOptimizer,
    ShardedState,
    TensorSpec,
    dtype_name,
    optimizer_class_name,
    param_names,
)


@dataclass(frozen=True)
class Placement:
    """What part of a logical tensor of ``shape`` a rank holds.

    ``axis`` None: all of it; 0 or 1: indices ``[lo, hi)`` along that axis.
    ``group`` and ``sizes`` (axis 1 only) say how to gather the full tensor.
    """

    shape: tuple[int, ...]
    axis: int | None = None
    lo: int = 0
    hi: int = 0
    group: ProcessGroup | None = None
    sizes: tuple[int, ...] = ()

    @property
    def row_size(self) -> int:
        """Elements per index of axis 0."""
        return int(np.prod(self.shape[1:], dtype=np.int64))


def _tp_layers(target: Any) -> Iterator[Any]:
    """The tensor-parallel layers in ``target``: itself, or its attributes (one level)."""
    if isinstance(target, (ColumnParallelLinear, RowParallelLinear)):
        yield target
        return
    if isinstance(target, TensorParallelMLP):
        yield target.fc1
        yield target.fc2
        return
    values = list(vars(target).values()) if hasattr(target, "__dict__") else []
    for v in values:
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(item, (ColumnParallelLinear, RowParallelLinear, TensorParallelMLP)):
                yield from _tp_layers(item)


def placements(target: Any, params: Sequence[Parameter]) -> list[Placement]:
    """Each parameter's placement (whole unless it is a tensor-parallel shard)."""
    by_id: dict[int, Placement] = {}
    for layer in _tp_layers(target):
        s = layer.shard
        out, inp = layer.out_features, layer.in_features
        if isinstance(layer, ColumnParallelLinear):
            by_id[id(layer.weight)] = Placement((out, inp), 0, s.start, s.stop)
            if layer.bias is not None:
                by_id[id(layer.bias)] = Placement((out,), 0, s.start, s.stop)
        else:
            by_id[id(layer.weight)] = Placement((out, inp), 1, s.start, s.stop, layer.group,
                                                tuple(layer.shard_sizes))
    return [by_id.get(id(p), Placement(p.shape)) for p in params]


def flat_name(tensor: str) -> str:
    """A file-safe flat name for ``tensor``, unique by a short hash of the full name."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", tensor)[:60]
    return f"t.{safe}.{hashlib.sha256(tensor.encode()).hexdigest()[:8]}"


def _gathered(a: Any, pl: Placement) -> tuple[np.ndarray, Placement]:
    """A column block gathered into the full tensor on every rank of its group (collective)."""
    assert pl.group is not None
    xp = _array.namespace(a)
    full_t = all_gather(xp.ascontiguousarray(a.T), pl.group, sizes=list(pl.sizes))
    return np.ascontiguousarray(_array.to_host(full_t).T), Placement(pl.shape)


@dataclass(frozen=True)
class _Piece:
    name: str
    dtype: str
    pl: Placement
    data: Any
    owned: bool = False  # a private copy (state_dict arrays, gathered blocks)
    start: int | None = None  # where data starts in the flattened tensor (None: from pl)


def _pieces(params: Sequence[Parameter], names: list[str], pls: list[Placement],
            optimizer: Any) -> tuple[list[_Piece], dict[str, Any] | None]:
    pieces = [_Piece(n, dtype_name(p.dtype), pl, p.data) for p, n, pl in zip(params, names, pls)]
    if optimizer is None:
        return pieces, None
    sharded = isinstance(optimizer, ShardedOptimizer)
    # a sharded optimizer's arrays are element ranges of the state: each rank writes its own
    sd = optimizer.sharded_state_dict() if sharded else optimizer.state_dict()
    ranges = optimizer.state_ranges() if sharded else {}
    index_of = {id(p): i for i, p in enumerate(params)}
    steps: dict[str, int] = {}
    opt_names = []
    for k, p in enumerate(optimizer.params):
        j = index_of.get(id(p))
        if j is None:
            raise CheckpointError("save_sharded_checkpoint: the optimizer updates a parameter "
                                  f"(optimizer parameter {k}) that is not in the model; pass the "
                                  "optimizer built over this model's parameters")
        opt_names.append(names[j])
        entry = sd["state"].get(k)
        if entry is None:
            continue
        steps[names[j]] = int(entry.get("step", 0))
        for key in sorted(entry):
            if key != "step":
                arr = entry[key]
                start = ranges[k][0] if sharded else None
                pieces.append(_Piece(f"optim/{names[j]}/{key}", dtype_name(arr.dtype), pls[j],
                                     arr, owned=True, start=start))
    return pieces, optimizer_meta(sd, steps, opt_names)


def layout_state(target: Any, optimizer: Any, g: ProcessGroup) -> ShardedState:
    """This rank's :class:`ShardedState` for a model that is not FSDP (collective over ``g``:
    ranks agree on who writes what, and column blocks are gathered)."""
    params = parameters_of(target)
    names = param_names(params)
    pieces, opt_meta = _pieces(params, names, placements(target, params), optimizer)
    tensors, mine = [], []
    for pc in pieces:
        pl, data, owned = pc.pl, pc.data, pc.owned
        if pl.axis == 1:
            (data, pl), owned = _gathered(data, pl), True
        flat = flat_name(pc.name)
        numel = int(np.prod(pl.shape, dtype=np.int64))
        tensors.append(TensorSpec(pc.name, pl.shape, pc.dtype, flat, 0))
        start = pc.start if pc.start is not None else pl.lo * pl.row_size if pl.axis == 0 else 0
        mine.append(FlatShard(flat, numel, start, data, owned))
    claims = g.backend_for("save_sharded_checkpoint").allgather_object(
        [(s.flat, s.start, int(s.data.size)) for s in mine])
    first: dict[tuple[str, int, int], int] = {}
    for r, rank_claims in enumerate(claims):
        for c in rank_claims:
            first.setdefault(tuple(c), r)
    shards = [s for s in mine if first[(s.flat, s.start, int(s.data.size))] == g.rank]
    return ShardedState(tensors, shards, opt_meta)


def _read_local(reader: CheckpointReader, name: str, pl: Placement, local: tuple[int, ...]
                ) -> np.ndarray:
    spec = reader.spec(name)
    if tuple(spec.shape) != pl.shape:
        raise CheckpointError(f"load_sharded_checkpoint: tensor {name!r} has shape "
                              f"{tuple(spec.shape)} in the checkpoint, {pl.shape} in the model")
    if pl.axis is None:
        return reader.read_full(name)
    if pl.axis == 0:
        return reader.read(name, pl.lo * pl.row_size, pl.hi * pl.row_size).reshape(local)
    return np.ascontiguousarray(reader.read_full(name)[:, pl.lo:pl.hi])


def assign(p: Parameter, value: np.ndarray) -> None:
    """Copy host ``value`` into ``p.data`` in place (so views stay valid)."""
    xp = _array.namespace(p.data)
    p.data[...] = xp.asarray(value).astype(p.dtype)


def load_layout(reader: CheckpointReader, target: Any, optimizer: Any, strict: bool) -> None:
    """Fill a model that is not FSDP (and ``optimizer``) from ``reader``; no communication."""
    params = parameters_of(target)
    names = param_names(params)
    pls = placements(target, params)
    for p, name, pl in zip(params, names, pls):
        assign(p, _read_local(reader, name, pl, p.shape))
    if optimizer is None:
        return
    meta = reader.optimizer
    if meta is None:
        raise CheckpointError(f"load_sharded_checkpoint: checkpoint {reader.path} holds no "
                              "optimizer state; pass optimizer=None or save it with one")
    index_of = {id(p): i for i, p in enumerate(params)}
    listed = set(meta.get("params", meta["steps"]))
    sharded = isinstance(optimizer, ShardedOptimizer)
    ranges = optimizer.state_ranges() if sharded else {}
    state: dict[int, dict[str, Any]] = {}
    for k, p in enumerate(optimizer.params):
        i = index_of.get(id(p))
        if i is None:
            raise CheckpointError("load_sharded_checkpoint: the optimizer updates a parameter "
                                  f"(optimizer parameter {k}) that is not in the model")
        name = names[i]
        if name not in meta["steps"]:
            if strict and name not in listed:
                raise CheckpointError(
                    f"load_sharded_checkpoint: checkpoint {reader.path} has no optimizer entry "
                    f"for parameter {name!r}; pass strict=False to start its optimizer state "
                    "fresh")
            continue
        if sharded and k not in ranges:
            continue  # another rank holds all of this parameter's state
        entry: dict[str, Any] = {"step": int(meta["steps"][name])}
        for key in optimizer_state_names(reader, name):
            if sharded:
                entry[key] = _read_range(reader, f"optim/{name}/{key}", pls[i], ranges[k])
            else:
                entry[key] = _read_local(reader, f"optim/{name}/{key}", pls[i], p.shape)
        state[k] = entry
    full = optimizer_state_dict_from(reader, optimizer, state)
    if sharded:
        optimizer.load_sharded_state_dict(full)
    else:
        optimizer.load_state_dict(full)


def _read_range(reader: CheckpointReader, name: str, pl: Placement, rng: tuple[int, int]
                ) -> np.ndarray:
    """Elements ``[start, stop)`` of flattened tensor ``name``, whose shape must be ``pl``'s."""
    spec = reader.spec(name)
    if tuple(spec.shape) != pl.shape:
        raise CheckpointError(f"load_sharded_checkpoint: tensor {name!r} has shape "
                              f"{tuple(spec.shape)} in the checkpoint, {pl.shape} in the model")
    return reader.read(name, *rng)


def optimizer_meta(sd: dict[str, Any], steps: dict[str, int],
                   params: Sequence[str] | None = None) -> dict[str, Any]:
    """The JSON-able part of an optimizer state_dict; arrays travel as tensors.

    Args:
        sd: the optimizer's ``state_dict()``.
        steps: each parameter name's update count (parameters with state only).
        params: every parameter name the optimizer updates (lets a load tell a
            parameter that had no state from one the checkpoint lacks).
    """
    hyper = {k: (list(v) if isinstance(v, tuple) else v)
             for k, v in sd.get("hyperparameters", {}).items()}
    keys = sorted({k for entry in sd.get("state", {}).values() for k in entry if k != "step"})
    meta = {"class": sd.get("optimizer"), "version": sd.get("version"), "hyperparameters": hyper,
            "step_count": int(sd.get("step_count", 0)), "steps": dict(steps),
            "state_keys": keys}
    if params is not None:
        meta["params"] = list(params)
    return meta


def optimizer_state_names(reader: CheckpointReader, param_name: str) -> list[str]:
    """The optimizer state arrays saved for ``param_name`` (e.g. ``["exp_avg", "exp_avg_sq"]``)."""
    meta = reader.optimizer or {}
    if param_name in meta.get("steps", {}) and "state_keys" in meta:
        return list(meta["state_keys"])
    prefix = f"optim/{param_name}/"
    return sorted(n[len(prefix):] for n in reader.names if n.startswith(prefix))


def optimizer_state_dict_from(reader: CheckpointReader, optimizer: Any,
                              state: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """An optimizer ``state_dict`` from the index's optimizer entry and ``state`` arrays.

    Raises:
        CheckpointError: no optimizer entry, or one of another optimizer class.
    """
    meta = reader.optimizer
    if meta is None:
        raise CheckpointError(f"load_sharded_checkpoint: checkpoint {reader.path} holds no "
                              "optimizer state; pass optimizer=None or save it with one")
    kind = optimizer_class_name(optimizer)
    if meta["class"] != kind:
        raise CheckpointError(f"load_sharded_checkpoint: the checkpoint's optimizer is "
                              f"{meta['class']}, not {kind}")
    return {"optimizer": meta["class"], "version": meta.get("version"),
            "hyperparameters": dict(meta["hyperparameters"]),
            "step_count": int(meta["step_count"]), "state": state}


__all__ = ["Placement", "assign", "flat_name", "layout_state", "load_layout", "optimizer_meta",
           "optimizer_state_dict_from", "optimizer_state_names", "placements"]
