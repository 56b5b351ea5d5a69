"""How a torch-backend collective moves its data: one table, read top to bottom, first
match wins.

Every call is checked first (see :mod:`~axondist.backends.torch.guard`); this table says
what runs once the ranks agreed. The default is torch.distributed's own collective. The
rows above it exist because gloo's collectives differ from the other backends' in what
they compute or accept, and the sockets' rows (``*WIRES``) because gloo is slow at what it
does: on host memory in a group with its own sockets they take every collective, and the
gloo rows below them serve groups without the sockets. Each row says what gloo does, what
the row does instead, and the test that holds it. A mean is not a row: every plan runs
AVERAGE as a SUM then a division by the group's size, as MPI does, so the backends round
a mean alike.

The table is pure: it reads the call's key, the group's size and whether its members have
their own sockets, never torch, so tests read it without a process group. It reads
nothing that may differ between the ranks of one call (an input's layout, a rank's own
block size): every rank must choose the same row.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
    #: As :data:`RANK_ORDER_SUM`, for every reduction (combined as the mock world combines
    #: it), with the copies and the results on the group's own sockets (:mod:`.wires`),
    #: right after the check that travelled on them.
    RANK_ORDER_WIRES = "rank_order_wires"
    #: The bytes move as they are on the group's own sockets, right after the check that
    #: travelled on them: a broadcast's or scatter's root writes them on each member's
    #: connection, a gather's members on the root's, an all-gather's or all-to-all's
    #: members each on every other's.
    WIRES = "wires"
    #: Two members: each sends the block the other owns on the group's own sockets and
    #: sums (and scales) its own; an all-reduce sends the result back
    #: (:meth:`.wires.GroupWires.pair_reduce`, :meth:`~.wires.GroupWires.pair_swap`).
    PAIR_WIRES = "pair_wires"


#: Reductions that add.
SUMS = frozenset({"SUM", "AVERAGE"})
#: Reductions that compare.
COMPARISONS = frozenset({"MIN", "MAX"})
#: Collectives whose torch call takes one equal block per rank.
BLOCKED = frozenset({"all_gather", "reduce_scatter", "gather", "scatter"})
#: Reductions.
REDUCTIONS = frozenset({"all_reduce", "reduce_scatter", "reduce"})
#: Collectives that move bytes as they are.
MOVES_BYTES = frozenset({"broadcast", "all_gather", "gather", "scatter", "all_to_all"})


@dataclass(frozen=True)
class Layout:
    """What the table knows about the group."""

    world_size: int
    #: The group's members are connected by their own sockets (the check's, see
    #: :mod:`.wires`).
    wired: bool = False


def _adds_in_rank_order(key: CallKey, layout: Layout) -> bool:
    return (key.collective in ("all_reduce", "reduce_scatter") and layout.world_size > 2
            and key.reduce_op in SUMS
            and (_array.is_floating(key.dtype) or key.dtype.kind == "c"))


def _on_sockets(key: CallKey, layout: Layout) -> bool:
    """Host memory in a group whose members have their own sockets (the layout of a call's
    input is not asked: it may differ between ranks, and every rank must choose alike)."""
    return layout.wired and key.library == "numpy"


def _rank_order_on_wires(key: CallKey, layout: Layout) -> bool:
    return key.collective in REDUCTIONS and layout.world_size > 1 and _on_sockets(key, layout)


def _restores_nans(key: CallKey, layout: Layout) -> bool:
    return (key.collective in ("all_reduce", "reduce", "reduce_scatter")
            and key.reduce_op in COMPARISONS and _array.is_floating(key.dtype))


def _bytes_on_wires(key: CallKey, layout: Layout) -> bool:
    return key.collective in MOVES_BYTES and _on_sockets(key, layout)


#: dtypes a two-member sum on the group's sockets adds with NumPy (a + b is b + a bit for
#: bit, as gloo adds the pair).
PAIR_WIRES_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def _pair_on_wires(key: CallKey, layout: Layout) -> bool:
    if not (layout.world_size == 2 and _on_sockets(key, layout)):
        return False
    return (key.collective in ("all_reduce", "reduce_scatter") and key.reduce_op in SUMS
            and key.dtype in PAIR_WIRES_DTYPES and not _uneven(key, layout))


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
    Rule(_pair_on_wires, Algorithm.PAIR_WIRES,
         "float32/64 or int32/64 SUM/AVERAGE all-reduce or reduce-scatter (of equal blocks) "
         "of host memory in a group of two connected by its own sockets: gloo hands its "
         "messages to its socket loop thread. "
         "Each member sends the block the other owns on the group's sockets and sums (and "
         "scales) its own; an all-reduce then sends its result back. The caller's thread "
         "writes and reads in turn as the socket allows (the next row's work without its "
         "copies: a + b is b + a bit for bit). With the check, against raw "
         "torch's time on two ranks of one host: all-reduce 0.13x at 4 KiB, 0.28x at 1 MiB, "
         "0.77x at 16 MiB; reduce-scatter 0.13x, 0.19x, 0.31x "
         "(benchmarks/bench_torch_backend.py; tests/world/test_torch_backend.py: "
         "test_a_pair_all_reduce_on_the_groups_sockets_equals_gloos)"),
    Rule(_rank_order_on_wires, Algorithm.RANK_ORDER_WIRES,
         "every other all-reduce, reduce-scatter or reduce of host memory in a group whose "
         "members are connected by their own sockets: gloo hands every message to its "
         "socket loop thread, which on three ranks sharing two cores costs milliseconds a "
         "call (a MIN or MAX took two of them, the NaNs put back). Each member writes the "
         "others' blocks on their connections, combines the copies of its own in rank "
         "order (the next row's adds for a float sum, the same bits; the mock world's "
         "combine for every op: MIN and MAX keep NaNs with no second reduction, integers "
         "and booleans as NumPy) and writes the result on every connection (a reduce: on "
         "the root's). Against raw torch's time on three ranks of one host, the check "
         "included (before: the same sums through gloo): all-reduce 0.10-0.14x at 4 KiB "
         "(0.91x), 0.28-0.30x at 1 MiB (1.36x), 0.97-1.05x at 16 MiB; reduce-scatter "
         "0.07-0.10x, 0.19-0.23x, 0.50-0.54x (0.32x, 0.62x, -) "
         "(benchmarks/bench_torch_backend.py; tests/world/test_torch_backend.py: "
         "test_sums_in_rank_order_and_all_gathers_on_the_groups_sockets_equal_gloos, "
         "test_every_reduction_on_the_groups_sockets_combines_as_the_mock_world)"),
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
    Rule(_bytes_on_wires, Algorithm.WIRES,
         "broadcast, all-gather, gather, scatter or all-to-all (blocks of any size, none "
         "padded) of host memory in a group whose members are connected by their own "
         "sockets: gloo hands every message to its "
         "socket loop thread (a broadcast 0.24-0.29 ms at 4 KiB, 0.64-0.81 ms at 1 MiB on two "
         "idle ranks of one host). The root writing the bytes on each member's socket, the "
         "check included, takes 0.26-0.31x raw torch's broadcast at 4 KiB, 0.24x at 64 KiB, "
         "0.47-0.58x at 1 MiB and the same from 16 MiB, where loopback TCP is the limit for "
         "both; an all-gather, each member writing its block on every connection: 0.18x, "
         "0.42x and 0.31x at two ranks, 0.15x, 0.74-0.76x and 0.33-0.35x at three (1.16x "
         "and 1.25x at 4 KiB and 1 MiB before) "
         "(benchmarks/bench_torch_backend.py; tests/world/test_torch_backend.py: "
         "test_a_broadcast_on_the_groups_sockets_equals_gloos, "
         "test_sums_in_rank_order_and_all_gathers_on_the_groups_sockets_equal_gloos)"),
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


__all__ = ["BLOCKED", "COMPARISONS", "MOVES_BYTES", "REDUCTIONS", "SUMS", "TABLE", "Algorithm",
           "Layout", "Rule", "choose"]
