"""Pipeline: run a model split into stages through a pipeline schedule, in one process or many.

Each pipeline rank walks its program from :func:`~axondist.pipeline.communication_plan`
(recv, action, send) with the user's :class:`~axondist.pipeline.PipelineStage`
callables; :meth:`Pipeline.from_stages` runs every rank in this process over
in-memory queues, and :class:`Pipeline` on a group runs one rank per process
over send/recv on a private copy of the group. How batches split into
microbatches, how the loss is scaled, which rank needs which input and why
sends go through a helper thread: ``docs/guide.md`` ("Pipeline runtime").
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from axondist import _array, clip, comm
from axondist._step import check_optimizer
from axondist._validate import positive_number
from axondist.parameter import Parameter
from axondist.pipeline._arguments import (
    ABSENT,
    NO_LOSS_FN,
    check_batch_rows,
    check_loss_fn,
    forwards_only,
    rows_code,
    schedule_for,
    shape_of,
    split_rows,
    stage_list,
)
from axondist.pipeline._state_dict import gather_state, load_state
from axondist.pipeline.communication import (
    CommunicationPlan,
    check_channels,
    communication_plan,
)
from axondist.pipeline.executor import LossFn, StepState, run_programs
from axondist.pipeline.memory import PipelineRunStats
from axondist.pipeline.render import render_text
from axondist.pipeline.schedules import (
    PipelineSchedule,
    Schedule,
)
from axondist.pipeline.simulate import log_dry_run, simulate
from axondist.pipeline.stage import PipelineStage
from axondist.pipeline.transport import GroupTransport, InProcessTransport, Transport
from axondist.process_group import ProcessGroup, resolve_group

__all__ = ["LossFn", "Pipeline"]


class Pipeline:
    """A model split into pipeline stages, trained or evaluated through a schedule.

    Distributed mode (this constructor): every rank of ``group`` builds its
    Pipeline at the same time (the constructor is collective: it copies the
    group) with the stages it holds.  With ``p`` ranks and ``chunks = v``
    there are ``p * v`` virtual stages; rank ``r`` passes ``v`` stages, the
    virtual stages ``r, r + p, ..., r + (v - 1) * p`` in that order (one
    stage, or a list of one, when ``v == 1``).  For example, on every rank::

        stage = PipelineStage(forward, backward, params)   # this rank's layers
        pipe = Pipeline(stage, world, num_microbatches=8, loss_fn=loss_fn)  # 1F1B
        opt = SGD(pipe.parameters(), lr=0.1)               # this rank's parameters
        loss = pipe.step(x, target, optimizer=opt)          # x read on rank 0, target
                                                            # on the last stage's rank

    The training calls are those of DDP and FSDP (:meth:`backward`,
    :meth:`step`, :meth:`clip_grad_norm`, :meth:`no_sync`,
    :meth:`summon_full_params`, :meth:`state_dict`), so a loop written for
    them runs a pipeline too; :meth:`train_step` (``.grad`` replaced, the
    loss function per call) still works.

    Args:
        stages: this rank's :class:`PipelineStage` (or list of ``chunks`` of them).
        group: the pipeline's ranks (the current world when None); group rank
            ``r`` is pipeline rank ``r``, stage 0 is on rank 0 and the last
            stage on rank ``p - 1``.
        num_microbatches: microbatches per step, ``m >= 1``; fewer than the
            number of stages works (with a larger bubble). May be left out
            when ``schedule`` is a :class:`Schedule` (it says).
        schedule: a :class:`PipelineSchedule` or its name in any case
            (``"gpipe"``, ``"1F1B"``, ... :func:`~axondist.pipeline.schedule_names`),
            or a hand-made :class:`Schedule` (for example from
            :func:`~axondist.pipeline.parse_schedule`), validated before use.
        chunks: stages per rank (kinds whose ``SCHEDULES[kind].multi_chunk`` is
            True accept more than 1); 1 when left out, or the schedule's own.
        loss_fn: ``loss_fn(y, target) -> (loss, grad_y)`` for one microbatch
            (see :meth:`train_step`), used by :meth:`backward` and
            :meth:`step`; only the last stage's rank calls it (and needs it).

    Raises:
        ValueError: a bad count, a schedule that does not take ``chunks``, an
            unknown schedule name, or the wrong number of stages for ``chunks``.
        ScheduleError: a hand-made schedule that is invalid or does not fit the
            pipeline (ranks, microbatches, chunks).
        TypeError: a stage that is not a :class:`PipelineStage`, a schedule
            that is neither a kind, a name nor a :class:`Schedule`, or a
            ``loss_fn`` that is not callable.
    """

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        group: ProcessGroup | None = None,
        *,
        num_microbatches: int | None = None,
        schedule: PipelineSchedule | str | Schedule = PipelineSchedule.ONE_F_ONE_B,
        chunks: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        g = resolve_group(group)
        g.backend_for("Pipeline")  # non-members get a clear error
        m, v = shape_of("Pipeline", schedule, num_microbatches, chunks)
        self.loss_fn = check_loss_fn(loss_fn, "Pipeline")
        local = stage_list(stages, "Pipeline")
        if len(local) != v:
            raise ValueError(
                f"Pipeline: rank {g.rank} passed {len(local)} stage(s) but chunks={v}; "
                f"with chunks=v each rank passes its v stages (virtual stages rank, "
                f"rank + {g.world_size}, ...)")
        p = g.world_size
        self._setup("Pipeline", schedule, p, m, v,
                    {c * p + g.rank: st for c, st in enumerate(local)}, (g.rank,))
        # Pipeline traffic on its own communicator, never matching the caller's messages.
        self._group: ProcessGroup | None = g.new_group(list(range(p)))
        channels = [(o.src_rank, o.dst_rank) for row in self._plan.ops for o in row]
        self._transport: GroupTransport | None = GroupTransport(self._group, channels)
        weakref.finalize(self, self._transport.stop)

    @classmethod
    def from_stages(
        cls,
        stages: Sequence[PipelineStage],
        *,
        num_microbatches: int | None = None,
        schedule: PipelineSchedule | str | Schedule = PipelineSchedule.ONE_F_ONE_B,
        chunks: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> Pipeline:
        """A single-process pipeline holding every stage (no communication).

        Virtual stage ``s`` plays rank ``s % p``'s chunk ``s // p``, so the
        schedule, the messages and the memory accounting are those of ``p``
        ranks.

        Args:
            stages: all ``p * chunks`` virtual stages in model order
                (``len(stages)`` a multiple of ``chunks``).
            num_microbatches: as for :class:`Pipeline`.
            schedule: as for :class:`Pipeline` (a kind, a name or a :class:`Schedule`).
            chunks: as for :class:`Pipeline`.
            loss_fn: as for :class:`Pipeline`.

        Returns:
            The Pipeline; it needs no :meth:`close`.

        Raises:
            ValueError, ScheduleError, TypeError: as for :class:`Pipeline`.
        """
        m, v = shape_of("Pipeline.from_stages", schedule, num_microbatches, chunks)
        local = stage_list(stages, "Pipeline.from_stages")
        if len(local) % v:
            raise ValueError(
                f"Pipeline.from_stages: {len(local)} stages do not split into chunks={v} "
                "per rank; pass a multiple of chunks stages")
        p = len(local) // v
        self = cls.__new__(cls)
        self.loss_fn = check_loss_fn(loss_fn, "Pipeline.from_stages")
        self._setup("Pipeline.from_stages", schedule, p, m, v, dict(enumerate(local)),
                    tuple(range(p)))
        self._group = None
        self._transport = None
        return self

    def _setup(self, what: str, schedule: PipelineSchedule | str | Schedule, p: int, m: int,
               v: int, stages: dict[int, PipelineStage], ranks: tuple[int, ...]) -> None:
        self._schedule = schedule_for(what, schedule, p, m, v)
        self._plan = communication_plan(self._schedule)
        self._forward_schedule = forwards_only(self._schedule)
        self._forward_plan = communication_plan(self._forward_schedule)
        check_channels(self._forward_plan)
        simulate(self._forward_schedule)  # raises on deadlock (never, for a valid schedule)
        dry_run = simulate(self._schedule)
        self._expected_peaks = dry_run.peak_activations
        log_dry_run(dry_run)
        self._stages = stages
        self._ranks = ranks
        self._no_sync_depth = 0
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

    def clip_grad_norm(self, max_norm: float, norm_type: float | str = 2.0,
                       error_if_nonfinite: bool = False) -> float:
        """Scale the stages' gradients so their norm over the whole model is at most ``max_norm``.

        The norm covers every stage of every pipeline rank (collective over the
        pipeline's group in distributed mode: call it on every rank, after
        :meth:`backward` or :meth:`train_step`; inside :meth:`no_sync` too,
        since the gradients are never averaged over replicas). As
        ``torch.nn.utils.clip_grad_norm_``: the gradients are multiplied by
        ``min(max_norm / (norm + 1e-6), 1)``; a NaN anywhere makes the norm NaN
        (also for ``norm_type=inf``) and every gradient NaN, an infinite
        element makes the norm inf and the finite gradients 0. Sums are taken
        in float64.

        Args:
            max_norm: the largest norm kept, a finite number > 0.
            norm_type: the order p of the norm (> 0), or ``inf`` for the largest
                absolute element.
            error_if_nonfinite: raise instead of scaling when the norm is NaN or inf.

        Returns:
            The norm before clipping, the same float on every rank.

        Raises:
            NonFiniteNormError: the norm is NaN or inf and ``error_if_nonfinite``
                (on every rank; no gradient changes).
            ValueError: a bad ``max_norm`` or ``norm_type``.
        """
        grads = [prm.grad for prm in self.parameters() if prm.grad is not None]
        return clip.clip_grad_norm(grads, max_norm, norm_type, error_if_nonfinite,
                                   group=self._group, where="Pipeline.clip_grad_norm")

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
            self._transport.destroy()
        if self._group is not None:
            self._group.destroy()  # idempotent: a second close() is a no-op

    def __repr__(self) -> str:
        where = "single process" if self._group is None else f"rank {self.rank}"
        kind = self._schedule.kind  # None for a hand-made schedule
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
        return self._train("train_step", x, target, loss_fn, accumulate=False)

    def _train(self, what: str, x: Any, target: Any, loss_fn: LossFn | None,
               accumulate: bool) -> float:
        """Run the training schedule once; write (or add) ``.grad``; the loss on every rank.

        ``loss_fn`` may be None where the last stage is not held (it is never called there).
        """
        rows = self._agree_on_rows(what, x, target, no_loss_fn=loss_fn is None)
        step = self._step_state(self._schedule, True, rows, x, target, loss_fn)
        self._execute(step, self._plan)
        loss = step.total_loss() if self.holds_last_stage else math.nan
        if self._group is not None:
            buf = self._group.backend_for(what).metadata_buffer(
                np.array([loss], dtype=np.float64))
            comm.broadcast(buf, self._group, src=(self.num_stages - 1) % self.num_ranks)
            loss = float(_array.to_host(buf)[0])
        step.write_grads(accumulate)
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

    # -- the training calls shared with DDP and FSDP ----------------------------------

    def backward(self, x: Any, target: Any = None, *, loss_fn: LossFn | None = None) -> float:
        """One forward and backward pass of the batch, *adding* the gradients into ``.grad``.

        The same pass as :meth:`train_step`, but as ``loss.backward()`` under
        DDP: each local parameter's ``.grad`` gets this batch's gradient added
        (set when it was None), so several calls (inside :meth:`no_sync`)
        accumulate, and ``opt.zero_grad()`` clears them between steps. Call it
        on every pipeline rank: the gradients of the whole model are then
        final (a pipeline has no replicas to average over).

        Args:
            x: the input batch; read only where :attr:`holds_first_stage`
                (others may pass None, or the same batch).
            target: split into microbatches like ``x`` and passed to
                ``loss_fn``; read only where :attr:`holds_last_stage`.
            loss_fn: this call's microbatch loss instead of the constructor's
                (only the last stage's rank needs one).

        Returns:
            The full-batch loss (the row-weighted mean of the microbatch
            losses), the same float on every rank.

        Raises:
            TypeError: no ``loss_fn`` (here or at construction) on the last
                stage's rank (raised on every rank alike), or one that is not
                callable or returns something else than a pair.
            ValueError: as :meth:`train_step`, on every rank alike.
        """
        fn = self._resolve_loss_fn(loss_fn, "Pipeline.backward")
        return self._train("Pipeline.backward", x, target, fn, accumulate=True)

    def step(self, x: Any, target: Any = None, *, optimizer: Any, max_norm: float | None = None,
             loss_fn: LossFn | None = None) -> float:
        """One training step: :meth:`backward`, optional clipping, ``optimizer.step()``,
        ``optimizer.zero_grad()``.

        Gradients accumulated by earlier :meth:`backward` calls inside
        :meth:`no_sync` are included. Call it on every rank, each with an
        optimizer over its own :meth:`parameters`.

        Args:
            x: the input batch (read where :attr:`holds_first_stage`).
            target: the targets (read where :attr:`holds_last_stage`).
            optimizer: what updates this rank's parameters (``step()`` and
                ``zero_grad()``).
            max_norm: clip the whole model's gradient to this norm first (see
                :meth:`clip_grad_norm`); None: no clipping.
            loss_fn: this call's microbatch loss instead of the constructor's.

        Returns:
            The full-batch loss, the same float on every rank.

        Raises:
            RuntimeError: called inside :meth:`no_sync` (use :meth:`backward`
                for the micro-batches and ``step`` for the last one).
            TypeError: ``optimizer`` lacks ``step()``/``zero_grad()``, no
                ``loss_fn`` on the last stage's rank, or ``max_norm`` is not a
                number.
            ValueError: ``max_norm`` is not > 0, or a bad batch (as
                :meth:`train_step`).
        """
        where = "Pipeline.step"
        check_optimizer(optimizer, where)
        if max_norm is not None:
            positive_number(max_norm, where, "max_norm")  # before any work
        if self._no_sync_depth:
            raise RuntimeError(f"{where}: cannot step inside no_sync(); use backward() for the "
                               "micro-batches, step() for the last one")
        fn = self._resolve_loss_fn(loss_fn, where)
        loss = self._train(where, x, target, fn, accumulate=True)
        if max_norm is not None:
            self.clip_grad_norm(max_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several :meth:`backward` calls; :meth:`step` is refused.

        A pipeline's ranks hold different layers, not replicas, so there is
        no gradient averaging to put off: :meth:`backward` always adds into
        ``.grad`` and the block only marks the accumulation (a :meth:`step`
        inside raises). It exists so that accumulation loops written for DDP
        and FSDP run on a pipeline unchanged.
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[list[Parameter]]:
        """Yield :meth:`parameters`: the Parameters of the stages held here, already whole.

        A pipeline splits the model by layer, not inside arrays, so this
        rank's parameters are complete and there is nothing to gather; the
        other ranks' layers are *not* brought here (:meth:`state_dict` gives
        the whole model on every rank). It exists so that code written for
        FSDP (``with model.summon_full_params(): ...``) runs as is.
        """
        yield self.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's ``.grad`` (``None``, or zeros in place with False)."""
        for prm in self.parameters():
            prm.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{name: NumPy copy}`` of the whole model, every stage of every rank, on every rank.

        Collective over the pipeline's ranks (call it on every rank). Keys
        are the Parameters' names in model order (virtual stage, then
        position in the stage), ``param{i}`` for an unnamed one with ``i`` its
        index in that order: the keys and shapes DDP and FSDP give the same
        model, so a state saved under one strategy loads under another.

        Raises:
            ValueError: two parameters of the model share a name.
        """
        return gather_state(self._stages, self._group, "Pipeline.state_dict")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy this rank's parameters, in place, from the whole model's ``{name: array}``.

        Collective (the model's layout is gathered first): every rank passes
        the same whole state, as :meth:`state_dict` returns, and takes its own
        stages' arrays from it. The whole state is checked before anything
        is written.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a parameter missing from ``state``, a name that is no
                parameter's, an array of another shape, or two parameters of
                the model with the same name.
        """
        load_state(self._stages, self._group, state, "Pipeline.load_state_dict")

    def _resolve_loss_fn(self, loss_fn: LossFn | None, where: str) -> LossFn | None:
        """This call's ``loss_fn``, else the constructor's (None: neither; only the last
        stage's rank needs one, and :meth:`_agree_on_rows` reports its absence to all)."""
        if loss_fn is not None:
            check_loss_fn(loss_fn, where)
            return loss_fn
        return self.loss_fn

    def _agree_on_rows(self, what: str, x: Any, target: Any, no_loss_fn: bool = False
                       ) -> list[int]:
        """Rows per microbatch, checked the same way on every rank (so errors are collective)."""
        x_rows = rows_code(x) if self.holds_first_stage else ABSENT
        t_rows = ABSENT
        if self.holds_last_stage:
            t_rows = NO_LOSS_FN if no_loss_fn else rows_code(target)
        if self._group is not None:
            mine = self._group.backend_for(what).metadata_buffer(
                np.array([[x_rows, t_rows]], dtype=np.int64))
            table = _array.to_host(comm.all_gather(mine, self._group,
                                                   sizes=[1] * self.num_ranks))
            x_rows = int(table[0, 0])
            t_rows = int(table[(self.num_stages - 1) % self.num_ranks, 1])
        m = self.num_microbatches
        check_batch_rows(what, x_rows, t_rows, m, (self.num_stages - 1) % self.num_ranks)
        return comm.split_sizes(x_rows, m)

    def _step_state(self, schedule: Schedule, training: bool, rows: list[int], x: Any,
                    target: Any, loss_fn: LossFn | None) -> StepState:
        m = self.num_microbatches
        return StepState(
            schedule, self._stages, self._ranks, training=training, rows=rows,
            inputs=split_rows(x, m) if self.holds_first_stage else None,
            targets=(split_rows(target, m) if self.holds_last_stage and target is not None
                     else None),
            loss_fn=loss_fn)

    def _execute(self, step: StepState, plan: CommunicationPlan) -> None:
        transport: Transport = (
            InProcessTransport() if self._transport is None else self._transport)
        run_programs(step, plan, self._ranks, transport)
