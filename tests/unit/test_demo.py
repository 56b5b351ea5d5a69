"""The demo CLI: every strategy trains, the check passes, and a wrong result fails it."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI

from axondist import demo
from axondist.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
# Variables an MPI launcher sets: a child started without them is not part of a launch.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = demo.run_demo(**_kwargs(args), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _kwargs(args: tuple[str, ...]) -> dict:
    """The CLI's parsing, reused: argv -> run_demo keyword arguments."""
    from axondist.__main__ import _parser

    ns = _parser().parse_args(["demo", *args])
    return {"world_size": ns.world_size, "strategy": ns.strategy, "steps": ns.steps,
            "backend": "mock", "progress": False if ns.no_progress else None,
            "batch_size": ns.batch_size, "lr": ns.lr, "seed": ns.seed, "dtype": ns.dtype,
            "tol": ns.tol, "schedule": ns.schedule}


def available(strategy: str) -> bool:
    try:
        demo.check_available(strategy)
    except demo.StrategyUnavailable:
        return False
    return True


@pytest.mark.parametrize("strategy", demo.STRATEGIES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_strategy_matches_single_process_training(strategy, world_size):
    status, out, err = run_cli("--strategy", strategy, "--world-size", str(world_size),
                               "--steps", "6")
    if not available(strategy):
        assert status == demo.EXIT_UNAVAILABLE and strategy in err
        return
    assert status == 0, out + err
    assert f"{strategy} on a mock world of {world_size} ranks" in out
    assert "max abs parameter difference" in out and ": OK" in out
    # The distributed loss column equals the single-process one to the printed digits.
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert rows and all(r[1] == r[2] for r in rows)


@pytest.mark.parametrize("strategy", demo.STRATEGIES)
def test_rank_results_agree_with_the_reference_in_float64(strategy):
    if not available(strategy):
        pytest.skip(f"{strategy} not available")
    from axondist import spawn

    cfg = demo.DemoConfig(strategy=strategy, world_size=2, steps=5, dtype="float64")
    ref = demo.train_reference(cfg)
    results = spawn(lambda w: demo.STRATEGY_FNS[strategy](w, cfg, ref, lambda s, v: None), 2)
    for r in results:
        assert r.max_diff < 1e-12
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-12)
    assert ref.losses[-1] < ref.losses[0]  # it learns


def test_pipeline_schedules_including_interleaved():
    if not available("pipeline"):
        pytest.skip("pipeline not available")
    for schedule in ("gpipe", "interleaved_1f1b", "zb_h1"):
        status, out, err = run_cli("--strategy", "pipeline", "--world-size", "2", "--steps", "3",
                                   "--schedule", schedule)
        assert status == 0, out + err
        assert f"pipeline schedule ({schedule}" in out


def test_a_wrong_result_fails_the_check(monkeypatch):
    real = demo.train_reference

    def off_by_a_little(cfg):
        ref = real(cfg)
        w, b = ref.weights[0]
        ref.weights[0] = (w + 1e-3, b)
        return ref

    monkeypatch.setattr(demo, "train_reference", off_by_a_little)
    status, out, _ = run_cli("--strategy", "tp", "--world-size", "2", "--steps", "2")
    assert status == 1
    assert "FAILED" in out


def test_unavailable_strategy_exits_2(monkeypatch):
    def missing(strategy):
        raise demo.StrategyUnavailable(f"the {strategy} strategy needs axondist.nothing")

    monkeypatch.setattr(demo, "check_available", missing)
    status, out, err = run_cli("--strategy", "ddp", "--steps", "1")
    assert status == demo.EXIT_UNAVAILABLE
    assert "needs axondist.nothing" in err and out == ""


def test_progress_bar_draws_in_place():
    stream = io.StringIO()
    bar = demo.ProgressBar(4, stream, enabled=True, width=8)
    bar.update(2, 0.5)
    bar.close()
    assert stream.getvalue() == "\r[####----] 2/4  loss 0.50000\n"
    quiet = io.StringIO()
    demo.ProgressBar(4, quiet, enabled=False).update(1, 1.0)
    assert quiet.getvalue() == ""


def test_progress_bar_only_when_asked():
    status, _, err = run_cli("--strategy", "tp", "--world-size", "2", "--steps", "2")
    assert status == 0 and err == ""  # StringIO is not a terminal: no bar
    out, err2 = io.StringIO(), io.StringIO()
    status = demo.run_demo(world_size=2, strategy="tp", steps=3, backend="mock", progress=True,
                           out=out, err=err2)
    assert status == 0 and "3/3" in err2.getvalue()


@pytest.mark.parametrize("args, match", [
    (("--steps", "0"), "--steps"),
    (("--batch-size", "400", "--world-size", "2"), "global batch of 800"),
    (("--world-size", "0"), "world_size"),
])
def test_bad_settings_exit_2_with_a_message(args, match, capsys):
    assert main(["demo", "--backend", "mock", "--no-progress", *args]) == 2
    assert match in capsys.readouterr().err


def test_pipeline_needs_a_layer_per_stage():
    # The CLI deepens the model to fit the world; an explicit depth that is too small is refused.
    with pytest.raises(ValueError, match="a layer per stage: 4 layers for 5 stages"):
        demo.check_config(demo.DemoConfig(strategy="pipeline", world_size=5, depth=4))
    demo.check_config(demo.DemoConfig(strategy="pipeline", world_size=4, depth=4))


def test_cli_entry_point_prints_the_report(capsys):
    assert main(["demo", "--backend", "mock", "--world-size", "2", "--steps", "3",
                 "--strategy", "tp", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("axondist demo: tp on a mock world of 2 ranks")


def _mpi_launcher() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpi_launcher() is None,
                    reason="needs mpi4py and mpiexec")
def test_demo_under_mpiexec_uses_the_mpi_world():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([_mpi_launcher(), "-n", "2", sys.executable, "-m", "axondist", "demo",
                           "--steps", "5"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on an MPI world of 2 processes" in proc.stdout
    assert proc.stdout.count("axondist demo:") == 1  # only rank 0 prints
    assert ": OK" in proc.stdout
