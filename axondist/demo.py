"""The demo behind ``axondist demo``: a hand-written NumPy MLP learns a seeded synthetic
regression task with one parallel strategy (``ddp``, ``fsdp``, ``pipeline`` or ``tp``), on
threads of a mock world or, under ``mpiexec``/``axondist run``, one rank per process; the same
steps of single-process training on the same global batches give the reference, and the demo
fails when the parameters differ by more than the tolerance (parallelism changes where the maths
runs, not the maths). Rank 0 alone prints the report and the progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TextIO

import numpy as np

from ._environment import default_backend
from .comm import split_sizes
from .data import DistributedSampler
from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel
from .launching.worlds import init, spawn
from .log import all_reduce_scalar
from .optim import SGD
from .parameter import Parameter
from .pipeline import SCHEDULES, Pipeline, PipelineSchedule, PipelineStage
from .process_group import ProcessGroup
from .progress import MODES, Progress, resolve_mode
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

STRATEGIES = ("ddp", "fsdp", "pipeline", "tp")

#: How progress is shown: a bar (tqdm) on a terminal, plain lines elsewhere, or nothing.
PROGRESS_MODES = MODES


# --- configuration -----------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains, and how."""

    strategy: str = "ddp"
    """One of :data:`STRATEGIES`."""
    world_size: int = 4
    """Ranks taking part (the MPI world's size under mpiexec)."""
    steps: int = 40
    """Optimizer steps."""
    batch_size: int = 16
    """Samples per rank and step; the global batch is ``batch_size * world_size``."""
    in_features: int = 8
    """Input width of the MLP."""
    hidden: int = 32
    """Width of every hidden layer."""
    out_features: int = 4
    """Output width (regression targets per sample)."""
    depth: int = 4
    """Linear layers (the pipeline strategy needs at least one per rank)."""
    samples: int = 512
    """Size of the synthetic data set."""
    lr: float = 0.05
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    seed: int = 0
    """Seed of the data, the teacher and the initial weights."""
    dtype: str = "float32"
    """``"float32"`` or ``"float64"``: parameters, data and communication."""
    schedule: str = "1f1b"
    """The pipeline schedule (pipeline strategy only)."""
    tol: float | None = None
    """Largest accepted parameter difference (None: 1e-4 for float32, 1e-10 for float64)."""

    @property
    def tolerance(self) -> float:
        """``tol``, or the default for ``dtype``."""
        if self.tol is not None:
            return self.tol
        return 1e-10 if np.dtype(self.dtype) == np.float64 else 1e-4

    def sizes(self) -> list[int]:
        """Feature widths, input to output: ``depth + 1`` numbers."""
        return [self.in_features] + [self.hidden] * (self.depth - 1) + [self.out_features]

    def describe(self) -> str:
        """One line: the model's shape and size, dtype and optimizer."""
        s = self.sizes()
        n = sum(s[i + 1] * s[i] + s[i + 1] for i in range(self.depth))
        return (f"MLP {'-'.join(map(str, s))} (tanh), {n} parameters, {self.dtype}; "
                f"SGD(lr={self.lr}, momentum={self.momentum})")


# --- the model, written out by hand --------------------------------------------------


def init_weights(cfg: DemoConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """The seeded initial ``(W, b)`` of every layer, ``W`` of shape (out, in): the same on
    every rank and in the reference."""
    rng = np.random.default_rng([cfg.seed, 1])
    sizes = cfg.sizes()
    layers = []
    for fan_in, fan_out in pairwise(sizes):
        bound = 1.0 / np.sqrt(fan_in)
        w = (rng.standard_normal((fan_out, fan_in)) * bound).astype(cfg.dtype)  # LeCun normal
        b = rng.uniform(-bound, bound, fan_out).astype(cfg.dtype)
        layers.append((w, b))
    return layers


def make_data(cfg: DemoConfig) -> tuple[np.ndarray, np.ndarray]:
    """The data set: inputs (samples, in) and targets (samples, out) of a random teacher."""
    rng = np.random.default_rng([cfg.seed, 2])
    x = rng.standard_normal((cfg.samples, cfg.in_features))
    w1 = rng.standard_normal((cfg.in_features, cfg.hidden)) / np.sqrt(cfg.in_features)
    w2 = rng.standard_normal((cfg.hidden, cfg.out_features)) / np.sqrt(cfg.hidden)
    y = np.tanh(x @ w1) @ w2 + 0.05 * rng.standard_normal((cfg.samples, cfg.out_features))
    return x.astype(cfg.dtype), y.astype(cfg.dtype)


def layers_forward(arrays: list[np.ndarray], x: np.ndarray,
                   output: bool) -> tuple[np.ndarray, list[Any]]:
    """Consecutive layers ``h = tanh(h W^T + b)``; ``arrays`` is ``[W0, b0, W1, b1, ...]``.

    With ``output`` the last layer is the model's output layer (no tanh).
    Returns the output and what :func:`layers_backward` needs (each layer's
    input and output): the ``forward`` of a :class:`~axondist.pipeline.PipelineStage`.
    """
    saved = []
    n = len(arrays) // 2
    for i in range(n):
        w, b = arrays[2 * i], arrays[2 * i + 1]
        saved.append(x)
        x = x @ w.T + b
        if i < n - 1 or not output:
            x = np.tanh(x)
        saved.append(x)
    return x, saved + [output]


def layers_backward(arrays: list[np.ndarray], saved: list[Any],
                    grad: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The input gradient and ``[dW0, db0, dW1, db1, ...]`` from the output gradient."""
    output = saved[-1]
    n = len(arrays) // 2
    grads: list[np.ndarray] = [np.empty(0)] * len(arrays)
    for i in reversed(range(n)):
        x, y = saved[2 * i], saved[2 * i + 1]
        if i < n - 1 or not output:
            grad = grad * (1 - y * y)  # tanh' from tanh's output
        w = arrays[2 * i]
        grads[2 * i] = grad.T @ x
        grads[2 * i + 1] = grad.sum(axis=0)
        grad = grad @ w
    return grad, grads


def as_parameters(weights: list[tuple[np.ndarray, np.ndarray]], first: int = 0) -> list[Parameter]:
    """``[W0, b0, W1, b1, ...]`` as named Parameters (copies)."""
    params = []
    for i, (w, b) in enumerate(weights):
        params += [Parameter(w.copy(), f"layer{first + i}.weight"),
                   Parameter(b.copy(), f"layer{first + i}.bias")]
    return params


def mse(y: np.ndarray, target: np.ndarray, count: int) -> tuple[float, np.ndarray]:
    """``0.5 * sum((y - t)^2) / (count * out)`` and its gradient in ``y``.

    ``count`` is the number of samples the loss is a mean over, so the parts
    of a batch (micro-batches, ranks' shares) add up to the batch's mean.
    """
    diff = y - target
    scale = 1.0 / (count * y.shape[-1])
    return float(0.5 * np.sum(diff * diff) * scale), (diff * scale).astype(y.dtype)


def mse_grad_fn(arrays: list[np.ndarray], x: np.ndarray,
                y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """``(loss, grads)`` of the whole MLP on a batch: the ``grad_fn`` DDP and FSDP call."""
    out, saved = layers_forward(arrays, x, output=True)
    loss, grad = mse(out, y, len(x))
    return loss, layers_backward(arrays, saved, grad)[1]


def batch_indices(cfg: DemoConfig, step: int, rank: int, ranks: int) -> np.ndarray:
    """Rank ``rank``'s samples of ``step`` when the batch is shared by ``ranks`` ranks.

    Each rank's :class:`DistributedSampler` walks its share of every epoch's
    shuffle, ``batch_size * world_size / ranks`` samples a step.
    """
    per_rank = cfg.batch_size * cfg.world_size // ranks
    sampler = DistributedSampler(cfg.samples, num_replicas=ranks, rank=rank, seed=cfg.seed)
    per_epoch = len(sampler) // per_rank
    if per_epoch == 0:
        raise ValueError(f"demo: {cfg.samples} samples are too few for a global batch of "
                         f"{per_rank * ranks}")
    epoch, k = divmod(step, per_epoch)
    sampler.set_epoch(epoch)
    return sampler.indices()[k * per_rank:(k + 1) * per_rank]


def global_batch(cfg: DemoConfig, step: int, ranks: int) -> np.ndarray:
    """Every rank's samples of ``step``, concatenated in rank order."""
    return np.concatenate([batch_indices(cfg, step, r, ranks) for r in range(ranks)])


# --- the reference ---------------------------------------------------------------------


@dataclass
class Reference:
    """Single-process training on the full global batches."""

    weights: list[tuple[np.ndarray, np.ndarray]]
    losses: list[float]


def train_reference(cfg: DemoConfig) -> Reference:
    """Plain training: the whole global batch of each step in one process."""
    ranks_sharing_data = data_ranks(cfg.strategy, cfg.world_size)
    x, y = make_data(cfg)
    params = as_parameters(init_weights(cfg))
    opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    losses = []
    for step in range(cfg.steps):
        idx = global_batch(cfg, step, ranks_sharing_data)
        loss, grads = mse_grad_fn([p.data for p in params], x[idx], y[idx])
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        losses.append(loss)
    return Reference([(params[i].data, params[i + 1].data) for i in range(0, len(params), 2)],
                     losses)


# --- progress ------------------------------------------------------------------------


def _no_progress(step: int, loss: float) -> None:
    pass


# --- strategies ------------------------------------------------------------------------


@dataclass
class RankResult:
    """What one rank reports after training."""

    losses: list[float]
    """The global loss of each step (the same on every rank)."""
    max_diff: float
    """Largest |parameter - reference| over every rank (the same on every rank)."""
    details: dict[str, Any] = field(default_factory=dict)


OnStep = Callable[[int, float], None]
StrategyFn = Callable[[ProcessGroup, DemoConfig, Reference, OnStep], RankResult]


def _global_max(value: float, group: ProcessGroup) -> float:
    return all_reduce_scalar(value, "max", group)


def _diff(params: list[np.ndarray], reference: list[np.ndarray]) -> float:
    return max((float(np.max(np.abs(np.asarray(p, np.float64) - r))) if np.size(r) else 0.0)
               for p, r in zip(params, reference))


def _flat_reference(ref: Reference) -> list[np.ndarray]:
    return [a.astype(np.float64) for wb in ref.weights for a in wb]


def run_tp(group: ProcessGroup, cfg: DemoConfig, ref: Reference, progress: OnStep) -> RankResult:
    """Every linear layer split across the group; every rank sees the whole batch."""
    x, y = make_data(cfg)
    layers: list[Any] = []
    for i, (w, b) in enumerate(init_weights(cfg)):
        if i % 2 == 0:  # column-parallel: output features split; gathered only at the end
            layers.append(ColumnParallelLinear.from_dense(
                w, b, group, gather_output=(i == cfg.depth - 1)))
        else:  # row-parallel: consumes the column layer's split output, returns the full sum
            layers.append(RowParallelLinear.from_dense(w, b, group, input_is_parallel=True))
    params = [p for layer in layers for p in layer.parameters()]
    opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    losses = []
    for step in range(cfg.steps):
        idx = global_batch(cfg, step, 1)
        opt.zero_grad()
        h, outs = x[idx], []
        for i, layer in enumerate(layers):
            h = layer.forward(h)
            if i < cfg.depth - 1:
                h = np.tanh(h)  # element-wise: works on a split activation as on a full one
            outs.append(h)
        loss, grad = mse(h, y[idx], len(idx))
        for i in reversed(range(cfg.depth)):
            if i < cfg.depth - 1:
                grad = grad * (1 - outs[i] * outs[i])
            grad = layers[i].backward(grad)
        opt.step()
        losses.append(loss)  # the output is full and replicated: every rank has the loss
        progress(step + 1, loss)
    full = [a for layer in layers for a in layer.full_weights()]
    diff = _global_max(_diff(full, _flat_reference(ref)), group)
    return RankResult(losses, diff, {"layers": [repr(layer) for layer in layers]})


def _data_parallel_loss(loss: float, group: ProcessGroup) -> float:
    """The global batch's loss from each rank's loss over its share (a mean of means)."""
    return all_reduce_scalar(loss, "mean", group)


def run_ddp(group: ProcessGroup, cfg: DemoConfig, ref: Reference,
            progress: OnStep) -> RankResult:
    """Every rank holds the model and trains on its share; DDP averages the gradients."""
    x, y = make_data(cfg)
    params = as_parameters(init_weights(cfg))
    ddp = DistributedDataParallel(params, group, grad_fn=mse_grad_fn)
    opt = SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    losses = []
    for step in range(cfg.steps):
        idx = batch_indices(cfg, step, group.rank, group.world_size)
        opt.zero_grad(set_to_none=False)  # keep .grad as views into DDP's buckets
        local = ddp.backward(x[idx], y[idx])  # this rank's loss; the gradients are averaged
        opt.step()
        losses.append(_data_parallel_loss(local, group))
        progress(step + 1, losses[-1])
    diff = _global_max(_diff([p.data for p in params], _flat_reference(ref)), group)
    return RankResult(losses, diff, {"wrapper": repr(ddp)})


def run_fsdp(group: ProcessGroup, cfg: DemoConfig, ref: Reference,
             progress: OnStep) -> RankResult:
    """As ddp, with parameters, gradients and optimizer state sharded (one unit per layer)."""
    x, y = make_data(cfg)
    params = as_parameters(init_weights(cfg))
    units = [[2 * i, 2 * i + 1] for i in range(cfg.depth)]
    fsdp = FullyShardedDataParallel(params, group, units=units)
    opt = SGD(fsdp.sharded_parameters(), lr=cfg.lr, momentum=cfg.momentum)
    losses = []
    for step in range(cfg.steps):
        idx = batch_indices(cfg, step, group.rank, group.world_size)
        local = fsdp.step(mse_grad_fn, x[idx], y[idx], optimizer=opt)
        losses.append(_data_parallel_loss(local, group))
        progress(step + 1, losses[-1])
    fsdp.gather_parameters()
    full = [p.data for p in fsdp.full_parameters()]
    diff = _global_max(_diff(full, _flat_reference(ref)), group)
    shard = sum(p.size for p in fsdp.sharded_parameters())
    return RankResult(losses, diff, {"wrapper": f"{shard} of {sum(a.size for a in full)} "
                                                "parameters held per rank"})


def stage_layers(depth: int, stages: int) -> list[range]:
    """The layers of each pipeline stage (numpy.array_split rule)."""
    bounds = np.cumsum([0] + split_sizes(depth, stages))
    return [range(int(a), int(b)) for a, b in pairwise(bounds)]


def run_pipeline(group: ProcessGroup, cfg: DemoConfig, ref: Reference,
                 progress: OnStep) -> RankResult:
    """One stage (consecutive layers) per rank; the batch flows through as micro-batches."""
    x, y = make_data(cfg)
    chunks = pipeline_chunks(cfg.schedule)
    stages_total = group.world_size * chunks
    layout = stage_layers(cfg.depth, stages_total)
    weights = init_weights(cfg)
    mine = []
    for c in range(chunks):  # this rank holds virtual stages rank, rank + p, ...
        s = c * group.world_size + group.rank
        params = as_parameters([weights[i] for i in layout[s]], first=layout[s][0])
        last = s == stages_total - 1

        def forward(arrays: list[np.ndarray], h: np.ndarray, last: bool = last) -> Any:
            return layers_forward(arrays, h, output=last)

        mine.append((s, PipelineStage(forward, layers_backward, params,
                                               name=f"layers {layout[s][0]}..{layout[s][-1]}")))
    pipe = Pipeline([st for _, st in mine], group, num_microbatches=2 * group.world_size,
                             schedule=cfg.schedule, chunks=chunks)
    opt = SGD(pipe.parameters(), lr=cfg.lr, momentum=cfg.momentum)

    def loss_fn(out: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
        return mse(out, target, len(out))  # the mean over the micro-batch's rows

    losses = []
    try:
        for step in range(cfg.steps):
            idx = global_batch(cfg, step, 1)
            opt.zero_grad()
            loss = pipe.train_step(x[idx] if pipe.holds_first_stage else None,
                                   y[idx] if pipe.holds_last_stage else None, loss_fn)
            opt.step()
            losses.append(loss)
            progress(step + 1, loss)
    finally:
        pipe.close()
    reference = _flat_reference(ref)
    diffs = [_diff([p.data for p in st.params],
                   reference[2 * layout[s][0]:2 * (layout[s][-1] + 1)]) for s, st in mine]
    diff = _global_max(max(diffs), group)
    return RankResult(losses, diff, {"schedule": pipe.schedule_text()})


def pipeline_chunks(schedule: str) -> int:
    """Stages per rank a schedule runs in the demo (2 for the interleaved ones)."""
    return 2 if SCHEDULES[PipelineSchedule.parse(schedule, "demo: schedule")].interleaved else 1


STRATEGY_FNS: dict[str, StrategyFn] = {"ddp": run_ddp, "fsdp": run_fsdp,
                                       "pipeline": run_pipeline, "tp": run_tp}


def data_ranks(strategy: str, world_size: int) -> int:
    """How many ranks share each global batch (the others see all of it)."""
    return world_size if strategy in ("ddp", "fsdp") else 1


def check_config(cfg: DemoConfig) -> None:
    """Refuse settings the chosen strategy cannot run with, saying what to change."""
    world_size = cfg.world_size
    if world_size < 1:
        raise ValueError(f"demo: world_size must be >= 1, got {world_size}")
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ValueError(f"demo: --steps ({cfg.steps}) and --batch-size ({cfg.batch_size}) must "
                         "be >= 1")
    if cfg.depth < 1:
        raise ValueError(f"demo: depth must be >= 1, got {cfg.depth}")
    if cfg.strategy == "pipeline":
        stages = world_size * pipeline_chunks(cfg.schedule)
        if cfg.depth < stages:
            raise ValueError(f"demo: the pipeline needs a layer per stage: {cfg.depth} layers "
                             f"for {stages} stages")
    if cfg.strategy == "tp" and world_size > cfg.hidden:
        raise ValueError(f"demo: {world_size} ranks cannot split {cfg.hidden} hidden features; "
                         "use fewer ranks")
    if cfg.batch_size * world_size > cfg.samples:
        raise ValueError(f"demo: a global batch of {cfg.batch_size * world_size} exceeds the "
                         f"{cfg.samples} samples; lower --batch-size")


# --- running ---------------------------------------------------------------------------


def report(cfg: DemoConfig, result: RankResult, ref: Reference, where: str, seconds: float,
           out: TextIO) -> bool:
    """Print the loss curve and the check; True when the check passed."""
    n = len(result.losses)
    marks = sorted({1, *(max(1, round(n * k / 4)) for k in (1, 2, 3)), n})
    print("step   loss (distributed)   loss (single process)", file=out)
    for s in marks:
        print(f"{s:4d}   {result.losses[s - 1]:18.6f}   {ref.losses[s - 1]:21.6f}", file=out)
    if "schedule" in result.details:
        print(f"pipeline schedule ({cfg.schedule}, one step; F/B: forward/backward of a "
              f"micro-batch, I/W: a backward's input/weight halves, '.': idle):", file=out)
        grid = result.details["schedule"].splitlines()
        if max(len(line) for line in grid) > 160:  # too wide for a terminal: the summary only
            grid = grid[-1:]
        print("\n".join(grid), file=out)
    if "wrapper" in result.details:
        print(f"rank 0: {result.details['wrapper']}", file=out)
    ok = bool(result.max_diff <= cfg.tolerance)
    print(f"trained {n} steps on {where} in {seconds:.2f} s", file=out)
    print(f"check against single-process training on the full batch: max abs parameter "
          f"difference {result.max_diff:.3g} (tolerance {cfg.tolerance:.0e}): "
          f"{'OK' if ok else 'FAILED'}", file=out)
    return ok


#: The demo's backends; those of a launched job, by what the report calls their world.
_BACKENDS = ("auto", "mock", "mpi", "torch")
_LAUNCHED = {"mpi": "an MPI", "torch": "a torch.distributed"}


def run_demo(world_size: int = 4, strategy: str = "ddp", steps: int = 40, *,
             backend: str = "auto", progress: bool | str | None = None,
             out: TextIO | None = None, **options: Any) -> int:
    """Run the demo and return the process exit status.

    Args:
        world_size: ranks of the mock world (ignored under mpiexec or torchrun: the launch
            decides).
        strategy: one of :data:`STRATEGIES`.
        steps: optimizer steps.
        backend: ``"mock"`` (threads), ``"mpi"`` (this process is one rank of an
            ``mpiexec`` launch), ``"torch"`` (one rank of a ``torchrun`` launch) or
            ``"auto"`` (what :func:`axondist.init` would pick: mpi under mpiexec, torch
            under torchrun, else the mock world).
        progress: one of :data:`PROGRESS_MODES` (True: ``"auto"``, False: ``"off"``):
            how rank 0 shows progress on ``out``; ``"auto"`` (the default) draws a bar on a
            terminal and prints a plain line every tenth of the run elsewhere (a log, a
            pipe, mpiexec's forwarding). The other ranks stay quiet.
        out: where the progress and then the report go (stdout when None); one stream for
            both, since mpiexec forwards stdout and stderr through separate pipes and a bar
            on one could end after the report's first line on the other.
        **options: other :class:`DemoConfig` fields (``batch_size``, ``lr``, ...).

    Returns:
        0 when the check passed, 1 when the parameters differ by more than the
        tolerance.

    Raises:
        ValueError: an unknown strategy, backend or progress mode, or settings the
            strategy cannot run with (the message says what to change).
    """
    out = out or sys.stdout
    if strategy not in STRATEGIES:
        raise ValueError(f"demo: unknown strategy {strategy!r}; choose one of "
                         f"{', '.join(STRATEGIES)}")
    if backend not in _BACKENDS:
        raise ValueError(f"demo: backend must be one of {', '.join(_BACKENDS)}, got {backend!r}")
    mode = resolve_mode(progress, out, "demo")
    name = default_backend() if backend == "auto" else backend
    world = init(name) if name in _LAUNCHED else None
    if world is not None:
        world_size = world.world_size
    speaks = world is None or world.rank == 0
    if strategy == "pipeline" and "depth" not in options:  # a layer per stage at least
        stages = world_size * pipeline_chunks(options.get("schedule", DemoConfig.schedule))
        options["depth"] = max(DemoConfig.depth, stages)
    cfg = DemoConfig(strategy=strategy, world_size=world_size, steps=steps, **options)
    check_config(cfg)
    where = (f"{_LAUNCHED[name]} world of {world_size} processes" if world is not None
             else f"a mock world of {world_size} ranks (threads)")
    if speaks:
        print(f"axondist demo: {strategy} on {where}", file=out)
        print(f"model: {cfg.describe()}; data: {cfg.samples} samples, global batch "
              f"{cfg.batch_size * world_size}", file=out)
        out.flush()
    ref = train_reference(cfg)  # every MPI rank makes its own: cheaper than sending it
    bar: Progress[int] = Progress(cfg.steps, stream=out, mode=mode, show=speaks)

    def shown(step: int, loss: float) -> None:
        bar.update(step, loss=loss)

    run = STRATEGY_FNS[strategy]
    start = time.perf_counter()
    if world is None:
        results = spawn(lambda w: run(w, cfg, ref, shown if w.rank == 0 else _no_progress),
                        world_size)
        result = results[0]
    else:
        result = run(world, cfg, ref, shown if speaks else _no_progress)
    seconds = time.perf_counter() - start
    bar.close()
    if not speaks:
        return 0 if result.max_diff <= cfg.tolerance else 1
    return 0 if report(cfg, result, ref, where, seconds, out) else 1


__all__ = ["PROGRESS_MODES", "STRATEGIES", "DemoConfig", "run_demo"]
