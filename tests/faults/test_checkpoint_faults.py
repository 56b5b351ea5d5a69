"""Re-saves that are killed or fail under ``mpiexec -n 2`` never lose the last good checkpoint.

Each case starts ``tests/faults/scripts/checkpoint_save.py`` (an FSDP model whose two ranks
both write shard files) under ``mpiexec -n 2`` in its own bounded ``timeout``, over a copy
of a committed checkpoint, with a fault injected on one rank at a chosen change of the
directory: SIGKILL (after a change, or with a file half-written), a full disk, a read-only
file system, or a pause while a second job tries to save to the same root. Afterwards the
root loads as exactly the old or exactly the new checkpoint, and the next save cleans up
and succeeds.
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
from axondist.checkpoint import Checkpointer, load_sharded_checkpoint, save_sharded_checkpoint
from axondist.checkpoint.files import RELEASE_ENV
from axondist.launch import launched_by_mpi
from axondist.optim import Adam

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


def loaded(root: Path) -> tuple[int, list[np.ndarray], dict]:
    """(saved seed, parameters, optimizer state) of the root's latest checkpoint."""
    params = script.dense(99)
    opt = Adam(params, lr=0.1)
    meta = load_sharded_checkpoint(root, params, opt)
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
