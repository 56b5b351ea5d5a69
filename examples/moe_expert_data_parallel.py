"""Train a small mixture-of-experts model with expert and data parallelism, and check it
against the same training in one process.

    python examples/moe_expert_data_parallel.py                 # 4 mock ranks: ep=2 x dp=2
    python examples/moe_expert_data_parallel.py --world-size 6 --ep 3
    axondist run -n 4 examples/moe_expert_data_parallel.py --ep 2

The model is ``pred = (x + MoE(x)) W_out^T`` on a regression target, trained with Adam
on the mean squared error plus the load-balancing and z losses. The ranks form an
``(dp, ep)`` mesh: the 12 experts are split over each expert-parallel group, so every
expert has ``dp`` replicas, and every rank trains on its own share of each batch. The
layer sums each expert's gradient over its replicas only and the router's over every
rank; the replicated output weight ``W_out`` is summed over the world by hand. Every
rank also trains the same model on the whole batch alone (a group of one rank) and
compares the dense weights after every step.
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

from axondist.expert_parallel import MixtureOfExperts
from axondist.mesh import DeviceMesh
from axondist.optim import Adam

D_MODEL, D_HIDDEN, EXPERTS, TOP_K, OUT = 8, 16, 12, 2, 3
TOKENS = 90  # per step, over all ranks (need not divide the world size)
AUX, Z = 0.01, 0.001


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch: tokens and a target with a different rule per region."""
    rng = np.random.default_rng([step, 17])
    x = rng.standard_normal((TOKENS, D_MODEL))
    t = np.stack([np.sin(2 * x[:, 0]) * (x[:, 1] > 0), x[:, 2] * x[:, 3],
                  np.abs(x[:, 4]) - 0.5], axis=1)
    return x, t


class Model:
    """``pred = (x + MoE(x)) W_out^T`` over ``group`` (experts) and ``data_group`` (replicas)."""

    def __init__(self, group: ad.ProcessGroup, data_group: ad.ProcessGroup | None,
                 everyone: ad.ProcessGroup) -> None:
        self.moe = MixtureOfExperts(D_MODEL, D_HIDDEN, EXPERTS, TOP_K, group,
                                    data_group=data_group, aux_loss_coeff=AUX, z_loss_coeff=Z,
                                    seed=3, dtype=np.float64)
        rng = np.random.default_rng(5)
        self.w_out = ad.Parameter(rng.standard_normal((OUT, D_MODEL)) / np.sqrt(D_MODEL),
                                  "w_out")
        self.everyone = everyone  # every rank holding tokens: W_out's gradient sums over it
        self.opt = Adam([self.w_out, *self.moe.parameters()], lr=0.02)

    def step(self, x: np.ndarray, t: np.ndarray) -> float:
        """One Adam step on this rank's tokens; returns the global loss."""
        h = x + self.moe.forward(x)
        pred = h @ self.w_out.data.T
        residual = pred - t
        grad_pred = residual / TOKENS  # d(mean over the global batch) / d pred
        self.w_out.grad = ad.all_reduce_sum(grad_pred.T @ h, self.everyone)
        self.moe.backward(grad_pred @ self.w_out.data)  # x's gradient is not needed
        self.opt.step()
        self.opt.zero_grad()
        sq = ad.all_reduce_sum(np.array([0.5 * float((residual ** 2).sum())]), self.everyone)
        return float(sq[0]) / TOKENS + self.moe.aux_loss + self.moe.z_loss

    def dense(self) -> list[np.ndarray]:
        full = self.moe.full_weights()
        return [self.w_out.data.copy()] + [full[k] for k in sorted(full)]


def train(world: ad.World, ep: int, steps: int) -> list[tuple[int, float, float, float]]:
    """Per-rank training; returns (step, parallel loss, one-process loss, max |W - W_one|)."""
    n = world.world_size
    mesh = DeviceMesh(world, (n // ep, ep), ("dp", "ep"))
    parallel = Model(mesh["ep"], mesh["dp"], world)
    # this rank by itself, for the one-process run (every rank makes every group)
    alone = [world.new_group([r]) for r in range(n)][world.rank]
    single = Model(alone, None, alone)
    share = np.array_split(np.arange(TOKENS), n)[world.rank]
    rows = []
    for step in range(steps):
        x, t = batch(step)
        loss = parallel.step(x[share], t[share])
        one_loss = single.step(x, t)
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(parallel.dense(), single.dense()))
        rows.append((step, loss, one_loss, diff))
    return rows


def check(world: ad.World, args: argparse.Namespace) -> int:
    """Train on every rank; rank 0 prints the table. The exit status (the same on every
    rank)."""
    rows = train(world, args.ep, args.steps)
    worst = ad.all_reduce_scalar(max(r[3] for r in rows), "max", group=world)
    size = world.world_size
    ok = worst < 1e-9
    if world.rank == 0:
        print(f"MixtureOfExperts {D_MODEL}->{D_HIDDEN} x {EXPERTS} experts, top-{TOP_K}, on "
              f"{size} ranks: ep={args.ep}, dp={size // args.ep}")
        print(f"{'step':>4} {'ep x dp loss':>14} {'one-process loss':>17} "
              f"{'max |W - W_one|':>16}")
        for step, loss, one_loss, diff in rows:
            print(f"{step:>4} {loss:>14.6f} {one_loss:>17.6f} {diff:>16.2e}")
        print("matches single-process training:", "yes" if ok else "NO (FAILED)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world size")
    parser.add_argument("--ep", type=int, default=2, help="ranks per expert-parallel group")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    # python moe_expert_data_parallel.py: --world-size threads; axondist run -n K: K processes
    return ad.run(check, args.world_size, args)[0]


if __name__ == "__main__":
    sys.exit(main())
