"""Saving a sharded checkpoint: lock, stage, write (optionally in the background), commit.

Rank 0 takes the root's lock and makes a staging directory; every rank
writes its shard files there (on a background thread for an asynchronous
save, from host copies taken before the call returns); rank 0 learns every
rank's files (through a collective, or for an asynchronous save through
marker files its thread waits for), writes the checksummed index, re-checks
every file against it and commits (see :mod:`.directory`). Every failure, on
any rank, is reported on every rank as one :class:`CheckpointError`, and
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..process_group import ProcessGroup
from .directory import (
    STAGING_PREFIX,
    Lock,
    acquire_lock,
    commit,
    committed_history,
    remove_debris,
    step_of,
)
from .files import atomic_write, fsync_dir, remove_tree
from .index import FORMAT, INDEX_FILE, VERSION, canonical_json, with_checksum
from .reader import CheckpointReader
from .types import ShardedState, TensorSpec, dtype_name, storable

_WHAT = "save_sharded_checkpoint"
LOCK_WAIT = 120.0  # seconds a save waits for an earlier save of this same process
COMMIT_WAIT = 600.0  # seconds rank 0's writer waits for the other ranks' files (async saves)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class SaveHandle:
    """A save in progress; :meth:`wait` reports its outcome.

    ``wait`` is collective: every rank of the saving group calls it (a new
    save through :class:`Checkpointer` calls it for you). An asynchronous save
    is committed by rank 0's writer thread as soon as every rank's files are
    written; until then the previous checkpoint stays the latest.
    """

    def __init__(self, job: _SaveJob | None, result: str | None = None) -> None:
        self._job = job
        self._result = result
        self._error: CheckpointError | None = None

    @property
    def collected(self) -> bool:
        """True once :meth:`wait` has run (its outcome is kept and re-raised by later waits)."""
        return self._job is None

    def done(self) -> bool:
        """True once this rank's part is done: its files written (on rank 0 of an
        asynchronous save, the checkpoint committed or failed)."""
        return self._job is None or not self._job.thread_alive()

    def wait(self) -> str:
        """Finish the save on every rank; return the committed checkpoint directory.

        Raises:
            CheckpointError: the save failed on some rank (the message names
                it and the cause); the previous checkpoint is still the latest.
        """
        if self._job is not None:
            job, self._job = self._job, None
            try:
                self._result = job.finish()
            except CheckpointError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class _SaveJob:
    """One save's state between ``start`` and ``finish`` (both collective)."""

    def __init__(self, root: str, state: ShardedState, g: ProcessGroup,
                 metadata: Mapping[str, Any] | None, step: int | None,
                 keep_last: int | None) -> None:
        self.root, self.state, self.g = root, state, g
        self.b = g.backend_for(_WHAT)
        self.metadata = dict(metadata or {})
        self.step, self.keep_last = step, keep_last
        self.lock: Lock | None = None
        self.staging = ""
        self.entries: list[dict[str, Any]] = []
        self.error = ""
        self._thread: threading.Thread | None = None
        self.post_error = ""  # a rank that could not post its marker file (async saves)
        self.cancelled: list[str] = []  # rank 0: those errors; its writer stops waiting
        self.result: tuple[str, str] | None = None  # rank 0 of an async save: the outcome

    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- start: lock and staging (rank 0), then every rank's files --------------------------

    def _open(self) -> tuple[str, Any, Any]:
        try:
            os.makedirs(self.root, exist_ok=True)
            self.lock = acquire_lock(self.root, _WHAT, LOCK_WAIT)
            history = committed_history(self.root, _WHAT)
            step = self.step
            if step is None:
                step = step_of(history[-1]) + 1 if history else 0
            staging = f"{STAGING_PREFIX}{uuid.uuid4().hex}"
            remove_debris(self.root, history)
            os.mkdir(os.path.join(self.root, staging))
            return "ok", staging, step
        except BaseException as exc:
            if self.lock is not None:
                self.lock.release()
                self.lock = None
            return "error", f"{_WHAT}: cannot start a save in {self.root}: {_describe(exc)}", None

    def start(self, background: bool) -> None:
        opened = self._open() if self.g.rank == 0 else None
        status, staging, step = self.b.broadcast_object(opened, 0)
        if status != "ok":
            raise CheckpointError(staging)
        self.staging, self.step = staging, step
        try:
            shards = [(s, storable(s.data).reshape(-1)) for s in self.state.shards]
            if background:  # host copies now: training may change the arrays once we return
                shards = [(s, d if s.owned else _private(d, s.data)) for s, d in shards]
        except BaseException as exc:  # reported to every rank by finish(), like a write error
            self.error, shards = f"rank {self.g.rank}: {_describe(exc)}", []
        if background:
            self._thread = threading.Thread(target=self._background, args=(shards,),
                                            name="axondist-checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._write(shards)

    def _report(self) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], Any]:
        """What this rank tells rank 0: its error (or ""), its files, tensors and optimizer."""
        return (self.error, self.entries, [_spec_json(t) for t in self.state.tensors],
                self.state.optimizer)

    def _background(self, shards: list[tuple[Any, np.ndarray]]) -> None:
        """Write this rank's files; then rank 0 commits as soon as every rank has reported
        through a marker file, so the save becomes the latest while training goes on."""
        self._write(shards)
        if self.g.rank != 0:
            try:
                body = canonical_json(list(self._report()))
                atomic_write(self._marker(self.g.rank), lambda f: f.write(body))
            except BaseException as exc:
                self.post_error = f"rank {self.g.rank}: {_describe(exc)}"
            return
        everyone: list[Any] = [self._report()]
        for r in range(1, self.g.world_size):
            report = self._await_marker(r)
            if report is None:
                self.result = ("error", f"{_WHAT}: rank {r} did not report its files "
                                        f"({'; '.join(self.cancelled) or 'timed out'})")
                self._abandon()
                return
            everyone.append(report)
        self.result = self._commit(everyone)

    def _marker(self, rank: int) -> str:
        return os.path.join(self.root, self.staging, f"rank{rank}.done.json")

    def _await_marker(self, rank: int) -> Any:
        deadline = time.monotonic() + COMMIT_WAIT
        path = self._marker(rank)
        while not os.path.exists(path):
            if self.cancelled or time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        with open(path, "rb") as f:
            report = json.loads(f.read())
        os.remove(path)
        return report

    def _abandon(self) -> None:
        try:
            remove_tree(os.path.join(self.root, self.staging))
        except BaseException:
            pass  # the next save removes it
        if self.lock is not None:
            self.lock.release()

    def _write(self, shards: list[tuple[Any, np.ndarray]]) -> None:
        try:
            directory = os.path.join(self.root, self.staging)
            pieces: dict[str, int] = {}
            for sh, data in shards:
                if data.size == 0:
                    continue
                k = pieces[sh.flat] = pieces.get(sh.flat, -1) + 1
                fname = f"{sh.flat}.rank{self.g.rank}" + (f".{k}" if k else "") + ".npy"
                nbytes, digest = atomic_write(os.path.join(directory, fname),
                                              functools.partial(_write_npy, data=data))
                self.entries.append({"flat": sh.flat, "numel": int(sh.numel),
                                     "dtype": dtype_name(sh.data.dtype), "file": fname,
                                     "start": int(sh.start), "stop": int(sh.start + data.size),
                                     "bytes": nbytes, "sha256": digest})
            fsync_dir(directory)
        except BaseException as exc:  # reported to every rank by finish()
            self.error = f"rank {self.g.rank}: {_describe(exc)}"
            if not isinstance(exc, (OSError, CheckpointError)):
                self.error += "\n" + "".join(traceback.format_exception(exc))

    # --- finish: agree, index, verify, commit -----------------------------------------------

    def finish(self) -> str:
        if self._thread is None:
            everyone = self.b.allgather_object(self._report())
            result = self._commit(everyone) if self.g.rank == 0 else None
        else:
            if self.g.rank != 0:
                self._thread.join()
            posted = self.b.allgather_object(self.post_error)
            if self.g.rank == 0:
                self.cancelled = [e for e in posted if e]
            self._thread.join()
            result = self.result
        status, text = self.b.broadcast_object(result, 0)
        if status != "ok":
            raise CheckpointError(text)
        return str(text)

    def _commit(self, everyone: list[Any]) -> tuple[str, str]:
        staging = os.path.join(self.root, self.staging)
        try:
            errors = [e for e, *_ in everyone if e]
            if errors:
                raise CheckpointError(f"{_WHAT}: writing the shard files failed on "
                                      f"{len(errors)} rank(s): " + "; ".join(errors))
            index = with_checksum(_build_index(everyone, self.g.world_size, self.step,
                                               self.metadata))
            text = canonical_json(index)
            atomic_write(os.path.join(staging, INDEX_FILE), lambda f: f.write(text))
            fsync_dir(staging)
            CheckpointReader(staging, verify=False).verify_all()  # every file, as a load sees it
            assert self.step is not None
            name = commit(self.root, self.staging, self.step, self.keep_last)
            return "ok", os.path.join(self.root, name)
        except BaseException as exc:
            try:
                remove_tree(staging)
            except BaseException:
                pass  # the next save removes it
            msg = _describe(exc)
            return "error", msg if msg.startswith(_WHAT) else f"{_WHAT}: {msg}"
        finally:
            if self.lock is not None:
                self.lock.release()


def _private(host: np.ndarray, original: Any) -> np.ndarray:
    """``host`` (the host form of ``original``), copied unless it already is a copy."""
    return np.array(host, copy=True) if isinstance(original, np.ndarray) else host


def _write_npy(f: Any, data: np.ndarray) -> None:
    np.lib.format.write_array(f, data, allow_pickle=False)


def _spec_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "shape": [int(d) for d in t.shape], "dtype": t.dtype,
            "flat": t.flat, "offset": int(t.offset)}


def _build_index(everyone: list[Any], world_size: int, step: int | None,
                 metadata: dict[str, Any]) -> dict[str, Any]:
    flats: dict[str, dict[str, Any]] = {}
    tensors: dict[str, dict[str, Any]] = {}
    optimizer: dict[str, Any] | None = None
    for rank, (_, entries, specs, opt) in enumerate(everyone):
        for e in entries:
            flat = flats.setdefault(e["flat"], {"numel": e["numel"], "dtype": e["dtype"],
                                                "shards": []})
            if (flat["numel"], flat["dtype"]) != (e["numel"], e["dtype"]):
                raise CheckpointError(f"{_WHAT}: rank {rank} wrote flat {e['flat']!r} as "
                                      f"{e['numel']} {e['dtype']} elements, another rank as "
                                      f"{flat['numel']} {flat['dtype']}")
            flat["shards"].append({k: e[k] for k in ("file", "start", "stop", "bytes", "sha256")})
        for s in specs:
            spec = {k: s[k] for k in ("shape", "dtype", "flat", "offset")}
            if tensors.setdefault(s["name"], spec) != spec:
                raise CheckpointError(f"{_WHAT}: ranks disagree on tensor {s['name']!r}: "
                                      f"{tensors[s['name']]} vs {spec} (rank {rank})")
        optimizer = _merge_optimizer(optimizer, opt, rank)
    for name, flat in flats.items():
        flat["shards"].sort(key=lambda s: s["start"])
        end = 0
        for s in flat["shards"]:
            if s["start"] < end:
                raise CheckpointError(f"{_WHAT}: two ranks wrote overlapping elements of flat "
                                      f"{name!r} (at {s['start']}); each element must have one "
                                      "writer")
            end = s["stop"]
    for name, t in tensors.items():
        _check_covered(name, t, flats)
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "step": step,
            "tensors": tensors, "flats": flats, "optimizer": optimizer, "metadata": metadata}


def _merge_optimizer(have: dict[str, Any] | None, opt: dict[str, Any] | None, rank: int
                     ) -> dict[str, Any] | None:
    if opt is None:
        return have
    if have is None:
        return {**opt, "steps": dict(opt["steps"])}
    if opt["class"] != have["class"]:
        raise CheckpointError(f"{_WHAT}: rank {rank} saves a {opt['class']} optimizer, an "
                              f"earlier rank a {have['class']}")
    have["steps"].update(opt["steps"])
    if "params" in have:
        have["params"] = sorted(set(have["params"]) | set(opt.get("params", [])))
    have["state_keys"] = sorted(set(have.get("state_keys", [])) | set(opt.get("state_keys", [])))
    return have


def _check_covered(name: str, t: Mapping[str, Any], flats: Mapping[str, Any]) -> None:
    numel = int(np.prod(t["shape"], dtype=np.int64))
    lo, hi = t["offset"], t["offset"] + numel
    pos = lo
    for s in flats.get(t["flat"], {"shards": []})["shards"]:
        if pos >= hi:
            break
        if s["start"] <= pos < s["stop"]:
            pos = s["stop"]
    if numel and pos < hi:
        raise CheckpointError(f"{_WHAT}: no rank wrote elements {pos}..{hi} of flat "
                              f"{t['flat']!r}, which tensor {name!r} needs")


def start_save(root: str, state: ShardedState, g: ProcessGroup, *,
               metadata: Mapping[str, Any] | None, step: int | None, keep_last: int | None,
               async_save: bool) -> SaveHandle:
    """Start a save of ``state`` into checkpoint root ``root``; see :class:`SaveHandle`."""
    job = _SaveJob(root, state, g, metadata, step, keep_last)
    job.start(background=async_save)
    handle = SaveHandle(job)
    if not async_save:
        handle.wait()
    return handle


__all__ = ["LOCK_WAIT", "SaveHandle", "start_save"]
