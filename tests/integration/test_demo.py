"""The demo CLI: every strategy trains, the check passes, a wrong result fails it, and the
progress display fits narrow terminals, pipes and mpiexec."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import UNDER_MPI

from axondist import demo, spawn
from axondist.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
# Variables an MPI launcher sets: a child started without them is not part of a launch.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    status = demo.run_demo(**_kwargs(args), out=out)
    return status, out.getvalue()


def _kwargs(args: tuple[str, ...]) -> dict:
    """The CLI's parsing, reused: argv -> run_demo keyword arguments."""
    from axondist.__main__ import _parser

    ns = _parser().parse_args(["demo", *args])
    return {"world_size": ns.world_size, "strategy": ns.strategy, "steps": ns.steps,
            "backend": "mock", "progress": ns.progress,
            "batch_size": ns.batch_size, "lr": ns.lr, "seed": ns.seed, "dtype": ns.dtype,
            "tol": ns.tol, "schedule": ns.schedule}


@pytest.mark.parametrize("strategy", demo.STRATEGIES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_strategy_matches_single_process_training(strategy, world_size):
    status, out = run_cli("--strategy", strategy, "--world-size", str(world_size),
                          "--steps", "6", "--no-progress")
    assert status == 0, out
    assert f"{strategy} on a mock world of {world_size} ranks" in out
    assert "max abs parameter difference" in out and ": OK" in out
    # The distributed loss column equals the single-process one to the printed digits.
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert rows and all(r[1] == r[2] for r in rows)


@pytest.mark.parametrize("strategy", demo.STRATEGIES)
def test_rank_results_agree_with_the_reference_in_float64(strategy):

    cfg = demo.DemoConfig(strategy=strategy, world_size=2, steps=5, dtype="float64")
    ref = demo.train_reference(cfg)
    results = spawn(lambda w: demo.STRATEGY_FNS[strategy](w, cfg, ref, lambda s, v: None), 2)
    for r in results:
        assert r.max_diff < 1e-12
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-12)
    assert ref.losses[-1] < ref.losses[0]  # it learns


def test_pipeline_schedules_including_interleaved():
    for schedule in ("gpipe", "interleaved_1f1b", "zb_h1"):
        status, out = run_cli("--strategy", "pipeline", "--world-size", "2", "--steps", "3",
                              "--schedule", schedule)
        assert status == 0, out
        assert f"pipeline schedule ({schedule}" in out


def test_a_wrong_result_fails_the_check(monkeypatch):
    real = demo.train_reference

    def off_by_a_little(cfg):
        ref = real(cfg)
        w, b = ref.weights[0]
        ref.weights[0] = (w + 1e-3, b)
        return ref

    monkeypatch.setattr(demo, "train_reference", off_by_a_little)
    status, out = run_cli("--strategy", "tp", "--world-size", "2", "--steps", "2",
                          "--no-progress")
    assert status == 1
    assert "FAILED" in out


def test_every_strategy_is_part_of_the_library():
    assert not hasattr(demo, "StrategyUnavailable")
    assert set(demo.STRATEGY_FNS) == set(demo.STRATEGIES)
    with pytest.raises(ValueError, match="demo: unknown strategy 'moe'; choose one of ddp"):
        demo.run_demo(strategy="moe", backend="mock", out=io.StringIO())


def test_plain_lines_when_not_a_terminal():
    status, out = run_cli("--strategy", "tp", "--world-size", "2", "--steps", "20")
    assert status == 0, out
    lines = [line for line in out.splitlines() if re.match(r"step \d+/20", line)]
    assert [line.split()[1] for line in lines] == [f"{s}/20" for s in range(2, 21, 2)]
    assert all("  loss " in line for line in lines)
    assert "\r" not in out
    # the progress comes first, then the report, on the one stream
    assert out.index("step 20/20") < out.index("step   loss (distributed)")


@pytest.mark.parametrize("world_size", [1, 3])
def test_only_rank_0_reports_progress(world_size):
    out = io.StringIO()
    status = demo.run_demo(world_size=world_size, strategy="ddp", steps=3, backend="mock",
                           progress="lines", out=out)
    assert status == 0 and out.getvalue().count("step 3/3") == 1


def test_no_progress_is_silent():
    status, out = run_cli("--strategy", "tp", "--world-size", "2", "--steps", "2",
                          "--no-progress")
    assert status == 0 and "step 2/2" not in out
    with pytest.raises(ValueError, match="demo: progress='fancy' is not one of auto, bar, lines"):
        demo.run_demo(world_size=1, steps=1, backend="mock", progress="fancy")


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="needs tqdm")
def test_bar_through_a_pipe_fits_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    out = io.StringIO()
    status = demo.run_demo(world_size=2, strategy="tp", steps=25, backend="mock",
                           progress="bar", out=out)
    assert status == 0
    frames = [f for f in re.split(r"[\r\n]", out.getvalue()) if "%|" in f]
    assert frames and all(len(f) <= 40 for f in frames), frames
    assert "25/25" in frames[-1] and "loss" in frames[-1]


_PTY_SCRIPT = """
import fcntl, os, pty, struct, sys, termios
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "axondist", "demo", "--backend", "mock",
                              "--world-size", "2", "--steps", "60", "--strategy", "tp"])
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
chunks = []
while True:
    try:
        data = os.read(fd, 4096)
    except OSError:
        break
    if not data:
        break
    chunks.append(data)
os.waitpid(pid, 0)
sys.stdout.write(b"".join(chunks).decode(errors="replace"))
"""


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None or sys.platform == "win32",
                    reason="needs tqdm and a pseudo-terminal")
def test_a_40_column_terminal_gets_a_bar_that_never_wraps():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env.pop("COLUMNS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _PTY_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    frames = [f for f in re.split(r"[\r\n]", proc.stdout) if "%|" in f]
    assert len(frames) >= 2, proc.stdout  # redrawn in place
    assert all(len(f) <= 40 for f in frames), frames
    assert "60/60" in frames[-1] and ": OK" in proc.stdout


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
    assert proc.stdout.count("step 5/5  loss") == 1  # rank 0's progress, as plain lines


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpi_launcher() is None
                    or importlib.util.find_spec("tqdm") is None,
                    reason="needs mpi4py, mpiexec and tqdm")
def test_rank_0_draws_the_bar_under_mpiexec():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "40"
    proc = subprocess.run([_mpi_launcher(), "-n", "3", sys.executable, "-m", "axondist", "demo",
                           "--steps", "8", "--progress", "bar"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    frames = [f for f in re.split(r"[\r\n]", proc.stdout) if "%|" in f]
    assert frames and all(len(f) <= 40 for f in frames), proc.stdout
    assert proc.stdout.count("| 0/8") == 1 and "8/8" in frames[-1]  # one bar: rank 0's
    # the bar's last line ends before the report starts (bar and report share stdout)
    assert re.search(r"^step   loss \(distributed\)", proc.stdout, re.M), proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(UNDER_MPI, reason="launches its own torchrun")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (pip install '.[torch]')")
def test_demo_under_torchrun_uses_the_torch_world():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "axondist", "demo", "--steps", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on a torch.distributed world of 2 processes" in proc.stdout
    assert proc.stdout.count("axondist demo:") == 1  # only rank 0 prints
    assert ": OK" in proc.stdout
