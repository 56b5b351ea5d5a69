"""What runs around every MPI call: its sequence number, its flight-recorder entry, and
the cross-rank check that the ranks called the same thing with the same arguments.

The check of a call is one small all-reduce (MAX of ``[h, -h]``, ``h`` a hash of the
call's key) on a communicator of the group's own, before the call's data moves: when the
ranks agree, the result is ``[h, -h]`` again. In a group of two it is a swap of 24-byte
headers (the hash, a flag, the bytes of data that follow) by persistent point-to-point
requests, which a small all-reduce's data may ride (:mod:`.algorithms.pair_ride`). When
the ranks differ, they learn it from the same messages, exchange their keys (pickled)
and raise the same :class:`~axondist.errors.CollectiveMismatchError` naming what differs,
before any data reaches a caller's buffer. A rank in ``barrier`` meets a rank in
``all_reduce`` inside the check, and no collective ever runs with sizes that differ
(MPICH aborts those). A
non-blocking call's check is an ``Iallreduce`` settled in its ``wait()``. Under
``AXONDIST_DEBUG=1`` the check exchanges the full keys instead. The guard carries no data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..checks import CallLog, Key, check_words, raise_if_different
from ..recording.recorder import FlightRecorder
from .choose import RIDE_MAX_BYTES
from .transport import raise_mpi_error

#: A two-rank check's header: the call's hash, a "ranks disagree" flag, the data's bytes.
HEADER = 24
#: Room after the header for data that rides with the check (the riding all-reduce's
#: largest message; see :mod:`axondist.backends.mpi.choose`).
RIDE_ROOM = RIDE_MAX_BYTES
#: The swaps' tag on the checks' communicator.
PAIR_TAG = 1
#: The tag of data a two-rank call sends ahead of its check (see :meth:`CallGuard.swap`).
AHEAD_TAG = 2


class CallGuard(CallLog):
    """Sequence numbers, recording and argument checks of one MPI communicator.

    Args:
        comm: the group's communicator (the data's).
        mpi: mpi4py's ``MPI`` module.
        recorder: the rank's flight recorder (shared by all its groups).
        group: the group's name in the recorder (``"world"``, ``"world.0"``...).
        members: the group's members as world ranks, in group-rank order.
        checks: run the cross-rank check before each collective.
        debug: the check compares full keys (a pickled all-gather) instead of hashes.
    """

    def __init__(self, comm: Any, mpi: Any, recorder: FlightRecorder, group: str,
                 members: Iterable[int], checks: bool, debug: bool = False) -> None:
        super().__init__(recorder, group, members)
        self.checks = checks or debug
        self.debug = debug
        self._mpi = mpi
        #: The checks' own communicator (None for one rank, or with the checks off): a
        #: check never meets the data of a collective, nor a user's message.
        self.comm = comm.Dup() if comm.Get_size() > 1 and self.checks else None
        self._result = np.zeros(2, dtype=np.int64)
        self._out = [self._result, mpi.INT64_T]
        self._max = mpi.MAX
        #: A two-rank group's swap: the other rank, every header lands in :attr:`received`
        #: (room for the largest riding message), and this rank's header.
        self.peer: int | None = None
        if self.comm is not None and comm.Get_size() == 2 and not debug:
            self.peer = 1 - comm.Get_rank()
            self.received = np.zeros(HEADER + RIDE_ROOM, np.uint8)
            #: Where a riding all-reduce builds its message (one per group: plans keep none).
            self.outgoing = np.zeros(HEADER + RIDE_ROOM, np.uint8)
            self.seen = self.received[:HEADER].view(np.int64)
            self._header = np.zeros(3, np.int64)
            self.receive = self.comm.Recv_init(self.received, self.peer, PAIR_TAG)
            self._swap = [self.comm.Send_init(self._header, self.peer, PAIR_TAG), self.receive]

    def agree(self, op: str, key: Key, words: np.ndarray) -> None:
        """Return when every rank of the group calls ``op`` with this ``key`` (``words``:
        its :func:`check_words`).

        Raises:
            CollectiveMismatchError: on every rank, naming what differs.
        """
        comm = self.comm
        if comm is None:
            return
        if self.debug:
            self._compare(op, comm.allgather((op, key)))
            return
        if self.peer is not None:
            header = self._header
            header[0], header[1], header[2] = words[0], 0, 0
            if self.swap(self._swap, int(words[0]), 0):
                self.disagree(op, key)
            return
        try:
            comm.Allreduce([words, self._mpi.INT64_T], self._out, self._max)
        except self._mpi.Exception as exc:
            raise_mpi_error(self._mpi, exc, "the cross-rank check")
        result = self._result
        if result[0] != -result[1]:
            self.disagree(op, key)

    def swap(self, requests: list[Any], h: int, nbytes: int | None) -> bool:
        """Run a two-rank group's swap (``requests``: a persistent send of this rank's
        message and :attr:`receive`); true when the other rank's call differs from this
        one's (hash ``h``; ``nbytes`` of data after the header, or minus the bytes that
        left ahead of it on AHEAD_TAG, which a disagreeing rank receives and drops; None
        when the ranks' sizes may differ, and the other's is read from :attr:`seen`)."""
        try:
            self._mpi.Prequest.Startall(requests)
            self._mpi.Request.Waitall(requests)
        except self._mpi.Exception as exc:
            raise_mpi_error(self._mpi, exc, "the cross-rank check")
        seen = self.seen
        if seen[1] or seen[0] != h or (nbytes is not None and seen[2] != nbytes):
            self._drop_ahead()
            return True
        return False

    def _drop_ahead(self) -> None:
        """After a swap that disagreed, receive and drop what the other rank sent ahead of
        its check (a header's negative byte count: that many bytes on AHEAD_TAG), so no
        message of a refused call is left for a later one to meet."""
        ahead = -int(self.seen[2])
        if ahead <= 0 or self.comm is None:
            return
        dropped = (self.received[HEADER:HEADER + ahead] if ahead <= RIDE_ROOM
                   else np.empty(ahead, np.uint8))
        try:
            self.comm.Recv([dropped, self._mpi.BYTE], self.peer, AHEAD_TAG)
        except self._mpi.Exception as exc:
            raise_mpi_error(self._mpi, exc, "the cross-rank check")

    def agree_later(self, op: str, key: Key,
                    words: np.ndarray) -> tuple[Any, Callable[[], None]] | None:
        """The check of a non-blocking call: its request, and what verifies it once the
        request completed (raising :class:`CollectiveMismatchError` on disagreement);
        None without checks."""
        comm = self.comm
        if comm is None:
            return None
        if self.debug:
            self._compare(op, comm.allgather((op, key)))
            return None
        out = np.empty(2, dtype=np.int64)  # its own: blocking checks may run meanwhile
        request = comm.Iallreduce([words, self._mpi.INT64_T], [out, self._mpi.INT64_T],
                                  self._max)

        def verify() -> None:
            if out[0] != -out[1]:
                self.disagree(op, key)

        return request, verify

    def agree_within(self, op: str, key: Key, seq: int, deadline: float) -> None:
        """:meth:`agree` that gives up at ``deadline`` (``time.monotonic``), naming the
        ranks that did not start call ``seq`` (from their flight recorders).

        Raises:
            CollectiveTimeoutError: the deadline passed first (the check stays pending:
                the communicator is unusable afterwards).
        """
        comm = self.comm
        if comm is None:
            return
        words = self.words(op, key)
        out = np.empty(2, dtype=np.int64)
        request = comm.Iallreduce([words, self._mpi.INT64_T], [out, self._mpi.INT64_T],
                                  self._max)
        wait_until(request.Test, deadline, lambda: self.absent_error(op, seq))
        if out[0] != -out[1]:
            self.disagree(op, key)

    def disagree(self, op: str, key: Key) -> None:
        """Raise, on every rank of the group (each calls this), the error naming what the
        ranks' calls differ in."""
        assert self.comm is not None
        self._compare(op, self.comm.allgather((op, key)), named=True)

    def _compare(self, op: str, calls: list[Any], named: bool = False) -> None:
        raise_if_different(op, calls, named)

    def close(self) -> None:
        """Free the checks' communicator and requests (collective, with the group's own)."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        if self.peer is not None:
            for request in self._swap:
                request.Free()
            self.peer = None
        comm.Free()


def wait_until(done: Any, deadline: float, error: Any) -> None:
    """Poll ``done()`` (an MPI request's ``Test``) until it is true; past ``deadline``
    raise ``error()``. Sleeps grow to 1 ms, so a waiting rank leaves its core to others."""
    pause = 1e-5
    while not done():
        if time.monotonic() >= deadline:
            raise error()
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


__all__ = ["AHEAD_TAG", "HEADER", "PAIR_TAG", "CallGuard", "Key", "check_words", "wait_until"]
