"""Checking and splitting what a Pipeline is given: counts, stages, loss function, batches.

Pure helpers of :mod:`axondist.pipeline.runtime` (no communication): the
microbatch and chunk counts a schedule implies, the validated schedule, the
stage list, the loss function, the batch-size codes the ranks exchange before
a step and the verdict on them, the split into microbatches and the
forward-only schedule used for inference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from axondist import _array
from axondist.errors import ScheduleError
from axondist.pipeline.executor import LossFn
from axondist.pipeline.schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    Schedule,
    build_schedule,
    schedule_names,
)
from axondist.pipeline.stage import PipelineStage
from axondist.pipeline.validation import validate

__all__ = ["ABSENT", "NONE", "NO_LOSS_FN", "SCALAR", "check_batch_rows", "check_loss_fn",
           "forwards_only", "rows_code", "schedule_for", "shape_of", "split_rows",
           "stage_list"]

#: Codes the ranks exchange before a step in place of a row count: not held here, None, a
#: 0-d array, and (for the last stage's target) no loss function to apply to it.
ABSENT, NONE, SCALAR, NO_LOSS_FN = -3, -1, -2, -4


def shape_of(what: str, schedule: Any, num_microbatches: Any, chunks: Any) -> tuple[int, int]:
    """``(num_microbatches, chunks)``: the arguments, checked, or those of a Schedule value."""
    if isinstance(schedule, Schedule):
        for name, value, own in (("num_microbatches", num_microbatches,
                                  schedule.num_microbatches), ("chunks", chunks, schedule.chunks)):
            if value is not None and value != own:
                raise ScheduleError(f"{what}: {name}={value!r} but the schedule has {name}="
                                    f"{own}; leave {name} out to use the schedule's")
        return schedule.num_microbatches, schedule.chunks
    if not isinstance(schedule, (PipelineSchedule, str)):
        raise TypeError(f"{what}: schedule must be a PipelineSchedule, one of "
                        f"{list(schedule_names())} or a Schedule, got "
                        f"{type(schedule).__name__} {schedule!r}")
    if num_microbatches is None:
        raise ValueError(f"{what}: num_microbatches is required with a schedule kind "
                         f"({schedule!r}); pass num_microbatches=m (m >= 1)")
    chunks = 1 if chunks is None else chunks
    for name, value in (("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: {name} must be an int >= 1, got {value!r}")
    return num_microbatches, chunks


def schedule_for(what: str, schedule: PipelineSchedule | str | Schedule, p: int, m: int,
                 v: int) -> Schedule:
    """The validated schedule a pipeline of ``p`` ranks, ``m`` microbatches and ``v`` chunks
    runs: ``schedule`` itself when it is a :class:`Schedule` (for ``p`` ranks), else the one
    its kind or name builds."""
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != p:
            raise ScheduleError(
                f"{what}: the schedule is for {schedule.num_ranks} rank(s) but the pipeline "
                f"has {p} (the group's size, or len(stages) // chunks); build it for {p}")
        built = schedule
    else:
        kind = PipelineSchedule.parse(schedule, f"{what}: schedule")
        built = build_schedule(kind, p, m, v)
    validate(built)
    return built


def check_loss_fn(loss_fn: Any, where: str) -> LossFn | None:
    """``loss_fn`` when it is None or callable, else a TypeError naming ``where``."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be a callable loss_fn(y, target) -> "
                        f"(loss, grad_y), got {type(loss_fn).__name__} {loss_fn!r}")
    return loss_fn


def stage_list(stages: Any, what: str) -> list[PipelineStage]:
    if isinstance(stages, PipelineStage):
        return [stages]
    if stages is None or isinstance(stages, (str, bytes)) or not isinstance(stages, Iterable):
        raise TypeError(f"{what}: stages must be a PipelineStage or a list of them, got "
                        f"{type(stages).__name__} {stages!r}; wrap forward/backward callables "
                        "with PipelineStage(...)")
    items = list(stages)
    if not items:
        raise ValueError(f"{what}: needs at least one PipelineStage, got none")
    for i, st in enumerate(items):
        if not isinstance(st, PipelineStage):
            raise TypeError(f"{what}: stage {i} is a {type(st).__name__}, not a PipelineStage; "
                            "wrap forward/backward callables with PipelineStage(...)")
    return items


def rows_code(x: Any) -> int:
    if x is None:
        return NONE
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = _array.as_array(x).shape
    return SCALAR if len(shape) == 0 else int(shape[0])


def check_batch_rows(what: str, x_rows: int, t_rows: int, m: int, last: int) -> None:
    """Refuse a batch from the row codes of ``x`` and ``target`` every rank agreed on (so
    every rank raises alike): no loss function on the last stage's rank ``last``, no ``x``,
    a 0-d one or fewer rows than the ``m`` microbatches, a 0-d target or one whose rows
    differ from ``x``'s."""
    if t_rows == NO_LOSS_FN:
        raise TypeError(f"{what}: no loss_fn where the last stage lives (rank {last}); "
                        "pass loss_fn=... to the Pipeline (or to this call): "
                        "loss_fn(y, target) -> (loss, grad_y) for one microbatch")
    if x_rows == NONE:
        raise ValueError(f"{what}: the rank holding stage 0 (rank 0) passed x=None; it "
                         "must pass the input batch")
    if x_rows == SCALAR:
        raise ValueError(f"{what}: x must have a leading batch axis, got a 0-d array")
    if x_rows < m:
        raise ValueError(
            f"{what}: x has {x_rows} rows, fewer than num_microbatches={m}; every "
            f"microbatch needs at least one row (numpy.array_split would make empty "
            f"ones): pass at least {m} rows or build the Pipeline with "
            f"num_microbatches <= {x_rows}")
    if t_rows == SCALAR:
        raise ValueError(f"{what}: target (on rank {last}) must have a leading batch axis "
                         "to split into microbatches, got a 0-d array")
    if t_rows >= 0 and t_rows != x_rows:
        raise ValueError(f"{what}: target has {t_rows} rows but x has {x_rows}; they are "
                         "split into microbatches together and must match")


def split_rows(x: Any, m: int) -> list[Any]:
    x = _array.as_array(x)
    return list(_array.namespace(x).array_split(x, m, axis=0))


def forwards_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in the same per-rank order (for inference)."""
    rows = []
    for r, row in enumerate(schedule.actions):
        fs = [a for a in row if a.kind is ActionKind.F]
        rows.append(tuple(Action(r, k, ActionKind.F, a.microbatch, a.chunk)
                          for k, a in enumerate(fs)))
    return Schedule(kind=schedule.kind, num_ranks=schedule.num_ranks,
                    num_microbatches=schedule.num_microbatches, chunks=schedule.chunks,
                    actions=tuple(rows))
