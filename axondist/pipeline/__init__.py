"""Pipeline parallelism: schedules as data, and the runtime that executes them.

The schedule layer (``schedules``, ``communication``, ``simulate``,
``validation``, ``render``) is pure: it builds, validates, dry-runs and draws
the per-rank action lists
(:class:`Schedule`) and their send/recv order (:class:`CommunicationPlan`).
The runtime (``stage``, ``runtime``, ``executor``, ``transport``) runs those
lists with the user's :class:`PipelineStage` callables, in one process or one
stage (chunk) per rank over send/recv.
"""

from axondist.errors import ScheduleError
from axondist.pipeline.communication import (
    CommKind,
    CommOp,
    CommunicationPlan,
    Payload,
    check_channels,
    communication_plan,
)
from axondist.pipeline.memory import PipelineRunStats
from axondist.pipeline.render import render_image, render_text
from axondist.pipeline.runtime import LossFn, Pipeline
from axondist.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    PipelineMemoryStats,
    PipelineSchedule,
    Schedule,
    ScheduleSpec,
    build_schedule,
    interleaved_rounds,
    parse_schedule,
    schedule_names,
)
from axondist.pipeline.simulate import DEFAULT_COSTS, SimulationResult, TimedAction, simulate
from axondist.pipeline.stage import PipelineStage
from axondist.pipeline.validation import validate

__all__ = [
    "DEFAULT_COSTS",
    "Action",
    "ActionKind",
    "CommKind",
    "CommOp",
    "CommunicationPlan",
    "Payload",
    "PipelineMemoryStats",
    "PipelineSchedule",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimulationResult",
    "TimedAction",
    "build_schedule",
    "check_channels",
    "communication_plan",
    "interleaved_rounds",
    "parse_schedule",
    "render_image",
    "render_text",
    "schedule_names",
    "simulate",
    "validate",
    # runtime
    "LossFn",
    "Pipeline",
    "PipelineRunStats",
    "PipelineStage",
]
