"""PyTorch autograd computes the gradients, axondist averages them in place, without copies.

    python examples/torch_autograd.py                 # 4 ranks of the in-process mock world
    axondist run -n 2 examples/torch_autograd.py      # 2 processes (or mpiexec -n 2 python ...)
    torchrun --nproc-per-node 2 examples/torch_autograd.py   # 2 processes, the torch backend

axondist never imports torch: it reads a CPU tensor through DLPack, as a NumPy
array *sharing the tensor's memory*. So the collectives take the tensors
themselves: ``axondist.broadcast(p)`` copies rank 0's weights into every rank's
parameter (a tensor that requires grad is reduced through its data, as
``torch.distributed`` does), and ``axondist.sync_gradients`` averages every
``p.grad`` inside the torch tensors, with one all-reduce, before
``torch.optim.SGD`` steps with the averaged values. In the other direction
``torch.from_numpy`` (or ``torch.from_dlpack``) wraps a NumPy array without a
copy; here it feeds each rank's share of the NumPy data set to the model.

Each rank trains a copy of the same model on its share of every batch;
afterwards the example trains the model in one process on the full batches
and prints the largest parameter difference (exit status 1 if it exceeds the
tolerance). Without PyTorch installed it prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError:
    print("torch_autograd.py: PyTorch is not installed; skipping (pip install torch)")
    sys.exit(0)

try:
    import axondist as ad
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import axondist as ad

from axondist.data import DistributedSampler

SAMPLES, BATCH_PER_RANK, STEPS, LR = 512, 16, 30, 0.1
TOLERANCE = 1e-5


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """A smooth regression task: 6 inputs -> 2 outputs, float32 NumPy arrays."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1).astype(np.float32)
    return x, y


def make_model() -> torch.nn.Module:
    """The model with seeded initial weights, written into torch's tensors through NumPy views.

    (Not ``torch.manual_seed``: the mock world's ranks are threads sharing
    torch's global generator, so their draws would interleave.)
    """
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for p in model.parameters():
            ad.as_array(p)[...] = 0.4 * rng.standard_normal(tuple(p.shape))
    return model


def batch_of(step: int, rank: int, world_size: int) -> np.ndarray:
    sampler = DistributedSampler(SAMPLES, world_size, rank, seed=3)
    per_epoch = len(sampler) // BATCH_PER_RANK
    sampler.set_epoch(step // per_epoch)
    k = step % per_epoch
    return sampler.indices()[k * BATCH_PER_RANK:(k + 1) * BATCH_PER_RANK]


def train(world: ad.World) -> list[np.ndarray]:
    """One rank: torch computes gradients, axondist averages them inside the tensors."""
    torch.set_num_threads(1)  # the mock world's ranks share this process's cores
    x, y = make_data()
    model = make_model()
    for p in model.parameters():  # start from rank 0's weights, as torch DDP does
        assert ad.broadcast(p, world, src=0) is p  # in place: the tensor itself comes back
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        idx = batch_of(step, world.rank, world.world_size)
        xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])  # NumPy -> torch, no copy
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        grads = [p.grad for p in model.parameters()]
        ad.sync_gradients(grads, world)  # averaged in place, i.e. inside each p.grad
        opt.step()
    return [ad.as_array(p).copy() for p in model.parameters()]


def train_single_process(world_size: int) -> list[np.ndarray]:
    x, y = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        idx = np.concatenate([batch_of(step, r, world_size) for r in range(world_size)])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x[idx])),
                                     torch.from_numpy(y[idx])).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def zero_copy_check() -> bool:
    """The DLPack round trip shares memory both ways (what the example relies on)."""
    t = torch.zeros(4)
    view = ad.as_array(t)
    view += 1.0                         # written through NumPy ...
    back = torch.from_numpy(view)       # ... and wrapped again without a copy
    half = torch.zeros(4, dtype=torch.bfloat16)
    ad.as_array(half)[...] = 1.0        # bfloat16 crosses too (as ml_dtypes.bfloat16)
    return bool(t.sum() == 4.0 and back.data_ptr() == t.data_ptr() and half.sum() == 4.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="mock world ranks")
    args = parser.parse_args(argv)
    # python torch_autograd.py: --world-size threads; axondist run -n K: this process's rank
    return ad.run(check, args.world_size)[0]


def check(world: ad.World) -> int:
    """Train on every rank; rank 0 compares with single-process training. The exit status."""
    params = train(world)
    if world.rank != 0:
        return 0
    reference = train_single_process(world.world_size)
    diff = max(float(np.max(np.abs(p - r))) for p, r in zip(params, reference))
    ok = diff <= TOLERANCE and zero_copy_check()
    print(f"torch {torch.__version__}: {world.world_size} ranks, {STEPS} steps; gradients "
          f"averaged in place through DLPack (zero copy: {zero_copy_check()})")
    print(f"max |parameter - single-process parameter| = {diff:.2e} "
          f"({'OK' if ok else 'FAILED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
