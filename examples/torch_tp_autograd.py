"""A torch module with column- and row-parallel linear layers, written with
``axondist.differentiable``: torch autograd carries the gradients through the collectives.

    python examples/torch_tp_autograd.py                          # 3 ranks on threads
    mpiexec -n 2 python examples/torch_tp_autograd.py             # 2 processes, MPI
    torchrun --nproc-per-node 2 examples/torch_tp_autograd.py     # 2 processes, torch backend

``ColumnParallelLinear`` keeps rows r of the weight (output features r, array_split rule)
and can gather the full output with ``differentiable.all_gather`` along the last axis;
``RowParallelLinear`` keeps columns r (input features r) and sums the ranks' partial
outputs with ``differentiable.all_reduce``. A three-layer MLP (column, GELU, row, column
with its output gathered) is trained with ``torch.optim.SGD``. The gradients are of the sum
over ranks of what each rank computes, so each rank's copy of the replicated loss is divided
by the world size, and the replicated bias of the row layer has its gradient summed over the
ranks. The example then trains the same MLP, as ``torch.nn.Linear`` layers, in one process
and compares the weights (exit status 1 beyond the tolerance). Without PyTorch it prints a
note and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError:
    print("torch_tp_autograd.py: PyTorch is not installed; skipping (pip install torch)")
    sys.exit(0)

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist import differentiable as dd

IN, HIDDEN, MID, OUT, BATCH, LR = 6, 10, 5, 3, 32, 0.1
TOLERANCE = 2e-5


def _rows(n: int, size: int, rank: int) -> slice:
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n), size)])
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output features (rows r on rank r).

    The output is this rank's features, or all of them with ``gather_output`` (an
    all-gather, whose backward hands each rank the gradient of its own features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, world: ad.World,
                 gather_output: bool = False) -> None:
        super().__init__()
        mine = _rows(weight.shape[0], world.world_size, world.rank)
        self.weight = torch.nn.Parameter(weight[mine].clone())
        self.bias = torch.nn.Parameter(bias[mine].clone())
        self.world, self.gather_output = world, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        return dd.all_gather(y.T.contiguous(), self.world).T  # features are the last axis


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input features (columns r on rank r);
    ``X`` comes split the same way. The partial products are summed over the ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, world: ad.World) -> None:
        super().__init__()
        mine = _rows(weight.shape[1], world.world_size, world.rank)
        self.weight = torch.nn.Parameter(weight[:, mine].clone())
        self.bias = torch.nn.Parameter(bias.clone())  # replicated
        self.world = world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dd.all_reduce(x @ self.weight.T, group=self.world) + self.bias


def full_weights() -> list[torch.Tensor]:
    """Each layer's weight and bias in torch.nn.Linear's layout."""
    g = torch.Generator().manual_seed(0)
    sizes = [(IN, HIDDEN), (HIDDEN, MID), (MID, OUT)]
    return [t for fan_in, fan_out in sizes for t in (
        0.4 * torch.randn(fan_out, fan_in, generator=g), 0.1 * torch.randn(fan_out, generator=g))]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT]) + 0.1


def train(world: ad.World, steps: int) -> tuple[list[float], list[np.ndarray]]:
    w1, b1, w2, b2, w3, b3 = full_weights()
    column = ColumnParallelLinear(w1, b1, world)
    row = RowParallelLinear(w2, b2, world)
    head = ColumnParallelLinear(w3, b3, world, gather_output=True)
    model = torch.nn.Sequential(column, torch.nn.GELU(), row, head)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        x, y = batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (loss / world.world_size).backward()  # every rank holds the same loss: count it once
        assert row.bias.grad is not None
        ad.all_reduce(row.bias.grad, group=world)  # replicated: sum the ranks' shares
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():  # the shards back into full weights, to compare with one process
        full = [ad.all_gather(column.weight, world), ad.all_gather(column.bias, world),
                ad.all_gather(row.weight.T.contiguous(), world).T, row.bias,
                ad.all_gather(head.weight, world), ad.all_gather(head.bias, world)]
    return losses, [t.detach().numpy().copy() for t in full]


def train_single_process(steps: int) -> tuple[list[float], list[np.ndarray]]:
    layers = [torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, MID),
              torch.nn.Linear(MID, OUT)]
    model = torch.nn.Sequential(layers[0], torch.nn.GELU(), *layers[1:])
    with torch.no_grad():
        for p, v in zip(model.parameters(), full_weights()):
            p.copy_(v)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        x, y = batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().numpy().copy() for p in model.parameters()]


def check(world: ad.World, steps: int) -> int:
    """Train on every rank; rank 0 compares with one process. The exit status."""
    losses, weights = train(world, steps)
    if world.rank != 0:
        return 0
    ref_losses, ref_weights = train_single_process(steps)
    worst = max(float(np.max(np.abs(w - r))) for w, r in zip(weights, ref_weights))
    ok = worst <= TOLERANCE and losses[-1] < losses[0]
    print(f"{world.world_size} ranks: column/row-parallel MLP through torch autograd; loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f} (one process: {ref_losses[-1]:.4f})")
    print(f"single-process training: largest weight difference {worst:.2e} "
          f"(tolerance {TOLERANCE:g}): {'yes (OK)' if ok else 'NO (FAILED)'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3,
                        help="ranks on threads when not launched (a launcher decides otherwise)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    return ad.run(check, args.world_size, args.steps)[0]


if __name__ == "__main__":
    sys.exit(main())
