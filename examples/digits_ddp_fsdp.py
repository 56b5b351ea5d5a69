"""Classify scikit-learn's handwritten digits with DDP, ZeRO-1 and FSDP; check against 1 process.

    python examples/digits_ddp_fsdp.py                     # 3 ranks of the mock world
    python examples/digits_ddp_fsdp.py --world-size 4 --epochs 30
    mpiexec -n 2 python examples/digits_ddp_fsdp.py        # the MPI world
    python examples/digits_ddp_fsdp.py --device gpu --world-size 1   # CuPy arrays on a GPU

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

``--device gpu`` trains on CuPy arrays (the single-process reference too): over
NCCL when every rank has a GPU of its own (in one process: one thread per GPU;
under ``mpiexec``: no more ranks per host than GPUs), else over the MPI backend
(under ``mpiexec``) or the in-process world with CuPy arrays. Without CuPy or
a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's axondist comes first

try:
    from sklearn.datasets import load_digits
except ImportError:
    print("digits_ddp_fsdp.py: scikit-learn is not installed; skipping "
          "(pip install '.[examples]' from the axondist checkout)")
    sys.exit(0)

import axondist as ad
from axondist import comm
from axondist.data import DistributedSampler
from axondist.launching.worlds import launched_by_mpi
from axondist.optim import Adam
from axondist.zero import ZeroRedundancyOptimizer

IN, HIDDEN, CLASSES = 64, 64, 10
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
STRATEGIES = ("ddp", "zero1", "fsdp")
TOLERANCE = 1e-8  # largest weight difference from the single-process run (float64)


def array_module(device: str) -> ModuleType:
    """NumPy, or CuPy for ``--device gpu``."""
    return importlib.import_module("cupy") if device == "gpu" else np


def load_data(seed: int = 0, device: str = "cpu") -> tuple[Any, Any, Any, Any]:
    """Train and test images (pixels scaled to [0, 1]) and labels; 20 % held out."""
    digits = load_digits()
    x, y = digits.data / 16.0, digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    xp = array_module(device)
    return xp.asarray(x[train]), xp.asarray(y[train]), xp.asarray(x[test]), xp.asarray(y[test])


def init_params(seed: int = 0, device: str = "cpu") -> list[ad.Parameter]:
    rng, xp = np.random.default_rng(seed), array_module(device)
    shapes = [(HIDDEN, IN), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,)]
    scales = [1 / np.sqrt(IN), 0.0, 1 / np.sqrt(HIDDEN), 0.0]
    return [ad.Parameter(xp.asarray(rng.standard_normal(s) * k), n)
            for n, s, k in zip(NAMES, shapes, scales)]


def logits(w: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The class scores, and the hidden activations backward needs."""
    h = ad.namespace(x).tanh(x @ w[0].T + w[1])
    return h @ w[2].T + w[3], h


def loss_and_grads(w: list[np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean cross-entropy over the rows of ``x`` and its gradient for each parameter."""
    xp = ad.namespace(x)
    z, h = logits(w, x)
    z = z - z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = -float(xp.mean(xp.log(p[rows, y])))
    dz = p.copy()
    dz[rows, y] -= 1.0
    dz /= len(y)
    dh = (dz @ w[2]) * (1.0 - h * h)
    return loss, [dh.T @ x, dh.sum(axis=0), dz.T @ h, dz.sum(axis=0)]


def correct(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> int:
    return int((logits(w, x)[0].argmax(axis=1) == y).sum())


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
    params = init_params(args.seed, args.device)
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
    xp = array_module(args.device)
    losses = []
    comm.barrier(world)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        mine = xp.asarray(sampler.indices())  # row numbers where the rows are
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
        mean = array_module(args.device).asarray([total / steps])
        losses.append(float(comm.all_reduce_mean(mean, world)[0]))
    seconds = time.perf_counter() - start
    # Evaluation: each rank scores its share of the test set, then the counts are summed.
    bounds = np.cumsum([0] + [len(r) for r in np.array_split(np.arange(len(x_test)), n)])
    share = slice(int(bounds[world.rank]), int(bounds[world.rank + 1]))
    if fsdp is not None:
        with fsdp.summon_full_params() as full:
            weights = [p.data.copy() for p in full]
    else:
        weights = [p.data.copy() for p in params]
    hits = array_module(args.device).asarray([correct(weights, x_test[share], y_test[share])],
                                             dtype=np.int64)
    comm.all_reduce_sum(hits, world)
    return {"losses": losses, "accuracy": float(hits[0]) / len(x_test), "weights": weights,
            "seconds": seconds}


def train(world: ad.World, args: argparse.Namespace) -> dict[str, dict]:
    """Every strategy in turn, on this rank."""
    data = load_data(device=args.device)
    return {s: train_strategy(world, s, args, data) for s in args.strategies}


def train_single_process(args: argparse.Namespace) -> dict:
    """The same training in one process: each step on the whole global batch."""
    x_train, y_train, x_test, y_test = load_data(device=args.device)
    params = init_params(args.seed, args.device)
    opt = Adam(params, lr=args.lr)
    # The permutation every rank's sampler draws (seeded by seed and epoch only).
    sampler = DistributedSampler(len(x_train), num_replicas=1, rank=0, shuffle=True,
                                 seed=args.seed, drop_last=True)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = array_module(args.device).asarray(sampler.epoch_order())
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
        worst = max(float(np.max(np.abs(ad.to_host(a) - ad.to_host(b)))) for res in results
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3, help="mock world size (no MPI)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=60,
                        help="global batch (split evenly over the ranks)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="NumPy arrays, or CuPy arrays on GPUs (NCCL when each rank has "
                             "a GPU of its own)")
    args = parser.parse_args(argv)

    results = run_ranks(args.device, args.world_size, train, args)
    world = ad.current_world() if launched_by_mpi() else None
    size = world.world_size if world is not None else args.world_size
    show = world is None or world.rank == 0
    ok = compare(results, train_single_process(args), size, show, args)
    if not ok and show:
        print("FAILED: a distributed run differs from single-process training")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
