"""``python -m axondist tune``: measure all-reduce bus bandwidth per size, pick DDP's sizes.

A sweep all-reduces float32 arrays of growing size over the world (each size timed on its
slowest rank, the median of a few repeats) and reports the bus bandwidth, the rate at
which each rank's link carries a ring all-reduce (``2 (n - 1) / n * bytes / seconds``,
the figure NCCL's tests print). A fit of latency and bandwidth to the sweep gives
:func:`pick_bucket_bytes` the smallest size that spends ``fraction`` of its time moving
bytes. A second sweep times OVERLAPPED's own pipelined pieces (:func:`piece_sweep`), and
:func:`pick_piece_bytes` takes the smallest piece within ``1 / fraction`` of the fastest
(what is left after a backward pass's last gradient is about one piece, so smaller is
better while the link keeps up). The picks and the tables go to a small JSON settings
file (:func:`save_settings`, :func:`load_settings`), by default ``axondist-tune.json`` or
``$AXONDIST_TUNE_FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import comm
from ._environment import launched_by_mpi
from ._validate import positive_number
from .backends import settings
from .ddp import DEFAULT_BUCKET_CAP_MB, GradientSynchronizer, GradSyncStrategy
from .launching.worlds import spawn
from .log import all_reduce_scalar
from .process_group import ProcessGroup, init, resolve_group

#: Where the settings file goes and is read from, unless ``$AXONDIST_TUNE_FILE`` says.
DEFAULT_FILE = "axondist-tune.json"
#: Sizes swept by default: 64 KiB to 64 MiB, doubling.
DEFAULT_SIZES = tuple(64 << 10 << k for k in range(11))
SETTINGS_VERSION = 1
#: OVERLAPPED pieces swept by default: 1 to 16 MiB, doubling.
DEFAULT_PIECE_SIZES = tuple(1 << 20 << k for k in range(5))
#: Bytes each piece sweep all-reduces per call (at least two of the largest pieces).
PIECE_SWEEP_BYTES = 32 << 20


@dataclass(frozen=True)
class SweepPoint:
    """One all-reduce size of a sweep."""

    nbytes: int
    """Bytes all-reduced (float32 values x 4)."""
    seconds: float
    """Median over the repeats of the slowest rank's time for one all-reduce."""
    busbw: float
    """Bus bandwidth in bytes per second: ``2 (n - 1) / n * nbytes / seconds``."""


@dataclass(frozen=True)
class TuneSettings:
    """What ``python -m axondist tune`` measured and picked, as saved to the settings file."""

    bucket_cap_mb: float
    """The picked DDP bucket size in MiB."""
    world_size: int
    """Ranks of the measured world (the pick holds for that layout)."""
    nodes: int
    """Hosts of the measured world."""
    fraction: float
    """The share of the link's bandwidth the picked size reaches at least."""
    sweep: tuple[SweepPoint, ...] = field(default_factory=tuple)
    """Every measured size, smallest first."""
    latency: float = 0.0
    """Seconds of the fitted per-call latency (alpha)."""
    bandwidth: float = 0.0
    """Message bytes per second of the fitted bandwidth (beta; not bus bytes)."""
    piece_mb: float | None = None
    """The picked OVERLAPPED piece in MiB (:func:`pick_piece_bytes`); None in files
    written before tune picked it (DDP then keeps its default piece)."""
    piece_sweep: tuple[SweepPoint, ...] = field(default_factory=tuple)
    """Per piece size (``nbytes``), the time of one pipelined all-reduce of
    :data:`PIECE_SWEEP_BYTES` in such pieces (its bus bandwidth over those bytes)."""


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second each rank's link carries in a ring all-reduce of ``nbytes``.

    Raises:
        ValueError: ``seconds`` or ``world_size`` is not positive.
    """
    positive_number(seconds, "bus_bandwidth", "seconds")
    if world_size < 1:
        raise ValueError(f"bus_bandwidth: world_size={world_size} must be at least 1")
    return 2.0 * (world_size - 1) / world_size * nbytes / seconds if world_size > 1 else math.inf


def fit_latency_bandwidth(points: Sequence[SweepPoint]) -> tuple[float, float]:
    """``(alpha, beta)``: the fit ``seconds = alpha + nbytes / beta`` of a sweep.

    The least-squares fit of *relative* errors, so the small sizes (which show the
    latency ``alpha``) weigh as much as the large ones (which show the bandwidth
    ``beta``, bytes per second). A single noisy size moves it little.

    Raises:
        ValueError: fewer than two distinct sizes.
    """
    if len({p.nbytes for p in points}) < 2:
        raise ValueError(f"fit_latency_bandwidth: needs at least two distinct sizes, got "
                         f"{sorted({p.nbytes for p in points})}")
    t = np.array([p.seconds for p in points], np.float64)
    rows = np.stack([1.0 / t, np.array([p.nbytes for p in points], np.float64) / t], axis=1)
    (alpha, per_byte), *_ = np.linalg.lstsq(rows, np.ones(len(points)), rcond=None)
    per_byte = max(float(per_byte), 1e-15)  # noise cannot make the link infinitely slow
    return max(float(alpha), 0.0), 1.0 / per_byte


def pick_bucket_bytes(points: Sequence[SweepPoint], fraction: float = 0.9) -> int:
    """The smallest swept size that spends at least ``fraction`` of its time moving bytes.

    With the fit ``seconds = alpha + nbytes / beta`` (:func:`fit_latency_bandwidth`), a
    call of ``s`` bytes reaches ``s / (s + alpha * beta)`` of the link's bandwidth; the
    pick is the smallest swept size at or above ``alpha * beta * fraction / (1 -
    fraction)``, else the largest swept size. A bigger bucket gains less than
    ``1 - fraction`` more, and starts its all-reduce later in the backward pass.

    Args:
        points: a sweep of at least two sizes (any order).
        fraction: in (0, 1); 0.9 accepts 10 % of each call's time spent on latency.

    Returns:
        The size in bytes.

    Raises:
        ValueError: fewer than two sizes, or ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"pick_bucket_bytes: fraction={fraction!r} must be in (0, 1), "
                         "e.g. 0.9")
    if not points:
        raise ValueError("pick_bucket_bytes: points is empty; run a sweep first")
    alpha, beta = fit_latency_bandwidth(points)
    needed = alpha * beta * fraction / (1 - fraction)
    sizes = sorted({p.nbytes for p in points})
    return next((s for s in sizes if s >= needed), sizes[-1])


def pick_piece_bytes(points: Sequence[SweepPoint], fraction: float = 0.9) -> int:
    """The smallest OVERLAPPED piece whose pipelined all-reduce is within ``1 / fraction``
    of the fastest piece's time (a :func:`piece_sweep`).

    Under OVERLAPPED each bucket is cut into pieces, each started as soon as its
    gradients are in, so what is left after the last gradient is about one piece:
    smaller is better, as long as the pieces still move the bytes about as fast. How
    fast they do depends on more than a latency and a bandwidth (each piece is a ring
    of ``2 (n - 1)`` steps, and message sizes cross the transports' protocol
    thresholds), so it is measured, not modelled.

    Args:
        points: a piece sweep of at least one size (any order): ``nbytes`` the piece,
            ``seconds`` the time of the same all-reduce in such pieces.
        fraction: in (0, 1); 0.9 accepts pieces up to 1.11x the fastest time.

    Returns:
        The size in bytes, one of the swept pieces.

    Raises:
        ValueError: no points, or ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"pick_piece_bytes: fraction={fraction!r} must be in (0, 1), "
                         "e.g. 0.9")
    if not points:
        raise ValueError("pick_piece_bytes: points is empty; run a piece sweep first")
    fastest = min(p.seconds for p in points)
    return min(p.nbytes for p in points if p.seconds * fraction <= fastest)


def piece_sweep(group: ProcessGroup | None = None, sizes: Sequence[int] = DEFAULT_PIECE_SIZES,
                *, total_bytes: int = PIECE_SWEEP_BYTES, repeats: int = 3,
                warmup: int = 1) -> list[SweepPoint]:
    """Time OVERLAPPED's pieces: per size, a synchronizer over one float32 gradient of
    ``total_bytes`` cut into pieces of that size, all started at once (as many in flight
    as a backward pass keeps); collective, every rank calls it.

    Args:
        group: the group to measure (None: the current world).
        sizes: piece sizes in bytes, each a positive multiple of 4.
        total_bytes: bytes all-reduced per timed call, a positive multiple of 4.
        repeats: timed calls per size (the median of the slowest rank's times is kept).
        warmup: untimed calls per size first (the first sets the pieces up).

    Returns:
        One point per size, in the order given, the same on every rank.

    Raises:
        ValueError: a size or ``total_bytes`` that is not a positive multiple of 4, or
            ``repeats`` < 1.
    """
    g = resolve_group(group)
    _check_sizes("piece_sweep", [*sizes, total_bytes], repeats)
    backend = g.backend_for("piece_sweep")
    x = backend.metadata_buffer(np.ones(total_bytes // 4, np.float32))  # on the GPU for NCCL
    points = []
    for nbytes in sizes:
        sync = GradientSynchronizer(GradSyncStrategy.OVERLAPPED, bucket_bytes=total_bytes,
                                    group=g)
        sync.piece_bytes = nbytes
        sync.prepare([x])
        times = []
        try:
            for k in range(warmup + repeats):
                comm.barrier(g)
                start = time.perf_counter()
                sync.start(g)
                sync.add_gradient(0, x)
                sync.finish()
                elapsed = time.perf_counter() - start
                if k >= warmup:
                    times.append(all_reduce_scalar(elapsed, "max", g))  # the slowest rank
        finally:
            sync.close()
        seconds = max(statistics.median(times), 1e-9)
        points.append(SweepPoint(nbytes, seconds, bus_bandwidth(total_bytes, seconds,
                                                                g.world_size)))
    return points


def _check_sizes(where: str, sizes: Sequence[int], repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"{where}: repeats={repeats!r} must be at least 1")
    for nbytes in sizes:
        if not isinstance(nbytes, int) or nbytes < 4 or nbytes % 4:
            raise ValueError(f"{where}: size {nbytes!r} must be a positive multiple of 4 "
                             "bytes (float32 values)")


def sweep(group: ProcessGroup | None = None, sizes: Sequence[int] = DEFAULT_SIZES, *,
          repeats: int = 5, warmup: int = 1) -> list[SweepPoint]:
    """Time an all-reduce of each size over ``group``; collective (every rank calls it).

    Args:
        group: the group to measure (None: the current world).
        sizes: bytes per all-reduce, each a positive multiple of 4 (float32).
        repeats: timed all-reduces per size (the median is kept).
        warmup: untimed all-reduces per size first.

    Returns:
        One point per size, in the order given, the same on every rank.

    Raises:
        ValueError: a size that is not a positive multiple of 4, or ``repeats`` < 1.
    """
    g = resolve_group(group)
    _check_sizes("sweep", sizes, repeats)
    points = []
    backend = g.backend_for("sweep")
    for nbytes in sizes:
        x = backend.metadata_buffer(np.ones(nbytes // 4, np.float32))  # on the GPU for NCCL
        for _ in range(warmup):
            comm.all_reduce(x, "sum", g)
        times = []
        for _ in range(repeats):
            comm.barrier(g)
            start = time.perf_counter()
            comm.all_reduce(x, "sum", g)
            elapsed = time.perf_counter() - start
            times.append(all_reduce_scalar(elapsed, "max", g))  # the slowest rank
        seconds = max(statistics.median(times), 1e-9)
        points.append(SweepPoint(nbytes, seconds, bus_bandwidth(nbytes, seconds,
                                                                g.world_size)))
    return points


def tune(group: ProcessGroup | None = None, sizes: Sequence[int] = DEFAULT_SIZES, *,
         repeats: int = 5, fraction: float = 0.9,
         piece_sizes: Sequence[int] = DEFAULT_PIECE_SIZES,
         piece_total_bytes: int = PIECE_SWEEP_BYTES) -> TuneSettings:
    """Sweep ``group`` and pick the bucket and piece sizes (collective; see :func:`sweep`
    and :func:`piece_sweep`, which gets ``piece_sizes``, ``piece_total_bytes`` and at
    most 3 ``repeats``).

    Returns:
        The settings, the same on every rank.
    """
    g = resolve_group(group)
    points = sweep(g, sizes, repeats=repeats)
    pieces = piece_sweep(g, piece_sizes, total_bytes=piece_total_bytes,
                         repeats=min(repeats, 3))
    nodes = len({info[0] for info in comm.all_gather_object(g.node_info(), g)})
    picked = pick_bucket_bytes(points, fraction)
    alpha, beta = fit_latency_bandwidth(points)
    return TuneSettings(picked / 2**20, g.world_size, nodes, fraction, tuple(points),
                        alpha, beta, pick_piece_bytes(pieces, fraction) / 2**20, tuple(pieces))


def settings_path(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, else ``$AXONDIST_TUNE_FILE``, else ``axondist-tune.json`` here."""
    return Path(path if path is not None else settings.read("AXONDIST_TUNE_FILE") or DEFAULT_FILE)


def save_settings(settings: TuneSettings, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``settings`` as JSON (see :func:`settings_path`); the path written."""
    target = settings_path(path)
    data = {"version": SETTINGS_VERSION, **asdict(settings)}
    target.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return target


def tuned_sizes(group: ProcessGroup, path: str | os.PathLike[str] | None = None
                ) -> tuple[float, int | None]:
    """The DDP sizes of the settings file, when it was measured on this group's layout
    (:func:`tuned_ddp_options` gives them as DDP's keyword arguments).

    Collective: group rank 0 reads the file (:func:`settings_path`) and every rank gets
    the same answer. A file measured on another world size or host count, no file, or
    an unreadable one (a ``RuntimeWarning`` says why) give the defaults.

    Args:
        group: the group DDP averages over.
        path: the settings file (:func:`settings_path` when None).

    Returns:
        ``(bucket_cap_mb, piece_bytes)``: the tuned bucket in MiB and OVERLAPPED piece in
        bytes, else :data:`~axondist.ddp.DEFAULT_BUCKET_CAP_MB` and None (None also for a
        file written before tune picked a piece: keep the synchronizer's default piece).
    """
    found: Any = None
    if group.rank == 0:  # one reader: every rank must pick the same sizes
        try:
            settings = load_settings(path)
            found = None if settings is None else (settings.bucket_cap_mb, settings.world_size,
                                                   settings.nodes, settings.piece_mb)
        except ValueError as exc:
            found = str(exc)
    found = comm.broadcast_object(found, group, src=0)
    if isinstance(found, str):
        warnings.warn(f"ignoring the tune settings: {found}", RuntimeWarning, stacklevel=3)
        return DEFAULT_BUCKET_CAP_MB, None
    nodes = len({info[0] for info in comm.all_gather_object(group.node_info(), group)})
    if found is None or (found[1], found[2]) != (group.world_size, nodes):
        return DEFAULT_BUCKET_CAP_MB, None
    piece = None if found[3] is None else max(1, round(found[3] * 2**20))
    return float(found[0]), piece


def tuned_ddp_options(group: ProcessGroup, path: str | os.PathLike[str] | None = None
                      ) -> dict[str, Any]:
    """The settings file's sizes as keyword arguments of an OVERLAPPED DDP on ``group``:
    ``DistributedDataParallel(model, group, strategy="overlapped",
    **tuned_ddp_options(group))``.

    DDP reads no settings file itself; this call is the one place that does, when the
    user asks. Collective, as :func:`tuned_sizes`: every rank of ``group`` calls it and
    gets the same sizes (the defaults when the file is missing, unreadable or measured
    on another layout).

    Args:
        group: the group DDP averages over.
        path: the settings file (:func:`settings_path` when None).

    Returns:
        ``{"bucket_cap_mb": MiB, "piece_bytes": bytes or None}`` (None: DDP's default
        piece).
    """
    bucket_cap_mb, piece_bytes = tuned_sizes(group, path)
    return {"bucket_cap_mb": bucket_cap_mb, "piece_bytes": piece_bytes}


def load_settings(path: str | os.PathLike[str] | None = None) -> TuneSettings | None:
    """The settings saved by ``python -m axondist tune``, or None when there is no file.

    Raises:
        ValueError: the file exists but is not a settings file of this version (the
            message names it and says to run the tune again).
    """
    source = settings_path(path)
    if not source.exists():
        return None
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
        if data.get("version") != SETTINGS_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {SETTINGS_VERSION}")
        points = tuple(SweepPoint(int(p["nbytes"]), float(p["seconds"]), float(p["busbw"]))
                       for p in data["sweep"])
        piece = data.get("piece_mb")  # absent from files written before the piece pick
        if piece is not None and not float(piece) > 0:
            raise ValueError(f"piece_mb={piece!r} is not a positive size")
        pieces = tuple(SweepPoint(int(p["nbytes"]), float(p["seconds"]), float(p["busbw"]))
                       for p in data.get("piece_sweep", ()))
        return TuneSettings(float(data["bucket_cap_mb"]), int(data["world_size"]),
                            int(data["nodes"]), float(data["fraction"]), points,
                            float(data["latency"]), float(data["bandwidth"]),
                            None if piece is None else float(piece), pieces)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"load_settings: {source} is not a readable axondist tune file "
                         f"({exc}); run `python -m axondist tune` again or delete it") from None


def format_sweep(settings: TuneSettings) -> str:
    """The sweeps as text tables (all-reduce sizes, then OVERLAPPED pieces), the picks
    marked."""
    piece = None if settings.piece_mb is None else round(settings.piece_mb * 2**20)
    tables = [("size", settings.sweep, round(settings.bucket_cap_mb * 2**20), "bucket"),
              ("piece", settings.piece_sweep, piece, "piece")]
    lines = []
    for title, points, picked, name in tables:
        if points:
            lines += [f"{title:>10}  {'time':>10}  {'busbw':>12}",
                      *(f"{_size(p.nbytes):>10}  {p.seconds * 1e3:>8.3f}ms  "
                        f"{p.busbw / 1e9:>8.3f} GB/s{'  <- ' + name if p.nbytes == picked else ''}"
                        for p in points)]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m axondist tune",
        description="Measure all-reduce bus bandwidth per size over the world and save the "
                    "DDP bucket and OVERLAPPED piece sizes that reach the bandwidth (run it "
                    "under mpiexec on the machines and ranks you train on).")
    parser.add_argument("--min-size", type=int, default=DEFAULT_SIZES[0], metavar="BYTES",
                        help="smallest all-reduce (default: %(default)s)")
    parser.add_argument("--max-size", type=int, default=DEFAULT_SIZES[-1], metavar="BYTES",
                        help="largest all-reduce; sizes double (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size")
    parser.add_argument("--fraction", type=float, default=0.9,
                        help="pick the smallest size reaching this share of the link's "
                             "bandwidth (default: %(default)s)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help=f"settings file (default: $AXONDIST_TUNE_FILE or {DEFAULT_FILE})")
    parser.add_argument("--world-size", type=int, default=2, metavar="N",
                        help="ranks of the mock world when not under mpiexec (default: 2)")
    return parser


def _sizes(lo: int, hi: int) -> list[int]:
    if lo < 4 or hi < lo:
        raise ValueError(f"tune: --min-size={lo} and --max-size={hi} must satisfy "
                         "4 <= min <= max")
    sizes, size = [], lo - lo % 4
    while size <= hi:
        sizes.append(size)
        size *= 2
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep (``argv``: the options after ``tune``); 0 on success, 2 on bad options."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        sizes = _sizes(args.min_size, args.max_size)
        if not 0 < args.fraction < 1 or args.repeats < 1:
            raise ValueError(f"tune: --fraction={args.fraction:g} must be in (0, 1) and "
                             f"--repeats={args.repeats} at least 1 (e.g. 0.9 and 5)")
    except ValueError as exc:
        print(f"axondist {exc}", file=sys.stderr)
        return 2

    def measure(group: Any) -> TuneSettings:
        return tune(group, sizes, repeats=args.repeats, fraction=args.fraction)

    if launched_by_mpi():
        world = init("mpi")
        settings, speaks = measure(world), world.rank == 0
    else:
        settings, speaks = spawn(measure, args.world_size)[0], True
    if speaks:
        target = save_settings(settings, args.out)
        print(format_sweep(settings))
        print(f"{settings.world_size} ranks on {settings.nodes} host(s): latency "
              f"{settings.latency * 1e6:.1f} us, bandwidth {settings.bandwidth / 1e9:.3g} GB/s "
              f"(fitted); bucket {settings.bucket_cap_mb:g} MiB (at least "
              f"{settings.fraction:g} of the bandwidth), OVERLAPPED piece "
              f"{settings.piece_mb:g} MiB (within 1/{settings.fraction:g} of the fastest "
              f"piece's time); saved to {target}")
        print("DDP reads no settings file itself: pass the sizes with "
              "DistributedDataParallel(model, group, strategy='overlapped', "
              "**axondist.tune.tuned_ddp_options(group))")
    return 0


__all__ = ["DEFAULT_FILE", "DEFAULT_PIECE_SIZES", "PIECE_SWEEP_BYTES", "SweepPoint",
           "TuneSettings", "bus_bandwidth", "fit_latency_bandwidth", "format_sweep",
           "load_settings", "main", "pick_bucket_bytes", "pick_piece_bytes", "piece_sweep",
           "save_settings", "settings_path", "sweep", "tune", "tuned_ddp_options", "tuned_sizes"]
