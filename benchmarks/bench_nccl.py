"""all_reduce bus bandwidth of the NCCL backend, 1 MiB .. 1 GiB (nccl-tests convention).

    python benchmarks/bench_nccl.py [--quick] [--json results.json]    # every local GPU
    python benchmarks/bench_nccl.py --min-bytes 4 --max-bytes 262144    # small messages
    torchrun --nproc-per-node N benchmarks/bench_nccl.py                 # one process per GPU
    mpiexec -n N python benchmarks/bench_nccl.py                         # the same under MPI

In one process, every visible GPU (or ``--devices``) joins one world made
by ``NcclBackend.create_world`` and each step issues every GPU's all-reduce
from one thread inside ``group_calls()``. Launched by torchrun or mpiexec,
``axondist.init("nccl")`` makes the world and each process drives its GPU.

Each size runs ``--warmup`` untimed steps, then ``--iters`` steps back to
back (float32 SUM, in place, ``async_op=True``) and one synchronization; a
step's time is that total over ``iters`` (the slowest rank's, under several
processes). The two variants alternate for ``REPEATS`` rounds: the time and
the ``axondist/raw`` ratio are the median (min-max) over those rounds, the
bandwidths are at the median time. As in nccl-tests: ``algbw = bytes / time`` and
``busbw = algbw * 2 (n - 1) / n``, the bandwidth each link must carry in a
ring, comparable across world sizes (on one GPU it is 0 by definition).
The ``raw`` column times CuPy's ``NcclCommunicator.allReduce`` on the same
buffers and stream, so ``axondist/raw`` is the backend's own overhead.

Without CuPy, NCCL or a GPU it exits with status 1 and says what is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

from _common import (  # noqa: E402
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)

RUNNER = {"needs": ["cupy"], "quick_args": ["--quick"], "timeout": 900}

REPEATS = 3
"""Alternating rounds of (axondist, raw) per size: each figure's spread is over these."""

MIN_BYTES, MAX_BYTES = 1 << 20, 1 << 30


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: ``algbw * 2 (n - 1) / n``."""
    if world_size < 1:
        raise ValueError(f"bus_bandwidth: world_size must be >= 1, got {world_size}")
    return algbw * 2.0 * (world_size - 1) / world_size


def message_sizes(lo: int = MIN_BYTES, hi: int = MAX_BYTES, factor: int = 2) -> list[int]:
    """``lo, lo*factor, ...`` up to ``hi`` (bytes), every one a multiple of 4 (float32)."""
    if lo < 4 or hi < lo or factor < 2:
        raise ValueError(f"message_sizes: need 4 <= lo <= hi and factor >= 2, got {lo}, {hi}, "
                         f"{factor}")
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n - n % 4)
        n *= factor
    return sizes


def gpu_unavailable_reason() -> str | None:
    """Why this machine cannot run the benchmark (None when it can)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CUDA libraries failing to load
        return (f"CuPy is not importable ({exc}); from the checkout, pip install "
                "'.[gpu-cuda13]' for CUDA 13 or '.[gpu]' for CUDA 12 (nvidia-smi's \"CUDA "
                "Version\" says which)")
    if not getattr(nccl, "available", False):
        return "CuPy cannot load NCCL; pip install nvidia-nccl-cu13 (CUDA 13) or -cu12 (CUDA 12)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"CUDA reports no GPU ({exc})"
    return None if count > 0 else "CUDA reports no GPU"


def _launched() -> bool:
    from axondist.backends.rendezvous import LaunchEnv
    from axondist.launching.worlds import launched_by_mpi

    return launched_by_mpi() or LaunchEnv.present(os.environ)


def _time_steps(step: Callable[[], list[Any]], sync: Callable[[], None], warmup: int,
                iters: int) -> float:
    """Seconds per step: ``iters`` steps back to back between two synchronizations."""
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters


def run(sizes: list[int], iters: int, warmup: int,
        devices: list[int] | None) -> tuple[dict[str, Any], bool]:
    """Time every size; returns the results (every rank's worst time) and "this is rank 0"."""
    import cupy

    import axondist as ad
    from axondist.backends.nccl import NcclBackend, group_calls
    from axondist.backends.nccl.basics import NCCL_DTYPES, NCCL_OPS

    backends: list[Any]
    if _launched():
        backends = [ad.init("nccl").backend]
        world_size = backends[0].world_size
    else:
        backends = NcclBackend.create_world(devices or range(cupy.cuda.runtime.getDeviceCount()))
        world_size = len(backends)
    sum_op = ad.ReduceOp.SUM
    f32, nccl_sum = NCCL_DTYPES["float32"], NCCL_OPS["sum"]

    def sync() -> None:
        for b in backends:
            b.synchronize()
        if len(backends) == 1 and world_size > 1:
            backends[0].barrier()

    rows = []
    for nbytes in sizes:
        bufs = []
        for b in backends:
            with cupy.cuda.Device(b.device):
                bufs.append(cupy.zeros(nbytes // 4, dtype=cupy.float32))  # sums stay 0
                cupy.cuda.Device(b.device).synchronize()  # the raw variant skips stream ordering

        def axondist_step(bufs: list[Any] = bufs) -> list[Any]:
            with group_calls():
                return [b.all_reduce(x, sum_op, async_op=True) for b, x in zip(backends, bufs)]

        def raw_step(bufs: list[Any] = bufs) -> list[Any]:
            with group_calls():
                for b, x in zip(backends, bufs):
                    with cupy.cuda.Device(b.device):
                        b.communicator.allReduce(x.data.ptr, x.data.ptr, x.size, f32, nccl_sum,
                                                 b.stream.ptr)
            return []

        # alternate the variants so drift in machine load hits both alike
        t_ad, t_raw = [], []
        for _ in range(REPEATS):
            t_ad.append(_time_steps(axondist_step, sync, warmup, iters))
            t_raw.append(_time_steps(raw_step, sync, warmup, iters))
        if len(backends) == 1 and world_size > 1:  # each round: the slowest rank decides
            t_ad = [max(v) for v in zip(*backends[0].allgather_object(t_ad))]
            t_raw = [max(v) for v in zip(*backends[0].allgather_object(t_raw))]
        time_us = spread(t_ad, 1e6)
        algbw = nbytes / (time_us["median"] * 1e-6) / 1e9  # at the median time
        rows.append({"bytes": nbytes, "us": time_us, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, world_size),
                     "axondist/raw": ratio_spread(t_ad, t_raw)})
        bufs.clear()  # free this size before allocating the next
    devices_used = [b.device for b in backends]
    is_rank0 = backends[0].rank == 0
    for b in backends:
        b.close()
    return {"world_size": world_size, "repeats": REPEATS, "devices_of_rank0": devices_used,
            "all_reduce": rows}, is_rank0


def report(results: dict[str, Any]) -> str:
    rows = [[format_size(r["bytes"]), format_spread(r["us"]), r["algbw_GBps"], r["busbw_GBps"],
             format_spread(r["axondist/raw"])] for r in results["all_reduce"]]
    text = [f"NCCL all_reduce, float32 SUM in place, world size {results['world_size']}; "
            f"median (min-max) over {results['repeats']} rounds",
            format_table(["size", "time us", "algbw GB/s", "busbw GB/s", "axondist/raw"], rows)]
    if results["world_size"] == 1:
        text.append("(one GPU: busbw is 0 by the nccl-tests convention; algbw is the local "
                    "in-place reduction speed)")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-bytes", type=int, default=MIN_BYTES,
                        help="smallest message in bytes, at least 4 (default 1 MiB)")
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES,
                        help="largest message in bytes (default 1 GiB)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per size")
    parser.add_argument("--devices", type=int, nargs="+", help="GPU ids (one process only)")
    parser.add_argument("--quick", action="store_true", help="sizes x4 apart, fewer steps")
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    args = parser.parse_args(argv)
    if not 4 <= args.min_bytes <= args.max_bytes:
        parser.error(f"need 4 <= --min-bytes <= --max-bytes, got --min-bytes {args.min_bytes} "
                     f"and --max-bytes {args.max_bytes}")
    reason = gpu_unavailable_reason()
    if reason is not None:
        sys.exit(f"bench_nccl: cannot run without a CUDA GPU: {reason}")
    factor, iters, warmup = (4, 5, 2) if args.quick else (2, args.iters, args.warmup)
    results, is_rank0 = run(message_sizes(args.min_bytes, args.max_bytes, factor), iters, warmup,
                            args.devices)
    if is_rank0:
        print(report(results))
        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
