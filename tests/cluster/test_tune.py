"""``python -m axondist tune``: the bucket and piece picks, the sweep on the mock world, the
settings file (old files without a piece still load), DDP applying the tuned piece under
OVERLAPPED only, the command line, and a sweep across two simulated hosts."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist import tune
from axondist.__main__ import main as cli
from axondist.ddp import DDP, DEFAULT_BUCKET_CAP_MB, GradientSynchronizer, GradSyncStrategy
from axondist.tune import SweepPoint, TuneSettings
from cluster.simcluster import SimCluster

size_sets = st.lists(st.integers(2, 27), min_size=2, max_size=12, unique=True).map(
    lambda ks: sorted(1 << k for k in ks))


def _model_sweep(sizes: list[int], alpha: float, beta: float) -> list[SweepPoint]:
    """A noiseless sweep of a link with latency ``alpha`` and bandwidth ``beta``."""
    return [SweepPoint(s, alpha + s / beta, tune.bus_bandwidth(s, alpha + s / beta, 2))
            for s in sizes]


@given(sizes=size_sets, alpha=st.floats(1e-6, 1e-2), beta=st.floats(1e6, 1e11))
def test_the_fit_recovers_latency_and_bandwidth(sizes: list[int], alpha: float,
                                                beta: float) -> None:
    got_alpha, got_beta = tune.fit_latency_bandwidth(_model_sweep(sizes, alpha, beta))
    assert got_alpha == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert got_beta == pytest.approx(beta, rel=1e-6)


@given(sizes=size_sets, alpha=st.floats(1e-6, 1e-2), beta=st.floats(1e6, 1e11),
       fraction=st.floats(0.05, 0.99))
def test_the_pick_is_the_smallest_size_that_reaches_the_fraction(
        sizes: list[int], alpha: float, beta: float, fraction: float) -> None:
    picked = tune.pick_bucket_bytes(_model_sweep(sizes, alpha, beta), fraction)

    def efficiency(s: int) -> float:
        return (s / beta) / (alpha + s / beta)

    assert picked in sizes
    if picked != sizes[-1]:  # else no size reaches it: the largest is the best there is
        assert efficiency(picked) >= fraction * (1 - 1e-6)
    assert all(efficiency(s) < fraction * (1 + 1e-6) for s in sizes if s < picked)


piece_sweeps = st.lists(st.tuples(st.integers(0, 6), st.floats(1e-3, 10.0)), min_size=1,
                        max_size=7, unique_by=lambda t: t[0]).map(
    lambda pts: [SweepPoint(1 << 20 << k, t, 1.0) for k, t in pts])


@given(points=piece_sweeps, fraction=st.floats(0.05, 0.99))
def test_the_piece_is_the_smallest_within_reach_of_the_fastest(points: list[SweepPoint],
                                                               fraction: float) -> None:
    """Less is left after the last gradient with a smaller piece: the pick is the smallest
    swept piece whose time is at most ``1 / fraction`` of the fastest piece's."""
    picked = tune.pick_piece_bytes(points, fraction)
    fastest = min(p.seconds for p in points)
    by_size = {p.nbytes: p.seconds for p in points}
    assert picked in by_size
    assert by_size[picked] * fraction <= fastest
    assert all(t * fraction > fastest for s, t in by_size.items() if s < picked)
    assert tune.pick_piece_bytes(points[::-1], fraction) == picked  # any order
    # the fastest piece qualifies, so the pick is never bigger than it
    assert picked <= min(s for s, t in by_size.items() if t == fastest)


def test_bad_picks_and_bandwidths_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pick_bucket_bytes: points is empty"):
        tune.pick_bucket_bytes([])
    with pytest.raises(ValueError, match=r"pick_bucket_bytes: fraction=1.5 must be in \(0, 1\)"):
        tune.pick_bucket_bytes([SweepPoint(4, 1.0, 1.0)], 1.5)
    with pytest.raises(ValueError, match=r"fit_latency_bandwidth: needs at least two distinct "
                                         r"sizes, got \[4\]"):
        tune.pick_bucket_bytes([SweepPoint(4, 1.0, 1.0)] * 3)
    two = [SweepPoint(4, 1.0, 1.0), SweepPoint(8, 2.0, 1.0)]
    with pytest.raises(ValueError, match=r"pick_piece_bytes: fraction=0 must be in \(0, 1\)"):
        tune.pick_piece_bytes(two, 0)
    with pytest.raises(ValueError, match=r"pick_piece_bytes: points is empty; run a piece "):
        tune.pick_piece_bytes([])
    with pytest.raises(ValueError, match=r"bus_bandwidth: seconds=0 must be a finite number"):
        tune.bus_bandwidth(4, 0, 2)
    assert tune.bus_bandwidth(1000, 1.0, 4) == 1500.0
    assert math.isinf(tune.bus_bandwidth(1000, 1.0, 1))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_sweep_is_the_same_on_every_rank(n: int) -> None:
    sizes, pieces = [4, 1 << 12, 1 << 16], [1 << 10, 1 << 12]
    results = ad.spawn(lambda w: tune.tune(w, sizes, repeats=2, piece_sizes=pieces,
                                           piece_total_bytes=1 << 14), n)
    assert all(r == results[0] for r in results)
    settings = results[0]
    assert [p.nbytes for p in settings.sweep] == sizes
    assert [p.nbytes for p in settings.piece_sweep] == pieces
    assert settings.world_size == n and settings.nodes == 1
    assert settings.bucket_cap_mb * 2**20 in sizes
    assert settings.piece_mb is not None and settings.piece_mb * 2**20 in pieces
    assert settings.piece_mb * 2**20 == tune.pick_piece_bytes(settings.piece_sweep, 0.9)
    assert all(p.seconds > 0 and p.busbw > 0 for p in settings.sweep + settings.piece_sweep)


def test_the_sweep_refuses_bad_sizes() -> None:
    def body(world: ad.World) -> None:
        with pytest.raises(ValueError, match=r"sweep: size 6 must be a positive multiple of 4"):
            tune.sweep(world, [4, 6])
        with pytest.raises(ValueError, match=r"sweep: repeats=0 must be at least 1"):
            tune.sweep(world, [4], repeats=0)
        with pytest.raises(ValueError, match=r"piece_sweep: size 10 must be a positive "
                                             r"multiple of 4"):
            tune.piece_sweep(world, [1024], total_bytes=10)
        with pytest.raises(ValueError, match=r"piece_sweep: repeats=0 must be at least 1"):
            tune.piece_sweep(world, [1024], repeats=0)

    ad.spawn(body, 2)


def test_settings_round_trip_and_missing_or_broken_files(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    settings = TuneSettings(2.0, 4, 2, 0.9, (SweepPoint(1 << 21, 0.01, 2e8),), 1e-4, 1e8, 0.5,
                            (SweepPoint(1 << 19, 0.2, 3e8), SweepPoint(1 << 20, 0.19, 3e8)))
    path = tune.save_settings(settings, tmp_path / "t.json")
    assert tune.load_settings(path) == settings
    old = tmp_path / "old.json"  # written before tune picked a piece: still loads
    data = json.loads(path.read_text())
    del data["piece_mb"], data["piece_sweep"]
    old.write_text(json.dumps(data))
    assert tune.load_settings(old) == dataclasses.replace(settings, piece_mb=None,
                                                          piece_sweep=())
    assert tune.load_settings(old).piece_mb is None  # type: ignore[union-attr]
    monkeypatch.setenv("AXONDIST_TUNE_FILE", str(path))
    assert tune.settings_path() == path and tune.load_settings() == settings
    assert tune.load_settings(tmp_path / "none.json") is None
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "bucket_cap_mb": 2}')
    with pytest.raises(ValueError, match=r"load_settings: .*broken.json is not a readable "
                                         r"axondist tune file .*run `python -m axondist tune`"):
        tune.load_settings(broken)
    broken.write_text(json.dumps({**data, "piece_mb": -1}))
    with pytest.raises(ValueError, match=r"piece_mb=-1 is not a positive size"):
        tune.load_settings(broken)
    broken.write_text('{"version": 99}')
    with pytest.raises(ValueError, match=r"version 99, expected 1"):
        tune.load_settings(broken)


def _ddp_sizes(world: ad.World, seed: int) -> dict[str, object]:
    """Per DDP (SYNCHRONOUS and OVERLAPPED as built without options, OVERLAPPED given
    ``**tune.tuned_ddp_options(world)``): its bucket cap and piece, and one step's averages
    against NumPy's."""
    shapes = [(40, 3), (7,), (129,)]
    found: dict[str, object] = {}
    tuned = tune.tuned_ddp_options(world)
    for name, strategy, options in (("SYNCHRONOUS", GradSyncStrategy.SYNCHRONOUS, {}),
                                    ("OVERLAPPED", GradSyncStrategy.OVERLAPPED, {}),
                                    ("OVERLAPPED tuned", GradSyncStrategy.OVERLAPPED, tuned)):
        params = [ad.Parameter(np.zeros(s)) for s in shapes]
        with DDP(params, world, strategy=strategy, **options) as ddp:
            grads = [np.random.default_rng([seed, world.rank, k]).standard_normal(s)
                     for k, s in enumerate(shapes)]
            for p, g in zip(params, grads):
                p.grad = g.copy()
            ddp.sync_gradients()
            for k, p in enumerate(params):
                want = np.mean([np.random.default_rng([seed, r, k]).standard_normal(shapes[k])
                                for r in range(world.world_size)], axis=0)
                np.testing.assert_allclose(p.grad, want, rtol=1e-12, atol=1e-12)
            found[name] = (ddp.bucket_cap_mb, ddp.synchronizer.piece_bytes)
    return found


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ddp_takes_the_tuned_sizes_only_when_passed(
        n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP reads no settings file: built without options it keeps 25 MiB and the default
    piece whatever the file says. ``tuned_ddp_options`` gives the file's sizes (1 KiB
    piece here: it cuts the 3 KiB bucket in three), and the averages stay right. A file
    without a piece (written before tune picked one) gives the tuned bucket and the
    default piece; a file measured on another layout, or none, gives the defaults."""
    default = (DEFAULT_BUCKET_CAP_MB, GradientSynchronizer.piece_bytes)
    path = tmp_path / "tune.json"
    monkeypatch.setenv("AXONDIST_TUNE_FILE", str(path))
    point = (SweepPoint(1 << 21, 0.01, 2e8),)
    cases = [(TuneSettings(2.0, n, 1, 0.9, point, 1e-4, 1e8, 2.0**-10), (2.0, 1024)),
             (TuneSettings(2.0, n, 1, 0.9, point, 1e-4, 1e8, None), (2.0, default[1])),
             (TuneSettings(2.0, n + 1, 1, 0.9, point, 1e-4, 1e8, 0.5), default),
             (None, default)]
    for seed, (settings, tuned) in enumerate(cases):
        if settings is None:
            path.unlink()
        else:
            tune.save_settings(settings, path)
        for found in ad.spawn(lambda w, seed=seed: _ddp_sizes(w, seed), n):
            assert found == {"SYNCHRONOUS": default, "OVERLAPPED": default,
                             "OVERLAPPED tuned": tuned}, settings


def test_tuned_ddp_options_are_ddp_keywords(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXONDIST_TUNE_FILE", str(tmp_path / "none.json"))
    options = ad.spawn(tune.tuned_ddp_options, 2)
    assert options == [{"bucket_cap_mb": DEFAULT_BUCKET_CAP_MB, "piece_bytes": None}] * 2


def test_the_command_writes_the_settings_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune.json"
    assert cli(["tune", "--min-size", "4096", "--max-size", "65536", "--repeats", "2",
                "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bucket" in printed and "piece" in printed and f"saved to {out}" in printed
    assert "**axondist.tune.tuned_ddp_options(group)" in printed
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and [p["nbytes"] for p in data["sweep"]] == [
        4096, 8192, 16384, 32768, 65536]


@pytest.mark.parametrize("args, message", [
    (["--fraction", "1"], "tune: --fraction=1 must be in (0, 1)"),
    (["--repeats", "0"], "--repeats=0 at least 1"),
    (["--min-size", "64", "--max-size", "32"], "tune: --min-size=64 and --max-size=32"),
])
def test_the_command_refuses_bad_options(args: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["tune", *args]) == 2
    assert message in capsys.readouterr().err


def test_tune_across_two_hosts(cluster: SimCluster) -> None:
    out = cluster.workdir / "tune.json"
    run = cluster.run([2, 2], ["-m", "axondist", "tune", "--min-size", "65536", "--max-size",
                               str(4 << 20), "--repeats", "3", "--out", str(out)], timeout=120)
    assert run.returncode == 0, run.tail()
    settings = tune.load_settings(out)
    assert settings is not None and settings.world_size == 4 and settings.nodes == 2
    assert settings.piece_mb is not None and len(settings.piece_sweep) == 5, run.tail()
    assert "4 ranks on 2 host(s)" in run.ranks[0], run.tail()
