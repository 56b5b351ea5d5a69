"""Rebuilding a checkpoint root's ``latest`` pointer from the complete steps on disk."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..errors import CheckpointError
from .directory import (
    LATEST,
    Pointer,
    acquire_lock,
    history_on_disk,
    inspect_pointer,
    step_of,
    write_pointer,
)

_WHAT = "checkpoint.repair"


@dataclass(frozen=True)
class Repaired:
    """What :func:`repair` found and did."""

    steps: tuple[int, ...]
    """The committed steps after the repair, oldest first (the last is the latest)."""
    problem: str
    """What was wrong with the old pointer ("" when it was missing or sound)."""
    moved_aside: str | None
    """Where a damaged pointer (file or folder) was moved, or None."""
    rewritten: bool
    """True when a new pointer was written."""


def _aside_name(root: str) -> str:
    n = 0
    while os.path.lexists(os.path.join(root, f"{LATEST}.corrupt" + (f".{n}" if n else ""))):
        n += 1
    return os.path.join(root, f"{LATEST}.corrupt" + (f".{n}" if n else ""))


def repair(root: str | os.PathLike) -> Repaired:
    """Rebuild ``root``'s ``latest`` pointer from the complete checkpoints on disk.

    A damaged pointer (garbage, a failed checksum, a folder) is moved aside to
    ``latest.corrupt`` and a new one lists every complete ``step-N``
    directory, in step order, the newest as the latest; a sound pointer gains
    the complete steps it does not list. No checkpoint is removed. Takes the
    root's lock, so it refuses to run while a save is writing there.

    Args:
        root: the checkpoint root.

    Returns:
        A :class:`Repaired` naming the steps kept and what changed.

    Raises:
        CheckpointError: ``root`` is not a directory, holds no complete
            checkpoint, or a save holds its lock.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{_WHAT}: {root} is not a directory; pass the checkpoint root "
                              "(the folder holding the step-N directories)")
    lock = acquire_lock(root, _WHAT, wait=0.0)
    try:
        pointer, problem = inspect_pointer(root)
        history = history_on_disk(root, pointer)
        if not history:
            raise CheckpointError(f"{_WHAT}: {root} holds no complete checkpoint (no step-N "
                                  "directory with a valid index.json); there is nothing to load, "
                                  "so save again")
        moved = None
        if problem:
            moved = _aside_name(root)
            os.rename(os.path.join(root, LATEST), moved)
        rewritten = pointer is None or history != pointer.history
        if rewritten:
            write_pointer(root, Pointer(history[-1], history))
    finally:
        lock.release()
    return Repaired(tuple(step_of(h) for h in history), problem, moved, rewritten)


def main(argv: list[str]) -> int:
    """``python -m axondist checkpoint repair ROOT``: print what was done; 0 on success,
    1 when the root cannot be repaired, 2 for bad arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m axondist checkpoint",
        description="Rebuild a checkpoint root's 'latest' pointer from the complete steps on "
                    "disk (a damaged pointer is moved aside to latest.corrupt; nothing is "
                    "deleted).")
    parser.add_argument("action", choices=("repair",), help="what to do")
    parser.add_argument("root", help="the checkpoint root")
    args = parser.parse_args(argv)
    try:
        done = repair(args.root)
    except CheckpointError as exc:
        print(f"axondist {exc}", flush=True)
        return 1
    if done.problem:
        print(f"the pointer {os.path.join(args.root, LATEST)} {done.problem}; moved it to "
              f"{done.moved_aside}")
    state = "rewrote the pointer" if done.rewritten else "the pointer was sound"
    print(f"{state}: steps {list(done.steps)}, latest step {done.steps[-1]}")
    return 0


__all__ = ["Repaired", "main", "repair"]
