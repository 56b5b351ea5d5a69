"""NCCL calls queued behind a long kernel on a real GPU: what only a GPU shows.

A kernel that spins for seconds holds the caller's stream; the backend's
calls are ordered after it. Kept apart from ``test_nccl_gpu.py`` because
the CPU stand-in (which runs that file in CI) has no kernels to hold a
stream with. Skipped, at collection, without CuPy, NCCL or a CUDA device.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_nccl_gpu import REASON, close

import axondist as ad
from axondist.errors import CollectiveTimeoutError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _hold_stream(stream, seconds: float) -> None:
    """Queue a kernel on ``stream`` that keeps one SM busy for about ``seconds``."""
    import cupy

    rate_khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    kernel = cupy.RawKernel(_SPIN, "spin")
    with stream:
        kernel((1,), (1,), (np.int64(seconds * rate_khz * 1e3),))


def test_a_wait_on_a_stream_held_by_a_long_kernel_times_out_then_completes(world):
    import cupy

    user = cupy.cuda.Stream(non_blocking=True)
    with user:
        x = cupy.ones(1024, dtype=cupy.float32)
    _hold_stream(user, 3.0)
    with user:
        work = ad.all_reduce(x, group=world, async_op=True)  # waits for the kernel on the GPU
    assert not work.is_completed()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="all_reduce"):
        work.wait(timeout=0.3)
    assert time.monotonic() - start < 2.0, "an explicit timeout must not wait for the kernel"
    assert not work.is_completed()
    assert work.wait() is x  # the operation kept running: a later wait gets the result
    assert work.is_completed()
    close(x.get(), np.ones(1024, np.float32))
    # a blocking call issued behind the kernel returns only once the GPU ran it
    _hold_stream(user, 0.5)
    with user:
        start = time.monotonic()
        ad.all_reduce(x, group=world)
        held = time.monotonic() - start
    assert held >= 0.4, f"the blocking all_reduce returned after {held:.3f} s, before the GPU"
    close(x.get(), np.ones(1024, np.float32))
