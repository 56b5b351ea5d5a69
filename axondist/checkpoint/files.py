"""Durable file writes for checkpoints: temporary name, fsync, rename, fsync the directory.

Every step that changes a checkpoint directory (a file written, a directory
renamed, the ``latest`` pointer swapped, an old checkpoint removed) passes
through :func:`fault_point`, a test hook: with ``AXONDIST_CHECKPOINT_FAULT``
set to ``KIND:K`` the K-th such step of this process is made to fail in the
way KIND names (``kill`` and ``kill-tmp``: SIGKILL after or before the file
is renamed into place; ``enospc``, ``erofs``: the OSError a full disk or a
read-only file system raises; ``pause``: wait until the file named by
``AXONDIST_CHECKPOINT_RELEASE`` exists). Unset, it costs one look-up of the variable.
"""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..backends import settings
from ..errors import CheckpointError

FAULT_ENV = "AXONDIST_CHECKPOINT_FAULT"
RELEASE_ENV = "AXONDIST_CHECKPOINT_RELEASE"
_HASH_CHUNK = 1 << 22
_events = itertools.count(1)  # steps seen by fault_point in this process


def fault_point(stage: str) -> None:
    """Count one change to a checkpoint directory; inject the configured fault at the K-th.

    ``stage`` is ``"tmp"`` (bytes written, not yet renamed) or ``"done"``
    (the change is in place). Only ``kill-tmp`` acts on ``"tmp"``.
    """
    spec: str | None = settings.read(FAULT_ENV)  # per call: a test sets it between steps
    if not spec:
        return
    kind, _, k = spec.partition(":")
    if (stage == "tmp") != (kind == "kill-tmp"):
        return
    if next(_events) != int(k):
        return
    if kind in ("kill", "kill-tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    elif kind == "erofs":
        raise OSError(errno.EROFS, "Read-only file system (injected)")
    elif kind == "pause":
        release: str = settings.read(RELEASE_ENV) or ""
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        raise CheckpointError(f"{FAULT_ENV}={spec!r}: unknown kind {kind!r}; use kill, "
                              "kill-tmp, enospc, erofs or pause")


class HashingWriter(io.RawIOBase):
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


def fsync_dir(path: str) -> None:
    """Make a rename or removal inside directory ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[Any], Any]) -> tuple[int, str]:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, rename it to ``path``.

    Returns:
        ``(bytes written, their sha256 hex digest)``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            hw = HashingWriter(f)
            write(hw)
            f.flush()
            os.fsync(f.fileno())
        fault_point("tmp")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fault_point("done")
    return hw.count, hw.sha.hexdigest()


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


#: Held while NumPy parses a .npy header. The header is a Python literal that NumPy reads
#: with ``ast.literal_eval``, and CPython 3.11's AST constructor keeps its recursion depth in
#: state shared by threads: mock-world ranks loading at once can raise "AST constructor
#: recursion depth mismatch" (CPython gh-106905), which would read as a damaged file.
NPY_HEADER_LOCK = threading.Lock()


def remove_tree(path: str) -> None:
    """Remove a file or directory tree (missing is fine), as one counted change."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
    fault_point("done")


__all__ = ["FAULT_ENV", "RELEASE_ENV", "HashingWriter", "atomic_write", "fault_point",
           "NPY_HEADER_LOCK", "file_sha256", "fsync_dir", "remove_tree"]
