"""Which algorithm an MPI collective runs: one table, read top to bottom, first match wins.

Every call is checked first (see :mod:`~axondist.backends.mpi.guard`); this table says
how its data moves once the ranks agreed. The default is the MPI library's own
collective, whose algorithm MPICH chooses per size and network (its ``MPIR_CVAR_*``
variables tune it). A row above it keeps a Python algorithm only where it was measured
to win; each row says by how much, and where (``benchmarks/bench_mpi_collectives.py``,
2 ranks on one 2-core host unless said otherwise; ``docs/backends.md`` has the tables).

The table is pure: it reads the call's key and the group's layout, never MPI, so tests
read it without a communicator. It reads nothing that may differ between the ranks of
one call (a rank's own block size, an all-to-all's own counts): every rank must choose the
same row.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..plan import CallKey


class Algorithm(enum.Enum):
    """How a checked call's data moves."""

    #: The MPI library's collective (``Allreduce``, ``Bcast``, ``Allgatherv``...).
    MPI = "mpi"
    #: Two ranks: the check's header and the data travel in one message each way; each
    #: rank combines the two sides itself, or puts the other's block in place
    #: (:mod:`.algorithms.pair_ride`).
    PAIR_RIDE = "pair_ride"
    #: The MPI collective over consecutive pieces of at most ``chunk_bytes``
    #: (:mod:`.algorithms.pieces`).
    PIECES = "pieces"
    #: Two ranks: one point-to-point exchange between the callers' buffers, sent ahead of
    #: the check where it fits (:mod:`.algorithms.pair_exchange`).
    PAIR_EXCHANGE = "pair_exchange"
    #: Two ranks: a mean as a reduce-scatter and an all-gather, point to point, each half
    #: summed and scaled in one pass by its owner (:mod:`.algorithms.pair_halves`).
    PAIR_HALVES = "pair_halves"
    #: One message to each other rank on the checks' communicator
    #: (:class:`~.vector_plans.PointToPointAllToAllPlan`).
    POINT_TO_POINT = "point_to_point"


#: The largest all-reduce whose data rides with its check in a group of two.
RIDE_MAX_BYTES = 64 << 10
#: The most bytes of data a two-rank reduce-scatter (the other rank's block: half the input)
#: or all-gather with sizes (the largest rank's block) carries in its check's message.
EXCHANGE_RIDE_MAX_BYTES = 4 << 10
#: Pieces of big all-reduces in a group on one node.
NODE_CHUNK_BYTES = 2 << 20
#: All-reduces from this size run in pieces (on one node).
PIECES_FROM_BYTES = 32 << 20
#: Two-rank all-gathers with sizes go point to point up to this size (at 16 MiB MPICH's
#: Allgather wins); reduce-scatters at every size...
PAIR_GATHER_MAX_BYTES = 2 << 20
#: ...and broadcasts up to this size (measured at 4 and 64 KiB).
PAIR_BROADCAST_MAX_BYTES = 64 << 10

#: Two-rank AVERAGE all-reduces from this size run as halves (below it the ride or one
#: Allreduce is faster; from PIECES_FROM_BYTES pieces are).
HALVES_FROM_BYTES = 1 << 20
#: dtypes a two-rank mean is fused for.
HALVES_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64))

#: dtypes and ops a riding all-reduce combines with NumPy: for two ranks ``a + b`` is
#: ``b + a`` bit for bit, so the result is the bits of MPI's own ``Allreduce``.
RIDE_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
RIDE_OPS = frozenset({"SUM", "AVERAGE", "MIN", "MAX", "PRODUCT"})


@dataclass(frozen=True)
class Layout:
    """What the table knows about the group and the backend's options."""

    world_size: int
    #: Nodes the group spans.
    nodes: int = 1
    #: The cross-rank check runs (riding needs it: the ride is the check).
    checks: bool = True
    #: Bytes per piece (``MPIOptions.chunk_bytes``; None: the layout's default, 0: never).
    chunk_bytes: int | None = None

    @property
    def chunk(self) -> int:
        """Bytes per piece in force (0: no pieces)."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return NODE_CHUNK_BYTES if self.nodes == 1 else 0


def nbytes(key: CallKey) -> int:
    """Bytes of the call's buffer."""
    size = 1
    for d in key.shape:
        size *= d
    return size * key.dtype.itemsize


def largest_block_bytes(key: CallKey) -> int:
    """Bytes of the largest rank's block of an all-gather with row counts: the same on
    every rank (each rank's key has its own block's shape; a choice made from that would
    differ between ranks whose blocks differ, and leave them in different calls)."""
    row = 1
    for d in key.shape[1:]:
        row *= d
    return max(key.counts or (0,)) * row * key.dtype.itemsize


def _rides(key: CallKey, layout: Layout) -> bool:
    return (key.collective == "all_reduce" and layout.world_size == 2 and layout.checks
            and not key.async_op and key.library == "numpy" and key.dtype in RIDE_DTYPES
            and key.reduce_op in RIDE_OPS and nbytes(key) <= RIDE_MAX_BYTES)


#: The data a riding two-rank call's message would carry, from its key (the same on every
#: rank: an all-gather's largest block), for the collectives other than all-reduce that ride
#: (a broadcast's ride measured no faster than its exchange: 0.95x at 4 KiB, 1.04x at 16).
_RIDE_PAYLOAD: dict[str, Callable[[CallKey], int | None]] = {
    "reduce_scatter": lambda key: (nbytes(key) // 2 if key.dtype in RIDE_DTYPES
                                   and key.reduce_op in RIDE_OPS else None),
    "all_gather": lambda key: largest_block_bytes(key) if key.counts is not None else None,
}


def _exchange_rides(key: CallKey, layout: Layout) -> bool:
    payload = _RIDE_PAYLOAD[key.collective](key) if key.collective in _RIDE_PAYLOAD else None
    return (payload is not None and payload <= EXCHANGE_RIDE_MAX_BYTES
            and layout.world_size == 2 and layout.checks and not key.async_op
            and key.library == "numpy")


def _in_pieces(key: CallKey, layout: Layout) -> bool:
    return (key.collective == "all_reduce" and not key.async_op and layout.chunk > 0
            and nbytes(key) >= max(PIECES_FROM_BYTES, 2 * layout.chunk))


def _halves(key: CallKey, layout: Layout) -> bool:
    return (key.collective == "all_reduce" and key.reduce_op == "AVERAGE"
            and layout.world_size == 2 and layout.nodes == 1 and layout.checks
            and not key.async_op and key.library == "numpy" and key.dtype in HALVES_DTYPES
            and HALVES_FROM_BYTES <= nbytes(key) < PIECES_FROM_BYTES)


def _exchanges(key: CallKey, layout: Layout) -> bool:
    if key.collective == "reduce_scatter":
        fits = key.dtype in RIDE_DTYPES and key.reduce_op in RIDE_OPS
    elif key.collective == "all_gather":  # without sizes: the blocks are told in the check
        fits = key.counts is None or largest_block_bytes(key) <= PAIR_GATHER_MAX_BYTES
    else:
        fits = key.collective == "broadcast" and nbytes(key) <= PAIR_BROADCAST_MAX_BYTES
    return (fits and layout.world_size == 2 and layout.nodes == 1 and layout.checks
            and not key.async_op and key.library == "numpy")


def _all_to_all_point_to_point(key: CallKey, layout: Layout) -> bool:
    return (key.collective == "all_to_all" and layout.world_size > 1 and layout.checks
            and not key.async_op and key.library == "numpy")


@dataclass(frozen=True)
class Rule:
    """One row of the table: when it applies, what runs, and the measurement behind it."""

    applies: Callable[[CallKey, Layout], bool]
    algorithm: Algorithm
    why: str


TABLE: tuple[Rule, ...] = (
    Rule(_rides, Algorithm.PAIR_RIDE,
         "blocking all-reduce, 2 ranks, <= 64 KiB, float32/64 or int32/64: one swap instead "
         "of a check and an Allreduce; against the checked Allreduce 0.58-0.63x from 64 B "
         "to 4 KiB, 0.70x at 16 KiB, 0.79x at 32 KiB, 0.90x at 64 KiB"),
    Rule(_exchange_rides, Algorithm.PAIR_RIDE,
         f"blocking reduce-scatter (float32/64 or int32/64) or all-gather with sizes, 2 "
         f"ranks, <= {EXCHANGE_RIDE_MAX_BYTES >> 10} KiB of data sent (the other rank's "
         "block; this rank's): the data rides with the check, one message each way instead "
         "of the exchange's two; against the exchange, reduce-scatter 0.80x of a 4 KiB and "
         "0.79x of an 8 KiB input (0.65x with a sum outside errstate), all-gather 0.86x of "
         "4 KiB blocks (8 KiB sent: 1.09x and 1.16x, not kept there)"),
    Rule(_halves, Algorithm.PAIR_HALVES,
         "blocking float32/64 AVERAGE all-reduce, 2 ranks on one node, 1024 KiB to 32 MiB: "
         "the other rank's half sent ahead of the check, each half summed and scaled in one "
         "pass by its owner and sent back block by block (two round trips, as Allreduce's); "
         "against the checked Allreduce then the mean's pass 0.80-1.05x at 1 MiB, "
         "0.83x at 4 MiB (host under load 17-25; with the check first and Sendrecv: "
         "0.80-0.90x, 0.73-1.02x, 0.77-0.79x at 16 MiB; 256 KiB 0.94-1.08x: not kept there)"),
    Rule(_in_pieces, Algorithm.PIECES,
         "blocking all-reduce of >= 32 MiB on one node: 2 MiB pieces avoid MPICH's page "
         "faults on big shared-memory messages; 64 MiB took 0.55x one Allreduce (8 MiB "
         "1.17x and 16 MiB 1.05x: not kept there; broadcasts in pieces 1.04-1.06x: not kept)"),
    Rule(_exchanges, Algorithm.PAIR_EXCHANGE,
         "blocking reduce-scatter of float32/64 or int32/64 (any size), all-gather with "
         "sizes (<= 2 MiB, the largest rank's block) or without (any size: the blocks are "
         "told in the check, two over 2 MiB then move by Allgatherv), or broadcast "
         "(<= 64 KiB), 2 ranks on one node: one point-to-point exchange sent ahead of the "
         "check, one round trip for both instead of two; without sizes against raw "
         "Allgather 3.9x, 1.1x, 0.73x, 1.0x at 4 KiB, 64 KiB, 1 and 16 MiB (the check, an "
         "Allgather of the counts, then Allgatherv: 4.5x, 1.6x, 1.1x, 1.0x); with "
         "the check first, against the checked MPI call, reduce-scatter 0.73x at 64 KiB, "
         "0.82x at 1 and 16 MiB, all-gather 0.66x at 64 KiB, 0.86x at 1 MiB (1.27x at 16 MiB: "
         "not kept); ahead, against raw mpi4py at load 17-25 (before: check then MPI's "
         "call), reduce-scatter 6.4x (6.6x) at 4 KiB, 2.1x (2.3x) at 64 KiB, broadcast "
         "7.2x (25x), 2.5x (3.7x), all-gather 7.8x (7.6x), 2.7x (3.0x)"),
    Rule(_all_to_all_point_to_point, Algorithm.POINT_TO_POINT,
         "blocking all-to-all of host memory, 2 ranks or more, with the check on (its "
         "communicator carries the messages): MPICH's Alltoallv moves equal blocks 2.1-2.4x "
         "slower than its Alltoall from 1 MiB on one host, and every rank's counts are its "
         "own, so no rank may choose Alltoall for them alone; one Sendrecv per other rank, "
         "in steps, runs near Alltoall. Against raw Alltoall (before: "
         "the checked Alltoallv), 2 ranks: 1.27x at 1 MiB (2.36x), 1.09x at 16 MiB (2.08x), "
         "64 KiB 1.29x (1.67x), 4 KiB 3.6x (3.4x: the check); 3 ranks: 1.48x (2.72x), "
         "1.14x (2.25x), 1.77x (1.89x), 3.4x (3.1x) (benchmarks/bench_mpi_collectives.py "
         "--ops all_to_all; tests/world/test_collectives.py)"),
    Rule(lambda key, layout: True, Algorithm.MPI, "everything else: MPI's own collective"),
)


def choose(key: CallKey, layout: Layout) -> Algorithm:
    """The algorithm a call of ``key`` runs in a group of ``layout``."""
    for rule in TABLE:
        if rule.applies(key, layout):
            return rule.algorithm
    raise AssertionError("the table's last row applies to every call")


__all__ = ["EXCHANGE_RIDE_MAX_BYTES", "HALVES_DTYPES", "HALVES_FROM_BYTES", "NODE_CHUNK_BYTES",
           "PAIR_BROADCAST_MAX_BYTES", "PAIR_GATHER_MAX_BYTES", "PIECES_FROM_BYTES",
           "RIDE_DTYPES", "RIDE_MAX_BYTES", "TABLE", "Algorithm", "Layout", "Rule", "choose",
           "largest_block_bytes", "nbytes"]
