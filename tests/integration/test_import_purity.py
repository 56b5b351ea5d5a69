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
#: tracing, the progress bar's tqdm, the archive modules shutil drags in, and ml_dtypes
#: (bfloat16's home: loaded when a call first meets a bfloat16 array).
LOADED_ON_USE = ("axondist.ddp", "axondist.fsdp", "axondist.zero", "axondist.optim",
                 "axondist.pipeline", "axondist.checkpoint", "axondist.tune",
                 "axondist.tensor_parallel", "axondist.mesh", "axondist.data", "axondist.demo",
                 "axondist.launching.supervisor", "axondist.trace", "tqdm", "matplotlib",
                 "shutil", "bz2", "lzma", "ml_dtypes")


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

#: What an MPI job's ``init()`` and first collective (of float64) must leave unloaded.
NOT_IN_AN_MPI_JOB = ("axondist.backends.mock", "axondist.backends.nccl",
                     "axondist.backends.torch", "axondist.backends.recording.trace_file",
                     "axondist.launching.supervisor", "difflib", "cupy", "torch", "jax",
                     "ml_dtypes")


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


#: Programs that meet bfloat16 only after an MPI world started without ml_dtypes, each with
#: what it prints: a torch tensor's crossing loads ml_dtypes, a blocking reduction and a
#: persistent one each make the MPI type table's bfloat16 entries when first met.
_LATE_BFLOAT16 = {
    "torch_then_blocking": (
        "import torch; t = torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16); "
        "assert axondist.all_reduce(t, op='MAX').dtype is torch.bfloat16; "
        "assert 'ml_dtypes' in sys.modules; import ml_dtypes; "
        "x = numpy.array([0.5, 1.0], ml_dtypes.bfloat16); axondist.all_reduce(x); "
        "print(x.astype(numpy.float32).tolist(), t.float().tolist())",
        "[0.5, 1.0] [1.5, -2.0, 3.0]"),
    "persistent": (
        "import ml_dtypes; y = numpy.array([0.25, -4.0], ml_dtypes.bfloat16); "
        "p = world.backend.persistent_all_reduce(y); p.start(0).wait(); p.free(); "
        "print(y.astype(numpy.float32).tolist())",
        "[0.25, -4.0]"),
}


@pytest.mark.parametrize("case", sorted(_LATE_BFLOAT16))
def test_bfloat16_works_in_a_job_that_loads_ml_dtypes_after_init(case):
    """ml_dtypes is imported on first use, so bfloat16 must work when it comes after init."""
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install '.[mpi]')")
    if case.startswith("torch"):
        pytest.importorskip("torch", reason="needs torch (pip install '.[torch]')")
    program, printed = _LATE_BFLOAT16[case]
    code = ("import sys, numpy, axondist; world = axondist.init('mpi'); "
            "axondist.all_reduce(numpy.ones(3)); assert 'ml_dtypes' not in sys.modules; "
            + program)
    env = {k: v for k, v in os.environ.items() if k != "AXONDIST_TRACE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == printed, done.stdout
