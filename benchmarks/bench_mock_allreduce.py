"""Mock-world all-reduce against the floor of NumPy summing the same arrays in one thread.

Run: ``python benchmarks/bench_mock_allreduce.py [--ranks 4] [--repeats 15]``

For each size, the timed batches alternate (mock all-reduce, NumPy floor,
mock, floor, ...); a mock batch's time is its slowest rank's. Every figure is
the median (min-max) over the batches; the ratio is mock time / NumPy time,
paired batch by batch (target, on the median: <= 2 at >= 1 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # the checkout's axondist, and _common

import numpy as np  # noqa: E402
from _common import format_spread, ratio_spread, spread  # noqa: E402

import axondist as ad  # noqa: E402

TARGET = 2.0
"""Largest mock/NumPy time ratio (median) allowed from 1 MiB up."""

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def bench(ranks: int, repeats: int, sizes: list[int]) -> list[dict]:
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32)
                  for r in range(ranks)]
        iters = max(1, min(200, (8 << 20) // nbytes))
        mock_times: list[float] = []
        floor_times: list[float] = []
        start_evt = threading.Barrier(ranks)

        def body(world, iters=iters, inputs=inputs, start_evt=start_evt):
            buf = inputs[world.rank].copy()
            ad.all_reduce(buf)  # warm-up
            start_evt.wait()
            t0 = time.perf_counter()
            with np.errstate(over="ignore"):  # repeated in-place sums grow; speed is the same
                for _ in range(iters):
                    ad.all_reduce(buf)
            return (time.perf_counter() - t0) / iters

        out = np.empty(count, np.float32)
        for _ in range(repeats):
            mock_times.append(max(ad.spawn(body, ranks)))
            t0 = time.perf_counter()
            for _ in range(iters):  # the same adds, same order, one thread
                np.add(inputs[0], inputs[1], out=out)
                for x in inputs[2:]:
                    np.add(out, x, out=out)
            floor_times.append((time.perf_counter() - t0) / iters)
        rows.append({"bytes": nbytes, "mock_us": spread(mock_times, 1e6),
                     "numpy_sum_us": spread(floor_times, 1e6),
                     "ratio": ratio_spread(mock_times, floor_times)})
        if nbytes >= 1 << 20:
            rows[-1]["meets_target"] = rows[-1]["ratio"]["median"] <= TARGET
    return rows


def _target_text(row: dict) -> str:
    if "meets_target" not in row:
        return "(none below 1 MiB)"
    return "met" if row["meets_target"] else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = bench(args.ranks, args.repeats, SIZES)
    print(f"mock all_reduce (float32, {args.ranks} ranks) vs NumPy summing the same "
          f"{args.ranks} arrays in one thread; median (min-max) of {args.repeats} "
          "alternating batches")
    print(f"{'size':>8} {'mock us':>22} {'numpy us':>22} {'ratio':>18} target")
    for r in rows:
        print(f"{_fmt_bytes(r['bytes']):>8} {format_spread(r['mock_us']):>22} "
              f"{format_spread(r['numpy_sum_us']):>22} {format_spread(r['ratio']):>18} "
              f"{_target_text(r)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "ranks": args.ranks, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
