"""Re-saves that are killed or fail under ``mpiexec -n 2`` never lose the last good checkpoint.

Each case starts ``tests/faults/scripts/checkpoint_save.py`` (an FSDP model whose two ranks
both write shard files) under ``mpiexec -n 2`` in its own bounded ``timeout``, over a copy
of a committed checkpoint, with a fault injected on one rank at a chosen change of the
directory: SIGKILL (after a change, or with a file half-written), a full disk, a read-only
file system, or a pause while a second job tries to save to the same root. Afterwards the
root loads as exactly the old or exactly the new checkpoint, and the next save cleans up
and succeeds. The same holds with the ``latest`` pointer deleted or damaged (the steps on
disk stay loadable, and the error says how to repair the pointer), and a full ``.npz``
save that meets a full or read-only disk fails on every rank naming the file and the cause
(``scripts/checkpoint_full.py``, on the mock world and under ``mpiexec -n 2``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import axondist as ad
from axondist.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_full_checkpoint,
    load_sharded_checkpoint,
    save_full_checkpoint,
    save_sharded_checkpoint,
)
from axondist.checkpoint.files import RELEASE_ENV
from axondist.launching.worlds import launched_by_mpi
from axondist.optim import Adam
from faults.runner import LIMIT, run_case

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "faults" / "scripts" / "checkpoint_save.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 60.0

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(launched_by_mpi(), reason="starts its own mpiexec jobs"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or not MPIEXEC.exists(),
                       reason="needs mpi4py and MPICH's mpiexec next to the interpreter"),
]

spec = importlib.util.spec_from_file_location("checkpoint_save", SCRIPT)
assert spec is not None and spec.loader is not None
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "AXONDIST_TIMEOUT": "30", "PYTHONUNBUFFERED": "1",
           "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("AXONDIST_BACKEND", None)
    env.pop("AXONDIST_CHECKPOINT_FAULT", None)
    return env


def _cmd(root: Path, seed: int, step: int, fault: tuple[int, str] | None) -> list[str]:
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, str(SCRIPT), str(root), str(seed), str(step)]
    return cmd + ([str(fault[0]), fault[1]] if fault else [])


def mpi_save(root: Path, seed: int, step: int, fault: tuple[int, str] | None = None,
             **env: str) -> subprocess.CompletedProcess[str]:
    """One ``mpiexec -n 2`` save; the job (its whole session) is killed after TIMEOUT."""
    proc = subprocess.Popen(_cmd(root, seed, step, fault), env=_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the save with fault {fault} did not end within {TIMEOUT} s:\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _fsdp_save(world: ad.World, root: str, seed: int, step: int) -> None:
    f = ad.FSDP(script.dense(seed), world, sharding_strategy="full_shard")
    opt = Adam(f.sharded_parameters(), lr=0.1)
    for p in f.sharded_parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    save_sharded_checkpoint(root, f, opt, step=step, metadata={"seed": seed})


def loaded(root: Path, step: int | None = None) -> tuple[int, list[np.ndarray], dict]:
    """(saved seed, parameters, optimizer state) of the root's latest checkpoint (or of
    ``step``'s)."""
    params = script.dense(99)
    opt = Adam(params, lr=0.1)
    meta = load_sharded_checkpoint(root, params, opt, step=step)
    return meta["seed"], [p.data.copy() for p in params], opt.state_dict()["state"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    """The old checkpoint (seed 0, step 1) to re-save over, and the values old and new hold
    (saved by a 2-rank mock world: the same files an MPI job writes)."""
    base = tmp_path_factory.mktemp("templates")
    old, new = base / "old", base / "new"
    ad.spawn(_fsdp_save, 2, str(old), 0, 1)
    ad.spawn(_fsdp_save, 2, str(new), 1, 2)
    return {"old": old, "values": {0: loaded(old), 1: loaded(new)}}


def _same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
            and all(np.array_equal(a[2][k][n], b[2][k][n]) for k in b[2] for n in b[2][k]))


def _fresh_root(tmp_path: Path, checkpoints: dict) -> Path:
    root = tmp_path / "root"
    shutil.copytree(checkpoints["old"], root)
    return root


def _assert_next_save_cleans_up(root: Path) -> None:
    ad.spawn(_fsdp_save, 2, str(root), 2, 3)
    assert loaded(root)[0] == 2
    history = [f"step-{s:08d}" for s in Checkpointer(root).steps()]
    assert sorted(os.listdir(root)) == sorted(["latest", *history])


# Rank 0's changes in a re-save: 1 lock, 2-4 its shard files, 5 the index, 6 the rename of the
# staging directory, 7 the pointer swap; its temporary files: 1-3 shards, 4 index, 5 pointer.
KILLS = [
    ((0, "kill:1"), 0),      # holding the lock, nothing written
    ((1, "kill-tmp:2"), 0),  # rank 1 with a shard file half-renamed
    ((0, "kill-tmp:4"), 0),  # the index written, not yet in place
    ((0, "kill:6"), 0),      # the new step-N in place, the pointer not yet swapped
    ((0, "kill:7"), 1),      # the pointer swapped: the new checkpoint is the latest
]


@pytest.mark.parametrize(("fault", "expect"), KILLS, ids=[f"rank{f[0]}-{f[1]}" for f, _ in KILLS])
def test_sigkill_during_a_resave_leaves_old_or_new(tmp_path: Path, checkpoints: dict,
                                                   fault: tuple[int, str], expect: int) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    result = mpi_save(root, 1, 2, fault)
    assert result.returncode != 0, result.stdout
    assert "saved" not in result.stdout.replace("events", "")
    assert _same(loaded(root), checkpoints["values"][expect]), f"expected seed {expect}"
    _assert_next_save_cleans_up(root)


def test_unfaulted_mpi_resave_commits(tmp_path: Path, checkpoints: dict) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    result = mpi_save(root, 1, 2, (0, "kill:99"))  # counts rank 0's changes
    assert result.returncode == 0 and "events=7" in result.stdout, result.stdout
    assert _same(loaded(root), checkpoints["values"][1])


@pytest.mark.parametrize(("fault", "text"), [
    ((1, "enospc:2"), "writing the shard files failed on 1 rank.*?rank 1: .*?No space left"),
    ((0, "erofs:1"), "cannot start a save in .*?Read-only file system"),
    ((0, "enospc:5"), "No space left on device"),  # the index cannot be written
])
def test_full_disk_or_read_only_fails_cleanly_on_every_rank(tmp_path: Path, checkpoints: dict,
                                                            fault: tuple[int, str],
                                                            text: str) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    result = mpi_save(root, 1, 2, fault)
    assert result.returncode == 3, result.stdout
    # both ranks raise the same error (their lines may interleave)
    assert len(re.findall(f"CheckpointError: save_sharded_checkpoint: .*?{text}",
                          result.stdout)) == 2, result.stdout
    assert _same(loaded(root), checkpoints["values"][0])
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"]  # no staging, no lock
    _assert_next_save_cleans_up(root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_really_read_only_root(tmp_path: Path, checkpoints: dict) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    root.chmod(0o555)
    try:
        result = mpi_save(root, 1, 2)
    finally:
        root.chmod(0o755)
    assert result.returncode == 3 and "cannot start a save" in result.stdout, result.stdout
    assert _same(loaded(root), checkpoints["values"][0])


def test_a_second_job_is_refused_while_the_first_saves(tmp_path: Path, checkpoints: dict) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    release = tmp_path / "release"
    first = subprocess.Popen(_cmd(root, 1, 2, (0, "pause:2")), text=True,
                             env=_env(**{RELEASE_ENV: str(release)}), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (root / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        second = mpi_save(root, 2, 5)
        release.touch()
        out, _ = first.communicate(timeout=TIMEOUT)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert first.returncode == 0 and out.count("saved") == 2, out
    pids = [int(p) for p in re.findall(r"pid=(\d+)", out)]
    assert second.returncode == 3, second.stdout
    named = f"another writer (host {socket.gethostname()}, pid "
    assert second.stdout.count(named) == 2, second.stdout
    assert any(f"pid {p}," in second.stdout for p in pids), (pids, second.stdout)
    assert _same(loaded(root), checkpoints["values"][1])  # the first job's save, intact


# --- a deleted or damaged `latest` pointer ---------------------------------------------------

def test_latest_deleted_then_a_save_killed_after_its_first_file_keeps_step_1(
        tmp_path: Path, checkpoints: dict) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    (root / "latest").unlink()
    assert Checkpointer(root).steps() == [1]  # the newest complete step on disk is the latest
    result = mpi_save(root, 1, 2, (0, "kill:2"))  # rank 0: 1 the lock, 2 its first shard file
    assert result.returncode != 0, result.stdout
    assert "saved" not in result.stdout.replace("events", "")
    assert Checkpointer(root).steps() == [1]
    assert _same(loaded(root), checkpoints["values"][0])
    _assert_next_save_cleans_up(root)
    assert Checkpointer(root).steps() == [1, 3]


def test_latest_deleted_then_a_save_keeps_every_older_step(tmp_path: Path,
                                                           checkpoints: dict) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    (root / "latest").unlink()
    result = mpi_save(root, 1, 2)
    assert result.returncode == 0 and result.stdout.count("saved") == 2, result.stdout
    assert Checkpointer(root).steps() == [1, 2]
    assert _same(loaded(root), checkpoints["values"][1])
    assert _same(loaded(root, step=1), checkpoints["values"][0])


def _damage(root: Path, how: str) -> str:
    """Damage the pointer; return the start of what the error says about it."""
    pointer = root / "latest"
    if how == "folder":
        pointer.unlink()
        pointer.mkdir()
        return "cannot be read (IsADirectoryError"
    pointer.write_bytes(b"\x00garbage\xff" * 3)
    return "is not valid JSON"


@pytest.mark.parametrize("how", ["garbage", "folder"])
def test_a_damaged_pointer_names_the_steps_on_disk_and_the_repair(tmp_path: Path,
                                                                  checkpoints: dict,
                                                                  how: str) -> None:
    root = _fresh_root(tmp_path, checkpoints)
    problem = _damage(root, how)
    result = mpi_save(root, 1, 2)
    assert result.returncode == 3, result.stdout
    said = (re.escape(f"the 'latest' pointer {root / 'latest'} {problem}") + ".*?"
            + re.escape(f"The complete checkpoints on disk are steps [1]: load one with "
                        f"load_sharded_checkpoint('{root}', target, step=1), or rebuild the "
                        "pointer from them with axondist.checkpoint.repair(root) (or: python -m "
                        "axondist checkpoint repair ROOT)"))
    assert len(re.findall("CheckpointError: save_sharded_checkpoint: .*?" + said,
                          result.stdout)) == 2, result.stdout  # on both ranks
    with pytest.raises(CheckpointError, match=said):
        loaded(root)
    assert _same(loaded(root, step=1), checkpoints["values"][0])  # needs no pointer
    repair = subprocess.run([sys.executable, "-m", "axondist", "checkpoint", "repair", str(root)],
                            env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert f"moved it to {root / 'latest.corrupt'}" in repair.stdout, repair.stdout
    assert "rewrote the pointer: steps [1], latest step 1" in repair.stdout, repair.stdout
    assert _same(loaded(root), checkpoints["values"][0])
    result = mpi_save(root, 1, 2)
    assert result.returncode == 0, result.stdout
    assert Checkpointer(root).steps() == [1, 2]
    assert _same(loaded(root), checkpoints["values"][1])


def test_repair_of_a_root_without_a_complete_step_fails_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "latest").write_bytes(b"junk")
    repair = subprocess.run([sys.executable, "-m", "axondist", "checkpoint", "repair",
                             str(tmp_path)], env=_env(), capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert repair.returncode == 1, repair.stdout + repair.stderr
    assert f"checkpoint.repair: {tmp_path} holds no complete checkpoint" in repair.stdout
    assert (tmp_path / "latest").read_bytes() == b"junk"  # nothing moved or removed


# --- the full .npz format on a full or read-only disk ----------------------------------------

FULL_SCRIPT = REPO / "tests" / "faults" / "scripts" / "checkpoint_full.py"
FULL_CAUSES = {"enospc": "ENOSPC (No space left on device); free space on that disk",
               "erofs": "EROFS (Read-only file system); the file system is read-only",
               "fsync": "ENOSPC (No space left on device); free space on that disk"}


@pytest.mark.parametrize("mode", ["mock", "mpi"])
@pytest.mark.parametrize("case", [*FULL_CAUSES, "none"])
def test_full_checkpoint_on_a_full_or_read_only_disk(tmp_path: Path, case: str,
                                                     mode: str) -> None:
    path = tmp_path / "model.npz"
    save_full_checkpoint(path, {"w": np.zeros((3, 2)), "b": np.zeros(2)},
                         group=ad.World.mock())  # the file a failed save must leave alone
    out = run_case(FULL_SCRIPT, case, mode, 2, {"AXONDIST_TEST_FULL_PATH": str(path)})
    assert out.seconds < LIMIT, out.output
    want = 7.0 if case == "none" else 0.0
    np.testing.assert_array_equal(load_full_checkpoint(path)["w"], np.full((3, 2), want))
    assert os.listdir(tmp_path) == ["model.npz"], os.listdir(tmp_path)  # no temporary file
    if case == "none":
        assert out.returncode == 0 and out.output.count(" saved") == 2, out.output
        return
    assert out.returncode == 3, out.output
    said = (rf"rank [01]: CheckpointError: save_full_checkpoint: cannot write {path}: "
            + re.escape(FULL_CAUSES[case]))
    assert len(re.findall(said, out.output)) == 2, out.output  # on both ranks


# --- examples/resume.py: killed under mpiexec -n 3, resumed under mpiexec -n 2 --------------

def _example(n: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(REPO / "examples" / "resume.py"),
           *args]
    proc = subprocess.Popen(cmd, env=_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT * 2)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"examples/resume.py {args} did not end within {TIMEOUT * 2} s:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_example_killed_at_3_ranks_resumed_at_2_equals_an_uninterrupted_run(
        tmp_path: Path, strategy: str) -> None:
    pytest.importorskip("sklearn")
    common = ["--dir", str(tmp_path / "run"), "--strategy", strategy, "--steps", "24",
              "--every", "8"]
    killed = _example(3, [*common, "--kill-at", "20", "--no-verify"])
    assert killed.returncode != 0, killed.stdout
    assert Checkpointer(tmp_path / "run").latest_step() == 16  # step 8's and 16's committed
    resumed = _example(2, common)
    assert resumed.returncode == 0, resumed.stdout
    assert f"resumed from step 16 at 2 ranks ({strategy})" in resumed.stdout
    assert "equal an uninterrupted single-process run bit for bit: True" in resumed.stdout
