"""Slow links: all-reduce and DDP on a simulated 2-host cluster with delayed, limited links.

    sudo python benchmarks/bench_cluster.py [--json results.json] [--repeats N]
        [--delay-ms 5] [--rate-mbit 1000] [--per-host 2]

Builds the simulated cluster of ``tests/cluster/simcluster.py`` with slow links: each
host's cable goes through the userspace relay of ``tests/cluster/relay.py`` (this kernel
has no ``netem``), which delays every frame ``--delay-ms`` one way and carries at most
``--rate-mbit`` each way. Ranks 0, 1 run on node0 and 2, 3 on node1 (``--per-host 1``:
one each). The machine's cores are shared by every rank and the relay (2 cores here), so
compute-heavy figures are pessimistic. Needs root; prints why and exits 0 otherwise.
Every figure is the median (min-max) over timed batches, each the slowest rank's time,
ratios paired batch by batch (``_common``). Rank 0 switches the relay's delay off and on
(signals) for the "no delay" figures, so those pairs share one cluster and one job.

* all-reduce of 4 KiB to 64 MiB float32: axondist vs raw mpi4py ``Allreduce`` (target:
  axondist <= 1.1x raw from 4 MiB; the 4 KiB row is the latency, the 64 MiB row's bus
  bandwidth the links'), and :class:`axondist.HierarchicalAllReduce` vs the flat one.
* ``python -m axondist tune``'s sweeps on the same links (all-reduce sizes, and
  OVERLAPPED's pipelined pieces), and the bucket and piece it picks (saved to a settings
  file, which the tuned DDP gets through ``tune.tuned_ddp_options``).
* DDP on a 95 MiB model (160 arrays): gradient sync alone with 25 MiB buckets vs the
  tuned size (no target: the pick is meant for OVERLAPPED only, since a sync alone
  can only gain from fewer, bigger buckets; the ratio shows what a pick would cost a
  SYNCHRONOUS step) and vs buckets summed by
  ``HierarchicalAllReduce.hook`` (no target); with the delay vs without it (target:
  <= 1.5x); and a backward step whose compute (a sleep per array, as a GPU kernel leaves
  the CPU free) lasts as long as the sync: SYNCHRONOUS vs OVERLAPPED (target: OVERLAPPED
  step <= 1.25x max(compute, sync), where SYNCHRONOUS pays their sum); OVERLAPPED with
  pieces of 1 to 16 MiB and of whole 25 MiB buckets (torch DDP's default: a bucket
  reduced once all its gradients are in) vs the default 4 MiB (the sweep), and with what
  ``tuned_ddp_options`` gives from the tune file (its piece and bucket) vs the sweep's
  best piece (target: <= 1.05x), vs 16 MiB pieces, too big for these links, and vs whole
  25 MiB buckets (targets: <= 0.95x). The tuned step against the default one has no target: the
  default 4 MiB piece was itself chosen on these links (the sweep shows it is the best
  here, 2 MiB within noise), so a pick can at best tie it; the targets test what
  ``tune`` controls, that it finds the best piece and avoids a bad one. Last, OVERLAPPED
  with its progress helper (on by itself across hosts) vs without
  (``progress_interval = 0``; no target).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_ROOT, _HERE, os.path.join(_ROOT, "tests")]  # axondist, _common, cluster

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    alternate,
    format_size,
    format_spread,
    format_table,
    ratio_spread,
    spread,
    write_json,
)
from cluster.simcluster import SimCluster, SlowLinks, why_no_cluster  # noqa: E402

import axondist as ad  # noqa: E402
from axondist import tune  # noqa: E402
from axondist.ddp import DDP, GradSyncStrategy  # noqa: E402

RUNNER = {"quick_args": ["--repeats", "3"], "timeout": 900}
RELAY_PID = "BENCH_RELAY_PID"  # the relay's process id, for rank 0 to signal

DEFAULT_BUCKET_MB = 25.0
SIZES = [4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
TUNE_SIZES = [256 << 10 << k for k in range(9)]  # 256 KiB .. 64 MiB
# OVERLAPPED pieces timed against the default; a piece of a whole bucket (25 MiB) is what
# torch's DDP does by default: each bucket reduced whole once all its gradients are in.
PIECE_SWEEP_MB = (1.0, 2.0, 4.0, 8.0, 16.0, DEFAULT_BUCKET_MB)
BAD_PIECE_MB = 16.0  # a piece too big for these links: the tuned one must beat it


def model_shapes(layers: int = 40) -> list[tuple[int, ...]]:
    """160 arrays, 24.95M float32 values (95 MiB), as bench_ddp's model."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(640, 512), (640,), (512, 576), (512,)]
    return shapes


# --- on every rank ----------------------------------------------------------------------

class DelaySwitch:
    """Switches the relay's delay on or off from rank 0 (signals: SIGUSR1 on, SIGUSR2
    off), then a barrier; a no-op when already so. Every rank calls it."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.pid = int(os.environ.get(RELAY_PID, "0"))
        self.on = True

    def __call__(self, on: bool) -> None:
        if on == self.on or not self.pid:
            return
        if self.comm.rank == 0:
            os.kill(self.pid, signal.SIGUSR1 if on else signal.SIGUSR2)
        self.comm.Barrier()
        self.on = on


def all_reduce_part(world: ad.World, mpi: Any, repeats: int) -> list[dict[str, Any]]:
    comm = mpi.COMM_WORLD
    hierarchical = ad.HierarchicalAllReduce(world, min_bytes=0)  # three steps at every size
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.ones(nbytes // 4, np.float32)
        variants = {"axondist": lambda x=x: ad.all_reduce(x),
                    "raw": lambda y=y: comm.Allreduce(mpi.IN_PLACE, y, mpi.SUM)}
        if hierarchical.is_hierarchical:
            variants["hierarchical"] = lambda x=x: hierarchical(x)
        batch = max(1, min(20, (16 << 20) // nbytes))
        times = alternate(variants, batch=batch, repeats=repeats, comm=comm)
        busbw = [tune.bus_bandwidth(nbytes, t, world.world_size) / 1e6 for t in times["raw"]]
        row = {"size": nbytes, "axondist_ms": spread(times["axondist"], 1e3),
               "raw_ms": spread(times["raw"], 1e3), "raw_busbw_MBps": spread(busbw),
               "axondist/raw": ratio_spread(times["axondist"], times["raw"])}
        if "hierarchical" in times:
            row["hierarchical_ms"] = spread(times["hierarchical"], 1e3)
            row["hierarchical/flat"] = ratio_spread(times["hierarchical"], times["axondist"])
        rows.append(row)
    hierarchical.close()
    return rows


def _ddp(shapes: list[tuple[int, ...]], strategy: GradSyncStrategy, bucket_mb: float,
         grad_fn: Any, compression: Any = None, piece_bytes: int | None = None) -> DDP:
    params = [ad.Parameter(np.full(s, 0.01, np.float32)) for s in shapes]
    ddp = DDP(params, strategy=strategy, bucket_cap_mb=bucket_mb, piece_bytes=piece_bytes,
              grad_fn=grad_fn, init_sync=False, compression=compression)
    for p in params:
        p.grad = np.full(p.shape, ddp.process_group.rank + 1.0, np.float32)
    ddp.sync_gradients()  # packs once; every .grad becomes its bucket view
    n = ddp.process_group.world_size
    if not np.allclose(params[0].grad, (n + 1) / 2):
        raise RuntimeError("bench_cluster: DDP did not average the gradients")
    return ddp


def _overlapped(shapes: list[tuple[int, ...]], grad_fn: Any, tune_file: str, *,
                piece_mb: float | None = None, tuned: bool = False, helper: bool = True) -> DDP:
    """An OVERLAPPED DDP with 25 MiB buckets and ``piece_mb`` pieces (None: the default), or
    (``tuned``) with the sizes ``tune.tuned_ddp_options`` gives from the settings file
    ``tune_file``."""
    if tuned:
        options = tune.tuned_ddp_options(ad.current_world(), tune_file)
        ddp = _ddp(shapes, GradSyncStrategy.OVERLAPPED, options["bucket_cap_mb"], grad_fn,
                   piece_bytes=options["piece_bytes"])
    else:
        ddp = _ddp(shapes, GradSyncStrategy.OVERLAPPED, DEFAULT_BUCKET_MB, grad_fn)
    if piece_mb is not None or not helper:
        ddp.synchronizer.close()  # the next step sets up its pieces again, as set here
        if piece_mb is not None:
            ddp.synchronizer.piece_bytes = round(piece_mb * 2**20)
        if not helper:
            ddp.synchronizer.progress_interval = 0
    return ddp


def ddp_part(mpi: Any, repeats: int, tuned_mb: float, delay: DelaySwitch,
             tune_file: str) -> dict[str, Any]:
    comm = mpi.COMM_WORLD
    shapes = model_shapes()
    grads = [np.full(s, 0.5, np.float32) for s in shapes]
    pause = [0.0]  # seconds of "compute" per array, set once the sync time is known

    def grad_fn(arrays: list[Any]) -> Any:
        for i in reversed(range(len(arrays))):
            time.sleep(pause[0])
            yield i, grads[i]
        return 0.0

    alone = {f"sync {name}": _ddp(shapes, GradSyncStrategy.SYNCHRONOUS, mb, None).sync_gradients
             for name, mb in (("default", DEFAULT_BUCKET_MB), ("tuned", tuned_mb))}
    hierarchical = ad.HierarchicalAllReduce(ad.current_world())
    if hierarchical.is_hierarchical:
        alone["sync hierarchical"] = _ddp(shapes, GradSyncStrategy.SYNCHRONOUS,
                                          DEFAULT_BUCKET_MB, None,
                                          hierarchical.hook).sync_gradients
    sync_times = alternate(alone, batch=1, repeats=repeats, comm=comm, prime=False)
    default_sync = alone["sync default"]

    def switched(on: bool) -> Callable[[], None]:
        def call() -> None:
            delay(on)  # in the untimed first call of each batch (prime)
            default_sync()
        return call

    delay_times = alternate({"delay": switched(True), "no delay": switched(False)}, batch=1,
                            repeats=repeats, comm=comm)
    delay(True)
    compute = float(np.median(sync_times["sync default"]))
    pause[0] = compute / len(shapes)
    made = {"sync default": _ddp(shapes, GradSyncStrategy.SYNCHRONOUS, DEFAULT_BUCKET_MB,
                                 grad_fn),
            "overlapped default": _overlapped(shapes, grad_fn, tune_file),
            "overlapped tuned": _overlapped(shapes, grad_fn, tune_file, tuned=True),
            "overlapped no helper": _overlapped(shapes, grad_fn, tune_file, helper=False)}
    default_piece = made["overlapped default"].synchronizer.piece_bytes
    tuned_piece = made["overlapped tuned"].synchronizer.piece_bytes
    for mb in PIECE_SWEEP_MB:
        if round(mb * 2**20) != default_piece:
            made[f"overlapped piece {mb:g} MiB"] = _overlapped(shapes, grad_fn, tune_file,
                                                               piece_mb=mb)
    steps: dict[str, Callable[[], None]] = {}
    for name, ddp in made.items():
        def step(ddp: DDP = ddp) -> None:
            for p in ddp.parameters():
                p.grad[...] = 0
            ddp.backward()

        steps[name] = step

    def compute_only() -> None:
        for _ in grad_fn(grads):
            pass

    steps["compute only"] = compute_only
    step_times = alternate(steps, batch=1, repeats=repeats, comm=comm, prime=False)
    bound = [max(c, compute) for c in sync_times["sync default"]]
    hierarchical_ratio = (ratio_spread(sync_times["sync hierarchical"],
                                       sync_times["sync default"])
                          if "sync hierarchical" in sync_times else None)
    swept = {f"{mb:g} MiB": step_times.get(f"overlapped piece {mb:g} MiB",
                                           step_times["overlapped default"])
             for mb in PIECE_SWEEP_MB}  # the default piece's row is the default step
    best = min(swept, key=lambda k: float(np.median(swept[k])))
    return {
        "compute_s": compute, "tuned_mb": tuned_mb,
        "tuned_piece_mb": None if tuned_piece is None else tuned_piece / 2**20,
        "default_piece_mb": None if default_piece is None else default_piece / 2**20,
        "piece/default step": {k: ratio_spread(v, step_times["overlapped default"])
                               for k, v in swept.items()},
        "best piece": best,
        "overlapped tuned/best piece step": ratio_spread(step_times["overlapped tuned"],
                                                         swept[best]),
        "overlapped tuned/bad piece step": ratio_spread(step_times["overlapped tuned"],
                                                        swept[f"{BAD_PIECE_MB:g} MiB"]),
        "overlapped tuned/whole bucket step": ratio_spread(
            step_times["overlapped tuned"], swept[f"{DEFAULT_BUCKET_MB:g} MiB"]),
        "hierarchical/default sync": hierarchical_ratio,
        "sync_s": {k: spread(v) for k, v in sync_times.items()},
        "delay_sync_s": {k: spread(v) for k, v in delay_times.items()},
        "delay/no delay sync": ratio_spread(delay_times["delay"], delay_times["no delay"]),
        "step_s": {k: spread(v) for k, v in step_times.items()},
        "tuned/default sync": ratio_spread(sync_times["sync tuned"], sync_times["sync default"]),
        "sync step/max(compute, sync)": ratio_spread(step_times["sync default"], bound),
        "overlapped step/max(compute, sync)": ratio_spread(step_times["overlapped default"],
                                                           bound),
        "overlapped tuned/default step": ratio_spread(step_times["overlapped tuned"],
                                                      step_times["overlapped default"]),
        "overlapped default/no helper step": ratio_spread(step_times["overlapped default"],
                                                          step_times["overlapped no helper"]),
    }


def rank_main(args: argparse.Namespace) -> None:
    from mpi4py import MPI  # noqa: PLC0415 - only the ranks load MPI

    world = ad.init()
    results: dict[str, Any] = {"world_size": world.world_size, "per_host": args.per_host,
                               "delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit,
                               "repeats": args.repeats}
    results["all_reduce"] = all_reduce_part(world, MPI, args.repeats)
    settings = tune.tune(world, TUNE_SIZES, repeats=3)
    results["tune"] = [{"size": p.nbytes, "busbw_MBps": p.busbw / 1e6} for p in settings.sweep]
    results["tune_fit"] = {"latency_s": settings.latency, "bandwidth_Bps": settings.bandwidth}
    results["tune_pieces"] = [{"size": p.nbytes, "ms": p.seconds * 1e3}
                              for p in settings.piece_sweep]
    tune_file = args.rank_out + ".tune.json"  # what the tuned DDP reads (rank 0)
    if world.rank == 0:
        tune.save_settings(settings, tune_file)
    MPI.COMM_WORLD.Barrier()
    results["ddp"] = ddp_part(MPI, args.repeats, settings.bucket_cap_mb,
                              DelaySwitch(MPI.COMM_WORLD), tune_file)
    if world.rank == 0:
        Path(args.rank_out).write_text(json.dumps(results))


# --- the driver (one process, root) ------------------------------------------------------

def _targets(results: dict[str, Any]) -> dict[str, bool]:
    ddp = results["ddp"]
    big = [r for r in results["all_reduce"] if r["size"] >= 4 << 20]
    return {
        "axondist all_reduce <= 1.1x raw from 4 MiB": all(r["axondist/raw"]["median"] <= 1.1
                                                          for r in big),
        "tuned OVERLAPPED step <= 1.05x the best swept piece's":
            ddp["overlapped tuned/best piece step"]["median"] <= 1.05,
        f"tuned OVERLAPPED step <= 0.95x with {BAD_PIECE_MB:g} MiB pieces":
            ddp["overlapped tuned/bad piece step"]["median"] <= 0.95,
        f"tuned OVERLAPPED step <= 0.95x with whole {DEFAULT_BUCKET_MB:g} MiB buckets":
            ddp["overlapped tuned/whole bucket step"]["median"] <= 0.95,
        f"DDP sync with {results['delay_ms']:g} ms delay <= 1.5x no delay":
            ddp["delay/no delay sync"]["median"] <= 1.5,
        "OVERLAPPED step <= 1.25x max(compute, sync)":
            ddp["overlapped step/max(compute, sync)"]["median"] <= 1.25,
    }


def _all_reduce_table(rows: list[dict[str, Any]]) -> str:
    hier = "hierarchical/flat" in rows[0]
    header = ["size", "axondist ms", "raw ms", "axondist/raw", "raw busbw MB/s"]
    header += ["hierarchical ms", "hierarchical/flat"] if hier else []
    body = []
    for r in rows:
        cells = [format_size(r["size"]), format_spread(r["axondist_ms"]),
                 format_spread(r["raw_ms"]), format_spread(r["axondist/raw"]),
                 format_spread(r["raw_busbw_MBps"])]
        if hier:
            cells += [format_spread(r["hierarchical_ms"]), format_spread(r["hierarchical/flat"])]
        body.append(cells)
    return format_table(header, body)


def report(results: dict[str, Any]) -> str:
    ddp = results["ddp"]
    rate = f"{results['rate_mbit']:g} Mbit/s" if results["rate_mbit"] else "no rate limit"
    seconds = {**ddp["sync_s"], **{f"sync default, {k}": v
                                   for k, v in ddp["delay_sync_s"].items()},
               **{f"step {k}": v for k, v in ddp["step_s"].items()}}
    ratios = ("tuned/default sync", "hierarchical/default sync", "delay/no delay sync",
              "sync step/max(compute, sync)",
              "overlapped step/max(compute, sync)", "overlapped tuned/default step",
              "overlapped tuned/best piece step", "overlapped tuned/bad piece step",
              "overlapped tuned/whole bucket step",
              "overlapped default/no helper step")
    relay = results.get("relay", {})
    lines = [f"2 hosts x {results['per_host']} ranks on {os.cpu_count()} cores; links: "
             f"{results['delay_ms']:g} ms one way, {rate} each way (userspace relay: "
             f"{relay.get('dropped', '?')} frames dropped, busy "
             f"{relay.get('cpu_s', 0) / max(relay.get('wall_s', 0), 1e-9):.0%} of the run); "
             f"{results['repeats']} timed batches per figure, median (min-max)",
             _all_reduce_table(results["all_reduce"]), "",
             "tune sweep: " + ", ".join(f"{format_size(p['size'])} {p['busbw_MBps']:.0f} MB/s"
                                        for p in results["tune"]),
             f"tune piece sweep ({format_size(tune.PIECE_SWEEP_BYTES)} in pieces): "
             + ", ".join(f"{format_size(p['size'])} {p['ms']:.0f} ms"
                         for p in results["tune_pieces"]),
             f"tuned bucket: {ddp['tuned_mb']:g} MiB (default {DEFAULT_BUCKET_MB:g}); tuned "
             f"OVERLAPPED piece: {ddp['tuned_piece_mb']:g} MiB (default "
             f"{ddp['default_piece_mb']:g}); compute per step {ddp['compute_s']:.3g} s", "",
             format_table(["DDP 95 MiB", "seconds"],
                          [[k, format_spread(v)] for k, v in seconds.items()]),
             "", format_table(["ratio", "median (min-max)"],
                              [[k, format_spread(ddp[k])] for k in ratios if ddp.get(k)]), "",
             format_table([f"OVERLAPPED piece (best: {ddp['best piece']})",
                           "step / default piece step"],
                          [[k, format_spread(v)]
                           for k, v in ddp["piece/default step"].items()]), ""]
    lines += [f"target {'met' if ok else 'MISSED'}: {name}"
              for name, ok in results["targets"].items()]
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    reason = why_no_cluster()
    if reason is not None:
        print(f"bench_cluster: skipped: {reason}")
        write_json(args.json, {"skipped": reason})
        return 0
    links = SlowLinks(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit)
    with SimCluster(hosts=2, links=links) as cluster:
        assert cluster.relay is not None
        out = cluster.workdir / "results.json"
        run = cluster.run([args.per_host] * 2,
                          ["-m", "mpi4py", os.path.abspath(__file__), "--rank",
                           "--rank-out", str(out), "--repeats", str(args.repeats),
                           "--delay-ms", str(args.delay_ms), "--rate-mbit", str(args.rate_mbit),
                           "--per-host", str(args.per_host)],
                          env={RELAY_PID: str(cluster.relay.pid)}, timeout=args.timeout)
        if run.returncode != 0 or not out.exists():
            print(f"bench_cluster: the run failed (exit {run.returncode})\n{run.tail()}")
            return 1
        results = json.loads(out.read_text())
        results["relay"] = cluster.relay_stats()
    results["targets"] = _targets(results)
    print(report(results))
    write_json(args.json, results)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per variant")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one way (default 5)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="each way, per host (default 1000; 0: no limit)")
    parser.add_argument("--per-host", type=int, choices=(1, 2), default=2,
                        help="ranks per host (default 2)")
    parser.add_argument("--timeout", type=float, default=800.0, help="seconds for the run")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
