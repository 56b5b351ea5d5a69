"""One training script for every data-parallel strategy: switching strategy is one line.

    python examples/one_script.py --strategy ddp                 # 4 ranks on threads
    python examples/one_script.py --strategy fsdp --world-size 3
    python examples/one_script.py --strategy hybrid --ranks-per-node 2
    python examples/one_script.py --strategy pipeline --world-size 2
    mpiexec -n 2 python examples/one_script.py --strategy zero1  # the MPI world
    axondist run -n 3 examples/one_script.py --strategy ddp fsdp zero1 hybrid

An MLP (64 -> 32 -> 10, ReLU, softmax cross-entropy) with hand-written NumPy
gradients classifies the 8x8 digits of scikit-learn's ``load_digits`` (a
seeded synthetic set of the same shape when scikit-learn is missing:
``pip install '.[examples]'`` in a checkout). The training loop is the same for
every strategy: ``model.backward(x, y)``, ``model.clip_grad_norm(...)``,
``opt.step()``; the result is ``model.state_dict()`` (the whole model on
every rank, under every strategy), which the evaluation reads. Only
:data:`WRAPPERS` (and the optimizer for ``zero1``, the batch for
``pipeline``) says which strategy runs:

* ``ddp``: every rank holds the model; gradients are averaged.
* ``fsdp``: parameters, gradients and optimizer state sharded (FULL_SHARD).
* ``zero1``: DDP with a ZeroRedundancyOptimizer (optimizer state sharded).
* ``hybrid``: FSDP's HYBRID_SHARD, sharded within a node, replicated across.
* ``pipeline``: the MLP's four operations (one per parameter) split in
  order over at most 4 ranks, 1F1B over 4 micro-batches; not data
  parallel, so every rank reads the whole global batch.

Every rank starts from different random weights on purpose: each wrapper
starts from rank 0's. The global batch (48 rows) is split evenly over the
ranks, so every strategy and world size takes the same steps, and the script
checks its final parameters against the same training in one process (exit
status 1 when they differ by more than the tolerance).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist.data import DistributedSampler
from axondist.ddp import DDP
from axondist.fsdp import FSDP
from axondist.optim import SGD
from axondist.pipeline import Pipeline, PipelineStage
from axondist.zero import ZeroRedundancyOptimizer

IN, HIDDEN, CLASSES = 64, 32, 10
GLOBAL_BATCH = 48  # divisible by 1, 2, 3, 4, 6, 8, 12, 16 ranks
LR, MOMENTUM, MAX_NORM = 0.1, 0.9, 2.0
SEED = 7
TOLERANCE = 1e-4

#: The one line that changes with the strategy: the wrapper around the parameters.
WRAPPERS: dict[str, Callable[..., Any]] = {
    "ddp": lambda params, group, rpn: DDP(params, group, grad_fn=grad_fn),
    "fsdp": lambda params, group, rpn: FSDP(params, group, grad_fn=grad_fn),
    "zero1": lambda params, group, rpn: DDP(params, group, grad_fn=grad_fn),
    "hybrid": lambda params, group, rpn: FSDP(params, group, grad_fn=grad_fn,
                                              sharding_strategy="hybrid_shard",
                                              ranks_per_node=rpn),
    "pipeline": lambda params, group, rpn: pipeline(params, group),
}


def make_optimizer(strategy: str, params: list[ad.Parameter]) -> Any:
    """SGD with momentum over the wrapper's parameters; zero1 shards its state over the ranks."""
    if strategy == "zero1":
        return ZeroRedundancyOptimizer(params, SGD, lr=LR, momentum=MOMENTUM)
    return SGD(params, lr=LR, momentum=MOMENTUM)


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """Digits as (1797, 64) float32 in [0, 1] and labels 0..9 (synthetic without sklearn)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        rng = np.random.default_rng(0)
        labels = rng.integers(0, CLASSES, 1797)
        centers = rng.random((CLASSES, IN))
        x = np.clip(centers[labels] + 0.2 * rng.standard_normal((1797, IN)), 0, 1)
        return x.astype(np.float32), labels
    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def init_params(seed: int) -> list[ad.Parameter]:
    """fc1 (hidden, in), its bias, fc2 (classes, hidden), its bias: He-initialised."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((HIDDEN, IN)) * np.sqrt(2 / IN)
    w2 = rng.standard_normal((CLASSES, HIDDEN)) * np.sqrt(2 / HIDDEN)
    arrays = [w1, np.zeros(HIDDEN), w2, np.zeros(CLASSES)]
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    return [ad.Parameter(a.astype(np.float32), n) for a, n in zip(arrays, names)]


def grad_fn(params: list[np.ndarray], x: np.ndarray, labels: np.ndarray
            ) -> tuple[float, list[np.ndarray]]:
    """Forward and backward of the MLP on one batch, by hand: (mean loss, gradients)."""
    w1, b1, w2, b2 = params
    h = x @ w1.T + b1
    a = np.maximum(h, 0)
    logits = a @ w2.T + b2
    logits -= logits.max(axis=1, keepdims=True)  # a stable softmax
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    loss = -float(np.mean(np.log(p[np.arange(n), labels])))
    dlogits = p
    dlogits[np.arange(n), labels] -= 1
    dlogits /= n
    dh = (dlogits @ w2) * (h > 0)
    return loss, [dh.T @ x, dh.sum(axis=0), dlogits.T @ a, dlogits.sum(axis=0)]


# --- the same MLP as pipeline stages: one operation per parameter, split over the ranks ------

def matmul_forward(arrays: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, Any]:
    return x @ arrays[0].T, x


def matmul_backward(arrays: list[np.ndarray], x: np.ndarray, grad: np.ndarray) -> Any:
    return grad @ arrays[0], [grad.T @ x]


def bias_relu_forward(arrays: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, Any]:
    h = x + arrays[0]
    return np.maximum(h, 0), h


def bias_relu_backward(arrays: list[np.ndarray], h: np.ndarray, grad: np.ndarray) -> Any:
    dh = grad * (h > 0)
    return dh, [dh.sum(axis=0)]


def bias_forward(arrays: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, Any]:
    return x + arrays[0], None


def bias_backward(arrays: list[np.ndarray], _: Any, grad: np.ndarray) -> Any:
    return grad, [grad.sum(axis=0)]


#: (forward, backward) of the operation using parameter i: fc1.weight, fc1.bias + ReLU, ...
OPERATIONS = [(matmul_forward, matmul_backward), (bias_relu_forward, bias_relu_backward),
              (matmul_forward, matmul_backward), (bias_forward, bias_backward)]


def operations_stage(ops: list[int], params: list[ad.Parameter]) -> PipelineStage:
    """A stage running ``OPERATIONS[i]`` for each ``i`` in ``ops``, in order."""

    def forward(arrays: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, Any]:
        saved = []
        for k, i in enumerate(ops):
            x, kept = OPERATIONS[i][0](arrays[k:k + 1], x)
            saved.append(kept)
        return x, saved

    def backward(arrays: list[np.ndarray], saved: Any, grad: np.ndarray) -> Any:
        grads: list[np.ndarray] = []
        for k in reversed(range(len(ops))):
            grad, one = OPERATIONS[ops[k]][1](arrays[k:k + 1], saved[k], grad)
            grads = one + grads
        return grad, grads

    return PipelineStage(forward, backward, [params[i] for i in ops])


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """The pipeline's loss_fn: mean softmax cross-entropy and its gradient (grad_fn's last part)."""
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(logits)
    loss = -float(np.mean(np.log(p[np.arange(n), labels])))
    p[np.arange(n), labels] -= 1
    return loss, p / n


def pipeline(params: list[ad.Parameter], group: ad.World) -> Pipeline:
    """The four operations split in order over the ranks (at most 4), from rank 0's weights."""
    ranks = group.world_size
    if ranks > len(OPERATIONS):
        raise ValueError(f"one_script: the pipeline splits the MLP's {len(OPERATIONS)} "
                         f"operations over the ranks; use at most {len(OPERATIONS)} ranks, "
                         f"not {ranks}")
    for p in params:  # every rank starts from rank 0's values, as the other wrappers do
        ad.broadcast(p.data, group, src=0)
    ops = [i for i in range(len(OPERATIONS)) if i * ranks // len(OPERATIONS) == group.rank]
    return Pipeline(operations_stage(ops, params), group, num_microbatches=4,
                    loss_fn=cross_entropy)


def accuracy(params: list[np.ndarray], x: np.ndarray, labels: np.ndarray) -> float:
    w1, b1, w2, b2 = params
    logits = np.maximum(x @ w1.T + b1, 0) @ w2.T + b2
    return float(np.mean(logits.argmax(axis=1) == labels))


def batches(sampler: DistributedSampler, steps: int) -> list[np.ndarray]:
    """This rank's rows for each step: GLOBAL_BATCH / ranks of them, epoch after epoch."""
    per_rank = GLOBAL_BATCH // sampler.num_replicas
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        idx = sampler.indices()
        out += [idx[k * per_rank:(k + 1) * per_rank] for k in range(len(idx) // per_rank)]
        epoch += 1
    return out[:steps]


def train(world: ad.World, strategy: str, steps: int, ranks_per_node: int | None
          ) -> dict[str, Any]:
    """One rank's training under ``strategy``; the loop below is the same for every one."""
    if GLOBAL_BATCH % world.world_size:
        raise ValueError(f"one_script: the global batch of {GLOBAL_BATCH} rows does not split "
                         f"over {world.world_size} ranks; use a world size dividing it")
    x, labels = load_data()
    params = init_params(SEED + world.rank)  # rank-dependent: the wrapper takes rank 0's
    model = WRAPPERS[strategy](params, world, ranks_per_node)
    opt = make_optimizer(strategy, model.parameters())
    # A pipeline's ranks hold layers of one model, not replicas: each reads the whole batch.
    split = {"num_replicas": 1, "rank": 0} if strategy == "pipeline" else {"group": world}
    sampler = DistributedSampler(len(x), **split, seed=SEED, drop_last=True)
    losses = []
    for rows in batches(sampler, steps):
        loss = model.backward(x[rows], labels[rows])  # gradients averaged over the ranks
        model.clip_grad_norm(MAX_NORM)                # the global norm, on every strategy
        opt.step()
        opt.zero_grad()
        losses.append(ad.all_reduce_scalar(loss, "mean", world))
    state = model.state_dict()                        # the whole model, on every rank
    acc = accuracy([state[p.name or ""] for p in params], x, labels)
    return {"state": state, "losses": losses, "accuracy": acc}


def train_single_process(steps: int) -> dict[str, np.ndarray]:
    """The same steps in one process on the whole global batch, from rank 0's weights."""
    x, labels = load_data()
    params = init_params(SEED)
    opt = SGD(params, lr=LR, momentum=MOMENTUM)
    for rows in batches(DistributedSampler(len(x), 1, 0, seed=SEED, drop_last=True), steps):
        _, grads = grad_fn([p.data for p in params], x[rows], labels[rows])
        norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)))
        coef = MAX_NORM / (norm + 1e-6)
        for p, g in zip(params, grads):
            p.grad = g * coef if coef < 1 else g
        opt.step()
    return {p.name or "": p.data for p in params}


def max_difference(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(state[k] - reference[k]))) for k in reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", nargs="+", choices=sorted(WRAPPERS), default=["ddp"],
                        help="one or more strategies, each trained in turn")
    parser.add_argument("--world-size", type=int, default=4,
                        help="ranks on threads (ignored under mpiexec / axondist run)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="hybrid: shard over blocks of this many ranks (default: real nodes)")
    parser.add_argument("--save", metavar="NPZ", help="rank 0 writes each strategy's final "
                        "parameters here, as STRATEGY/NAME arrays")
    args = parser.parse_args(argv)

    reference = train_single_process(args.steps)
    failed, saved = False, {}
    for strategy in args.strategy:
        results = ad.run(train, args.world_size, strategy, args.steps, args.ranks_per_node)
        diff = max(max_difference(r["state"], reference) for r in results)
        failed |= diff > TOLERANCE
        first = results[0]
        ad.print0(f"{strategy:>6}: {len(first['losses'])} steps, loss {first['losses'][0]:.4f} "
                  f"-> {first['losses'][-1]:.4f}, accuracy {first['accuracy']:.1%}, "
                  f"max |param - single process| = {diff:.2e} "
                  f"({'OK' if diff <= TOLERANCE else 'FAILED'})")
        saved.update({f"{strategy}/{k}": v for k, v in first["state"].items()})
    if args.save and ad.rank() == 0:
        np.savez(args.save, **saved)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
