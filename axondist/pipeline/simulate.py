"""Discrete-event dry run of a pipeline schedule: timing, bubble, activation memory, deadlock.

Each rank runs its actions strictly in list order.  An action starts when the
rank's previous action has finished and every action it depends on has
finished -- plus ``comm`` time units when the producer is on another rank (the
message latency).  Sends never block (they are buffered), so this is exactly
the timing of a runtime executing :func:`~axondist.pipeline.communication.communication_plan`
on an in-order transport, once the plan's channels check out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from axondist.pipeline.schedules import Action, ActionKind, Schedule, ScheduleError

__all__ = ["DEFAULT_COSTS", "SimulationResult", "TimedAction", "log_dry_run", "simulate"]

logger = logging.getLogger("axondist.pipeline")

#: Default duration of each action kind, in arbitrary time units.  B = I + W.
DEFAULT_COSTS: Mapping[ActionKind, float] = {
    ActionKind.F: 1.0,
    ActionKind.B: 2.0,
    ActionKind.I: 1.0,
    ActionKind.W: 1.0,
}

Costs = Mapping[ActionKind | str, float] | Callable[[Action], float]


@dataclass(frozen=True)
class TimedAction:
    """An action with the simulated interval ``[start, end)`` it occupies its rank."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

    ``timeline[rank]`` lists that rank's actions in execution order with their
    start and end times; ``busy[rank]`` is the rank's total compute time;
    ``peak_activations[rank]`` is the largest number of microbatch
    activations the rank holds at once, over all its chunks (+1 at each F,
    -1 at each B, or at each W when the backward is split into I and W).
    """

    schedule: Schedule = field(repr=False)
    comm: float
    timeline: tuple[tuple[TimedAction, ...], ...] = field(repr=False)
    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle time of each rank within ``[0, makespan)``."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Total idle time over total rank time: ``sum(idle) / (num_ranks * makespan)``."""
        if self.makespan == 0:
            return 0.0
        return sum(self.idle) / (self.schedule.num_ranks * self.makespan)

    @cached_property
    def _by_action(self) -> dict[Action, TimedAction]:
        return {t.action: t for row in self.timeline for t in row}

    def start(self, action: Action) -> float:
        """Simulated start time of ``action``."""
        return self._by_action[action].start

    def end(self, action: Action) -> float:
        """Simulated end time of ``action``."""
        return self._by_action[action].end


def _cost_function(costs: Costs | None) -> Callable[[Action], float]:
    if callable(costs):
        fn = costs
    else:
        table = dict(DEFAULT_COSTS)
        for key, value in (costs or {}).items():
            kind = key if isinstance(key, ActionKind) else ActionKind(str(key).upper())
            table[kind] = float(value)
        for kind, value in table.items():
            if not value > 0:
                raise ValueError(f"cost of {kind.value} must be > 0, got {value!r}")

        def fn(a: Action) -> float:
            return table[a.kind]

    return fn


def _peak_activations(row: tuple[Action, ...]) -> int:
    live = peak = 0
    for a in row:
        if a.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in (ActionKind.B, ActionKind.W):
            live -= 1
    return peak


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, comm: float = 0.0
) -> SimulationResult:
    """Dry-run ``schedule`` and time every action.

    ``costs`` maps action kinds (``ActionKind`` or ``"F"``/``"B"``/``"I"``/``"W"``)
    to durations, overriding :data:`DEFAULT_COSTS` (F=1, B=2, I=1, W=1); or it
    is a function ``action -> duration`` (e.g. per-stage costs).  ``comm`` is
    added between an action and a dependent action on another rank.

    Raises :class:`ScheduleError` on deadlock -- no rank can start its next
    action -- listing, for every stuck rank, the action it is stuck at and
    what that action waits for.  It does not check anything else; see
    :func:`~axondist.pipeline.validation.validate`.
    """
    if comm < 0:
        raise ValueError(f"comm latency must be >= 0, got {comm!r}")
    cost = _cost_function(costs)
    rows = schedule.actions
    deps = [[schedule.dependencies(a) for a in row] for row in rows]
    end: dict[Action, float] = {}
    ptr = [0] * len(rows)
    free = [0.0] * len(rows)
    timeline: list[list[TimedAction]] = [[] for _ in rows]

    progressed = True
    while progressed:
        progressed = False
        for r, row in enumerate(rows):
            while ptr[r] < len(row):
                a = row[ptr[r]]
                t = free[r]
                for _what, dep in deps[r][ptr[r]]:
                    if dep is None or dep not in end:
                        break
                    t = max(t, end[dep] + (comm if dep.rank != r else 0.0))
                else:
                    d = cost(a)
                    if not d > 0:
                        raise ValueError(f"cost of {a} must be > 0, got {d!r}")
                    end[a] = free[r] = t + d
                    timeline[r].append(TimedAction(a, t, t + d))
                    ptr[r] += 1
                    progressed = True
                    continue
                break

    stuck = {r: row[ptr[r]] for r, row in enumerate(rows) if ptr[r] < len(row)}
    if stuck:
        lines = []
        for r, a in stuck.items():
            for what, dep in deps[r][ptr[r]]:
                if dep is None:
                    lines.append(f"rank {r} step {ptr[r]} ({a}) waits for {what}, "
                                 "which is not in the schedule")
                    break
                if dep not in end:
                    holder = stuck.get(dep.rank)
                    behind = (f", itself stuck behind rank {dep.rank} step {holder.step} ({holder})"
                              if holder is not None and holder != dep else "")
                    lines.append(f"rank {r} step {ptr[r]} ({a}) waits for {what} "
                                 f"at rank {dep.rank} step {dep.step}{behind}")
                    break
        first_rank, first = next(iter(stuck.items()))
        raise ScheduleError(
            "deadlock, no rank can start its next action: " + "; ".join(lines),
            rank=first_rank, step=ptr[first_rank], action=first, stuck=stuck,
        )

    makespan = max((row[-1].end for row in timeline if row), default=0.0)
    busy = tuple(sum(t.end - t.start for t in row) for row in timeline)
    return SimulationResult(
        schedule=schedule,
        comm=comm,
        timeline=tuple(tuple(row) for row in timeline),
        makespan=makespan,
        busy=busy,
        peak_activations=tuple(_peak_activations(row) for row in rows),
    )


def log_dry_run(dry_run: SimulationResult) -> None:
    """The schedule at INFO on ``axondist.pipeline``: its shape, dry-run numbers and actions."""
    if not logger.isEnabledFor(logging.INFO):
        return
    s = dry_run.schedule
    logger.info(
        "pipeline schedule %s: %d rank(s) x %d chunk(s), %d microbatch(es); dry run (F=1, "
        "B=2): bubble %.3f, peak activations per rank %s\n%s",
        s.kind.value if s.kind is not None else "custom", s.num_ranks, s.chunks,
        s.num_microbatches, dry_run.bubble_fraction, list(dry_run.peak_activations), s.text())
