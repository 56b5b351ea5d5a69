"""Reading a sharded checkpoint: the verified index, and element ranges of any tensor."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _array
from ..errors import CheckpointError
from .directory import resolve
from .files import NPY_HEADER_LOCK, file_sha256
from .index import INDEX_FILE, parse_checked_json, storage_dtype, validate_index
from .types import TensorSpec, restore


class CheckpointReader:
    """Read tensors, or element ranges of them, from a sharded checkpoint.

    The index is refused unless its checksum matches and every field passes
    the schema check; each shard file is checked (size, ``.npy`` header and,
    with ``verify``, sha256) the first time it is used, then memory-mapped, so
    a rank reading a range touches only those bytes after the first check.

    Args:
        path: a checkpoint root (its ``latest`` checkpoint is read, or the
            one of ``step``) or one checkpoint directory.
        verify: check each shard file's sha256 against the index the first
            time it is used (reads the whole file once).
        step: read the committed checkpoint of this step instead of the latest.

    Raises:
        CheckpointError: no complete checkpoint, or an index that fails its
            checksum or schema (naming the file and the field).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True,
                 step: int | None = None) -> None:
        self.root = os.fspath(path)
        self.path = resolve(self.root, step)
        self.verify = verify
        index_path = os.path.join(self.path, INDEX_FILE)
        try:
            with open(index_path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise CheckpointError(f"load_sharded_checkpoint: {index_path} cannot be read "
                                  f"({exc}); the checkpoint is incomplete") from None
        self.index: dict[str, Any] = parse_checked_json(raw, index_path,
                                                        "load_sharded_checkpoint")
        validate_index(self.index, index_path)
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def names(self) -> list[str]:
        """Every logical tensor, parameters and optimizer state, in index order."""
        return list(self.index["tensors"])

    @property
    def step(self) -> int | None:
        """The training step the checkpoint was saved at (None when not given)."""
        step: int | None = self.index["step"]
        return step

    @property
    def world_size(self) -> int:
        """How many ranks saved it."""
        return int(self.index["world_size"])

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the ``metadata`` dict given at save time (empty when none was)."""
        return dict(self.index["metadata"])

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The index's optimizer entry, or None when saved without an optimizer.

        Holds what is not an array: ``class``, ``version``, ``hyperparameters``,
        ``step_count``, each parameter's ``steps`` and the ``state_keys``; the
        state arrays are tensors named ``optim/<param>/<key>`` (see :meth:`names`).
        """
        opt: dict[str, Any] | None = self.index["optimizer"]
        return opt

    def spec(self, name: str) -> TensorSpec:
        """Shape, dtype and location of tensor ``name``.

        Raises:
            CheckpointError: no tensor of that name.
        """
        t = self.index["tensors"].get(name)
        if t is None:
            raise CheckpointError(f"checkpoint {self.path}: no tensor named {name!r}; it has "
                                  f"{len(self.index['tensors'])} tensors, e.g. "
                                  f"{self.names[:5]}")
        return TensorSpec(name, tuple(t["shape"]), t["dtype"], t["flat"], int(t["offset"]))

    def _open(self, entry: Mapping[str, Any], dtype: str) -> np.ndarray:
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
            with NPY_HEADER_LOCK:  # the data is mapped, not read: held for the header
                arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except Exception as exc:  # a damaged header: ValueError, SyntaxError, EOFError...
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is not a "
                                  f"readable .npy file ({type(exc).__name__}: {exc})") from None
        expected = entry["stop"] - entry["start"]
        if arr.ndim != 1 or arr.size != expected or arr.dtype != storage_dtype(dtype):
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} holds "
                                  f"{arr.dtype} {arr.shape}, the index says {dtype} "
                                  f"({expected},)")
        arr = restore(arr, dtype)
        self._arrays[fname] = arr
        return arr

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of flattened tensor ``name`` (a new 1-D array).

        Raises:
            CheckpointError: no such tensor, a range outside it, or a damaged
                shard file (naming it).
        """
        t = self.spec(name)
        stop = t.numel if stop is None else stop
        if not 0 <= start <= stop <= t.numel:
            raise CheckpointError(f"CheckpointReader.read: range [{start}, {stop}) is outside "
                                  f"tensor {name!r} of {t.numel} elements")
        out = np.empty(stop - start, dtype=_array.dtype_named(t.dtype))
        if stop == start:
            return out
        flat = self.index["flats"][t.flat]
        lo, hi = t.offset + start, t.offset + stop
        for entry in flat["shards"]:  # validated: sorted, disjoint, covering every tensor
            a, b = max(lo, entry["start"]), min(hi, entry["stop"])
            if b > a:
                src = self._open(entry, flat["dtype"])
                out[a - lo:b - lo] = src[a - entry["start"]:b - entry["start"]]
        return out

    def read_full(self, name: str) -> np.ndarray:
        """Tensor ``name`` at its full shape."""
        return self.read(name).reshape(self.spec(name).shape)

    def verify_all(self) -> None:
        """Check the size, header and sha256 of every shard file (raises CheckpointError)."""
        for flat in self.index["flats"].values():
            for entry in flat["shards"]:
                self._open(entry, flat["dtype"])


__all__ = ["CheckpointReader"]
