"""Train, checkpoint every K steps, get killed, resume at another world size: same result.

    python examples/resume.py                          # 3 ranks of the mock world, checked
    axondist run -n 3 examples/resume.py --dir /tmp/run --kill-at 25   # SIGKILLed at step 25
    axondist run -n 2 examples/resume.py --dir /tmp/run     # resumes from step 20, checked

A 64-32-10 tanh MLP learns scikit-learn's bundled digits (softmax
cross-entropy, Adam), data parallel with DDP or FSDP FULL_SHARD
(``--strategy``). Every ``--every`` steps it saves a checkpoint in the
background (the previous one stays loadable until the new one is complete);
at start it resumes from the latest one, whatever world size and strategy
wrote it. It ends by loading the final checkpoint in one process and comparing
it, bit for bit, with an uninterrupted single-process run (exit status 1 if
they differ; ``--no-verify`` skips this).

Bit-exact across world sizes: each sample's gradient is rounded to a multiple
of 2^-30, so sums of gradients are exact in float64 in any order, and each
rank's share is scaled by powers of two (and by the group size for FSDP's
average, whose sum-then-divide is exact here) so that the wrappers' average
is exactly the global-batch sum divided by the batch size (a power of two).
Without the rounding (a script of your own) a run resumed at another world size
agrees to rounding, about 2e-16 relative per step: its sums' order depends on the
world size.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist.checkpoint import Checkpointer, load_sharded_checkpoint
from axondist.launching.worlds import launched_by_mpi
from axondist.optim import Adam

IN, HIDDEN, CLASSES = 64, 32, 10
BATCH = 64  # a power of two: dividing by it is exact
GRID = 2.0 ** 30
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 8x8 images, 10 classes), pixels scaled to [0, 1].

    Read straight from the CSV file scikit-learn ships (what ``load_digits``
    reads), which spares every rank the seconds importing scikit-learn takes.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("examples/resume.py needs scikit-learn: pip install scikit-learn (or "
                 "pip install '.[examples]' in a checkout)")
    csv = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(csv, delimiter=",")
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def init_params(seed: int = 0) -> list[ad.Parameter]:
    rng = np.random.default_rng(seed)
    shapes = [(HIDDEN, IN), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,)]
    scales = [1 / np.sqrt(IN), 0.0, 1 / np.sqrt(HIDDEN), 0.0]
    return [ad.Parameter(rng.standard_normal(s) * k, n) for n, s, k in zip(NAMES, shapes, scales)]


def step_rows(step: int, n_samples: int) -> np.ndarray:
    """The global batch of ``step``: the same whatever the world size."""
    return np.random.default_rng([7, step]).choice(n_samples, BATCH, replace=False)


def sample_grad(arrays: list[np.ndarray], x: np.ndarray, label: int) -> tuple[float, list]:
    """Loss and gradients of one sample, each rounded to a multiple of 2^-30."""
    w1, b1, w2, b2 = arrays
    h = np.tanh(w1 @ x + b1)
    z = w2 @ h + b2
    p = np.exp(z - z.max())
    p /= p.sum()
    dz = p.copy()
    dz[label] -= 1.0
    dh = (w2.T @ dz) * (1 - h * h)
    grads = [np.outer(dh, x), dh, np.outer(dz, h), dz]
    return -float(np.log(p[label])), [np.round(g * GRID) / GRID for g in grads]


def local_sum(arrays: list[np.ndarray], xs: np.ndarray, ys: np.ndarray) -> tuple[float, list]:
    """This rank's loss sum and the exact sum of its samples' rounded gradients."""
    total = [np.zeros(a.shape) for a in arrays]
    loss = 0.0
    for x, y in zip(xs, ys):
        sample_loss, grads = sample_grad(arrays, x, int(y))
        loss += sample_loss
        for t, g in zip(total, grads):
            t += g
    return loss, total


def power_of_two_weights(n: int) -> tuple[list[int], int]:
    """Sample weights for DDP, powers of two adding up to one: its weights are then exact."""
    total = 1 << (n - 1).bit_length()
    return [2 if r < total - n else 1 for r in range(n)], total


def train(world: ad.World, args: argparse.Namespace) -> list[float]:
    data, labels = load_data()
    n, rank = world.world_size, world.rank
    params = init_params()
    if args.strategy == "fsdp":
        target: object = ad.FSDP(params, world, sharding_strategy="full_shard")
        opt = Adam(target.sharded_parameters(), lr=args.lr)  # type: ignore[attr-defined]
    else:
        target = ad.DistributedDataParallel(params, world)
        opt = Adam(target.parameters(), lr=args.lr)  # type: ignore[attr-defined]
    ckpt = Checkpointer(args.dir, keep_last=2)
    start = ckpt.latest_step() or 0
    if start:
        ckpt.load(target, opt)
        if rank == 0:
            print(f"resumed from step {start} at {n} ranks ({args.strategy})", flush=True)
    weights, total = power_of_two_weights(n)
    losses = []
    for step in range(start, args.steps):
        rows = np.array_split(step_rows(step, len(data)), n)[rank]
        xs, ys = data[rows], labels[rows]
        if args.strategy == "fsdp":  # FSDP averages: sum, then an exact division by n
            def grad_fn(arrays: list, xs: np.ndarray, ys: np.ndarray) -> tuple[float, list]:
                loss, sums = local_sum(arrays, xs, ys)
                return loss, [g * (n / BATCH) for g in sums]
            loss = target.step(grad_fn, xs, ys, optimizer=opt)  # type: ignore[attr-defined]
        else:
            loss, sums = local_sum([p.data for p in params], xs, ys)
            for p, g in zip(params, sums):
                p.grad = g * (total / (weights[rank] * BATCH))
            target.sync_gradients(num_samples=weights[rank])  # type: ignore[attr-defined]
            opt.step()
            opt.zero_grad()
        losses.append(float(loss))
        done = step + 1
        if args.kill_at is not None and done == args.kill_at:
            # Every rank finishes the last save (rank 0 commits it) before the crash, so
            # the resume point is known; a crash mid-save would resume one save earlier.
            ckpt.wait()
            ad.barrier(world)
            if rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        if done % args.every == 0 or done == args.steps:
            ckpt.save(target, opt, step=done, async_save=True)
        if rank == 0 and done % 10 == 0:
            print(f"step {done}: loss of rank 0's samples {loss / len(rows):.4f}", flush=True)
    ckpt.wait()
    return losses


def reference(steps: int, lr: float) -> tuple[list[ad.Parameter], Adam]:
    """The uninterrupted single-process run."""
    data, labels = load_data()
    params = init_params()
    opt = Adam(params, lr=lr)
    for step in range(steps):
        rows = step_rows(step, len(data))
        _, sums = local_sum([p.data for p in params], data[rows], labels[rows])
        for p, g in zip(params, sums):
            p.grad = g / BATCH
        opt.step()
        opt.zero_grad()
    return params, opt


def verify(args: argparse.Namespace) -> bool:
    """The final checkpoint equals the uninterrupted run, parameters and Adam state."""
    params = init_params(seed=1)
    opt = Adam(params, lr=args.lr)
    load_sharded_checkpoint(args.dir, params, opt)
    want, want_opt = reference(args.steps, args.lr)
    same = all(np.array_equal(p.data, w.data) for p, w in zip(params, want))
    got, ref = opt.state_dict(), want_opt.state_dict()
    same = same and got["step_count"] == ref["step_count"] == args.steps
    for k, entry in ref["state"].items():
        same = same and all(np.array_equal(got["state"][k][key], v) for key, v in entry.items())
    print(f"final parameters and Adam state equal an uninterrupted single-process run bit for "
          f"bit: {same}", flush=True)
    return bool(same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None,
                        help="checkpoint root, resumed from when it holds one (default: a new "
                             "temporary folder, removed at the end)")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--world-size", type=int, default=3, help="mock world size (no MPI)")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL a rank after step N")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the comparison with an uninterrupted single-process run")
    args = parser.parse_args(argv)
    if args.kill_at is not None and not launched_by_mpi():  # threads share one process
        parser.error("--kill-at needs processes (axondist run -n N): on threads it would kill "
                     "every rank")
    # python resume.py: --world-size threads; axondist run -n K: this process's rank of K
    return ad.run(run_and_verify, args.world_size, args)[0]


def run_and_verify(world: ad.World, args: argparse.Namespace) -> int:
    """Train (resuming from the folder's latest checkpoint), then rank 0 compares with an
    uninterrupted single-process run. The exit status."""
    args = argparse.Namespace(**vars(args))  # this rank's copy: its folder is set below
    temporary = args.dir is None
    if temporary:  # rank 0 makes the folder, every rank uses it
        made = tempfile.mkdtemp(prefix="axondist-resume-") if world.rank == 0 else None
        args.dir = ad.broadcast_object(made, world, src=0)
    try:
        train(world, args)
        ok = verify(args) if args.verify and world.rank == 0 else True
    finally:
        if temporary:
            ad.barrier(world)
            if world.rank == 0:
                shutil.rmtree(args.dir, ignore_errors=True)
    if not ok:
        print("FAILED: the resumed run differs from an uninterrupted one", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
