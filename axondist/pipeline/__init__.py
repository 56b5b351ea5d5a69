"""Pipeline parallelism: schedule generation, validation, dry-run simulation and rendering.

Everything here is pure (no communication); an executor consumes
:class:`Schedule` (per-rank action order) and :class:`CommunicationPlan`
(per-rank send/recv order).
"""

from axondist.pipeline.communication import (
    CommKind,
    CommOp,
    CommunicationPlan,
    Payload,
    check_channels,
    communication_plan,
)
from axondist.pipeline.render import render_image, render_text
from axondist.pipeline.schedules import (
    Action,
    ActionKind,
    PipelineMemoryStats,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    build_schedule,
    parse_schedule,
    validate,
)
from axondist.pipeline.simulate import DEFAULT_COSTS, SimulationResult, TimedAction, simulate

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
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "TimedAction",
    "build_schedule",
    "check_channels",
    "communication_plan",
    "parse_schedule",
    "render_image",
    "render_text",
    "simulate",
    "validate",
]
