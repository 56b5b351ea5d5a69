"""What the torch backend arranges for gloo, and where it refuses, on every rank of a torchrun
world: uneven blocks padded and unpadded again, a receive of the wrong size, complex
products, torch tensors reduced in place. The torchrun world runs (tests/world/
test_torch_launch.py) run it at two and three ranks; the MPI backend's own checks are
``test_mpi_launch.py::test_mpi_backend_checks``, the mock world's test_mock_world.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import UNDER_TORCHRUN, launched_world

import axondist as ad

pytestmark = pytest.mark.skipif(
    not UNDER_TORCHRUN, reason="the torch backend's own arrangements: runs under torchrun "
                               "(tests/world/test_torch_launch.py's world runs)")


def test_the_torch_backend_pads_uneven_blocks_checks_sizes_and_reduces_in_place():
    import torch
    import torch.distributed as dist

    world = launched_world()
    n, rank = world.world_size, world.rank
    assert world.backend.name == "torch" and n == dist.get_world_size()
    assert world.node_info() == (0, rank, n)  # torchrun --standalone: one host
    # uneven blocks (gloo moves equal ones): padded and unpadded again
    rows = [r + 1 for r in range(n)]
    xs = [np.full((rows[r], 3), r, np.float32) for r in range(n)]
    np.testing.assert_array_equal(ad.all_gather(xs[rank]), np.concatenate(xs))
    big = np.arange(2 * n + 1, dtype=np.float64) + rank
    want = np.array_split(sum(np.arange(2 * n + 1.0) + r for r in range(n)), n)[rank]
    np.testing.assert_array_equal(ad.reduce_scatter(big), want)
    gathered = ad.gather_tensor(xs[rank], dst=n - 1)
    assert (gathered is None) == (rank != n - 1)
    # a receive of the wrong size raises, drops the message, and the next one arrives
    backend = world.backend
    if rank == 0:
        backend.send(np.arange(4.0), 1, tag=5)
        backend.send(np.arange(3.0), 1, tag=5)
    elif rank == 1:
        with pytest.raises(ad.CollectiveMismatchError, match="the message has 32 bytes but "
                                                             "the buffer holds 24"):
            backend.recv(np.empty(3), 0, tag=5)
        again = np.empty(3)
        backend.recv(again, 0, tag=5)
        np.testing.assert_array_equal(again, np.arange(3.0))
    # torch.distributed multiplies no complex values: our message, not torch's
    with pytest.raises(ad.UnsupportedDTypeError, match="cannot multiply complex values"):
        ad.all_reduce(np.ones(2, np.complex64), "product")
    # the torch tensor a caller passes is the one reduced, in place
    t = torch.full((3,), float(rank + 1))
    assert ad.all_reduce(t) is t
    torch.testing.assert_close(t, torch.full((3,), n * (n + 1) / 2))
    ad.barrier()
