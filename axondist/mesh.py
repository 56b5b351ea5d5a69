"""Device meshes: the world's ranks laid out on a grid, one process group per axis.

A mesh of shape ``(dp, tp)`` numbers its positions row-major, so the *last* axis
varies fastest: on 4 ranks with ``tp = 2`` the tensor-parallel groups are positions
``[0, 1]`` and ``[2, 3]`` and the data-parallel groups ``[0, 2]`` and ``[1, 3]``.
:func:`make_mesh` fills the positions with the ranks ordered by node (host), so a
tensor-parallel group stays on one host wherever the placement allows, and warns (or
refuses, on request) when one must cross hosts. The layout arithmetic
(:func:`mesh_groups`, :func:`mesh_layout`, :func:`node_order`, :func:`groups_across_nodes`)
is pure and tested without communication; :class:`DeviceMesh` then creates the groups
(collectively: every rank creates every group of every axis, in the same order).
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from math import prod

from . import comm
from ._validate import parse_choice
from .process_group import ProcessGroup, resolve_group


class Placement(str, Enum):
    """How :func:`make_mesh` fills the grid's positions with ranks."""

    NODE = "node"
    """Ranks ordered by node (nodes by their lowest rank), then by rank: consecutive
    positions, and so a tensor-parallel group, share a host where the layout allows."""
    RANK = "rank"
    """Position i holds rank i, whatever the host."""


class CrossHosts(str, Enum):
    """What :func:`make_mesh` does when a tensor-parallel group spans several hosts."""

    WARN = "warn"
    """A RuntimeWarning naming the groups and their hosts; the mesh is built."""
    ERROR = "error"
    """A ValueError naming the groups and their hosts; no group is created."""
    ALLOW = "allow"
    """Build the mesh silently."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_shape(shape: Sequence[int], world_size: int, where: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"{where}: shape={tuple(shape)} must be a non-empty tuple of positive "
                         "sizes, e.g. (dp, tp)")
    if prod(dims) != world_size:
        raise ValueError(f"{where}: shape={dims} holds {prod(dims)} ranks but the group has "
                         f"{world_size}; the sizes must multiply to {world_size}")
    return dims


def mesh_groups(shape: Sequence[int], axis: int) -> list[list[int]]:
    """The rank lists of the groups along ``axis`` of a row-major mesh of ``shape``.

    Each group holds the ranks whose coordinates differ only along ``axis``,
    in increasing order; groups are listed in increasing order of their
    first rank. Together they cover every rank exactly once.

    >>> mesh_groups((2, 2), 1)   # consecutive ranks
    [[0, 1], [2, 3]]
    >>> mesh_groups((2, 2), 0)   # strided ranks
    [[0, 2], [1, 3]]

    Raises:
        ValueError: ``axis`` is not an axis of ``shape``.
    """
    dims = _check_shape(shape, prod(int(d) for d in shape), "mesh_groups")
    if not -len(dims) <= axis < len(dims):
        raise ValueError(f"mesh_groups: axis={axis} is not an axis of a {len(dims)}-D mesh of "
                         f"shape {dims}")
    axis %= len(dims)
    stride = prod(dims[axis + 1:])
    groups = []
    for start in range(prod(dims)):
        if (start // stride) % dims[axis] == 0:  # coordinate 0 along `axis`
            groups.append([start + k * stride for k in range(dims[axis])])
    return groups


def node_order(nodes: Sequence[int]) -> list[int]:
    """The ranks ordered by node, then by rank; ``nodes[r]`` is rank r's node.

    Nodes come in the order of their lowest rank, so a placement that already keeps
    each node's ranks together (``[0, 0, 1, 1]``) gives ``[0, 1, 2, 3]`` unchanged.

    >>> node_order([0, 1, 0, 1])   # ranks placed round-robin over two hosts
    [0, 2, 1, 3]
    """
    first = {node: i for i, node in reversed(list(enumerate(nodes)))}
    return sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r))


def groups_across_nodes(groups: Sequence[Sequence[int]], nodes: Sequence[int]
                        ) -> list[tuple[list[int], list[int]]]:
    """The groups whose ranks sit on more than one node, each with its nodes in order
    of first appearance; ``nodes[r]`` is rank r's node.

    >>> groups_across_nodes([[0, 1], [2, 3]], [0, 0, 0, 1])
    [([2, 3], [0, 1])]
    """
    found = []
    for group in groups:
        spanned = list(dict.fromkeys(nodes[r] for r in group))
        if len(spanned) > 1:
            found.append((list(group), spanned))
    return found


@dataclass(frozen=True)
class MeshLayout:
    """Which ranks form each tensor-parallel and data-parallel group.

    Attributes:
        world_size: number of ranks.
        tp_size: ranks per tensor-parallel group (consecutive ranks).
        tp_groups: the tensor-parallel groups, ``world_size // tp_size`` of them.
        dp_groups: the data-parallel groups (ranks ``tp_size`` apart), ``tp_size`` of them.
    """

    world_size: int
    tp_size: int
    tp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]

    @property
    def dp_size(self) -> int:
        """Ranks per data-parallel group."""
        return self.world_size // self.tp_size

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_index, tp_index)`` of ``rank``: its group rank in its dp and tp groups."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"MeshLayout.coords: rank={rank} is outside 0..{self.world_size - 1}")
        return divmod(rank, self.tp_size)


def mesh_layout(world_size: int, tp_size: int) -> MeshLayout:
    """The tensor-parallel x data-parallel layout of ``world_size`` ranks.

    Raises:
        ValueError: ``tp_size`` is not a positive divisor of ``world_size``
            (the message lists the valid sizes).
    """
    if world_size < 1:
        raise ValueError(f"mesh_layout: world_size={world_size} must be positive")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"mesh_layout: tp_size={tp_size} does not divide the world size "
                         f"{world_size}; choose one of {_divisors(world_size)}")
    shape = (world_size // tp_size, tp_size)
    return MeshLayout(world_size, tp_size,
                      tuple(tuple(g) for g in mesh_groups(shape, 1)),
                      tuple(tuple(g) for g in mesh_groups(shape, 0)))


class DeviceMesh:
    """A row-major grid of a group's ranks, with this rank's group along each axis.

    Args:
        world: the World (or any ProcessGroup; ranks are then its group ranks).
        shape: the grid's sizes, multiplying to ``world.world_size``,
            e.g. ``(dp, tp)``.
        names: one name per axis, e.g. ``("dp", "tp")``.
        ranks: the rank at each row-major position of the grid (a permutation of
            the group's ranks); None: position i holds rank i.

    Every rank must construct the mesh (same arguments, same point in the
    program): it calls ``world.new_group`` for every group of every axis.

    Raises:
        ValueError: the sizes do not multiply to the world size, the names
            are not one distinct name per axis, or ``ranks`` is not a
            permutation of the group's ranks.
    """

    def __init__(self, world: ProcessGroup | None, shape: Sequence[int],
                 names: Sequence[str] = ("dp", "tp"), *,
                 ranks: Sequence[int] | None = None) -> None:
        parent = resolve_group(world)
        parent.backend_for("DeviceMesh")  # non-members cannot take part in new_group
        self.shape = _check_shape(shape, parent.world_size, "DeviceMesh")
        self.names = tuple(str(n) for n in names)
        if len(self.names) != len(self.shape) or len(set(self.names)) != len(self.names):
            raise ValueError(f"DeviceMesh: names={tuple(names)} must give one distinct name per "
                             f"axis of shape {self.shape}")
        n = parent.world_size
        order = list(range(n)) if ranks is None else [int(r) for r in ranks]
        if sorted(order) != list(range(n)):
            raise ValueError(f"DeviceMesh: ranks={list(ranks or [])} must hold each rank "
                             f"0..{n - 1} exactly once (the rank at each grid position)")
        #: The rank of the parent group at each row-major position of the grid.
        self.ranks = tuple(order)
        self.parent = parent
        self._groups: dict[str, ProcessGroup] = {}
        for name in self.names:
            for group_ranks in self.groups(name):
                group = parent.new_group(group_ranks)  # collective: every rank, every group
                if group.is_member:
                    self._groups[name] = group

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"DeviceMesh: no axis named {name!r}; the axes are {self.names}")
        return self.names.index(name)

    def group(self, name: str) -> ProcessGroup:
        """This rank's group along axis ``name``."""
        self._axis(name)
        return self._groups[name]

    __getitem__ = group

    def size(self, name: str) -> int:
        """Number of ranks along axis ``name``."""
        return self.shape[self._axis(name)]

    def groups(self, name: str) -> list[list[int]]:
        """Every group along axis ``name``, as ranks of the parent group."""
        return [[self.ranks[p] for p in g] for g in mesh_groups(self.shape, self._axis(name))]

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinate along each axis (its rank in each axis's group)."""
        return tuple(self._groups[n].rank for n in self.names)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"DeviceMesh({axes}, rank={self.parent.rank}, coords={self.coords})"


def make_mesh(world: ProcessGroup | None, tp_size: int, *,
              placement: Placement | str = Placement.NODE,
              cross_hosts: CrossHosts | str = CrossHosts.WARN) -> DeviceMesh:
    """A ``(dp, tp)`` mesh with ``tp_size`` ranks per tensor-parallel group, kept on one host.

    With ``placement="node"`` the grid is filled with the ranks ordered by node
    (:func:`node_order` of every rank's ``node_info()``), so a tensor-parallel group
    crosses hosts only when a host holds fewer ranks than a group, or a count that
    ``tp_size`` does not divide (an uneven layout such as 2 + 1); on one host, or
    when each host's ranks are consecutive, this is rank order. Collective: every
    rank of ``world`` calls it. ``mesh.group("tp")`` is this rank's tensor-parallel
    group, ``mesh.group("dp")`` its data-parallel group, ``mesh.ranks`` the order.

    Args:
        world: the World or a ProcessGroup (None: the current world).
        tp_size: ranks per tensor-parallel group; divides the group's size.
        placement: ``"node"`` (ranks by host, the default) or ``"rank"`` (rank order).
        cross_hosts: when a tensor-parallel group spans hosts: ``"warn"`` (a
            RuntimeWarning naming the groups and hosts), ``"error"`` or ``"allow"``.

    Returns:
        The DeviceMesh, axes ``("dp", "tp")``.

    Raises:
        ValueError: ``tp_size`` does not divide the world size (the message lists
            the sizes that do), an unknown ``placement`` or ``cross_hosts``, or a
            tensor-parallel group spans hosts under ``cross_hosts="error"``
            (raised on every rank, before any group is created).
    """
    parent = resolve_group(world)
    n = parent.world_size
    if not isinstance(tp_size, int) or tp_size < 1 or n % tp_size:
        raise ValueError(f"make_mesh: tp_size={tp_size!r} does not divide the world size {n}; "
                         f"choose one of {_divisors(n)}")
    how = parse_choice(Placement, placement, "make_mesh: placement")
    on_cross = parse_choice(CrossHosts, cross_hosts, "make_mesh: cross_hosts")
    layout = mesh_layout(n, tp_size)
    hosts = comm.all_gather_object((parent.node_info()[0], socket.gethostname()), parent)
    nodes = [node for node, _ in hosts]
    order = node_order(nodes) if how is Placement.NODE else list(range(n))
    tp_groups = [[order[p] for p in g] for g in layout.tp_groups]
    crossing = groups_across_nodes(tp_groups, nodes)
    if crossing and on_cross is not CrossHosts.ALLOW:
        names = {node: host for node, host in hosts}
        detail = "; ".join(f"{group} spans {', '.join(f'node {k} ({names[k]})' for k in spans)}"
                           for group, spans in crossing)
        hint = ("the hosts hold uneven rank counts or fewer ranks than tp_size: launch "
                f"a multiple of {tp_size} ranks per host" if how is Placement.NODE else
                "pass placement='node' to keep each group on one host")
        text = (f"make_mesh: {len(crossing)} tensor-parallel group(s) of tp_size={tp_size} "
                f"cross hosts ({detail}); their all-reduces go over the network ({hint})")
        if on_cross is CrossHosts.ERROR:
            raise ValueError(text + "; cross_hosts='error' refused the mesh")
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    return DeviceMesh(parent, (layout.dp_size, layout.tp_size), ("dp", "tp"), ranks=order)


__all__ = ["CrossHosts", "DeviceMesh", "MeshLayout", "Placement", "groups_across_nodes",
           "make_mesh", "mesh_groups", "mesh_layout", "node_order"]
