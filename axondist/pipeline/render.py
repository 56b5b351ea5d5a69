"""Pictures of a simulated schedule: a text grid (always) and an image (with matplotlib)."""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping
from typing import Any

from axondist._validate import positive_number
from axondist.pipeline.schedules import ActionKind, Schedule
from axondist.pipeline.simulate import Costs, SimulationResult, simulate

__all__ = ["render_image", "render_text"]


def _as_result(
    obj: Schedule | SimulationResult, costs: Costs | None, comm: float, what: str
) -> SimulationResult:
    if isinstance(obj, SimulationResult):
        return obj
    if isinstance(obj, Schedule):
        return simulate(obj, costs, comm=comm)
    raise TypeError(
        f"{what}: obj must be a Schedule (build_schedule or parse_schedule make one) or a "
        f"SimulationResult (simulate makes one), got {type(obj).__name__} {obj!r:.60}")


def render_text(
    obj: Schedule | SimulationResult,
    *,
    costs: Costs | None = None,
    comm: float = 0.0,
    slot: float | None = None,
) -> str:
    """A rank x time grid: one row per rank, one column per ``slot`` time units.

    A cell shows the action running at the middle of its slot (``"F0"``,
    ``"B3"``, ``"1F2"`` for chunk 1 when chunks > 1) or ``"."`` when the rank
    is idle, so the bubble is visible; an action lasting several slots fills
    several cells, and one shorter than ``slot`` may not show. The last line
    gives makespan, bubble fraction and peak activations.

    Args:
        obj: a :class:`Schedule` (simulated first with ``costs`` and ``comm``)
            or a :class:`SimulationResult`, simulated or measured
            (:meth:`PipelineRunStats.as_simulation`).
        costs: action durations for a Schedule, as for :func:`simulate`.
        comm: message latency for a Schedule, as for :func:`simulate`.
        slot: time units per column; 1 when every simulated time is an
            integer, else the shortest action, when None.

    Returns:
        The grid, lines joined by newlines.

    Raises:
        TypeError: ``obj`` is neither a Schedule nor a SimulationResult, or
            ``slot`` is not a number.
        ValueError: ``slot`` is not a finite number > 0.
        ScheduleError: the Schedule deadlocks (from :func:`simulate`).
    """
    result = _as_result(obj, costs, comm, "render_text")
    schedule = result.schedule
    timed = [t for row in result.timeline for t in row]
    if slot is None:
        if all(float(t.start).is_integer() and float(t.end).is_integer() for t in timed):
            slot = 1.0
        else:
            slot = min((t.end - t.start for t in timed), default=1.0)
    slot = positive_number(slot, "render_text", "slot")
    ncols = math.ceil(result.makespan / slot - 1e-9) if result.makespan > 0 else 0

    labels = {id(t): t.action.text(schedule.chunks) for t in timed}
    width = max([len(x) for x in labels.values()] + [1])
    row_name_width = len(f"rank {schedule.num_ranks - 1}")
    lines = []
    # Header: the start time of every 5th column.
    header = [" "] * (ncols * (width + 1))
    for c in range(0, ncols, 5):
        mark = f"{c * slot:g}"
        pos = c * (width + 1)
        for i, ch in enumerate(mark):
            if pos + i < len(header):
                header[pos + i] = ch
    lines.append(f"{'t':<{row_name_width}} | " + "".join(header).rstrip())
    for r, row in enumerate(result.timeline):
        starts = [t.start for t in row]
        cells = []
        for c in range(ncols):
            mid = (c + 0.5) * slot
            i = bisect.bisect_right(starts, mid) - 1
            if i >= 0 and row[i].start <= mid < row[i].end:
                cells.append(f"{labels[id(row[i])]:<{width}}")
            else:
                cells.append(f"{'.':<{width}}")
        lines.append(f"{f'rank {r}':<{row_name_width}} | " + " ".join(cells).rstrip())
    lines.append(
        f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}, "
        f"peak activations per rank {list(result.peak_activations)}"
    )
    return "\n".join(lines)


_COLORS: Mapping[ActionKind, str] = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#55A868",
    ActionKind.I: "#2A8C9E",
    ActionKind.W: "#7F7F7F",
}
_MEANING: Mapping[ActionKind, str] = {
    ActionKind.F: "F: forward",
    ActionKind.B: "B: backward",
    ActionKind.I: "I: input gradient",
    ActionKind.W: "W: weight gradient",
}
_INCH_PER_ACTION = 0.42  # the busiest rank's actions set the width, whatever the time unit
_MAX_WIDTH = 24.0  # inches; beyond it labels that do not fit across their bar run up it
_LABEL_PT = 7.0  # a label's size where it fits
_MIN_ACROSS_PT = 5.0  # below this a label runs up its bar instead of across
_MIN_UP_PT = 4.0
_INCH_PER_CHAR_PT = 0.0093  # a character's width per point of size (DejaVu Sans: 0.065 in at 7)
_LINE_INCH_PER_PT = 1.25 / 72  # a line's height per point of font size
_FILL = 0.8  # of a bar's width a label may take, leaving a margin either side


def _shade(chunk: int, chunks: int) -> float:
    """Opacity of a chunk's bars: 1 for chunk 0, fading to 0.55 for the last."""
    return 1.0 - 0.45 * (chunk / max(1, chunks - 1))


def _label_style(label: str, box_inches: float) -> dict[str, Any]:
    """How a bar's label is drawn so that it never vanishes: across the bar at 7 pt, or
    smaller down to 5 pt; on a bar narrower than that, up the bar (rotated), in a size that
    fits its width (4 pt at least)."""
    across = _FILL * box_inches / (_INCH_PER_CHAR_PT * len(label))  # the size that fits across
    if across >= _MIN_ACROSS_PT:
        return {"fontsize": min(_LABEL_PT, across), "rotation": 0}
    up = _FILL * box_inches / _LINE_INCH_PER_PT  # one line of text up the bar
    return {"fontsize": max(_MIN_UP_PT, min(_LABEL_PT, up)), "rotation": 90}


def _text_colour(alpha: float) -> str:
    """White on the dark shades, black on the pale ones (later chunks)."""
    return "white" if alpha >= 0.75 else "black"


def _figure_size(result: SimulationResult) -> tuple[float, float]:
    most = max((len(row) for row in result.timeline), default=0)
    width = min(_MAX_WIDTH, max(6.0, 2.5 + _INCH_PER_ACTION * most))
    return width, 0.55 * result.schedule.num_ranks + 1.3


def render_image(
    obj: Schedule | SimulationResult,
    path: str | os.PathLike[str],
    *,
    costs: Costs | None = None,
    comm: float = 0.0,
    title: str | None = None,
) -> None:
    """Draw the timeline as a Gantt chart (one row per rank, white gaps = bubble) to ``path``.

    Bars are coloured by action kind; the chunks of an interleaved schedule
    are told apart by shade (chunk 0 darkest), shown in the legend in each
    kind's colour, and by the label's chunk prefix. Every bar is labelled:
    across the bar where the label fits, else up it in a smaller size. The
    width follows the busiest rank's number of actions rather than the time
    unit, so seconds, milliseconds and simulate's units give the same
    picture. matplotlib, which axondist does not depend on, is
    imported on the first call, and only its object API is used: pyplot's
    global state and backend are left alone.

    Args:
        obj: a :class:`Schedule` (simulated first with ``costs`` and ``comm``)
            or a :class:`SimulationResult`, simulated or measured.
        path: the file to write; the extension picks the format (``.png``,
            ``.svg``, ``.pdf``...).
        costs: action durations for a Schedule, as for :func:`simulate`.
        comm: message latency for a Schedule, as for :func:`simulate`.
        title: the picture's title; the kind, shape and bubble when None.

    Raises:
        ImportError: matplotlib is not installed (the message says how to
            install it, or to use :func:`render_text`).
        TypeError: ``obj`` is neither a Schedule nor a SimulationResult.
        ScheduleError: the Schedule deadlocks (from :func:`simulate`).
    """
    figure_cls, patch_cls, tuple_handler = _matplotlib()
    result = _as_result(obj, costs, comm, "render_image")
    schedule = result.schedule
    p = schedule.num_ranks
    fig = figure_cls(figsize=_figure_size(result))
    ax = fig.subplots()
    inch_per_unit = fig.get_figwidth() * 0.8 / max(result.makespan, 1e-12)
    for r, row in enumerate(result.timeline):
        for t in row:
            alpha = _shade(t.action.chunk, schedule.chunks)
            ax.barh(
                r, t.end - t.start, left=t.start, height=0.8, color=_COLORS[t.action.kind],
                alpha=alpha, edgecolor="black", linewidth=0.5,
            )
            label = t.action.text(schedule.chunks)
            ax.text(
                (t.start + t.end) / 2, r, label, ha="center", va="center",
                color=_text_colour(alpha),
                **_label_style(label, (t.end - t.start) * inch_per_unit),
            )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    present = {t.action.kind for row in result.timeline for t in row}
    kinds = [k for k in ActionKind if k in present]
    handles: list[Any] = [patch_cls(color=_COLORS[k], label=_MEANING[k]) for k in kinds]
    labels = [_MEANING[k] for k in kinds]
    if schedule.chunks > 1:  # a chunk's swatch: each kind's colour in that chunk's shade
        for c in range(schedule.chunks):
            alpha = _shade(c, schedule.chunks)
            handles.append(tuple(patch_cls(color=_COLORS[k], alpha=alpha) for k in kinds))
            labels.append(f"chunk {c}")
    ax.legend(
        handles, labels, handler_map={tuple: tuple_handler(ndivide=None, pad=0.0)},
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
    )
    name = schedule.kind.value if schedule.kind is not None else "custom"
    ax.set_title(
        title or f"{name}: {p} ranks, {schedule.num_microbatches} microbatches, "
        f"{schedule.chunks} chunk(s), bubble {result.bubble_fraction:.1%}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)


def _matplotlib() -> tuple[Any, Any, Any]:
    """matplotlib's Figure, Patch and HandlerTuple classes, imported on first use (an
    optional dependency)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.legend_handler import HandlerTuple
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "render_image needs matplotlib, which is not installed; install it with "
            "`pip install matplotlib` (or `pip install '.[examples]'` in a checkout), or use "
            "render_text, which needs nothing"
        ) from err
    return Figure, Patch, HandlerTuple
