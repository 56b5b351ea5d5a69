"""Which algorithm an MPI collective runs: one table, read top to bottom, first match wins.

Every call is checked first (see :mod:`~axondist.backends.mpi.guard`); this table says
how its data moves once the ranks agreed. The default is the MPI library's own
collective, whose algorithm MPICH chooses per size and network (its ``MPIR_CVAR_*``
variables tune it). A row above it keeps a Python algorithm only where it was measured
to win; each row says by how much, and where (``benchmarks/bench_mpi_collectives.py``,
2 ranks on one 2-core host unless said otherwise; ``docs/backends.md`` has the tables).

The table is pure: it reads the call's key and the group's layout, never MPI, so tests
read it without a communicator.
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
    #: Two ranks: the check's header and the data travel in one message each way, and
    #: each rank combines the two halves itself (:mod:`.algorithms.pair_ride`).
    PAIR_RIDE = "pair_ride"
    #: The MPI collective over consecutive pieces of at most ``chunk_bytes``
    #: (:mod:`.algorithms.pieces`).
    PIECES = "pieces"


#: The largest all-reduce whose data rides with its check in a group of two.
RIDE_MAX_BYTES = 16 << 10
#: Pieces of big all-reduces and broadcasts in a group on one node.
NODE_CHUNK_BYTES = 2 << 20
#: Messages from this size run in pieces (on one node).
PIECES_FROM_BYTES = 8 << 20

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


def _rides(key: CallKey, layout: Layout) -> bool:
    return (key.collective == "all_reduce" and layout.world_size == 2 and layout.checks
            and not key.async_op and key.library == "numpy" and key.dtype in RIDE_DTYPES
            and key.reduce_op in RIDE_OPS and nbytes(key) <= RIDE_MAX_BYTES)


def _in_pieces(key: CallKey, layout: Layout) -> bool:
    return (key.collective in ("all_reduce", "broadcast") and not key.async_op
            and layout.chunk > 0 and nbytes(key) >= max(PIECES_FROM_BYTES, 2 * layout.chunk))


@dataclass(frozen=True)
class Rule:
    """One row of the table: when it applies, what runs, and the measurement behind it."""

    applies: Callable[[CallKey, Layout], bool]
    algorithm: Algorithm
    why: str


TABLE: tuple[Rule, ...] = (
    Rule(_rides, Algorithm.PAIR_RIDE,
         "blocking all-reduce, 2 ranks, <= 16 KiB, float32/64 or int32/64: one swap instead "
         "of a check and an Allreduce; 4 KiB took 0.62x the checked Allreduce (1.1x raw "
         "Allreduce against 1.75x)"),
    Rule(_in_pieces, Algorithm.PIECES,
         "blocking all-reduce or broadcast of >= 8 MiB on one node: 2 MiB pieces avoid "
         "MPICH's page faults on big shared-memory messages; 16 MiB took 0.73x one "
         "Allreduce, 64 MiB 0.43x"),
    Rule(lambda key, layout: True, Algorithm.MPI, "everything else: MPI's own collective"),
)


def choose(key: CallKey, layout: Layout) -> Algorithm:
    """The algorithm a call of ``key`` runs in a group of ``layout``."""
    for rule in TABLE:
        if rule.applies(key, layout):
            return rule.algorithm
    raise AssertionError("the table's last row applies to every call")


__all__ = ["NODE_CHUNK_BYTES", "PIECES_FROM_BYTES", "RIDE_DTYPES", "RIDE_MAX_BYTES", "TABLE",
           "Algorithm", "Layout", "Rule", "choose", "nbytes"]
