"""Pipeline schedules as values: per-rank ordered action lists, and the table that builds them.

A :class:`Schedule` holds, for every pipeline rank, the ordered :class:`Action` s
(``F``, ``B``, or the split backward ``I``/``W``) of one training step; the
messages between ranks follow from the stage numbering (virtual stage ``s`` lives
on rank ``s % num_ranks``), see ``docs/guide.md`` ("Pipeline schedules").
:data:`SCHEDULES` maps every :class:`PipelineSchedule` kind to its builder, and
:func:`build_schedule`, the demo CLI and the tests all read it. Nothing here
communicates; :func:`~axondist.pipeline.validate` checks a schedule.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from axondist._validate import parse_choice
from axondist.errors import ScheduleError

__all__ = [
    "Action",
    "ActionKind",
    "PipelineMemoryStats",
    "PipelineSchedule",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "build_schedule",
    "interleaved_rounds",
    "parse_schedule",
    "schedule_names",
]


class PipelineSchedule(enum.Enum):
    """The schedule kinds :func:`build_schedule` generates (:data:`SCHEDULES` says how)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_ONE_F_ONE_B = "interleaved_1f1b"
    INTERLEAVED_ONE_F_ONE_B_LEAN = "interleaved_1f1b_lean"
    ZERO_BUBBLE_H1 = "zb_h1"

    @classmethod
    def parse(cls, value: Any, what: str = "schedule") -> PipelineSchedule:
        """The kind named by ``value``: a member, its value or its name, in any case.

        Args:
            value: ``PipelineSchedule.GPIPE``, ``"gpipe"``, ``"GPIPE"``, ``"1F1B"``...
            what: how the caller names the argument in errors
                (``"build_schedule: schedule"``).

        Returns:
            The member.

        Raises:
            ValueError: ``value`` names no kind; the message lists the valid names.
        """
        return parse_choice(cls, value, what)


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
                "Schedule: num_ranks, num_microbatches and chunks must all be >= 1, got "
                f"{self.num_ranks}, {self.num_microbatches}, {self.chunks}")

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

    Handy for tests and for trying out an order of your own: a
    :class:`~axondist.pipeline.Pipeline` given the result validates it first
    (:func:`~axondist.pipeline.validate` does it alone).

    Args:
        rows: per rank, a whitespace-separated string or a list of tokens like
            ``"F0"``, ``"B3"``, ``"1F2"`` (chunk 1), ``"I0"``, ``"W0"``.
        num_microbatches: inferred from the largest microbatch seen when None.
        chunks: inferred from the largest chunk seen when None.
        kind: the kind to record (None: hand-made).

    Returns:
        The :class:`Schedule`, not yet checked.

    Raises:
        ValueError: a token that is not an action.
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
                    f"parse_schedule: rank {r} token {k}: expected an action like 'F3', 'B0', "
                    f"'1F2' (chunk 1), 'I0' or 'W0', got {tok!r}")
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


Step = tuple[ActionKind, int, int]
"""One entry of a builder's order: (kind, microbatch, chunk)."""

RankOrder = Callable[[int, int, int, int], list[Step]]
"""A builder: ``(num_ranks, num_microbatches, chunks, rank) -> that rank's order``."""


def _numbered(rank: int, items: Sequence[Step]) -> tuple[Action, ...]:
    return tuple(Action(rank, k, kind, mb, chunk) for k, (kind, mb, chunk) in enumerate(items))


def _gpipe(p: int, m: int, v: int, rank: int) -> list[Step]:
    # All forwards (chunk by chunk, microbatches ascending), then all backwards
    # (last chunk first, microbatches ascending, as torch.distributed.pipelining's
    # ScheduleGPipe does).  With chunks > 1 this is the "looped breadth-first" order.
    order = [(ActionKind.F, mb, c) for c in range(v) for mb in range(m)]
    order += [(ActionKind.B, mb, c) for c in reversed(range(v)) for mb in range(m)]
    return order


def _one_f_one_b(p: int, m: int, v: int, rank: int) -> list[Step]:
    # PipeDream-flush: min(p - rank - 1, m) warm-up forwards, then alternate
    # F(i + warmup), B(i), then the remaining backwards.
    warmup = min(p - rank - 1, m)
    order = [(ActionKind.F, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order.append((ActionKind.F, warmup + i, 0))
        order.append((ActionKind.B, i, 0))
    order += [(ActionKind.B, mb, 0) for mb in range(m - warmup, m)]
    return order


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> list[int]:
    """Microbatches per round of :attr:`PipelineSchedule.INTERLEAVED_ONE_F_ONE_B`.

    ``max(1, m // p)`` rounds of as equal a size as possible, the larger
    first; every round holds at least ``p`` microbatches when ``m >= p``.
    When ``p`` divides ``m`` these are torch's rounds of ``p``; when torch
    accepts ``m`` (``m`` a multiple of the number of rounds) they are its
    ``microbatches_per_round``.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: ``m``.

    Returns:
        The round sizes, summing to ``m``.
    """
    n = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, n)
    return [base + 1] * extra + [base] * (n - extra)


def _interleaved_order(p: int, v: int, rank: int, rounds: Sequence[range]) -> list[Step]:
    # Depth first within a round: chunk 0 of the round's microbatches, then
    # chunk 1, ...; backwards mirror the chunk order.  Rank r warms up with
    # 2 * (p - r - 1) + (v - 1) * len(first round) forwards, then alternates
    # one forward and one backward, then drains the backwards.
    forwards = [(ActionKind.F, mb, c) for mbs in rounds for c in range(v) for mb in mbs]
    backwards = [(ActionKind.B, mb, c) for mbs in rounds for c in reversed(range(v)) for mb in mbs]
    total = len(forwards)
    warmup = min(2 * (p - rank - 1) + (v - 1) * len(rounds[0]), total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order.append(forwards[warmup + i])
        order.append(backwards[i])
    return order + backwards[total - warmup:]


def _interleaved_lean(p: int, m: int, v: int, rank: int) -> list[Step]:
    # Rounds of exactly p microbatches (Megatron's order), built for m rounded
    # up to a multiple of p; the padding microbatches' actions are then deleted.
    # Deleting actions keeps every wait implied by the padded schedule and
    # removes a padding message at both ends, so the result stays valid; the
    # holes become idle time, and the short warm-up keeps few activations.
    if v == 1:
        return _one_f_one_b(p, m, v, rank)
    padded = -(-m // p) * p
    rounds = [range(start, start + p) for start in range(0, padded, p)]
    return [step for step in _interleaved_order(p, v, rank, rounds) if step[1] < m]


def _interleaved(p: int, m: int, v: int, rank: int) -> list[Step]:
    # torch.distributed.pipelining's ScheduleInterleaved1F1B order, extended to
    # every m by rounds of unequal size (interleaved_rounds).  With two ranks
    # one channel carries activations and gradients both ways, and unequal
    # rounds would make a rank receive them in another order than its peer
    # sends them, so there the lean order runs instead.
    if v == 1:
        return _one_f_one_b(p, m, v, rank)
    sizes = interleaved_rounds(p, m)
    if p == 2 and len(set(sizes)) > 1:
        return _interleaved_lean(p, m, v, rank)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    rounds = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    return _interleaved_order(p, v, rank, rounds)


def _zero_bubble_h1(p: int, m: int, v: int, rank: int) -> list[Step]:
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


@dataclass(frozen=True)
class ScheduleSpec:
    """How :func:`build_schedule` makes one :class:`PipelineSchedule` kind."""

    builder: RankOrder
    """``(num_ranks, num_microbatches, chunks, rank) -> [(ActionKind, microbatch, chunk)]``."""
    multi_chunk: bool
    """True when it takes several chunks (virtual stages) per rank."""
    interleaved: bool
    """True when its point is several chunks per rank (the demo gives it 2)."""
    split_backward: bool
    """True when it splits each backward into ``I`` and ``W``."""
    summary: str
    """One line for help texts and logs."""


SCHEDULES: Mapping[PipelineSchedule, ScheduleSpec] = MappingProxyType({
    PipelineSchedule.GPIPE: ScheduleSpec(
        _gpipe, multi_chunk=True, interleaved=False, split_backward=False,
        summary="all forwards, then all backwards (looped breadth-first with chunks)"),
    PipelineSchedule.ONE_F_ONE_B: ScheduleSpec(
        _one_f_one_b, multi_chunk=False, interleaved=False, split_backward=False,
        summary="PipeDream-flush: warm-up forwards, then one forward and one backward"),
    PipelineSchedule.INTERLEAVED_ONE_F_ONE_B: ScheduleSpec(
        _interleaved, multi_chunk=True, interleaved=True, split_backward=False,
        summary="interleaved 1F1B as torch's ScheduleInterleaved1F1B, for any microbatches"),
    PipelineSchedule.INTERLEAVED_ONE_F_ONE_B_LEAN: ScheduleSpec(
        _interleaved_lean, multi_chunk=True, interleaved=True, split_backward=False,
        summary="interleaved 1F1B in rounds of num_ranks microbatches: fewer activations, "
                "a larger bubble when num_ranks does not divide the microbatches"),
    PipelineSchedule.ZERO_BUBBLE_H1: ScheduleSpec(
        _zero_bubble_h1, multi_chunk=False, interleaved=False, split_backward=True,
        summary="ZB-H1: 1F1B with the weight gradient W deferred into the bubble"),
})
"""Every schedule kind and how to build it: read by build_schedule, the CLI and the tests."""


def schedule_names() -> tuple[str, ...]:
    """The values of every kind in :data:`SCHEDULES` (``"gpipe"``, ``"1f1b"``...), in order."""
    return tuple(kind.value for kind in SCHEDULES)


def _count(value: Any, what: str, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: {arg} must be an int >= 1, got {value!r}")
    return value


def build_schedule(
    schedule: PipelineSchedule | str,
    num_ranks: int,
    num_microbatches: int,
    chunks: int = 1,
) -> Schedule:
    """Generate the per-rank action lists of one :data:`SCHEDULES` kind.

    Works for every ``num_microbatches >= 1``, also fewer than the stages and
    counts ``num_ranks`` does not divide. Every generated schedule passes
    :func:`~axondist.pipeline.validate`; the unit tests check this for every
    kind over a grid of shapes, and that ``INTERLEAVED_ONE_F_ONE_B`` reaches
    the bubble ``(p - 1) / (v * m + p - 1)`` of torch's schedule whenever
    ``m >= p`` (two ranks with an odd ``m`` excepted: see ``docs/guide.md``).

    Args:
        schedule: a :class:`PipelineSchedule` or its name in any case (``"1F1B"``).
        num_ranks: pipeline ranks ``p >= 1``.
        num_microbatches: microbatches ``m >= 1``.
        chunks: stages per rank ``v >= 1``; above 1 only for the kinds whose
            :attr:`ScheduleSpec.multi_chunk` is True.

    Returns:
        The :class:`Schedule`, with ``kind`` set.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), a count
            below 1, or ``chunks > 1`` for a one-chunk kind.
    """
    kind = PipelineSchedule.parse(schedule, "build_schedule: schedule")
    spec = SCHEDULES[kind]
    p = _count(num_ranks, "build_schedule", "num_ranks")
    m = _count(num_microbatches, "build_schedule", "num_microbatches")
    v = _count(chunks, "build_schedule", "chunks")
    if v != 1 and not spec.multi_chunk:
        several = ", ".join(k.name for k, s in SCHEDULES.items() if s.multi_chunk)
        raise ValueError(
            f"build_schedule: {kind.name} runs one chunk per rank, got chunks={v}; use one of "
            f"{several} for several chunks per rank, or chunks=1")
    rows = tuple(_numbered(r, spec.builder(p, m, v, r)) for r in range(p))
    return Schedule(kind=kind, num_ranks=p, num_microbatches=m, chunks=v, actions=rows)



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
        al.'s approximation (bubble time divided by ``v``), which
        ``INTERLEAVED_ONE_F_ONE_B`` reaches exactly (F=1, B=2 per chunk) when
        ``m >= p``.
        """
        p, m, v = stages, microbatches, chunks
        return (p - 1) / (v * m + p - 1)
