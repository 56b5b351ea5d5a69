"""Data-parallel training of a NumPy MLP with hand-written gradients, checked against one process.

    python examples/numpy_mlp.py                      # 4 ranks of the in-process mock world
    python examples/numpy_mlp.py --world-size 3 --epochs 5
    axondist run -n 2 examples/numpy_mlp.py           # 2 processes (or mpiexec -n 2 python ...)

A two-layer ReLU network classifies points from three Gaussian blobs
(softmax cross-entropy). Every rank holds the whole model; a
DistributedSampler gives each rank its share of every epoch, and
DistributedDataParallel averages the gradients. The gradient function is a
generator that hands over each gradient as soon as backward has computed it
(last layer first), so with ``strategy="overlapped"`` a bucket's all-reduce
runs while the remaining gradients are still being computed.

At the end the example trains the same model in one process on the same
global batches and prints the largest parameter difference (exit status 1
if it exceeds the tolerance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist.data import DistributedSampler
from axondist.ddp import DistributedDataParallel
from axondist.optim import SGD

IN, HIDDEN, CLASSES = 2, 32, 3
SAMPLES = 600
BATCH_PER_RANK = 20
LR = 0.5
TOLERANCE = 1e-4


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian blobs in 2-D, shuffled: inputs (N, 2) float32, labels (N,) int."""
    rng = np.random.default_rng(seed)
    centers = np.array([[0.0, 2.0], [-1.8, -1.0], [1.8, -1.0]])
    labels = rng.integers(0, CLASSES, SAMPLES)
    x = centers[labels] + 0.8 * rng.standard_normal((SAMPLES, IN))
    return x.astype(np.float32), labels


def init_params(seed: int = 1) -> list[ad.Parameter]:
    """W1 (hidden, in), b1, W2 (classes, hidden), b2: He-initialised, the same on every rank."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((HIDDEN, IN)) * np.sqrt(2 / IN)
    w2 = rng.standard_normal((CLASSES, HIDDEN)) * np.sqrt(2 / HIDDEN)
    arrays = [w1, np.zeros(HIDDEN), w2, np.zeros(CLASSES)]
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    return [ad.Parameter(a.astype(np.float32), n) for a, n in zip(arrays, names)]


def grad_fn(params: list[np.ndarray], x: np.ndarray, labels: np.ndarray):
    """Forward and backward of the MLP on one batch, by hand.

    A generator: yields ``(parameter index, gradient)`` as backward produces
    them and returns the mean cross-entropy loss (DDP's generator form).
    """
    w1, b1, w2, b2 = params
    h = x @ w1.T + b1
    a = np.maximum(h, 0)
    logits = a @ w2.T + b2
    logits -= logits.max(axis=1, keepdims=True)  # a stable softmax
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    loss = -np.mean(np.log(p[np.arange(n), labels]))
    dlogits = p
    dlogits[np.arange(n), labels] -= 1
    dlogits /= n
    yield 3, dlogits.sum(axis=0)            # b2: ready first, its bucket can start
    yield 2, dlogits.T @ a                   # W2
    dh = (dlogits @ w2) * (h > 0)
    yield 1, dh.sum(axis=0)                  # b1
    yield 0, dh.T @ x                        # W1
    return float(loss)


def accuracy(params: list[np.ndarray], x: np.ndarray, labels: np.ndarray) -> float:
    w1, b1, w2, b2 = params
    logits = np.maximum(x @ w1.T + b1, 0) @ w2.T + b2
    return float(np.mean(logits.argmax(axis=1) == labels))


def steps_per_epoch(sampler: DistributedSampler) -> int:
    return len(sampler) // BATCH_PER_RANK


def train(world: ad.World, epochs: int, strategy: str) -> dict:
    """One rank's training; returns its final parameters and the loss curve."""
    x, labels = make_data()
    params = init_params()
    ddp = DistributedDataParallel(params, world, grad_fn=grad_fn, strategy=strategy)
    opt = SGD(ddp.parameters(), lr=LR, momentum=0.9)
    sampler = DistributedSampler(SAMPLES, group=world, seed=7)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # the same shuffle on every rank, a new one each epoch
        idx = sampler.indices()
        for k in range(steps_per_epoch(sampler)):
            batch = idx[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]
            opt.zero_grad(set_to_none=False)  # .grad stays a view into DDP's buckets
            loss = ddp.backward(x[batch], labels[batch])
            opt.step()
            mean = np.array([loss])
            ad.all_reduce_mean(mean, world)  # the global batch's loss, for printing
            losses.append(float(mean[0]))
    return {"params": [p.data.copy() for p in params], "losses": losses,
            "accuracy": accuracy([p.data for p in params], x, labels)}


def train_single_process(world_size: int, epochs: int) -> list[np.ndarray]:
    """The same steps in one process: each step's global batch is every rank's share."""
    x, labels = make_data()
    params = init_params()
    opt = SGD(params, lr=LR, momentum=0.9)
    samplers = [DistributedSampler(SAMPLES, world_size, r, seed=7) for r in range(world_size)]
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        shares = [s.indices() for s in samplers]
        for k in range(steps_per_epoch(samplers[0])):
            batch = np.concatenate([i[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]
                                    for i in shares])
            gen = grad_fn([p.data for p in params], x[batch], labels[batch])
            try:
                while True:
                    i, g = next(gen)
                    params[i].grad = g
            except StopIteration:
                pass
            opt.step()
    return [p.data for p in params]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world ranks")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--strategy", choices=("synchronous", "overlapped"), default="overlapped")
    args = parser.parse_args(argv)
    # python numpy_mlp.py: --world-size threads; axondist run -n K: this process's rank of K
    return ad.run(check, args.world_size, args)[0]


def check(world: ad.World, args: argparse.Namespace) -> int:
    """Train on every rank; rank 0 compares with single-process training. The exit status."""
    result = train(world, args.epochs, args.strategy)
    if world.rank != 0:
        return 0
    reference = train_single_process(world.world_size, args.epochs)
    diff = max(float(np.max(np.abs(p - r))) for p, r in zip(result["params"], reference))
    losses = result["losses"]
    print(f"{world.world_size} ranks, {len(losses)} steps: loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, training accuracy {result['accuracy']:.1%}")
    print(f"max |parameter - single-process parameter| = {diff:.2e} "
          f"({'OK' if diff <= TOLERANCE else 'FAILED'})")
    return 0 if diff <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
