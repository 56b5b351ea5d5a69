"""The launch doors under every launcher: ``ad.run``, ``ad.spawn`` and ``ad.init`` answer the
same way under plain ``python`` (threads of the mock world), ``mpiexec -n 2`` (MPI) and
``torchrun --nproc-per-node 2`` (the torch backend), directly or through ``axondist run``.

Under a launcher, ``ad.run`` joins the launched world (one model, trained by every process),
``ad.spawn`` warns that it makes separate worlds, and a second ``ad.init`` returns the world
the first made (or is refused, with other arguments). Each launch runs in its own session
under a timeout (``axondist_run``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_launcher import _LAUNCH_PREFIXES, ROOT, axondist_run, run_in_session, script

from axondist._environment import env_launch_size, launched_by_mpi

TIMEOUT = 120

pytestmark = [
    pytest.mark.skipif(launched_by_mpi() or env_launch_size() is not None,
                       reason="already under a launcher: the launcher tests do not recurse"),
]

DOORS = """
    import os
    import warnings

    import numpy as np

    import axondist as ad

    def say(*words):  # one write: the ranks of a torchrun job share one stdout
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())

    def train(world):
        x = np.ones(1) * (world.rank + 1)
        ad.all_reduce(x)
        return world.world_size, float(x[0])

    for size, total in ad.run(train, 3):
        say("run", size, total)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ad.spawn(lambda w: None, 2)
    say("spawn-warned", any("separate worlds" in str(w.message) for w in caught))
    world = ad.init()
    say("init-same", ad.init() is world, world.backend.name, world.world_size)
    try:
        other = ad.init(timeout=7)
        say("init-other", other is world)
    except ad.LaunchError as exc:
        say("init-refused", str(exc).split(";")[0])
"""


def _torch() -> str | None:
    return None if importlib.util.find_spec("torch") else "needs torch (pip install '.[torch]')"


def _python(path: str, *launch: str) -> subprocess.CompletedProcess[str]:
    """``python path``, or ``LAUNCH... path``, from the checkout, in its own session, under a
    timeout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in ("RANK", "WORLD_SIZE",
                                                               "LOCAL_RANK", "AXONDIST_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return run_in_session([*launch, path] if launch else [sys.executable, path], env,
                          TIMEOUT)


def _lines(out: str, key: str) -> list[str]:
    return [line.split(key, 1)[1].strip() for line in out.splitlines() if f"{key} " in line]


def test_plain_python_runs_threads_and_keeps_one_mock_world(tmp_path: Path) -> None:
    proc = _python(script(tmp_path, DOORS))
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout, "run") == ["3 6.0"] * 3
    assert _lines(proc.stdout, "spawn-warned") == ["False"]
    assert _lines(proc.stdout, "init-same") == ["True mock 1"]
    assert _lines(proc.stdout, "init-other") == ["False"]  # a one-rank mock world is replaced


def _assert_one_launched_world(out: str, backend: str) -> None:
    assert sorted(_lines(out, "run")) == ["2 3.0"] * 2, out  # one world of 2, not 2 of 3
    assert _lines(out, "spawn-warned") == ["True"] * 2, out
    assert _lines(out, "init-same") == [f"True {backend} 2"] * 2, out
    refused = _lines(out, "init-refused")
    assert len(refused) == 2 and all("this process already has a world" in r
                                     for r in refused), out


@pytest.mark.mpi
def test_under_mpiexec_run_joins_the_mpi_world(tmp_path: Path) -> None:
    proc = axondist_run("-n", "2", script(tmp_path, DOORS), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_one_launched_world(proc.stdout, "mpi")


@pytest.mark.skipif(_torch() is not None, reason=str(_torch()))
def test_under_torchrun_run_joins_the_torch_world(tmp_path: Path) -> None:
    proc = _python(script(tmp_path, DOORS), sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_one_launched_world(proc.stdout, "torch")


@pytest.mark.skipif(_torch() is not None, reason=str(_torch()))
def test_under_axondist_run_with_torchrun_run_joins_the_torch_world(tmp_path: Path) -> None:
    proc = axondist_run("--launcher", "torchrun", "-n", "2", script(tmp_path, DOORS),
                        timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_one_launched_world(proc.stdout, "torch")


@pytest.mark.skipif(_torch() is not None, reason=str(_torch()))
def test_the_torch_autograd_example_trains_one_model_under_torchrun() -> None:
    proc = _python(str(ROOT / "examples" / "torch_autograd.py"), sys.executable, "-m",
                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": 2 ranks,") == 1, proc.stdout  # printed once, by rank 0
    assert ": 4 ranks," not in proc.stdout, proc.stdout


def test_a_launcher_without_a_backend_to_join_is_refused_by_run(tmp_path: Path) -> None:
    """torchrun's variables, the mock backend asked for: ``ad.run`` refuses, as init does."""
    path = script(tmp_path, "import axondist as ad\nad.run(lambda w: w.rank, 2)\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "AXONDIST_BACKEND": "mock", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode != 0
    assert "LaunchError" in proc.stderr and "each process would train its own model" in (
        proc.stderr), proc.stderr
