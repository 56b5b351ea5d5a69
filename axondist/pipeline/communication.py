"""The point-to-point messages a schedule implies, in the order each rank issues them.

A forward of virtual stage ``s`` sends its activation to stage ``s + 1``, a
backward (``B`` or ``I``) its input gradient to stage ``s - 1`` (messages
between stages on one rank are no communication). :func:`communication_plan`
puts every recv right before the action that consumes it and every send right
after the one that produces it; a runtime with buffered sends and in-order
delivery per rank pair runs the plan as is when :func:`check_channels` passes
(``CommOp.tag`` is unique per message, for runtimes that match by tag).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from axondist.pipeline.schedules import Action, ActionKind, Schedule, ScheduleError

__all__ = [
    "CommKind",
    "CommOp",
    "CommunicationPlan",
    "Payload",
    "check_channels",
    "communication_plan",
]


class CommKind(enum.Enum):
    """Direction of a point-to-point operation, seen from the rank performing it."""

    SEND = "send"
    RECV = "recv"


class Payload(enum.Enum):
    """What a message carries."""

    ACTIVATION = "activation"  # forward output of src_stage, input of dst_stage = src_stage + 1
    # input gradient of src_stage = output gradient of dst_stage = src_stage - 1
    GRADIENT = "gradient"


@dataclass(frozen=True)
class CommOp:
    """One send or recv performed by ``rank`` with ``peer``.

    ``step`` is the index (in ``rank``'s action list) of the action the
    operation belongs to: a recv runs right before that action, a send right
    after it.  ``src_stage``/``dst_stage`` are virtual stages; ``tag`` is
    unique per message within one schedule (both ends compute the same value).
    """

    op: CommKind
    rank: int
    peer: int
    payload: Payload
    microbatch: int
    src_stage: int
    dst_stage: int
    step: int
    tag: int

    @property
    def src_rank(self) -> int:
        """Rank that sends the message."""
        return self.rank if self.op is CommKind.SEND else self.peer

    @property
    def dst_rank(self) -> int:
        """Rank that receives the message."""
        return self.peer if self.op is CommKind.SEND else self.rank

    @property
    def message(self) -> tuple[Payload, int, int, int]:
        """Identity of the message, equal on both ends: (payload, microbatch, src, dst stage)."""
        return (self.payload, self.microbatch, self.src_stage, self.dst_stage)

    def describe_message(self) -> str:
        """Human-readable message identity, e.g. ``"activation of microbatch 3, stage 1->2"``."""
        return (
            f"{self.payload.value} of microbatch {self.microbatch}, "
            f"stage {self.src_stage}->{self.dst_stage}"
        )

    def __str__(self) -> str:
        way = f"to rank {self.peer}" if self.op is CommKind.SEND else f"from rank {self.peer}"
        return f"{self.op.value} {self.describe_message()} {way}"


@dataclass(frozen=True)
class CommunicationPlan:
    """Per-rank communication of a schedule.

    ``ops[rank]``: that rank's sends and recvs in the order it performs them.
    ``program[rank]``: the same interleaved with its actions -- for each action,
    its recvs, the action, then its sends.  An executor walks ``program[rank]``
    top to bottom.
    """

    schedule: Schedule = field(repr=False)
    ops: tuple[tuple[CommOp, ...], ...]
    program: tuple[tuple[Action | CommOp, ...], ...] = field(repr=False)

    def sends(self, src: int, dst: int) -> list[CommOp]:
        """Sends from ``src`` to ``dst``, in ``src``'s order."""
        return [o for o in self.ops[src] if o.op is CommKind.SEND and o.peer == dst]

    def recvs(self, dst: int, src: int) -> list[CommOp]:
        """Recvs at ``dst`` of messages from ``src``, in ``dst``'s order."""
        return [o for o in self.ops[dst] if o.op is CommKind.RECV and o.peer == src]

    def __iter__(self) -> Iterator[CommOp]:
        for row in self.ops:
            yield from row


def _tag(schedule: Schedule, payload: Payload, microbatch: int, dst_stage: int) -> int:
    return (microbatch * schedule.num_stages + dst_stage) * 2 + (payload is Payload.GRADIENT)


def _op(
    schedule: Schedule, kind: CommKind, rank: int, peer: int, a: Action,
    payload: Payload, src: int, dst: int,
) -> CommOp:
    return CommOp(
        kind, rank, peer, payload, a.microbatch, src, dst, a.step,
        _tag(schedule, payload, a.microbatch, dst),
    )


def communication_plan(schedule: Schedule) -> CommunicationPlan:
    """Derive every rank's send/recv sequence from its action order.

    Does not check that the schedule is consistent (a recv is planned even
    when its producer is missing); :func:`check_channels` and
    :func:`~axondist.pipeline.validation.validate` do that.
    """
    S = schedule.num_stages
    ops_rows: list[tuple[CommOp, ...]] = []
    prog_rows: list[tuple[Action | CommOp, ...]] = []
    for r, row in enumerate(schedule.actions):
        ops: list[CommOp] = []
        prog: list[Action | CommOp] = []
        for a in row:
            s = schedule.stage_of(a)
            recv = send = None
            if a.kind is ActionKind.F:
                if s > 0:
                    recv = (Payload.ACTIVATION, s - 1, s)
                if s < S - 1:
                    send = (Payload.ACTIVATION, s, s + 1)
            elif a.kind.is_backward:
                if s < S - 1:
                    recv = (Payload.GRADIENT, s + 1, s)
                if s > 0:
                    send = (Payload.GRADIENT, s, s - 1)
            if recv is not None and schedule.rank_of_stage(recv[1]) != r:
                o = _op(schedule, CommKind.RECV, r, schedule.rank_of_stage(recv[1]), a, *recv)
                ops.append(o)
                prog.append(o)
            prog.append(a)
            if send is not None and schedule.rank_of_stage(send[2]) != r:
                o = _op(schedule, CommKind.SEND, r, schedule.rank_of_stage(send[2]), a, *send)
                ops.append(o)
                prog.append(o)
        ops_rows.append(tuple(ops))
        prog_rows.append(tuple(prog))
    return CommunicationPlan(schedule=schedule, ops=tuple(ops_rows), program=tuple(prog_rows))


def check_channels(plan: CommunicationPlan) -> None:
    """Raise :class:`ScheduleError` unless sends and recvs pair up in order on every channel.

    For each ordered pair (a, b) the k-th send from a to b must carry the same
    message as the k-th recv at b from a; otherwise an in-order transport
    would hand the receiver the wrong tensor.  The error names the receiving
    rank, the step and action whose recv is wrong, and what arrives instead.
    """
    schedule = plan.schedule
    p = schedule.num_ranks
    problems: list[ScheduleError] = []  # the first mismatch of each channel
    for b in range(p):
        for a in range(p):
            if a != b:
                err = _channel_mismatch(schedule, a, b, plan.sends(a, b), plan.recvs(b, a))
                if err is not None:
                    problems.append(err)
    if problems:
        # Report the mismatch a rank would hit earliest in its own program.
        raise min(problems, key=lambda e: (e.step if e.step is not None else 0, e.rank or 0))


def _channel_mismatch(
    schedule: Schedule, a: int, b: int, sends: list[CommOp], recvs: list[CommOp]
) -> ScheduleError | None:
    for k in range(max(len(sends), len(recvs))):
        if k >= len(sends):
            rv = recvs[k]
            return ScheduleError(
                f"receives {rv.describe_message()} as message #{k} from rank {a}, but "
                f"rank {a} sends only {len(sends)} message(s) to rank {b}",
                rank=b, step=rv.step, action=schedule.actions[b][rv.step],
            )
        if k >= len(recvs):
            sd = sends[k]
            return ScheduleError(
                f"sends {sd.describe_message()} as message #{k} to rank {b}, but "
                f"rank {b} receives only {len(recvs)} message(s) from rank {a}",
                rank=a, step=sd.step, action=schedule.actions[a][sd.step],
            )
        sd, rv = sends[k], recvs[k]
        if sd.message != rv.message:
            src_act = schedule.actions[a][sd.step]
            return ScheduleError(
                f"expects {rv.describe_message()} as message #{k} from rank {a}, but "
                f"rank {a}'s message #{k} to rank {b} is {sd.describe_message()} "
                f"(sent after its step {sd.step}, {src_act.text(schedule.chunks)}); "
                "in-order point-to-point delivery would hand over the wrong tensor",
                rank=b, step=rv.step, action=schedule.actions[b][rv.step],
            )
    return None
