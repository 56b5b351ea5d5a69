"""One GPU: NCCL small-message latency, CuPy through MPI host staging, FSDP on GPU vs CPU.

    python benchmarks/bench_gpu.py [--quick] [--json results.json] [--profile]  # parts 1 and 3
    mpiexec -n 2 python benchmarks/bench_gpu.py [--quick] [--json results.json]  # all three
    mpiexec -n 2 python benchmarks/bench_gpu.py --cpu-only --quick  # NumPy sides, no GPU needed

Part 1 times float32 SUM all-reduces of 4 B to 256 KiB on a one-GPU NCCL world
through ``axondist.all_reduce``, through the backend's own ``all_reduce`` and
through CuPy's ``NcclCommunicator.allReduce`` on the same buffer and stream
(blocking: each call then a stream synchronize; queued: calls back to back, one
synchronize per batch), then again in a child process under
``AXONDIST_CHECKS=0``; ``--profile`` adds a cProfile of 2000 blocking 4-byte
calls. Part 2 (every rank under mpiexec, all on one GPU) times
``axondist.all_reduce`` of 4 KiB to 16 MiB on the MPI backend for a CuPy array
(through the host copies when MPI is not CUDA-aware) and for a NumPy array,
beside the cost of those copies alone. Part 3 (rank 0) times training steps of
an MLP (4 layers of 2048x2048, tanh, 256 samples, SGD) in plain loops and
wrapped in FSDP FULL_SHARD over a one-rank mock world, on NumPy and CuPy (and
over a one-GPU NCCL world), and checks that every variant computes the same
losses. Every figure is a median (min-max) over timed
batches that alternate between the variants (``_common.alternate``), every
ratio paired batch by batch. Without CuPy or a GPU the script exits with
status 1 and the reason, except with ``--cpu-only``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    batch_for,
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)
from bench_nccl import gpu_unavailable_reason  # noqa: E402

import axondist as ad  # noqa: E402
from axondist.backends.base import checks_enabled  # noqa: E402
from axondist.backends.nccl import NcclBackend  # noqa: E402
from axondist.backends.nccl.basics import NCCL_DTYPES, NCCL_OPS  # noqa: E402
from axondist.fsdp import FSDP, ShardingStrategy  # noqa: E402
from axondist.launching.worlds import launched_by_mpi  # noqa: E402
from axondist.optim import SGD  # noqa: E402
from axondist.pipeline import PipelineStage  # noqa: E402

RUNNER = {"ranks": 2, "needs": ["cupy"], "quick_args": ["--quick"], "timeout": 600}

LATENCY_SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10]
STAGING_SIZES = [4 << 10, 1 << 20, 16 << 20]
PROFILE_CALLS = 2000
SUM = ad.ReduceOp.SUM
#: Relative difference above which two variants' losses count as different results.
LOSS_TOLERANCE = 1e-3
#: Variables of an MPI launch, left out of the checks-off child's environment.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_")

ONE_GPU_NOTE = (
    "What one GPU cannot show: bus bandwidth between GPUs (NVLink, PCIe, network), NCCL with "
    "more than one rank (rings and trees, and axondist's 16-byte cross-rank check before each "
    "blocking call, which runs only with several ranks), and FSDP's all-gathers and "
    "reduce-scatters actually moving data. Part 2's ranks share one GPU and its copy engines, "
    "so its copies contend; run bench_nccl.py and bench_fsdp.py on several GPUs for those.")


# --- part 1: NCCL latency floor at world size 1 -------------------------------------------------

def latency(cp: ModuleType, device: int, batch: int, repeats: int,
            profile: bool = False) -> dict[str, Any]:
    """Part 1 on a one-GPU NCCL world: every size blocking and queued, and the profile."""
    cp.cuda.Device(device).use()
    backend = NcclBackend.create_world([device])[0]
    world = ad.World(backend)
    try:
        rows = []
        for nbytes in LATENCY_SIZES:
            rows += latency_rows(cp, world, backend, nbytes, batch, repeats)
        text = profile_calls(cp, world, backend, PROFILE_CALLS) if profile else None
    finally:
        backend.close()
    return {"device": device, "AXONDIST_CHECKS": os.environ.get("AXONDIST_CHECKS", "(unset)"),
            "checks_enabled": checks_enabled(), "batch": batch, "repeats": repeats,
            "nccl_version": ".".join(map(str, backend.nccl_version())), "latency": rows,
            "profile": text}


def latency_rows(cp: ModuleType, world: ad.World, backend: NcclBackend, nbytes: int,
                 batch: int, repeats: int) -> list[dict[str, Any]]:
    """The blocking and the queued row of one size."""
    x = cp.zeros(nbytes // 4, dtype=cp.float32)  # SUM over one rank keeps it 0
    cp.cuda.Device(backend.device).synchronize()  # the raw calls skip stream ordering
    stream, nccl_comm = backend.stream, backend.communicator
    ptr, count, stream_ptr = x.data.ptr, x.size, stream.ptr
    f32, nccl_sum = NCCL_DTYPES["float32"], NCCL_OPS["sum"]

    def raw() -> None:
        nccl_comm.allReduce(ptr, ptr, count, f32, nccl_sum, stream_ptr)

    def raw_blocking() -> None:
        raw()
        stream.synchronize()

    def axondist_blocking() -> None:
        ad.all_reduce(x, SUM, world)
        stream.synchronize()

    def backend_blocking() -> None:
        backend.all_reduce(x, SUM).wait()
        stream.synchronize()

    def axondist_queued() -> None:
        ad.all_reduce(x, SUM, world, async_op=True)

    def backend_queued() -> None:
        backend.all_reduce(x, SUM, async_op=True)

    modes = {"blocking": {"axondist": axondist_blocking, "backend": backend_blocking,
                          "raw": raw_blocking},
             "queued": {"axondist": axondist_queued, "backend": backend_queued, "raw": raw}}
    rows = []
    for mode, variants in modes.items():
        t = alternate(variants, batch=batch, repeats=repeats, sync=backend.synchronize)
        rows.append({"bytes": nbytes, "mode": mode,
                     "axondist_us": spread(t["axondist"], 1e6),
                     "backend_us": spread(t["backend"], 1e6),
                     "raw_us": spread(t["raw"], 1e6),
                     "axondist-raw_us": spread([a - r for a, r in zip(t["axondist"], t["raw"])],
                                               1e6),
                     "axondist/raw": ratio_spread(t["axondist"], t["raw"]),
                     "backend/raw": ratio_spread(t["backend"], t["raw"])})
    return rows


def profile_calls(cp: ModuleType, world: ad.World, backend: NcclBackend, calls: int) -> str:
    """cProfile of ``calls`` blocking 4-byte ``axondist.all_reduce`` calls, top 25 by tottime."""
    x = cp.zeros(1, dtype=cp.float32)
    for _ in range(100):  # first-call costs stay out of the profile
        ad.all_reduce(x, SUM, world)
    backend.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        ad.all_reduce(x, SUM, world)
        backend.stream.synchronize()
    prof.disable()
    elapsed = time.perf_counter() - start
    out = io.StringIO()
    out.write(f"cProfile of {calls} blocking 4-byte axondist.all_reduce calls + stream "
              f"synchronize ({elapsed / calls * 1e6:.1f} us per call under the profiler), "
              "top 25 by tottime:\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue().rstrip()


def latency_without_checks(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 again in a child process started with ``AXONDIST_CHECKS=0`` (the checks are
    switched by that variable only, read when a world is made)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["AXONDIST_CHECKS"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "latency.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--latency-child", path,
               "--device", str(args.device)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the AXONDIST_CHECKS=0 child ({' '.join(cmd)}) exited with "
                               f"{proc.returncode}:\n{proc.stdout}{proc.stderr}")
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
    return result


def latency_report(part: dict[str, Any], checks_off: dict[str, Any] | None) -> str:
    text = [f"Part 1: NCCL all_reduce latency at world size 1 (GPU {part['device']}, NCCL "
            f"{part['nccl_version']}), float32 SUM in place; us per call, median (min-max) over "
            f"{part['repeats']} batches of {part['batch']} calls. blocking: each call then a "
            "stream synchronize; queued: async_op calls back to back, one synchronize per "
            "batch. axondist = axondist.all_reduce(x, group=world); backend = "
            "NcclBackend.all_reduce; raw = CuPy NcclCommunicator.allReduce on the same buffer "
            f"and stream. AXONDIST_CHECKS={part['AXONDIST_CHECKS']}."]
    header = ["size", "mode", "axondist us", "backend us", "raw us", "axondist-raw us",
              "axondist/raw", "backend/raw"]
    rows = [[format_size(r["bytes"]), r["mode"], format_spread(r["axondist_us"]),
             format_spread(r["backend_us"]), format_spread(r["raw_us"]),
             format_spread(r["axondist-raw_us"]), format_spread(r["axondist/raw"]),
             format_spread(r["backend/raw"])] for r in part["latency"]]
    text.append(format_table(header, rows))
    if checks_off is not None:
        text.append("The same in a child process with AXONDIST_CHECKS=0 (each ratio paired "
                    "inside its own process; at world size 1 the 16-byte check all-reduce is "
                    "skipped in both, so what differs is noise and the switch itself):")
        off = {(r["bytes"], r["mode"]): r for r in checks_off["latency"]}
        rows = [[format_size(r["bytes"]), r["mode"], format_spread(r["axondist_us"]),
                 format_spread(off[r["bytes"], r["mode"]]["axondist_us"]),
                 format_spread(r["axondist/raw"]),
                 format_spread(off[r["bytes"], r["mode"]]["axondist/raw"])]
                for r in part["latency"] if (r["bytes"], r["mode"]) in off]
        text.append(format_table(["size", "mode", "checks on us", "checks off us",
                                  "on: axondist/raw", "off: axondist/raw"], rows))
    return "\n".join(text)


# --- part 2: CuPy through the MPI backend (host staging) vs NumPy ----------------------------

def staging(cp: ModuleType | None, world: ad.World, device: int, repeats: int) -> dict[str, Any]:
    """Part 2 on every rank of the MPI world; the same results come back on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    backend = world.backend_for("bench_gpu")
    mode = backend.options.host_staging
    aware = bool(backend.cuda_aware)
    staged = mode == "always" or (mode == "auto" and not aware)
    if cp is not None:
        cp.cuda.Device(device).use()
    rows = []
    for nbytes in STAGING_SIZES:
        rows.append(staging_row(cp, world, comm, nbytes, repeats))
    return {"world_size": world.world_size, "host_staging": mode, "mpi_cuda_aware": aware,
            "cupy_staged": staged, "gpu": cp is not None, "repeats": repeats,
            "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
            "staging": rows}


def staging_row(cp: ModuleType | None, world: ad.World, comm: Any, nbytes: int,
                repeats: int) -> dict[str, Any]:
    host = np.zeros(nbytes // 4, dtype=np.float32)  # sums stay 0

    def numpy_call() -> None:
        ad.all_reduce(host, SUM, world)

    variants: dict[str, Callable[[], None]] = {"numpy": numpy_call}
    if cp is not None:
        dev = cp.zeros(nbytes // 4, dtype=cp.float32)
        stream = cp.cuda.get_current_stream()

        def cupy_call() -> None:
            ad.all_reduce(dev, SUM, world)
            stream.synchronize()  # the copy back is enqueued, not done, when it returns

        def copies() -> None:  # what the staging adds: to the host and back, in place
            dev[...] = cp.asarray(cp.asnumpy(dev))
            stream.synchronize()

        variants.update({"cupy": cupy_call, "copies": copies})
    batch = batch_for(nbytes, 32 << 20, 2, 200)
    t = alternate(variants, batch=batch, repeats=repeats, comm=comm)
    row: dict[str, Any] = {"bytes": nbytes, "batch": batch, "numpy_us": spread(t["numpy"], 1e6)}
    if cp is not None:
        row.update({"cupy_us": spread(t["cupy"], 1e6), "copies_us": spread(t["copies"], 1e6),
                    "cupy/numpy": ratio_spread(t["cupy"], t["numpy"]),
                    "(numpy+copies)/cupy": ratio_spread(
                        [a + b for a, b in zip(t["numpy"], t["copies"])], t["cupy"])})
    return row


def staging_report(part: dict[str, Any]) -> str:
    staged = "through host copies" if part["cupy_staged"] else "directly (no host copies)"
    where = " on one GPU" if part["gpu"] else ""
    text = [f"Part 2: axondist.all_reduce on the MPI backend, {part['world_size']} ranks"
            f"{where}, float32 SUM; us per call, median (min-max) over {part['repeats']} batches "
            f"(each the slowest rank's). {part['mpi_library']}; MPI reports CUDA-aware: "
            f"{part['mpi_cuda_aware']}; host_staging={part['host_staging']!r}, so CuPy arrays "
            f"go {staged}. copies = cupy.asnumpy then cupy.asarray written back in place (what "
            "the staging adds); (numpy+copies)/cupy near 1 means the copies explain the gap."]
    if part["gpu"]:
        header = ["size", "numpy us", "cupy us", "copies us", "cupy/numpy",
                  "(numpy+copies)/cupy"]
        rows = [[format_size(r["bytes"]), format_spread(r["numpy_us"]),
                 format_spread(r["cupy_us"]), format_spread(r["copies_us"]),
                 format_spread(r["cupy/numpy"]), format_spread(r["(numpy+copies)/cupy"])]
                for r in part["staging"]]
    else:
        text.append("(--cpu-only: the NumPy side only)")
        header = ["size", "numpy us"]
        rows = [[format_size(r["bytes"]), format_spread(r["numpy_us"])] for r in part["staging"]]
    text.append(format_table(header, rows))
    return "\n".join(text)


# --- part 3: FSDP step time, GPU vs CPU -----------------------------------------------------

def layer_forward(pa: list[Any], x: Any) -> tuple[Any, Any]:
    """``h = tanh(x W + b)``; saves ``(x, h)``."""
    w, b = pa
    xp = ad.namespace(x)
    h = x @ w
    h += b
    xp.tanh(h, out=h)
    return h, (x, h)


def layer_backward(pa: list[Any], saved: Any, gy: Any,
                   need_input: bool = True) -> tuple[Any, list[Any]]:
    """``d = gy (1 - h^2)``: ``dx = d W^T``, ``dW = x^T d``, ``db = sum_rows d``."""
    w, _ = pa
    x, h = saved
    xp = ad.namespace(h)
    d = h * h
    xp.subtract(1.0, d, out=d)
    d *= gy
    return (d @ w.T if need_input else None), [x.T @ d, d.sum(axis=0)]


def first_layer_backward(pa: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    """The first layer's backward: the input needs no gradient."""
    return layer_backward(pa, saved, gy, need_input=False)


def mse(y: Any, target: Any) -> tuple[float, Any]:
    """``0.5 * mean over rows of |y - target|^2`` and its gradient."""
    xp = ad.namespace(y)
    d = y - target
    return 0.5 * float(xp.mean(xp.sum(d * d, axis=1))), d / len(y)


def initial_values(layers: int, width: int) -> list[np.ndarray]:
    """Every layer's (weight, bias), the same for every variant."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(layers):
        out.append(rng.standard_normal((width, width), dtype=np.float32)
                   / np.float32(np.sqrt(width)))
        out.append(np.zeros(width, np.float32))
    return out


def parameters_on(xp: ModuleType, values: list[np.ndarray]) -> list[ad.Parameter]:
    """Parameters holding copies of ``values`` (the optimizers update them in place)."""
    return [ad.Parameter(xp.array(v, copy=True), f"l{k // 2}.{'wb'[k % 2]}")
            for k, v in enumerate(values)]


def plain_step(xp: ModuleType, values: list[np.ndarray], x: Any, y: Any,
               lr: float) -> Callable[[], float]:
    """The model as a plain single-process loop: forward, loss, backward, SGD."""
    params = parameters_on(xp, values)
    opt = SGD(params, lr=lr)
    layers = len(params) // 2

    def step() -> float:
        h, saved = x, []
        for k in range(layers):
            h, s = layer_forward([params[2 * k].data, params[2 * k + 1].data], h)
            saved.append(s)
        loss, g = mse(h, y)
        for k in reversed(range(layers)):
            backward = first_layer_backward if k == 0 else layer_backward
            g, (params[2 * k].grad, params[2 * k + 1].grad) = backward(
                [params[2 * k].data, params[2 * k + 1].data], saved[k], g)
            saved[k] = None
        opt.step()
        opt.zero_grad()
        return loss

    return step


def fsdp_step(xp: ModuleType, values: list[np.ndarray], x: Any, y: Any, lr: float,
              world: ad.World) -> tuple[Callable[[], float], FSDP]:
    """The same model as FSDP FULL_SHARD layers (one unit each) over ``world``, SGD."""
    params = parameters_on(xp, values)
    stages = [PipelineStage(layer_forward, first_layer_backward if k == 0 else layer_backward,
                            params[2 * k:2 * k + 2]) for k in range(len(params) // 2)]
    f = FSDP.from_layers(stages, world, loss_fn=mse,
                         sharding_strategy=ShardingStrategy.FULL_SHARD)
    opt = SGD(f.sharded_parameters(), lr=lr)
    return (lambda: f.step(x, y, optimizer=opt)), f


def plain_on(xp: ModuleType, values: list[np.ndarray], x: Any, y: Any,
             lr: float) -> tuple[Callable[[], float], list[Callable[[], None]]]:
    """:func:`plain_step`, and nothing to close."""
    return plain_step(xp, values, x, y, lr), []


def fsdp_on(xp: ModuleType, values: list[np.ndarray], x: Any, y: Any, lr: float,
            make_world: Callable[[], ad.World]) -> tuple[Callable[[], float],
                                                         list[Callable[[], None]]]:
    """:func:`fsdp_step` on a new world; the step, and what closes the wrapper and world."""
    world = make_world()
    backend = world.backend_for("bench_gpu")
    try:
        step, f = fsdp_step(xp, values, x, y, lr, world)
    except BaseException:
        backend.close()
        raise
    return step, [f.close, backend.close]


def fsdp_compare(cp: ModuleType | None, args: argparse.Namespace, batch: int,
                 repeats: int) -> dict[str, Any]:
    """Part 3: plain and FSDP steps on NumPy (and CuPy), timed alternately; their losses."""
    values = initial_values(args.layers, args.width)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch_size, args.width), dtype=np.float32)
    y = rng.standard_normal((args.batch_size, args.width), dtype=np.float32)
    lr = 1e-2
    libs: dict[str, ModuleType] = {"numpy": np}
    if cp is not None:
        cp.cuda.Device(args.device).use()
        libs["cupy"] = cp
    builders: dict[str, Callable[[], tuple[Callable[[], float], list[Callable[[], None]]]]] = {}
    for lib, xp in libs.items():
        xs, ys = xp.asarray(x), xp.asarray(y)
        builders[f"plain {lib}"] = functools.partial(plain_on, xp, values, xs, ys, lr)
        builders[f"FSDP {lib}"] = functools.partial(fsdp_on, xp, values, xs, ys, lr,
                                                    ad.World.mock)
    if cp is not None:  # the GPU's own backend: a one-GPU NCCL world
        builders["FSDP cupy, NCCL world"] = functools.partial(
            fsdp_on, cp, values, cp.asarray(x), cp.asarray(y), lr,
            lambda: ad.World(NcclBackend.create_world([args.device])[0]))
    steps: dict[str, Callable[[], float]] = {}
    first: dict[str, float] = {}
    closers: list[Callable[[], None]] = []
    errors: dict[str, str] = {}
    for name, build in builders.items():
        try:  # a variant that fails is reported, and the others still measured
            step, close = build()
            closers = close + closers
            first[name] = step()
            steps[name] = step
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"bench_gpu: part 3, {name} failed:\n{errors[name]}", file=sys.stderr,
                  flush=True)

    def sync() -> None:
        if cp is not None:
            cp.cuda.Device(args.device).synchronize()

    try:
        times = alternate(steps, batch=batch, repeats=repeats, sync=sync)
        # every variant has now taken the same number of steps on the same data
        last = {name: step() for name, step in steps.items()}
    finally:
        for close in closers:
            close()
    return {"layers": args.layers, "width": args.width, "batch_size": args.batch_size,
            "lr": lr, "batch": batch, "repeats": repeats, "cpu_count": os.cpu_count(),
            "gpu": cp is not None,
            "steps": step_rows(times), "fsdp_over_plain": overhead_rows(times),
            "losses": loss_rows(first, last), "errors": errors}


def loss_rows(first: dict[str, float], last: dict[str, float]) -> list[dict[str, Any]]:
    """Each variant's first and last loss, and its largest relative difference from
    ``plain numpy``'s (``agree``: within :data:`LOSS_TOLERANCE`)."""
    ref_first, ref_last = first["plain numpy"], last["plain numpy"]
    rows = []
    for name in first:
        diff = max(abs(first[name] - ref_first) / max(abs(ref_first), 1e-30),
                   abs(last[name] - ref_last) / max(abs(ref_last), 1e-30))
        rows.append({"variant": name, "first_loss": first[name], "last_loss": last[name],
                     "rel_diff": diff, "agree": diff <= LOSS_TOLERANCE})
    return rows


def step_rows(t: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Table rows: each model on both libraries (step times ``t`` in seconds per batch)."""
    rows = []
    for model in ("plain", "FSDP"):
        row: dict[str, Any] = {"variant": model, "numpy_ms": spread(t[f"{model} numpy"], 1e3)}
        if f"{model} cupy" in t:
            row.update({"cupy_ms": spread(t[f"{model} cupy"], 1e3),
                        "numpy/cupy": ratio_spread(t[f"{model} numpy"], t[f"{model} cupy"])})
        rows.append(row)
    if "FSDP cupy, NCCL world" in t:
        rows.append({"variant": "FSDP, NCCL world",
                     "cupy_ms": spread(t["FSDP cupy, NCCL world"], 1e3),
                     "numpy/cupy": ratio_spread(t["FSDP numpy"], t["FSDP cupy, NCCL world"])})
    return rows


def overhead_rows(t: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Table rows: FSDP's step over the plain loop's on each library."""
    pairs = [("numpy", "FSDP numpy", "plain numpy"), ("cupy", "FSDP cupy", "plain cupy"),
             ("cupy, NCCL world", "FSDP cupy, NCCL world", "plain cupy")]
    return [{"library": lib, "FSDP/plain": ratio_spread(t[a], t[b]),
             "FSDP-plain_ms": spread([x - y for x, y in zip(t[a], t[b])], 1e3)}
            for lib, a, b in pairs if a in t and b in t]


def fsdp_report(part: dict[str, Any]) -> str:
    w = part["width"]
    text = [f"Part 3: training step of an MLP of {part['layers']} layers of {w}x{w} (tanh), "
            f"{part['batch_size']} samples, float32, SGD; plain loop vs FSDP FULL_SHARD "
            "(one-rank mock world, one unit per layer, from_layers); ms per step, median "
            f"(min-max) over {part['repeats']} batches of {part['batch']} steps"
            f"{', GPU synchronized before each clock read' if part['gpu'] else ''}; "
            f"{part['cpu_count']} CPU cores for NumPy."]
    header = ["variant", "numpy ms", "cupy ms", "numpy/cupy"]
    rows = [[r["variant"], format_spread(r["numpy_ms"]) if "numpy_ms" in r else "-",
             format_spread(r["cupy_ms"]) if "cupy_ms" in r else "-",
             format_spread(r["numpy/cupy"]) if "numpy/cupy" in r else "-"]
            for r in part["steps"]]
    text.append(format_table(header, rows))
    text.append("FSDP's cost over the plain loop on the same library:")
    text.append(format_table(["library", "FSDP/plain", "FSDP-plain ms"],
                             [[r["library"], format_spread(r["FSDP/plain"]),
                               format_spread(r["FSDP-plain_ms"])]
                              for r in part["fsdp_over_plain"]]))
    rows = part["losses"]
    losses = ", ".join(f"{r['variant']}: {r['first_loss']:.6g} -> {r['last_loss']:.6g}"
                       for r in rows)
    verdict = "agree" if all(r["agree"] for r in rows) else "DIFFER"
    text.append(f"Losses (first step -> after the timed steps): {losses}; they {verdict} "
                f"(largest relative difference from plain numpy "
                f"{max(r['rel_diff'] for r in rows):.2g}, tolerance {LOSS_TOLERANCE:g}).")
    return "\n".join(text)


# --- driver ---------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (under a minute)")
    parser.add_argument("--json", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--profile", action="store_true",
                        help=f"print a cProfile of {PROFILE_CALLS} blocking 4-byte all-reduces")
    parser.add_argument("--cpu-only", action="store_true",
                        help="no GPU: the NumPy sides of parts 2 and 3 only")
    parser.add_argument("--device", type=int, default=0, help="the GPU id every rank uses")
    parser.add_argument("--staging", choices=["auto", "always", "never"], default="auto",
                        help="part 2: the MPI backend's host_staging option (never hands "
                        "device pointers to MPI: only for a CUDA-aware MPI)")
    parser.add_argument("--layers", type=int, default=4, help="part 3: MLP layers")
    parser.add_argument("--width", type=int, default=2048, help="part 3: layer width")
    parser.add_argument("--batch-size", type=int, default=256, help="part 3: samples per step")
    parser.add_argument("--latency-child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.latency_child and args.cpu_only:
        parser.error("--latency-child times the GPU: it cannot go with --cpu-only")
    for name in ("layers", "width", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def wait_for_rank0(comm: Any) -> None:
    """A barrier that sleeps while it waits (a busy one would take a core from rank 0)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def guarded(name: str, fn: Callable[[], Any], failures: dict[str, str]) -> Any:
    """``fn()``, or None with its traceback kept in ``failures`` (the other parts still run)."""
    try:
        return fn()
    except Exception:
        failures[name] = traceback.format_exc()
        print(f"bench_gpu: {name} failed:\n{failures[name]}", file=sys.stderr, flush=True)
        return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cp = None
    if not args.cpu_only:
        reason = gpu_unavailable_reason()
        if reason is not None:
            sys.exit(f"bench_gpu: cannot run without a CUDA GPU: {reason} (--cpu-only runs "
                     "the NumPy sides)")
        cp = importlib.import_module("cupy")
        count = cp.cuda.runtime.getDeviceCount()
        if not 0 <= args.device < count:
            sys.exit(f"bench_gpu: --device {args.device} is not a visible GPU (valid: "
                     f"0..{count - 1})")
    lat_batch, lat_repeats = (100, 5) if args.quick else (200, 15)
    if args.latency_child and cp is not None:  # the AXONDIST_CHECKS=0 run of part 1
        write_json(args.latency_child, latency(cp, args.device, lat_batch, lat_repeats))
        return {}
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    rank, comm = 0, None
    if launched_by_mpi():
        world = ad.init("mpi", host_staging=args.staging)
        from mpi4py import MPI

        rank, comm = world.rank, MPI.COMM_WORLD
        results["part2"] = staging(cp, world, args.device, 5 if args.quick else 15)
    else:
        results["part2"] = None
    if rank == 0:
        if cp is not None:
            results["part1"] = guarded("part 1", lambda: latency(
                cp, args.device, lat_batch, lat_repeats, args.profile), failures)
            results["part1_checks_off"] = guarded(
                "part 1 with AXONDIST_CHECKS=0", lambda: latency_without_checks(args), failures)
        batch, repeats = (2, 3) if args.quick else (3, 7)
        results["part3"] = guarded("part 3", lambda: fsdp_compare(cp, args, batch, repeats),
                                   failures)
        part3 = results["part3"] or {}
        for name, error in part3.get("errors", {}).items():
            failures[f"part 3 ({name})"] = error
        differ = [r["variant"] for r in part3.get("losses", []) if not r["agree"]]
        if differ:
            failures["part 3 (losses)"] = f"{', '.join(differ)} computed other losses"
        print(report(results, args, failures), flush=True)
        write_json(args.json, {**results, "failures": failures})
    if comm is not None:
        wait_for_rank0(comm)
    if failures:
        sys.exit(f"bench_gpu: {', '.join(failures)} failed (tracebacks above)")
    return results


def report(results: dict[str, Any], args: argparse.Namespace,
           failures: dict[str, str]) -> str:
    text = []
    part1 = results.get("part1")
    if part1 is not None:
        text.append(latency_report(part1, results.get("part1_checks_off")))
        if part1["profile"]:
            text.append(part1["profile"])
    elif args.cpu_only:
        text.append("Part 1 (NCCL latency) skipped: --cpu-only.")
    if results["part2"] is not None:
        text.append(staging_report(results["part2"]))
    else:
        text.append("Part 2 (CuPy through MPI host staging vs NumPy) skipped: not launched by "
                    "mpiexec; run: mpiexec -n 2 python benchmarks/bench_gpu.py")
    if results.get("part3") is not None:
        text.append(fsdp_report(results["part3"]))
    for name, error in failures.items():
        text.append(f"{name} FAILED: {error.strip().splitlines()[-1]}")
    text.append(ONE_GPU_NOTE)
    return "\n\n".join(text)


if __name__ == "__main__":
    main()
