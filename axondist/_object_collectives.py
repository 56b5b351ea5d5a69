"""Collectives of small picklable Python objects over a process group (metadata: sizes,
names, settings), torch.distributed's ``*_object`` calls. Every function takes an optional
``group`` (the current world when None); objects travel pickled, through the group's
backend (:meth:`~axondist.backends.base.Backend.allgather_object` and
:meth:`~axondist.backends.base.Backend.broadcast_object`). Their public home is
:mod:`axondist.comm`, beside the array collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._call_args import member
from ._validate import as_rank
from .errors import CollectiveMismatchError
from .process_group import ProcessGroup


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (for metadata)."""
    return member(group, "all_gather_object")[1].allgather_object(obj)


def broadcast_object(obj: Any, group: ProcessGroup | None = None, *, src: int = 0) -> Any:
    """Group rank ``src``'s picklable ``obj`` on every rank (``obj`` is ignored elsewhere)."""
    g, b = member(group, "broadcast_object")
    return b.broadcast_object(obj, as_rank(src, g.world_size, "broadcast_object", "src"))


def broadcast_object_list(object_list: list[Any], src: int = 0,
                          group: ProcessGroup | None = None) -> list[Any]:
    """Replace ``object_list``'s items, in place, by those of group rank ``src`` (torch's
    call); every rank passes a list of the same length. Returns the list."""
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list: object_list must be a list, got "
                        f"{type(object_list).__name__}")
    items = broadcast_object(list(object_list), group, src=src)
    if len(items) != len(object_list):
        raise CollectiveMismatchError(
            f"broadcast_object_list: rank {src} sent {len(items)} objects but this rank's list "
            f"holds {len(object_list)}; pass lists of the same length on every rank")
    object_list[:] = items
    return object_list


def gather_object(obj: Any, group: ProcessGroup | None = None, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj`` in rank order on group rank ``dst``; None elsewhere."""
    g, b = member(group, "gather_object")
    dst = as_rank(dst, g.world_size, "gather_object", "dst")
    objects = b.allgather_object(obj)
    return objects if g.rank == dst else None


def scatter_object_list(objects: Sequence[Any] | None, group: ProcessGroup | None = None,
                        src: int = 0) -> Any:
    """Item r of group rank ``src``'s ``objects`` (one per rank) on rank r.

    Raises:
        ValueError: on the source, ``objects`` does not hold one item per rank.
    """
    g, b = member(group, "scatter_object_list")
    src = as_rank(src, g.world_size, "scatter_object_list", "src")
    problem = None
    if g.rank == src and (objects is None or len(objects) != g.world_size):
        problem = (f"scatter_object_list: the source (rank {src}) must pass one object per "
                   f"rank ({g.world_size}), got "
                   f"{'None' if objects is None else len(objects)}")
    mine = list(objects) if problem is None and objects is not None and g.rank == src else None
    items = b.broadcast_object((problem, mine), src)
    if items[0] is not None:
        raise ValueError(items[0])
    return items[1][g.rank]


__all__ = ["all_gather_object", "broadcast_object", "broadcast_object_list", "gather_object",
           "scatter_object_list"]
