"""FSDP: axondist against torch FSDP2 under mpiexec; memory and time per strategy in the mock world.

    mpiexec -n 2 python benchmarks/bench_fsdp.py [--json results.json] [--repeats N] [--quick]
    python benchmarks/bench_fsdp.py [--json results.json] [--repeats N] [--quick]

Under mpiexec (the comparison): an MLP of 8 layers of width 2048 (a 2048x2048
matrix and a bias each, tanh; 33.6M float32 parameters, 128 MiB), Adam,
32 samples per rank, one FSDP unit per layer, FULL_SHARD, the same initial
values everywhere; the first layer computes no gradient for its input, as
torch's autograd does not. Variants:

* ``axondist one-call``: ``FSDP.from_layers(...)`` and ``fsdp.step(x, y,
  optimizer=opt)``: one layer's unit gathered at a time, the next one's
  all-gather prefetched, resharded after forward (the default);
* ``axondist one-call, no prefetch``: the same with ``prefetch=False``;
* ``axondist unit loop``: the loop a user writes with ``gather_parameters(u)``,
  ``reshard_parameters(u)`` and ``sync_gradients(u)``, no prefetch;
* ``axondist grad_fn step``: ``fsdp.step(grad_fn, x, y, ...)`` with a
  whole-model gradient function (every unit gathered during it);
* ``torch FSDP2``: ``fully_shard`` on each Linear and the root, gloo, one
  thread, ``torch.optim.Adam``; skipped, with a line saying so, without torch.

Step time: ``_common.alternate`` with ``comm=``, the variants in balanced
order, an untimed step before each batch; each batch is the slowest rank's
time; ``median (min-max)`` over the repeats, and the paired ratio to torch.
Memory is process memory, measured per variant in its own phase before any
timing (glibc set to return every freed buffer over 128 KiB to the system at
once, so one phase's leftovers do not hide the next one's allocations; the
timing then runs with glibc's warmed-up thresholds, see ``set_malloc``): build
it, take one step (Adam's state appears), reset the kernel's high-water mark
(``/proc/self/clear_refs``), take 3 steps, read ``VmHWM``. ``state MiB`` is
the RSS the variant added by then (shards, Adam state), ``step peak MiB`` how
far the 3 steps rose above it, ``variant peak MiB`` their sum (the target's
measure) and ``process peak MiB`` the whole process's ``VmHWM``; each the
maximum over ranks.
The first step's loss of every variant is printed too: the same model gives
the same loss. Targets: the one-call step >= 2x faster than torch FSDP2; the
one-call step at most 1.05x the unit loop's time; its variant peak at most
the unit loop's without prefetch, and at most one unit (16 MiB) more with it
(both within 1 MiB: RSS moves by pages and small Python objects).

With plain Python it measures in-process mock worlds of 2 and 4 ranks
(:func:`axondist.spawn`): an MLP of 8 layers of width 384, one row per
sharding strategy, stepped with the ``grad_fn`` step. ``resident MiB`` and
``held in step MiB`` are axondist's own accounting (``memory_stats``: the arrays
the wrapper and optimizer hold, between steps and inside ``grad_fn`` with
every unit gathered), ``model MiB`` the estimate (``memory_estimate``),
``vs NO_SHARD`` resident bytes over NO_SHARD's, ``step ms`` and ``time ratio``
(to NO_SHARD) paired as above.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common
if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")  # one thread per rank, as torch gets (start_gloo)

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    start_gloo,
    write_json,
)

import axondist as ad  # noqa: E402
from axondist import comm  # noqa: E402
from axondist.fsdp import FSDP, MixedPrecision, ShardingStrategy  # noqa: E402
from axondist.launching.worlds import launched_by_mpi  # noqa: E402
from axondist.optim import Adam  # noqa: E402
from axondist.pipeline import PipelineStage  # noqa: E402

RUNNER = {"ranks": 2, "quick_args": ["--quick"], "timeout": 600}

LAYERS, WIDTH, BATCH = 8, 384, 16
MIB = 2**20


class MLP:
    """``h = tanh(h @ W_l + b_l)`` for each layer; loss ``0.5 * mean |h_L - y|^2``."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.params = []
        for layer in range(LAYERS):
            w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            self.params += [ad.Parameter(w, f"l{layer}.w"),
                            ad.Parameter(np.zeros(WIDTH, np.float32), f"l{layer}.b")]

    def parameters(self) -> list[ad.Parameter]:
        return self.params

    def units(self) -> list[list[int]]:
        return [[2 * layer, 2 * layer + 1] for layer in range(LAYERS)]


def grad_fn(arrays: list[Any], x: np.ndarray, y: np.ndarray) -> tuple[float, list[Any]]:
    acts = [x]
    for layer in range(LAYERS):
        w, b = arrays[2 * layer], arrays[2 * layer + 1]
        acts.append(np.tanh(acts[-1] @ w.astype(np.float32) + b.astype(np.float32)))
    diff = acts[-1] - y
    loss = 0.5 * float(np.mean(np.sum(diff * diff, axis=1)))
    delta = diff / len(x)
    grads: list[Any] = [None] * len(arrays)
    for layer in reversed(range(LAYERS)):
        delta = delta * (1.0 - acts[layer + 1] ** 2)
        dtype = arrays[2 * layer].dtype
        grads[2 * layer] = (acts[layer].T @ delta).astype(dtype)
        grads[2 * layer + 1] = delta.sum(axis=0).astype(dtype)
        delta = delta @ arrays[2 * layer].astype(np.float32).T
    return loss, grads


def variants(world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "NO_SHARD": {"sharding_strategy": ShardingStrategy.NO_SHARD},
        "SHARD_GRAD_OP": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        "FULL_SHARD": {"sharding_strategy": ShardingStrategy.FULL_SHARD},
        "FULL_SHARD bf16": {"sharding_strategy": ShardingStrategy.FULL_SHARD,
                            "mixed_precision": MixedPrecision("bfloat16", "bfloat16")},
    }
    if world_size % 2 == 0 and world_size >= 4:
        out["HYBRID_SHARD"] = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD,
                               "ranks_per_node": world_size // 2}
    return out


def run_rank(world: ad.World, repeats: int, batch: int) -> list[dict[str, Any]] | None:
    """Every rank measures; rank 0 returns the rows (the per-rank maxima)."""
    rng = np.random.default_rng([1, world.rank])
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    setups: dict[str, tuple[FSDP, Adam, dict[str, int]]] = {}
    for name, kwargs in variants(world.world_size).items():
        f = FSDP(MLP(), world, **kwargs)
        opt = Adam(f.sharded_parameters(), lr=1e-3)
        f.register_optimizer(opt)
        setups[name] = (f, opt, {"peak": 0})

    def stepper(name: str) -> Any:
        f, opt, peak = setups[name]

        def measured_grad_fn(arrays: list[Any], xb: Any, yb: Any) -> Any:
            result = grad_fn(arrays, xb, yb)
            for p, g in zip(f.full_parameters(), result[1]):
                p.grad = g  # so memory_stats sees the full gradients too
            peak["peak"] = max(peak["peak"], f.memory_stats().total_bytes_per_rank)
            return result

        return lambda: f.step(measured_grad_fn, x, y, optimizer=opt)

    times = alternate({name: stepper(name) for name in setups}, batch=batch, repeats=repeats,
                      sync=lambda: comm.barrier(world))
    every = comm.all_gather_object(times, world)  # each batch: the slowest rank's time
    times = {k: [max(batch) for batch in zip(*(t[k] for t in every))] for k in times}
    rows = []
    base_resident = None
    for name, (f, _opt, peak) in setups.items():
        resident = f.memory_stats().total_bytes_per_rank
        mine = [resident, peak["peak"], f.memory_estimate().total_bytes_per_rank]
        worst = comm.all_gather_object(mine, world)
        resident, peak_b, model_b = (max(col) for col in zip(*worst))
        base_resident = base_resident or resident
        rows.append({"ranks": world.world_size, "strategy": name,
                     "resident MiB": resident / MIB, "held in step MiB": peak_b / MIB,
                     "model MiB": model_b / MIB, "vs NO_SHARD": resident / base_resident,
                     "step ms": spread(times[name], 1e3),
                     "time ratio": ratio_spread(times[name], times["NO_SHARD"])})
    return rows if world.rank == 0 else None


HEADER = ["ranks", "strategy", "resident MiB", "held in step MiB", "model MiB", "vs NO_SHARD",
          "step ms", "time ratio"]


# --- under mpiexec: axondist against torch FSDP2, process memory -------------------------------

C_LAYERS, C_WIDTH, C_BATCH = 8, 2048, 32
C_UNIT_MIB = (C_WIDTH * C_WIDTH + C_WIDTH) * 4 / MIB  # one layer's full parameters
SLACK_MIB = 1.0  # RSS moves by pages and small Python objects: equal within this is equal
ONE_CALL, NO_PREFETCH, UNIT_LOOP, GRAD_FN, TORCH = (
    "axondist one-call", "axondist one-call, no prefetch", "axondist unit loop",
    "axondist grad_fn step", "torch FSDP2")


def initial_values() -> list[np.ndarray]:
    """Every layer's (weight, bias), the same on every rank and for every variant."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(C_LAYERS):
        out.append(rng.standard_normal((C_WIDTH, C_WIDTH), dtype=np.float32)
                    / np.float32(np.sqrt(C_WIDTH)))
        out.append(np.zeros(C_WIDTH, np.float32))
    return out


def layer_forward(pa: list[Any], x: Any) -> tuple[Any, Any]:
    w, b = pa
    h = x @ w
    h += b
    np.tanh(h, out=h)
    return h, (x, h)


def layer_backward(pa: list[Any], saved: Any, gy: Any,
                   need_input: bool = True) -> tuple[Any, list[Any]]:
    w, _ = pa
    x, h = saved
    d = h * h  # tanh' = 1 - h^2, computed in place
    np.subtract(1.0, d, out=d)
    d *= gy
    return d @ w.T if need_input else None, [x.T @ d, d.sum(axis=0)]


def first_layer_backward(pa: list[Any], saved: Any, gy: Any) -> tuple[Any, list[Any]]:
    """The first layer's backward: the input needs no gradient (torch's autograd skips it too)."""
    return layer_backward(pa, saved, gy, need_input=False)


def backward_of(layer: int) -> Any:
    return first_layer_backward if layer == 0 else layer_backward


def mse(y: Any, target: Any) -> tuple[float, Any]:
    d = y - target
    return 0.5 * float(np.mean(np.sum(d * d, axis=1))), d / len(y)


def np_params() -> list[ad.Parameter]:
    return [ad.Parameter(v, f"l{k // 2}.{'wb'[k % 2]}") for k, v in enumerate(initial_values())]


def layer_units() -> list[list[int]]:
    return [[2 * k, 2 * k + 1] for k in range(C_LAYERS)]


def build_one_call(world: ad.World, x: Any, y: Any, prefetch: bool) -> Any:
    params = np_params()
    layers = [PipelineStage(layer_forward, backward_of(k), params[2 * k:2 * k + 2])
              for k in range(C_LAYERS)]
    f = FSDP.from_layers(layers, world, loss_fn=mse, prefetch=prefetch)
    opt = Adam(f.sharded_parameters(), lr=1e-4)
    return lambda: f.step(x, y, optimizer=opt)


def build_unit_loop(world: ad.World, x: Any, y: Any) -> Any:
    f = FSDP(np_params(), world, units=layer_units())
    opt = Adam(f.sharded_parameters(), lr=1e-4)
    full = f.full_parameters()

    def step() -> float:
        h, saved = x, []
        for u in range(C_LAYERS):
            f.gather_parameters(u)
            h, s = layer_forward([full[2 * u].data, full[2 * u + 1].data], h)
            saved.append(s)
            f.reshard_parameters(u)
        loss, g = mse(h, y)
        for u in reversed(range(C_LAYERS)):
            f.gather_parameters(u)
            g, (full[2 * u].grad, full[2 * u + 1].grad) = backward_of(u)(
                [full[2 * u].data, full[2 * u + 1].data], saved[u], g)
            saved[u] = None
            f.reshard_parameters(u)
            f.sync_gradients(u)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def whole_model_grad_fn(arrays: list[Any], x: Any, y: Any) -> tuple[float, list[Any]]:
    h, saved = x, []
    for u in range(C_LAYERS):
        h, s = layer_forward(arrays[2 * u:2 * u + 2], h)
        saved.append(s)
    loss, g = mse(h, y)
    grads: list[Any] = [None] * len(arrays)
    for u in reversed(range(C_LAYERS)):
        g, grads[2 * u:2 * u + 2] = backward_of(u)(arrays[2 * u:2 * u + 2], saved[u], g)
    return loss, grads


def build_grad_fn(world: ad.World, x: Any, y: Any) -> Any:
    f = FSDP(np_params(), world, units=layer_units())
    opt = Adam(f.sharded_parameters(), lr=1e-4)
    return lambda: f.step(whole_model_grad_fn, x, y, optimizer=opt)


def build_torch(x: Any, y: Any) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(C_WIDTH, C_WIDTH),
                                                      torch.nn.Tanh())
                                  for _ in range(C_LAYERS)])
    values = initial_values()
    with torch.no_grad():
        for k, block in enumerate(model):
            block[0].weight.copy_(torch.from_numpy(values[2 * k].T.copy()))
            block[0].bias.copy_(torch.from_numpy(values[2 * k + 1]))
    del values
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step() -> float:
        out = model(tx)
        loss = 0.5 * ((out - ty) ** 2).sum(dim=1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    return step


def proc_status(field: str) -> int:
    """``field`` of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"bench_fsdp: /proc/self/status has no {field}")


def reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (VmHWM := VmRSS)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def set_malloc(mmap_threshold: int) -> bool:
    """Fix glibc's mmap threshold (and its heap trim threshold at twice that), for every variant.

    By default glibc raises the threshold after the first large free, so later
    buffers come from a heap that keeps its pages after a free: RSS would then
    depend on which variant ran before. Fixed at 128 KiB for the memory phases
    (a freed array leaves RSS at once, in every phase alike); at 32 MiB (the
    most glibc would raise it to) for the timing, where a warmed-up process
    reuses freed heap pages instead of faulting fresh ones in on every step.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
                    and libc.mallopt(-1, 2 * mmap_threshold))  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def memory_phase(build: Any, comm: Any, steps: int = 3) -> dict[str, Any]:
    """Build one variant, step it, measure (see the module docstring), drop it."""
    gc.collect()
    comm.Barrier()
    before = proc_status("VmRSS")
    step = build()
    first_loss = step()
    gc.collect()
    comm.Barrier()
    exact = reset_peak()
    base = proc_status("VmRSS")
    for _ in range(steps):
        step()
    peak = proc_status("VmHWM")
    del step
    gc.collect()
    mine = [base - before, peak - base, peak - before, peak]
    worst = [max(col) for col in zip(*comm.allgather(mine))]
    return {"state MiB": worst[0] / MIB, "step peak MiB": worst[1] / MIB,
            "variant peak MiB": worst[2] / MIB, "process peak MiB": worst[3] / MIB,
            "first loss": first_loss, "peak reset": all(comm.allgather(exact))}


def compare(world: ad.World, repeats: int, batch: int) -> dict[str, Any]:
    """Every rank measures; the same results come back on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng([1, world.rank])
    x = rng.standard_normal((C_BATCH, C_WIDTH), dtype=np.float32)
    y = rng.standard_normal((C_BATCH, C_WIDTH), dtype=np.float32)
    fixed = set_malloc(128 * 1024)
    dist = start_gloo(comm)
    builders = {ONE_CALL: lambda: build_one_call(world, x, y, True),
                NO_PREFETCH: lambda: build_one_call(world, x, y, False),
                UNIT_LOOP: lambda: build_unit_loop(world, x, y),
                GRAD_FN: lambda: build_grad_fn(world, x, y)}
    if dist is not None:
        builders[TORCH] = lambda: build_torch(x, y)
    memory = {name: memory_phase(build, comm) for name, build in builders.items()}
    fixed = set_malloc(32 * MIB) and fixed
    steps = {name: build() for name, build in builders.items()}
    times = alternate(steps, batch=batch, repeats=repeats, comm=comm)
    if dist is not None:
        dist.destroy_process_group()
    return {"world_size": world.world_size, "repeats": repeats, "batch": batch,
            "memory": memory, "times": times, "torch": dist is not None,
            "fixed mmap threshold": all(comm.allgather(fixed))}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Rows per variant, ratios and the targets."""
    times, memory = results["times"], results["memory"]
    rows = []
    for name, t in times.items():
        row = {"variant": name, "step ms": spread(t, 1e3), **memory[name]}
        if TORCH in times:
            row["torch time / this"] = ratio_spread(times[TORCH], t)
        row["this / unit loop"] = ratio_spread(t, times[UNIT_LOOP])
        rows.append(row)
    loop_peak = memory[UNIT_LOOP]["variant peak MiB"]
    targets = {
        "one-call <= 1.05x unit loop time":
            ratio_spread(times[ONE_CALL], times[UNIT_LOOP])["median"] <= 1.05,
        "one-call (no prefetch) peak <= unit loop's (+1 MiB slack)":
            memory[NO_PREFETCH]["variant peak MiB"] <= loop_peak + SLACK_MIB,
        "one-call peak <= unit loop's + 1 unit (the prefetch)":
            memory[ONE_CALL]["variant peak MiB"] <= loop_peak + C_UNIT_MIB + SLACK_MIB,
    }
    if TORCH in times:
        targets["one-call >= 2x faster than torch FSDP2"] = (
            ratio_spread(times[TORCH], times[ONE_CALL])["median"] >= 2.0)
    return {"comparison": rows, "targets": targets}


C_HEADER = ["variant", "step ms", "torch time / this", "this / unit loop", "state MiB",
            "step peak MiB", "variant peak MiB", "process peak MiB", "first loss"]


def print_comparison(results: dict[str, Any], summary: dict[str, Any]) -> None:
    print(f"FSDP FULL_SHARD, {results['world_size']} ranks, {C_LAYERS} x {C_WIDTH} MLP "
          f"({C_LAYERS * (C_WIDTH + 1) * C_WIDTH * 4 / MIB:.0f} MiB float32), Adam, {C_BATCH} "
          f"samples per rank; step ms: median (min-max) over {results['repeats']} batches of "
          f"{results['batch']} steps, slowest rank; memory: process RSS, maximum over ranks")
    def cell(row: dict[str, Any], h: str) -> Any:
        v = row.get(h, "-")
        if isinstance(v, dict):
            return format_spread(v)
        return f"{v:.1f}" if h.endswith("MiB") else f"{v:.6g}" if h == "first loss" else v

    rows = [[cell(r, h) for h in C_HEADER] for r in summary["comparison"]]
    print(format_table(C_HEADER, rows))
    if not results["torch"]:
        print("torch FSDP2: not measured (torch is not installed); its rows and target are "
              "skipped")
    if not results["fixed mmap threshold"]:
        print("note: mallopt failed: RSS may keep freed heap pages between phases")
    if not all(m["peak reset"] for m in results["memory"].values()):
        print("note: /proc/self/clear_refs was not writable: step peaks are since process start")
    print(format_table(["target", "met"], [(k, "met" if v else "MISSED")
                                           for k, v in summary["targets"].items()]))


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per variant")
    parser.add_argument("--batch", type=int, default=3, help="steps per timed batch")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 2 steps")
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    repeats, batch = (3, 2) if args.quick else (args.repeats, args.batch)
    if launched_by_mpi():
        world = ad.init("mpi")
        results = compare(world, repeats, batch)
        summary = summarize(results)
        if world.rank == 0:
            print_comparison(results, summary)
            write_json(args.json, {**summary, "missing_peers": {} if results["torch"] else
                                   {"torch FSDP2": "torch not installed"}})
        return summary
    rows: list[dict[str, Any]] = []
    for size in (2, 4):
        rows += ad.spawn(run_rank, size, repeats, batch, timeout=600)[0]
    print(format_table(HEADER, [[format_spread(r[h]) if isinstance(r[h], dict) else r[h]
                                 for h in HEADER] for r in rows]))
    write_json(args.json, {"fsdp": rows})
    return rows


if __name__ == "__main__":
    main()
