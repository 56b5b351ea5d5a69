"""Pictures of a simulated schedule: a text grid (always) and an image (with matplotlib)."""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping

from axondist.pipeline.schedules import ActionKind, Schedule
from axondist.pipeline.simulate import Costs, SimulationResult, simulate

__all__ = ["render_image", "render_text"]


def _as_result(
    obj: Schedule | SimulationResult, costs: Costs | None, comm: float
) -> SimulationResult:
    if isinstance(obj, SimulationResult):
        return obj
    if isinstance(obj, Schedule):
        return simulate(obj, costs, comm=comm)
    raise TypeError(f"expected a Schedule or SimulationResult, got {type(obj).__name__}")


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
    is idle, so the bubble is visible.  An action lasting several slots fills
    several cells.  ``slot`` defaults to 1 when all simulated times are
    integers, else to the shortest action; actions shorter than ``slot`` may
    not show.  A :class:`Schedule` is simulated first with ``costs``/``comm``.
    The last line gives makespan, bubble fraction and peak activations.
    """
    result = _as_result(obj, costs, comm)
    schedule = result.schedule
    timed = [t for row in result.timeline for t in row]
    if slot is None:
        if all(float(t.start).is_integer() and float(t.end).is_integer() for t in timed):
            slot = 1.0
        else:
            slot = min((t.end - t.start for t in timed), default=1.0)
    if not slot > 0:
        raise ValueError(f"slot must be > 0, got {slot!r}")
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
    ActionKind.I: "#64B5CD",
    ActionKind.W: "#8C8C8C",
}


def render_image(
    obj: Schedule | SimulationResult,
    path: str | os.PathLike[str],
    *,
    costs: Costs | None = None,
    comm: float = 0.0,
    title: str | None = None,
) -> None:
    """Draw the simulated timeline as a Gantt chart and save it to ``path``.

    The format follows the file extension (``.png``, ``.svg``, ``.pdf``...).
    Needs matplotlib, which axondist does not depend on; raises ImportError
    saying how to install it when it is missing.  Uses matplotlib's object
    API only, so pyplot's global state and backend are left untouched.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "render_image needs matplotlib, which is not installed; install it with "
            "`pip install matplotlib` (or use render_text, which needs nothing)"
        ) from err
    result = _as_result(obj, costs, comm)
    schedule = result.schedule
    p = schedule.num_ranks
    fig = Figure(figsize=(max(6.0, min(40.0, result.makespan * 0.35)), 0.6 * p + 1.2))
    ax = fig.subplots()
    for r, row in enumerate(result.timeline):
        for t in row:
            shade = 1.0 - 0.45 * (t.action.chunk / max(1, schedule.chunks - 1))
            ax.barh(
                r, t.end - t.start, left=t.start, height=0.8,
                color=_COLORS[t.action.kind], alpha=shade, edgecolor="black", linewidth=0.5,
            )
            ax.text(
                (t.start + t.end) / 2, r, t.action.text(schedule.chunks),
                ha="center", va="center", fontsize=7, color="white",
            )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time")
    kinds = sorted({t.action.kind for row in result.timeline for t in row}, key=lambda k: k.value)
    ax.legend(
        handles=[Patch(color=_COLORS[k], label=k.value) for k in kinds],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
    )
    name = schedule.kind.name if schedule.kind is not None else "custom"
    ax.set_title(
        title or f"{name}: {p} ranks, {schedule.num_microbatches} microbatches, "
        f"{schedule.chunks} chunk(s), bubble {result.bubble_fraction:.1%}"
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path))
