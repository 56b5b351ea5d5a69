"""The toy model the pipeline tests run: affine + tanh stages in float64.

Backward passes are hand-written, both whole and split into input and weight
halves (for the zero-bubble schedule). :func:`sequential` is the reference:
the same layers one after the other on the whole batch, and
:func:`train_sequential` trains with it.
"""

from __future__ import annotations

import numpy as np

import axondist as ad
from axondist.optim import SGD, Adam
from axondist.pipeline import PipelineStage


def layer_params(seed: int, stage: int, d_in: int, d_out: int) -> list[ad.Parameter]:
    rng = np.random.default_rng([seed, stage])
    return [ad.Parameter(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), f"W{stage}"),
            ad.Parameter(0.1 * rng.standard_normal(d_out), f"b{stage}")]


def fwd(params, x):
    W, b = params
    y = np.tanh(x @ W + b)
    return y, (x, y)


def bwd(params, saved, gy):
    W, _ = params
    x, y = saved
    gz = gy * (1.0 - y * y)
    return gz @ W.T, [x.T @ gz, gz.sum(axis=0)]


def bwd_input(params, saved, gy):
    W, _ = params
    _, y = saved
    gz = gy * (1.0 - y * y)
    return gz @ W.T, gz


def bwd_weight(params, saved, gy, gz):
    x, _ = saved
    return [x.T @ gz, gz.sum(axis=0)]


def make_stages(seed: int, dims: list[int], split: str = "full") -> list[PipelineStage]:
    """``split``: "full" (backward only), "halves" (I/W only) or "both"."""
    kw = ({"backward_input": bwd_input, "backward_weight": bwd_weight}
          if split in ("halves", "both") else {})
    return [PipelineStage(fwd, None if split == "halves" else bwd,
                          layer_params(seed, s, dims[s], dims[s + 1]), **kw)
            for s in range(len(dims) - 1)]


def mse(y, t):
    """Mean over rows of 0.5 * ||y - t||^2, and its gradient."""
    d = y - t
    return 0.5 * float(np.sum(d * d)) / y.shape[0], d / y.shape[0]


def sequential(stages: list[PipelineStage], x, t):
    """Loss, parameter gradients and output of the full batch, stage after stage."""
    saved, h = [], x
    for stage in stages:
        h, sv = fwd(stage.param_arrays(), h)
        saved.append(sv)
    loss, g = mse(h, t)
    grads = [None] * len(stages)
    for s in reversed(range(len(stages))):
        g, grads[s] = bwd(stages[s].param_arrays(), saved[s], g)
    return loss, grads, h


def data(seed: int, rows: int, d_in: int, d_out: int):
    rng = np.random.default_rng([seed, 999])
    return rng.standard_normal((rows, d_in)), rng.standard_normal((rows, d_out))


def make_optimizer(kind: str, params):
    """SGD with momentum or Adam (the two optimizers the one-loop tests use)."""
    return SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.02)


def state_of(stages: list[PipelineStage]) -> dict:
    """``{name: copy}`` of every stage's parameters in model order."""
    return {p.name: p.data.copy() for s in stages for p in s.params}


def train_sequential(stages: list[PipelineStage], steps, max_norm, opt_kind: str):
    """Train ``stages`` in one process; each step is a list of (x, t) batches whose gradients
    are summed (accumulation), clipped to ``max_norm`` (None: not) by the global 2-norm.

    Returns each step's last batch loss and pre-clipping norm.
    """
    params = [p for s in stages for p in s.params]
    opt = make_optimizer(opt_kind, params)
    losses, norms = [], []
    for batches in steps:
        total = None
        for x, t in batches:
            loss, grads, _ = sequential(stages, x, t)
            flat = [g for gs in grads for g in gs]
            total = flat if total is None else [a + b for a, b in zip(total, flat)]
        norm = float(np.sqrt(sum(float(np.sum(g * g)) for g in total)))
        coef = 1.0 if max_norm is None else min(max_norm / (norm + 1e-6), 1.0)
        for p, g in zip(params, total):
            p.grad = g * coef
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        norms.append(norm)
    return losses, norms
