"""Pipeline-parallel schedules: which forward/backward step each rank runs, in what order.

This module is pure bookkeeping: it never communicates.  A :class:`Schedule`
holds, for every pipeline rank, the ordered list of compute :class:`Action` s
that rank performs.  Communication is implicit in the stage numbering:

* there are ``num_stages = num_ranks * chunks`` *virtual* stages; virtual stage
  ``s`` lives on rank ``s % num_ranks`` as its chunk ``s // num_ranks`` (the
  Megatron interleaved layout; with ``chunks == 1`` stage ``s`` is rank ``s``);
* the forward ``F`` of stage ``s`` consumes the activation produced by the
  forward of stage ``s - 1`` and produces the one stage ``s + 1`` consumes;
* the backward (``B``, or its input-gradient half ``I``) of stage ``s``
  consumes the gradient produced by the backward of stage ``s + 1`` and
  produces the gradient stage ``s - 1`` consumes.  The last stage's backward
  starts from the loss, so it needs only its own forward.
* ``W`` (weight gradient, zero-bubble schedules only) needs only the ``I`` of
  the same microbatch and stage, so it can be deferred to fill idle time.

:func:`communication_plan` (in :mod:`axondist.pipeline.communication`) turns
a schedule into the per-rank send/recv sequence; :func:`validate` checks a
schedule statically and by a dry run (:func:`~axondist.pipeline.simulate.simulate`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from axondist.errors import ScheduleError

__all__ = [
    "Action",
    "ActionKind",
    "PipelineMemoryStats",
    "PipelineSchedule",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "parse_schedule",
    "validate",
]


class PipelineSchedule(enum.Enum):
    """The schedules :func:`build_schedule` can generate."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_ONE_F_ONE_B = "interleaved_1f1b"
    ZERO_BUBBLE_H1 = "zb_h1"


class ActionKind(enum.Enum):
    """What one action computes.

    ``B`` is a full backward (input and weight gradient together).  ``I`` and
    ``W`` are its two halves, used by zero-bubble schedules: ``I`` computes the
    gradient w.r.t. the stage input (needed by the previous stage, so it is on
    the critical path) and ``W`` the gradient w.r.t. the stage's parameters.
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the letter is the established name in the literature
    W = "W"

    @property
    def is_backward(self) -> bool:
        """True for the kinds that send a gradient to the previous stage (B, I)."""
        return self in (ActionKind.B, ActionKind.I)


@dataclass(frozen=True)
class Action:
    """One compute step of one rank.

    ``rank`` is the pipeline rank that runs it, ``step`` its index in that
    rank's ordered action list, ``chunk`` the virtual-stage chunk on that rank
    (0 without interleaving).  The stage it computes is
    ``chunk * num_ranks + rank`` (:meth:`Schedule.stage_of`).
    """

    rank: int
    step: int
    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def text(self, chunks: int = 1) -> str:
        """Short form: ``"F3"``; ``"1F3"`` (chunk first) when chunk > 0 or ``chunks`` > 1."""
        prefix = str(self.chunk) if (self.chunk > 0 or chunks > 1) else ""
        return f"{prefix}{self.kind.value}{self.microbatch}"

    def __str__(self) -> str:
        return self.text()


_ACTION_RE = re.compile(r"^(?:(\d+))?([FBIW])(\d+)$")


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the shape they were built for.

    ``actions[rank]`` is the tuple of that rank's actions in execution order;
    ``actions[rank][k].step == k``.  ``kind`` is ``None`` for hand-made
    schedules (:func:`parse_schedule`).  Construction does not check
    consistency; call :func:`validate` for that.
    """

    kind: PipelineSchedule | None
    num_ranks: int
    num_microbatches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    def __post_init__(self) -> None:
        # Accept lists for convenience but store immutable tuples.
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        if self.num_ranks < 1 or self.num_microbatches < 1 or self.chunks < 1:
            raise ValueError(
                "num_ranks, num_microbatches and chunks must all be >= 1, got "
                f"{self.num_ranks}, {self.num_microbatches}, {self.chunks}"
            )

    # -- stage geometry ---------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Number of virtual stages, ``num_ranks * chunks``."""
        return self.num_ranks * self.chunks

    def stage_of(self, action: Action) -> int:
        """Virtual stage index the action computes: ``chunk * num_ranks + rank``."""
        return action.chunk * self.num_ranks + action.rank

    def rank_of_stage(self, stage: int) -> int:
        """Rank holding virtual stage ``stage``."""
        return stage % self.num_ranks

    def chunk_of_stage(self, stage: int) -> int:
        """Chunk index of virtual stage ``stage`` on its rank."""
        return stage // self.num_ranks

    # -- lookup -----------------------------------------------------------
    def __iter__(self) -> Iterator[Action]:
        """All actions, rank by rank, each rank in execution order."""
        for row in self.actions:
            yield from row

    @property
    def uses_split_backward(self) -> bool:
        """True when any action is an ``I`` or ``W`` (zero-bubble style backward)."""
        return any(a.kind in (ActionKind.I, ActionKind.W) for a in self)

    @cached_property
    def _index(self) -> dict[tuple[ActionKind, int, int], Action]:
        index: dict[tuple[ActionKind, int, int], Action] = {}
        for a in self:
            index.setdefault((a.kind, a.microbatch, self.stage_of(a)), a)
        return index

    def find(self, kind: ActionKind, microbatch: int, stage: int) -> Action | None:
        """The (first) action of ``kind`` for ``microbatch`` at virtual ``stage``, if any."""
        return self._index.get((kind, microbatch, stage))

    def input_gradient_producer(self, microbatch: int, stage: int) -> Action | None:
        """The action that computes ``stage``'s input gradient: its ``I`` if split, else ``B``."""
        return self.find(ActionKind.I, microbatch, stage) or self.find(
            ActionKind.B, microbatch, stage
        )

    def dependencies(self, action: Action) -> list[tuple[str, Action | None]]:
        """What ``action`` must wait for, as ``(description, producer)`` pairs.

        The producer is ``None`` when the schedule lacks it (a malformed
        schedule); the description then says what was expected.  Remote
        producers (another rank) correspond to a received message.
        """
        s = self.stage_of(action)
        mb = action.microbatch
        deps: list[tuple[str, Action | None]] = []
        if action.kind is ActionKind.F:
            if s > 0:
                deps.append((f"F{mb} of stage {s - 1}", self.find(ActionKind.F, mb, s - 1)))
        elif action.kind.is_backward:
            deps.append((f"F{mb} of stage {s}", self.find(ActionKind.F, mb, s)))
            if s < self.num_stages - 1:
                deps.append(
                    (f"backward of microbatch {mb} at stage {s + 1}",
                     self.input_gradient_producer(mb, s + 1))
                )
        else:  # W
            deps.append((f"I{mb} of stage {s}", self.find(ActionKind.I, mb, s)))
        return deps

    def text(self) -> str:
        """One line per rank with the short forms of its actions, e.g. ``"0: F0 F1 B0 B1"``."""
        return "\n".join(
            f"{r}: " + " ".join(a.text(self.chunks) for a in row)
            for r, row in enumerate(self.actions)
        )


# ---------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------


def parse_schedule(
    rows: Sequence[str | Sequence[str]],
    *,
    num_microbatches: int | None = None,
    chunks: int | None = None,
    kind: PipelineSchedule | None = None,
) -> Schedule:
    """Build a (possibly invalid) schedule from short forms, one entry per rank.

    Each row is a whitespace-separated string or a list of tokens like
    ``"F0"``, ``"B3"``, ``"1F2"`` (chunk 1), ``"I0"``, ``"W0"``.  Missing
    ``num_microbatches``/``chunks`` are inferred from the largest indices seen.
    Handy for tests and for trying out a custom order; run :func:`validate`
    on the result before executing it.
    """
    parsed: list[list[Action]] = []
    max_mb, max_chunk = 0, 0
    for r, row in enumerate(rows):
        tokens = row.split() if isinstance(row, str) else list(row)
        out: list[Action] = []
        for k, tok in enumerate(tokens):
            m = _ACTION_RE.match(tok.strip())
            if m is None:
                raise ValueError(
                    f"rank {r} token {k}: expected an action like 'F3', 'B0' or '1F2', got {tok!r}"
                )
            chunk = int(m.group(1)) if m.group(1) else 0
            mb = int(m.group(3))
            max_mb, max_chunk = max(max_mb, mb), max(max_chunk, chunk)
            out.append(Action(r, k, ActionKind(m.group(2)), mb, chunk))
        parsed.append(out)
    return Schedule(
        kind=kind,
        num_ranks=len(parsed),
        num_microbatches=num_microbatches if num_microbatches is not None else max_mb + 1,
        chunks=chunks if chunks is not None else max_chunk + 1,
        actions=tuple(tuple(row) for row in parsed),
    )


def _numbered(rank: int, items: Sequence[tuple[ActionKind, int, int]]) -> tuple[Action, ...]:
    return tuple(Action(rank, k, kind, mb, chunk) for k, (kind, mb, chunk) in enumerate(items))


def _gpipe(p: int, m: int, v: int, rank: int) -> list[tuple[ActionKind, int, int]]:
    # All forwards (chunk by chunk, microbatches ascending), then all backwards
    # (last chunk first, microbatches ascending, as torch.distributed.pipelining's
    # ScheduleGPipe does).  With chunks > 1 this is the "looped breadth-first" order.
    order = [(ActionKind.F, mb, c) for c in range(v) for mb in range(m)]
    order += [(ActionKind.B, mb, c) for c in reversed(range(v)) for mb in range(m)]
    return order


def _one_f_one_b(p: int, m: int, rank: int) -> list[tuple[ActionKind, int, int]]:
    # PipeDream-flush: min(p - rank - 1, m) warm-up forwards, then alternate
    # F(i + warmup), B(i), then the remaining backwards.
    warmup = min(p - rank - 1, m)
    order = [(ActionKind.F, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order.append((ActionKind.F, warmup + i, 0))
        order.append((ActionKind.B, i, 0))
    order += [(ActionKind.B, mb, 0) for mb in range(m - warmup, m)]
    return order


def _interleaved(p: int, m: int, v: int, rank: int) -> list[tuple[ActionKind, int, int]]:
    """Megatron's interleaved 1F1B order for any ``m``.

    Megatron's construction (Narayanan et al. 2021) needs ``m % p == 0``: the
    forward order is a table of (microbatch, chunk) pairs taken in groups of
    ``p`` microbatches -- chunk 0 of the group, then chunk 1, ... -- and the
    backward order is the same table with the chunk order mirrored; rank ``r``
    runs ``2 * (p - r - 1) + (v - 1) * p`` warm-up forwards, then alternates
    one forward and one backward, then drains the backwards.

    For other ``m`` we build that order for ``m`` rounded up to a multiple of
    ``p`` and delete the actions of the padding microbatches.  Deleting
    actions keeps the schedule deadlock-free (every remaining wait was
    already implied, transitively, by the padded schedule) and keeps the
    send/recv sequences of every rank pair equal (a padding microbatch's
    messages disappear at both ends).  The padding slots turn into idle time,
    so such ``m`` get a somewhat larger bubble than a multiple of ``p`` would.
    """
    if v == 1:
        return _one_f_one_b(p, m, rank)
    padded = -(-m // p) * p
    table = [
        (mb, c)
        for start in range(0, padded, p)
        for c in range(v)
        for mb in range(start, start + p)
    ]
    total = len(table)
    forwards = [(ActionKind.F, mb, c) for mb, c in table]
    backwards = [(ActionKind.B, mb, v - 1 - c) for mb, c in table]
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order.append(forwards[warmup + i])
        order.append(backwards[i])
    order += backwards[total - warmup:]
    return [item for item in order if item[1] < m]


def _zero_bubble_h1(p: int, m: int, rank: int) -> list[tuple[ActionKind, int, int]]:
    # The 1F1B skeleton with every B replaced by its I, and W(j) issued after
    # I(j + rank): rank r keeps up to r input-gradients whose W is pending, so
    # every rank holds at most min(p, m) activations -- the first rank's 1F1B
    # peak (Qi et al. 2023, ZB-H1).  Deferred Ws then fill the tail that 1F1B
    # leaves idle on the later ranks, and since I does not wait for W the
    # gradient wave travels back faster.
    warmup = min(p - rank - 1, m)
    order = [(ActionKind.F, mb, 0) for mb in range(warmup)]
    next_f, next_w = warmup, 0
    for i in range(m):
        if next_f < m:
            order.append((ActionKind.F, next_f, 0))
            next_f += 1
        order.append((ActionKind.I, i, 0))
        if (i + 1) - next_w > rank:
            order.append((ActionKind.W, next_w, 0))
            next_w += 1
    order += [(ActionKind.W, mb, 0) for mb in range(next_w, m)]
    return order


def build_schedule(
    schedule: PipelineSchedule | str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int = 1,
) -> Schedule:
    """Generate the per-rank action lists of ``schedule``.

    Works for every ``num_microbatches >= 1``, including fewer microbatches
    than stages and counts not divisible by ``num_ranks``:

    * ``GPIPE``: all forwards, then all backwards in the same microbatch order
      (chunk by chunk, last chunk's backwards first, when ``chunks > 1``).
    * ``ONE_F_ONE_B``: PipeDream-flush; needs ``chunks == 1``.
    * ``INTERLEAVED_ONE_F_ONE_B``: Megatron's interleaved order (microbatch
      groups of ``num_ranks``, warm-up ``2 * (p - rank - 1) + (chunks - 1) * p``
      forwards); when ``num_microbatches`` is not a multiple of ``num_ranks``
      it is built for the next multiple and the padding microbatches are
      deleted (see ``_interleaved``).  With ``chunks == 1`` it is exactly
      ``ONE_F_ONE_B``.
    * ``ZERO_BUBBLE_H1``: 1F1B with B split into I and W, W deferred by
      ``rank`` microbatches; needs ``chunks == 1``.

    Every generated schedule passes :func:`validate` (no deadlock, matching
    send/recv order on every rank pair); the unit tests check this over a
    grid of shapes.
    """
    kind = PipelineSchedule(schedule) if isinstance(schedule, str) else schedule
    p, m, v = num_ranks, num_microbatches, chunks
    for name, value in (("num_ranks", p), ("num_microbatches", m), ("chunks", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if v != 1 and kind in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.ZERO_BUBBLE_H1):
        raise ValueError(
            f"{kind.name} runs one chunk per rank, got chunks={v}; use "
            "INTERLEAVED_ONE_F_ONE_B (or GPIPE) for several chunks per rank"
        )
    rows = []
    for r in range(p):
        if kind is PipelineSchedule.GPIPE:
            items = _gpipe(p, m, v, r)
        elif kind is PipelineSchedule.ONE_F_ONE_B:
            items = _one_f_one_b(p, m, r)
        elif kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
            items = _interleaved(p, m, v, r)
        else:
            items = _zero_bubble_h1(p, m, r)
        rows.append(_numbered(r, items))
    return Schedule(kind=kind, num_ranks=p, num_microbatches=m, chunks=v, actions=tuple(rows))


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _check_structure(schedule: Schedule) -> None:
    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.chunks
    if len(schedule.actions) != p:
        raise ScheduleError(f"expected action lists for {p} ranks, got {len(schedule.actions)}")
    for r, row in enumerate(schedule.actions):
        for k, a in enumerate(row):
            if not isinstance(a, Action) or not isinstance(a.kind, ActionKind):
                raise ScheduleError(f"expected an Action, got {a!r}", rank=r, step=k)
            reason = None
            if a.rank != r:
                reason = f"is listed for rank {r} but says rank {a.rank}"
            elif a.step != k:
                reason = f"is at index {k} but says step {a.step}"
            elif not 0 <= a.microbatch < m:
                reason = f"microbatch must be in [0, {m}), got {a.microbatch}"
            elif not 0 <= a.chunk < v:
                reason = f"chunk must be in [0, {v}), got {a.chunk}"
            if reason is not None:
                raise ScheduleError(reason, rank=r, step=k, action=a)


def _check_completeness(schedule: Schedule) -> None:
    seen: dict[tuple[ActionKind, int, int], Action] = {}
    for a in schedule:
        key = (a.kind, a.microbatch, schedule.stage_of(a))
        if key in seen:
            first = seen[key]
            raise ScheduleError(
                f"duplicate: {a.kind.value}{a.microbatch} of stage {key[2]} already runs at "
                f"rank {first.rank} step {first.step}",
                rank=a.rank, step=a.step, action=a,
            )
        seen[key] = a
    for s in range(schedule.num_stages):
        r, c = schedule.rank_of_stage(s), schedule.chunk_of_stage(s)
        for mb in range(schedule.num_microbatches):
            has = {k: (k, mb, s) in seen for k in ActionKind}
            label = f"microbatch {mb} of stage {s} (chunk {c})"
            if not has[ActionKind.F]:
                raise ScheduleError(f"missing the forward F of {label}", rank=r)
            if has[ActionKind.B] and (has[ActionKind.I] or has[ActionKind.W]):
                a = seen[(ActionKind.B, mb, s)]
                raise ScheduleError(
                    f"{label} has both a full backward B and a split I/W backward; "
                    "expected exactly one of the two forms",
                    rank=a.rank, step=a.step, action=a,
                )
            if not (has[ActionKind.B] or has[ActionKind.I] or has[ActionKind.W]):
                raise ScheduleError(f"missing the backward (B, or I and W) of {label}", rank=r)
            if has[ActionKind.I] != has[ActionKind.W]:
                missing = "W" if has[ActionKind.I] else "I"
                raise ScheduleError(
                    f"{label} has a split backward but no {missing}; expected both I and W",
                    rank=r,
                )


def _check_local_order(schedule: Schedule) -> None:
    # Dependencies between actions of the same rank must respect program order;
    # otherwise that rank waits for itself.  (Cross-rank cycles are found by
    # the dry run.)
    for a in schedule:
        for what, dep in schedule.dependencies(a):
            if dep is not None and dep.rank == a.rank and dep.step > a.step:
                raise ScheduleError(
                    f"{a.kind.value}{a.microbatch} of stage {schedule.stage_of(a)} comes before "
                    f"{what} (step {dep.step}) which it needs; expected {what} first",
                    rank=a.rank, step=a.step, action=a,
                )


def validate(schedule: Schedule, *, check_deadlock: bool = True) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is executable.

    Checks, in order: well-formed actions (rank/step/microbatch/chunk in
    range); exactly one F and exactly one B (or one I and one W) per
    (microbatch, stage); per-rank order of local dependencies (F before its
    B/I, I before its W, neighbouring stages on the same rank); that every
    rank pair's send sequence equals the receiver's recv sequence (see
    :func:`~axondist.pipeline.communication.communication_plan`); and, with
    ``check_deadlock``, a dry run that finds cross-rank wait cycles.  The
    error names the first offending rank, step and action and says why.
    """
    from axondist.pipeline.communication import check_channels, communication_plan
    from axondist.pipeline.simulate import simulate

    _check_structure(schedule)
    _check_completeness(schedule)
    _check_local_order(schedule)
    check_channels(communication_plan(schedule))
    if check_deadlock:
        simulate(schedule)


# ---------------------------------------------------------------------------
# closed-form reference numbers
# ---------------------------------------------------------------------------


class PipelineMemoryStats:
    """Textbook activation-memory and bubble numbers, for sizing before running.

    "Activations" count microbatches whose forward ran on a stage but whose
    backward (or W) has not released them yet, per stage/rank.
    """

    @staticmethod
    def gpipe_peak_activations(stages: int, microbatches: int) -> int:
        """GPipe stores every microbatch before the first backward: ``microbatches``."""
        return microbatches

    @staticmethod
    def one_f_one_b_peak_activations(stages: int, microbatches: int) -> int:
        """1F1B's peak, reached on the first stage: ``min(stages, microbatches)``."""
        return min(stages, microbatches)

    @staticmethod
    def one_f_one_b_peak_activations_per_stage(stages: int, microbatches: int) -> list[int]:
        """1F1B's peak on each stage ``s``: ``min(stages - s, microbatches)``."""
        return [min(stages - s, microbatches) for s in range(stages)]

    @staticmethod
    def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
        """Standard bubble estimate ``(p - 1) / (v * m + p - 1)``.

        ``p = stages`` (ranks), ``m = microbatches``, ``v = chunks``.  For
        ``v == 1`` this is ``(p - 1) / (m + p - 1)``, exact for GPipe and 1F1B
        when every stage takes the same forward and backward time and
        communication is free; for interleaved schedules it is Narayanan et
        al.'s approximation (bubble time divided by ``v``).
        """
        p, m, v = stages, microbatches, chunks
        return (p - 1) / (v * m + p - 1)
