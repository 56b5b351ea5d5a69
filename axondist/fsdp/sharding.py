"""The arithmetic of sharding: flat units, padding, shard bounds, node layouts.

Pure functions and values, no communication, tested on their own.

A *unit* is a list of parameters flattened, in order, into one 1-D buffer of
``numel`` elements. The buffer is padded with zeros to ``padded_numel``, the
next multiple of the number of shards ``S``, so it splits into ``S`` equal
contiguous shards of ``shard_size`` elements; shard ``r`` covers elements
``[r * shard_size, (r + 1) * shard_size)`` of the padded buffer. Equal shards
let the all-gather and reduce-scatter move fixed sizes with no size exchange.

Example: 10 elements over 4 shards pad to 12; shard sizes 3; shard 3 holds
elements 9..11, of which only element 9 is real (``valid_bounds`` = (9, 10)).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._array import FlatLayout

#: Default upper size of a unit made by :func:`plan_units` (bytes of the master dtype).
DEFAULT_UNIT_BYTES = 16 * 2**20


def _check_shards(shards: int, where: str) -> int:
    if not isinstance(shards, (int, np.integer)) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"{where}: shards must be a positive int, got {shards!r}")
    return int(shards)


def padded_numel(numel: int, shards: int) -> int:
    """``numel`` rounded up to a multiple of ``shards`` (0 stays 0)."""
    shards = _check_shards(shards, "padded_numel")
    if numel < 0:
        raise ValueError(f"padded_numel: numel must be >= 0, got {numel}")
    return -(-int(numel) // shards) * shards


def shard_size(numel: int, shards: int) -> int:
    """Elements in each of the ``shards`` equal shards of a padded buffer of ``numel``."""
    return padded_numel(numel, shards) // shards


def shard_bounds(numel: int, shards: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``rank`` in the padded buffer (padding included)."""
    shards = _check_shards(shards, "shard_bounds")
    if not 0 <= rank < shards:
        raise ValueError(f"shard_bounds: rank={rank} is not in 0..{shards - 1}")
    size = shard_size(numel, shards)
    return rank * size, (rank + 1) * size


def valid_bounds(numel: int, shards: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``rank`` clipped to the real elements (``stop >= start``)."""
    start, stop = shard_bounds(numel, shards, rank)
    start = min(start, numel)
    return start, max(start, min(stop, numel))


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of half-open ranges ``a`` and ``b``, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else None


@dataclass(frozen=True)
class ParamPiece:
    """The part of one parameter that lies in one shard.

    Attributes:
        position: the parameter's position in its unit.
        param_start, param_stop: the element range in the flattened parameter.
        shard_offset: where that range starts inside the shard.
    """

    position: int
    param_start: int
    param_stop: int
    shard_offset: int

    @property
    def size(self) -> int:
        """Elements in the piece (``param_stop - param_start``)."""
        return self.param_stop - self.param_start


@dataclass(frozen=True)
class FlatUnit:
    """One unit's flat layout and its split into ``shards`` padded shards.

    Attributes:
        index: the unit's position in the wrapper.
        param_indices: the model's parameter indices in this unit, in flat order.
        shapes: those parameters' shapes.
        dtype: the master dtype (every parameter of a unit shares it).
        shards: number of shards (ranks sharing this unit).
    """

    index: int
    param_indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    shards: int

    @functools.cached_property
    def layout(self) -> FlatLayout:
        """Where each parameter lives in the unpadded flat buffer (built once)."""
        return FlatLayout.of(self.shapes, self.dtype)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer, in flat order."""
        return self.layout.offsets

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each parameter, in flat order."""
        return self.layout.sizes

    @property
    def numel(self) -> int:
        """Real elements (no padding)."""
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """``numel`` rounded up to a multiple of ``shards`` (the padded buffer's length)."""
        return padded_numel(self.numel, self.shards)

    @property
    def shard_size(self) -> int:
        """Elements in each shard, padding included (``padded_numel // shards``)."""
        return shard_size(self.numel, self.shards)

    @property
    def padding(self) -> int:
        """Zero elements appended to make the shards equal."""
        return self.padded_numel - self.numel

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of shard ``rank`` in the padded buffer (padding included).

        Raises:
            ValueError: ``rank`` is not in ``0 .. shards - 1``.
        """
        return shard_bounds(self.numel, self.shards, rank)

    def valid_bounds(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of shard ``rank`` clipped to the real elements (may be empty)."""
        return valid_bounds(self.numel, self.shards, rank)

    def pieces(self, rank: int) -> list[ParamPiece]:
        """The parts of each parameter that shard ``rank`` holds, in flat order."""
        start, stop = self.shard_bounds(rank)
        out = []
        for pos, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            hit = overlap((off, off + n), (start, stop))
            if hit is not None:
                out.append(ParamPiece(pos, hit[0] - off, hit[1] - off, hit[0] - start))
        return out


def plan_units(sizes: Sequence[int], dtypes: Sequence[Any], units: Sequence[Sequence[int]] | None,
               unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[list[int]]:
    """Group parameter indices into units.

    Args:
        sizes: element count of each parameter.
        dtypes: dtype of each parameter.
        units: explicit groups (lists of parameter indices), or None for the
            default: consecutive parameters of one dtype, a new unit started
            whenever adding the next parameter would pass ``unit_bytes``; a
            parameter larger than ``unit_bytes`` is a unit of its own.
        unit_bytes: the default grouping's size limit.

    Returns:
        The units as lists of indices. Explicit units keep their order.

    Raises:
        ValueError: explicit units that miss or repeat a parameter, name an
            index out of range, are empty, or mix dtypes.
    """
    n = len(sizes)
    if len(dtypes) != n:
        raise ValueError(f"plan_units: {n} sizes but {len(dtypes)} dtypes")
    if units is None:
        if unit_bytes <= 0:
            raise ValueError(f"plan_units: unit_bytes must be > 0, got {unit_bytes}")
        planned: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for i in range(n):
            nbytes = int(sizes[i]) * np.dtype(dtypes[i]).itemsize
            new_dtype = current and np.dtype(dtypes[current[0]]) != np.dtype(dtypes[i])
            if current and (new_dtype or current_bytes + nbytes > unit_bytes):
                planned.append(current)
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
        if current:
            planned.append(current)
        return planned
    planned = [[int(i) for i in u] for u in units]
    seen: dict[int, int] = {}
    for u, members in enumerate(planned):
        if not members:
            raise ValueError(f"units: unit {u} is empty; every unit needs at least one parameter")
        for i in members:
            if not 0 <= i < n:
                raise ValueError(f"units: unit {u} names parameter {i}, but the model has {n} "
                                 f"parameters (0..{n - 1})")
            if i in seen:
                raise ValueError(f"units: parameter {i} is in unit {seen[i]} and unit {u}; each "
                                 "parameter must be in exactly one unit")
            seen[i] = u
        kinds = {str(np.dtype(dtypes[i])) for i in members}
        if len(kinds) > 1:
            raise ValueError(f"units: unit {u} mixes dtypes {sorted(kinds)}; a unit is one flat "
                             "buffer, so put parameters of different dtypes in different units")
    missing = [i for i in range(n) if i not in seen]
    if missing:
        raise ValueError(f"units: parameters {missing} are in no unit; list every parameter once")
    return planned


def unit_indices(units: Sequence[Sequence[Any]], params: Sequence[Any]) -> list[list[int]]:
    """A model's ``.units()`` as parameter indices: each item an index or one of ``params``.

    Raises:
        ValueError: a unit names a Parameter that is not in ``params``.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    out = []
    for u in units:
        members = []
        for item in u:
            if isinstance(item, (int, np.integer)):
                members.append(int(item))
            elif id(item) in index_of:
                members.append(index_of[id(item)])
            else:
                raise ValueError("FullyShardedDataParallel: model.units() names a "
                                 "Parameter that model.parameters() does not return")
        out.append(members)
    return out


def node_of_ranks(world_size: int, ranks_per_node: int) -> list[int]:
    """Node index of each rank when consecutive blocks of ``ranks_per_node`` share a node.

    Raises:
        ValueError: ``ranks_per_node`` is not a positive divisor of ``world_size``.
    """
    if not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1:
        raise ValueError(f"HYBRID_SHARD: ranks_per_node must be a positive int, got "
                         f"{ranks_per_node!r}")
    if world_size % ranks_per_node:
        raise ValueError(
            f"HYBRID_SHARD: ranks_per_node={ranks_per_node} does not divide the group of "
            f"{world_size} ranks into whole nodes; pass a divisor of {world_size} "
            f"({', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})")
    return [r // ranks_per_node for r in range(world_size)]


def hybrid_groups(node_of_rank: Sequence[Any]) -> tuple[list[list[int]], list[list[int]]]:
    """The shard groups (one per node) and replica groups (one per local index).

    Args:
        node_of_rank: a node label per group rank (any comparable values).

    Returns:
        ``(shard_groups, replica_groups)``: shard group k holds the ranks of
        the k-th node (nodes ordered by their lowest rank), each in increasing
        order; replica group j holds the j-th rank of every node.

    Raises:
        ValueError: nodes hold different numbers of ranks.
    """
    nodes: dict[Any, list[int]] = {}
    for r, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(r)
    shard_groups = list(nodes.values())
    sizes = {len(g) for g in shard_groups}
    if len(sizes) > 1:
        detail = ", ".join(f"node {k}: {len(g)}" for k, g in enumerate(shard_groups))
        raise ValueError(f"HYBRID_SHARD: nodes hold different numbers of ranks ({detail}); "
                         "every node needs the same count, or pass ranks_per_node=")
    local = len(shard_groups[0]) if shard_groups else 0
    replica_groups = [[g[j] for g in shard_groups] for j in range(local)]
    return shard_groups, replica_groups


__all__ = [
    "DEFAULT_UNIT_BYTES",
    "FlatUnit",
    "ParamPiece",
    "hybrid_groups",
    "node_of_ranks",
    "overlap",
    "padded_numel",
    "plan_units",
    "shard_bounds",
    "shard_size",
    "unit_indices",
    "valid_bounds",
]
