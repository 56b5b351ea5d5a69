"""torch on the same GPU, for the side-by-side of ``gpu_check.sh``: all_reduce latency and an
FSDP step, the figures ``bench_gpu.py`` gives for axondist.

    python benchmarks/torch_gpu.py [--quick]

Part 1 times ``torch.distributed.all_reduce`` (NCCL, a one-rank group, float32 SUM) of
4 B to 256 KiB: blocking (each call then a stream synchronize) and queued (calls back to
back, one synchronize per batch). Part 2 times a training step of the MLP of
``bench_gpu.py`` part 3 (4 layers of 2048x2048, tanh, 256 samples, MSE, SGD) in a plain
loop, under ``DistributedDataParallel`` and under FSDP2 (``fully_shard`` per layer).
Figures are medians (min-max) of timed batches. Without torch or a GPU it says so and
exits with status 0 (there is nothing to compare).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SIZES = [4, 64, 1024, 16 << 10, 256 << 10]


def timed(fn: Callable[[], Any], sync: Callable[[], Any], batch: int,
          repeats: int) -> list[float]:
    """Seconds per call of ``fn``, one figure per batch of ``batch`` calls (after a warm-up)."""
    for _ in range(batch):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        out.append((time.perf_counter() - start) / batch)
    return out


def spread(values: list[float], scale: float) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def latency(torch: Any, dist: Any, batch: int, repeats: int) -> None:
    print("torch.distributed.all_reduce, NCCL, 1 rank, float32 SUM (us per call)")
    print(f"{'bytes':>8} {'blocking':>22} {'queued':>22}")
    sync = torch.cuda.synchronize
    for nbytes in SIZES:
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device="cuda")

        def blocking(x: Any = x) -> None:
            dist.all_reduce(x)
            sync()

        def queued(x: Any = x) -> None:
            dist.all_reduce(x)

        b = timed(blocking, sync, batch, repeats)
        q = timed(queued, sync, batch, repeats)
        print(f"{nbytes:>8} {spread(b, 1e6):>22} {spread(q, 1e6):>22}")


def fsdp_steps(torch: Any, dist: Any, batch: int, repeats: int) -> None:
    nn = torch.nn
    width, layers, samples = 2048, 4, 256
    torch.manual_seed(0)
    x = torch.randn(samples, width, device="cuda")
    y = torch.randn(samples, width, device="cuda")

    def model() -> Any:
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                               for _ in range(layers)]).cuda()

    def stepper(net: Any) -> Callable[[], None]:
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            opt.step()

        return step

    variants = {"plain": stepper(model()),
                "DDP": stepper(nn.parallel.DistributedDataParallel(model()))}
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            fully_shard = None
    if fully_shard is not None:
        net = model()
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        variants["FSDP2 (fully_shard per layer)"] = stepper(net)
    print(f"\ntraining step, {layers} x {width}x{width} tanh MLP, {samples} samples, SGD (ms)")
    for name, step in variants.items():
        print(f"{name:<30} {spread(timed(step, torch.cuda.synchronize, batch, repeats), 1e3)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    args = parser.parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        print(f"torch_gpu: torch is not importable ({exc}); nothing to compare")
        return 0
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("torch_gpu: torch sees no CUDA GPU (or has no NCCL); nothing to compare")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        batch, repeats = (100, 5) if args.quick else (200, 15)
        latency(torch, dist, batch, repeats)
        fsdp_steps(torch, dist, 5 if args.quick else 10, repeats)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
