"""How a torch-backend collective moves its data: one table, read top to bottom, first
match wins.

Every call is checked first (see :mod:`~axondist.backends.torch.guard`); this table says
what runs once the ranks agreed. The default is torch.distributed's own collective. The
rows above it exist because gloo's collectives differ from the other backends' in what
they compute or accept, not for speed: each row says what gloo does, what the row does
instead, and the test that holds it. A mean is not a row: every plan runs AVERAGE as a SUM
then a division by the group's size, as MPI does, so the backends round a mean alike.

The table is pure: it reads the call's key and the group's size, never torch, so tests
read it without a process group.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ... import _array
from ..plan import CallKey, element_counts


class Algorithm(enum.Enum):
    """How a checked call's data moves."""

    #: torch.distributed's collective (``all_reduce``, ``broadcast``, ``reduce``,
    #: ``all_gather_single``, ``reduce_scatter_single``, ``gather``, ``scatter``,
    #: ``all_to_all_single``), a mean divided afterwards.
    TORCH = "torch"
    #: Every rank's copy of each block arrives by one ``all_to_all_single`` and the copies
    #: are added in rank order (an all-reduce then all-gathers the sums).
    RANK_ORDER_SUM = "rank_order_sum"
    #: The MIN or MAX, then a second reduction (a SUM of booleans) of where each rank's
    #: values are NaN, which puts the NaNs back; a reduce or reduce-scatter runs as such an
    #: all-reduce of a copy.
    NAN_RESTORE = "nan_restore"
    #: Each rank's block padded to the largest, torch's equal-block collective
    #: (``all_gather_single``, ``reduce_scatter_single``, ``gather``, ``scatter``), the
    #: padding dropped.
    PADDED = "padded"


#: Reductions that add.
SUMS = frozenset({"SUM", "AVERAGE"})
#: Reductions that compare.
COMPARISONS = frozenset({"MIN", "MAX"})
#: Collectives whose torch call takes one equal block per rank.
BLOCKED = frozenset({"all_gather", "reduce_scatter", "gather", "scatter"})


@dataclass(frozen=True)
class Layout:
    """What the table knows about the group."""

    world_size: int


def _adds_in_rank_order(key: CallKey, layout: Layout) -> bool:
    return (key.collective in ("all_reduce", "reduce_scatter") and layout.world_size > 2
            and key.reduce_op in SUMS
            and (_array.is_floating(key.dtype) or key.dtype.kind == "c"))


def _restores_nans(key: CallKey, layout: Layout) -> bool:
    return (key.collective in ("all_reduce", "reduce", "reduce_scatter")
            and key.reduce_op in COMPARISONS and _array.is_floating(key.dtype))


def _uneven(key: CallKey, layout: Layout) -> bool:
    return (key.collective in BLOCKED and bool(key.shape)
            and len(set(element_counts(key, layout.world_size))) > 1)


@dataclass(frozen=True)
class Rule:
    """One row of the table: when it applies, what runs, and why."""

    applies: Callable[[CallKey, Layout], bool]
    algorithm: Algorithm
    why: str


TABLE: tuple[Rule, ...] = (
    Rule(_adds_in_rank_order, Algorithm.RANK_ORDER_SUM,
         "float or complex SUM/AVERAGE all-reduce or reduce-scatter, 3 ranks or more: gloo's "
         "ring adds each element's values in an order that depends on the message's length "
         "and cut, so an all-reduce of a bucket and of its pieces, or a reduce-scatter and "
         "an all-reduce, differ in their last bits; adding in rank order gives every cut "
         "the mock world's bits (OVERLAPPED DDP keeps SYNCHRONOUS's). Two ranks add one "
         "pair, the same either way: torch's call"),
    Rule(_restores_nans, Algorithm.NAN_RESTORE,
         "float MIN/MAX all-reduce, reduce or reduce-scatter: gloo's comparisons drop NaNs "
         "where NumPy, MPI and the mock world keep them (a NaN gradient norm must reach "
         "every rank); a SUM of NaN masks puts them back "
         "(tests/world/test_collectives.py: test_min_max_propagate_nan_whichever_rank_holds_it)"),
    Rule(_uneven, Algorithm.PADDED,
         "all-gather, reduce-scatter, gather or scatter whose ranks' blocks differ in size: "
         "torch's all_gather_single, reduce_scatter_single, gather and scatter take equal "
         "blocks (an all-to-all's split sizes may differ: torch's own)"),
    Rule(lambda key, layout: True, Algorithm.TORCH,
         "everything else: torch.distributed's own collective"),
)


def choose(key: CallKey, layout: Layout) -> Algorithm:
    """The algorithm a call of ``key`` runs in a group of ``layout``."""
    for rule in TABLE:
        if rule.applies(key, layout):
            return rule.algorithm
    raise AssertionError("the table's last row applies to every call")


__all__ = ["BLOCKED", "COMPARISONS", "SUMS", "TABLE", "Algorithm", "Layout", "Rule", "choose"]
