"""Full checkpoints: one ``.npz`` of every parameter at its full shape, written by rank 0.

The file holds each array under its name plus an ``__index__`` entry (JSON
text as a uint8 array, with its own checksum) giving each array's dtype,
shape and sha256 and the caller's metadata; bfloat16 arrays are stored as
their uint16 bit patterns. ``np.load`` reads it with nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _array
from ..errors import CheckpointError
from ..parameter import Parameter, parameters_of
from ..process_group import ProcessGroup, resolve_group
from .files import NPY_HEADER_LOCK, atomic_write
from .index import canonical_json, parse_checked_json, with_checksum
from .layouts import assign
from .types import dtype_name, param_names, restore, storable

FULL_FORMAT = "axondist-full"
FULL_VERSION = 2
_INDEX_KEY = "__index__"
_FIXES = {errno.ENOSPC: "free space on that disk or save elsewhere",
          errno.EDQUOT: "free space within your quota or save elsewhere",
          errno.EROFS: "the file system is read-only: save to a writable path",
          errno.EACCES: "no permission to write there: save to a writable path",
          errno.EPERM: "no permission to write there: save to a writable path"}


def _write_npz(f: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed ``.npz``; unlike ``np.savez(f, **arrays)`` any name
    works, ``file`` and ``allow_pickle`` included."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, a in arrays.items():
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(a), allow_pickle=False)


def full_state_of(target: Any) -> dict[str, Any] | None:
    """``{name: array}`` for ``target``: FSDP's gathered state (None off rank 0), a dict of
    arrays as given, or a model's parameters."""
    if hasattr(target, "full_state_dict"):
        state: dict[str, Any] | None = target.full_state_dict()
        return state
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

    Raises:
        CheckpointError: on every rank, when the file cannot be written (a full
            disk, a read-only file system, no permission: the message names
            the file and the cause) or a name is reserved (``__index__``).
    """
    g = target.group if (group is None and hasattr(target, "full_state_dict")) else \
        resolve_group(group)
    state = full_state_of(target)
    error = None
    if g.rank == 0:
        try:
            error = _write_full(os.fspath(path), state, metadata)
        except Exception as exc:  # reported on every rank, like the file errors
            error = f"save_full_checkpoint: writing {os.fspath(path)} failed: " \
                    f"{type(exc).__name__}: {exc}"
    error = g.backend_for("save_full_checkpoint").broadcast_object(error, 0)
    if error is not None:  # on every rank, so none waits for a file that will not come
        raise CheckpointError(error)


def _write_full(path: str, state: dict[str, Any] | None,
                metadata: Mapping[str, Any] | None) -> str | None:
    """Write ``state`` to ``path`` (rank 0); return None, or the error every rank raises."""
    what = "save_full_checkpoint"
    assert state is not None
    arrays = {name: storable(a) for name, a in state.items()}
    if _INDEX_KEY in arrays:
        return f"{what}: {_INDEX_KEY!r} is reserved; rename that tensor"
    index = with_checksum({
        "format": FULL_FORMAT, "version": FULL_VERSION, "metadata": dict(metadata or {}),
        "tensors": {name: {"shape": list(np.shape(a)), "dtype": dtype_name(a.dtype),
                           "sha256": hashlib.sha256(arrays[name].tobytes()).hexdigest()}
                    for name, a in state.items()}})
    arrays[_INDEX_KEY] = np.frombuffer(canonical_json(index), dtype=np.uint8)
    try:
        atomic_write(path, lambda f: _write_npz(f, arrays))
    except OSError as exc:
        cause = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        fix = _FIXES.get(exc.errno or 0, "check the path and its permissions")
        return (f"{what}: cannot write {path}: {cause} ({exc.strerror or exc}); {fix}. "
                "A file already at that path is left as it was")
    return None


def _read_npz(path: str) -> dict[str, np.ndarray]:
    try:  # our own file handle, so it is closed even when NumPy fails on a damaged zip
        with NPY_HEADER_LOCK, open(path, "rb") as fh, np.load(fh, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}  # each member's header is parsed here
    except Exception as exc:  # zipfile/ValueError/EOFError: all mean a damaged file
        raise CheckpointError(f"load_full_checkpoint: {path} cannot be read as a .npz file "
                              f"({type(exc).__name__}: {exc}); it is truncated or corrupted"
                              ) from None


def _full_index(path: str, raw: dict[str, np.ndarray]) -> dict[str, Any]:
    if _INDEX_KEY not in raw:
        raise CheckpointError(f"load_full_checkpoint: {path} has no {_INDEX_KEY!r} entry; "
                              "it was not written by save_full_checkpoint")
    index = parse_checked_json(raw.pop(_INDEX_KEY).tobytes(), f"{path}:{_INDEX_KEY}",
                               "load_full_checkpoint")
    if index.get("format") != FULL_FORMAT or index.get("version") != FULL_VERSION:
        raise CheckpointError(f"load_full_checkpoint: {path} field format/version: "
                              f"{index.get('format')!r} v{index.get('version')!r}, expected "
                              f"{FULL_FORMAT!r} v{FULL_VERSION}")
    if not isinstance(index.get("tensors"), dict) or not isinstance(index.get("metadata"), dict):
        raise CheckpointError(f"load_full_checkpoint: {path} field tensors/metadata: expected "
                              "objects")
    return index


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
        CheckpointError: the file is missing, not a full checkpoint, its index
            fails its checksum, or an array fails its checksum (naming the
            file and the array).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"load_full_checkpoint: {path} does not exist")
    raw = _read_npz(path)
    index = _full_index(path, raw)
    state = {}
    for name, info in index["tensors"].items():
        a = raw.get(name)
        if a is None:
            raise CheckpointError(f"load_full_checkpoint: {path} lacks array {name!r}")
        if hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() != info.get("sha256"):
            raise CheckpointError(f"load_full_checkpoint: array {name!r} in {path} fails its "
                                  "sha256 check (checksum mismatch: the file is corrupted)")
        try:
            state[name] = restore(a, info["dtype"]).reshape(info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"load_full_checkpoint: {path} field tensors[{name!r}]: "
                                  f"{type(exc).__name__}: {exc}") from None
    if target is not None:
        load_full_state(target, state)
    return (state, index["metadata"]) if metadata else state


def load_full_state(target: Any, state: Mapping[str, Any]) -> None:
    """Copy a ``{name: array}`` state into FSDP (its shards) or a model's parameters.

    Raises:
        CheckpointError: a parameter the state lacks, or a shape that differs.
    """
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
        assign(p, _array.to_host(value))


__all__ = ["FULL_FORMAT", "full_state_of", "load_full_checkpoint", "load_full_state",
           "save_full_checkpoint"]
