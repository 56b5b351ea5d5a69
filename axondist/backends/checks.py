"""What every checked backend (MPI, torch) keeps per group: the numbering and flight
recording of its calls, and the words of the cross-rank check that the ranks made the
same call with the same arguments.

A call's check words are ``[h, -h]`` for a hash ``h`` of its name and key: the MAX of
every rank's words is ``[h, -h]`` again exactly when the ranks agree, so one small
all-reduce tells every rank. When they differ, the ranks exchange their keys and raise
the same :class:`~axondist.errors.CollectiveMismatchError` (:func:`raise_if_different`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

try:  # hashlib's blake2b, without the OpenSSL library hashlib loads (start-up time)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - another Python implementation
    from hashlib import blake2b

from ..errors import CollectiveMismatchError, CollectiveTimeoutError
from .recording.recorder import FlightRecorder, describe_status

Key = tuple[tuple[str, Any], ...]

#: Check words a group keeps for calls made outside plans.
_WORDS_KEPT = 1024


def check_words(op: str, key: Key) -> np.ndarray:
    """``[h, -h]`` for a 62-bit hash of the call's name and key (the same on every rank):
    the send buffer of its check."""
    digest = blake2b(repr((op, key)).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") >> 2
    return np.array([h, -h], dtype=np.int64)


def agreed(words: np.ndarray) -> bool:
    """Whether the MAX over the ranks of their check words says that they all agree."""
    return bool(words[0] == -words[1])


class CallLog:
    """Sequence numbers and flight recording of one group's calls.

    Args:
        recorder: the rank's flight recorder (shared by all its groups).
        group: the group's name in the recorder (``"world"``, ``"world.0"``...).
        members: the group's members as world ranks, in group-rank order.
    """

    def __init__(self, recorder: FlightRecorder, group: str, members: Iterable[int]) -> None:
        self.rec = recorder
        self.group = group
        self.members = tuple(members)
        recorder.groups[group] = self.members
        self.p2p_group = f"{group}:p2p"
        recorder.groups[self.p2p_group] = self.members
        self.seqs = itertools.count(1)
        self._p2p_seqs = itertools.count(1)
        self.groups_made = 0
        #: The check words of the calls made outside plans (barrier, objects, rooted calls),
        #: by ``(op, key)``: hashing a key costs more than a small call's check.
        self._words: dict[tuple[str, Key], np.ndarray] = {}

    def begin(self, op: str, detail: Any, blocking: bool = True) -> tuple[int, int]:
        """Number and record a call starting now: ``(seq, recorder slot)``."""
        seq = next(self.seqs)
        return seq, self.rec.begin(self.group, seq, op, detail, blocking)

    def begin_p2p(self, op: str, detail: Any) -> int:
        """Record a send or receive starting now (numbered apart from the collectives,
        which every rank must count alike); the recorder slot."""
        return self.rec.begin(self.p2p_group, next(self._p2p_seqs), op, detail)

    def words(self, op: str, key: Key) -> np.ndarray:
        """:func:`check_words` of ``(op, key)``, kept (at most ``_WORDS_KEPT`` at once)."""
        found = self._words.get((op, key))
        if found is None:
            if len(self._words) >= _WORDS_KEPT:
                self._words.clear()
            found = self._words[(op, key)] = check_words(op, key)
        return found

    def absent_error(self, op: str, seq: int) -> Exception:
        """The error naming the ranks that did not start call ``seq`` of the group."""
        others = [r for r in self.members if r != self.rec.rank]
        statuses = self.rec.query_peers(others) if self.rec.query_peers else {}
        absent = [r for r in others if not isinstance(statuses.get(r), dict)
                  or int(statuses[r].get("issued", {}).get(self.group, 0)) < seq]
        lines = [describe_status(statuses[r]) if isinstance(statuses.get(r), dict)
                 else f"rank {r}: {statuses.get(r, 'not asked')}" for r in absent]
        return CollectiveTimeoutError(
            f"monitored_barrier: ranks {absent} of group {self.group} did not arrive at {op} "
            f"#{seq}: " + "; ".join(lines))

    def forget(self) -> None:
        """Drop the group's entries from the flight recorder (the group is gone)."""
        self.rec.groups.pop(self.group, None)
        self.rec.groups.pop(self.p2p_group, None)


def compare_signatures(op_name: str,
                       signatures: Sequence[Key | None]) -> CollectiveMismatchError | None:
    """The error every rank raises when ranks disagree on a collective's arguments.

    ``signatures`` holds each rank's signature in rank order, each starting
    with ``("op", name_of_the_collective)``; None when they all agree.
    Backends call it on the gathered signatures (the mock world always, MPI
    under ``AXONDIST_DEBUG=1``) so every rank raises the same message.
    """
    first = signatures[0]
    if all(s == first for s in signatures):
        return None
    fields: dict[str, list[Any]] = {}
    for sig in signatures:
        for name, _value in sig or ():
            fields.setdefault(name, [])
    for name in fields:
        fields[name] = [dict(sig or ()).get(name) for sig in signatures]
    differing = [name for name, vals in fields.items() if any(v != vals[0] for v in vals)]
    if "op" in differing:
        detail = ", ".join(f"rank {k} called {v}" for k, v in enumerate(fields["op"]))
        return CollectiveMismatchError(
            f"{op_name}: ranks called different collectives at the same point ({detail}); "
            "every rank must make the same collective calls in the same order")
    name = differing[0]
    detail = ", ".join(f"rank {k}: {v}" for k, v in enumerate(fields[name]))
    return CollectiveMismatchError(f"{op_name}: ranks disagree on {name} ({detail})")


def raise_if_different(op: str, calls: list[Any], named: bool = False) -> None:
    """Raise the mismatch error for the ranks' ``calls``, if they differ.

    ``calls`` holds each rank's ``(op, key)`` pair, in rank order, so ranks that called
    different collectives are told so (a bare key per rank, as an older caller sends,
    is read as a call of this rank's ``op``). ``named``: the hashed check said the calls
    differ, so equal calls are a bug, reported as such instead of going on.
    """
    pairs = calls if all(_is_call(c) for c in calls) else [(op, key) for key in calls]
    signatures = [(("op", name),) + printable(key) for name, key in pairs]
    error = compare_signatures(op, signatures)
    if error is None and named:  # equal calls cannot disagree: say so, never go on
        error = CollectiveMismatchError(
            f"{op}: the ranks' checks disagree although their calls match "
            f"({[repr(k) for _, k in pairs]}); report this as a bug")
    if error is not None:
        raise error


def _is_call(item: Any) -> bool:
    """Whether ``item`` is an ``(op, key)`` pair (a key's items are pairs themselves)."""
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], tuple))


def printable(key: Key) -> Key:
    """The key's values as every backend's mismatch message prints them: dtypes by name,
    shapes as NumPy prints them (``(3,)``), row counts as the list a caller passes as
    ``sizes=`` (``[2, 2]``), and a field named twice once (the last value)."""
    fields = dict(key)
    return tuple((name, _printable_value(name, value)) for name, value in fields.items())


def _printable_value(name: str, value: Any) -> Any:
    if isinstance(value, np.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return list(value) if name == "counts" else tuple(value)
    return value


__all__ = ["CallLog", "Key", "agreed", "check_words", "compare_signatures", "printable",
           "raise_if_different"]
