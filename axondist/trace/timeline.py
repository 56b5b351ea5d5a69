"""Reading a trace folder back: every rank's calls and spans on rank 0's clock, and the
collectives matched across ranks (who arrived when, who was last).

Times are in seconds on rank 0's ``time.monotonic()``: each rank's readings
are moved by its clock offset, interpolated linearly between its clock
exchanges (one exchange: a constant; none: 0, right on one host where every
process reads the same monotonic clock). A line that does not parse (the torn
last line of a rank that crashed) is skipped and counted.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..backends.recording.trace_file import rank_file


@dataclass(frozen=True)
class Call:
    """One call of one rank, on the common clock."""

    rank: int
    op: str
    group: str
    seq: int
    bytes: int
    start: float
    end: float
    blocking: bool
    detail: str

    @property
    def label(self) -> str:
        """``all_reduce (dtype=float32, shape=[1024])``: the op and its detail."""
        return f"{self.op} ({self.detail})" if self.detail else self.op


@dataclass(frozen=True)
class Span:
    """One user span (:func:`axondist.trace_span`) of one rank, on the common clock."""

    rank: int
    name: str
    start: float
    end: float
    thread: str


@dataclass
class RankTrace:
    """What one rank's files hold."""

    rank: int
    header: dict[str, Any]
    calls: list[Call] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    clocks: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skipped_lines: int = 0


@dataclass(frozen=True)
class Collective:
    """One collective call (``seq`` of ``group``) as every member rank saw it."""

    group: str
    seq: int
    label: str
    arrivals: dict[int, float]
    """world rank -> when it entered the call."""
    ends: dict[int, float]
    """world rank -> when the call returned on it."""

    @property
    def last_rank(self) -> int:
        """The rank that arrived last (the others waited for it)."""
        return max(self.arrivals, key=lambda r: (self.arrivals[r], r))

    @property
    def held_s(self) -> float:
        """How long the first rank to arrive waited for the last one."""
        return max(self.arrivals.values()) - min(self.arrivals.values())

    def waits(self) -> dict[int, float]:
        """world rank -> how long it waited for the last rank (0 for the last one)."""
        last = max(self.arrivals.values())
        return {r: last - t for r, t in self.arrivals.items()}


class Timeline:
    """Every rank's trace from one folder, on rank 0's clock."""

    def __init__(self, ranks: dict[int, RankTrace]) -> None:
        self.ranks = dict(sorted(ranks.items()))

    @property
    def calls(self) -> list[Call]:
        """Every rank's calls, by start time."""
        return sorted((c for t in self.ranks.values() for c in t.calls), key=lambda c: c.start)

    @property
    def spans(self) -> list[Span]:
        """Every rank's spans, by start time."""
        return sorted((s for t in self.ranks.values() for s in t.spans), key=lambda s: s.start)

    def groups(self) -> dict[str, tuple[int, ...]]:
        """Group name -> its world ranks, as the ranks wrote them."""
        out: dict[str, tuple[int, ...]] = {}
        for trace in self.ranks.values():
            out.update(trace.groups)
        return out

    def clock_note(self) -> str:
        """One line saying how the ranks' clocks were aligned."""
        synced = [r for r, t in self.ranks.items() if t.clocks]
        if not synced:
            return ("clocks: no ping exchange recorded (trace.start/stop); times taken as they "
                    "are, right on one host")
        worst = max((abs(c["offset_s"]), c["rtt_s"]) for r in synced
                    for c in self.ranks[r].clocks)
        return (f"clocks: ping exchanges on {len(synced)} of {len(self.ranks)} ranks; largest "
                f"offset {worst[0] * 1e3:.3f} ms (round trip {worst[1] * 1e3:.3f} ms)")

    def collectives(self) -> tuple[list[Collective], int]:
        """The collectives every member rank recorded, by the last arrival; and how many
        were recorded by only some of their ranks (rotated out, or a rank stopped)."""
        # a group's name is not unique across ranks (each rank names its own groups of one,
        # say): a collective is its group's name, its members as the rank saw them, and seq
        seen: dict[tuple[str, tuple[int, ...] | None, int], dict[int, Call]] = {}
        for trace in self.ranks.values():
            for call in trace.calls:
                if call.group.endswith(":p2p") or call.op.startswith("wait "):
                    continue  # point to point and waits on async calls pair up differently
                members = trace.groups.get(call.group)
                seen.setdefault((call.group, members, call.seq), {})[trace.rank] = call
        matched, partial = [], 0
        for (group, members, seq), by_rank in seen.items():
            if members is not None and set(members) - set(by_rank):
                partial += 1
                continue
            if len(by_rank) < 2:
                continue  # a group of one: nobody waits
            first = next(iter(by_rank.values()))
            matched.append(Collective(group, seq, first.label,
                                      {r: c.start for r, c in by_rank.items()},
                                      {r: c.end for r, c in by_rank.items()}))
        matched.sort(key=lambda c: max(c.arrivals.values()))
        return matched, partial


def _offset_function(clocks: list[dict[str, Any]]) -> Any:
    """``t -> offset`` (seconds to add to this rank's clock), linear between exchanges."""
    points = sorted((float(c["at"]), float(c["offset_s"])) for c in clocks)
    if not points:
        return lambda t: 0.0
    if len(points) == 1:
        return lambda t: points[0][1]

    def offset(t: float) -> float:
        if t <= points[0][0]:
            (a, oa), (b, ob) = points[0], points[1]
        elif t >= points[-1][0]:
            (a, oa), (b, ob) = points[-2], points[-1]
        else:
            k = next(i for i in range(1, len(points)) if points[i][0] >= t)
            (a, oa), (b, ob) = points[k - 1], points[k]
        return oa if b == a else oa + (ob - oa) * (t - a) / (b - a)

    return offset


def _records(path: str) -> tuple[list[dict[str, Any]], int]:
    """A file's records; and the lines that did not parse (a torn last line)."""
    out, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(record, dict):
                out.append(record)
            else:
                skipped += 1
    return out, skipped


def read_rank(directory: str, rank: int) -> RankTrace:
    """One rank's trace (its rotated file, then its current one), on rank 0's clock."""
    records: list[dict[str, Any]] = []
    skipped = 0
    for path in (rank_file(directory, rank, old=True), rank_file(directory, rank)):
        if os.path.exists(path):
            more, bad = _records(path)
            records += more
            skipped += bad
    trace = RankTrace(rank, {}, skipped_lines=skipped)
    raw_calls, raw_spans = [], []
    for record in records:
        if "call" in record:
            raw_calls.append(record)
        elif "span" in record:
            raw_spans.append(record)
        elif "clock" in record:
            if record["clock"] not in trace.clocks:  # repeated in each rotated segment
                trace.clocks.append(record["clock"])
        elif "groups" in record:
            trace.groups.update({g: tuple(r) for g, r in record["groups"].items()})
        elif "header" in record:
            trace.header = record["header"]
    shift = _offset_function(trace.clocks)
    for c in raw_calls:
        d = shift(c["start"])
        trace.calls.append(Call(rank, c["call"], c["group"], int(c["seq"]), int(c["bytes"]),
                                c["start"] + d, c["end"] + d, bool(c["blocking"]),
                                c.get("detail") or ""))
    for s in raw_spans:
        d = shift(s["start"])
        trace.spans.append(Span(rank, s["span"], s["start"] + d, s["end"] + d,
                                s.get("thread", "")))
    return trace


def read_timeline(directory: str) -> Timeline:
    """Every rank's trace in ``directory``.

    Raises:
        FileNotFoundError: the folder holds no rank files (the message says what to run).
    """
    ranks = sorted({int(m.group(1)) for path in glob.glob(os.path.join(directory, "rank-*.jsonl"))
                    if (m := re.match(r"rank-(\d+)(\.old)?\.jsonl$", os.path.basename(path)))})
    if not ranks:
        raise FileNotFoundError(
            f"trace: {directory!r} holds no rank-NNNNN.jsonl files; record a run with "
            "AXONDIST_TRACE=DIR or axondist.trace.start(DIR) first")
    return Timeline({r: read_rank(directory, r) for r in ranks})


__all__ = ["Call", "Collective", "RankTrace", "Span", "Timeline", "read_rank", "read_timeline"]
