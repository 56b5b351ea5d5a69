"""A full ``.npz`` save that meets a full disk or a read-only file system, on every rank.

``python checkpoint_full.py CASE mock N`` runs it on an N-rank mock world,
``mpiexec -n N python checkpoint_full.py CASE mpi`` on MPI; the file is
``$AXONDIST_TEST_FULL_PATH``. CASE ``enospc``: every write into a file of that folder fails
with ENOSPC; ``erofs``: opening one for writing fails with EROFS; ``fsync``: the fsync of
the written file fails with ENOSPC (as on NFS); ``none``: no fault. Each rank prints
``rank R: CheckpointError: ...`` or ``rank R saved``; the exit status is 3 when a rank got
the error.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from typing import Any

import numpy as np

import axondist as ad
from axondist.checkpoint import save_full_checkpoint
from axondist.errors import CheckpointError

PATH = os.environ.get("AXONDIST_TEST_FULL_PATH", "")
_real_open = builtins.open
_real_fsync = os.fsync


class _FullDisk(io.FileIO):
    def write(self, b: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _ours(path: Any) -> bool:
    return isinstance(path, str) and os.path.dirname(os.path.abspath(path)) == \
        os.path.dirname(os.path.abspath(PATH))


def _faulty_open(case: str) -> Any:
    def fake(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if _ours(path) and "w" in mode:
            if case == "erofs":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            if case == "enospc":
                return _FullDisk(path, "w")
        return _real_open(path, mode, *args, **kwargs)
    return fake


def _failing_fsync(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def inject(case: str) -> None:
    if case in ("enospc", "erofs"):
        builtins.open = _faulty_open(case)
    elif case == "fsync":
        os.fsync = _failing_fsync


def save(world: ad.World, case: str) -> int:
    if world.rank == 0:
        inject(case)  # rank 0 writes the file; on the mock world all ranks share the process
    params = [ad.Parameter(np.full((3, 2), 7.0), "w"), ad.Parameter(np.ones(2), "b")]
    try:
        save_full_checkpoint(PATH, params, group=world)
    except CheckpointError as exc:
        print(f"rank {world.rank}: CheckpointError: {exc}", flush=True)
        return 3
    print(f"rank {world.rank} saved", flush=True)
    return 0


def main() -> int:
    case, mode = sys.argv[1], sys.argv[2]
    if mode == "mpi":
        return save(ad.init("mpi"), case)
    return max(ad.spawn(save, int(sys.argv[3]), case))


if __name__ == "__main__":
    sys.exit(main())
