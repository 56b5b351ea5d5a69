"""The sharded checkpoint index: its checksum, and a schema check of every field on load.

An index is plain JSON (``index.json`` in a checkpoint directory). Its
``checksum`` field is the sha256 of the canonical JSON text of every other
field (sorted keys, no spaces), so any edit or flipped bit is caught before a
value is trusted; :func:`validate_index` then checks each field's type and
range and the cross-references between tensors, flats and shard files, and
raises :class:`CheckpointError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _array
from ..errors import CheckpointError

FORMAT = "axondist-sharded"
VERSION = 2
INDEX_FILE = "index.json"
CHECKSUM_FIELD = "checksum"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.npy$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64", "complex64", "complex128", "bfloat16"}


def canonical_json(obj: Any) -> bytes:
    """``obj`` as the canonical JSON bytes the checksums are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def with_checksum(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` plus its ``checksum`` field (sha256 of its canonical JSON)."""
    out = {k: v for k, v in body.items() if k != CHECKSUM_FIELD}
    out[CHECKSUM_FIELD] = hashlib.sha256(canonical_json(out)).hexdigest()
    return out


def parse_checked_json(raw: bytes, where: str, what: str) -> dict[str, Any]:
    """Decode JSON ``raw`` read from file ``where`` and verify its ``checksum`` field.

    Raises:
        CheckpointError: not UTF-8 JSON, not an object, no checksum, or a
            checksum that does not match (the file was edited or damaged).
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what}: {where} is not valid JSON ({exc}); the file is "
                              "corrupted") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what}: {where} holds a JSON {type(obj).__name__}, expected an "
                              "object; the file is corrupted")
    stored = obj.get(CHECKSUM_FIELD)
    if not isinstance(stored, str):
        raise CheckpointError(f"{what}: {where} has no {CHECKSUM_FIELD!r} field; the file is "
                              "corrupted or was not written by axondist")
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    try:
        actual = hashlib.sha256(canonical_json(body)).hexdigest()
    except ValueError as exc:  # NaN/inf smuggled in
        raise CheckpointError(f"{what}: {where} holds a value JSON cannot round-trip ({exc})"
                              ) from None
    if actual != stored:
        raise CheckpointError(f"{what}: {where} fails its {CHECKSUM_FIELD!r} check (checksum "
                              "mismatch: the file was edited or is corrupted)")
    return body


class _Checker:
    """Field checks that name the file and the field path in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"load_sharded_checkpoint: {self.where} field {field}: {problem}")

    def obj(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, f"expected an object, got {type(value).__name__}")
        return value

    def keys(self, value: Any, field: str, required: set[str],
             optional: frozenset[str] = frozenset()) -> dict[str, Any]:
        d = self.obj(value, field)
        missing = sorted(required - d.keys())
        if missing:
            raise self.fail(field, f"missing key(s) {missing}")
        extra = sorted(d.keys() - required - optional)
        if extra:
            raise self.fail(field, f"unexpected key(s) {extra}")
        return d

    def integer(self, value: Any, field: str, lo: int = 0, hi: int | None = None) -> int:
        if value.__class__ is not int:
            raise self.fail(field, f"expected an integer, got {type(value).__name__} {value!r}")
        if value < lo or (hi is not None and value > hi):
            top = "" if hi is None else f"..{hi}"
            raise self.fail(field, f"{value} is outside {lo}{top}")
        return value

    def string(self, value: Any, field: str, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(field, f"expected a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise self.fail(field, f"{value!r} is not a valid value")
        return value

    def dtype(self, value: Any, field: str) -> str:
        if value not in _DTYPES:
            raise self.fail(field, f"{value!r} is not a dtype checkpoints store")
        return str(value)

    def shape(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.fail(field, f"expected a list of sizes, got {type(value).__name__}")
        return tuple(self.integer(d, f"{field}[{i}]") for i, d in enumerate(value))


def validate_index(index: Mapping[str, Any], where: str) -> None:
    """Check every field of a (checksum-verified) index body.

    Args:
        index: the index without its checksum field.
        where: the file it came from, for the messages.

    Raises:
        CheckpointError: naming ``where`` and the first bad field.
    """
    c = _Checker(where)
    c.keys(index, "<root>", {"format", "version", "world_size", "step", "tensors", "flats",
                             "optimizer", "metadata"})
    if index["format"] != FORMAT:
        raise c.fail("format", f"{index['format']!r}, expected {FORMAT!r}")
    if index["version"] != VERSION:
        raise c.fail("version", f"{index['version']!r}; this axondist reads version {VERSION}")
    c.integer(index["world_size"], "world_size", 1)
    if index["step"] is not None:
        c.integer(index["step"], "step")
    c.obj(index["metadata"], "metadata")
    flats = _validate_flats(c, c.obj(index["flats"], "flats"))
    tensors = c.obj(index["tensors"], "tensors")
    for name, t in tensors.items():
        f = f"tensors[{name!r}]"
        c.keys(t, f, {"shape", "dtype", "flat", "offset"})
        numel = int(np.prod(c.shape(t["shape"], f"{f}.shape"), dtype=np.int64))
        dtype = c.dtype(t["dtype"], f"{f}.dtype")
        flat_name = c.string(t["flat"], f"{f}.flat")
        offset = c.integer(t["offset"], f"{f}.offset")
        flat = flats.get(flat_name)
        if flat is None:
            if numel:
                raise c.fail(f"{f}.flat", f"names flat {flat_name!r}, which is not in 'flats'")
            continue
        if dtype != flat["dtype"]:
            raise c.fail(f"{f}.dtype", f"{dtype!r} differs from its flat's {flat['dtype']!r}")
        if offset + numel > flat["numel"]:
            raise c.fail(f"{f}.offset", f"elements {offset}..{offset + numel} run past the end "
                                        f"of flat {flat_name!r} ({flat['numel']} elements)")
        _check_covered(c, f, flat_name, flat, offset, offset + numel)
    if index["optimizer"] is not None:
        _validate_optimizer(c, index["optimizer"], tensors)
    elif any(t.startswith("optim/") for t in tensors):
        raise c.fail("optimizer", "null, but the tensors hold optimizer state")


def _validate_flats(c: _Checker, flats: dict[str, Any]) -> dict[str, Any]:
    files: set[str] = set()
    for name, flat in flats.items():
        f = f"flats[{name!r}]"
        c.keys(flat, f, {"numel", "dtype", "shards"})
        numel = c.integer(flat["numel"], f"{f}.numel")
        c.dtype(flat["dtype"], f"{f}.dtype")
        shards = flat["shards"]
        if not isinstance(shards, list):
            raise c.fail(f"{f}.shards", "expected a list")
        end = 0
        for i, s in enumerate(shards):
            sf = f"{f}.shards[{i}]"
            c.keys(s, sf, {"file", "start", "stop", "bytes", "sha256"})
            fname = c.string(s["file"], f"{sf}.file", _FILE_NAME)
            if fname in files:
                raise c.fail(f"{sf}.file", f"{fname!r} is listed twice")
            files.add(fname)
            start = c.integer(s["start"], f"{sf}.start", 0, numel)
            stop = c.integer(s["stop"], f"{sf}.stop", start + 1, numel)
            if start < end:
                raise c.fail(f"{sf}.start", f"{start} overlaps the previous shard (ends at {end}); "
                                            "shards must be sorted and disjoint")
            end = stop
            c.integer(s["bytes"], f"{sf}.bytes", 1)
            c.string(s["sha256"], f"{sf}.sha256", _SHA256)
    return flats


def _check_covered(c: _Checker, field: str, flat_name: str, flat: Mapping[str, Any],
                   lo: int, hi: int) -> None:
    pos = lo
    for s in flat["shards"]:
        if pos >= hi:
            break
        if s["start"] <= pos < s["stop"]:
            pos = s["stop"]
    if pos < hi:
        raise c.fail(field, f"elements {pos}..{hi} of flat {flat_name!r} are in no shard file")


def _validate_optimizer(c: _Checker, opt: Any, tensors: Mapping[str, Any]) -> None:
    c.keys(opt, "optimizer", {"class", "version", "hyperparameters", "step_count", "steps"},
           frozenset({"state_keys", "params"}))
    c.string(opt["class"], "optimizer.class")
    c.obj(opt["hyperparameters"], "optimizer.hyperparameters")
    c.integer(opt["step_count"], "optimizer.step_count")
    steps = c.obj(opt["steps"], "optimizer.steps")
    keys = opt.get("state_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise c.fail("optimizer.state_keys", f"expected a list of names, got {keys!r}")
    for name, n in steps.items():
        c.integer(n, f"optimizer.steps[{name!r}]")
        if name not in tensors:
            raise c.fail(f"optimizer.steps[{name!r}]", "names no parameter tensor")
        for key in keys:
            if f"optim/{name}/{key}" not in tensors:
                raise c.fail("tensors", f"the optimizer state {key!r} of parameter {name!r} "
                                        f"(tensor 'optim/{name}/{key}') is missing")
    for t in tensors:
        if t.startswith("optim/"):
            owner, _, key = t[len("optim/"):].rpartition("/")
            if owner not in steps or key not in keys:
                raise c.fail(f"tensors[{t!r}]", f"optimizer state of {owner!r} that "
                                                "'optimizer.steps' and 'state_keys' do not list")
    params = opt.get("params")
    if params is not None and (not isinstance(params, list)
                               or not all(isinstance(p, str) for p in params)):
        raise c.fail("optimizer.params", f"expected a list of parameter names, got {params!r}")


def storage_dtype(name: str) -> np.dtype:
    """The dtype a ``.npy`` shard of dtype ``name`` holds (bfloat16 as uint16 bits)."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(_array.dtype_named(name))


__all__ = ["CHECKSUM_FIELD", "FORMAT", "INDEX_FILE", "VERSION", "canonical_json",
           "parse_checked_json", "storage_dtype", "validate_index", "with_checksum"]
