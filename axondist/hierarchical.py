"""A hierarchical all-reduce: reduce-scatter within each node, all-reduce across, all-gather.

Each of a node's ``k`` ranks ends the first step holding the node's reduction of one
``1/k`` block of the array; the second step reduces that block with the ranks of the
same local rank on the other nodes, so every byte crosses the network once per node
rather than once per rank; the third step reassembles the array within the node. The
layout comes from the ranks' ``node_info()`` (or an explicit list); nodes holding
different numbers of ranks have no such decomposition, and fall back to the flat
all-reduce or are refused (``uneven=``). When it pays is measured in
``docs/multi-host.md``.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import _array
from ._call_args import one_array
from ._validate import parse_choice, sequence_of
from .backends.base import CompletedWork, Work
from .comm import all_gather, all_gather_object, all_reduce, reduce_scatter, split_sizes
from .errors import NotAMemberError
from .ops import ReduceOp, check_op_dtype
from .process_group import ProcessGroup, current_world, resolve_group


class Uneven(str, enum.Enum):
    """What :class:`HierarchicalAllReduce` does when nodes hold different rank counts."""

    #: Use the flat all-reduce over the whole group (``is_hierarchical`` is False).
    FLAT = "flat"
    #: Raise a ValueError on every rank, naming each node's rank count.
    ERROR = "error"


@dataclass(frozen=True)
class HierarchyPlan:
    """Which ranks reduce together at each step, from ``nodes[r]`` (rank r's node).

    Attributes:
        within: the ranks of each node, in rank order; nodes in order of their lowest rank.
        across: for each local rank j, the j-th rank of every node (when ``even``).
        even: every node holds the same number of ranks.
    """

    within: tuple[tuple[int, ...], ...]
    across: tuple[tuple[int, ...], ...]
    even: bool

    @property
    def useful(self) -> bool:
        """Even, with several nodes and several ranks per node (else flat is the same)."""
        return self.even and len(self.within) > 1 and len(self.within[0]) > 1


def hierarchy_plan(nodes: Sequence[int]) -> HierarchyPlan:
    """The node groups and cross-node groups of a layout (``nodes[r]`` is rank r's node).

    >>> hierarchy_plan([0, 1, 0, 1]).within, hierarchy_plan([0, 1, 0, 1]).across
    (((0, 2), (1, 3)), ((0, 1), (2, 3)))
    """
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    within = tuple(tuple(ranks) for ranks in members.values())
    even = len({len(ranks) for ranks in within}) <= 1
    across = tuple(tuple(ranks[j] for ranks in within)
                   for j in range(len(within[0]))) if even and within else ()
    return HierarchyPlan(within, across, even)


def _checked_nodes(nodes: Any, size: int) -> list[int]:
    listed = sequence_of(nodes, "HierarchicalAllReduce", "nodes")
    if len(listed) != size:
        raise ValueError(f"HierarchicalAllReduce: nodes must give one node id per rank of the "
                         f"group ({size}), got {len(listed)}: {listed!r}")
    for value in listed:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"HierarchicalAllReduce: nodes must hold ints (node ids), got "
                            f"{type(value).__name__} {value!r} in {listed!r}")
    return [int(v) for v in listed]


class HierarchicalAllReduce:
    """An all-reduce over ``group`` in three steps along its node layout (module docstring).

    Build it once (every rank of the group, collectively: it creates the sub-groups) and
    call it like :func:`axondist.all_reduce`; :meth:`close` (or ``with``) frees the groups.
    Results equal the flat all-reduce's up to floating-point rounding (the sums are
    grouped differently); AVERAGE averages the nodes' averages, exact as the nodes are
    even. With one node, one rank per node, or (``uneven="flat"``) uneven nodes it
    is the flat all-reduce, and so is it for arrays under ``min_bytes``: three
    collectives cost three latencies, which only large arrays repay.

    Args:
        group: the group (current world when None).
        nodes: node id of each group rank, the same list on every rank (default: every
            rank's ``group.node_info()``, exchanged).
        uneven: ``"flat"`` (fall back, :attr:`is_hierarchical` False) or ``"error"``.
        min_bytes: arrays of fewer bytes take the flat all-reduce (default 1 MiB; 0:
            always three steps).

    Raises:
        ValueError: ``nodes`` has the wrong length or differs between ranks; ``uneven``
            is not a valid choice; the nodes are uneven and ``uneven="error"``;
            ``min_bytes`` is negative.
        TypeError: ``nodes`` is not a list of ints; ``min_bytes`` is not an int.
        NotAMemberError: this process is not in ``group``.
    """

    def __init__(self, group: ProcessGroup | None = None, *, nodes: Sequence[int] | None = None,
                 uneven: Uneven | str = Uneven.FLAT, min_bytes: int = 1 << 20) -> None:
        policy = parse_choice(Uneven, uneven, "HierarchicalAllReduce: uneven")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, (int, numbers.Integral)):
            raise TypeError(f"HierarchicalAllReduce: min_bytes must be an int (bytes), got "
                            f"{type(min_bytes).__name__} {min_bytes!r}")
        if min_bytes < 0:
            raise ValueError(f"HierarchicalAllReduce: min_bytes={min_bytes} must be >= 0 "
                             "(0: every array takes the three steps)")
        self.min_bytes = int(min_bytes)
        self.group = current_world() if group is None else resolve_group(group)
        size = self.group.world_size
        mine = (_checked_nodes(nodes, size) if nodes is not None
                else [self.group.node_info()[0]])
        seen = all_gather_object(mine, self.group)
        if nodes is None:
            layout = [n for (n,) in seen]
        elif any(other != mine for other in seen):
            raise ValueError("HierarchicalAllReduce: ranks passed different nodes lists "
                             f"({dict(enumerate(seen))}); pass the same list on every rank")
        else:
            layout = mine
        self.plan = hierarchy_plan(layout)
        if not self.plan.even and policy is Uneven.ERROR:
            counts = {k: len(r) for k, r in enumerate(self.plan.within)}
            raise ValueError(f"HierarchicalAllReduce: nodes hold different numbers of ranks "
                             f"(node: ranks {counts}, ranks by node {list(self.plan.within)}); "
                             "launch the same number per node, or pass uneven='flat'")
        self._node: ProcessGroup | None = None
        self._across: ProcessGroup | None = None
        self._closed = False
        if self.plan.useful:  # every rank creates every group, in one order
            for ranks in self.plan.within:
                made = self.group.new_group(ranks)
                self._node = made if made.is_member else self._node
            for ranks in self.plan.across:
                made = self.group.new_group(ranks)
                self._across = made if made.is_member else self._across

    @property
    def is_hierarchical(self) -> bool:
        """True when calls take the three steps (False: the flat all-reduce, or closed)."""
        return self._node is not None

    def __call__(self, x: Any, op: ReduceOp | str = ReduceOp.SUM) -> Any:
        """Reduce ``x`` over the group in place and return it (blocking).

        Args:
            x: writable, C-contiguous array, the same shape and dtype on every rank.
            op: a :class:`ReduceOp` (or its name).

        Returns:
            ``x``, reduced.

        Raises:
            As :func:`axondist.all_reduce`.
        """
        if self._closed:
            raise NotAMemberError("HierarchicalAllReduce: called after close(); build a new "
                                  "HierarchicalAllReduce(group) on every rank")
        x = one_array(x, "HierarchicalAllReduce", in_place=True)  # a list would stay as it was
        if self._node is None or self._across is None or x.nbytes < self.min_bytes:
            return all_reduce(x, op, self.group)
        op = ReduceOp.parse(op, "HierarchicalAllReduce")
        check_op_dtype(op, x.dtype, "HierarchicalAllReduce")
        _array.check_writable(x, "HierarchicalAllReduce")
        flat = _array.flat_view(x)
        part = reduce_scatter(flat, op, self._node)
        all_reduce(part, op, self._across)
        all_gather(part, self._node, sizes=split_sizes(flat.shape[0], self._node.world_size),
                   out=flat)
        return x

    def hook(self, flat: Any, group: ProcessGroup, async_op: bool) -> Work | None:
        """Sum a gradient bucket in place through the three steps: a
        :class:`~axondist.ddp.ReductionHook`, as in
        ``DDP(model, group, compression=hier.hook)`` (``hier`` built on the same group).

        Blocking: meant for :attr:`~axondist.GradSyncStrategy.SYNCHRONOUS`. Under
        OVERLAPPED each bucket would be reduced, blocking, as soon as it is complete;
        a Work that is already complete is returned.

        Raises:
            ValueError: ``group`` is not the group this all-reduce was built on.
        """
        if resolve_group(group) is not self.group:
            raise ValueError(f"HierarchicalAllReduce.hook: DDP's group {group!r} is not the "
                             f"group this all-reduce was built on ({self.group!r}); build "
                             "HierarchicalAllReduce(group) with DDP's group")
        self(flat, ReduceOp.SUM)
        return CompletedWork(flat) if async_op else None

    def close(self) -> None:
        """Free the sub-groups (collective over the group; idempotent)."""
        for made in (self._node, self._across):
            if made is not None:
                made.destroy()
        self._node = self._across = None
        self._closed = True

    def __enter__(self) -> HierarchicalAllReduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "hierarchical" if self.is_hierarchical else "flat"
        return f"HierarchicalAllReduce({kind}, nodes={[list(r) for r in self.plan.within]})"
