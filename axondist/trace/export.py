"""A timeline as pictures: a Chrome/Perfetto trace JSON (``ui.perfetto.dev``,
``chrome://tracing``) and a PNG (matplotlib, an optional extra).

In the JSON each rank is a process with a track for its blocking calls, one
for its non-blocking calls and waits, and one for the user's spans; each
call carries its group, sequence number, bytes and how long the rank
waited there for the last one to arrive.
"""

from __future__ import annotations

import json
from typing import Any

from .timeline import Call, Timeline

#: Track (thread) ids of a rank's process in the trace JSON.
TRACKS = {"collectives": 1, "async calls and waits": 2, "spans": 3}


def _origin(timeline: Timeline) -> float:
    starts = [c.start for c in timeline.calls] + [s.start for s in timeline.spans]
    return min(starts, default=0.0)


def _waits(timeline: Timeline) -> dict[tuple[int, str, int], float]:
    """(rank, group, seq) -> seconds the rank waited there for the last rank."""
    out = {}
    for c in timeline.collectives()[0]:
        for rank, wait in c.waits().items():
            out[(rank, c.group, c.seq)] = wait
    return out


def _call_track(call: Call) -> int:
    async_like = not call.blocking or call.op.startswith("wait ")
    return TRACKS["async calls and waits" if async_like else "collectives"]


def perfetto_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace-event JSON object (times in microseconds from the
    first event)."""
    t0 = _origin(timeline)
    waits = _waits(timeline)
    events: list[dict[str, Any]] = []
    for rank, trace in timeline.ranks.items():
        host = trace.header.get("host", "")
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}" + (f" ({host})" if host else "")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                       "args": {"sort_index": rank}})
        for name, tid in TRACKS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for c in trace.calls:
            args: dict[str, Any] = {"group": c.group, "seq": c.seq, "bytes": c.bytes,
                                    "blocking": c.blocking, "detail": c.detail}
            wait = waits.get((rank, c.group, c.seq))
            if wait is not None:
                args["waited_for_last_rank_ms"] = round(wait * 1e3, 3)
            events.append({"ph": "X", "name": c.op, "cat": "collective", "pid": rank,
                           "tid": _call_track(c), "ts": round((c.start - t0) * 1e6, 3),
                           "dur": round(max(c.end - c.start, 0.0) * 1e6, 3), "args": args})
        for s in trace.spans:
            events.append({"ph": "X", "name": s.name, "cat": "span", "pid": rank,
                           "tid": TRACKS["spans"], "ts": round((s.start - t0) * 1e6, 3),
                           "dur": round(max(s.end - s.start, 0.0) * 1e6, 3),
                           "args": {"thread": s.thread}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clocks": timeline.clock_note()}}


def write_perfetto(timeline: Timeline, path: str) -> None:
    """Write :func:`perfetto_trace` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(perfetto_trace(timeline), f, separators=(",", ":"))


def _span_depths(spans: list[Any]) -> list[int]:
    """Each span's nesting depth among its rank's spans (0: outermost)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end))
    depths = [0] * len(spans)
    open_ends: list[float] = []
    for i in order:
        while open_ends and open_ends[-1] <= spans[i].start:
            open_ends.pop()
        depths[i] = len(open_ends)
        open_ends.append(spans[i].end)
    return depths


#: Qualitative colour maps the legend's colours are drawn from: tab10's ten first, then
#: whichever colour of the others lies farthest from every colour already taken.
_PALETTES = ("tab10", "Dark2", "Set1", "Set2", "Accent", "tab20")


def legend_colours(plt: Any, count: int) -> list[Any]:
    """``count`` colours for the picture's legend, each as far from the ones before it as the
    palettes allow (tab10's ten are far apart; a near-twin of one, such as tab20's blues
    beside tab10's, comes only once the distinct ones run out)."""
    pool = [tuple(cmap.colors[i])[:3] for cmap in map(plt.get_cmap, _PALETTES)
            for i in range(len(cmap.colors))]
    taken = list(dict.fromkeys(pool[:10]))
    rest = [c for c in dict.fromkeys(pool[10:]) if c not in taken]
    while len(taken) < count and rest:
        far = max(rest, key=lambda c: min(sum((a - b) ** 2 for a, b in zip(c, t))
                                          for t in taken))
        rest.remove(far)
        taken.append(far)
    return [taken[i % len(taken)] for i in range(count)]


def write_png(timeline: Timeline, path: str, title: str = "") -> None:
    """Draw the timeline: per rank a row of calls (coloured by op, the time spent waiting
    for the last rank hatched in red) and a row of spans.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the message says what to install).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "trace: drawing the PNG needs matplotlib: pip install matplotlib (or "
            "pip install '.[examples]' from the axondist checkout); the JSON and the report "
            "do not") from None
    t0 = _origin(timeline)
    waits = _waits(timeline)
    ranks = list(timeline.ranks)
    ops = sorted({c.op for c in timeline.calls})
    span_names = sorted({s.name for s in timeline.spans})
    colours = legend_colours(plt, len(ops) + len(span_names))
    colour = dict(zip(ops, colours))
    span_colour = dict(zip(span_names, colours[len(ops):]))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(ranks)))
    for row, rank in enumerate(ranks):
        base = (len(ranks) - 1 - row) * 2
        trace = timeline.ranks[rank]
        depths = _span_depths(trace.spans)
        levels = min(max(depths, default=0) + 1, 3)
        height = 0.8 / levels
        for s, depth in zip(trace.spans, depths):
            if depth >= levels:
                continue
            ax.broken_barh([(s.start - t0, s.end - s.start)],
                           (base + 1.05 + (levels - 1 - depth) * height, height),
                           color=span_colour[s.name], edgecolor="grey", linewidth=0.3)
        for c in trace.calls:
            ax.broken_barh([(c.start - t0, c.end - c.start)], (base + 0.1, 0.8),
                           color=colour[c.op])
            wait = waits.get((rank, c.group, c.seq), 0.0)
            if wait > 0:
                ax.broken_barh([(c.start - t0, min(wait, c.end - c.start))], (base + 0.1, 0.8),
                               facecolor="none", edgecolor="red", hatch="////", linewidth=0)
    ax.set_yticks([(len(ranks) - 1 - row) * 2 + off for row in range(len(ranks))
                   for off in (0.5, 1.45)])
    ax.set_yticklabels([f"rank {r} {kind}" for r in ranks for kind in ("calls", "spans")])
    ax.set_ylim(-0.1, 2 * len(ranks))
    ax.set_xlabel("seconds (rank 0's clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[op]) for op in ops]
    handles += [plt.Rectangle((0, 0), 1, 1, color=span_colour[n]) for n in span_names]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="red",
                                 hatch="////"))
    ax.legend(handles, ops + span_names + ["waiting for the last rank"], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=min(6, len(handles)), fontsize=8, frameon=False)
    ax.set_title(title or f"{len(ranks)} ranks: calls and spans")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["TRACKS", "perfetto_trace", "write_perfetto", "write_png"]
