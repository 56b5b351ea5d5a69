"""Pipeline: run a model split into stages through a pipeline schedule.

Each pipeline rank walks its program from
:func:`~axondist.pipeline.communication_plan` top to bottom: a recv right
before the action that consumes the message, the action (``F``, ``B``,
``I`` or ``W`` of one microbatch on one local stage), the sends right after
the action that produced them.  Two ways to run the same programs:

* **single process** (:meth:`Pipeline.from_stages`): every stage lives in
  this process; the ranks' programs are interleaved in one thread (each rank
  runs until it needs a message not sent yet, then the next rank), and
  messages pass through in-memory FIFO queues, one per rank pair.  For tests,
  debugging and small models.
* **distributed** (:class:`Pipeline` with a group): each rank of the group
  holds its stage (or its ``chunks`` stages) and activations and gradients
  move with :func:`axondist.send` / :func:`axondist.recv` on a private copy
  of the group (made when the Pipeline is built, so pipeline messages never
  match the caller's own sends).  A schedule needs *buffered* sends (a rank
  sends and goes on before its peer receives: 1F1B ranks send to each other
  at the same moment), but an MPI ``Send`` of more than a few KiB waits for
  the receiver; so sends go through a helper thread (one per Pipeline, in
  program order), and every step waits for them to finish before it returns.

Microbatches: the batch is split along axis 0 with ``numpy.array_split``
(the first ``rows % m`` microbatches get one row more).  Loss scaling: with
``loss_fn`` returning the *mean* loss over its rows and ``grad_y`` its
gradient, the full-batch mean loss is ``L = sum_i (rows_i / N) * loss_i``, so
``train_step`` returns exactly that and feeds the last stage's backward
``(rows_i / N) * grad_y_i``; the parameter gradients summed over
microbatches are then those of ``L`` on the full batch, also when ``N`` does
not split evenly.  A ``loss_fn`` that *sums* over its rows must be made a
mean first (divide its loss and grad_y by ``y.shape[0]``); the step then
returns the full-batch mean, and the full-batch sum's loss and gradients
are ``N`` times it.  Empty microbatches (fewer rows than microbatches) are
refused with a ValueError.

Per-rank inputs and results in distributed mode: ``x`` is read only on the
rank holding stage 0 and ``target`` only on the last stage's rank (others
may pass None); ``train_step`` returns the loss on every rank (broadcast
from the last stage's rank); ``forward`` returns the output on the last
stage's rank and None elsewhere.  The batch size is exchanged at the start
of every step (one small all-gather), so a bad batch raises the same error
on every rank instead of leaving some waiting.

Zero-bubble (``ZERO_BUBBLE_H1``) with a stage that has only a full
``backward``: that stage runs it at ``I`` and only adds the weight gradient
at ``W`` (see :class:`~axondist.pipeline.PipelineStage`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from axondist import _array, comm
from axondist.parameter import Parameter
from axondist.pipeline.communication import (
    CommunicationPlan,
    check_channels,
    communication_plan,
)
from axondist.pipeline.executor import LossFn, RankRunner, StepState
from axondist.pipeline.memory import PipelineRunStats
from axondist.pipeline.render import render_text
from axondist.pipeline.schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    Schedule,
    build_schedule,
    validate,
)
from axondist.pipeline.simulate import simulate
from axondist.pipeline.stage import PipelineStage
from axondist.pipeline.transport import GroupTransport, InProcessTransport, Transport
from axondist.process_group import ProcessGroup, resolve_group

__all__ = ["LossFn", "Pipeline"]

_ABSENT, _NONE, _SCALAR = -3, -1, -2  # batch-size codes exchanged by _agree_on_rows


class Pipeline:
    """A model split into pipeline stages, trained or evaluated through a schedule.

    Distributed mode (this constructor): every rank of ``group`` builds its
    Pipeline at the same time (the constructor is collective: it copies the
    group) with the stages it holds.  With ``p`` ranks and ``chunks = v``
    there are ``p * v`` virtual stages; rank ``r`` passes ``v`` stages, the
    virtual stages ``r, r + p, ..., r + (v - 1) * p`` in that order (one
    stage, or a list of one, when ``v == 1``).  For example, on every rank::

        stage = PipelineStage(forward, backward, params)   # this rank's layers
        pipe = Pipeline(stage, world, num_microbatches=8)  # 1F1B
        opt = SGD(pipe, lr=0.1)                            # this rank's parameters
        loss = pipe.train_step(x if world.rank == 0 else None,
                               target if world.rank == world.world_size - 1 else None,
                               loss_fn)
        opt.step()

    Args:
        stages: this rank's :class:`PipelineStage` (or list of ``chunks`` of them).
        group: the pipeline's ranks (the current world when None); group rank
            ``r`` is pipeline rank ``r``, stage 0 is on rank 0 and the last
            stage on rank ``p - 1``.
        num_microbatches: microbatches per step, ``m >= 1``; fewer than the
            number of stages works (with a larger bubble).
        schedule: a :class:`PipelineSchedule` or its value (``"gpipe"``,
            ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``).
        chunks: stages per rank (``INTERLEAVED_ONE_F_ONE_B`` and ``GPIPE``
            accept more than 1).

    Raises:
        ValueError: a bad count, a schedule that does not take ``chunks``, or
            the wrong number of stages for ``chunks``.
        TypeError: a stage that is not a :class:`PipelineStage`.
    """

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        group: ProcessGroup | None = None,
        *,
        num_microbatches: int,
        schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
        chunks: int = 1,
    ) -> None:
        g = resolve_group(group)
        g.backend_for("Pipeline")  # non-members get a clear error
        _check_counts("Pipeline", num_microbatches, chunks)
        local = _stage_list(stages, "Pipeline")
        if len(local) != chunks:
            raise ValueError(
                f"Pipeline: rank {g.rank} passed {len(local)} stage(s) but chunks={chunks}; "
                f"with chunks=v each rank passes its v stages (virtual stages rank, "
                f"rank + {g.world_size}, ...)")
        p = g.world_size
        self._setup(schedule, p, num_microbatches, chunks,
                    {c * p + g.rank: st for c, st in enumerate(local)}, (g.rank,))
        # Pipeline traffic on its own communicator, never matching the caller's messages.
        self._group: ProcessGroup | None = g.new_group(list(range(p)))
        self._transport: GroupTransport | None = GroupTransport(self._group)
        weakref.finalize(self, self._transport.stop)

    @classmethod
    def from_stages(
        cls,
        stages: Sequence[PipelineStage],
        *,
        num_microbatches: int,
        schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
        chunks: int = 1,
    ) -> Pipeline:
        """A single-process pipeline holding every stage (no communication).

        ``stages`` lists all ``p * chunks`` virtual stages in model order;
        virtual stage ``s`` plays rank ``s % p``'s chunk ``s // p``, so the
        schedule, the messages and the memory accounting are those of ``p``
        ranks.  ``len(stages)`` must be a multiple of ``chunks``.
        """
        _check_counts("Pipeline.from_stages", num_microbatches, chunks)
        local = _stage_list(stages, "Pipeline.from_stages")
        if len(local) % chunks:
            raise ValueError(
                f"Pipeline.from_stages: {len(local)} stages do not split into chunks={chunks} "
                "per rank; pass a multiple of chunks stages")
        p = len(local) // chunks
        self = cls.__new__(cls)
        self._setup(schedule, p, num_microbatches, chunks, dict(enumerate(local)),
                    tuple(range(p)))
        self._group = None
        self._transport = None
        return self

    def _setup(self, schedule: PipelineSchedule | str, p: int, m: int, v: int,
               stages: dict[int, PipelineStage], ranks: tuple[int, ...]) -> None:
        if not isinstance(schedule, (PipelineSchedule, str)):
            raise TypeError(f"Pipeline: schedule must be a PipelineSchedule or one of "
                            f"{[k.value for k in PipelineSchedule]}, got {schedule!r}")
        try:
            kind = PipelineSchedule(schedule)
        except ValueError:
            raise ValueError(f"Pipeline: unknown schedule {schedule!r}; choose one of "
                             f"{[k.value for k in PipelineSchedule]}") from None
        self._schedule = build_schedule(kind, p, m, v)
        validate(self._schedule)
        self._plan = communication_plan(self._schedule)
        self._forward_schedule = _forwards_only(self._schedule)
        self._forward_plan = communication_plan(self._forward_schedule)
        check_channels(self._forward_plan)
        simulate(self._forward_schedule)  # raises on deadlock (never, for generated schedules)
        self._expected_peaks = simulate(self._schedule).peak_activations
        self._stages = stages
        self._ranks = ranks
        self.last_stats: PipelineRunStats | None = None
        """What the last train_step/forward measured on this process (None before)."""

    # -- shape -----------------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        """The per-rank action lists this pipeline runs (``schedule.kind`` is the kind)."""
        return self._schedule

    @property
    def plan(self) -> CommunicationPlan:
        """Every rank's program: its actions with their sends and recvs."""
        return self._plan

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks ``p`` (simulated ones in single-process mode)."""
        return self._schedule.num_ranks

    @property
    def num_stages(self) -> int:
        """Virtual stages, ``num_ranks * chunks``."""
        return self._schedule.num_stages

    @property
    def num_microbatches(self) -> int:
        """Microbatches ``m`` each batch is split into (rows split like ``numpy.array_split``)."""
        return self._schedule.num_microbatches

    @property
    def chunks(self) -> int:
        """Stages (model chunks) per rank ``v``; above 1 only for interleaved 1F1B and GPipe."""
        return self._schedule.chunks

    @property
    def group(self) -> ProcessGroup | None:
        """The pipeline's private communicator (None in single-process mode)."""
        return self._group

    @property
    def rank(self) -> int | None:
        """This process's pipeline rank (None in single-process mode, which runs them all)."""
        return None if self._group is None else self._ranks[0]

    @property
    def stages(self) -> dict[int, PipelineStage]:
        """Virtual stage -> the PipelineStage held here."""
        return dict(self._stages)

    @property
    def holds_first_stage(self) -> bool:
        """True where stage 0 lives: this process needs ``x``."""
        return 0 in self._stages

    @property
    def holds_last_stage(self) -> bool:
        """True where the last stage lives: this process needs ``target`` and gets outputs."""
        return self.num_stages - 1 in self._stages

    def parameters(self) -> list[Parameter]:
        """The Parameters of the stages held here (each once), in stage order.

        A Pipeline can be passed to an optimizer as the model.
        """
        seen: dict[int, Parameter] = {}
        for s in sorted(self._stages):
            for prm in self._stages[s].params:
                seen.setdefault(id(prm), prm)
        return list(seen.values())

    def schedule_text(self, **kwargs: Any) -> str:
        """:func:`~axondist.pipeline.render_text` of the schedule (``costs``, ``comm``,
        ``slot`` pass through): the rank x time grid with the bubble shown as dots."""
        return render_text(self._schedule, **kwargs)

    def close(self) -> None:
        """Stop the send thread and release the private communicator (distributed mode);
        the Pipeline is unusable afterwards.  Call it on every rank (freeing an MPI
        communicator is collective); single-process pipelines need no closing."""
        if self._transport is not None:
            self._transport.stop(wait=True)
        if self._group is not None and self._group.backend is not None:
            self._group.backend.close()

    def __repr__(self) -> str:
        where = "single process" if self._group is None else f"rank {self.rank}"
        kind = self._schedule.kind  # never None: the Pipeline builds its schedule by kind
        return (f"Pipeline({kind.value if kind else 'custom'}, {self.num_ranks} ranks x "
                f"{self.chunks} chunk(s), {self.num_microbatches} microbatches, {where})")

    # -- running ----------------------------------------------------------------------

    def train_step(self, x: Any, target: Any, loss_fn: LossFn) -> float:
        """One forward and backward pass of the batch through the schedule.

        Args:
            x: the input batch (leading axis = rows); needed only where
                :attr:`holds_first_stage`, ignored (may be None) elsewhere.
            target: passed to ``loss_fn`` split like ``x``; needed only where
                :attr:`holds_last_stage` (None there calls ``loss_fn(y, None)``).
            loss_fn: ``loss_fn(y, target) -> (loss, grad_y)`` for one
                microbatch: the loss as a scalar, the mean over the
                microbatch's rows, and its gradient with respect to ``y``.

        Returns:
            The full-batch loss ``sum_i (rows_i / N) * loss_i`` as a float, on
            every rank (broadcast from the last stage's rank).

        Afterwards every local stage's ``param.grad`` holds the gradient of
        that loss summed over all microbatches, *replacing* any earlier
        ``.grad`` (a Parameter shared by several local stages gets the sum).

        Raises:
            ValueError: on every rank alike, when stage 0's rank passed no
                ``x``, ``x`` has fewer rows than ``num_microbatches`` (there
                would be empty microbatches), or ``target`` has a different
                number of rows than ``x``; and where a stage or ``loss_fn``
                returns something of the wrong form.
        """
        if not callable(loss_fn):
            raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
        rows = self._agree_on_rows("train_step", x, target)
        step = self._step_state(self._schedule, True, rows, x, target, loss_fn)
        self._execute(step, self._plan)
        loss = step.total_loss() if self.holds_last_stage else math.nan
        if self._group is not None:
            buf = np.array([loss], dtype=np.float64)
            comm.broadcast(buf, self._group, src=(self.num_stages - 1) % self.num_ranks)
            loss = float(buf[0])
        step.write_grads()
        self.last_stats = step.stats(self._expected_peaks)
        return loss

    def forward(self, x: Any) -> Any:
        """Inference: run every microbatch forward (the schedule's forward order).

        Args:
            x: the input batch; needed only where :attr:`holds_first_stage`.

        Returns:
            Where :attr:`holds_last_stage`: the last stage's outputs of all
            microbatches concatenated along axis 0 (the output for the whole
            batch, rows in order).  Elsewhere: None.  Nothing is kept for a
            backward pass and no ``.grad`` changes.
        """
        rows = self._agree_on_rows("forward", x, None)
        step = self._step_state(self._forward_schedule, False, rows, x, None, None)
        self._execute(step, self._forward_plan)
        self.last_stats = step.stats((0,) * self.num_ranks)
        if not self.holds_last_stage:
            return None
        outs = [step.outputs[mb] for mb in range(self.num_microbatches)]
        return _array.namespace(*outs).concatenate(outs, axis=0)

    def _agree_on_rows(self, what: str, x: Any, target: Any) -> list[int]:
        """Rows per microbatch, checked the same way on every rank (so errors are collective)."""
        x_rows = _rows_code(x) if self.holds_first_stage else _ABSENT
        t_rows = _rows_code(target) if self.holds_last_stage else _ABSENT
        if self._group is not None:
            mine = np.array([[x_rows, t_rows]], dtype=np.int64)
            table = comm.all_gather(mine, self._group, sizes=[1] * self.num_ranks)
            x_rows = int(table[0, 0])
            t_rows = int(table[(self.num_stages - 1) % self.num_ranks, 1])
        m = self.num_microbatches
        last = (self.num_stages - 1) % self.num_ranks
        if x_rows == _NONE:
            raise ValueError(f"{what}: the rank holding stage 0 (rank 0) passed x=None; it "
                             "must pass the input batch")
        if x_rows == _SCALAR:
            raise ValueError(f"{what}: x must have a leading batch axis, got a 0-d array")
        if x_rows < m:
            raise ValueError(
                f"{what}: x has {x_rows} rows, fewer than num_microbatches={m}; every "
                f"microbatch needs at least one row (numpy.array_split would make empty "
                f"ones): pass at least {m} rows or build the Pipeline with "
                f"num_microbatches <= {x_rows}")
        if t_rows == _SCALAR:
            raise ValueError(f"{what}: target (on rank {last}) must have a leading batch axis "
                             "to split into microbatches, got a 0-d array")
        if t_rows >= 0 and t_rows != x_rows:
            raise ValueError(f"{what}: target has {t_rows} rows but x has {x_rows}; they are "
                             "split into microbatches together and must match")
        return comm.split_sizes(x_rows, m)

    def _step_state(self, schedule: Schedule, training: bool, rows: list[int], x: Any,
                    target: Any, loss_fn: LossFn | None) -> StepState:
        m = self.num_microbatches
        return StepState(
            schedule, self._stages, self._ranks, training=training, rows=rows,
            inputs=_split(x, m) if self.holds_first_stage else None,
            targets=(_split(target, m) if self.holds_last_stage and target is not None
                     else None),
            loss_fn=loss_fn)

    def _execute(self, step: StepState, plan: CommunicationPlan) -> None:
        transport: Transport = (
            InProcessTransport() if self._transport is None else self._transport)
        runners = [RankRunner(step, r, plan.program[r], transport) for r in self._ranks]
        try:
            # One rank: runs to the end (recvs block).  All ranks in one thread: each
            # runs until it needs a message not yet sent; a valid plan always progresses.
            while not all(rr.done for rr in runners):
                if not any([rr.advance() for rr in runners]):
                    stuck = {rr.rank: rr.next_entry for rr in runners if not rr.done}
                    raise RuntimeError(f"Pipeline: no rank can progress ({stuck}); the "
                                       "communication plan is inconsistent (a bug: please report)")
            transport.finish()
        except BaseException:
            transport.abandon()
            raise
        step.finish()


# --- helpers ---------------------------------------------------------------------------


def _check_counts(what: str, num_microbatches: Any, chunks: Any) -> None:
    for name, value in (("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: {name} must be an int >= 1, got {value!r}")


def _stage_list(stages: Any, what: str) -> list[PipelineStage]:
    items = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not items:
        raise ValueError(f"{what}: needs at least one PipelineStage, got none")
    for i, st in enumerate(items):
        if not isinstance(st, PipelineStage):
            raise TypeError(f"{what}: stage {i} is a {type(st).__name__}, not a PipelineStage; "
                            "wrap forward/backward callables with PipelineStage(...)")
    return items


def _rows_code(x: Any) -> int:
    if x is None:
        return _NONE
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = _array.as_array(x).shape
    return _SCALAR if len(shape) == 0 else int(shape[0])


def _split(x: Any, m: int) -> list[Any]:
    x = _array.as_array(x)
    return list(_array.namespace(x).array_split(x, m, axis=0))


def _forwards_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in the same per-rank order (for inference)."""
    rows = []
    for r, row in enumerate(schedule.actions):
        fs = [a for a in row if a.kind is ActionKind.F]
        rows.append(tuple(Action(r, k, ActionKind.F, a.microbatch, a.chunk)
                          for k, a in enumerate(fs)))
    return Schedule(kind=schedule.kind, num_ranks=schedule.num_ranks,
                    num_microbatches=schedule.num_microbatches, chunks=schedule.chunks,
                    actions=tuple(rows))
