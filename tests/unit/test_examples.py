"""Every example runs, passes its own check against single-process training, and exits 0.

The JAX and PyTorch examples are skipped when the framework is not
installed; their own "not installed" path is tested by hiding the module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import UNDER_MPI, mock_only

ROOT = Path(__file__).resolve().parents[2]
# Variables an MPI launcher sets: a child started without them is not part of a launch.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
FRAMEWORK = {"jax_grad.py": "jax", "torch_autograd.py": "torch"}

# The examples start their own worlds: running them once per MPI rank would only repeat them.
pytestmark = mock_only


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_the_examples_are_there():
    names = {p.name for p in EXAMPLES}
    assert {"numpy_mlp.py", "jax_grad.py", "torch_autograd.py"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_checks_itself(path):
    if path.name in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[path.name])
    proc = run([sys.executable, str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout


@pytest.mark.parametrize("name", sorted(FRAMEWORK))
def test_framework_examples_skip_cleanly_without_the_framework(name):
    module = FRAMEWORK[name]
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = [{name!r}]; "
            f"runpy.run_path({str(ROOT / 'examples' / name)!r}, run_name='__main__')")
    proc = run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is not installed; skipping" in proc.stdout


def test_numpy_example_detects_a_wrong_result(monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import numpy_mlp
    finally:
        sys.path.remove(str(ROOT / "examples"))
    real = numpy_mlp.train_single_process
    monkeypatch.setattr(numpy_mlp, "train_single_process",
                        lambda n, e: [p + 1e-3 for p in real(n, e)])
    assert numpy_mlp.main(["--world-size", "2", "--epochs", "1"]) == 1


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(UNDER_MPI, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or _mpiexec() is None,
                    reason="needs mpi4py and mpiexec")
def test_numpy_example_under_mpiexec():
    proc = run([_mpiexec(), "-n", "2", sys.executable, str(ROOT / "examples" / "numpy_mlp.py"),
                "--epochs", "1"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("2 ranks") and "(OK)" in proc.stdout
