"""A checkpoint root: ``step-N`` directories, the ``latest`` pointer, the writer's lock.

A save writes into a hidden staging directory, renames it to a fresh
``step-N`` name once it is complete and verified, then swaps the checksummed
``latest`` pointer file in one ``os.replace``: until that instant the previous
checkpoint is what every load sees. The pointer also lists the committed
checkpoints (``history``, oldest first), so anything else in the root that
matches our naming (staging directories, uncommitted ``step-N`` directories,
temporary files) is debris of an interrupted save, removed by the next save.
The ``.lock`` file (created with ``O_EXCL``) names the host and pid of the
writer holding the root; a lock whose process is gone is taken over.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from .files import atomic_write, fault_point, fsync_dir, remove_tree
from .index import INDEX_FILE, canonical_json, parse_checked_json, with_checksum

LATEST = "latest"
LOCK = ".lock"
POINTER_FORMAT = "axondist-checkpoints"
STAGING_PREFIX = ".writing-"
_STEP_DIR = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_DEBRIS = re.compile(r"^(\.writing-.*|step-\d{8,}(\.\d+)?|\..*\.tmp)$")


def step_dir_name(step: int, copy: int = 0) -> str:
    """``step-00000012`` (``step-00000012.1`` for a re-save of step 12)."""
    return f"step-{step:08d}" + (f".{copy}" if copy else "")


def step_of(name: str) -> int:
    """The step number in a ``step-N`` directory name."""
    m = _STEP_DIR.match(name)
    if m is None:
        raise CheckpointError(f"checkpoint: {name!r} is not a step-N directory name")
    return int(m.group(1))


@dataclass(frozen=True)
class Pointer:
    """The ``latest`` file: the current checkpoint and the committed ones, oldest first."""

    latest: str
    history: tuple[str, ...]


def read_pointer(root: str) -> Pointer | None:
    """The root's ``latest`` pointer, or None when there is none.

    Raises:
        CheckpointError: the pointer fails its checksum or names a bad directory.
    """
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    body = parse_checked_json(raw, path, "load_sharded_checkpoint")
    history = body.get("history")
    if (body.get("format") != POINTER_FORMAT or not isinstance(history, list) or not history
            or not all(isinstance(h, str) and _STEP_DIR.match(h) for h in history)
            or body.get("latest") != history[-1]):
        raise CheckpointError(f"load_sharded_checkpoint: {path} field latest/history: not a "
                              "valid checkpoint pointer; the file is corrupted")
    return Pointer(history[-1], tuple(history))


def write_pointer(root: str, pointer: Pointer) -> None:
    """Swap the ``latest`` pointer in one atomic rename (then fsync the root)."""
    body = with_checksum({"format": POINTER_FORMAT, "latest": pointer.latest,
                          "history": list(pointer.history)})
    atomic_write(os.path.join(root, LATEST), lambda f: f.write(canonical_json(body)))
    fsync_dir(root)


def resolve(path: str, step: int | None = None) -> str:
    """The checkpoint directory that ``path`` (a root or one checkpoint) stands for.

    A root resolves to its ``latest`` checkpoint (or the committed one of
    ``step``); a directory holding ``index.json`` is itself a checkpoint.

    Raises:
        CheckpointError: no checkpoint there, or no committed one of ``step``.
    """
    pointer = read_pointer(path)
    if pointer is not None:
        if step is None:
            return os.path.join(path, pointer.latest)
        for name in reversed(pointer.history):
            if step_of(name) == step:
                return os.path.join(path, name)
        steps = sorted({step_of(n) for n in pointer.history})
        raise CheckpointError(f"load_sharded_checkpoint: {path} holds no checkpoint of step "
                              f"{step}; it holds steps {steps}")
    if step is None and os.path.isfile(os.path.join(path, INDEX_FILE)):
        return path
    raise CheckpointError(
        f"load_sharded_checkpoint: {path} holds no complete checkpoint (neither a {LATEST!r} "
        f"pointer nor an {INDEX_FILE}); a save that was interrupted before its commit leaves "
        "none, so save again")


def next_free_name(root: str, step: int) -> str:
    """A ``step-N`` name not yet used in ``root``."""
    copy = 0
    while os.path.lexists(os.path.join(root, step_dir_name(step, copy))):
        copy += 1
    return step_dir_name(step, copy)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Lock:
    """A held ``.lock`` of a checkpoint root."""

    root: str
    token: str

    def release(self) -> None:
        """Remove the lock file when it is still ours."""
        path = os.path.join(self.root, LOCK)
        try:
            with open(path, encoding="utf-8") as f:
                if json.load(f).get("token") != self.token:
                    return
        except (OSError, ValueError):
            return
        os.remove(path)


def acquire_lock(root: str, what: str, wait: float) -> Lock:
    """Create ``root/.lock`` naming this host and pid.

    A lock held by another thread of this process (another save in flight) is
    waited for, up to ``wait`` seconds; one whose process on this host is gone
    is taken over; any other holder is an error.

    Raises:
        CheckpointError: another writer (named by host and pid) holds the root.
    """
    path = os.path.join(root, LOCK)
    token = uuid.uuid4().hex
    me = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
          "since": time.time()}
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                continue  # released (or half-written by a writer killed while creating it)
            same_host = holder.get("host") == me["host"]
            pid = holder.get("pid")
            if same_host and isinstance(pid, int) and not _pid_alive(pid):
                _remove_stale(path, holder)
                continue
            if same_host and pid == me["pid"] and time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            raise CheckpointError(
                f"{what}: {root} is being written by another writer (host {holder.get('host')}, "
                f"pid {pid}, since {time.ctime(holder.get('since', 0))}); two jobs must not "
                f"save to one directory. If that writer is gone, delete {path}") from None
        lock = Lock(root, token)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            fault_point("done")
        except BaseException:
            _remove_quietly(path)
            raise
        return lock


def _holder(path: str) -> dict[str, Any] | None:
    """The lock file's contents; None when it vanished. A lock left empty or unreadable by a
    writer killed while creating it is removed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        if isinstance(holder, dict):
            return holder
    except ValueError:
        pass
    if time.time() - _mtime(path) > 2.0:  # not a writer between create and write
        _remove_quietly(path)
        return None
    time.sleep(0.01)
    return None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return time.time()


def _remove_stale(path: str, holder: dict[str, Any]) -> None:
    if _holder(path) == holder:
        _remove_quietly(path)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_debris(root: str, pointer: Pointer | None, keep: str = "") -> list[str]:
    """Remove what interrupted saves left in ``root``; return the names removed.

    Only names this module creates are touched (staging directories,
    ``step-N`` directories the pointer does not list, ``.*.tmp`` files);
    ``keep`` (this save's staging directory) is spared.
    """
    committed = set(pointer.history) if pointer is not None else set()
    removed = []
    for name in sorted(os.listdir(root)):
        if name in committed or name == keep or not _DEBRIS.match(name):
            continue
        remove_tree(os.path.join(root, name))
        removed.append(name)
    return removed


def commit(root: str, staging: str, step: int, keep_last: int | None) -> str:
    """Rename complete ``staging`` to a new ``step-N`` name, swap the pointer, prune.

    Returns:
        The new checkpoint's directory name.
    """
    pointer = read_pointer(root)
    name = next_free_name(root, step)
    os.rename(os.path.join(root, staging), os.path.join(root, name))
    fsync_dir(root)
    fault_point("done")
    history = [h for h in (pointer.history if pointer else ()) if step_of(h) != step] + [name]
    if keep_last is not None:
        history = history[-keep_last:]
    new = Pointer(name, tuple(history))
    try:
        write_pointer(root, new)
    except BaseException:
        if read_pointer(root) != new:  # not swapped: the save failed, the old one stands
            raise
    try:  # committed: what is left is clean-up, which the next save redoes when this fails
        remove_debris(root, new)
        fsync_dir(root)
    except OSError:
        pass
    return name


__all__ = ["LATEST", "LOCK", "Lock", "Pointer", "STAGING_PREFIX", "acquire_lock", "commit",
           "next_free_name", "read_pointer", "remove_debris", "resolve", "step_dir_name",
           "step_of", "write_pointer"]
