"""The straggler report: for each collective the last rank to arrive and how long the
others waited for it, summed per rank and per call.

A collective *held* the job for the time between its first and its last
rank's arrival: that is what the rank arriving last "kept the others
waiting". The ranks' waits added up (rank-seconds) are reported beside it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .timeline import Collective, Timeline


@dataclass
class RankDelay:
    """What one rank cost the others, as the rank arriving last."""

    held_s: float = 0.0
    """Seconds the first arrivals waited for this rank, summed over its collectives."""
    waited_rank_s: float = 0.0
    """The other ranks' waits for it, added up (rank-seconds)."""
    times_last: int = 0
    """Collectives it arrived last at."""
    by_call: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Call label -> held seconds."""


@dataclass
class CallDelay:
    """One kind of call (op and detail) over the run."""

    calls: int = 0
    held_s: float = 0.0
    last_ranks: Counter[int] = field(default_factory=Counter)


@dataclass
class StragglerReport:
    """The per-rank and per-call totals of a run's waits (:func:`straggler_report`)."""

    collectives: int
    partial: int
    ranks: dict[int, RankDelay]
    calls: dict[str, CallDelay]
    worst: list[Collective]
    clock_note: str
    steps: int = 0
    """Spans named ``step`` on the rank with the most (0: the run marked none)."""

    def held_s(self, rank: int) -> float:
        """Seconds ``rank`` kept the others waiting."""
        delay = self.ranks.get(rank)
        return 0.0 if delay is None else delay.held_s

    @property
    def straggler(self) -> int | None:
        """The rank that kept the others waiting longest (None without collectives)."""
        if not self.ranks:
            return None
        return max(self.ranks, key=lambda r: (self.ranks[r].held_s, -r))


def straggler_report(timeline: Timeline, worst: int = 5) -> StragglerReport:
    """Sum, over the collectives of ``timeline``, who arrived last and how long the others
    waited; keep the ``worst`` collectives that held the job longest."""
    collectives, partial = timeline.collectives()
    ranks: dict[int, RankDelay] = {r: RankDelay() for r in timeline.ranks}
    calls: dict[str, CallDelay] = defaultdict(CallDelay)
    for c in collectives:
        last = c.last_rank
        delay = ranks.setdefault(last, RankDelay())
        delay.held_s += c.held_s
        delay.waited_rank_s += sum(c.waits().values())
        delay.times_last += 1
        delay.by_call[c.label] += c.held_s
        kind = calls[c.label]
        kind.calls += 1
        kind.held_s += c.held_s
        kind.last_ranks[last] += 1
    top = sorted(collectives, key=lambda c: c.held_s, reverse=True)[:worst]
    steps = max((sum(1 for s in t.spans if s.name.lower() == "step")
                 for t in timeline.ranks.values()), default=0)
    return StragglerReport(len(collectives), partial, ranks, dict(calls), top,
                           timeline.clock_note(), steps)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def format_report(report: StragglerReport, calls: int = 8) -> str:
    """The report as text: one line per rank (worst first), the ``calls`` kinds of call that
    held the job longest, and the longest single waits."""
    lines = [f"straggler report: {report.collectives:,} collectives matched across ranks"
             + (f" ({report.partial:,} recorded by only some of their ranks, left out)"
                if report.partial else ""), report.clock_note]
    if not report.collectives:
        return "\n".join(lines + ["no collective was recorded by all of its ranks"])
    total = sum(d.held_s for d in report.ranks.values())
    lines.append("per rank (time the others waited for it as the last to arrive):")
    over = (f"{report.steps:,} steps ({report.collectives:,} collectives)" if report.steps
            else f"{report.collectives:,} collectives")
    for rank, d in sorted(report.ranks.items(), key=lambda kv: -kv[1].held_s):
        text = (f"  rank {rank} kept the others waiting {_seconds(d.held_s)} over "
                f"{over} (last to arrive at {d.times_last:,}; "
                f"{_seconds(d.waited_rank_s)} of waiting added over the ranks)")
        if d.by_call and d.held_s > 0:
            label, held = max(d.by_call.items(), key=lambda kv: kv[1])
            text += f", {100 * held / d.held_s:.0f}% of it before {label}"
        lines.append(text)
    lines.append("per call:")
    kinds = sorted(report.calls.items(), key=lambda kv: -kv[1].held_s)
    if len(kinds) > calls:
        rest = sum(k.held_s for _, k in kinds[calls:])
        kinds = kinds[:calls]
    for label, k in kinds:
        share = 100 * k.held_s / total if total > 0 else 0.0
        who = ", ".join(f"rank {r} x{n}" for r, n in k.last_ranks.most_common(3))
        lines.append(f"  {label}: {k.calls:,} calls held {_seconds(k.held_s)} ({share:.0f}%); "
                     f"last to arrive: {who}")
    if len(report.calls) > calls:
        lines.append(f"  ({len(report.calls) - calls} more kinds of call held "
                     f"{_seconds(rest)} together)")
    lines.append("longest waits:")
    for c in report.worst:
        lines.append(f"  {c.label} #{c.seq} on {c.group}: rank {c.last_rank} arrived "
                     f"{_seconds(c.held_s)} after the first")
    return "\n".join(lines)


__all__ = ["CallDelay", "RankDelay", "StragglerReport", "format_report", "straggler_report"]
