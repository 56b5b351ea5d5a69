"""``axondist run``: rank-tagged output, one summary line for a failed rank (an exception, an
exit code, a signal, a rank left waiting), restarts that let a job carry on, and the argument
checks. Every launch runs in its own session under a timeout, so a hang fails the test."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist._environment import launched_by_mpi
from axondist.errors import LaunchError
from axondist.launching import supervisor as launcher
from axondist.launching.supervisor import RankFailure, RunConfig, build_command, parse_args, summary

ROOT = Path(__file__).resolve().parents[2]
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
TIMEOUT = 120


def _why_no_launch() -> str | None:
    if launched_by_mpi():
        return "already under mpiexec: the launcher tests do not recurse"
    if importlib.util.find_spec("mpi4py") is None:
        return "needs mpi4py (pip install '.[mpi]')"
    try:
        mpiexec = launcher.find_mpiexec()
    except LaunchError as exc:
        return str(exc)
    if launcher.mpiexec_flavour(mpiexec) != "hydra":
        return "the launch tests read hydra's (MPICH's) behaviour"
    return None


_NO_LAUNCH = _why_no_launch()


def launches(test):
    """Mark a test that starts mpiexec: skipped where it cannot."""
    return pytest.mark.mpi(pytest.mark.skipif(_NO_LAUNCH is not None,
                                              reason=str(_NO_LAUNCH))(test))


def axondist_run(*args: str, cwd: Path | None = None, path_first: Path | None = None,
                 timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``python -m axondist run ARGS`` in its own session; the whole session is killed when it
    outlives the timeout, so a hung rank cannot outlive the test. ``path_first`` goes first on
    ``PYTHONPATH`` (a folder of stand-in modules)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path_first or ""), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    env.pop(launcher.RESTART_COUNT_VAR, None)
    return run_in_session([sys.executable, "-m", "axondist", "run", *args], env, timeout,
                          cwd or ROOT)


def run_in_session(command: list[str], env: dict[str, str], timeout: float,
                   cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; kill the whole session and fail the test when it
    outlives ``timeout`` seconds."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(command)} hung for {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def script(tmp_path: Path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# --- pure parts ----------------------------------------------------------------------------

def test_command_under_hydra_tags_through_per_rank_files():
    cfg = RunConfig(nprocs=4, target=("train.py", "--lr", "0.1"), nproc_per_node=2,
                    hosts=("a", "b"))
    cmd = build_command(cfg, "/x/mpiexec", "hydra", "/tmp/d", python="/py")
    assert cmd[:9] == ["/x/mpiexec", "-n", "4", "-ppn", "2", "-hosts", "a,b",
                       "-outfile-pattern", "/tmp/d/out.%r"]
    assert cmd[-6:] == ["/py", "-c", launcher._RANK_ENTRY, "train.py", "--lr", "0.1"]
    hostfile = build_command(RunConfig(nprocs=2, target=("-m", "pkg"), hostfile="hf"),
                             "mpiexec", "hydra", None, python="py")
    assert hostfile == ["mpiexec", "-n", "2", "-f", "hf", "py", "-c", launcher._RANK_ENTRY,
                        "-m", "pkg"]
    ompi = build_command(cfg, "mpirun", "openmpi", "/tmp/d", python="py")
    assert ["--map-by", "ppr:2:node"] == ompi[3:5] and "--tag-output" in ompi
    assert "-outfile-pattern" not in ompi


@given(n=st.integers(1, 64), ppn=st.one_of(st.none(), st.integers(1, 8)),
       restarts=st.integers(0, 5), args=st.lists(st.sampled_from(["-n", "x", "--lr", "-m"]),
                                                 max_size=4))
def test_parse_args_keeps_the_scripts_own_arguments(n, ppn, restarts, args):
    argv = ["-n", str(n), "--max-restarts", str(restarts)]
    if ppn is not None:
        argv += ["--nproc-per-node", str(ppn)]
    cfg = parse_args([*argv, "train.py", *args])
    assert cfg.nprocs == n and cfg.nproc_per_node == ppn and cfg.max_restarts == restarts
    assert cfg.target == ("train.py", *args)


def test_parse_args_module_and_derived_size():
    cfg = parse_args(["--nproc-per-node", "3", "--hosts", "a,b", "-m", "pkg.train", "--x"])
    assert cfg.nprocs == 6 and cfg.hosts == ("a", "b")
    assert cfg.target == ("-m", "pkg.train", "--x")


@pytest.mark.parametrize("argv, match", [
    (["-n", "0", "s.py"], "-n must be >= 1, got 0"),
    (["-n", "2"], "no script given"),
    (["s.py"], "give the number of processes with -n N"),
    (["-n", "2", "--max-restarts", "-1", "s.py"], "--max-restarts must be >= 0, got -1"),
    (["-n", "2", "--nproc-per-node", "0", "s.py"], "--nproc-per-node must be >= 1"),
    (["-n", "2", "--hostfile", "/no/such/file", "s.py"], "--hostfile '/no/such/file' does not"),
    (["-n", "2", "--hosts", ",", "s.py"], "names no host"),
    (["-n", "2", "--stop-grace", "nan", "s.py"], "--stop-grace must be >= 0"),
])
def test_bad_arguments_are_named(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_bad_arguments_exit_2_from_the_command_line(capsys):
    assert launcher.main(["-n", "0", "s.py"]) == 2
    assert "axondist run: -n must be >= 1" in capsys.readouterr().err


def test_no_mpiexec_names_both_places(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError) as info:
        launcher.find_mpiexec()
    text = str(info.value)
    assert str(tmp_path / "mpiexec") in text and "none on PATH" in text
    assert "pip install '.[mpi]'" in text
    with pytest.raises(LaunchError, match="--mpiexec 'nope' is not an executable"):
        launcher.find_mpiexec("nope")


def test_summary_is_one_line_then_the_tail():
    failure = RankFailure(1, signal_number=9, tail=["a", "b"])
    lines = summary(failure, 3, 2.04)
    assert lines == ["axondist run: rank 1 of 3 failed after 2.0 s (killed by signal 9 "
                     "(SIGKILL)); last 2 lines of rank 1:", "    | a", "    | b"]
    assert failure.exit_status == 137
    bare = RankFailure(None, exit_code=5, reason="mpiexec failed")
    assert summary(bare, 2, 0.0) == ["axondist run: the job (2 ranks) failed after 0.0 s "
                                     "(exit code 5: mpiexec failed)"]
    assert bare.exit_status == 5


# --- real launches -------------------------------------------------------------------------

@launches
@pytest.mark.parametrize("n", [2, 3])
def test_output_is_tagged_with_the_rank(n, tmp_path):
    path = script(tmp_path, """
        import os, sys
        print("out of", os.environ["PMI_RANK"], sys.argv[1:])
        print("err of", os.environ["PMI_RANK"], file=sys.stderr)
        print("restart", os.environ["AXONDIST_RESTART_COUNT"])
    """)
    proc = axondist_run("-n", str(n), path, "--flag", "x")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(n):
        assert f"[rank {r}] out of {r} ['--flag', 'x']" in proc.stdout.splitlines()
        assert f"[rank {r}] err of {r}" in proc.stderr.splitlines()
    assert proc.stdout.count("restart 0") == n
    assert "\x1e" not in proc.stdout + proc.stderr  # the ranks' reports stay hidden


@launches
def test_an_exception_on_one_rank_ends_the_job_with_one_summary_line(tmp_path):
    path = script(tmp_path, """
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        print("step 1 on", rank, flush=True)
        if rank == 1:
            raise RuntimeError("loss is nan")
        MPI.COMM_WORLD.Barrier()  # rank 0 would wait here forever without the abort
    """)
    proc = axondist_run("-n", "2", path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("axondist run:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("axondist run: rank 1 of 2 failed after")
    assert "(exit code 1: RuntimeError: loss is nan); last line of rank 1 before its " \
        "traceback:" in lines[0]
    assert "    | step 1 on 1" in proc.stderr
    # the traceback shows once, live and tagged; the summary quotes what came before it
    assert proc.stderr.count("Traceback (most recent call last):") == 1, proc.stderr
    assert proc.stderr.count("RuntimeError: loss is nan") == 2, proc.stderr  # its last line
    assert "[rank 1] Traceback (most recent call last):" in proc.stderr
    assert "runpy" not in proc.stderr and "in_rank" not in proc.stderr
    assert "BAD TERMINATION" not in proc.stdout + proc.stderr


@launches
def test_a_signal_is_named(tmp_path):
    # The other ranks end first, so hydra's report of the killed process is unambiguous.
    path = script(tmp_path, """
        import os, signal, time
        if os.environ["PMI_RANK"] == "2":
            time.sleep(0.5)
            print("about to die", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = axondist_run("-n", "3", path)
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr
    assert "axondist run: rank 2 of 3 failed" in proc.stderr
    assert "killed by signal 9 (SIGKILL)" in proc.stderr
    assert "    | about to die" in proc.stderr
    assert "BAD TERMINATION" not in proc.stdout + proc.stderr


@launches
def test_a_crash_prints_the_python_stack(tmp_path):
    path = script(tmp_path, """
        import ctypes, os
        if os.environ["PMI_RANK"] == "1":
            ctypes.string_at(0)  # a segmentation fault
    """)
    proc = axondist_run("-n", "2", path)
    assert proc.returncode == 128 + 11, proc.stdout + proc.stderr
    assert "axondist run: rank 1 of 2 failed" in proc.stderr
    assert "killed by signal 11 (SIGSEGV)" in proc.stderr
    assert "[rank 1] Fatal Python error: Segmentation fault" in proc.stderr


@launches
def test_an_exit_code_without_mpi_stops_the_waiting_ranks(tmp_path):
    path = script(tmp_path, """
        import os, sys, time
        if os.environ["PMI_RANK"] == "0":
            sys.exit(3)
        time.sleep(300)  # no MPI here: only the launcher can end this rank
    """)
    proc = axondist_run("-n", "2", "--stop-grace", "0.5", path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "axondist run: rank 0 of 2 failed" in proc.stderr
    assert "exit code 3: sys.exit(3)" in proc.stderr


@launches
def test_max_restarts_relaunches_a_job_that_fails_once(tmp_path):
    marker = tmp_path / "failed-once"
    path = script(tmp_path, f"""
        import os, pathlib, sys
        from mpi4py import MPI
        rank, restarts = MPI.COMM_WORLD.rank, os.environ["AXONDIST_RESTART_COUNT"]
        marker = pathlib.Path({str(marker)!r})
        print("attempt", restarts, "rank", rank, flush=True)
        if rank == 1 and not marker.exists():
            marker.write_text("x")
            raise SystemExit("rank 1 lost its node")
        MPI.COMM_WORLD.Barrier()
        print("finished", restarts)
    """)
    proc = axondist_run("-n", "2", "--max-restarts", "1", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "axondist run: rank 1 of 2 failed" in proc.stderr
    assert "rank 1 lost its node" in proc.stderr
    assert ("axondist run: restarting the job (restart 1 of 1; the script sees "
            "AXONDIST_RESTART_COUNT=1)") in proc.stderr
    assert "[rank 0] finished 1" in proc.stdout and "[rank 1] finished 1" in proc.stdout
    assert "finished 0" not in proc.stdout


@launches
def test_restarts_run_out(tmp_path):
    path = script(tmp_path, """
        import os, sys
        print("try", os.environ["AXONDIST_RESTART_COUNT"])
        sys.exit(4)
    """)
    proc = axondist_run("-n", "2", "--max-restarts", "2", path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert proc.stderr.count("axondist run: restarting the job") == 2
    assert "axondist run: giving up after 2 restarts" in proc.stderr
    assert "[rank 0] try 2" in proc.stdout


@launches
def test_a_module_runs_with_python_m_semantics(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "import os, sys\nprint(__name__, os.environ['PMI_RANK'], sys.argv[1:])\n")
    proc = axondist_run("-n", "2", "-m", "pkg.train", "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 1] __main__ 1 ['--steps', '3']" in proc.stdout


@launches
def test_a_script_imports_modules_beside_it(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    path = script(tmp_path, "import helper\nprint('value', helper.VALUE, __name__)\n")
    proc = axondist_run("-n", "2", path)  # cwd is the repository, not the script's folder
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] value 42 __main__" in proc.stdout


@launches
@pytest.mark.parametrize("user_value", [None, "0"])
def test_mpichs_single_copy_reaches_every_rank_before_mpi_starts(tmp_path, monkeypatch,
                                                                  user_value):
    """Under hydra (MPICH's mpiexec) each rank ``axondist run`` starts sets
    ``MPIR_CVAR_CH4_CMA_ENABLE`` where its own host allows single-copy reads, before the script
    runs (a script that starts MPI itself, as ``python -m mpi4py`` does, gets it too); a value
    the user exported is kept."""
    from axondist.backends.mpi.single_copy import CMA_VARIABLE, why_not_permitted

    if launcher.mpiexec_flavour(launcher.find_mpiexec()) != "hydra":
        pytest.skip("the mpiexec here is not MPICH's hydra")
    monkeypatch.delenv(CMA_VARIABLE, raising=False)
    if user_value is not None:
        monkeypatch.setenv(CMA_VARIABLE, user_value)
    expected = user_value or ("1" if why_not_permitted() is None else "unset")
    path = script(tmp_path, f"import os\nprint('cma', os.environ.get({CMA_VARIABLE!r}, 'unset'))\n")
    proc = axondist_run("-n", "2", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        assert f"[rank {rank}] cma {expected}" in proc.stdout, proc.stdout + proc.stderr


@launches
def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    path = script(tmp_path, f"""
        import os, pathlib, time
        pathlib.Path({str(tmp_path)!r}, "pid." + os.environ["PMI_RANK"]).write_text(
            str(os.getpid()))
        print("ready", flush=True)
        time.sleep(300)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "axondist", "run", "-n", "2", path],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        ready = 0
        for line in proc.stdout:
            ready += line.endswith("ready\n")
            if ready == 2:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()  # reaped, its pipes closed: nothing left for a later test
        pytest.fail("the launcher did not stop after SIGTERM")
    assert proc.returncode == 130, err
    assert "axondist run: interrupted; the job was stopped" in err
    for rank in range(2):
        pid = int((tmp_path / f"pid.{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_and_wait_ready(path: str, n: int, *options: str) -> subprocess.Popen[str]:
    """``axondist run -n N [options] path`` in its own session, once every rank printed
    "ready"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "axondist", "run", "-n", str(n), *options,
                             path],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    ready = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        ready += line.endswith("ready\n")
        if ready == n:
            return proc
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the job ended before every rank was ready: {proc.communicate()}")


_SLEEPER = """
    import os, pathlib, time
    pathlib.Path({folder!r}, "rank." + os.environ["PMI_RANK"]).write_text(
        f"{{os.getpid()}} {{os.environ['AXONDIST_RUN_DIR']}}")
    print("ready", flush=True)
    time.sleep(300)
"""


def test_a_stop_signal_raises_nothing_where_it_lands():
    """The launcher's handler only records a stop: an exception raised where the signal
    lands could land inside ``Popen.poll`` holding its wait lock, and the launcher would then
    wait for mpiexec forever (a Ctrl-C that stopped nothing). The job's loop acts on it."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    previous = signal.signal(signal.SIGINT, launcher._interrupt)
    launcher._STOP_REQUESTED.clear()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while not launcher._STOP_REQUESTED.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler runs between bytecodes: it raised nothing here
        assert launcher._STOP_REQUESTED.is_set()
    finally:
        signal.signal(signal.SIGINT, previous)
        launcher._STOP_REQUESTED.clear()


def test_a_stop_signal_landing_at_any_line_of_the_loops_wait_returns():
    """A signal's handler runs between any two lines of the main thread, so the wait loop's
    sleep must hold no lock the handler takes (a ``threading.Event`` does: Ctrl-C once hung
    the launcher in its own handler). Here the handler runs before every line the wait runs,
    in a process of its own under a timeout."""
    code = textwrap.dedent("""
        import signal, sys
        from axondist.launching import supervisor

        def land_here(frame, event, arg):
            if event == "line":
                supervisor._interrupt(signal.SIGINT, frame)
            return land_here

        for _ in range(3):
            supervisor._STOP_REQUESTED.clear()
            sys.settrace(land_here)
            supervisor._STOP_REQUESTED.wait(0.01)
            sys.settrace(None)
            assert supervisor._STOP_REQUESTED.is_set()
        print("returned")
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("a stop signal landing inside the wait blocked its handler")
    assert proc.returncode == 0 and proc.stdout == "returned\n", proc.stderr


@launches
def test_ctrl_c_stops_the_job_with_one_line(tmp_path):
    path = script(tmp_path, _SLEEPER.format(folder=str(tmp_path)))
    proc = _start_and_wait_ready(path, 2)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the foreground group
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()  # reaped, its pipes closed: nothing left for a later test
        pytest.fail("the launcher did not stop after Ctrl-C")
    assert proc.returncode == 130, err
    assert err.strip() == "axondist run: interrupted; the job was stopped", err
    assert "[mpiexec@" not in out + err and "[proxy" not in out + err


@launches
def test_sigkill_of_the_launcher_ends_the_job_and_a_later_run_removes_its_folder(tmp_path):
    path = script(tmp_path, _SLEEPER.format(folder=str(tmp_path)))
    proc = _start_and_wait_ready(path, 2)
    ranks = [(tmp_path / f"rank.{r}").read_text().split() for r in range(2)]
    pids, run_dir = [int(pid) for pid, _ in ranks], ranks[0][1]
    proc.kill()
    proc.communicate()
    killed = time.monotonic()
    while any(map(_alive, pids)) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    alive = [pid for pid in pids if _alive(pid)]
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} still run 10 s after the launcher was killed"
    assert Path(run_dir).is_dir()  # nobody was left to remove it...
    assert run_dir in launcher.remove_stale_run_dirs()  # ...until the next run starts
    assert not Path(run_dir).exists()


def test_a_live_launchers_folder_is_kept(tmp_path):
    mine = tmp_path / f"axondist-run-{os.getpid()}-abc"
    dead = tmp_path / "axondist-run-999999999-abc"
    other = tmp_path / "axondist-run-notapid"
    for folder in (mine, dead, other):
        folder.mkdir()
    assert launcher.remove_stale_run_dirs(str(tmp_path)) == [str(dead)]
    assert mine.is_dir() and other.is_dir()


@launches
def test_a_rank_that_ends_with_os_exit_is_named(tmp_path):
    path = script(tmp_path, """
        import os, numpy as np, axondist as ad
        world = ad.init("mpi")
        ad.barrier()
        print("after the barrier", flush=True)
        if world.rank == 1:
            os._exit(3)
        ad.all_reduce(np.ones(4))
    """)
    proc = axondist_run("-n", "3", path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("axondist run:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("axondist run: rank 1 of 3 failed after"), proc.stderr
    assert "(exit code 3: its peers saw it leave (it called os._exit(3)))" in lines[0]
    assert "    | after the barrier" in proc.stderr


@launches
def test_python_c_and_no_python_run_on_every_rank(tmp_path):
    code = "import os, sys; print('c on', os.environ['PMI_RANK'], sys.argv[1:], __name__)"
    by_python = axondist_run("-n", "2", "python", "-c", code, "x")
    assert by_python.returncode == 0, by_python.stdout + by_python.stderr
    assert "[rank 1] c on 1 ['x'] __main__" in by_python.stdout
    program = axondist_run("-n", "2", "--no-python", "sh", "-c", "echo sh on $PMI_RANK")
    assert program.returncode == 0, program.stdout + program.stderr
    assert sorted(program.stdout.splitlines()) == ["[rank 0] sh on 0", "[rank 1] sh on 1"]


@pytest.mark.parametrize("argv,match", [
    (["-n", "2", "echo", "x"], r"'echo' is a program, not a Python script; give --no-python"),
    (["-n", "2", sys.executable, "-u", "x.py"], r"after the interpreter give a script, -m "
                                                r"MODULE or -c CODE"),
    (["-n", "2", "--no-python", "-m", "pkg"], r"--no-python runs a program; -m runs a Python"),
])
def test_a_program_in_place_of_a_script_is_named(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_python_targets_parse_to_the_rank_entrys_forms():
    cfg = parse_args(["-n", "2", "python", "-c", "print(1)", "a"])
    assert cfg.target == ("-c", "print(1)", "a") and cfg.python is not None
    assert parse_args(["-n", "2", "python3", "-mpkg.x", "a"]).target == ("-m", "pkg.x", "a")
    assert parse_args(["-n", "2", "--no-python", "echo", "a"]).target == ("echo", "a")
    command = build_command(parse_args(["-n", "2", "--no-python", "echo", "a"]), "mpiexec",
                            "hydra", None)
    assert command == ["mpiexec", "-n", "2", "echo", "a"]


@launches
def test_hosts_and_hostfile_reach_mpiexec(tmp_path):
    path = script(tmp_path, "import os\nprint('on', os.environ['PMI_RANK'])\n")
    (tmp_path / "hosts").write_text("localhost:3\n")
    by_file = axondist_run("-n", "3", "--hostfile", str(tmp_path / "hosts"), path)
    assert by_file.returncode == 0, by_file.stdout + by_file.stderr
    assert sorted(by_file.stdout.splitlines()) == [f"[rank {r}] on {r}" for r in range(3)]
    by_name = axondist_run("--nproc-per-node", "2", "--hosts", "localhost", path)
    assert by_name.returncode == 0, by_name.stdout + by_name.stderr
    assert sorted(by_name.stdout.splitlines()) == [f"[rank {r}] on {r}" for r in range(2)]


def _job_without_a_launch(nprocs: int) -> launcher._Job:
    """A job's bookkeeping with nothing started: what its markers make of a failure."""
    import collections

    job = object.__new__(launcher._Job)
    job.cfg = RunConfig(nprocs=nprocs, target=("t.py",))
    job.tails = [collections.deque() for _ in range(nprocs)]
    job.pids = {r: (1000 + r, "host") for r in range(nprocs)}
    job.ended, job.reported, job.before_traceback = set(), set(), {}
    job.failure, job.lost, job.banner = None, None, {}
    job.launcher_lines = collections.deque()
    return job


@pytest.mark.parametrize("lost_first", [True, False])
def test_a_peers_error_about_a_rank_that_left_names_the_rank_that_left(lost_first):
    """Rank 1 calls os._exit(3); rank 0's collective fails first ("rank 1 ended") or its
    watchdog reports the departure first: either way the summary names rank 1."""
    job = _job_without_a_launch(2)
    failed = (f"{launcher._MARK} 0 failed 1 axondist.errors.WorldAbortedError: all_reduce on "
              "rank 0 of 2 (group world) cannot complete: rank 1 ended")
    lost = f"{launcher._MARK} 0 lost 1 it called os._exit(3)"
    for line in ([lost, failed] if lost_first else [failed, lost]):
        job._marker(0, line)
    failure = job.outcome(1)
    assert failure is not None and failure.rank == 1
    assert failure.describe() == "exit code 3: its peers saw it leave (it called os._exit(3))"


def test_a_rank_that_reported_its_own_error_stays_the_failure():
    job = _job_without_a_launch(2)
    job._marker(1, f"{launcher._MARK} 1 failed 1 ValueError: bad input")
    job._marker(0, f"{launcher._MARK} 0 failed 1 axondist.errors.WorldAbortedError: rank 1 "
                   "failed")
    failure = job.outcome(1)
    assert failure is not None and failure.rank == 1 and "ValueError" in failure.reason
