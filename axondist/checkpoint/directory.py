"""A checkpoint root: ``step-N`` directories, the ``latest`` pointer, the writer's lock.

A save writes into a hidden staging directory, renames it to a fresh
``step-N`` name once it is complete and verified, then swaps the checksummed
``latest`` pointer file in one ``os.replace``: until that instant the previous
checkpoint is what every load sees. The pointer lists the committed
checkpoints (``history``, oldest first), a hint checked against the disk: an
entry whose directory is gone (a root copied without its newest step folder)
is left out, a complete ``step-N`` directory it does not list (a save killed
between its rename and its swap, or a pointer the user deleted) is adopted,
never deleted, and with no pointer, or one whose latest is gone, the newest
complete step on disk is the latest. Only a save's own supersession (a re-save
of the step, ``keep_last``) removes a complete checkpoint, after its commit.
Staging directories, ``step-N`` directories without an index and temporary
files are debris of an interrupted save, removed by the next save. The
``.lock`` file (created with ``O_EXCL``) names the host and pid of the writer
holding the root; a lock whose process is gone is taken over.
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
from .index import INDEX_FILE, canonical_json, parse_checked_json, validate_index, with_checksum

LATEST = "latest"
LOCK = ".lock"
POINTER_FORMAT = "axondist-checkpoints"
STAGING_PREFIX = ".writing-"
RETIRING_PREFIX = ".removing-"
REPAIR_HINT = ("axondist.checkpoint.repair(root) (or: python -m axondist checkpoint repair "
               "ROOT)")
_STEP_DIR = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_DEBRIS = re.compile(r"^(\.writing-.*|\.removing-.*|step-\d{8,}(\.\d+)?|\..*\.tmp)$")


def step_dir_name(step: int, copy: int = 0) -> str:
    """``step-00000012`` (``step-00000012.1`` for a re-save of step 12)."""
    return f"step-{step:08d}" + (f".{copy}" if copy else "")


def step_of(name: str) -> int:
    """The step number in a ``step-N`` directory name."""
    m = _STEP_DIR.match(name)
    if m is None:
        raise CheckpointError(f"checkpoint: {name!r} is not a step-N directory name")
    return int(m.group(1))


def _step_key(name: str) -> tuple[int, int]:
    m = _STEP_DIR.match(name)
    assert m is not None
    return int(m.group(1)), int(m.group(2) or 0)


@dataclass(frozen=True)
class Pointer:
    """The ``latest`` file: the current checkpoint and the committed ones, oldest first."""

    latest: str
    history: tuple[str, ...]


def inspect_pointer(root: str) -> tuple[Pointer | None, str]:
    """The root's ``latest`` pointer (None when there is none), or what is wrong with it."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:  # a folder named latest, no permission
        return None, f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    try:
        body = parse_checked_json(raw, path, "checkpoint")
    except CheckpointError as exc:
        return None, str(exc).split(f"{path} ", 1)[-1]
    history = body.get("history")
    if (body.get("format") != POINTER_FORMAT or not isinstance(history, list) or not history
            or not all(isinstance(h, str) and _STEP_DIR.match(h) for h in history)
            or body.get("latest") != history[-1]):
        return None, "field latest/history: not a valid checkpoint pointer; the file is corrupted"
    return Pointer(history[-1], tuple(history)), ""


def _corrupt_pointer(root: str, problem: str, what: str) -> CheckpointError:
    """The error for a damaged pointer: what is wrong, the steps on disk, how to go on."""
    on_disk = history_on_disk(root, None)
    path = os.path.join(root, LATEST)
    if not on_disk:
        return CheckpointError(f"{what}: the {LATEST!r} pointer {path} {problem}; no complete "
                               f"checkpoint is on disk under {root}: delete {path} and save "
                               "again")
    steps = sorted({step_of(n) for n in on_disk})
    return CheckpointError(
        f"{what}: the {LATEST!r} pointer {path} {problem}. The complete checkpoints on disk are "
        f"steps {steps}: load one with load_sharded_checkpoint({root!r}, target, "
        f"step={steps[-1]}), or rebuild the pointer from them with {REPAIR_HINT}")


def read_pointer(root: str, what: str = "load_sharded_checkpoint") -> Pointer | None:
    """The root's ``latest`` pointer, or None when there is none.

    Raises:
        CheckpointError: the pointer is damaged (fails its checksum, names a
            bad directory, or is not a file); the message names the complete
            steps on disk and how to load or repair them.
    """
    pointer, problem = inspect_pointer(root)
    if problem:
        raise _corrupt_pointer(root, problem, what)
    return pointer


def _has_valid_index(directory: str) -> bool:
    try:
        with open(os.path.join(directory, INDEX_FILE), "rb") as f:
            raw = f.read()
        validate_index(parse_checked_json(raw, directory, "checkpoint"), directory)
    except (OSError, CheckpointError):
        return False
    return True


def history_on_disk(root: str, pointer: Pointer | None) -> tuple[str, ...]:
    """The committed checkpoints of ``root``, oldest first, the latest last.

    The disk decides; the pointer is a hint, checked. Its entries whose
    directory still holds an ``index.json`` count (a root copied without its
    newest step folder leaves the pointer naming a step that is gone), plus
    every complete ``step-N`` directory (its index passes its checksum and
    schema) that it does not list, in step order. The pointer's latest stays
    the latest while it is on disk; otherwise (or without a pointer) the
    newest step on disk is.
    """
    listed = set(pointer.history) if pointer is not None else set()
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    extra = [n for n in names if n not in listed and _STEP_DIR.match(n)
             and _has_valid_index(os.path.join(root, n))]
    if pointer is None:
        return tuple(sorted(extra, key=_step_key))
    present = [h for h in pointer.history if os.path.isfile(os.path.join(root, h, INDEX_FILE))]
    if not extra and len(present) == len(pointer.history):
        return pointer.history
    if present and present[-1] == pointer.latest:
        return (*sorted([*extra, *present[:-1]], key=_step_key), pointer.latest)
    return tuple(sorted([*extra, *present], key=_step_key))


def committed_history(root: str, what: str) -> tuple[str, ...]:
    """:func:`history_on_disk` of ``root``'s pointer (empty for a root that does not exist).

    Raises:
        CheckpointError: a damaged pointer (see :func:`read_pointer`).
    """
    if not os.path.isdir(root):
        return ()
    return history_on_disk(root, read_pointer(root, what))


def write_pointer(root: str, pointer: Pointer) -> None:
    """Swap the ``latest`` pointer in one atomic rename (then fsync the root)."""
    body = with_checksum({"format": POINTER_FORMAT, "latest": pointer.latest,
                          "history": list(pointer.history)})
    atomic_write(os.path.join(root, LATEST), lambda f: f.write(canonical_json(body)))
    fsync_dir(root)


def resolve(path: str, step: int | None = None) -> str:
    """The checkpoint directory that ``path`` (a root or one checkpoint) stands for.

    A root resolves to its latest checkpoint (the pointer's, else the newest
    complete step on disk), or to the committed one of ``step``, which needs
    no pointer; a directory holding ``index.json`` is itself a checkpoint.

    Raises:
        CheckpointError: no checkpoint there, no committed one of ``step``, or
            a damaged pointer when no ``step`` is given.
    """
    what = "load_sharded_checkpoint"
    pointer, problem = inspect_pointer(path) if os.path.isdir(path) else (None, "")
    if problem and step is None:
        raise _corrupt_pointer(path, problem, what)
    history = history_on_disk(path, pointer) if os.path.isdir(path) else ()
    if history and step is None:
        return os.path.join(path, history[-1])
    if history:
        for name in reversed(history):
            if step_of(name) == step:
                return os.path.join(path, name)
        steps = sorted({step_of(n) for n in history})
        raise CheckpointError(f"{what}: {path} holds no checkpoint of step {step}; it holds "
                              f"steps {steps}")
    if step is None and os.path.isfile(os.path.join(path, INDEX_FILE)):
        return path
    raise CheckpointError(
        f"{what}: {path} holds no complete checkpoint (neither a {LATEST!r} pointer nor a "
        f"step-N directory with a valid {INDEX_FILE}); a save that was interrupted before its "
        "commit leaves none, so save again")


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


def remove_debris(root: str, committed: tuple[str, ...], keep: str = "") -> list[str]:
    """Remove what interrupted saves left in ``root``; return the names removed.

    Only names this module creates are touched: staging and retiring
    directories, ``.*.tmp`` files, and ``step-N`` directories that are not
    ``committed`` and hold no ``index.json`` (one whose index is damaged is
    left for its owner). ``keep`` (this save's staging directory) is spared.
    """
    removed = []
    for name in sorted(os.listdir(root)):
        if name in committed or name == keep or not _DEBRIS.match(name):
            continue
        if _STEP_DIR.match(name) and os.path.lexists(os.path.join(root, name, INDEX_FILE)):
            continue
        remove_tree(os.path.join(root, name))
        removed.append(name)
    return removed


def retire(root: str, name: str) -> None:
    """Remove checkpoint ``name``: renamed out of the ``step-N`` names first, so a removal cut
    short leaves debris, never a half-deleted checkpoint that looks complete."""
    hidden = os.path.join(root, f"{RETIRING_PREFIX}{name}.{uuid.uuid4().hex}")
    os.rename(os.path.join(root, name), hidden)
    remove_tree(hidden)


def commit(root: str, staging: str, step: int, keep_last: int | None) -> str:
    """Rename complete ``staging`` to a new ``step-N`` name, swap the pointer, prune.

    Only the checkpoints this save supersedes (an earlier save of ``step``,
    and with ``keep_last`` the oldest beyond it) are removed, after the swap.

    Returns:
        The new checkpoint's directory name.
    """
    history = committed_history(root, "save_sharded_checkpoint")
    name = next_free_name(root, step)
    os.rename(os.path.join(root, staging), os.path.join(root, name))
    fsync_dir(root)
    fault_point("done")
    kept = [h for h in history if step_of(h) != step] + [name]
    if keep_last is not None:
        kept = kept[-keep_last:]
    new = Pointer(name, tuple(kept))
    try:
        write_pointer(root, new)
    except BaseException:
        if inspect_pointer(root)[0] != new:  # not swapped: the save failed, the old one stands
            raise
    try:  # committed: what is left is clean-up, which the next save redoes when this fails
        for old in history:
            if old not in new.history:
                retire(root, old)
        remove_debris(root, new.history)
        fsync_dir(root)
    except OSError:
        pass
    return name


__all__ = ["LATEST", "LOCK", "REPAIR_HINT", "RETIRING_PREFIX", "Lock", "Pointer",
           "STAGING_PREFIX", "acquire_lock", "commit", "committed_history", "history_on_disk",
           "inspect_pointer", "next_free_name", "read_pointer", "remove_debris", "resolve",
           "retire", "step_dir_name", "step_of", "write_pointer"]
