"""The MPI backend's persistent rings: a piece of a persistent SUM all-reduce as a ring of
persistent point-to-point requests made once and started every step, the in-cache
weighted add its reduce-scatter steps make, and the pool of receive buffers the rings
borrow step by step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._mpi_common import block_counts, displacements, raise_mpi_error
from ._mpi_core import bind_mpi

# Bound when mpi4py loads (_mpi_core.bind_mpi).
MPI: Any = None
_IN_PLACE: Any = None
bind_mpi(globals())

#: Elements a weighted ring scales and adds at a time (each part still in cache).
_CACHED = 1 << 16


def weigh_and_add(mine: Any, got: Any, weight: float, got_weight: float, xp: Any = np) -> None:
    """``mine = mine * weight + got * got_weight`` in place (``got`` is scratch and is
    scaled in place too), in parts of ``_CACHED`` elements so each part is scaled and
    added while it is in cache: one pass over memory. A weight of 1 is skipped (exact).
    Each product is rounded to the arrays' dtype, as a sender weighting its own values
    before sending them would round them, so the ring's bits do not depend on which
    rank applies a weight."""
    if weight == 1.0 and got_weight == 1.0:
        xp.add(mine, got, out=mine)
        return
    multiply, add = xp.multiply, xp.add
    for lo in range(0, mine.shape[0], _CACHED):
        part, arrived = mine[lo:lo + _CACHED], got[lo:lo + _CACHED]
        if weight != 1.0:
            multiply(part, weight, out=part, casting="unsafe")
        if got_weight != 1.0:
            multiply(arrived, got_weight, out=arrived, casting="unsafe")
        add(part, arrived, out=part)


class ScratchPool:
    """Scratch buffers that :class:`PersistentRing` steps borrow, each for one step: the
    partial sums arriving from the left land in one, are added, and the buffer goes back.
    A buffer given back is the next one taken (still in cache), and there are only as
    many as steps were ever in flight at once (a bigger one replaces a free one too
    small), instead of one per piece. Buffers are written once when made (no page faults
    in later steps)."""

    __slots__ = ("_free",)

    def __init__(self) -> None:
        self._free: list[Any] = []

    def take(self, nbytes: int) -> Any:
        """A byte buffer of at least ``nbytes`` (the most recently given back that fits)."""
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            if free[i].nbytes >= nbytes:
                return free.pop(i)
        if free:
            free.pop()  # too small: replaced by the bigger one made here
        buf = np.empty(nbytes, np.uint8)
        buf[...] = 0
        return buf

    def give(self, buf: Any) -> None:
        """Return a buffer :meth:`take` handed out."""
        self._free.append(buf)

    def __len__(self) -> int:
        return len(self._free)


class PersistentRing:
    """One piece of a persistent SUM all-reduce as a ring of point-to-point requests made
    once (``Send_init`` per step, ``Recv_init`` for the all-gather's): n - 1 reduce-scatter
    steps, each adding the partial sum that arrives from the left into this rank's copy of
    a block, then n - 1 all-gather steps handing the finished blocks round, as the blocking
    ring of ``AllReduceMixin._ring_mean`` does (over the same piece the same blocks, so the
    same bits as the blocking weighted sum). :meth:`start` takes this rank's weight: each
    rank's values are weighted as they join the ring, in cache, while the partial sum that
    arrives is added (the first step's block, which left its rank unweighted, with the left
    neighbour's weight: sent along, unless the caller says every rank has the same), so
    weighting costs no pass of its own. A reduce-scatter step receives into a buffer
    borrowed from ``pool`` for that step only (an ``Irecv``), so rings share a few buffers
    that stay in cache. A step starts when the previous one completed on this rank;
    :meth:`test` and :meth:`block` move it on, so the ring advances only while its caller
    tests or waits.

    Args:
        comm: the group's private communicator.
        flat: the piece, flat, in its dtype (the sums are formed on it).
        wire: the same memory as MPI moves it (``flat`` or a view of it).
        mtype: the MPI datatype of ``wire``'s elements.
        rank: this rank in ``comm``.
        size: ``comm``'s size (> 1).
        tag: the tag every message of this piece carries.
        pool: where reduce-scatter steps borrow their receive buffers.
    """

    __slots__ = ("_steps", "_weighing", "_weights", "_weight", "_left_weight", "_live",
                 "_got", "_comm", "_left", "_tag", "_mtype", "_dtype", "_wire_dtype", "_pool",
                 "step", "_mpi")

    def __init__(self, comm: Any, flat: Any, wire: Any, mtype: Any, rank: int, size: int,
                 tag: int, pool: ScratchPool) -> None:
        counts = block_counts(flat.size, size)
        blocks = [slice(lo, lo + c) for lo, c in zip(displacements(counts), counts)]
        right, left = (rank + 1) % size, (rank - 1) % size
        self._comm, self._left, self._tag, self._mtype = comm, left, tag, mtype
        self._dtype, self._wire_dtype, self._pool = flat.dtype, wire.dtype, pool
        #: this rank's weight (sent right at each start) and the left neighbour's
        self._weights = np.zeros(2, np.float64)
        self._weight = self._left_weight = 1.0
        # The weights' messages start before step 0's data: same tag, same pair of ranks,
        # so MPI matches them first (messages do not overtake).
        self._weighing = [comm.Recv_init([self._weights[1:], MPI.DOUBLE], left, tag),
                          comm.Send_init([self._weights[:1], MPI.DOUBLE], right, tag)]
        #: per step: its persistent requests, and for a reduce-scatter step the block the
        #: arriving partial sum is added into (None for an all-gather step)
        self._steps: list[tuple[list[Any], Any]] = []
        for step in range(size - 1):  # reduce-scatter: block (rank - step - 1) grows
            out, into = blocks[(rank - step) % size], blocks[(rank - step - 1) % size]
            self._steps.append(([comm.Send_init([wire[out], mtype], right, tag)], flat[into]))
        for step in range(size - 1):  # all-gather: pass the finished blocks on
            out, into = blocks[(rank + 1 - step) % size], blocks[(rank - step) % size]
            self._steps.append(([comm.Recv_init([wire[into], mtype], left, tag),
                                 comm.Send_init([wire[out], mtype], right, tag)], None))
        #: the requests of the step in flight
        self._live: list[Any] = []
        #: the borrowed buffer the step in flight receives into (None: none borrowed)
        self._got: Any = None
        #: the step in flight; ``len(steps)`` when idle or done
        self.step = len(self._steps)
        self._mpi = MPI

    def start(self, weight: float = 1.0, left_weight: float | None = None) -> None:
        """Start the first step (the piece must be complete by now; its values are
        multiplied by ``weight`` as they join the ring, rounded to the piece's dtype).
        ``left_weight``: the left neighbour's weight where every rank knows it (every rank
        passes the same weight); None sends the weights round first. Every rank must pass
        a ``left_weight``, or none."""
        self.step = 0
        self._weight = weight = float(weight)
        try:
            if left_weight is None:
                self._weights[0] = weight
                self._left_weight = -1.0  # read from the message once it arrived
                self._mpi.Prequest.Startall(self._weighing)  # the weights first
                self._start_step(self._weighing)
            else:
                self._left_weight = float(left_weight)
                self._start_step([])
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _start_step(self, also: list[Any]) -> None:
        """Start step ``self.step`` (``also``: requests already started that it waits for)."""
        requests, mine = self._steps[self.step]
        live = list(also)
        if mine is not None:  # receive the partial sum into a borrowed buffer
            nbytes = mine.shape[0] * self._dtype.itemsize
            got = self._got = self._pool.take(nbytes)
            live.append(self._comm.Irecv([got[:nbytes].view(self._wire_dtype), self._mtype],
                                         self._left, self._tag))
        self._mpi.Prequest.Startall(requests)
        self._live = live + requests

    def test(self) -> bool:
        """Move the ring on without blocking; whether it finished."""
        testall = self._mpi.Request.Testall
        try:
            while self._live:  # empty when idle or done
                if not testall(self._live):
                    return False
                self._next()
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "all_reduce")
        return True

    def block(self) -> None:
        """Wait for the ring to finish."""
        waitall = self._mpi.Request.Waitall
        try:
            while self.step < len(self._steps):
                waitall(self._live)
                self._next()
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "all_reduce")

    def _next(self) -> None:
        """The step in flight completed: add what arrived (reduce-scatter), start the next."""
        mine = self._steps[self.step][1]
        if mine is not None:  # the first step's block left its rank unweighted
            got, self._got = self._got, None
            left = 1.0
            if self.step == 0:
                left = self._left_weight
                if left < 0:
                    left = self._left_weight = float(self._weights[1])
            count = mine.shape[0]
            weigh_and_add(mine, got[:count * self._dtype.itemsize].view(self._dtype),
                          self._weight, left)
            self._pool.give(got)
        self.step += 1
        self._live = []
        if self.step < len(self._steps):
            self._start_step([])

    def free(self) -> None:
        """Release the requests (the ring must not be in flight)."""
        for request in self._weighing + [r for requests, _ in self._steps for r in requests]:
            if request != self._mpi.REQUEST_NULL:
                request.Free()
