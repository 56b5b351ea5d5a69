"""What ``import axondist`` loads, checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys


def test_import_pulls_in_neither_mpi4py_nor_cupy():
    code = ("import sys, axondist; bad = [m for m in ('mpi4py', 'cupy', 'torch', 'jax') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_public_name_resolves_and_wrappers_load_lazily():
    code = ("import sys, axondist; assert 'axondist.fsdp' not in sys.modules; "
            "missing = [n for n in axondist.__all__ if not hasattr(axondist, n)]; "
            "print(missing); sys.exit(1 if missing else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
