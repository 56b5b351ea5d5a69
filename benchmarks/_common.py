"""Timing helpers shared by the benchmarks.

The machines these run on are shared and noisy, so every benchmark compares
variants *inside one run*. :func:`alternate` times batch after batch of each
variant in turn, so drift in machine load hits every variant alike; the
order changes every round (ABC, CBA, BCA, BAC, CAB, ACB: the rotations of
the order and of its reverse), so each variant runs right after each other
one equally often and another library's after-effects (its threads, cold
caches) cost every variant alike; one untimed call before each batch absorbs
most of them. :func:`paired_ratio` divides the variants' times batch by
batch (A's k-th batch by B's k-th) before taking the median; a ratio below 1
means the first variant is faster.

Typical use (every rank of an MPI job runs the same calls)::

    times = alternate({"axondist": f, "raw": g}, batch=200, repeats=15, comm=comm)
    row = {"axondist_us": spread(times["axondist"], 1e6),
           "axondist/raw": ratio_spread(times["axondist"], times["raw"])}
    print(format_table(["size", "axondist us", "raw us", "ratio"], rows))
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def alternate(variants: Mapping[str, Callable[[], Any]], *, batch: int, repeats: int,
              warmup: int = 1, sync: Callable[[], Any] | None = None,
              prime: bool = True, comm: Any = None) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per timed batch.

    Args:
        variants: name -> function making one call.
        batch: calls per timed batch (the batch's time is divided by it).
        repeats: timed batches per variant, interleaved round-robin.
        warmup: untimed batches per variant before timing (first-call costs).
        sync: called before and at the end of each timed batch (a barrier
            under MPI, so each batch measures every rank's part of the work);
            its cost is inside the batch, spread over ``batch`` calls.
        prime: make one untimed call before each batch (False for variants
            that are whole processes, e.g. start-up times).
        comm: an mpi4py communicator every rank passes: ``sync`` defaults to its
            ``Barrier``, and each batch's time is the slowest rank's (the same
            lists come back on every rank).

    Returns:
        name -> ``repeats`` per-call times in seconds, in batch order (so the
        k-th entries of two variants were measured side by side).
    """
    if batch < 1 or repeats < 1:
        raise ValueError(f"alternate: batch and repeats must be >= 1, got {batch}, {repeats}")
    sync = sync or (comm.Barrier if comm is not None else (lambda: None))
    times: dict[str, list[float]] = {name: [] for name in variants}
    orders = balanced_orders(list(variants))
    for rep in range(warmup + repeats):
        for name in orders[rep % len(orders)]:
            fn = variants[name]
            if prime:
                fn()  # untimed: the first call after another variant pays for its leftovers
            sync()
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            sync()
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed / batch)
    return slowest_rank(times, comm) if comm is not None else times


def slowest_rank(times: Mapping[str, Sequence[float]], comm: Any) -> dict[str, list[float]]:
    """Batch by batch, the largest time any rank of ``comm`` measured (a collective)."""
    every = comm.allgather({k: list(v) for k, v in times.items()})
    return {k: [max(values) for values in zip(*(rank[k] for rank in every))] for k in times}


def spread(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median, quartiles, extremes and count of ``values`` (times ``scale``: 1e3 for ms).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("spread: needs at least one value")
    v = sorted(float(x) * scale for x in values)
    if len(v) >= 2:
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    else:
        q1 = q3 = v[0]
    return {"median": statistics.median(v), "q1": q1, "q3": q3, "min": v[0], "max": v[-1],
            "n": len(v)}


def format_figure(value: float) -> str:
    """3 significant digits, without an exponent from 100 up: ``0.912``, ``12.5``, ``4630``."""
    mag = abs(value)
    return f"{value:.0f}" if 100 <= mag < 1e9 else f"{value:.1f}" if 10 <= mag < 100 \
        else f"{value:.3g}"


def format_spread(stat: Mapping[str, float], quartiles: bool = False) -> str:
    """``median (min-max)`` of a :func:`spread` (see :func:`format_figure`); with
    ``quartiles``, ``median [q1-q3]`` (the middle half of the batches)."""
    median = format_figure(stat["median"])
    if quartiles:
        return f"{median} [{format_figure(stat['q1'])}-{format_figure(stat['q3'])}]"
    return f"{median} ({format_figure(stat['min'])}-{format_figure(stat['max'])})"


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[k] / denominator[k]`` for every batch ``k``."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("paired_ratios: needs two equally long, non-empty series")
    return [a / b for a, b in zip(numerator, denominator)]


def ratio_spread(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """:func:`spread` of the per-batch ratios (its median is :func:`paired_ratio`)."""
    return spread(paired_ratios(numerator, denominator))


def target(name: str, measured: Mapping[str, float], limit: float,
           at_most: bool = True) -> dict[str, Any]:
    """A report row judging ``measured`` (a :func:`spread`) against ``limit`` on its median:
    ``{"target": name, "measured": measured, "limit": limit, "meets_target": bool}``."""
    value = measured["median"]
    ok = value <= limit if at_most else value >= limit
    return {"target": name, "measured": dict(measured), "limit": limit, "meets_target": bool(ok)}


def verdict(row: Mapping[str, Any]) -> str:
    """``met`` or ``MISSED`` for a :func:`target` row."""
    return "met" if row["meets_target"] else "MISSED"


def release_freed_memory() -> None:
    """Hand the C heap's freed pages back to the kernel (glibc's ``malloc_trim``; nothing
    elsewhere). Without it a resident-set difference depends on what ran before: arrays
    freed earlier leave pages in the heap that the next allocations reuse without the
    resident set growing, while that earlier freeing raised glibc's mmap threshold, so
    later big arrays land in the heap where freeing them leaves the set as it was (two
    identical DDPs measured 289 and 97 MiB added, one after the other; 195 and 191 with
    trimming)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (looked up once: ``find_library`` runs a program)."""
    name = ctypes.util.find_library("c")
    return None if name is None else getattr(ctypes.CDLL(name), "malloc_trim", None)


def process_memory_mib(field: str = "VmHWM") -> float:
    """This process's memory from ``/proc/self/status`` in MiB: ``VmHWM`` (peak resident
    set) or ``VmRSS`` (resident now); NaN where the file does not exist."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return float("nan")


def missing_peers(peers: Mapping[str, str]) -> dict[str, str]:
    """``{peer: "MODULE not installed"}`` for each peer (label -> module) not importable."""
    return {label: f"{module} not installed" for label, module in peers.items()
            if importlib.util.find_spec(module) is None}


def balanced_orders(names: list[str]) -> list[list[str]]:
    """Round orders in which each name follows each other name equally often:
    the rotations of ``names`` and of its reverse (all 6 orders for 3 names)."""
    back = names[::-1]
    orders = [names[k:] + names[:k] for k in range(len(names))]
    orders += [back[k:] + back[:k] for k in range(len(names))]
    return [orders[i // 2 + (i % 2) * len(names)] for i in range(len(orders))]  # interleave


def median(values: Sequence[float]) -> float:
    """The median (robust to the odd slow batch on a shared machine)."""
    return statistics.median(values)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over batches of ``numerator[k] / denominator[k]``."""
    return statistics.median(paired_ratios(numerator, denominator))


def batch_for(nbytes: int, budget_bytes: int = 64 << 20, lo: int = 1, hi: int = 400) -> int:
    """Calls per batch so one batch moves about ``budget_bytes`` (within [lo, hi]).

    Deterministic, so every rank of a job picks the same number.
    """
    return max(lo, min(hi, budget_bytes // max(1, nbytes)))


def format_size(nbytes: int) -> str:
    """``4 KiB``, ``16 MiB``..."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, right-aligned columns; floats get 3 significant digits."""
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    text = [[cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | None, results: Any) -> None:
    """Write ``results`` as JSON to ``path`` (nothing when None), keys in the order given
    (the report shows tables and columns in that order)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


def start_gloo(comm: Any) -> Any:
    """torch.distributed on gloo with MPI's rank and size, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port(comm))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    torch.set_num_threads(1)
    return dist


def free_port(comm: Any) -> int:
    """A TCP port free on 127.0.0.1, chosen by rank 0 of ``comm`` and the same on every
    rank (a collective): where rank 0 listens for torch.distributed's rendezvous."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return int(comm.bcast(port, root=0))
