"""What runs around every MPI call: its sequence number, its flight-recorder entry, and
the cross-rank check that the ranks called the same thing with the same arguments.

A blocking call's check is an exchange of 24-byte headers (a hash of the
call's name and arguments, a "disagree" flag, a size) by recursive doubling
over point-to-point messages on a communicator of its own (in a group of two,
one persistent send and receive, started per call); a small blocking
all-reduce (up to ``RIDE_MAX_BYTES``) sends its data behind the header in the
same messages (their classes are in :mod:`~axondist.backends._mpi_carriers`).
Every blocking collective starts with it, so a rank in ``barrier`` meets a
rank in ``all_reduce`` inside the check, ranks that disagree even on a
message's size find out from the same messages (no collective ever runs with
sizes that differ: MPICH aborts those), and all raise
:class:`~axondist.errors.CollectiveMismatchError` before any data reaches a
caller's buffer. Only then do the ranks exchange their full arguments
(pickled) to say what differs. A non-blocking call's check is an
``Iallreduce`` (MAX of ``[h, -h]``), settled in its ``wait()``.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable
from math import prod
from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from ._mpi_carriers import HEADER, RIDE_MAX_BYTES, Carrier, PairMove, Rider, RowCarrier
from ._mpi_common import raise_mpi_error
from .base import compare_signatures
from .recorder import CALL_FIELDS as FIELDS
from .recorder import FlightRecorder, describe_status

_CACHE_LIMIT = 4096
#: All-reduce plans kept at once (a rider holds a send buffer of up to ``RIDE_MAX_BYTES``).
_RIDERS_LIMIT = 256
_TAG = 1

#: NumPy's equal of each MPI reduction that a riding all-reduce applies itself (MIN and
#: MAX propagate NaN, as the MPI backend's float ops do).
_UFUNCS = {"SUM": np.add, "AVERAGE": np.add, "MAX": np.maximum, "MIN": np.minimum,
           "PRODUCT": np.multiply}
_RIDING_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
#: What :attr:`CallGuard.carriers` gives for a call not planned yet (None is a plan).
UNPLANNED: Any = object()
#: The same ufuncs and dtypes, for the backend's point-to-point algorithms (rings).
UFUNCS, RING_DTYPES = _UFUNCS, _RIDING_DTYPES
#: The rings' tags on the private communicator (RING_TAG and RING_TAG + 1; checks use _TAG).
RING_TAG = 2
#: The tag of checked calls' data sent point to point (:meth:`CallGuard.pair_exchange`).
_DATA_TAG = 4


def _hash_pair(op: str, key: tuple[Any, ...]) -> np.ndarray:
    """``[h, -h]`` for a 62-bit hash of the call's name and key (the same on every rank)."""
    h = _call_hash(op, key) >> 1
    return np.array([h, -h], dtype=np.int64)


def _call_hash(op: str, key: tuple[Any, ...]) -> int:
    """A 63-bit hash of the call's name and key (the same on every rank)."""
    digest = hashlib.blake2b(repr((op, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _schedule(rank: int, size: int) -> list[tuple[str, int]]:
    """Recursive doubling over ``size`` ranks as ``(step, peer)``: ranks past the largest
    power of two fold into a partner first and get the result back at the end."""
    p = 1 << (size.bit_length() - 1)
    if rank >= p:
        return [("fold_out", rank - p)]
    steps = [("fold_in", rank + p)] if rank + p < size else []
    steps += [("swap", rank ^ mask) for mask in (1 << k for k in range(p.bit_length() - 1))]
    return steps + ([("return", rank + p)] if rank + p < size else [])


class CallGuard:
    """Sequence numbers, recording and argument checks of one MPI communicator.

    Args:
        comm: the communicator the checks run on (the backend's own).
        mpi: mpi4py's ``MPI`` module.
        recorder: the rank's flight recorder (shared by all its groups).
        group: the group's name in the recorder (``"world"``, ``"world.0"``...).
        members: the group's members as world ranks, in group-rank order.
        checks: run the cross-rank check before each collective.
    """

    def __init__(self, comm: Any, mpi: Any, recorder: FlightRecorder, group: str,
                 members: Iterable[int], checks: bool) -> None:
        self.comm = comm
        self.rec = recorder
        self.group = group
        self.members = tuple(members)
        self.checks = checks
        recorder.groups[group] = self.members
        self.seqs = itertools.count(1)
        self._p2p_seqs = itertools.count(1)
        self.p2p_group = f"{group}:p2p"
        recorder.groups[self.p2p_group] = self.members
        self._int64 = mpi.INT64_T
        self._max = mpi.MAX
        self._out = np.zeros(2, dtype=np.int64)
        self._view = self._out.data  # a memoryview: indexing gives Python ints
        self._out_spec = (self._out, self._int64)
        self._specs: dict[tuple[str, tuple[Any, ...]], tuple[np.ndarray, Any]] = {}
        #: Blocking all_reduce key -> (its Rider or None, the backend's direct MPI call or
        #: None): see ``MPIBackend._plan_all_reduce``.
        self.all_reduces: dict[tuple[Any, ...], tuple[Rider | None, Any]] = {}
        #: (op, key) of another blocking collective -> its Carrier, or None where its
        #: data cannot ride (see :meth:`carrier`); absent: not planned yet (UNPLANNED).
        #: An unsized all-gather's are ("all_gather", key, rows) -> RowCarrier or None.
        self.carriers: dict[tuple[Any, ...], Any] = {}
        self._hashes: dict[tuple[str, tuple[Any, ...]], int] = {}
        self._mpi = mpi
        self._start_all, self._wait_all = mpi.Prequest.Startall, mpi.Request.Waitall
        self._steps = _schedule(comm.Get_rank(), comm.Get_size())
        #: The other rank of a two-rank group (whose exchange is one swap), else None.
        self._pair = self._steps[0][1] if comm.Get_size() == 2 and checks else None
        #: A communicator of the group's own (None for one rank): the checks' messages and
        #: the backend's point-to-point algorithms travel here, apart from the data's
        #: collectives and the users' sends (whose tags span all of MPI's).
        self.private = comm.Dup() if self._steps else None
        self._check_comm = self.private if checks else None
        # Every check message lands here: room for any rank's largest riding message.
        self._recv = np.zeros(HEADER + RIDE_MAX_BYTES, np.uint8)
        self._seen = self._recv[:HEADER].view(np.int64).data  # memoryview: Python ints
        # A check without data: its header alone.
        self._header = np.zeros(HEADER, np.uint8)
        self._words = self._header.view(np.int64).data
        self._receive: Any = None  # the pair's persistent receive into _recv
        self._header_requests: list[Any] | None = None
        if self._pair is not None and self._check_comm is not None:
            self._receive = self._check_comm.Recv_init(self._recv, self._pair, _TAG)
            self._header_requests = [self._check_comm.Send_init(self._header, self._pair, _TAG),
                                     self._receive]
        self.groups_made = 0

    def begin(self, op: str, detail: Any, blocking: bool = True) -> tuple[int, int]:
        """Number and record a call starting now: ``(seq, recorder slot)``."""
        seq = next(self.seqs)
        return seq, self.rec.begin(self.group, seq, op, detail, blocking)

    def begin_p2p(self, op: str, detail: Any) -> int:
        """Record a send or receive starting now (numbered apart from the collectives,
        which every rank must count alike); the recorder slot."""
        return self.rec.begin(self.p2p_group, next(self._p2p_seqs), op, detail)

    def agree(self, op: str, key: tuple[Any, ...], riding: bool | None = None) -> None:
        """Return when every rank of the group calls ``op`` with this ``key``.

        ``riding=False``: this call's key lets its data ride with the check, but this
        rank's buffer cannot (device memory); named if the others' did.

        Raises:
            CollectiveMismatchError: on every rank, naming what differs.
        """
        if self._check_comm is None:
            return
        h = self._hashes.get((op, key))
        if h is None:
            h = self._hash(op, key)
        words = self._words
        words[0], words[1], words[2] = h, 0, 0
        if self._header_requests is not None:
            flag = self._swap(self._header_requests, h, 0)
        else:
            flag = self._exchange(self._header, words, h, 0, None, None, None)
        if flag:
            self._disagree(op, key, riding)

    def rider(self, key: tuple[Any, ...], dtype: np.dtype, count: int, op_name: str,
              n: int) -> Rider | None:
        """The :class:`Rider` of blocking all-reduce ``key`` (``count`` elements of
        ``dtype`` sent as themselves, op ``op_name``, buffer shape ``key[1]``), or None
        where it cannot ride."""
        nbytes = count * dtype.itemsize
        ufunc = _UFUNCS.get(op_name)
        if (ufunc is None or dtype not in _RIDING_DTYPES or nbytes > RIDE_MAX_BYTES
                or self._check_comm is None):
            return None
        rider = Rider(self._hash("all_reduce", key), nbytes, dtype, key[1], key[1], self._recv,
                      ufunc, n if op_name == "AVERAGE" else 0)
        if self._receive is not None:
            self._pair_requests(rider)
        return rider

    def carrier(self, op: str, key: tuple[Any, ...], nbytes: int, dtype: np.dtype,
                mine: tuple[int, ...], theirs: tuple[int, ...],
                reduce_op: str | None = None) -> Carrier | None:
        """The :class:`Carrier` of blocking call ``op`` with ``key``, made now and kept in
        :attr:`carriers` (where later calls find it); see :meth:`_make_carrier`."""
        if len(self.carriers) >= _RIDERS_LIMIT:
            self._forget_all_reduces()
        made = self.carriers[(op, key)] = self._make_carrier(op, key, nbytes, dtype, mine,
                                                              theirs, reduce_op)
        return made

    def _make_carrier(self, op: str, key: tuple[Any, ...], nbytes: int, dtype: np.dtype,
                      mine: tuple[int, ...], theirs: tuple[int, ...],
                      reduce_op: str | None) -> Carrier | None:
        """The :class:`Carrier` of blocking call ``op`` with ``key`` in a two-rank group:
        ``nbytes`` of data in the call (the same on both ranks), ``mine`` and ``theirs``
        the shapes of what this rank sends and receives; a :class:`Rider` combining with
        ``reduce_op``'s ufunc when given. None where the data cannot ride (checks off,
        not two ranks, a message over ``RIDE_MAX_BYTES``, an op or dtype riders lack):
        decided from the arguments alone, which both ranks share."""
        if (self._receive is None
                or max(prod(mine), prod(theirs)) * dtype.itemsize > RIDE_MAX_BYTES):
            return None
        h = self._hash(op, key)
        if reduce_op is None:
            return self._pair_requests(Carrier(h, nbytes, dtype, mine, theirs, self._recv))
        ufunc = _UFUNCS.get(reduce_op)
        if ufunc is None or dtype not in _RIDING_DTYPES:
            return None
        return self._pair_requests(Rider(h, nbytes, dtype, mine, theirs, self._recv, ufunc,
                                         2 if reduce_op == "AVERAGE" else 0))

    def row_carrier(self, key: tuple[Any, ...], dtype: np.dtype, rows: int,
                    row_size: int) -> RowCarrier | None:
        """The :class:`RowCarrier` of unsized all-gather ``key`` (its last item the
        trailing shape) for this rank's ``rows`` rows of ``row_size`` elements, kept in
        :attr:`carriers` as ``("all_gather", key, rows)``; None where no swap carries it
        (checks off, or not two ranks)."""
        if len(self.carriers) >= _RIDERS_LIMIT:
            self._forget_all_reduces()
        made = None
        if self._receive is not None:
            made = RowCarrier(self._hashes.get(("all_gather", key)) or self._hash("all_gather",
                                                                                  key),
                              dtype, rows, row_size, key[3], self._recv)
            self._pair_requests(made)
        self.carriers[("all_gather", key, rows)] = made
        return made

    def carry_rows(self, carrier: RowCarrier, key: tuple[Any, ...]) -> int:
        """Swap ``carrier``'s message (its ``mine`` filled by the caller when its rows
        fit); the other rank's row count. ``theirs`` then views that rank's rows (in
        their shape), or is None where they did not fit in the message.

        Raises:
            CollectiveMismatchError: on both ranks, naming what differs.
        """
        requests = carrier.requests
        try:
            self._start_all(requests)
            self._wait_all(requests)
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "the cross-rank check")
        seen = self._seen
        if seen[1] or seen[0] != carrier.h or not seen[2]:
            self._disagree("all_gather", key, True)
        rows = seen[2] - 1
        if rows != carrier.their_rows:
            carrier.their_rows = rows
            end = HEADER + rows * carrier.row_size * carrier.dtype.itemsize
            carrier.theirs = (self._recv[HEADER:end].view(carrier.dtype).reshape(
                (rows,) + carrier.trailing) if end - HEADER <= RIDE_MAX_BYTES else None)
        return rows

    def _pair_requests(self, carrier: Carrier) -> Carrier:
        carrier.requests = [self._check_comm.Send_init(  # type: ignore[union-attr]
            carrier.send, self._pair, _TAG), self._receive]
        return carrier

    def carry(self, carrier: Carrier, op: str, key: tuple[Any, ...]) -> None:
        """Swap ``carrier``'s message (its ``mine`` filled by the caller); its ``theirs``
        then holds the other rank's data.

        Raises:
            CollectiveMismatchError: on both ranks, naming what differs.
        """
        requests = carrier.requests
        try:  # the swap of _swap, inline: one Python frame less per small call
            self._start_all(requests)
            self._wait_all(requests)
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "the cross-rank check")
        seen = self._seen
        if seen[1] or seen[0] != carrier.h or seen[2] != carrier.nbytes:
            self._disagree(op, key, True)

    def ride(self, rider: Rider, buf: np.ndarray, key: tuple[Any, ...]) -> None:
        """All-reduce ``buf`` (the caller's contiguous NumPy array, of the rider's shape)
        with its check riding along (see :class:`Rider`); ``buf`` is written only once
        every rank agreed.

        Raises:
            CollectiveMismatchError: on every rank, naming what differs.
        """
        mine = rider.mine
        mine[...] = buf  # (np.copyto costs twice as much at 4 KiB)
        requests = rider.requests
        if requests is not None:
            # Two ranks: one swap, combined straight into the caller's buffer.
            if self._swap(requests, rider.h, rider.nbytes):
                self._disagree("all_reduce", key, True)
            rider.ufunc(mine, rider.theirs, out=buf)
        else:
            rider.words[1] = 0
            if self._exchange(rider.send, rider.words, rider.h, rider.nbytes, mine,
                              rider.theirs, rider.ufunc):
                self._disagree("all_reduce", key, True)
            buf[...] = mine
        if rider.scale is not None:
            rider.scale(buf, rider.by, out=buf, casting="unsafe")

    def moves_data(self, nbytes: int, limit: int) -> bool:
        """Whether a blocking call whose largest message is ``nbytes`` (too big to ride
        with its check, at most ``limit``) moves its data point to point once checked
        (:meth:`move`, :meth:`pair_exchange`): in a two-rank group with the checks on."""
        return self._header_requests is not None and RIDE_MAX_BYTES < nbytes <= limit

    def pair_move(self, op: str, key: tuple[Any, ...], view: Any, mtype: Any) -> PairMove:
        """Call ``op`` with ``key``'s :class:`PairMove`, kept in :attr:`carriers` (in place
        of the None :meth:`carrier` kept: its data cannot ride)."""
        made = self.carriers[(op, key)] = PairMove(self._hash(op, key), view, mtype)
        return made

    def move(self, plan: PairMove, op: str, key: tuple[Any, ...], send: Any,
             recv: Any) -> None:
        """Run ``plan``'s check, then send ``send`` to the other rank and receive into
        ``recv`` (mpi4py buffer specs, either None) on the private communicator: one
        Python frame for the whole call past its arguments.

        Raises:
            CollectiveMismatchError: on both ranks, naming what differs (no data moved).
        """
        words, h = self._words, plan.h
        words[0], words[1], words[2] = h, 0, 0
        requests, comm, peer = self._header_requests, self._check_comm, self._pair
        try:
            self._start_all(requests)
            self._wait_all(requests)
            seen = self._seen
            if not (seen[1] or seen[0] != h or seen[2]):
                if recv is None:
                    comm.Send(send, peer, _DATA_TAG)  # type: ignore[union-attr]
                elif send is None:
                    comm.Recv(recv, peer, _DATA_TAG)  # type: ignore[union-attr]
                else:
                    comm.Sendrecv(send, peer, _DATA_TAG, recv, peer,  # type: ignore[union-attr]
                                  _DATA_TAG)
                return
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, op)
        self._disagree(op, key)

    def pair_exchange(self, send: Any, recv: Any, op: str) -> None:
        """In a two-rank group whose call ``op`` passed its check: send ``send`` to the
        other rank and receive into ``recv`` (mpi4py buffer specs, either None), point
        to point on the private communicator (for two ranks on one node, faster than
        MPICH's collectives: an all-gather's 1 MiB blocks took 0.9x its ``Allgather``)."""
        comm, peer = self._check_comm, self._pair
        try:
            requests = [] if recv is None else [comm.Irecv(recv, peer, _DATA_TAG)]  # type: ignore[union-attr]
            if send is not None:
                requests.append(comm.Isend(send, peer, _DATA_TAG))  # type: ignore[union-attr]
            self._wait_all(requests)
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, op)

    def _swap(self, requests: list[Any], h: int, nbytes: int) -> int:
        """Run a two-rank group's persistent swap of check messages; true when the
        other rank's call differs from this one's (hash ``h``, ``nbytes`` of data)."""
        try:
            self._start_all(requests)
            self._wait_all(requests)
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "the cross-rank check")
        seen = self._seen
        return seen[1] or seen[0] != h or seen[2] != nbytes

    def _exchange(self, send: np.ndarray, words: Any, h: int, nbytes: int,
                  mine: np.ndarray | None, theirs: np.ndarray | None, ufunc: Any) -> int:
        """Recursive doubling of ``send`` (header ``words``, hash ``h``; its data part
        ``mine`` combined in place with ``ufunc``); true when any rank's call differs
        from this one's. A rank that finds a difference sets the flag in its header, so
        the ranks it sends to afterwards learn it too."""
        comm, recv, seen, flag = self._check_comm, self._recv, self._seen, 0
        try:
            for step, peer in self._steps:
                if step == "swap":
                    comm.Sendrecv(send, peer, _TAG, recv, peer, _TAG)  # type: ignore[union-attr]
                elif step == "fold_in":
                    comm.Recv(recv, peer, _TAG)  # type: ignore[union-attr]
                elif step == "return":
                    comm.Send(send, peer, _TAG)  # type: ignore[union-attr]
                    continue
                else:  # fold_out: hand this rank's part over, get the result back
                    comm.Send(send, peer, _TAG)  # type: ignore[union-attr]
                    comm.Recv(recv, peer, _TAG)  # type: ignore[union-attr]
                    flag = seen[1] or seen[0] != h or seen[2] != nbytes
                    if not flag and mine is not None:
                        np.copyto(mine, theirs)  # type: ignore[arg-type]
                    continue
                if flag or seen[1] or seen[0] != h or seen[2] != nbytes:
                    flag = words[1] = 1
                elif mine is not None:
                    ufunc(mine, theirs, out=mine)
        except self._mpi.Exception as exc:
            raise_mpi_error(exc, "the cross-rank check")
        return flag

    def remember(self, key: tuple[Any, ...], rider: Rider | None,
                 direct: Any) -> tuple[Rider | None, Any]:
        """Keep blocking all-reduce ``key``'s plan (see :attr:`all_reduces`)."""
        if len(self.all_reduces) >= _RIDERS_LIMIT:
            self._forget_all_reduces()
        plan = self.all_reduces[key] = (rider, direct)
        return plan

    def _forget_all_reduces(self) -> None:
        """Drop every all-reduce plan and carrier, freeing their persistent sends."""
        carriers: list[Carrier | None] = [rider for rider, _ in self.all_reduces.values()]
        carriers += self.carriers.values()
        for carrier in carriers:
            if carrier is not None and carrier.requests is not None:
                carrier.requests[0].Free()
        self.all_reduces.clear()
        self.carriers.clear()

    def _hash(self, op: str, key: tuple[Any, ...]) -> int:
        """``op`` and ``key``'s hash, remembered (a bounded cache)."""
        if len(self._hashes) >= _CACHE_LIMIT:
            self._hashes.clear()
        h = self._hashes[(op, key)] = _call_hash(op, key)
        return h

    def close(self) -> None:
        """Free the checks' requests and the private communicator (collective, with the
        group's own)."""
        comm, self.private, self._check_comm = self.private, None, None
        if comm is None:
            return
        self._forget_all_reduces()
        if self._header_requests is not None:
            for request in self._header_requests:
                request.Free()
            self._header_requests = self._receive = None
        comm.Free()

    def _new_spec(self, op: str, key: tuple[Any, ...]) -> tuple[np.ndarray, Any]:
        """The send buffer of ``(op, key)``'s check, remembered (a bounded cache)."""
        if len(self._specs) >= _CACHE_LIMIT:
            self._specs.clear()
        spec = self._specs[(op, key)] = (_hash_pair(op, key), self._int64)
        return spec

    def agree_later(self, op: str, key: tuple[Any, ...]) -> tuple[Any, Callable[[], None]]:
        """The check of a non-blocking call: its request, and what verifies it once the
        request completed (raising :class:`CollectiveMismatchError` on disagreement)."""
        spec = self._specs.get((op, key)) or self._new_spec(op, key)
        out = np.empty(2, dtype=np.int64)  # its own: blocking checks may run meanwhile
        request = self.comm.Iallreduce(spec, [out, self._int64], self._max)

        def verify() -> None:
            if out[0] != -out[1]:
                self._disagree(op, key)

        return request, verify

    def agree_within(self, op: str, key: tuple[Any, ...], seq: int, deadline: float) -> None:
        """:meth:`agree` that gives up at ``deadline`` (``time.monotonic``), naming the
        ranks that did not start call ``seq`` (from their flight recorders).

        Raises:
            CollectiveTimeoutError: the deadline passed first (the check stays pending:
                the communicator is unusable afterwards).
        """
        spec = self._specs.get((op, key)) or self._new_spec(op, key)
        request = self.comm.Iallreduce(spec, self._out_spec, self._max)
        wait_until(request.Test, deadline, lambda: self._absent_error(op, seq))
        view = self._view
        if view[0] != -view[1]:
            self._disagree(op, key)

    def _absent_error(self, op: str, seq: int) -> Exception:
        others = [r for r in self.members if r != self.rec.rank]
        statuses = self.rec.query_peers(others) if self.rec.query_peers else {}
        absent = [r for r in others if not isinstance(statuses.get(r), dict)
                  or int(statuses[r].get("issued", {}).get(self.group, 0)) < seq]
        lines = [describe_status(statuses[r]) if isinstance(statuses.get(r), dict)
                 else f"rank {r}: {statuses.get(r, 'not asked')}" for r in absent]
        return CollectiveTimeoutError(
            f"monitored_barrier: ranks {absent} of group {self.group} did not arrive at {op} "
            f"#{seq}: " + "; ".join(lines))

    def _disagree(self, op: str, key: tuple[Any, ...], riding: bool | None = None) -> None:
        """Raise, on every rank of the group (each calls this), the error naming what the
        ranks' calls differ in. ``riding``: whether this rank's data rode with the check
        (None: a call whose data never rides)."""
        calls = self.comm.allgather((op, key, riding))
        signatures = [(("op", name),) + tuple(zip(FIELDS.get(name, ()), _printable(k)))
                      for name, k, _ in calls]
        error = compare_signatures(op, signatures)
        if error is None:
            kinds = [r for _, _, r in calls]
            if len(set(kinds)) > 1:
                host = [k for k, r in enumerate(kinds) if r]
                other = [k for k, r in enumerate(kinds) if not r]
                error = CollectiveMismatchError(
                    f"{op}: ranks {host} passed host NumPy arrays and ranks {other} other "
                    "arrays (device memory) to the same call; pass the same kind of array "
                    "on every rank")
            else:  # equal calls cannot disagree: say so rather than return a wrong value
                error = CollectiveMismatchError(
                    f"{op}: the ranks' checks disagree although their calls match "
                    f"({[repr(k) for _, k, _ in calls]}); report this as a bug")
        raise error


def wait_until(done: Any, deadline: float, error: Any) -> None:
    """Poll ``done()`` (an MPI request's ``Test``) until it is true; past ``deadline``
    raise ``error()``. Sleeps grow to 1 ms, so a waiting rank leaves its core to others."""
    pause = 1e-5
    while not done():
        if time.monotonic() >= deadline:
            raise error()
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _printable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key's values as they print in messages (dtypes by name, shapes as lists)."""
    return tuple(str(v) if isinstance(v, np.dtype) else list(v) if isinstance(v, tuple) else v
                 for v in key)


__all__ = ["FIELDS", "RIDE_MAX_BYTES", "RING_DTYPES", "RING_TAG", "UFUNCS", "UNPLANNED",
           "CallGuard"]
