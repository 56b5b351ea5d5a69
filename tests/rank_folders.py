"""Each rank of a launched pytest run (under ``mpiexec`` or ``torchrun``) gets a temporary
folder of its own in the system temp folder, ``axondist-rank{R}-{PID}-*``: ranks sharing
pytest's default one race while pruning old runs at exit. A rank removes its folder when its
session ends, and before it ends the job on a failure; a rank killed from outside (a peer's
MPI abort, torchrun stopping the others) cannot, so the next rank that starts removes every
folder whose process is gone."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

PREFIX = "axondist-rank"
_NAME = re.compile(rf"{PREFIX}\d+-(\d+)-\w+")


def make_rank_folder(rank: str) -> str:
    """A new folder for this process, rank ``rank``, after removing the orphaned ones."""
    remove_orphaned_rank_folders(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-{os.getpid()}-")


def remove_rank_folder(path: str | None) -> None:
    """Remove ``path`` if it is a rank's folder (a path chosen with ``--basetemp`` stays)."""
    if path is not None and _NAME.fullmatch(os.path.basename(str(path))):
        shutil.rmtree(path, ignore_errors=True)


def remove_orphaned_rank_folders(temp_dir: str) -> list[str]:
    """Remove the rank folders in ``temp_dir`` whose process no longer runs; their paths."""
    removed = []
    for name in sorted(os.listdir(temp_dir)):
        match = _NAME.fullmatch(name)
        if match is not None and not _process_runs(int(match.group(1))):
            shutil.rmtree(os.path.join(temp_dir, name), ignore_errors=True)
            removed.append(os.path.join(temp_dir, name))
    return removed


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
