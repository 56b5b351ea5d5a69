"""Classify scikit-learn's handwritten digits with DDP, ZeRO-1 and FSDP; check against 1 process.

    python examples/digits_ddp_fsdp.py                     # 3 ranks of the mock world
    python examples/digits_ddp_fsdp.py --world-size 4 --epochs 30
    mpiexec -n 2 python examples/digits_ddp_fsdp.py        # the MPI world

A 64-64-10 MLP (tanh, softmax cross-entropy, gradients written by hand in
NumPy, Adam) learns ``sklearn.datasets.load_digits`` (1,797 real 8x8 images;
a fixed 20 % is held out as the test set) three times: with
DistributedDataParallel, with ZeRO-1 (DDP's averaged gradients, and Adam's
state split over the ranks by ZeroRedundancyOptimizer) and with FSDP
FULL_SHARD. A DistributedSampler deals each rank its share of a new shuffle
every epoch (``set_epoch``); the global batch is the same whatever the world
size, so each run must end where the same training in one process ends. The
test set is split over the ranks and the correct answers summed; under FSDP
the full weights are gathered for it by ``summon_full_params``. The script
prints each strategy's test accuracy and its largest weight difference from
the single-process run, and exits with status 1 when any disagree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's axondist comes first

try:
    from sklearn.datasets import load_digits
except ImportError:
    print("digits_ddp_fsdp.py: scikit-learn is not installed; skipping "
          "(pip install 'axondist[examples]')")
    sys.exit(0)

import axondist as ad
from axondist import comm
from axondist.data import DistributedSampler
from axondist.launch import launched_by_mpi
from axondist.optim import Adam
from axondist.zero import ZeroRedundancyOptimizer

IN, HIDDEN, CLASSES = 64, 64, 10
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
STRATEGIES = ("ddp", "zero1", "fsdp")
TOLERANCE = 1e-8  # largest weight difference from the single-process run (float64)


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train and test images (pixels scaled to [0, 1]) and labels; 20 % held out."""
    digits = load_digits()
    x, y = digits.data / 16.0, digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def init_params(seed: int = 0) -> list[ad.Parameter]:
    rng = np.random.default_rng(seed)
    shapes = [(HIDDEN, IN), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,)]
    scales = [1 / np.sqrt(IN), 0.0, 1 / np.sqrt(HIDDEN), 0.0]
    return [ad.Parameter(rng.standard_normal(s) * k, n) for n, s, k in zip(NAMES, shapes, scales)]


def logits(w: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The class scores, and the hidden activations backward needs."""
    h = np.tanh(x @ w[0].T + w[1])
    return h @ w[2].T + w[3], h


def loss_and_grads(w: list[np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean cross-entropy over the rows of ``x`` and its gradient for each parameter."""
    z, h = logits(w, x)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = -float(np.mean(np.log(p[rows, y])))
    dz = p.copy()
    dz[rows, y] -= 1.0
    dz /= len(y)
    dh = (dz @ w[2]) * (1.0 - h * h)
    return loss, [dh.T @ x, dh.sum(axis=0), dz.T @ h, dz.sum(axis=0)]


def correct(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> int:
    return int(np.sum(np.argmax(logits(w, x)[0], axis=1) == y))


def per_rank_batch(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        sys.exit(f"digits_ddp_fsdp.py: --batch {global_batch} does not split over {world_size} "
                 "ranks; pass a multiple of the world size")
    return global_batch // world_size


def train_strategy(world: ad.World, strategy: str, args: argparse.Namespace,
                   data: tuple[np.ndarray, ...]) -> dict:
    """Train with one strategy on this rank; returns losses, accuracy, full weights, seconds."""
    x_train, y_train, x_test, y_test = data
    n = world.world_size
    batch = per_rank_batch(args.batch, n)
    params = init_params(args.seed)
    fsdp = None
    if strategy == "fsdp":
        fsdp = ad.FSDP(params, world, sharding_strategy="full_shard")
        opt = Adam(fsdp.sharded_parameters(), lr=args.lr)
    else:
        ddp = ad.DistributedDataParallel(params, world)
        opt = (Adam(ddp.parameters(), lr=args.lr) if strategy == "ddp" else
               ZeroRedundancyOptimizer(ddp.parameters(), Adam, world, lr=args.lr))
    sampler = DistributedSampler(len(x_train), group=world, shuffle=True, seed=args.seed,
                                 drop_last=True)
    losses = []
    comm.barrier(world)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        mine = sampler.indices()
        total = 0.0
        steps = len(mine) // batch
        for s in range(steps):
            rows = mine[s * batch:(s + 1) * batch]
            if fsdp is not None:
                loss = fsdp.step(loss_and_grads, x_train[rows], y_train[rows], optimizer=opt)
            else:
                loss, grads = loss_and_grads([p.data for p in params], x_train[rows],
                                             y_train[rows])
                for p, g in zip(params, grads):
                    p.grad = g
                ddp.sync_gradients()  # averaged over the ranks: the global batch's mean
                opt.step()
                opt.zero_grad()
            total += loss
        mean = np.array([total / steps])
        losses.append(float(comm.all_reduce_mean(mean, world)[0]))
    seconds = time.perf_counter() - start
    # Evaluation: each rank scores its share of the test set, then the counts are summed.
    share = np.array_split(np.arange(len(x_test)), n)[world.rank]
    if fsdp is not None:
        with fsdp.summon_full_params() as full:
            weights = [p.data.copy() for p in full]
    else:
        weights = [p.data.copy() for p in params]
    hits = np.array([correct(weights, x_test[share], y_test[share])], dtype=np.int64)
    comm.all_reduce_sum(hits, world)
    return {"losses": losses, "accuracy": float(hits[0]) / len(x_test), "weights": weights,
            "seconds": seconds}


def train(world: ad.World, args: argparse.Namespace) -> dict[str, dict]:
    """Every strategy in turn, on this rank."""
    data = load_data()
    return {s: train_strategy(world, s, args, data) for s in args.strategies}


def train_single_process(args: argparse.Namespace) -> dict:
    """The same training in one process: each step on the whole global batch."""
    x_train, y_train, x_test, y_test = load_data()
    params = init_params(args.seed)
    opt = Adam(params, lr=args.lr)
    # The permutation every rank's sampler draws (seeded by seed and epoch only).
    sampler = DistributedSampler(len(x_train), num_replicas=1, rank=0, shuffle=True,
                                 seed=args.seed, drop_last=True)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = sampler.epoch_order()
        steps = len(order) // args.batch
        total = 0.0
        for s in range(steps):
            rows = order[s * args.batch:(s + 1) * args.batch]
            loss, grads = loss_and_grads([p.data for p in params], x_train[rows], y_train[rows])
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            opt.zero_grad()
            total += loss
        losses.append(total / steps)
    weights = [p.data for p in params]
    return {"losses": losses, "accuracy": correct(weights, x_test, y_test) / len(x_test),
            "weights": weights}


def compare(results: list[dict[str, dict]], ref: dict, size: int, show: bool,
            args: argparse.Namespace) -> bool:
    """Print the table (``show``) and say whether every rank's every strategy matches ``ref``."""
    ok = True
    rows = []
    for strategy in args.strategies:
        worst = max(float(np.max(np.abs(a - b))) for res in results
                    for a, b in zip(res[strategy]["weights"], ref["weights"]))
        loss_diff = max(abs(a - b) for res in results
                        for a, b in zip(res[strategy]["losses"], ref["losses"]))
        mine = results[0][strategy]
        same = (worst <= TOLERANCE and loss_diff <= TOLERANCE
                and mine["accuracy"] == ref["accuracy"])
        ok = ok and same
        rows.append((strategy, mine["losses"][-1], mine["accuracy"], worst, mine["seconds"],
                     "OK" if same else "DIFFERS"))
    if show:
        print(f"{size} ranks, global batch {args.batch}, {args.epochs} epochs, Adam lr={args.lr}")
        print(f"{'strategy':<9} {'last loss':>10} {'test acc':>9} {'max |W - W_1proc|':>18} "
              f"{'seconds':>8}")
        for name, loss, acc, worst, seconds, verdict in rows:
            print(f"{name:<9} {loss:>10.5f} {acc:>9.2%} {worst:>18.2e} {seconds:>8.2f}  "
                  f"{verdict}")
        print(f"{'1 process':<9} {ref['losses'][-1]:>10.5f} {ref['accuracy']:>9.2%}")
        print("matches single-process training:", "yes" if ok else "NO")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3, help="mock world size (no MPI)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=60,
                        help="global batch (split evenly over the ranks)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    args = parser.parse_args(argv)

    results = ad.run(train, args.world_size, args)
    world = ad.current_world() if launched_by_mpi() else None
    size = world.world_size if world is not None else args.world_size
    show = world is None or world.rank == 0
    ok = compare(results, train_single_process(args), size, show, args)
    if not ok and show:
        print("FAILED: a distributed run differs from single-process training")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
