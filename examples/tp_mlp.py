"""Train a tensor-parallel MLP on a (dp x tp) mesh and check it against dense NumPy.

    python examples/tp_mlp.py                    # 4 ranks of the in-process mock world, tp=2
    python examples/tp_mlp.py --world-size 6 --tp 3
    axondist run -n 4 examples/tp_mlp.py --tp 2     # 4 processes (tp must divide them)

Each tensor-parallel group holds one copy of the model, split across its
ranks (the hidden layer's features); the data-parallel groups average the
copies' gradients, each copy seeing its own share of the batch. After every
step the example gathers the dense weights and compares them with the same
training done densely on the full batch in one process.
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

from axondist import comm
from axondist.ddp import DistributedDataParallel
from axondist.mesh import make_mesh
from axondist.optim import SGD
from axondist.tensor_parallel import TensorParallelMLP

IN, HIDDEN, OUT = 8, 30, 3  # 30 hidden features: uneven shards on 4 ranks (tp=4)
BATCH_PER_REPLICA = 16
LR = 0.2


def gelu(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tanh-GELU and its derivative (the dense reference's own copy)."""
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (h + 0.044715 * h**3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h**2)


def dense_step(w: list[np.ndarray], x: np.ndarray, t: np.ndarray) -> float:
    """One SGD step of the dense MLP on the full batch; returns the loss."""
    h = x @ w[0].T + w[1]
    a, da = gelu(h)
    y = a @ w[2].T + w[3]
    gy = (y - t) / len(x)
    gh = (gy @ w[2]) * da
    for p, g in zip(w, [gh.T @ x, gh.sum(0), gy.T @ a, gy.sum(0)]):
        p -= LR * g
    return float(0.5 * np.mean(np.sum((y - t) ** 2, axis=1)))


def train(world: ad.World, tp: int, steps: int) -> list[tuple[int, float, float, float]]:
    """Per-rank training loop; returns (step, tp loss, dense loss, max weight difference)."""
    mesh = make_mesh(world, tp)
    tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
    rng = np.random.default_rng(0)  # the same data on every rank; each replica takes a share
    batch = BATCH_PER_REPLICA * dp_group.world_size
    x = rng.standard_normal((batch, IN))
    t = np.sin(x[:, :OUT]) + 0.1 * rng.standard_normal((batch, OUT))
    share = slice(dp_group.rank * BATCH_PER_REPLICA, (dp_group.rank + 1) * BATCH_PER_REPLICA)

    mlp = TensorParallelMLP(IN, HIDDEN, OUT, tp_group, activation="gelu", dtype=np.float64,
                            seed=7)
    ddp = DistributedDataParallel(mlp, dp_group)  # averages each shard's grad over replicas
    opt = SGD(ddp.parameters(), lr=LR)
    full = mlp.full_weights()  # the dense MLP the seed stands for, same at any tp
    dense = [a.copy() for a in (*full["fc1"], *full["fc2"])]

    rows = []
    for step in range(steps):
        y = mlp.forward(x[share])
        loss = np.array([0.5 * np.mean(np.sum((y - t[share]) ** 2, axis=1))])
        mlp.backward((y - t[share]) / BATCH_PER_REPLICA)
        ddp.sync_gradients()
        opt.step()
        opt.zero_grad()
        comm.all_reduce_mean(loss, dp_group)
        dense_loss = dense_step(dense, x, t)
        full = mlp.full_weights()
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip((*full["fc1"], *full["fc2"]), dense))
        rows.append((step, float(loss[0]), dense_loss, diff))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world size")
    parser.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    # python tp_mlp.py: --world-size threads; axondist run -n K: this process's rank of K
    return ad.run(check, args.world_size, args)[0]


def check(world: ad.World, args: argparse.Namespace) -> int:
    """Train on every rank; every rank's distance from dense training, the worst on rank 0,
    which prints the table. The exit status."""
    rows = train(world, args.tp, args.steps)
    worst = ad.all_reduce_scalar(max(r[3] for r in rows), "max", group=world)
    size = world.world_size
    if world.rank == 0:
        print(f"TensorParallelMLP {IN}->{HIDDEN}->{OUT} on {size} ranks: "
              f"tp={args.tp}, dp={size // args.tp}")
        print(f"{'step':>4} {'tp x dp loss':>14} {'dense loss':>14} {'max |W - W_dense|':>18}")
        for step, loss, dense_loss, diff in rows:
            print(f"{step:>4} {loss:>14.6f} {dense_loss:>14.6f} {diff:>18.2e}")
        print("matches dense training:", "yes" if worst < 1e-9 else "NO")
    return 0 if worst < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
