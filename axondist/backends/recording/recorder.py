"""The flight recorder: each rank's last calls, for stall warnings and post-mortems.

Every collective and point-to-point call of a rank is written to a ring of
the last ``capacity`` calls (``AXONDIST_FLIGHT_RECORDER``, default 256) when
it starts and stamped when it ends; per group it also counts the calls issued
and completed. Recording costs two clock reads and a tuple per call. The
watchdog reads the recorders of the ranks a stalled call waits for, and
:func:`axondist.flight_recorder` returns this rank's for a post-mortem.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from .. import settings as _settings

_monotonic = time.monotonic
_trace = logging.getLogger("axondist.trace")

# Fields of a ring slot (a tuple, so a reader never sees half of an update); _ORDER
# numbers the calls of the rank (readers sort by it: the writers keep no "next" index).
_GROUP, _SEQ, _OP, _DETAIL, _START, _BLOCKING, _ORDER = range(7)


#: The arguments each call's key holds, in order (what a mismatch message names).
CALL_FIELDS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("dtype", "shape", "reduce_op", "async_op"),
    "scaled_sum": ("dtype", "shape"),
    "broadcast": ("dtype", "shape", "root", "async_op"),
    # an all-gather without sizes= names its trailing shape instead of counts it lacks
    "all_gather": ("dtype", "counts", "async_op", "trailing shape"),
    "reduce_scatter": ("dtype", "counts", "reduce_op", "async_op"),
    "gather": ("dtype", "counts", "root", "async_op"),
    "scatter": ("dtype", "counts", "root", "async_op"),
    "all_to_all": ("dtype", "async_op"),
    "reduce": ("dtype", "shape", "reduce_op", "root", "async_op"),
    "barrier": (),
    "allgather_object": (),
    "broadcast_object": ("root",),
    "new_group": ("ranks",),
    "destroy": (),
}


def describe_detail(detail: Any, op: str = "") -> str:
    """A call's detail (dtype, shape, op, root, peer...) as short text; a plain tuple of
    values is named by ``CALL_FIELDS[op]`` (its first names, where it has fewer values)."""
    if detail is None:
        return ""
    names = CALL_FIELDS.get(op)
    if (isinstance(detail, tuple) and names is not None and 0 < len(detail) <= len(names)
            and not _is_pair(detail[0])):
        detail = tuple((n, v) for n, v in zip(names, detail) if n != "async_op")
    if isinstance(detail, tuple):
        return ", ".join(_describe_item(d) for d in detail if d is not None and d != ())
    return _describe_item(detail)


def _is_pair(item: Any) -> bool:
    """Whether ``item`` is a ``(name, value)`` pair (details given as pairs name themselves)."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)


def _describe_item(item: Any) -> str:
    if _is_pair(item):
        value = list(item[1]) if isinstance(item[1], tuple) else item[1]
        return f"{item[0]}={value}"
    if isinstance(item, tuple):
        return str(list(item))
    return str(item)


def _peer_of(detail: Any) -> int | None:
    """The world rank a point-to-point call's detail names (its ``("peer", rank)`` pair)."""
    if isinstance(detail, tuple) and detail and isinstance(detail[0], tuple) \
            and len(detail[0]) == 2 and detail[0][0] == "peer":
        return int(detail[0][1])
    return None


class FlightRecorder:
    """One rank's ring of recent calls and its per-group call counts.

    Calls ``begin``/``end`` come from the rank's own threads; readers
    (the watchdog thread, a peer's status query) only read tuples and ints,
    so no lock is taken on the hot path.

    Args:
        rank: this process's rank in the world.
        world_size: ranks in the world.
        host: the host name, for messages.
        settings: the world's settings (its ``flight_recorder`` size, its ``trace`` folder);
            read from the environment when None.
    """

    def __init__(self, rank: int, world_size: int, host: str = "",
                 settings: _settings.Settings | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.pid = os.getpid()
        size: int = (_settings.read("AXONDIST_FLIGHT_RECORDER") if settings is None
                     else settings.flight_recorder)
        capacity = 1 << (size - 1).bit_length()  # a power of two: slots by masking
        self._mask = capacity - 1
        self._slots: list[tuple[Any, ...] | None] = [None] * capacity
        #: When each slot's call ended: a call is done once its end is not before its
        #: start (an end older than the start belongs to the slot's previous call).
        self._ends: list[float] = [0.0] * capacity
        #: group name -> highest sequence number issued (started) on it.
        self.issued: dict[str, int] = {}
        #: group name -> highest sequence number completed on it.
        self.completed: dict[str, int] = {}
        #: group name -> its members' world ranks.
        self.groups: dict[str, tuple[int, ...]] = {}
        self._counter = itertools.count()
        #: Log every completed call at DEBUG on ``axondist.trace`` (decided when the rank's
        #: world starts: set the level before ``init``/``spawn``).
        self.trace = _trace.isEnabledFor(logging.DEBUG)
        #: Asks peers for their status (set by a watchdog): world ranks -> status dicts.
        self.query_peers: Any = None
        #: Called with each finished call's entry and end time (a trace writer: see
        #: :mod:`axondist.trace`); ``AXONDIST_TRACE=DIR`` sets one from the start.
        folder = _settings.read("AXONDIST_TRACE") if settings is None else settings.trace
        self.sink: Any = None if folder is None else _trace_writer(folder, self)

    # --- writing (the owner's threads) --------------------------------------------------
    def begin(self, group: str, seq: int, op: str, detail: Any, blocking: bool = True) -> int:
        """Record the start of call ``seq`` of ``group``; the slot to pass to :meth:`end`."""
        i = next(self._counter)  # atomic under the GIL: threads never share a slot
        j = i & self._mask
        self._slots[j] = (group, seq, op, detail, _monotonic(), blocking, i)
        self.issued[group] = seq  # a group's calls are numbered in the order they start
        return j

    def end(self, slot: int) -> None:
        """Record that the call in ``slot`` completed (returned or raised)."""
        end = self._ends[slot] = _monotonic()
        entry = self._slots[slot]
        if entry[_BLOCKING]:  # type: ignore[index]  # begin() filled the slot
            # blocking calls of a group end in the order they started
            self.completed[entry[_GROUP]] = entry[_SEQ]  # type: ignore[index]
        if self.sink is not None:
            self.sink(entry, end)
        if self.trace:
            _trace.debug("rank %d: %s #%d on %s [%s] in %.3f ms", self.rank,
                         entry[_OP], entry[_SEQ], entry[_GROUP],  # type: ignore[index]
                         describe_detail(entry[_DETAIL], entry[_OP]),  # type: ignore[index]
                         (end - entry[_START]) * 1e3)  # type: ignore[index]

    def end_blocking(self, slot: int, group: str, seq: int) -> None:
        """:meth:`end` of a blocking call ``seq`` of ``group`` (the hot path's)."""
        self._ends[slot] = _monotonic()
        self.completed[group] = seq
        if self.trace or self.sink is not None:
            self.end(slot)

    def complete(self, group: str, seq: int) -> None:
        """Count call ``seq`` of ``group`` as completed (a non-blocking call's wait ended)."""
        if self.completed.get(group, 0) < seq:
            self.completed[group] = seq

    # --- reading --------------------------------------------------------------------------
    def last_calls(self, last: int = 8) -> str:
        """``last calls of rank R (flight recorder, oldest first):`` and the last ``last``
        entries, a line each: what an error that ends a job shows of this rank."""
        return (f"last calls of rank {self.rank} (flight recorder, oldest first):\n"
                + format_entries(self.entries(last)))

    def entries(self, last: int | None = None) -> list[dict[str, Any]]:
        """The recorded calls, oldest first, as dicts (``last``: only the newest ones).

        Each has ``group``, ``seq``, ``op``, ``detail`` (text), ``blocking``,
        ``started_s_ago`` and ``state`` (``"running"`` or ``"done"``) with
        ``duration_s`` once done.
        """
        now = _monotonic()
        calls = self._calls()
        if last is not None:
            calls = calls[len(calls) - last:] if 0 < last < len(calls) else calls[:max(last, 0)]
        out = []
        for entry, end in calls:
            item = {"group": entry[_GROUP], "seq": entry[_SEQ], "op": entry[_OP],
                    "detail": describe_detail(entry[_DETAIL], entry[_OP]),
                    "blocking": entry[_BLOCKING],
                    "started_s_ago": round(now - entry[_START], 3),
                    "state": "done" if end else "running"}
            if end:
                item["duration_s"] = round(end - entry[_START], 6)
            peer = _peer_of(entry[_DETAIL])
            if peer is not None:
                item["peer"] = peer
            out.append(item)
        return out

    def _calls(self) -> list[tuple[tuple[Any, ...], float]]:
        """The ring's calls, oldest first, each with its end time (0.0: still running)."""
        ends = list(self._ends)  # read before the slots: an end newer than its slot's start
        calls = []               # then belongs to that slot's call
        for j, entry in enumerate(list(self._slots)):
            if entry is not None:
                end = ends[j]
                calls.append((entry, end if end >= entry[_START] else 0.0))
        calls.sort(key=lambda call: call[0][_ORDER])
        return calls

    def running(self) -> list[dict[str, Any]]:
        """Blocking calls in progress (normally one per thread that communicates)."""
        return [e for e in self.entries() if e["state"] == "running" and e["blocking"]]

    def last_completed(self) -> dict[str, Any] | None:
        """The newest completed call, with ``ended_s_ago``; None before the first."""
        now = _monotonic()
        for entry, end in reversed(self._calls()):
            if end:
                return {"group": entry[_GROUP], "seq": entry[_SEQ], "op": entry[_OP],
                        "detail": describe_detail(entry[_DETAIL], entry[_OP]),
                        "ended_s_ago": round(now - end, 3)}
        return None

    def status(self, recent: int = 8) -> dict[str, Any]:
        """What a peer's watchdog asks for: running calls, the last completed, counts."""
        return {"rank": self.rank, "host": self.host, "pid": self.pid,
                "running": self.running(), "last": self.last_completed(),
                "issued": dict(self.issued), "completed": dict(self.completed),
                "recent": self.entries(recent)}


def describe_call(entry: dict[str, Any]) -> str:
    """``all_reduce #5 on world (float32[1024], op=sum)`` from an entry of :meth:`entries`."""
    detail = f" ({entry['detail']})" if entry.get("detail") else ""
    return f"{entry['op']} #{entry['seq']} on {entry['group']}{detail}"


def describe_status(status: dict[str, Any]) -> str:
    """One line saying what a rank is doing, from :meth:`FlightRecorder.status`."""
    where = f"rank {status['rank']} (host {status.get('host') or '?'}, pid {status.get('pid')})"
    running = status.get("running") or []
    last = status.get("last")
    last_text = (f"its last completed call was {describe_call(last)}, "
                 f"{last['ended_s_ago']:.1f} s ago" if last else "it completed no call yet")
    if running:
        calls = "; ".join(f"{describe_call(e)} for {e['started_s_ago']:.1f} s" for e in running)
        return f"{where} waits in {calls}; {last_text}"
    return f"{where} is not in any axondist call (busy in its own code); {last_text}"


def format_entries(entries: Sequence[dict[str, Any]]) -> str:
    """A flight-recorder dump as lines (oldest first)."""
    lines = []
    for e in entries:
        state = (f"done in {e['duration_s'] * 1e3:.3f} ms" if e["state"] == "done"
                 else f"RUNNING for {e['started_s_ago']:.1f} s")
        kind = "" if e["blocking"] else " (async)"
        lines.append(f"  {describe_call(e)}{kind}: started {e['started_s_ago']:.3f} s ago, "
                     f"{state}")
    return "\n".join(lines)


def _trace_writer(folder: str, recorder: FlightRecorder) -> Any:
    """A trace writer into ``folder`` (``AXONDIST_TRACE``): the trace module loads only in a
    job that traces."""
    from .trace_file import TraceWriter

    return TraceWriter(folder, recorder, describe=describe_detail)


__all__ = ["FlightRecorder", "describe_call", "describe_detail", "describe_status",
           "format_entries"]
