"""What runs around every MPI call: its sequence number, its flight-recorder entry, and
the cross-rank check that the ranks called the same thing with the same arguments.

The check is one extra ``Allreduce`` of two int64 (``MAX`` of ``[h, -h]``,
where ``h`` hashes the call's name and arguments): the ranks agree exactly
when the result is ``[h, -h]``. Every collective starts with it, so a rank
in ``barrier`` meets a rank in ``all_reduce`` inside the check, and both
raise :class:`~axondist.errors.CollectiveMismatchError` before any data
moves. Only then do the ranks exchange their full arguments (pickled) to say
what differs.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import CollectiveTimeoutError
from .base import compare_signatures
from .recorder import CALL_FIELDS as FIELDS
from .recorder import FlightRecorder, describe_status

_CACHE_LIMIT = 4096


def _hash_pair(op: str, key: tuple[Any, ...]) -> np.ndarray:
    """``[h, -h]`` for a 62-bit hash of the call's name and key (the same on every rank)."""
    digest = hashlib.blake2b(repr((op, key)).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 2
    return np.array([h, -h], dtype=np.int64)


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
        self.groups_made = 0

    def begin(self, op: str, detail: Any, blocking: bool = True) -> tuple[int, int]:
        """Number and record a call starting now: ``(seq, recorder slot)``."""
        seq = next(self.seqs)
        return seq, self.rec.begin(self.group, seq, op, detail, blocking)

    def begin_p2p(self, op: str, detail: Any) -> int:
        """Record a send or receive starting now (numbered apart from the collectives,
        which every rank must count alike); the recorder slot."""
        return self.rec.begin(self.p2p_group, next(self._p2p_seqs), op, detail)

    def agree(self, op: str, key: tuple[Any, ...]) -> None:
        """Return when every rank of the group calls ``op`` with this ``key``.

        Raises:
            CollectiveMismatchError: on every rank, naming what differs.
        """
        spec = self._specs.get((op, key))
        if spec is None:
            spec = self._new_spec(op, key)
        self.comm.Allreduce(spec, self._out_spec, self._max)
        view = self._view
        if view[0] != -view[1]:
            self._disagree(op, key)

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

    def _disagree(self, op: str, key: tuple[Any, ...]) -> None:
        calls = self.comm.allgather((op, key))
        signatures = [(("op", name),) + tuple(zip(FIELDS.get(name, ()), _printable(k)))
                      for name, k in calls]
        error = compare_signatures(op, signatures)
        if error is None:  # equal arguments that hash differently cannot happen; be explicit
            error = compare_signatures(op, [(("op", name), ("key", repr(k))) for name, k in calls])
        if error is not None:
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


__all__ = ["FIELDS", "CallGuard"]
