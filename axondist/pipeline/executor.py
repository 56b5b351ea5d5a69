"""Executing one step: the state of a train_step/forward and the walker of one rank's program.

:class:`RankRunner` walks ``plan.program[rank]``: a recv stores the message in
the rank's inbox, an action runs the local stage's callable on what it
needs (microbatch input, inbox entry, saved state) and routes its output --
to the inbox when the next stage is on the same rank, else to the outbox,
from where the send that follows it in the program takes it.
:class:`StepState` holds what the ranks of this process share: inputs,
targets, losses, accumulated gradients, the activation meter and timings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from axondist import _array
from axondist.parameter import Parameter
from axondist.pipeline.communication import CommKind, CommOp, CommunicationPlan, Payload
from axondist.pipeline.memory import ActivationMeter, PipelineRunStats
from axondist.pipeline.schedules import Action, ActionKind, Schedule
from axondist.pipeline.simulate import TimedAction
from axondist.pipeline.stage import PipelineStage
from axondist.pipeline.transport import Transport

__all__ = ["LossFn", "RankRunner", "StepState", "run_programs"]

#: ``loss_fn(y, target) -> (loss, grad_y)`` for one microbatch (see Pipeline.train_step).
LossFn = Callable[[Any, Any], tuple[Any, Any]]


class StepState:
    """Data of one train_step/forward on this process: inputs, losses, gradients, meters.

    Args:
        schedule: the schedule that runs (forward-only for inference).
        stages: virtual stage -> the PipelineStage held by this process.
        ranks: the pipeline ranks this process executes.
        training: False for inference (no loss, nothing saved).
        rows: rows of each microbatch.
        inputs: stage 0's microbatch inputs (None where stage 0 is elsewhere).
        targets: the last stage's microbatch targets (None when absent).
        loss_fn: the microbatch loss (None for inference).
    """

    def __init__(self, schedule: Schedule, stages: dict[int, PipelineStage],
                 ranks: tuple[int, ...], *, training: bool, rows: Sequence[int],
                 inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
                 loss_fn: LossFn | None) -> None:
        self.schedule = schedule
        self.stages = stages
        self.ranks = ranks
        self.training = training
        self.rows = list(rows)
        self.total_rows = sum(self.rows)
        self.inputs = inputs
        self.targets = targets
        self.loss_fn = loss_fn
        self.losses: dict[int, float] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, tuple[Parameter, Any]] = {}
        self.meter = ActivationMeter((schedule.rank_of_stage(s), s) for s in stages)
        self.timeline: dict[int, list[TimedAction]] = {r: [] for r in ranks}
        self.busy: dict[int, float] = {r: 0.0 for r in ranks}
        self.t0 = time.perf_counter()
        self.t_end = self.t0

    def record(self, action: Action, start: float, end: float) -> None:
        """Log ``action`` as run from ``start`` to ``end`` (``perf_counter`` times) on its rank."""
        self.timeline[action.rank].append(TimedAction(action, start - self.t0, end - self.t0))
        self.busy[action.rank] += end - start

    def finish(self) -> None:
        """Stop the step's clock (``t_end``) once every program has ended."""
        self.t_end = time.perf_counter()

    def loss_gradient(self, mb: int, y: Any, where: str) -> Any:
        """Run loss_fn on microbatch ``mb``'s output; keep the weighted loss, return the
        weighted grad_y (weight rows_mb / N, see :mod:`axondist.pipeline.runtime`)."""
        assert self.loss_fn is not None
        if y.shape[0] != self.rows[mb]:
            raise ValueError(f"{where}: the last stage's output has {y.shape[0]} rows but the "
                             f"microbatch has {self.rows[mb]}; stages must keep the leading "
                             "(batch) axis")
        target = self.targets[mb] if self.targets is not None else None
        out = self.loss_fn(y, target)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{where}: loss_fn must return a pair (loss, grad_y), got "
                            f"{type(out).__name__}")
        loss = _array.as_array(out[0])
        if loss.size != 1:
            raise ValueError(f"{where}: loss_fn must return a scalar loss, got shape "
                             f"{tuple(loss.shape)}")
        grad_y = _array.as_array(out[1])
        if tuple(grad_y.shape) != tuple(y.shape):
            raise ValueError(f"{where}: loss_fn returned grad_y of shape {tuple(grad_y.shape)} "
                             f"for y of shape {tuple(y.shape)}")
        weight = self.rows[mb] / self.total_rows
        self.losses[mb] = weight * float(_array.to_host(loss).reshape(-1)[0])
        return grad_y * weight

    def total_loss(self) -> float:
        """The batch loss: the row-weighted microbatch losses, summed exactly (``math.fsum``)."""
        return float(math.fsum(self.losses[mb] for mb in sorted(self.losses)))

    def accumulate(self, stage: PipelineStage, grads: list[Any]) -> None:
        """Add one microbatch's gradients for ``stage`` (in ``stage.params`` order) to the sums.

        The first gradient of a parameter is copied in the parameter's dtype;
        later ones are added to that copy in place.
        """
        for prm, g in zip(stage.params, grads):
            entry = self.grads.get(id(prm))
            if entry is None:
                self.grads[id(prm)] = (prm, g.astype(prm.dtype, copy=True))
            else:
                entry[1][...] += g

    def write_grads(self, accumulate: bool = False) -> None:
        """Set each parameter's ``.grad`` to its summed gradient, or add it to ``.grad``.

        With ``accumulate`` False what was there is replaced (``train_step``);
        with True the sum is added to an existing ``.grad`` (``backward``, so
        steps under ``no_sync`` add up). Parameters that got no gradient in
        this step are left alone.
        """
        for prm, acc in self.grads.values():
            prm.grad = acc if not accumulate or prm.grad is None else prm.grad + acc

    def stats(self, expected: Sequence[int]) -> PipelineRunStats:
        """The measurements, with ``expected[rank]`` the predicted peak activations."""
        ranks = self.ranks
        return PipelineRunStats(
            schedule=self.schedule,
            training=self.training,
            ranks=ranks,
            microbatch_rows=tuple(self.rows),
            peak_activations=dict(self.meter.peak_rank),
            peak_activations_per_stage=dict(self.meter.peak_stage),
            expected_peak_activations={r: expected[r] for r in ranks},
            step_time=self.t_end - self.t0,
            busy=dict(self.busy),
            timeline={r: tuple(row) for r, row in self.timeline.items()},
        )


class RankRunner:
    """Executes one pipeline rank's program: recvs, actions on local stages, sends."""

    def __init__(self, step: StepState, rank: int, program: Sequence[Action | CommOp],
                 transport: Transport) -> None:
        self.step = step
        self.rank = rank
        self._program = program
        self._transport = transport
        self._pos = 0
        sched = step.schedule
        self._sched = sched
        self._last_stage = sched.num_stages - 1
        # (payload, microbatch, destination stage) -> array, for messages to/from here
        self._inbox: dict[tuple[Payload, int, int], Any] = {}
        self._outbox: dict[tuple[Payload, int, int], Any] = {}
        self._saved: dict[tuple[int, int], Any] = {}  # (microbatch, stage) -> saved
        self._pending: dict[tuple[int, int], tuple[Any, ...]] = {}  # between I and W

    @property
    def done(self) -> bool:
        """True once every entry of the program has run."""
        return self._pos == len(self._program)

    @property
    def next_entry(self) -> Action | CommOp | None:
        """The entry :meth:`advance` runs next (None when done): where a stalled rank waits."""
        return None if self.done else self._program[self._pos]

    def advance(self) -> bool:
        """Run entries until the program ends or a message has not arrived; True if any ran."""
        moved = False
        while self._pos < len(self._program):
            entry = self._program[self._pos]
            if isinstance(entry, CommOp):
                key = (entry.payload, entry.microbatch, entry.dst_stage)
                if entry.op is CommKind.RECV:
                    if not self._transport.ready(entry):
                        return moved
                    self._inbox[key] = self._transport.recv(entry)
                else:
                    self._transport.send(entry, self._outbox.pop(key))
            else:
                start = time.perf_counter()
                self._run(entry)
                self.step.record(entry, start, time.perf_counter())
            self._pos += 1
            moved = True
        return moved

    def _run(self, a: Action) -> None:
        s = self._sched.stage_of(a)
        mb = a.microbatch
        stage = self.step.stages[s]
        where = f"stage {s} (rank {a.rank}, chunk {a.chunk}), {a.kind.value} of microbatch {mb}"
        if a.kind is ActionKind.F:
            self._forward(stage, s, mb, where)
        elif a.kind is ActionKind.B:
            grad_y = self._inbox.pop((Payload.GRADIENT, mb, s))
            grad_x, grads = stage.run_backward(self._saved.pop((mb, s)), grad_y, where)
            self.step.meter.release(s)
            self.step.accumulate(stage, grads)
            self._pass_input_gradient(s, mb, grad_x, where)
        elif a.kind is ActionKind.I:
            grad_y = self._inbox.pop((Payload.GRADIENT, mb, s))
            saved = self._saved[(mb, s)]  # W still needs it
            if stage.has_split_backward:
                grad_x, extra = stage.run_backward_input(saved, grad_y, where)
                self._pending[(mb, s)] = ("split", grad_y, extra)
            else:  # full backward now; W only accumulates (see PipelineStage)
                grad_x, grads = stage.run_backward(saved, grad_y, where)
                self._pending[(mb, s)] = ("done", grads)
            self._pass_input_gradient(s, mb, grad_x, where)
        else:  # W
            saved = self._saved.pop((mb, s))
            pending = self._pending.pop((mb, s))
            if pending[0] == "split":
                grads = stage.run_backward_weight(saved, pending[1], pending[2], where)
            else:
                grads = pending[1]
            self.step.meter.release(s)
            self.step.accumulate(stage, grads)

    def _forward(self, stage: PipelineStage, s: int, mb: int, where: str) -> None:
        step = self.step
        if s == 0:
            assert step.inputs is not None
            x = step.inputs[mb]
        else:
            x = self._inbox.pop((Payload.ACTIVATION, mb, s))
        y, saved = stage.run_forward(x, where)
        if s == self._last_stage:
            if step.training:
                self._inbox[(Payload.GRADIENT, mb, s)] = step.loss_gradient(mb, y, where)
            else:
                step.outputs[mb] = y
        else:
            self._route(Payload.ACTIVATION, mb, s + 1, y)
        if step.training:
            self._saved[(mb, s)] = saved
            step.meter.hold(s)

    def _pass_input_gradient(self, s: int, mb: int, grad_x: Any, where: str) -> None:
        if s == 0:
            return  # the model input needs no gradient
        if grad_x is None:
            raise ValueError(f"{where}: the backward returned grad_x=None; only stage 0 may "
                             "(every other stage's input gradient goes to the previous stage)")
        self._route(Payload.GRADIENT, mb, s - 1, _array.as_array(grad_x))

    def _route(self, payload: Payload, mb: int, dst_stage: int, x: Any) -> None:
        """Hand ``x`` to stage ``dst_stage``: directly when it is on this rank, else to the
        send that follows the action in the program."""
        key = (payload, mb, dst_stage)
        if self._sched.rank_of_stage(dst_stage) == self.rank:
            self._inbox[key] = x
        else:
            self._outbox[key] = x


def run_programs(step: StepState, plan: CommunicationPlan, ranks: Sequence[int],
                 transport: Transport) -> None:
    """Run the programs of ``ranks`` (this process's) for one step over ``transport``.

    Finishes the transport on success and abandons it on any error.
    """
    runners = [RankRunner(step, r, plan.program[r], transport) for r in ranks]
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
