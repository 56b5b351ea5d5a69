"""What FSDP checks and creates at construction: the model's checks and the groups it talks to.

:func:`check_floating` refuses parameters FSDP cannot train. The other two are
collective over the wrapper's group: :func:`check_same_model` compares every
rank's parameter list with rank 0's and raises the same error on every rank,
and :func:`sharding_groups` turns a :class:`~axondist.fsdp.policies.ShardingSpec`
into this rank's shard group and replica group (creating node sub-groups when
the spec shards by node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import comm
from ..errors import CollectiveMismatchError, UnsupportedDTypeError
from ..parameter import Parameter
from ..process_group import ProcessGroup
from .policies import ShardingSpec, Span
from .sharding import hybrid_groups, node_of_ranks


def check_floating(params: Sequence[Parameter], names: Sequence[str]) -> None:
    """Refuse a parameter FSDP cannot shard and train: one that is not floating point."""
    for i, (p, name) in enumerate(zip(params, names)):
        dt = np.dtype(p.dtype)
        if dt.kind != "f" and dt.name != "bfloat16":
            raise UnsupportedDTypeError(
                f"FullyShardedDataParallel: parameter {i} ({name}) is {dt}; FSDP shards, "
                "averages and updates floating-point parameters only (float16, bfloat16, "
                "float32, float64). Keep integer or boolean arrays outside the model, or cast "
                "them, e.g. Parameter(x.astype(np.float32))")


def check_same_model(group: ProcessGroup, entries: Sequence[tuple[str, tuple[int, ...], str]],
                     where: str, settings: dict[str, Any] | None = None) -> None:
    """Refuse ranks whose ``(name, shape, dtype)`` lists or ``settings`` differ from rank 0's.

    Collective over ``group`` (one small all-gather of the lists), so every
    rank reaches the same verdict and raises the same message.

    Args:
        group: the ranks that must agree.
        entries: this rank's ``(name, shape, dtype)`` per parameter, in order.
        where: the caller's name, for the message.
        settings: other arguments every rank must pass alike (compared by value).

    Raises:
        CollectiveMismatchError: on every rank, naming the first rank and the
            first parameter (or setting) that differ from rank 0's.
    """
    mine = ([tuple(e) for e in entries], sorted((settings or {}).items()))
    everyone = comm.all_gather_object(mine, group)
    first, first_settings = everyone[0]
    for r, (other, other_settings) in enumerate(everyone):
        if other_settings != first_settings:
            name, value, want = next((k, v, w) for (k, v), (_, w)
                                     in zip(other_settings, first_settings) if v != w)
            raise CollectiveMismatchError(
                f"{where}: the ranks' arguments differ: {name}={value!r} on rank {r} but "
                f"{name}={want!r} on rank 0. Every rank must pass the same {name}")
        if other == first:
            continue
        if len(other) != len(first):
            detail = f"rank {r} wraps {len(other)} parameters, rank 0 wraps {len(first)}"
        else:
            k = next(i for i, (a, b) in enumerate(zip(other, first)) if a != b)
            detail = (f"parameter {k} is {_describe(other[k])} on rank {r} but "
                      f"{_describe(first[k])} on rank 0")
        raise CollectiveMismatchError(
            f"{where}: the ranks' models differ: {detail}. Every rank must wrap the same "
            "parameters (names, shapes, dtypes) in the same order")


def _describe(entry: tuple[str, tuple[int, ...], str]) -> str:
    """``'w' float32[3, 4]`` for a (name, shape, dtype) entry."""
    name, shape, dtype = entry
    return f"{name!r} {dtype}{list(shape)}"


def sharding_groups(group: ProcessGroup, spec: ShardingSpec, ranks_per_node: int | None,
                    strategy_name: str
                    ) -> tuple[ProcessGroup | None, ProcessGroup | None, list[ProcessGroup]]:
    """This rank's (shard group, replica group) under ``spec``, and the groups it created.

    None stands for a group of one. Collective when the spec shards by node:
    every rank creates every node group, in one order, and the third item
    lists each of them this rank is a member of (one-rank ones included), for
    the caller to destroy. The node layout comes from ``ranks_per_node`` or,
    when None, from each rank's ``group.node_info()``.

    Raises:
        ValueError: ``ranks_per_node`` given to a spec that does not shard by
            node, or not dividing the group.
    """
    if ranks_per_node is not None and not spec.uses_nodes:
        raise ValueError(f"FullyShardedDataParallel: ranks_per_node={ranks_per_node} only "
                         f"applies to HYBRID_SHARD (strategies that shard within a node), "
                         f"not {strategy_name}")
    whole = group if group.world_size > 1 else None
    if not spec.uses_nodes:
        return ((whole if spec.shard_over is Span.GROUP else None),
                (whole if spec.replicate_over is Span.GROUP else None), [])
    if ranks_per_node is not None:
        nodes: list[Any] = node_of_ranks(group.world_size, ranks_per_node)
    else:
        nodes = [info[0] for info in comm.all_gather_object(group.node_info(), group)]
    shard_lists, replica_lists = hybrid_groups(nodes)
    shard = _member_group(group, shard_lists)
    replica = _member_group(group, replica_lists)
    return (shard if shard.world_size > 1 else None,
            replica if replica.world_size > 1 else None, [shard, replica])


def _member_group(group: ProcessGroup, rank_lists: list[list[int]]) -> ProcessGroup:
    """Create a group per list (collective: every rank, in one order); return this rank's.

    The groups this rank is not a member of hold no communicator, so only the
    returned one needs destroying.
    """
    mine = None
    for ranks in rank_lists:
        sub = group.new_group(ranks)
        if sub.is_member:
            mine = sub
    assert mine is not None  # every rank is in exactly one list
    return mine


__all__ = ["check_floating", "check_same_model", "sharding_groups"]
