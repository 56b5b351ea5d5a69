"""The check messages of a two-rank group's blocking calls, which carry the call's data
with its check: :class:`Carrier` (a small call's data behind the check's header),
:class:`Rider` (a small all-reduce or reduce-scatter combined on arrival),
:class:`RowCarrier` (an unsized all-gather's row count and rows) and :class:`PairMove`
(the plan of a call whose data follows its check point to point). The
:class:`~axondist.backends._mpi_guard.CallGuard` makes, swaps and frees them.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from ._mpi_common import mean_scaling

#: Largest blocking all-reduce whose check rides in its message (:class:`Rider`). Below
#: this a separate check costs about as much as the data's own all-reduce (both are
#: latency bound); above it MPI's own algorithms win.
RIDE_MAX_BYTES = 64 << 10

#: A check message's header: the call's hash, a "ranks disagree" flag, the payload bytes.
HEADER = 24


class Carrier:
    """A check message that carries a small call's data in a two-rank group.

    The header (the call's hash, a "disagree" flag, the call's data size)
    leads the data this rank sends; the other rank's message lands in the
    guard's receive buffer, whose ``theirs`` view the caller reads once
    :meth:`CallGuard.carry` found the headers equal. ``mine`` (shaped as the
    caller's data) is filled by the caller first. One exchange instead of a
    check and then the data: at 4 KiB a separate check costs as much as the
    data's own exchange. The send and receive are persistent requests, started
    and waited on per call.
    """

    __slots__ = ("h", "nbytes", "send", "words", "mine", "theirs", "requests", "keep", "give")

    def __init__(self, h: int, nbytes: int, dtype: np.dtype, mine: tuple[int, ...],
                 theirs: tuple[int, ...], recv: np.ndarray) -> None:
        self.h, self.nbytes = h, nbytes
        self.send = np.zeros(HEADER + prod(mine) * dtype.itemsize, np.uint8)
        self.words = self.send[:HEADER].view(np.int64).data  # memoryview: Python ints
        self.words[0], self.words[2] = h, nbytes
        self.mine = self.send[HEADER:].view(dtype).reshape(mine)
        end = HEADER + prod(theirs) * dtype.itemsize
        self.theirs: Any = recv[HEADER:end].view(dtype).reshape(theirs)
        #: The persistent [send, receive] of the swap (None: recursive doubling).
        self.requests: list[Any] | None = None
        #: What the caller keeps of its own buffer and where the other rank's part goes
        #: (slices the caller sets and reads: reduce-scatter and all-gather blocks).
        self.keep: Any = None
        self.give: Any = None


class Rider(Carrier):
    """A small blocking all-reduce (or a two-rank reduce-scatter) whose check travels in
    its own message.

    Ranks send each other their data behind the header (point to point, by
    recursive doubling, on the guard's own communicator) and combine it with
    the op's NumPy ufunc; a receiver compares the sender's hash and size with its
    own, so ranks that disagree, even on the size, find out from the same
    messages and no rank ever receives more than it expects (MPICH aborts a
    collective whose sizes differ).
    """

    __slots__ = ("ufunc", "scale", "by")

    def __init__(self, h: int, nbytes: int, dtype: np.dtype, mine: tuple[int, ...],
                 theirs: tuple[int, ...], recv: np.ndarray, ufunc: Any, divisor: int) -> None:
        super().__init__(h, nbytes, dtype, mine, theirs, recv)
        self.ufunc = ufunc
        # AVERAGE's turn from sum to mean (divisor 0: none), chosen once
        how, self.by = mean_scaling(divisor) if divisor else ("", 1.0)
        self.scale = {"multiply": np.multiply, "divide": np.divide}.get(how)


class RowCarrier(Carrier):
    """The check message of an all-gather whose row counts are not given, in a two-rank
    group: the header's size word says this rank's rows (plus one), and its rows ride
    behind it when they fit in ``RIDE_MAX_BYTES`` (both ranks apply the same rule to
    the other's count, so each knows whether the other's rows came along). One swap
    instead of a check, a row-count exchange, a second check and the data."""

    __slots__ = ("rows", "row_size", "trailing", "dtype", "fits", "their_rows")

    def __init__(self, h: int, dtype: np.dtype, rows: int, row_size: int,
                 trailing: tuple[int, ...], recv: np.ndarray) -> None:
        self.fits = rows * row_size * dtype.itemsize <= RIDE_MAX_BYTES
        super().__init__(h, rows + 1, dtype, (rows * row_size if self.fits else 0,), (0,), recv)
        self.rows, self.row_size, self.trailing, self.dtype = rows, row_size, trailing, dtype
        self.their_rows = -1  # the other rank's count that ``theirs`` views


class PairMove:
    """The plan of a checked blocking call in a two-rank group whose data is too big to
    ride with its check: the check's header swap, then the data point to point
    between the callers' buffers (:meth:`CallGuard.move`).

    ``view`` and ``mtype`` are how the data goes to MPI (a NumPy view dtype or None,
    the MPI datatype); ``keep`` and ``give`` are what the caller sets and reads (a
    broadcast's root: ``keep`` true; an all-gather: the slices of its result for its
    own block and the other rank's).
    """

    __slots__ = ("h", "view", "mtype", "keep", "give", "requests")

    def __init__(self, h: int, view: Any, mtype: Any) -> None:
        self.h, self.view, self.mtype = h, view, mtype
        self.keep: Any = None
        self.give: Any = None
        self.requests = None  # (no persistent requests of its own to free)


__all__ = ["HEADER", "RIDE_MAX_BYTES", "Carrier", "PairMove", "Rider", "RowCarrier"]
