"""The quick tier's tables (tests/tiers.py) name tests that exist: a renamed test would
otherwise leave the tier silently, or stay in it after it became slow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tiers

ROOT = Path(__file__).resolve().parents[2]


def _defines(place: str) -> bool:
    path, _, name = place.partition("::")
    name = name.split("[")[0]
    text = (ROOT / path).read_text(encoding="utf-8")
    return re.search(rf"^def {re.escape(name)}\(", text, flags=re.MULTILINE) is not None


@pytest.mark.parametrize("place", sorted(tiers.SLOW_TESTS | tiers.MPI_ONLY
                                         | tiers.THREE_RANK_TESTS | {tiers.QUICK_LAUNCH}))
def test_every_named_test_exists(place):
    assert _defines(place), f"tests/tiers.py names {place}, which is not defined there"


def test_every_named_folder_and_file_exists():
    missing = [p for p in (*tiers.SLOW_FOLDERS, *tiers.SLOW_FILES, *tiers.THREE_RANK_FILES)
               if not (ROOT / p).exists()]
    assert not missing, f"tests/tiers.py names missing paths {missing}"


def test_the_quick_launch_runs_two_processes():
    assert tiers.QUICK_LAUNCH.endswith("[2]")
    assert not any(tiers.QUICK_LAUNCH.startswith(f) for f in tiers.SLOW_FOLDERS)


def test_the_three_rank_runs_take_only_world_tests():
    assert all(path.startswith("tests/world/test_") for path in tiers.three_rank_files())
