"""A character-level transformer on Python's own sources: FSDP, pipelines, TP x DP, one loss curve.

    python examples/char_lm.py                       # 4 ranks of the mock world, 8 steps
    mpiexec -n 2 python examples/char_lm.py          # the MPI world
    python examples/char_lm.py --grads jax           # gradients from jax.vjp
    python examples/char_lm.py --steps 300 --plot docs/img/char_lm_loss.png   # the longer run
    python examples/char_lm.py --device gpu --world-size 1   # CuPy arrays on a GPU (NCCL)

The corpus is the standard library's own ``.py`` files (every Python has
them: a fixed, sorted subset of the files next to ``os.py``), read as
printable ASCII (96 symbols). The model is a small GPT: token and position
embeddings, pre-norm blocks of causal multi-head attention and a GELU MLP
with residual connections, a final layer norm and a linear head, softmax
cross-entropy on the next character. Every gradient is written by hand in
NumPy (layer norm, attention, MLP, embedding), in float64; with ``--grads
jax`` each piece's backward comes from ``jax.vjp`` instead (the
tensor-parallel layers stay hand-written), and the curves are the same.

The same model, data and Adam steps are trained four ways: FSDP FULL_SHARD
over every rank; a pipeline with 1F1B and with interleaved 1F1B (8 pieces,
embedding, 6 sub-blocks and head, dealt to the stages: 4 pipeline ranks
when the world size allows, else fewer, data parallel across pipelines,
or 4 stages in one process at world size 1); and tensor x data
parallel on a mesh (``make_mesh``: attention heads split by
:class:`~axondist.tensor_parallel.TensorParallelAttention`, MLPs by
:class:`~axondist.tensor_parallel.TensorParallelMLP`; tp = 2 when the
world size is even). Each strategy's loss at every step must equal the
single-process run's to 1e-9; the script prints the curves, tokens/s and
the time a step takes, and exits with status 1 when one differs.

``--device gpu`` trains on CuPy arrays instead (the single-process reference
too): over NCCL when every rank has a GPU of its own (in one process: one
thread per GPU; under ``mpiexec``: no more ranks per host than GPUs), else
over the MPI backend (under ``mpiexec``) or the in-process world with CuPy
arrays. Without CuPy or a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

# Tiny matrices, several ranks per machine: one BLAS thread per rank is fastest (as torchrun does).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's axondist comes first

import axondist as ad
from axondist import comm
from axondist import tensor_parallel as tp
from axondist.launching.worlds import launched_by_mpi
from axondist.mesh import DeviceMesh, make_mesh
from axondist.optim import Adam
from axondist.pipeline import Pipeline, PipelineStage

VOCAB = 96  # "\n" and the 95 printable ASCII characters; anything else reads as "?"
TOLERANCE = 1e-9  # largest |loss - single-process loss| at any step
GELU = tp.ACTIVATIONS["gelu"]
STRATEGIES = ("fsdp", "pipeline-1f1b", "pipeline-interleaved", "tp-dp")


@dataclass(frozen=True)
class Config:
    """The model's sizes and the training run's settings."""

    context: int = 16
    width: int = 32
    heads: int = 4
    hidden: int = 64
    blocks: int = 3
    batch: int = 24  # sequences per step, over all ranks
    lr: float = 3e-3
    seed: int = 0
    grads: str = "numpy"  # "jax": the pieces' backward from jax.vjp instead of by hand
    device: str = "cpu"  # "gpu": CuPy arrays


def array_module(cfg: Config) -> ModuleType:
    """NumPy, or CuPy for ``--device gpu``."""
    return importlib.import_module("cupy") if cfg.device == "gpu" else np


# --- data -------------------------------------------------------------------------------

def load_corpus(max_chars: int = 300_000) -> np.ndarray:
    """The standard library's sources as token ids: sorted file names, the first ``max_chars``."""
    text = []
    size = 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text.append(f.read())
        size += len(text[-1])
        if size >= max_chars:
            break
    codes = np.frombuffer("".join(text)[:max_chars].encode("ascii", "replace"), dtype=np.uint8)
    ids = np.where(codes == 10, 0, codes.astype(np.int64) - 31)  # "\n" -> 0, " ".."~" -> 1..95
    return np.where((ids >= 0) & (ids < VOCAB), ids, ord("?") - 31)


def batch_at(corpus: np.ndarray, step: int, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: inputs and next-character targets, (batch, context) each."""
    starts = np.random.default_rng([cfg.seed, step]).integers(0, len(corpus) - cfg.context - 1,
                                                               cfg.batch)
    windows = corpus[starts[:, None] + np.arange(cfg.context + 1)]
    xp = array_module(cfg)
    return xp.asarray(windows[:, :-1]), xp.asarray(windows[:, 1:])


# --- the model: 8 pieces, each a forward and a hand-written backward --------------------

def piece_kinds(cfg: Config) -> list[str]:
    return ["embed"] + ["attn", "mlp"] * cfg.blocks + ["head"]


def init_piece(kind: str, cfg: Config, rng: np.random.Generator) -> list[np.ndarray]:
    d, h, v = cfg.width, cfg.hidden, VOCAB

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    ln = [np.ones(d), np.zeros(d)]
    if kind == "embed":
        return [0.1 * rng.standard_normal((v, d)), 0.1 * rng.standard_normal((cfg.context, d))]
    if kind == "attn":
        return ln + [normal(3 * d, d), np.zeros(3 * d), normal(d, d), np.zeros(d)]
    if kind == "mlp":
        return ln + [normal(h, d), np.zeros(h), normal(d, h), np.zeros(d)]
    return ln + [normal(v, d), np.zeros(v)]


def init_model(cfg: Config) -> list[list[np.ndarray]]:
    """Every piece's arrays, the same on every rank (drawn on the host, then on the device)."""
    rng, xp = np.random.default_rng(cfg.seed), array_module(cfg)
    return [[xp.asarray(a) for a in init_piece(kind, cfg, rng)] for kind in piece_kinds(cfg)]


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> tuple:
    mu = x.mean(axis=-1, keepdims=True)
    inv = 1.0 / ad.namespace(x).sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mu) * inv
    return g * xhat + b, (xhat, inv)


def layer_norm_backward(cache: tuple, g: np.ndarray, gy: np.ndarray) -> tuple:
    xhat, inv = cache
    dxhat = gy * g
    dx = inv * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, _sum_rows(gy * xhat), _sum_rows(gy)


def _sum_rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def _outer(gy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The weight gradient ``sum over rows of gy^T x``."""
    return gy.reshape(-1, gy.shape[-1]).T @ x.reshape(-1, x.shape[-1])


def _heads(a: np.ndarray, heads: int) -> np.ndarray:
    return a.reshape(*a.shape[:-1], heads, -1).swapaxes(-2, -3)


def _merge(a: np.ndarray) -> np.ndarray:
    a = a.swapaxes(-2, -3)
    return a.reshape(*a.shape[:-2], -1)


def piece_forward(kind: str, w: list[np.ndarray], x: np.ndarray, cfg: Config) -> tuple:
    """``(y, cache)`` of one piece; the input of ``embed`` is token ids."""
    if cfg.grads == "jax":
        return jax_piece_forward(kind, w, x, cfg)
    if kind == "embed":
        return w[0][x] + w[1][:x.shape[-1]], x
    h, ln = layer_norm(x, w[0], w[1])
    if kind == "attn":
        qkv = h @ w[2].T + w[3]
        q, k, v = (_heads(a, cfg.heads) for a in ad.namespace(qkv).split(qkv, 3, axis=-1))
        o, p = tp.scaled_dot_product_attention(q, k, v, causal=True)
        merged = _merge(o)
        return x + merged @ w[4].T + w[5], (ln, h, q, k, v, p, merged)
    if kind == "mlp":
        a = h @ w[2].T + w[3]
        z = GELU.fn(a)
        return x + z @ w[4].T + w[5], (ln, h, a, z)
    return h @ w[2].T + w[3], (ln, h)  # head: the logits


def piece_backward(kind: str, w: list[np.ndarray], cache: tuple, gy: np.ndarray,
                   cfg: Config) -> tuple[np.ndarray | None, list[np.ndarray]]:
    """``(grad_x, grads)`` of one piece (``grad_x`` None for the embedding)."""
    if cfg.grads == "jax":
        return jax_piece_backward(kind, cache, gy)
    xp = ad.namespace(gy)
    if kind == "embed":
        # each token's rows of gy summed: a one-hot matmul (no scatter-add, whose order on
        # a GPU would vary from run to run)
        hot = cache.reshape(-1)[:, None] == xp.arange(w[0].shape[0])
        grad_tok = hot.T.astype(gy.dtype) @ gy.reshape(-1, gy.shape[-1])
        grad_pos = xp.zeros_like(w[1])
        grad_pos[:gy.shape[-2]] = gy.reshape(-1, *gy.shape[-2:]).sum(axis=0)
        return None, [grad_tok, grad_pos]
    ln, h = cache[0], cache[1]
    if kind == "attn":
        q, k, v, p, merged = cache[2:]
        grads_o = tp.scaled_dot_product_attention_backward(
            q, k, v, p, _heads(gy @ w[4], cfg.heads))
        grad_qkv = xp.concatenate([_merge(g) for g in grads_o], axis=-1)
        rest = [_outer(grad_qkv, h), _sum_rows(grad_qkv), _outer(gy, merged), _sum_rows(gy)]
        grad_h = grad_qkv @ w[2]
    elif kind == "mlp":
        a, z = cache[2:]
        grad_a = (gy @ w[4]) * GELU.grad(a)
        rest = [_outer(grad_a, h), _sum_rows(grad_a), _outer(gy, z), _sum_rows(gy)]
        grad_h = grad_a @ w[2]
    else:
        rest = [_outer(gy, h), _sum_rows(gy)]
        grad_h = gy @ w[2]
    grad_x, grad_g, grad_b = layer_norm_backward(ln, w[0], grad_h)
    if kind != "head":
        grad_x = grad_x + gy  # the residual connection
    return grad_x, [grad_g, grad_b] + rest


# --- the same pieces through JAX: jax.vjp gives each backward -----------------------------

def _jax() -> tuple:
    """``(jax, jax.numpy)`` in float64, imported on first use (only ``--grads jax`` needs them)."""
    try:
        jax = importlib.import_module("jax")
    except ImportError:
        sys.exit("char_lm.py: --grads jax needs JAX (pip install jax)")
    jax.config.update("jax_enable_x64", True)
    return jax, importlib.import_module("jax.numpy")


def _jax_forward(kind: str, cfg: Config, jnp: Any, jax: Any) -> Callable:
    """The piece's forward ``f(x, *w)`` in jax.numpy (the maths of piece_forward)."""
    def norm(x: Any, g: Any, b: Any) -> Any:
        mu = x.mean(axis=-1, keepdims=True)
        return g * (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + 1e-5) + b

    def heads(a: Any) -> Any:
        return jnp.swapaxes(a.reshape(*a.shape[:-1], cfg.heads, -1), -2, -3)

    def attn(x: Any, g: Any, b: Any, wqkv: Any, bqkv: Any, wo: Any, bo: Any) -> Any:
        q, k, v = (heads(a) for a in jnp.split(norm(x, g, b) @ wqkv.T + bqkv, 3, axis=-1))
        t = x.shape[-2]
        s = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)),
                      q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -jnp.inf)
        o = jnp.swapaxes(jax.nn.softmax(s, axis=-1) @ v, -2, -3)
        return x + o.reshape(*o.shape[:-2], -1) @ wo.T + bo

    def mlp(x: Any, g: Any, b: Any, w1: Any, b1: Any, w2: Any, b2: Any) -> Any:
        return x + jax.nn.gelu(norm(x, g, b) @ w1.T + b1, approximate=True) @ w2.T + b2

    def head(x: Any, g: Any, b: Any, w: Any, bias: Any) -> Any:
        return norm(x, g, b) @ w.T + bias

    return {"attn": attn, "mlp": mlp, "head": head}[kind]


@functools.cache
def _jitted(kind: str, cfg: Config) -> tuple[Callable, Callable]:
    """The piece's jitted forward ``f(x, *w)`` and backward ``b(gy, x, *w) -> grads``.

    The backward recomputes the forward inside ``jax.vjp`` (one compiled
    function, nothing kept between the calls but the inputs); its grads are
    the parameters' and, except for the embedding, then the input's.
    """
    jax, jnp = _jax()
    if kind == "embed":
        def forward(x: Any, tok: Any, pos: Any) -> Any:
            return tok[x] + pos[:x.shape[-1]]

        def backward(gy: Any, x: Any, *w: Any) -> Any:
            return jax.vjp(lambda *w: forward(x, *w), *w)[1](gy)
    else:
        forward = _jax_forward(kind, cfg, jnp, jax)

        def backward(gy: Any, x: Any, *w: Any) -> Any:
            grads = jax.vjp(forward, x, *w)[1](gy)
            return (*grads[1:], grads[0])

    return jax.jit(forward), jax.jit(backward)


def jax_piece_forward(kind: str, w: list[np.ndarray], x: np.ndarray, cfg: Config) -> tuple:
    """``(y, cache)`` of one piece computed by JAX; the cache is the piece's inputs."""
    return np.asarray(_jitted(kind, cfg)[0](x, *w)), (kind, cfg, x, w)


def jax_piece_backward(kind: str, cache: tuple, gy: np.ndarray) -> tuple:
    """``(grad_x, grads)`` from ``jax.vjp`` (``grad_x`` None for the embedding)."""
    _, cfg, x, w = cache
    grads = [np.asarray(g) for g in _jitted(kind, cfg)[1](gy, x, *w)]
    return (None, grads) if kind == "embed" else (grads[-1], grads[:-1])


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean next-character loss over every position, and its gradient for the logits."""
    xp = ad.namespace(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    rows, cols = xp.arange(targets.size), targets.reshape(-1)
    picked = p.reshape(-1, p.shape[-1])[rows, cols]
    grad = p.copy()
    grad.reshape(-1, p.shape[-1])[rows, cols] = picked - 1.0  # a view of grad's rows
    return -float(xp.mean(xp.log(picked))), grad / targets.size


def stage_callables(kinds: list[str], cfg: Config) -> tuple[Callable, Callable]:
    """forward and backward of consecutive pieces as one stage (params flattened in order)."""
    counts = [len(init_piece(k, cfg, np.random.default_rng(0))) for k in kinds]
    offsets = np.cumsum([0] + counts).tolist()

    def forward(arrays: list, x: np.ndarray) -> tuple:
        caches = []
        for i, kind in enumerate(kinds):
            x, cache = piece_forward(kind, arrays[offsets[i]:offsets[i + 1]], x, cfg)
            caches.append(cache)
        return x, caches

    def backward(arrays: list, caches: list, gy: np.ndarray) -> tuple:
        grads: list = []
        for i in reversed(range(len(kinds))):
            gy, g = piece_backward(kinds[i], arrays[offsets[i]:offsets[i + 1]], caches[i], gy,
                                   cfg)
            grads = list(g) + grads
        return gy, grads

    return forward, backward


def model_loss_and_grads(cfg: Config) -> Callable:
    """``f(arrays, x, y) -> (loss, grads)`` of the whole model (arrays flattened)."""
    forward, backward = stage_callables(piece_kinds(cfg), cfg)

    def loss_and_grads(arrays: list, x: np.ndarray, y: np.ndarray) -> tuple:
        logits, caches = forward(arrays, x)
        loss, grad = cross_entropy(logits, y)
        return loss, backward(arrays, caches, grad)[1]

    return loss_and_grads


def flat_parameters(pieces: list[list[np.ndarray]]) -> list[ad.Parameter]:
    return [ad.Parameter(a.copy(), f"piece{i}.{j}") for i, arrays in enumerate(pieces)
            for j, a in enumerate(arrays)]


# --- the strategies ---------------------------------------------------------------------

def share(cfg: Config, group: ad.ProcessGroup) -> slice:
    """This data-parallel rank's rows of the global batch (equal shares: means average)."""
    if cfg.batch % group.world_size:
        sys.exit(f"char_lm.py: --batch {cfg.batch} does not split over {group.world_size} "
                 "data-parallel ranks; pass a multiple of it")
    rows = cfg.batch // group.world_size
    return slice(group.rank * rows, (group.rank + 1) * rows)


def run_fsdp(world: ad.World, cfg: Config, corpus: np.ndarray, steps: int) -> tuple:
    params = flat_parameters(init_model(cfg))
    fsdp = ad.FSDP(params, world, sharding_strategy="full_shard")
    opt = Adam(fsdp.sharded_parameters(), lr=cfg.lr)
    mine, grad_fn = share(cfg, world), model_loss_and_grads(cfg)

    def step(s: int) -> float:
        x, y = batch_at(corpus, s, cfg)
        loss = fsdp.step(grad_fn, x[mine], y[mine], optimizer=opt)
        return float(comm.all_reduce_mean(array_module(cfg).asarray([loss]), world)[0])

    return timed(world, step, steps, array_module(cfg)), f"FULL_SHARD over {world.world_size} ranks"


def pipeline_ranks(world_size: int) -> int:
    """Pipeline ranks: the largest of 4, 3, 2 dividing the world size (1 for none)."""
    return next((p for p in (4, 3, 2) if world_size % p == 0), 1)


def run_pipeline(world: ad.World, cfg: Config, corpus: np.ndarray, steps: int,
                 interleaved: bool) -> tuple:
    kinds, pieces = piece_kinds(cfg), init_model(cfg)
    pp = pipeline_ranks(world.world_size)
    distributed = pp > 1
    ranks = pp if distributed else 4  # one process plays 4 pipeline ranks
    chunks = 2 if interleaved else 1
    cuts = np.array_split(np.arange(len(kinds)), ranks * chunks)
    stages = []
    for index, cut in enumerate(cuts):
        forward, backward = stage_callables([kinds[i] for i in cut], cfg)
        params = flat_parameters([pieces[i] for i in cut])
        stages.append(PipelineStage(forward, backward, params, name=f"stage {index}"))
    schedule = "interleaved_1f1b" if interleaved else "1f1b"
    if distributed:
        mesh = DeviceMesh(world, (world.world_size // pp, pp), ("dp", "pp"))
        dp_group, pp_rank = mesh.group("dp"), mesh.group("pp").rank
        local = [stages[c * pp + pp_rank] for c in range(chunks)]
        pipe = Pipeline(local, mesh.group("pp"), num_microbatches=4, schedule=schedule,
                        chunks=chunks)
    else:
        dp_group = world
        pipe = Pipeline.from_stages(stages, num_microbatches=4, schedule=schedule, chunks=chunks)
    ddp = ad.DistributedDataParallel(pipe.parameters(), dp_group)  # across pipeline replicas
    opt = Adam(pipe.parameters(), lr=cfg.lr)
    mine = share(cfg, dp_group)

    def step(s: int) -> float:
        x, y = batch_at(corpus, s, cfg)
        loss = pipe.train_step(x[mine], y[mine], cross_entropy)
        ddp.sync_gradients()
        opt.step()
        opt.zero_grad()
        return float(comm.all_reduce_mean(array_module(cfg).asarray([loss]), dp_group)[0])

    curve = timed(world, step, steps, array_module(cfg))
    pipe.close()
    where = (f"{ranks} ranks x {chunks} chunk(s), dp {dp_group.world_size}" if distributed
             else f"{ranks} ranks x {chunks} chunk(s) in each process, dp {dp_group.world_size}")
    return curve, f"{schedule}: {where}, 4 microbatches"


class TensorParallelModel:
    """The same model with attention heads and MLP features split over a tensor-parallel group.

    Embeddings, layer norms and the head are replicated (their gradients come
    out identical on every rank of the group, as their inputs do).
    """

    def __init__(self, pieces: list[list[np.ndarray]], cfg: Config,
                 group: ad.ProcessGroup) -> None:
        self.cfg, self.kinds = cfg, piece_kinds(cfg)
        self.layers: list = []
        self.replicated: list[list[ad.Parameter]] = []
        for kind, arrays in zip(self.kinds, pieces):
            keep = arrays if kind in ("embed", "head") else arrays[:2]
            self.replicated.append([ad.Parameter(a.copy()) for a in keep])
            if kind == "attn":
                self.layers.append(tp.TensorParallelAttention.from_dense(
                    *arrays[2:], num_heads=cfg.heads, group=group))
            elif kind == "mlp":
                self.layers.append(tp.TensorParallelMLP.from_dense(*arrays[2:], group=group))
            else:
                self.layers.append(None)

    def parameters(self) -> list[ad.Parameter]:
        out = []
        for reps, layer in zip(self.replicated, self.layers):
            out += reps + (layer.parameters() if layer is not None else [])
        return out

    def loss_and_backward(self, x: np.ndarray, y: np.ndarray) -> float:
        """Forward, loss and backward; every parameter's ``.grad`` is set."""
        caches = []
        for kind, reps, layer in zip(self.kinds, self.replicated, self.layers):
            w = [p.data for p in reps]
            if layer is None:
                x, cache = piece_forward(kind, w, x, self.cfg)
            else:
                h, cache = layer_norm(x, w[0], w[1])
                x = x + layer.forward(h)
            caches.append(cache)
        loss, gy = cross_entropy(x, y)
        for kind, reps, layer, cache in reversed(list(zip(self.kinds, self.replicated,
                                                          self.layers, caches))):
            w = [p.data for p in reps]
            if layer is None:
                gy, grads = piece_backward(kind, w, cache, gy, self.cfg)
            else:
                grad_x, grad_g, grad_b = layer_norm_backward(cache, w[0], layer.backward(gy))
                gy, grads = gy + grad_x, [grad_g, grad_b]
            for p, g in zip(reps, grads):
                p.grad = g
        return loss


def run_tp(world: ad.World, cfg: Config, corpus: np.ndarray, steps: int) -> tuple:
    size = 2 if world.world_size % 2 == 0 else world.world_size
    mesh = make_mesh(world, size)
    dp_group = mesh.group("dp")
    model = TensorParallelModel(init_model(cfg), cfg, mesh.group("tp"))
    ddp = ad.DistributedDataParallel(model.parameters(), dp_group)
    opt = Adam(model.parameters(), lr=cfg.lr)
    mine = share(cfg, dp_group)

    def step(s: int) -> float:
        x, y = batch_at(corpus, s, cfg)
        loss = model.loss_and_backward(x[mine], y[mine])
        ddp.sync_gradients()
        opt.step()
        opt.zero_grad()
        return float(comm.all_reduce_mean(array_module(cfg).asarray([loss]), dp_group)[0])

    return timed(world, step, steps, array_module(cfg)), f"tp {size} x dp {dp_group.world_size}"


def timed(world: ad.World, step: Callable[[int], float], steps: int,
          xp: ModuleType) -> tuple[list, float]:
    """The loss curve, and the seconds steps 2.. took on the slowest rank (step 1 warms up)."""
    losses = [step(0)]
    comm.barrier(world)
    start = time.perf_counter()
    losses += [step(s) for s in range(1, steps)]  # each step reads its loss: the GPU is done
    seconds = xp.asarray([time.perf_counter() - start])
    return losses, float(comm.all_reduce_max(seconds, world)[0])


RUNNERS: dict[str, Callable] = {
    "fsdp": run_fsdp,
    "pipeline-1f1b": lambda w, c, d, s: run_pipeline(w, c, d, s, interleaved=False),
    "pipeline-interleaved": lambda w, c, d, s: run_pipeline(w, c, d, s, interleaved=True),
    "tp-dp": run_tp,
}


def train(world: ad.World, cfg: Config, steps: int, strategies: list[str]) -> dict:
    """Every strategy on this rank: ``{name: ((losses, seconds), description)}``."""
    corpus = load_corpus()
    return {name: RUNNERS[name](world, cfg, corpus, steps) for name in strategies}


def train_single_process(cfg: Config, steps: int) -> tuple[list[float], float]:
    """The reference: every step on the whole batch in one process."""
    corpus = load_corpus()
    params = flat_parameters(init_model(cfg))
    opt = Adam(params, lr=cfg.lr)
    grad_fn = model_loss_and_grads(cfg)
    losses = []
    start = time.perf_counter()
    for s in range(steps):
        if s == 1:
            start = time.perf_counter()  # step 1 warms up, as in timed()
        x, y = batch_at(corpus, s, cfg)
        loss, grads = grad_fn([p.data for p in params], x, y)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, time.perf_counter() - start


# --- where the ranks run ----------------------------------------------------------------

def gpus_or_exit(script: str) -> int:
    """How many GPUs CuPy sees, or exit (status 2) saying what is missing."""
    try:
        cupy = importlib.import_module("cupy")
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or CUDA without a driver or a GPU
        count, reason = 0, f"{type(exc).__name__}: {exc}"
    else:
        reason = "CUDA reports no GPU"
    if count < 1:
        print(f"{script}: --device gpu needs CuPy and a CUDA GPU, and this machine has "
              f"none usable ({reason}). Install CuPy from the checkout with pip install "
              "'.[gpu-cuda13]' (CUDA 13) or '.[gpu]' (CUDA 12): the \"CUDA Version\" that "
              "nvidia-smi prints says which; or run with --device cpu.", file=sys.stderr)
        sys.exit(2)
    return count


def run_ranks(device: str, world_size: int, fn: Callable, *args: Any) -> list:
    """``fn(world, *args)`` on every rank; this process's results.

    ``--device cpu``: :func:`axondist.run` (the MPI world under mpiexec, else the
    mock world). ``--device gpu``: NCCL when each rank has a GPU of its own (under
    mpiexec, at most as many ranks per host as GPUs; in one process, one thread per
    GPU), else the MPI backend (under mpiexec) or the mock world, on CuPy arrays.
    """
    if device == "cpu":
        return ad.run(fn, world_size, *args)
    gpus = gpus_or_exit(Path(__file__).name)
    if launched_by_mpi():
        from mpi4py import MPI

        host = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        per_host = host.Get_size()
        host.Free()
        return [fn(ad.init("nccl" if per_host <= gpus else "mpi"), *args)]
    if world_size <= gpus:
        return ad.spawn_on_devices(fn, list(range(world_size)), *args)
    return ad.spawn(fn, world_size, *args)


# --- report -----------------------------------------------------------------------------

def report(results: dict, ref: tuple[list[float], float], cfg: Config, steps: int,
           size: int) -> bool:
    tokens = (steps - 1) * cfg.batch * cfg.context  # timed from step 2
    print(f"char LM: {cfg.blocks} blocks, width {cfg.width}, {cfg.heads} heads, context "
          f"{cfg.context}, batch {cfg.batch}; {steps} steps on {size} ranks")
    print(f"{'strategy':<21} {'first loss':>10} {'last loss':>10} {'max |dloss|':>11} "
          f"{'tokens/s':>9} {'ms/step':>8}  layout")
    ok = True
    print(f"{'1 process':<21} {ref[0][0]:>10.5f} {ref[0][-1]:>10.5f} {'':>11} "
          f"{tokens / ref[1]:>9.0f} {1e3 * ref[1] / (steps - 1):>8.2f}  {cfg.device}")
    for name, ((losses, seconds), layout) in results.items():
        worst = max(abs(a - b) for a, b in zip(losses, ref[0]))
        ok = ok and worst <= TOLERANCE
        print(f"{name:<21} {losses[0]:>10.5f} {losses[-1]:>10.5f} {worst:>11.1e} "
              f"{tokens / seconds:>9.0f} {1e3 * seconds / (steps - 1):>8.2f}  {layout}")
    print("loss curves equal single-process training at every step:", "yes" if ok else "NO")
    return ok


def plot(results: dict, ref: list[float], path: str) -> None:
    """Loss curves (left) and their distance from the single-process curve (right)."""
    try:
        from matplotlib.figure import Figure  # optional: only the plot needs it
    except ImportError:
        sys.exit("char_lm.py: --plot needs matplotlib (pip install matplotlib)")
    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    steps = np.arange(1, len(ref) + 1)
    left.plot(steps, ref, color="black", linewidth=3, alpha=0.3, label="1 process")
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "x")]
    for (name, ((losses, _), _)), (line, marker) in zip(results.items(), styles):
        left.plot(steps, losses, line, label=name)
        diff = np.abs(np.array(losses) - np.array(ref))
        right.semilogy(steps, np.maximum(diff, 1e-18), marker, markersize=3, alpha=0.6,
                       label=name)
    right.axhline(TOLERANCE, color="black", linewidth=1)
    right.text(1, TOLERANCE * 2, f"tolerance {TOLERANCE:g}")
    right.set_ylim(1e-18, 1e-7)
    left.set(xlabel="step", ylabel="training loss (nats/char)", title="char LM on the stdlib")
    right.set(xlabel="step", ylabel="|loss - 1-process loss| (0 drawn at 1e-18)",
              title="distance from the 1-process curve")
    left.legend()
    right.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world size (no MPI)")
    parser.add_argument("--steps", type=int, default=8, help="at least 2")
    parser.add_argument("--batch", type=int, default=Config.batch,
                        help="sequences per step over all ranks")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    parser.add_argument("--grads", choices=["numpy", "jax"], default="numpy",
                        help="each piece's backward: written by hand, or from jax.vjp (the "
                             "tensor-parallel attention and MLP layers are always by hand)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="NumPy arrays, or CuPy arrays on GPUs (NCCL when each rank has "
                             "a GPU of its own)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: pass at least 2 (the first step is not timed)")
    if args.device == "gpu" and args.grads == "jax":
        parser.error("--grads jax computes on the host: use it with --device cpu")
    cfg = Config(batch=args.batch, grads=args.grads, device=args.device)
    if cfg.grads == "jax":
        _jax()  # fail early, on every rank, when JAX is missing

    results = run_ranks(cfg.device, args.world_size, train, cfg, args.steps, args.strategies)[0]
    world = ad.current_world() if launched_by_mpi() else None
    size = world.world_size if world is not None else args.world_size
    ok = True
    if world is None or world.rank == 0:
        ref = train_single_process(cfg, args.steps)
        ok = report(results, ref, cfg, args.steps, size)
        if args.plot:
            plot(results, ref[0], args.plot)
        if not ok:
            print("FAILED: a strategy's loss curve differs from single-process training")
    if world is not None:
        ok = ad.broadcast_object(ok, world)  # every rank exits with rank 0's verdict
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
