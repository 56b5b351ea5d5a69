"""Run a per-rank test body on the mock world, or on the launched world under mpiexec or
torchrun.

A world test is written once as ``body(world, ...)`` that asserts its own
rank's results against a NumPy reference it can compute locally (every
rank's inputs derive from a seed and the rank). :func:`run_world` runs it on
``world_size`` threads of a mock world, or, when the test session itself was
launched by ``mpiexec -n K python -m pytest`` (the MPI backend) or ``torchrun
--nproc-per-node K -m pytest`` (the torch backend), once on this process's rank
of that K-rank world (``world_size`` is then ignored: use :func:`world_sizes` so
the generated sizes say so).
"""

from __future__ import annotations

import functools
import gc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import axondist
from axondist._environment import env_launch_size
from axondist.launching.worlds import launched_by_mpi

#: The session runs on one rank of an MPI world (under mpiexec).
UNDER_MPI = launched_by_mpi()
#: The session runs on one rank of a torch.distributed world (under torchrun).
UNDER_TORCHRUN = not UNDER_MPI and env_launch_size() is not None
#: The session runs on one rank of a launched world of processes (either of the above).
LAUNCHED = UNDER_MPI or UNDER_TORCHRUN


@functools.cache
def launched_world() -> axondist.World:
    """This process's world under mpiexec (MPI) or torchrun (torch), created once per
    test session."""
    return axondist.init("mpi" if UNDER_MPI else "torch")


def mpi_world() -> axondist.World:
    """This process's MPI world (created once per test session)."""
    assert UNDER_MPI, "mpi_world() needs a session launched by mpiexec"
    return launched_world()


def run_world(body: Callable[..., Any], world_size: int, *args: Any,
              timeout: float = 60.0) -> list[Any]:
    """Run ``body(world, *args)`` on every rank; return the results this process can see.

    Mock world: the list of every rank's result. A launched world: a one-item list
    with this rank's result (each process checks its own rank).
    """
    if LAUNCHED:
        return [body(launched_world(), *args)]
    return axondist.spawn(body, world_size, *args, timeout=timeout)


def calls_in_a_warm_all_reduce(world: axondist.World,
                               names: list[str] | None = None) -> tuple[int, int]:
    """The Python and C functions (``sys.setprofile``) one warm 4 KiB SUM ``all_reduce``
    enters on this rank once its plan exists; checks that the sums really ran. ``names``,
    when given, receives each function's name (for a message that says what was added)."""
    x = np.ones(1024, np.float32)
    for _ in range(3):  # the plan made and warm
        axondist.all_reduce(x)
    calls = {"call": 0, "c_call": 0}
    # A mock rank that waits for the others loops in ``_sleep_until`` until they arrive, as
    # often as it is woken (by each arrival, or by its timer on a busy machine): its first
    # sleep is counted, the loop's later turns are not (how long a rank waits is not work
    # the call adds).
    sleeping: list[Any] = []  # the frame of _sleep_until, then "woken" once its first sleep ends

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if sleeping:
            if event == "return" and frame is sleeping[0]:
                sleeping.clear()
            elif event == "return" and code.co_qualname == "_Signal.wait":
                sleeping.append("woken")
            if len(sleeping) > 1:
                return
        elif event == "call" and code.co_name == "_sleep_until":
            sleeping.append(frame)
        if event in calls:
            calls[event] += 1
            if names is not None:
                names.append(getattr(arg, "__qualname__", repr(arg)) if event == "c_call"
                             else f"{code.co_filename}:{code.co_qualname}")

    # no collection inside the count: finalizers of objects an earlier test left (weakref
    # callbacks, ``__del__``) would run in this thread and be counted as the call's work
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        axondist.all_reduce(x)
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    np.testing.assert_array_equal(x, world.world_size ** 4)
    return calls["call"], calls["c_call"] - 1  # setprofile(None) itself is a C call


def in_ordinary_memory(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body(world, ...)`` with the world's DDP buckets in ordinary memory: for tests of the
    persistent all-reduces, which buckets in memory both ranks map (``mpiexec -n 2``,
    tests/world/test_shared_buckets.py) do without."""
    @functools.wraps(body)
    def pinned(world: axondist.World, *args: Any) -> Any:
        backend = world.backend
        if not hasattr(backend, "shares_memory"):  # a backend without shared buffers
            return body(world, *args)
        shares = backend.shares_memory
        backend.shares_memory = False
        try:
            return body(world, *args)
        finally:
            backend.shares_memory = shares
    return pinned


def world_sizes(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[int]:
    """Hypothesis strategy for world sizes: the real size in a launched world."""
    if LAUNCHED:
        return st.just(launched_world().world_size)
    return st.integers(min_size, max_size)


def current_size(default: int) -> int:
    """The launched world's size under mpiexec or torchrun, else ``default``."""
    return launched_world().world_size if LAUNCHED else default


mock_only = pytest.mark.skipif(LAUNCHED, reason="needs the in-process mock world")


def why_no_gpu(need_nccl: bool = False) -> str | None:
    """Why the GPU tests cannot run here (CuPy, a CUDA device, NCCL when ``need_nccl``
    missing), or None when they can."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CUDA libraries failing to load
        return f"CuPy is not importable ({exc})"
    if need_nccl and not getattr(nccl, "available", False):
        return "CuPy cannot load NCCL"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device ({exc})"
    return None if count > 0 else "no CUDA device"

