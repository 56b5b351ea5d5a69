"""What the GPU tests share: a world of one rank on the NCCL backend, on GPU 0."""

from __future__ import annotations

import pytest

import axondist as ad


@pytest.fixture(scope="module")
def world():
    """A one-GPU NCCL world (NCCL refuses two ranks on one GPU), closed after the module.

    Only tests that ask for it create it, so files skipped for want of CuPy or NCCL never do.
    """
    import cupy

    from axondist.backends.nccl import NcclBackend

    cupy.cuda.Device(0).use()
    backend = NcclBackend(NcclBackend.generate_unique_id(), 0, 1, 0, timeout=120.0)
    yield ad.World(backend)
    backend.close()
