"""``axondist run --launcher torchrun``: the ranks get torchrun's variables, their lines come back
tagged, a failed rank is named in one summary line (from its own report, or from torchrun's
root cause when it died without a word), restarts relaunch the whole job, a killed launcher
takes the job with it, and a Python without torch is told what to install. Every launch runs
in its own session under a timeout, as in test_run_launcher.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_run_launcher import _alive, _start_and_wait_ready, axondist_run, script

from axondist._environment import env_launch_size, launched_by_mpi
from axondist.backends.registry import backend_names
from axondist.errors import LaunchError
from axondist.launching import supervisor as launcher
from axondist.launching.command_line import LAUNCHER_NAMES
from axondist.launching.styles import STYLES
from axondist.launching.supervisor import RunConfig, build_command, parse_args

TIMEOUT = 60  # one torchrun launch takes 3-5 s on two busy cores


def _why_no_torchrun() -> str | None:
    if launched_by_mpi() or env_launch_size() is not None:
        return "already under a launcher: the launcher tests do not recurse"
    if importlib.util.find_spec("torch") is None:
        return "needs torch (pip install '.[torch]')"
    return None


_NO_TORCHRUN = _why_no_torchrun()
_NO_TORCH_BACKEND = _NO_TORCHRUN or (None if "torch" in backend_names() else
                                     "the torch backend is not registered")


def launches(test):
    """Mark a test that starts torchrun: slow, and skipped where torch is missing."""
    return pytest.mark.slow(pytest.mark.skipif(_NO_TORCHRUN is not None,
                                               reason=str(_NO_TORCHRUN))(test))


def torchrun(*args: str, **options) -> tuple[int, str, str]:
    proc = axondist_run("--launcher", "torchrun", *args, timeout=TIMEOUT, **options)
    return proc.returncode, proc.stdout, proc.stderr


# --- pure parts ----------------------------------------------------------------------------

def test_the_torchrun_command_runs_every_rank_through_the_rank_entry():
    cfg = RunConfig(nprocs=3, target=("train.py", "--lr", "0.1"), launcher="torchrun")
    assert launcher.find_launcher(cfg) == (launcher.sys.executable, "torchrun")
    with pytest.raises(ValueError, match="launcher 'srun' is not one of mpiexec, torchrun"):
        launcher.find_launcher(RunConfig(nprocs=2, target=("t.py",), launcher="srun"))
    cmd = build_command(cfg, "/py", "torchrun", "/tmp/d", python="/ranks/py")
    assert cmd == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                   "--max-restarts", "0", "--redirects", "3", "--log-dir", "/tmp/d/torchrun",
                   "--no-python", "/ranks/py", "-c", launcher._RANK_ENTRY, "train.py", "--lr",
                   "0.1"]
    program = build_command(parse_args(["-n", "2", "--launcher", "torchrun", "--no-python",
                                        "echo", "a"]), "py", "torchrun", None)
    assert program == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       "2", "--max-restarts", "0", "--no-python", "echo", "a"]


def test_parse_args_takes_the_launcher_and_keeps_the_count():
    cfg = parse_args(["--launcher", "torchrun", "--nproc-per-node", "3", "train.py", "-n", "9"])
    assert cfg.launcher == "torchrun" and cfg.nprocs == 3
    assert cfg.target == ("train.py", "-n", "9")
    assert parse_args(["-n", "2", "train.py"]).launcher == "mpiexec"


def test_every_launcher_the_command_line_offers_has_a_way_to_start():
    assert tuple(launcher.LAUNCHERS) == LAUNCHER_NAMES
    with pytest.raises(SystemExit):  # argparse's own refusal, with the choices it knows
        parse_args(["--launcher", "srun", "-n", "2", "train.py"])


@pytest.mark.parametrize("argv, match", [
    (["--hosts", "a,b"], r"--launcher torchrun starts the ranks on this host only, and "
                         r"--hosts names others: torchrun runs once on every host\. Run there "
                         r"`torchrun --nnodes H"),
    (["--mpiexec", "mpiexec"], r"--mpiexec 'mpiexec' names the MPI launcher, but --launcher "
                               r"torchrun was asked for"),
    (["--nproc-per-node", "3"], r"-n 2 and --nproc-per-node 3 must agree"),
])
def test_what_torchrun_cannot_do_is_refused_with_what_to_run(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(["-n", "2", "--launcher", "torchrun", *argv, "train.py"])
    with pytest.raises(SystemExit):
        parse_args(["-n", "2", "--launcher", "srun", "train.py"])


def test_no_mpiexec_points_to_torchrun(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="without MPI, launch through torch with --launcher "
                                          "torchrun"):
        launcher.find_mpiexec()


_TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
job.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-26_16:43:29
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 16847)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 16847
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_16:43:29
  host      : node7
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 16848)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16848
============================================================"""


def test_torchruns_root_cause_names_the_rank_that_failed_first():
    report: dict[str, int | str] = {}
    for line in _TORCHRUN_REPORT.splitlines():
        assert STYLES["torchrun"].read_report(line, report)  # its lines are never shown
    assert {k: report[k] for k in ("rank", "signal", "pid", "host")} == {
        "rank": 2, "signal": 9, "pid": 16848, "host": "node7"}
    exited: dict[str, int | str] = {}
    for line in _TORCHRUN_REPORT.replace("-9 (pid: 16848)  (SIGKILL)", "3 (pid: 16848)") \
            .splitlines():
        STYLES["torchrun"].read_report(line, exited)
    assert exited["code"] == 3 and "signal" not in exited


# --- real launches -------------------------------------------------------------------------

def test_a_python_without_torch_is_told_what_to_install(tmp_path):
    """Runs with or without torch: a stand-in ``torch`` module first on the path fails to
    import, as a missing or broken torch does."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "torch.py").write_text("raise ImportError('no torch in this Python (stand-in)')\n")
    path = script(tmp_path, "print('never runs')\n")
    started = time.monotonic()
    code, out, err = torchrun("-n", "2", "--max-restarts", "3", path, path_first=shim)
    assert code == 2, out + err
    assert "axondist run: --launcher torchrun needs torch" in err
    assert "(ImportError: no torch in this Python (stand-in))" in err
    assert "pip install '.[torch]'" in err and "--launcher mpiexec" in err
    assert "restarting" not in err and "never runs" not in out
    assert len(err.strip().splitlines()) == 1, err  # torchrun's own traceback is not shown
    assert time.monotonic() - started < 30


@launches
def test_ranks_see_torchruns_variables_and_their_lines_come_back_tagged(tmp_path):
    path = script(tmp_path, """
        import os, sys
        env = os.environ
        print("rank", env["RANK"], "of", env["WORLD_SIZE"], "local", env["LOCAL_RANK"],
              "port", env["MASTER_PORT"].isdigit(), "restart", env["AXONDIST_RESTART_COUNT"],
              sys.argv[1:])
        print("err of", env["RANK"], file=sys.stderr)
    """)
    code, out, err = torchrun("-n", "2", path, "--flag", "x")
    assert code == 0, out + err
    for r in range(2):
        assert (f"[rank {r}] rank {r} of 2 local {r} port True restart 0 ['--flag', 'x']"
                in out.splitlines()), out
        assert f"[rank {r}] err of {r}" in err.splitlines(), err
    assert err.count("[rank") == 2 and "OMP_NUM_THREADS" not in err  # torchrun's chatter hidden
    assert "\x1e" not in out + err


@launches
@pytest.mark.skipif(_NO_TORCH_BACKEND is not None, reason=str(_NO_TORCH_BACKEND))
def test_init_joins_torchruns_world_through_the_torch_backend(tmp_path):
    path = script(tmp_path, """
        import os
        import numpy as np
        import axondist as ad
        world = ad.init()  # no backend named: torchrun's variables and torch pick "torch"
        x = np.arange(4.0) * (world.rank + 1)
        ad.all_reduce(x)
        print(repr(world), "sum", x.tolist(), "AXONDIST_BACKEND" in os.environ)
    """)
    code, out, err = torchrun("-n", "2", path)
    assert code == 0, out + err
    for r in range(2):  # each rank holds arange(4) * (1 + 2)
        assert (f"[rank {r}] World(torch, rank={r}, world_size=2) sum [0.0, 3.0, 6.0, 9.0] "
                "False") in out.splitlines(), out + err


@launches
@pytest.mark.skipif(_NO_TORCH_BACKEND is not None, reason=str(_NO_TORCH_BACKEND))
def test_a_rank_that_ends_with_os_exit_is_named_from_its_peers_report(tmp_path):
    """The peer's watchdog ends its own rank too, so torchrun sees two ranks fail at once;
    the peers' report names the one that left."""
    path = script(tmp_path, """
        import os, numpy as np, axondist as ad
        world = ad.init()
        ad.barrier()
        print("after the barrier", flush=True)
        if world.rank == 1:
            os._exit(3)
        ad.all_reduce(np.ones(4))
    """)
    code, out, err = torchrun("-n", "2", path)
    assert code == 3, out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("axondist run:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("axondist run: rank 1 of 2 failed after"), err
    assert "(exit code 3: its peers saw it leave (it called os._exit(3)))" in lines[0]


@launches
def test_a_failing_rank_is_named_in_one_line_and_the_job_ends(tmp_path):
    path = script(tmp_path, """
        import os, time
        print("step 1 on", os.environ["RANK"], flush=True)
        if os.environ["RANK"] == "1":
            raise RuntimeError("loss is nan")
        time.sleep(300)  # torchrun ends this rank once rank 1 failed
    """)
    code, out, err = torchrun("-n", "2", path)
    assert code == 1, out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("axondist run:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("axondist run: rank 1 of 2 failed after"), err
    assert "(exit code 1: RuntimeError: loss is nan); last line of rank 1 before its " \
        "traceback:" in lines[0]
    assert "    | step 1 on 1" in err
    assert "[rank 1] RuntimeError: loss is nan" in err
    assert "ChildFailedError" not in err and "Root Cause" not in err


@launches
def test_a_rank_killed_by_a_signal_is_named_from_torchruns_report(tmp_path):
    path = script(tmp_path, """
        import os, signal, time
        print("about to die" if os.environ["RANK"] == "1" else "waiting", flush=True)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    """)
    code, out, err = torchrun("-n", "2", path)
    assert code == 128 + 9, out + err
    assert "axondist run: rank 1 of 2 failed after" in err
    assert "(killed by signal 9 (SIGKILL)); last line of rank 1:" in err
    assert "    | about to die" in err


@launches
def test_max_restarts_relaunches_the_whole_job(tmp_path):
    marker = tmp_path / "failed-once"
    path = script(tmp_path, f"""
        import os, pathlib
        rank, restarts = os.environ["RANK"], os.environ["AXONDIST_RESTART_COUNT"]
        marker = pathlib.Path({str(marker)!r})
        if rank == "1" and not marker.exists():
            marker.write_text("x")
            raise SystemExit("rank 1 lost its node")
        print("finished", restarts, "torchrun restart", os.environ["TORCHELASTIC_RESTART_COUNT"])
    """)
    code, out, err = torchrun("-n", "2", "--max-restarts", "1", path)
    assert code == 0, out + err
    assert "axondist run: rank 1 of 2 failed" in err and "rank 1 lost its node" in err
    assert ("axondist run: restarting the job (restart 1 of 1; the script sees "
            "AXONDIST_RESTART_COUNT=1)") in err
    assert "[rank 0] finished 1 torchrun restart 0" in out
    assert "[rank 1] finished 1 torchrun restart 0" in out


_SLEEPER = """
    import os, pathlib, time
    pathlib.Path({folder!r}, "rank." + os.environ["RANK"]).write_text(
        f"{{os.getpid()}} {{os.environ['AXONDIST_RUN_DIR']}}")
    print("ready", flush=True)
    time.sleep(300)
"""


@launches
def test_sigkill_of_the_launcher_ends_torchrun_and_its_ranks(tmp_path):
    path = script(tmp_path, _SLEEPER.format(folder=str(tmp_path)))
    proc = _start_and_wait_ready(path, 2, "--launcher", "torchrun")
    ranks = [(tmp_path / f"rank.{r}").read_text().split() for r in range(2)]
    pids, run_dir = [int(pid) for pid, _ in ranks], ranks[0][1]
    proc.kill()
    proc.communicate()
    killed = time.monotonic()
    while any(map(_alive, pids)) and time.monotonic() - killed < 15:
        time.sleep(0.1)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} still run 15 s after the launcher was killed"
    assert run_dir in launcher.remove_stale_run_dirs()
    assert not Path(run_dir).exists()


_STUBBORN = """
    import os, pathlib, signal, time
    if os.environ["RANK"] == "1":  # only a kill ends this rank
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    pathlib.Path({folder!r}, "rank." + os.environ["RANK"]).write_text(str(os.getpid()))
    print("ready", flush=True)
    time.sleep(300)
"""


@launches
def test_ctrl_c_stops_torchrun_and_its_ranks_with_one_line(tmp_path):
    """Rank 0 ends when torchrun passes the stop on; rank 1 ignores it and is killed once
    torchrun is (after 5 s), not left behind."""
    path = script(tmp_path, _STUBBORN.format(folder=str(tmp_path)))
    proc = _start_and_wait_ready(path, 2, "--launcher", "torchrun")
    pids = [int((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the foreground group
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()  # reaped, its pipes closed: nothing left for a later test
        pytest.fail("the launcher did not stop after Ctrl-C")
    finally:
        time.sleep(0.5)  # a killed rank's parent (torchrun, killed too) no longer waits for it
        alive = [pid for pid in pids if _running(pid)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip() == "axondist run: interrupted; the job was stopped", err
    assert not alive, f"ranks {alive} outlived the launcher"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return _alive(pid)
