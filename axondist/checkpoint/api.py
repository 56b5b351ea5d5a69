"""The sharded checkpoint entry points: :class:`Checkpointer` and the one-call functions."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError
from ..process_group import ProcessGroup, resolve_group
from .directory import committed_history, step_of
from .layouts import layout_state, load_layout
from .reader import CheckpointReader
from .save import SaveHandle, start_save
from .types import ShardedState


def _group_of(target: Any, group: ProcessGroup | None) -> ProcessGroup:
    """``group``, else the target's own group (FSDP, DDP, a pipeline, a TP model), else the
    current world."""
    if group is not None:
        return resolve_group(group)
    for attr in ("group", "process_group"):
        g = getattr(target, attr, None)
        if isinstance(g, ProcessGroup):
            return g
    return resolve_group(None)


def _state_of(target: Any, optimizer: Any, g: ProcessGroup) -> ShardedState:
    if hasattr(target, "sharded_checkpoint_state"):
        state: ShardedState = target.sharded_checkpoint_state(optimizer)
        return state
    return layout_state(target, optimizer, g)


def _checked_keep_last(keep_last: Any, what: str) -> int | None:
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"{what}: keep_last={keep_last!r} must be an int >= 1 (the number of "
                         "checkpoints kept) or None to keep every one")
    return keep_last


def _checked_step(step: Any, what: str) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{what}: step={step!r} must be an int >= 0 (the training step)")
    return step


def save_sharded_checkpoint(path: str | os.PathLike, target: Any, optimizer: Any = None, *,
                            group: ProcessGroup | None = None,
                            metadata: Mapping[str, Any] | None = None,
                            step: int | None = None, keep_last: int | None = None,
                            async_save: bool = False) -> SaveHandle:
    """Save ``target`` (and ``optimizer``'s state) as a new checkpoint under root ``path``.

    Every rank of the group calls it with the same ``path`` (a shared
    directory). The new checkpoint becomes ``path``'s latest only once every
    file is written and checked; until then, and for ever if the save fails or
    is killed, loads see the previous one. A second job saving to the same
    ``path`` meanwhile gets a CheckpointError naming this one's host and pid.
    Works for FSDP (any strategy), DDP or a plain model, a pipeline (its
    ranks' stages) and tensor-parallel layers, and any of these loads what
    another saved.

    Args:
        path: the checkpoint root (created when missing).
        target: a model, :class:`~axondist.DistributedDataParallel`, FSDP,
            :class:`~axondist.pipeline.Pipeline` or tensor-parallel layer/MLP.
        optimizer: an axondist optimizer over ``target``'s (local) parameters.
        group: the saving ranks (default: the target's own group, else the world).
        metadata: JSON-able values stored in the index (returned by the load).
        step: the training step (default: the latest saved step + 1, or 0).
        keep_last: keep only the newest ``keep_last`` checkpoints (None: all).
        async_save: copy the state to host memory and write on a background
            thread; the returned handle's ``wait()`` (collective) commits it.

    Returns:
        A :class:`SaveHandle`; for a blocking save it has already succeeded.

    Raises:
        CheckpointError: another writer holds ``path``, or the save failed on
            some rank (the message names it); the previous checkpoint stays.
        ValueError: a bad ``step`` or ``keep_last``.
    """
    what = "save_sharded_checkpoint"
    step = _checked_step(step, what)
    keep_last = _checked_keep_last(keep_last, what)
    g = _group_of(target, group)
    state = _state_of(target, optimizer, g)
    return start_save(os.fspath(path), state, g, metadata=metadata, step=step,
                      keep_last=keep_last, async_save=bool(async_save))


def write_sharded(path: str | os.PathLike, state: ShardedState, *,
                  group: ProcessGroup | None = None,
                  metadata: Mapping[str, Any] | None = None, step: int | None = None,
                  keep_last: int | None = None) -> str:
    """Save a prepared :class:`ShardedState` as a new checkpoint under root ``path``.

    The low-level form of :func:`save_sharded_checkpoint` for wrappers that
    describe their own shards; every rank of ``group`` calls it.

    Returns:
        The committed checkpoint directory.

    Raises:
        CheckpointError: as for :func:`save_sharded_checkpoint`, or a tensor no
            rank's shards cover.
    """
    g = resolve_group(group)
    handle = start_save(os.fspath(path), state, g, metadata=metadata,
                        step=_checked_step(step, "write_sharded"),
                        keep_last=_checked_keep_last(keep_last, "write_sharded"),
                        async_save=False)
    return handle.wait()


def load_sharded_checkpoint(path: str | os.PathLike, target: Any, optimizer: Any = None, *,
                            verify: bool = True, step: int | None = None,
                            strict: bool = True) -> dict[str, Any]:
    """Load a sharded checkpoint into ``target`` (and ``optimizer``); return its metadata.

    Works whatever world size and layout saved it. Each rank reads only the
    element ranges of the shard files it needs. No communication.

    Args:
        path: a checkpoint root (its latest checkpoint) or one checkpoint directory.
        target: as for :func:`save_sharded_checkpoint`.
        optimizer: the optimizer to restore (None: parameters only).
        verify: check each shard file's sha256 before use.
        step: load the kept checkpoint of this step instead of the latest.
        strict: refuse a checkpoint without optimizer state for one of the
            optimizer's parameters; with False that state starts fresh.

    Raises:
        CheckpointError: no complete checkpoint, an index that fails its
            checksum or schema, a missing or damaged file (naming it), a tensor
            the target has but the checkpoint lacks, or a shape that differs.
    """
    step = _checked_step(step, "load_sharded_checkpoint")
    reader = CheckpointReader(path, verify=verify, step=step)
    try:
        if hasattr(target, "load_sharded_checkpoint_state"):
            target.load_sharded_checkpoint_state(reader, optimizer, strict=strict)
        else:
            load_layout(reader, target, optimizer, strict)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # e.g. hyper-parameters the optimizer refuses
        raise CheckpointError(f"load_sharded_checkpoint: {reader.path}/index.json does not fit "
                              f"the target or optimizer ({type(exc).__name__}: {exc})") from None
    return reader.metadata


class Checkpointer:
    """Periodic checkpoints of one training run under one root directory.

    A thin stateful front to :func:`save_sharded_checkpoint`: it remembers the
    root, the group and ``keep_last``, and the save in flight, which the next
    save (or :meth:`wait`) finishes first, so at most one is outstanding.

    Args:
        path: the checkpoint root.
        keep_last: how many checkpoints to keep (None: all).
        group: the saving ranks (default: each target's own group).
    """

    def __init__(self, path: str | os.PathLike, *, keep_last: int | None = None,
                 group: ProcessGroup | None = None) -> None:
        self.path = os.fspath(path)
        self.keep_last = _checked_keep_last(keep_last, "Checkpointer")
        self.group = group
        self._pending: SaveHandle | None = None

    def save(self, target: Any, optimizer: Any = None, *, step: int,
             metadata: Mapping[str, Any] | None = None, async_save: bool = False) -> SaveHandle:
        """Save a checkpoint of ``step`` (collective); see :func:`save_sharded_checkpoint`.

        Raises:
            CheckpointError: the previous asynchronous save failed (reported
                here, before this one starts), or this one failed.
        """
        self.wait()
        handle = save_sharded_checkpoint(self.path, target, optimizer, group=self.group,
                                         metadata=metadata, step=step, keep_last=self.keep_last,
                                         async_save=async_save)
        if async_save:
            self._pending = handle
        return handle

    def wait(self) -> None:
        """Finish the save in flight, if any (collective); raises its CheckpointError unless
        its handle's ``wait()`` already reported it."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.collected:
            pending.wait()

    def load(self, target: Any, optimizer: Any = None, *, step: int | None = None,
             strict: bool = True, verify: bool = True) -> dict[str, Any]:
        """Load the latest checkpoint (or that of ``step``); return its metadata."""
        return load_sharded_checkpoint(self.path, target, optimizer, verify=verify, step=step,
                                       strict=strict)

    def latest_step(self) -> int | None:
        """The step of the latest committed checkpoint (without a ``latest`` pointer, the
        newest complete step on disk), or None when there is none.

        Raises:
            CheckpointError: a damaged pointer (the message names the steps on disk).
        """
        history = committed_history(self.path, "Checkpointer.latest_step")
        return step_of(history[-1]) if history else None

    def steps(self) -> list[int]:
        """The steps of the kept checkpoints, oldest first (see :meth:`latest_step`)."""
        return [step_of(h) for h in committed_history(self.path, "Checkpointer.steps")]


__all__ = ["Checkpointer", "load_sharded_checkpoint", "save_sharded_checkpoint", "write_sharded"]
