"""The coverage table (tests/coverage_table.py, shown in docs/testing.md) names tests that
exist and run where it says: collected by pytest, not found by grep."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import coverage_table
import pytest
from coverage_table import (
    BEHAVIOURS,
    Behaviour,
    Collected,
    collect,
    collected_for_the_table,
    named_files,
    problems,
)


@pytest.fixture(scope="module")
def collected(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Collected]:
    return collected_for_the_table(request.config.args, tmp_path_factory.mktemp("collected"))


def test_this_sessions_collection_is_what_a_collection_of_its_own_finds(request, tmp_path):
    """The shortcut :func:`collected_for_the_table` takes in a whole run gives what a
    collection of the table's files in a process of its own gives."""
    if not coverage_table.session_took_the_files_whole(request.config.args):
        pytest.skip("this session did not collect the table's files whole")
    own = collect(named_files(), tmp_path)
    session = coverage_table.SESSION_COLLECTED
    assert {nodeid: session.get(nodeid) for nodeid in own} == own


#: The frameworks whose arrays the table's rows test (their modules skip without them).
FRAMEWORKS = ("torch", "jax")


def test_every_behaviour_has_a_test_that_runs_where_the_table_says(collected):
    missing = [name for name in FRAMEWORKS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the table names tests of {' and '.join(missing)} arrays, which pytest "
                    f"does not collect without them: pip install '.[torch,jax]'")
    assert problems(BEHAVIOURS, collected) == []


def test_a_behaviour_without_a_test_is_found(collected):
    renamed = replace(BEHAVIOURS[0], test=BEHAVIOURS[0].test + "_renamed")
    nothing = Behaviour("a behaviour nobody tests", "tests/world/test_collectives.py::x", ())
    found = problems((renamed, nothing), collected)
    assert f"{renamed.what}: mock names {renamed.test}, which pytest does not collect" in found
    assert f"{nothing.what}: no test" in found
    assert any(line.startswith(f"{nothing.what}: no test and no reason") for line in found)


def test_a_three_rank_cell_must_name_a_three_rank_test(collected):
    pairs_only = next(row for row in BEHAVIOURS if row.where == coverage_table.PAIRS)
    claimed = replace(pairs_only, where=coverage_table.EVERY)
    assert problems((claimed,), collected) == [
        f"{claimed.what}: {column} names {claimed.test}, which the three-rank runs leave out "
        "(tests/tiers.py: THREE_RANK_FILES, THREE_RANK_TESTS)"
        for column in (coverage_table.MPI_3, coverage_table.TORCH_3)]


def test_a_mock_cell_must_run_on_the_mock_world(collected):
    mpi_only = "tests/world/test_riding_checks.py::test_more_shapes_than_the_plan_cache_holds"
    row = Behaviour("the plan cache", mpi_only, (coverage_table.MOCK,), why_not="MPI's")
    assert problems((row,), collected) == [
        f"the plan cache: mock names {mpi_only}, which does not run on the mock world"]


def test_the_docs_show_the_table():
    text = coverage_table.DOC.read_text(encoding="utf-8")
    assert coverage_table.BEGIN in text and coverage_table.END in text
    assert coverage_table.doc_with_table(text) == text, (
        "docs/testing.md's coverage table is out of date: python tests/coverage_table.py --write")


def test_the_table_names_only_test_files():
    root = Path(coverage_table.__file__).resolve().parents[1]
    assert all((root / path).is_file() and Path(path).name.startswith("test_")
               for path in named_files())
