"""One rank's trace file: the writer the flight recorder hands each finished call to.

A :class:`TraceWriter` appends one JSON object per line to
``DIR/rank-00003.jsonl``: the rank's calls (op, group, sequence number, bytes,
start, end, blocking or not), the user's spans and the clock exchanges, in
batches written by a thread of its own (every ``BATCH`` records or every
second, and at close), so a crash loses at most the last second's records and
a torn last line is skipped by the reader.
The disk is bounded per rank: when the file passes half of ``max_bytes`` it
becomes ``rank-00003.old.jsonl`` (replacing the previous one) and a new file
starts with the rank's header, groups and clock exchanges again.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .. import settings

#: Records kept in memory before they are written (a crash loses at most these).
BATCH = 512
#: Records kept at most: past it a call writes them itself (memory stays bounded).
_MAX_KEPT = 16 * BATCH
#: Seconds between two writes of the records kept so far, at the longest.
FLUSH_EVERY_S = 1.0
#: Bytes of trace kept on disk per rank by default (``AXONDIST_TRACE_MB``).
DEFAULT_MAX_BYTES = int(settings.BY_NAME["AXONDIST_TRACE_MB"].default * (1 << 20))
#: The trace format's version, in every file's header.
FORMAT = 1

# Fields of a flight-recorder ring entry (see recorder.py)
_GROUP, _SEQ, _OP, _DETAIL, _START, _BLOCKING = range(6)

_open_writers: weakref.WeakSet[TraceWriter] = weakref.WeakSet()


def rank_file(directory: str, rank: int, old: bool = False) -> str:
    """The path of ``rank``'s trace file in ``directory`` (``old``: its rotated one)."""
    return os.path.join(directory, f"rank-{rank:05d}{'.old' if old else ''}.jsonl")


def max_bytes_from_environment() -> int:
    """``AXONDIST_TRACE_MB`` (MiB of trace per rank) in bytes, else the default."""
    mib: float = settings.read("AXONDIST_TRACE_MB")
    return int(mib * (1 << 20))


def payload_bytes(detail: Any) -> int:
    """The bytes a call moves, from its detail's ``dtype`` and ``shape`` (or ``counts``,
    rows of the first dimension); 0 where the detail names neither."""
    if not isinstance(detail, tuple):
        return 0
    fields = dict(item for item in detail if isinstance(item, tuple) and len(item) == 2
                  and isinstance(item[0], str))
    if not fields and detail:
        # a backend's plain key: (dtype, shape, ...) as CALL_FIELDS names it
        fields = {"dtype": detail[0], "shape": detail[1] if len(detail) > 1 else None}
    itemsize = getattr(fields.get("dtype"), "itemsize", 0)
    shape = fields.get("shape")
    if isinstance(shape, tuple) and all(isinstance(n, int) for n in shape):
        count = 1
        for n in shape:
            count *= n
        return int(itemsize * count)
    counts = fields.get("counts")
    if isinstance(counts, tuple) and all(isinstance(n, int) for n in counts):
        return int(itemsize * sum(counts))
    return 0


class TraceWriter:
    """Appends one rank's calls, spans and clock exchanges to its file in ``directory``.

    The flight recorder calls the writer with each finished call (the ring
    entry and its end time): that costs an append to a queue. A thread of the
    writer's own formats and writes the queue every ``BATCH`` records or
    second. Any of the rank's threads may call it.

    Args:
        directory: the trace folder (made if missing).
        recorder: the rank's flight recorder (its rank, world size, host and groups).
        max_bytes: bytes kept on disk for this rank (two files of half each).
        describe: a call's detail and op as text (the flight recorder's
            ``describe_detail``); ``str(detail)`` when None.
    """

    def __init__(self, directory: str, recorder: Any, max_bytes: int | None = None,
                 describe: Callable[[Any, str], str] | None = None) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"trace: directory must be a folder path, got {directory!r}")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.recorder = recorder
        self.rank = recorder.rank
        self.max_bytes = max_bytes_from_environment() if max_bytes is None else int(max_bytes)
        if self.max_bytes < 4096:
            raise ValueError(f"trace: max_bytes={max_bytes} is too small; give at least 4096")
        self.path = rank_file(self.directory, self.rank)
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()
        self._clocks: list[dict[str, Any]] = []
        #: group name -> its members' world ranks, as each group was first seen in a call
        #: (a group may be gone from the recorder by the time its calls are written)
        self._members: dict[str, tuple[int, ...]] = {}
        self._members_written = -1
        self._file: Any = None
        self._size = 0
        self._call_fields: dict[Any, tuple[str, str]] = {}
        self._describe = describe or (lambda detail, op: "" if detail is None else str(detail))
        for stale in (self.path, rank_file(self.directory, self.rank, old=True)):
            # a previous run's trace of this rank; another process tracing into the same
            # folder (a second job, a spawn world per process) may remove it first
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        with self._lock:
            self._open_segment()
        _open_writers.add(self)
        # formatting and writing happen on this thread: a slow disk never holds up a call
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"axondist-trace-r{self.rank}")
        self._thread.start()

    def _write_loop(self) -> None:
        """Write the kept records every ``BATCH`` records or ``FLUSH_EVERY_S``, until closed."""
        while not self._closing:
            self._wake.wait(FLUSH_EVERY_S)
            self._wake.clear()
            self.flush()

    # --- the hot path (the recorder's sink) -----------------------------------------------
    def __call__(self, entry: tuple[Any, ...], end: float) -> None:
        """Keep a finished call (a flight-recorder entry and its end time)."""
        if entry[_GROUP] not in self._members:
            self._members[entry[_GROUP]] = self.recorder.groups.get(entry[_GROUP], ())
        self._pending.append((entry, end))
        if len(self._pending) >= BATCH:
            self._wake.set()
            if len(self._pending) >= _MAX_KEPT:  # the writer's thread fell behind
                self.flush()

    def span(self, name: str, start: float, end: float) -> None:
        """Keep a user span from ``start`` to ``end`` (``time.monotonic`` seconds)."""
        self._pending.append(("span", name, start, end, threading.current_thread().name))
        if len(self._pending) >= BATCH:
            self._wake.set()

    def clock(self, record: dict[str, Any]) -> None:
        """Write a clock exchange's result now (repeated in every later segment)."""
        with self._lock:
            self._clocks.append(record)
        self.write_record({"clock": record})

    def write_record(self, record: dict[str, Any]) -> None:
        """Append one record (after the calls kept so far)."""
        self._pending.append(("record", record))
        self.flush()

    # --- writing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the kept records to the file and flush it to the operating system."""
        with self._lock:
            if self._file is None:
                self._pending.clear()
                return
            pending = self._pending
            left = len(pending)
            while True:  # a batch at a time: the file rotates between batches
                lines = []
                if len(self._members) != self._members_written:
                    lines.append(self._groups_line())
                for _ in range(min(left, BATCH)):
                    lines.append(self._line(pending.popleft()))
                left -= BATCH
                if lines:
                    self._write("".join(lines))
                if left <= 0:
                    break
            self._file.flush()

    def _write(self, text: str) -> None:
        """Append ``text``, first starting a new file when this one would pass its half."""
        if self._size + len(text) > self.max_bytes // 2 and self._size > 0:
            self._rotate()  # the new file starts with the header and groups
            if text.startswith('{"groups"'):
                text = text[text.index("\n") + 1:]
        self._file.write(text)
        self._size += len(text)

    def close(self) -> None:
        """Write what is kept and close the file (later calls are dropped)."""
        self._closing = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        _open_writers.discard(self)

    def _line(self, item: tuple[Any, ...]) -> str:
        if item[0] == "span":
            _, name, start, end, thread = item
            return json.dumps({"span": str(name), "start": start, "end": end,
                               "thread": thread}) + "\n"
        if item[0] == "record":
            return json.dumps(item[1], default=str) + "\n"
        entry, end = item
        # the fields a call shares with others of its kind, as JSON text made once
        kind: tuple[Any, ...] | None = (entry[_OP], entry[_GROUP], entry[_BLOCKING],
                                         entry[_DETAIL])
        try:
            fields = self._call_fields.get(kind)
        except TypeError:  # an unhashable detail
            kind, fields = None, None
        if fields is None:
            fields = self._fields_of(entry)
            if kind is not None and len(self._call_fields) < 4096:
                self._call_fields[kind] = fields
        return (f'{{"call": {fields[0]}, "seq": {int(entry[_SEQ])}, '
                f'"start": {float(entry[_START])!r}, "end": {float(end)!r}, {fields[1]}}}\n')

    def _fields_of(self, entry: tuple[Any, ...]) -> tuple[str, str]:
        """A call's op, and its group, bytes, blocking and detail, as JSON fragments."""
        detail = entry[_DETAIL]
        text = _first_of_each_field(self._describe(detail, entry[_OP]))
        rest = json.dumps({"group": entry[_GROUP], "bytes": payload_bytes(detail),
                           "blocking": bool(entry[_BLOCKING]), "detail": text})
        return json.dumps(entry[_OP]), rest[1:-1]

    def _groups_line(self) -> str:
        for name, ranks in list(self.recorder.groups.items()):
            if not self._members.get(name):
                self._members[name] = tuple(ranks)
        self._members_written = len(self._members)
        return json.dumps({"groups": {name: list(ranks) for name, ranks
                                      in list(self._members.items()) if ranks}}) + "\n"

    def _header_lines(self) -> str:
        rec = self.recorder
        header = {"format": FORMAT, "rank": rec.rank, "world_size": rec.world_size,
                  "host": rec.host or os.uname().nodename, "pid": os.getpid(),
                  "clock": "time.monotonic", "wall_minus_clock": time.time() - time.monotonic(),
                  "max_bytes": self.max_bytes}
        lines = [json.dumps({"header": header}) + "\n", self._groups_line()]
        lines += [json.dumps({"clock": c}, default=str) + "\n" for c in self._clocks]
        return "".join(lines)

    def _open_segment(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        self._size = self._file.tell()
        text = self._header_lines()
        self._file.write(text)
        self._file.flush()
        self._size += len(text)

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, rank_file(self.directory, self.rank, old=True))
        self._file = None
        self._open_segment()


def _first_of_each_field(text: str) -> str:
    """``dtype=f4, op=sum, op=SUM`` -> ``dtype=f4, op=sum`` (a field named twice, once by the
    caller and once by the backend, is shown once)."""
    seen, kept = set(), []
    for part in text.split(", "):
        name = part.split("=", 1)[0].lower()
        if "=" in part and name in seen:
            continue
        seen.add(name)
        kept.append(part)
    return ", ".join(kept)


@atexit.register
def _close_open_writers() -> None:
    for writer in list(_open_writers):
        writer.close()


__all__ = ["BATCH", "DEFAULT_MAX_BYTES", "TraceWriter", "max_bytes_from_environment",
           "payload_bytes", "rank_file"]
