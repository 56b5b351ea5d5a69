"""Checkpoints in plain files: NumPy ``.npy``/``.npz`` plus a JSON index.

Two formats, both readable with nothing but NumPy and ``json``:

**Full checkpoint** (:func:`save_full_checkpoint`): one ``.npz`` file written by
rank 0, holding every parameter at its full shape under its name, plus an
entry ``__index__`` (JSON text as a uint8 array) with each array's dtype,
shape and sha256, and the caller's metadata. bfloat16 arrays are stored as
their uint16 bit patterns (``.npy`` has no bfloat16); the index says so.

**Sharded checkpoint** (:func:`save_sharded_checkpoint`): a directory::

    ckpt/
      index.json                   written last, by rank 0, after a barrier
      unit0.rank0.npy              rank 0's shard of flat buffer "unit0"
      unit0.rank1.npy
      unit0.exp_avg.rank0.npy      optimizer state, sharded like its parameters
      ...

A checkpoint holds *logical tensors* (a parameter ``"fc1.w"``, or an
optimizer state array ``"optim/fc1.w/exp_avg"``), each stored inside a 1-D
*flat* buffer at an element ``offset``; a flat is split into contiguous
element ranges ``[start, stop)``, one ``.npy`` file each. ``index.json``::

    {"format": "axondist-sharded", "version": 1, "world_size": 4,
     "tensors": {"fc1.w": {"shape": [8, 4], "dtype": "float32",
                           "flat": "unit0", "offset": 0}, ...},
     "flats": {"unit0": {"numel": 36, "dtype": "float32",
                         "shards": [{"file": "unit0.rank0.npy", "start": 0, "stop": 9,
                                     "bytes": 164, "sha256": "..."}, ...]}, ...},
     "metadata": {...}, "optimizer": {...} or null}

A reader needs no knowledge of the writer's world size or strategy: to get
elements ``[a, b)`` of a tensor it reads ``[offset + a, offset + b)`` of its
flat from whichever shard files cover it, through a memory map, so each rank
touches only the bytes it needs. Saving at N ranks and loading at M ranks,
or from FSDP into a plain model (or DDP) and back, all work that way.

Every file is written to a temporary name and moved into place with
``os.replace``; the index is written last, so a crash mid-save leaves no
index pointing at half-written files. Before a file is used its size and
sha256 are checked against the index: a truncated or corrupted file is
refused with :class:`CheckpointError` naming it.

FSDP (and any other wrapper) takes part through two methods:
``sharded_checkpoint_state(optimizer)`` returning a :class:`ShardedState`, and
``load_sharded_checkpoint_state(reader, optimizer)``; anything else is treated
as a plain model whose parameters every rank holds in full.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _array
from .errors import CheckpointError
from .parameter import Parameter, parameters_of
from .process_group import ProcessGroup, resolve_group

FORMAT = "axondist-sharded"
FULL_FORMAT = "axondist-full"
VERSION = 1
INDEX_FILE = "index.json"
_FULL_INDEX_KEY = "__index__"
_HASH_CHUNK = 1 << 22


# --- what a writer hands over ----------------------------------------------------------

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


@dataclass
class ShardedState:
    """One rank's contribution to a sharded checkpoint.

    Attributes:
        tensors: every logical tensor (the same list on every rank).
        shards: the flat pieces this rank writes (empty on ranks that hold
            only replicas of pieces another rank writes).
        optimizer: optimizer description for the index (JSON-able: class,
            hyper-parameters, step counts per parameter name), or None.
    """

    tensors: list[TensorSpec]
    shards: list[FlatShard]
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --- small helpers ----------------------------------------------------------

def dtype_name(dtype: Any) -> str:
    """The dtype's name as the index stores it (``"bfloat16"`` included)."""
    return str(np.dtype(dtype)) if not _is_bf16(dtype) else "bfloat16"


def _is_bf16(dtype: Any) -> bool:
    return _array.bfloat16 is not None and np.dtype(dtype) == _array.bfloat16


def _storable(a: np.ndarray) -> np.ndarray:
    """``a`` as NumPy can store it in ``.npy`` (bfloat16 as its uint16 bits)."""
    a = np.ascontiguousarray(_array.to_host(a))
    return a.view(np.uint16) if _is_bf16(a.dtype) else a


def _restore(a: np.ndarray, dtype_name: str) -> np.ndarray:
    return a.view(_array.dtype_named(dtype_name)) if dtype_name == "bfloat16" else a


class _HashingWriter(io.RawIOBase):
    """A file wrapper that hashes and counts what is written through it."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.sha.update(mv)
        self.count += len(mv)
        return self._f.write(mv)


def _write_npz(f: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed ``.npz`` (what ``np.load`` reads).

    Unlike ``np.savez(f, **arrays)``, any name works, ``file`` and
    ``allow_pickle`` included.
    """
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, a in arrays.items():
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)


def _atomic_write(path: str, write: Any) -> tuple[int, str]:
    """Call ``write(file)`` on a temporary file, fsync it, move it to ``path``.

    Returns the bytes written and their sha256.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            hw = _HashingWriter(f)
            write(hw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return hw.count, hw.sha.hexdigest()


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


def _backend(g: ProcessGroup, what: str) -> Any:
    return g.backend_for(what)


# --- sharded: writing ----------------------------------------------------------

def write_sharded(path: str | os.PathLike, state: ShardedState, *,
                  group: ProcessGroup | None = None,
                  metadata: Mapping[str, Any] | None = None) -> None:
    """Write one rank's part of a sharded checkpoint; every rank of ``group`` calls it.

    ``path`` must name the same directory on every rank (a shared file system
    under MPI). Rank 0's ``state.tensors`` and ``state.optimizer`` go into the
    index.

    Raises:
        CheckpointError: a tensor that no rank's shards cover.
    """
    g = resolve_group(group)
    b = _backend(g, "save_sharded_checkpoint")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if g.rank == 0:  # an index left from an earlier save must not describe new files
        old = os.path.join(path, INDEX_FILE)
        if os.path.exists(old):
            os.remove(old)
    b.barrier()
    entries = []
    pieces_of: dict[str, int] = {}
    for sh in state.shards:
        data = _storable(sh.data).reshape(-1)
        if data.size == 0:
            continue
        k = pieces_of[sh.flat] = pieces_of.get(sh.flat, -1) + 1
        # one file per rank per flat; a rank's further pieces of that flat get a suffix
        fname = f"{sh.flat}.rank{g.rank}.npy" if k == 0 else f"{sh.flat}.rank{g.rank}.{k}.npy"
        nbytes, digest = _atomic_write(os.path.join(path, fname),
                                       lambda f, d=data: np.save(f, d, allow_pickle=False))
        entries.append({"flat": sh.flat, "numel": int(sh.numel), "dtype": dtype_name(sh.data.dtype),
                        "file": fname, "start": int(sh.start), "stop": int(sh.start + data.size),
                        "bytes": nbytes, "sha256": digest})
    all_entries = b.allgather_object(entries)
    if g.rank == 0:
        index = _build_index(state, all_entries, g.world_size, metadata)
        _atomic_write(os.path.join(path, INDEX_FILE),
                      lambda f: f.write(json.dumps(index, indent=1, sort_keys=True).encode()))
    b.barrier()


def _build_index(state: ShardedState, all_entries: list[list[dict[str, Any]]], world_size: int,
                 metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    flats: dict[str, dict[str, Any]] = {}
    for entries in all_entries:
        for e in entries:
            flat = flats.setdefault(e["flat"], {"numel": e["numel"], "dtype": e["dtype"],
                                                "shards": []})
            flat["shards"].append({k: e[k] for k in ("file", "start", "stop", "bytes", "sha256")})
    for flat in flats.values():
        flat["shards"].sort(key=lambda s: s["start"])
    tensors = {}
    for t in state.tensors:
        tensors[t.name] = {"shape": list(t.shape), "dtype": t.dtype, "flat": t.flat,
                           "offset": int(t.offset)}
        _check_covered(t, flats)
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "tensors": tensors,
            "flats": flats, "optimizer": state.optimizer, "metadata": dict(metadata or {}),
            **state.extra}


def _check_covered(t: TensorSpec, flats: Mapping[str, Any]) -> None:
    if t.numel == 0:
        return
    flat = flats.get(t.flat)
    lo, hi = t.offset, t.offset + t.numel
    pos = lo
    for s in (flat or {"shards": []})["shards"]:
        if s["start"] <= pos < s["stop"]:
            pos = s["stop"]
        if pos >= hi:
            return
    raise CheckpointError(f"save_sharded_checkpoint: no rank wrote elements {pos}..{hi} of flat "
                          f"{t.flat!r}, which tensor {t.name!r} needs")


# --- sharded: reading ----------------------------------------------------------

class CheckpointReader:
    """Read tensors, or element ranges of them, from a sharded checkpoint directory.

    Args:
        path: the checkpoint directory.
        verify: check each shard file's size and sha256 against the index the
            first time it is used (reads the whole file once).

    Raises:
        CheckpointError: no index (the save did not finish), or not an
            axondist sharded checkpoint.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True) -> None:
        self.path = os.fspath(path)
        self.verify = verify
        index_path = os.path.join(self.path, INDEX_FILE)
        if not os.path.isfile(index_path):
            raise CheckpointError(
                f"load_sharded_checkpoint: {index_path} does not exist; the directory is not a "
                "complete sharded checkpoint (the index is written last, so the save may have "
                "been interrupted)")
        try:
            with open(index_path, "rb") as f:
                self.index = json.loads(f.read().decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"load_sharded_checkpoint: {index_path} is not valid JSON "
                                  f"({exc}); the index is corrupted") from exc
        if self.index.get("format") != FORMAT:
            raise CheckpointError(f"load_sharded_checkpoint: {index_path} has format "
                                  f"{self.index.get('format')!r}, expected {FORMAT!r}")
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def names(self) -> list[str]:
        """Every logical tensor, parameters and optimizer state, in index order."""
        return list(self.index["tensors"])

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the ``metadata`` dict given at save time (empty when none was)."""
        return dict(self.index.get("metadata") or {})

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The index's optimizer entry, or None when saved without an optimizer.

        Holds what is not an array: ``class``, ``version``, ``hyperparameters``,
        ``step_count`` and each parameter's ``steps``; the state arrays are tensors
        named ``optim/<param>/<key>`` (see :meth:`names`).
        """
        return self.index.get("optimizer")

    def spec(self, name: str) -> TensorSpec:
        """Shape, dtype and location of tensor ``name``."""
        t = self.index["tensors"].get(name)
        if t is None:
            raise CheckpointError(f"checkpoint {self.path}: no tensor named {name!r}; it has "
                                  f"{len(self.index['tensors'])} tensors, e.g. "
                                  f"{self.names[:5]}")
        return TensorSpec(name, tuple(t["shape"]), t["dtype"], t["flat"], int(t["offset"]))

    def _open(self, entry: Mapping[str, Any], dtype_name: str) -> np.ndarray:
        fname = entry["file"]
        cached = self._arrays.get(fname)
        if cached is not None:
            return cached
        fpath = os.path.join(self.path, fname)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is missing")
        size = os.path.getsize(fpath)
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is {size} bytes but "
                                  f"the index says {entry['bytes']} (size mismatch: truncated or "
                                  "overwritten); restore the file or save again")
        if self.verify and file_sha256(fpath) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} fails its sha256 "
                                  "check (checksum mismatch: the file is corrupted); restore it "
                                  "or save again")
        try:
            arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is not a "
                                  f"readable .npy file ({exc})") from exc
        expected = entry["stop"] - entry["start"]
        if arr.ndim != 1 or arr.size != expected:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} holds "
                                  f"{arr.size} elements, the index says {expected}")
        arr = _restore(arr, dtype_name)
        self._arrays[fname] = arr
        return arr

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of flattened tensor ``name`` (a new 1-D array)."""
        t = self.spec(name)
        stop = t.numel if stop is None else stop
        if not 0 <= start <= stop <= t.numel:
            raise CheckpointError(f"CheckpointReader.read: range [{start}, {stop}) is outside "
                                  f"tensor {name!r} of {t.numel} elements")
        flat = self.index["flats"].get(t.flat)
        out = np.empty(stop - start, dtype=_array.dtype_named(t.dtype))
        lo, hi = t.offset + start, t.offset + stop
        filled = lo
        for entry in (flat["shards"] if flat else []):
            a, b = max(lo, entry["start"]), min(hi, entry["stop"])
            if b <= a:
                continue
            src = self._open(entry, flat["dtype"])
            out[a - lo:b - lo] = src[a - entry["start"]:b - entry["start"]]
            filled += b - a
        if filled != hi:
            raise CheckpointError(f"checkpoint {self.path}: the shard files do not cover "
                                  f"elements [{start}, {stop}) of tensor {name!r}")
        return out

    def read_full(self, name: str) -> np.ndarray:
        """Tensor ``name`` at its full shape."""
        return self.read(name).reshape(self.spec(name).shape)

    def verify_all(self) -> None:
        """Check the size and sha256 of every shard file (raises CheckpointError)."""
        for flat in self.index["flats"].values():
            for entry in flat["shards"]:
                self._open(entry, flat["dtype"])


# --- plain models: the replicated case ----------------------------------------------------------

def _plain_sharded_state(params: Sequence[Parameter], optimizer: Any, g: ProcessGroup
                         ) -> ShardedState:
    """A replicated model: rank 0 writes every parameter (and state array) whole."""
    names = param_names(params)
    tensors, shards = [], []
    writes = g.rank == 0
    for i, (p, name) in enumerate(zip(params, names)):
        tensors.append(TensorSpec(name, p.shape, dtype_name(p.dtype), f"param{i}", 0))
        if writes:
            shards.append(FlatShard(f"param{i}", p.size, 0, p.data.reshape(-1)))
    opt_meta = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        index_of = {id(p): i for i, p in enumerate(params)}
        steps = {}
        for k, entry in sd["state"].items():
            j = index_of.get(id(optimizer.params[int(k)]))
            if j is None:
                raise CheckpointError("save_sharded_checkpoint: the optimizer updates a parameter "
                                      "that is not in the model")
            steps[names[j]] = int(entry.get("step", 0))
            for key, arr in entry.items():
                if key == "step":
                    continue
                flat = f"param{j}.{key}"
                tensors.append(TensorSpec(f"optim/{names[j]}/{key}", _shape(arr),
                                          dtype_name(arr.dtype), flat, 0))
                if writes:
                    shards.append(FlatShard(flat, arr.size, 0, arr.reshape(-1)))
        opt_meta = optimizer_meta(sd, steps)
    return ShardedState(tensors, shards, opt_meta)


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def optimizer_meta(sd: Mapping[str, Any], steps: Mapping[str, int]) -> dict[str, Any]:
    """The JSON-able part of an optimizer state_dict; arrays travel as tensors."""
    hyper = {k: (list(v) if isinstance(v, tuple) else v)
             for k, v in sd.get("hyperparameters", {}).items()}
    return {"class": sd.get("optimizer"), "version": sd.get("version"), "hyperparameters": hyper,
            "step_count": int(sd.get("step_count", 0)), "steps": dict(steps)}


def optimizer_state_names(reader: CheckpointReader, param_name: str) -> list[str]:
    """The optimizer state arrays saved for ``param_name`` (e.g. ``["exp_avg", "exp_avg_sq"]``)."""
    prefix = f"optim/{param_name}/"
    return sorted(n[len(prefix):] for n in reader.names if n.startswith(prefix))


def optimizer_state_dict_from(reader: CheckpointReader, optimizer: Any,
                              state: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """An optimizer ``state_dict`` from the index's optimizer entry and ``state`` arrays."""
    meta = reader.optimizer
    if meta is None:
        raise CheckpointError(f"load_sharded_checkpoint: checkpoint {reader.path} holds no "
                              "optimizer state; pass optimizer=None or save it with one")
    if meta.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"load_sharded_checkpoint: the checkpoint's optimizer is "
                              f"{meta.get('class')}, not {type(optimizer).__name__}")
    return {"optimizer": meta["class"], "version": meta.get("version"),
            "hyperparameters": dict(meta.get("hyperparameters") or {}),
            "step_count": int(meta.get("step_count", 0)), "state": state}


def _load_plain(reader: CheckpointReader, params: Sequence[Parameter], optimizer: Any) -> None:
    names = param_names(params)
    for p, name in zip(params, names):
        t = reader.spec(name)
        if tuple(t.shape) != p.shape:
            raise CheckpointError(f"load_sharded_checkpoint: tensor {name!r} has shape "
                                  f"{tuple(t.shape)} in the checkpoint, {p.shape} in the model")
        _assign(p, reader.read_full(name))
    if optimizer is None:
        return
    index_of = {id(p): i for i, p in enumerate(params)}
    steps = (reader.optimizer or {}).get("steps", {})
    state: dict[int, dict[str, Any]] = {}
    for k, p in enumerate(optimizer.params):
        i = index_of.get(id(p))
        if i is None:
            raise CheckpointError("load_sharded_checkpoint: the optimizer updates a parameter "
                                  "that is not in the model")
        keys = optimizer_state_names(reader, names[i])
        if keys:
            state[k] = {"step": int(steps.get(names[i], 0))}
            for key in keys:
                state[k][key] = reader.read_full(f"optim/{names[i]}/{key}")
    optimizer.load_state_dict(optimizer_state_dict_from(reader, optimizer, state))


def _assign(p: Parameter, value: np.ndarray) -> None:
    """Copy host ``value`` into ``p.data`` in place (so views stay valid)."""
    xp = _array.namespace(p.data)
    p.data[...] = xp.asarray(value).astype(p.dtype)


# --- sharded: public entry points ----------------------------------------------------------

def save_sharded_checkpoint(path: str | os.PathLike, target: Any, optimizer: Any = None, *,
                            group: ProcessGroup | None = None,
                            metadata: Mapping[str, Any] | None = None) -> None:
    """Save ``target`` (and ``optimizer``'s state) as a sharded checkpoint directory.

    Every rank of the group calls it with the same ``path`` (a shared
    directory). An FSDP-wrapped model writes one file per rank per unit and
    per optimizer state array; a plain model (or DDP), replicated on every
    rank, is written by rank 0 only.

    Args:
        path: the checkpoint directory (created when missing).
        target: a :class:`~axondist.fsdp.FullyShardedDataParallel`, or a model
            (anything :func:`~axondist.parameters_of` accepts).
        optimizer: an axondist optimizer over ``target``'s (sharded) parameters.
        group: the group of ranks saving (FSDP: its own group when None).
        metadata: JSON-able values stored in the index (epoch, step, ...).
    """
    if hasattr(target, "sharded_checkpoint_state"):
        g = target.group if group is None else resolve_group(group)
        state = target.sharded_checkpoint_state(optimizer)
    else:
        g = resolve_group(group)
        state = _plain_sharded_state(parameters_of(target), optimizer, g)
    write_sharded(path, state, group=g, metadata=metadata)


def load_sharded_checkpoint(path: str | os.PathLike, target: Any, optimizer: Any = None, *,
                            verify: bool = True) -> dict[str, Any]:
    """Load a sharded checkpoint into ``target`` (and ``optimizer``); return its metadata.

    Works whatever world size and strategy saved it. Each rank reads only
    the element ranges of the shard files it needs (plain models read every
    tensor whole). No communication.

    Raises:
        CheckpointError: a missing index or file, a size or checksum
            mismatch (naming the file), a tensor the target has but the
            checkpoint lacks, or a shape that differs.
    """
    reader = CheckpointReader(path, verify=verify)
    if hasattr(target, "load_sharded_checkpoint_state"):
        target.load_sharded_checkpoint_state(reader, optimizer)
    else:
        _load_plain(reader, parameters_of(target), optimizer)
    return reader.metadata


# --- full checkpoints ----------------------------------------------------------

def full_state_of(target: Any) -> dict[str, Any] | None:
    """``{name: array}`` for ``target``: FSDP's gathered state (None off rank 0), a dict of
    arrays as given, or a model's parameters."""
    if hasattr(target, "full_state_dict"):
        return target.full_state_dict()
    if isinstance(target, Mapping) and all(not isinstance(v, Parameter) for v in target.values()):
        return {str(k): v for k, v in target.items()}
    params = parameters_of(target)
    return {name: p.data for name, p in zip(param_names(params), params)}


def save_full_checkpoint(path: str | os.PathLike, target: Any, *,
                         group: ProcessGroup | None = None,
                         metadata: Mapping[str, Any] | None = None) -> None:
    """Gather ``target``'s full parameters and write them to one ``.npz`` file on rank 0.

    Every rank of the group calls it (an FSDP target gathers its shards to
    rank 0); the call returns on every rank once the file is in place.

    Args:
        path: the file to write (``.npz`` is not appended).
        target: FSDP, a model, or a ``{name: array}`` dict (rank 0's is written).
        group: the group (FSDP: its own group when None).
        metadata: JSON-able values stored in the file's index.
    """
    g = target.group if (group is None and hasattr(target, "full_state_dict")) else \
        resolve_group(group)
    state = full_state_of(target)
    if g.rank == 0:
        assert state is not None
        arrays = {name: _storable(a) for name, a in state.items()}
        if _FULL_INDEX_KEY in arrays:
            raise CheckpointError(f"save_full_checkpoint: {_FULL_INDEX_KEY!r} is reserved")
        index = {"format": FULL_FORMAT, "version": VERSION, "metadata": dict(metadata or {}),
                 "tensors": {name: {"shape": list(np.shape(a)), "dtype": dtype_name(a.dtype),
                                    "sha256": hashlib.sha256(arrays[name].tobytes()).hexdigest()}
                             for name, a in state.items()}}
        arrays[_FULL_INDEX_KEY] = np.frombuffer(json.dumps(index).encode(), dtype=np.uint8)
        _atomic_write(os.fspath(path), lambda f: _write_npz(f, arrays))
    _backend(g, "save_full_checkpoint").barrier()


def load_full_checkpoint(path: str | os.PathLike, target: Any = None, *,
                         metadata: bool = False) -> Any:
    """Read a full checkpoint; optionally load it into ``target``.

    Args:
        path: the ``.npz`` file.
        target: None, an FSDP wrapper (each rank keeps its shard) or a model
            (its parameters are overwritten in place).
        metadata: also return the stored metadata, as ``(state, metadata)``.

    Returns:
        ``{name: array}`` (NumPy, the saved dtypes), or ``(state, metadata)``.

    Raises:
        CheckpointError: the file is missing, not a full checkpoint, or an
            array fails its checksum (naming the file and the array).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"load_full_checkpoint: {path} does not exist")
    try:  # our own file handle, so it is closed even when NumPy fails on a damaged zip
        with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as npz:
            raw = {k: npz[k] for k in npz.files}
    except Exception as exc:  # zipfile/ValueError/EOFError: all mean a damaged file
        raise CheckpointError(f"load_full_checkpoint: {path} cannot be read as a .npz file "
                              f"({type(exc).__name__}: {exc}); it is truncated or corrupted"
                              ) from exc
    if _FULL_INDEX_KEY not in raw:
        raise CheckpointError(f"load_full_checkpoint: {path} has no {_FULL_INDEX_KEY!r} entry; "
                              "it was not written by save_full_checkpoint")
    index = json.loads(raw.pop(_FULL_INDEX_KEY).tobytes().decode())
    state = {}
    for name, info in index["tensors"].items():
        a = raw.get(name)
        if a is None:
            raise CheckpointError(f"load_full_checkpoint: {path} lacks array {name!r}")
        if hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() != info["sha256"]:
            raise CheckpointError(f"load_full_checkpoint: array {name!r} in {path} fails its "
                                  "sha256 check (checksum mismatch: the file is corrupted)")
        state[name] = _restore(a, info["dtype"]).reshape(info["shape"])
    if target is not None:
        load_full_state(target, state)
    return (state, index.get("metadata", {})) if metadata else state


def load_full_state(target: Any, state: Mapping[str, Any]) -> None:
    """Copy a ``{name: array}`` state into FSDP (its shards) or a model's parameters."""
    if hasattr(target, "load_full_state_dict"):
        target.load_full_state_dict(state)
        return
    params = parameters_of(target)
    for p, name in zip(params, param_names(params)):
        if name not in state:
            raise CheckpointError(f"load_full_state: the state has no tensor {name!r}")
        value = np.asarray(state[name]) if not _array.is_cupy(state[name]) else state[name]
        if tuple(value.shape) != p.shape:
            raise CheckpointError(f"load_full_state: tensor {name!r} has shape "
                                  f"{tuple(value.shape)}, the parameter has {p.shape}")
        _assign(p, _array.to_host(value))


__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "FlatShard",
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
    "save_full_checkpoint",
    "save_sharded_checkpoint",
    "write_sharded",
]
