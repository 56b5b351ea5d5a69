"""Mock-world all-reduce against the floor of NumPy summing the same arrays in one thread.

Run: ``PYTHONPATH=. python benchmarks/bench_mock_allreduce.py [--repeats 5] [--json FILE]``

For each world size and array size one mock world stays up: ranks 1..N-1 call
all-reduce in a loop on threads of their own, and rank 0 calls it from the
timing loop of ``_common.alternate``, which times batches of it in turn with
batches of the floor (``np.add`` of the same N float32 arrays, in rank order,
into one output: the adds the mock world does, on one thread), a warm-up call
before each batch. The ranks go in lockstep, so rank 0's batch time is every
rank's. Figures are the median (min-max) over the timed batches; the ratio is
mock / NumPy, paired batch by batch. Target: a median ratio <= 2 from 1 MiB up.
Each call wakes every rank's thread at least once, so its cost has a floor of
one scheduler wake-up per rank: the table counts the context switches per call
(all threads, Linux only), and the header prints the cores and the load
average, which set what one wake-up costs.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import threading
from collections.abc import Callable

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

import axondist as ad  # noqa: E402
from axondist.backends import MockBackend  # noqa: E402

TARGET = 2.0
"""Largest median mock/NumPy ratio allowed from ``TARGET_FROM`` bytes up."""
TARGET_FROM = 1 << 20
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
RANKS = [2, 4]
WARMUP = 1
SWITCH_CALLS = 50
"""Untimed calls after the timed batches, over which context switches are counted."""


def context_switches() -> int | None:
    """Voluntary and involuntary context switches of this process's threads so far (None
    where ``/proc`` does not say)."""
    total, seen = 0, False
    for path in glob.glob("/proc/self/task/*/status"):
        try:
            with open(path) as f:
                for line in f:
                    if "ctxt_switches" in line:
                        total += int(line.split()[1])
                        seen = True
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def _numpy_floor(inputs: list[np.ndarray]) -> Callable[[], None]:
    out = np.empty_like(inputs[0])

    def floor() -> None:
        np.add(inputs[0], inputs[1], out=out)
        for x in inputs[2:]:
            np.add(out, x, out=out)

    return floor


def measure(ranks: int, nbytes: int, repeats: int) -> dict:
    """One row: the mock world's all-reduce and the NumPy floor, paired."""
    count = nbytes // 4
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32)
              for r in range(ranks)]
    batch = batch_for(nbytes, budget_bytes=48 << 20, lo=3, hi=100)
    # alternate's calls of each variant (one untimed before each batch), then the count
    calls = (WARMUP + repeats) * (batch + 1) + SWITCH_CALLS
    worlds = [ad.World(b) for b in MockBackend.create_world(ranks, timeout=120)]
    bufs = [x.copy() for x in inputs]
    errors: list[BaseException] = []
    counted = threading.Event()  # peers stay alive until their switches are counted

    def peer(rank: int) -> None:
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # the sums grow: same speed
                for _ in range(calls):
                    ad.all_reduce(bufs[rank], group=worlds[rank])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        counted.wait()

    threads = [threading.Thread(target=peer, args=(r,), daemon=True) for r in range(1, ranks)]
    for t in threads:
        t.start()
    made = [0]

    def mock_call() -> None:
        made[0] += 1
        ad.all_reduce(bufs[0], group=worlds[0])

    with np.errstate(over="ignore", invalid="ignore"):
        times = alternate({"mock": mock_call, "numpy": _numpy_floor(inputs)}, batch=batch,
                          repeats=repeats, warmup=WARMUP)
        before = context_switches()
        for _ in range(SWITCH_CALLS):
            mock_call()
        after = context_switches()
    counted.set()
    for t in threads:
        t.join()
    if errors or made[0] != calls:
        raise RuntimeError(f"bench_mock_allreduce: rank 0 made {made[0]} of {calls} calls; "
                           f"peer errors: {errors}")
    row = {"ranks": ranks, "bytes": nbytes, "size": format_size(nbytes), "batch": batch,
           "mock_us": spread(times["mock"], 1e6), "numpy_us": spread(times["numpy"], 1e6),
           "mock/numpy": ratio_spread(times["mock"], times["numpy"]),
           "switches_per_call": (None if before is None or after is None
                                 else (after - before) / SWITCH_CALLS)}
    if nbytes >= TARGET_FROM:
        row["meets_target"] = row["mock/numpy"]["median"] <= TARGET
    return row


def _verdict(row: dict) -> str:
    if "meets_target" not in row:
        return "-"
    return "met" if row["meets_target"] else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    parser.add_argument("--repeats", type=int, default=5, help="timed batches (>= 3)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats must be >= 3 for a spread, got {args.repeats}")
    load_before = os.getloadavg()
    rows = [measure(n, nbytes, args.repeats) for n in args.ranks for nbytes in SIZES]
    load_after = os.getloadavg()
    print(f"mock all_reduce (float32) vs NumPy adding the same arrays in one thread; "
          f"median (min-max) of {args.repeats} paired batches; {os.cpu_count()} cores, load "
          f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after; target: ratio "
          f"<= {TARGET:g} from {format_size(TARGET_FROM)}")
    print(format_table(
        ["ranks", "size", "mock us", "numpy us", "mock/numpy", "target", "switches/call"],
        [[r["ranks"], r["size"], format_spread(r["mock_us"]), format_spread(r["numpy_us"]),
          format_spread(r["mock/numpy"]), _verdict(r),
          "?" if r["switches_per_call"] is None else f"{r['switches_per_call']:.1f}"]
         for r in rows]))
    write_json(args.json, {"repeats": args.repeats, "cores": os.cpu_count(),
                           "load_average": [load_before[0], load_after[0]], "rows": rows})


if __name__ == "__main__":
    main()
