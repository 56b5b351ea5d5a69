"""MPICH's shared-memory segments (``/dev/shm/mpich_shm_*``) that the suite's jobs leave
behind. MPICH removes a job's segment once every rank has attached to it; a job whose ranks
are killed first (the fault cases kill and abort ranks on purpose) leaves it, 2 to 3 MB of
memory each, for as long as the machine runs: a few hundred per run of the suite, and
20 GB after a day of runs on one machine, at which the kernel's out-of-memory killer
ended a rank of a later run. The test session removes the ones no process holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Where POSIX shared memory lives on Linux, and the prefix of MPICH's segments.
SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"
#: A segment younger than this may belong to a job that is attaching to it right now.
MIN_AGE_S = 60.0


def held_segments(folder: str = SHM_DIR) -> set[str]:
    """The paths under ``folder`` that a live process maps or holds open (any user's
    process this one may read; a segment of one it may not read is never removed, as its
    age and name alone cannot tell)."""
    held: set[str] = set()
    marker = os.path.join(folder, PREFIX)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text(errors="replace")
            held.update(line.split(None, 5)[5].removesuffix(" (deleted)")
                        for line in maps.splitlines()
                        if marker in line and len(line.split(None, 5)) == 6)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(marker):
                    held.add(target)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return held


def remove_orphans(folder: str = SHM_DIR, min_age: float = MIN_AGE_S) -> list[str]:
    """Remove MPICH's segments under ``folder`` that no process holds and that are older
    than ``min_age`` seconds; the paths removed."""
    if not os.path.isdir(folder):
        return []
    now = time.time()
    candidates = []
    for entry in os.scandir(folder):
        try:
            if entry.name.startswith(PREFIX) and now - entry.stat().st_mtime > min_age:
                candidates.append(entry.path)
        except OSError:
            continue
    if not candidates:
        return []
    held = held_segments(folder)
    removed = []
    for path in candidates:
        if path in held:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed
