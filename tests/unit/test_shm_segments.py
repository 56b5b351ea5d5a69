"""The session removes MPICH's shared-memory segments that killed jobs left behind, and
never one a process still holds or one a job may be attaching to (tests/shm_segments.py)."""

from __future__ import annotations

import mmap
import os
import time

from shm_segments import PREFIX, held_segments, remove_orphans


def _segment(folder, name: str, age: float) -> str:
    path = os.path.join(folder, PREFIX + name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_only_old_segments_no_process_holds_are_removed(tmp_path):
    orphan = _segment(tmp_path, "orphan_0", age=3600)
    young = _segment(tmp_path, "young_0", age=1)
    mapped = _segment(tmp_path, "mapped_0", age=3600)
    opened = _segment(tmp_path, "opened_0", age=3600)
    other = tmp_path / "not_mpich"
    other.write_bytes(b"x")
    os.utime(other, (0, 0))
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as view, \
            open(opened, "rb") as held:
        assert {mapped, opened} <= held_segments(str(tmp_path))
        view[0] = 1
        assert remove_orphans(str(tmp_path)) == [orphan]
        assert held.read(1) == b"\0"
    assert not os.path.exists(orphan)
    assert os.path.exists(young) and os.path.exists(mapped) and os.path.exists(opened)
    assert other.exists()
    # released, any age: every one goes, and nothing else
    assert sorted(remove_orphans(str(tmp_path), min_age=0)) == sorted([young, mapped, opened])
    assert other.exists()


def test_a_missing_folder_removes_nothing(tmp_path):
    assert remove_orphans(str(tmp_path / "absent")) == []
