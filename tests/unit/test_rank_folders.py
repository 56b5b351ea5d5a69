"""A launched rank's temporary folder (tests/rank_folders.py) goes when its process does."""

from __future__ import annotations

import os
import subprocess
import sys

from rank_folders import remove_orphaned_rank_folders, remove_rank_folder


def _a_finished_process_id() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_folders_of_finished_processes_are_removed_and_the_others_kept(tmp_path):
    gone, alive = _a_finished_process_id(), os.getpid()
    for name in (f"axondist-rank1-{gone}-abc", f"axondist-rank0-{alive}-xyz",
                 "axondist-rank2-xyz", f"pytest-rank1-{gone}-abc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    assert remove_orphaned_rank_folders(str(tmp_path)) == [
        str(tmp_path / f"axondist-rank1-{gone}-abc")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"axondist-rank0-{alive}-xyz", "axondist-rank2-xyz", f"pytest-rank1-{gone}-abc"]


def test_a_folder_chosen_with_basetemp_is_never_removed(tmp_path):
    chosen = tmp_path / "my-basetemp"
    chosen.mkdir()
    remove_rank_folder(str(chosen))
    remove_rank_folder(None)
    assert chosen.is_dir()
    own = tmp_path / f"axondist-rank0-{os.getpid()}-abc"
    own.mkdir()
    remove_rank_folder(str(own))
    assert not own.exists()
