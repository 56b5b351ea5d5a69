"""What ``import axondist`` loads, checked in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


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


#: What ``import axondist`` must leave unloaded: the mock world (threads), the NCCL backend,
#: the watchdog and its sockets (started by a multi-process world), the trace writer (only
#: under tracing), and difflib (only to name a misspelt AXONDIST_* variable).
NOT_AT_IMPORT = ("axondist.backends.mock", "axondist.backends.nccl", "axondist.backends.mpi",
                 "axondist.backends.torch", "axondist.backends.watchdog.watchdog",
                 "axondist.backends.recording.trace_file", "axondist.launching.supervisor",
                 "difflib", "socket")

#: What an MPI job's ``init()`` and first collective must leave unloaded.
NOT_IN_AN_MPI_JOB = ("axondist.backends.mock", "axondist.backends.nccl",
                     "axondist.backends.torch", "axondist.backends.recording.trace_file",
                     "axondist.launching.supervisor", "difflib", "cupy", "torch", "jax")


def test_import_loads_no_backend_and_no_watchdog():
    code = ("import sys, axondist; "
            f"early = [m for m in {NOT_AT_IMPORT!r} if m in sys.modules]; "
            "print(early); sys.exit(1 if early else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, "loaded by import axondist: " + done.stdout + done.stderr


def test_an_mpi_world_loads_no_other_backend():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install '.[mpi]')")
    code = ("import sys, numpy, axondist; axondist.init('mpi'); axondist.barrier(); "
            "x = numpy.ones(4); axondist.all_reduce(x); "
            f"extra = [m for m in {NOT_IN_AN_MPI_JOB!r} if m in sys.modules]; "
            "print(extra); sys.exit(1 if extra else 0)")
    env = {k: v for k, v in os.environ.items() if k != "AXONDIST_TRACE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, "loaded by an MPI job: " + done.stdout + done.stderr
