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


#: What a job that only starts its world and calls collectives must not pay for at start-up:
#: the wrappers, checkpoints, tuning, the pipeline (and its pictures), the command line,
#: tracing, the progress bar's tqdm, and the archive modules shutil drags in.
LOADED_ON_USE = ("axondist.ddp", "axondist.fsdp", "axondist.zero", "axondist.optim",
                 "axondist.pipeline", "axondist.checkpoint", "axondist.tune",
                 "axondist.tensor_parallel", "axondist.mesh", "axondist.data", "axondist.demo",
                 "axondist.launching.supervisor", "axondist.trace", "tqdm", "matplotlib",
                 "shutil", "bz2", "lzma")


def test_import_and_init_load_only_what_a_job_uses():
    code = ("import sys, axondist; axondist.init('mock'); "
            f"early = [m for m in {LOADED_ON_USE!r} if m in sys.modules]; "
            "print(early); sys.exit(1 if early else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, ("loaded at start-up, before any use: "
                                  + done.stdout + done.stderr)
