"""Device meshes: the world's ranks laid out on a grid, one process group per axis.

A mesh of shape ``(dp, tp)`` numbers ranks row-major, so the *last* axis
varies fastest: on 4 ranks with ``tp = 2`` the tensor-parallel groups are
``[0, 1]`` and ``[2, 3]`` (neighbours, which usually share a node and its fast
links) and the data-parallel groups are ``[0, 2]`` and ``[1, 3]``.

The layout itself is pure arithmetic (:func:`mesh_groups`, :func:`mesh_layout`)
and is tested without communication; :class:`DeviceMesh` then creates the
groups. Creating a group is collective, so every rank creates *every* group
of every axis, in the same order, and keeps the one it belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from .process_group import ProcessGroup, resolve_group


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

    Every rank must construct the mesh (same arguments, same point in the
    program): it calls ``world.new_group`` for every group of every axis.

    Raises:
        ValueError: the sizes do not multiply to the world size, or the names
            are not one distinct name per axis.
    """

    def __init__(self, world: ProcessGroup | None, shape: Sequence[int],
                 names: Sequence[str] = ("dp", "tp")) -> None:
        parent = resolve_group(world)
        parent.backend_for("DeviceMesh")  # non-members cannot take part in new_group
        self.shape = _check_shape(shape, parent.world_size, "DeviceMesh")
        self.names = tuple(str(n) for n in names)
        if len(self.names) != len(self.shape) or len(set(self.names)) != len(self.names):
            raise ValueError(f"DeviceMesh: names={tuple(names)} must give one distinct name per "
                             f"axis of shape {self.shape}")
        self.parent = parent
        self._groups: dict[str, ProcessGroup] = {}
        for axis, name in enumerate(self.names):
            for ranks in mesh_groups(self.shape, axis):
                group = parent.new_group(ranks)  # collective: every rank, every group
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
        return mesh_groups(self.shape, self._axis(name))

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinate along each axis (its rank in each axis's group)."""
        return tuple(self._groups[n].rank for n in self.names)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"DeviceMesh({axes}, rank={self.parent.rank}, coords={self.coords})"


def make_mesh(world: ProcessGroup | None, tp_size: int) -> DeviceMesh:
    """A ``(dp, tp)`` mesh with ``tp_size`` consecutive ranks per tensor-parallel group.

    ``mesh.group("tp")`` is this rank's tensor-parallel group and
    ``mesh.group("dp")`` its data-parallel group.

    Raises:
        ValueError: ``tp_size`` does not divide the world size (the message
            lists the sizes that do).
    """
    parent = resolve_group(world)
    n = parent.world_size
    if not isinstance(tp_size, int) or tp_size < 1 or n % tp_size:
        raise ValueError(f"make_mesh: tp_size={tp_size!r} does not divide the world size {n}; "
                         f"choose one of {_divisors(n)}")
    layout = mesh_layout(n, tp_size)
    return DeviceMesh(parent, (layout.dp_size, layout.tp_size), ("dp", "tp"))


__all__ = ["DeviceMesh", "MeshLayout", "make_mesh", "mesh_groups", "mesh_layout"]
