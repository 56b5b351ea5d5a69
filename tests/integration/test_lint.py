"""The code stays lint-clean (ruff) and type-clean (mypy), with pyproject.toml's settings.

Each check runs the tool in a subprocess from the repository root, exactly as
a developer would (``python -m ruff check ...``, ``python -m mypy axondist``),
and shows the tool's report when it fails. A tool that is not installed
skips its test (both come with the ``test`` extra). Under ``mpiexec`` the
checks are skipped: they do not depend on the world, and one run is enough.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness import mock_only

ROOT = Path(__file__).resolve().parents[2]
#: What ruff checks: everything with Python in it, tests and tools included.
RUFF_PATHS = ["axondist", "tests", "benchmarks", "examples", "docs"]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


@mock_only
def test_ruff_is_clean():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install ruff)")
    proc = _run(["ruff", "check", "--no-fix", "--output-format", "concise", *RUFF_PATHS])
    if proc.returncode != 0:
        pytest.fail(f"ruff check {' '.join(RUFF_PATHS)} (exit {proc.returncode}):\n"
                    f"{proc.stdout}{proc.stderr}", pytrace=False)


@mock_only
def test_mypy_is_clean():
    pytest.importorskip("mypy", reason="mypy is not installed (pip install mypy)")
    proc = _run(["mypy", "axondist"])
    if proc.returncode != 0:
        pytest.fail(f"mypy axondist (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
