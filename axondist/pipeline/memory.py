"""What a pipeline run measured: live activations and time, per rank and stage.

The closed-form numbers (:class:`~axondist.pipeline.PipelineMemoryStats`) and
the dry run (:func:`~axondist.pipeline.simulate`) predict; this module holds
what :class:`~axondist.pipeline.Pipeline` observed while executing, so the two
can be compared (the tests check they are equal).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from axondist.pipeline.schedules import Schedule
from axondist.pipeline.simulate import SimulationResult, TimedAction

__all__ = ["ActivationMeter", "PipelineRunStats"]


class ActivationMeter:
    """Counts the microbatches whose saved forward state each stage holds, and the peaks.

    A microbatch is held by a stage from its forward ``F`` until the step that
    frees its saved state: the full backward ``B``, or the weight half ``W``
    of a split backward (the input half ``I`` still needs it).  This is the
    schedule's own accounting (:attr:`SimulationResult.peak_activations`).
    """

    def __init__(self, stages: Iterable[tuple[int, int]]) -> None:
        """``stages``: the ``(rank, virtual stage)`` pairs to count."""
        self._rank_of = dict((s, r) for r, s in stages)
        self._live_stage = {s: 0 for s in self._rank_of}
        self._live_rank = {r: 0 for r in self._rank_of.values()}
        self.peak_stage = dict(self._live_stage)
        self.peak_rank = dict(self._live_rank)

    def hold(self, stage: int) -> None:
        """A forward of ``stage`` stored its saved state."""
        r = self._rank_of[stage]
        self._live_stage[stage] += 1
        self._live_rank[r] += 1
        self.peak_stage[stage] = max(self.peak_stage[stage], self._live_stage[stage])
        self.peak_rank[r] = max(self.peak_rank[r], self._live_rank[r])

    def release(self, stage: int) -> None:
        """A backward (or W) of ``stage`` dropped one microbatch's saved state."""
        self._live_stage[stage] -= 1
        self._live_rank[self._rank_of[stage]] -= 1

    @property
    def live(self) -> int:
        """Microbatches held right now, over every counted stage."""
        return sum(self._live_stage.values())


@dataclass(frozen=True)
class PipelineRunStats:
    """Measurements of one :meth:`Pipeline.train_step` or :meth:`Pipeline.forward`.

    In single-process mode every rank of the pipeline ran in this process
    (one after another, so times show the order, not parallelism); in
    distributed mode only this process's rank is here.
    """

    schedule: Schedule = field(repr=False)
    """The schedule that ran (forward-only for :meth:`Pipeline.forward`)."""
    training: bool
    """True for train_step, False for forward."""
    ranks: tuple[int, ...]
    """The pipeline ranks measured here."""
    microbatch_rows: tuple[int, ...]
    """Rows of each microbatch (``numpy.array_split`` of the batch)."""
    peak_activations: Mapping[int, int]
    """Rank -> the most microbatches whose saved state it held at once, over all its chunks."""
    peak_activations_per_stage: Mapping[int, int]
    """Virtual stage -> the same, per stage."""
    expected_peak_activations: Mapping[int, int]
    """Rank -> the schedule's prediction (``simulate(schedule).peak_activations``; 0 for
    forward, which keeps nothing)."""
    step_time: float
    """Seconds from the start of the step to its end on this process (wall clock)."""
    busy: Mapping[int, float]
    """Rank -> seconds spent inside the stage callables and the loss function."""
    timeline: Mapping[int, tuple[TimedAction, ...]] = field(repr=False)
    """Rank -> its actions with start and end in seconds since the step started."""

    def idle_fraction(self, rank: int) -> float:
        """Share of the step ``rank`` spent outside stage callables: its measured bubble
        (meaningful in distributed mode, where ranks run in parallel)."""
        if self.step_time <= 0:
            return 0.0
        return max(0.0, 1.0 - self.busy[rank] / self.step_time)

    def as_simulation(self) -> SimulationResult:
        """The measured timeline as a :class:`SimulationResult` (times in seconds), for
        :func:`~axondist.pipeline.render_text`; ranks not measured here show empty rows."""
        p = self.schedule.num_ranks
        rows = tuple(self.timeline.get(r, ()) for r in range(p))
        return SimulationResult(
            schedule=self.schedule,
            comm=0.0,
            timeline=rows,
            makespan=max((row[-1].end for row in rows if row), default=0.0),
            busy=tuple(self.busy.get(r, 0.0) for r in range(p)),
            peak_activations=tuple(self.peak_activations.get(r, 0) for r in range(p)),
        )
