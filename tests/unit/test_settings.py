"""The ``AXONDIST_*`` variables: declared once (axondist/backends/settings.py), read by one
reader each, documented from the declaration, and a misspelt name named with the real one."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import axondist as ad
from axondist.backends import settings
from axondist.backends.registry import create_backend
from axondist.backends.settings import BY_NAME, TEST_KNOBS, VARIABLES, Settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"AXONDIST_[A-Z0-9_]*[A-Z0-9]")


def _names_in(folder: str) -> dict[str, str]:
    """Each ``AXONDIST_*`` name written in ``folder``'s Python files -> one file using it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.name in ("settings.py", "test_settings.py"):
            continue  # the declaration and this test: test knobs and misspelt examples
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_guide_table_is_the_declaration():
    guide = (ROOT / "docs" / "guide.md").read_text()
    start = guide.index("| variable | effect |")
    table = guide[start:guide.index("\n\n", start)]
    assert table == settings.markdown_table(), (
        "docs/guide.md's table of variables differs from axondist/backends/settings.py; "
        "paste the output of `python -m axondist.backends.settings` over it")


def test_settings_has_one_field_per_variable_with_its_default():
    assert list(Settings._fields) == [v.field for v in VARIABLES]
    assert len(BY_NAME) == len(VARIABLES)
    plain = Settings()
    for var in VARIABLES:
        assert getattr(plain, var.field) == var.default, var.name
    assert Settings.from_environ({}) == plain


def test_every_name_the_library_writes_is_declared():
    undeclared = {n: f for n, f in _names_in("axondist").items()
                  if n not in BY_NAME and n != "AXONDIST_TEST"}
    assert not undeclared, f"declare these in axondist/backends/settings.py: {undeclared}"


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "examples"])
def test_every_name_the_suite_sets_is_a_variable_or_a_test_knob(folder):
    unknown = {n: f for n, f in _names_in(folder).items()
               if n not in BY_NAME and n not in TEST_KNOBS
               and not n.startswith(settings.TEST_PREFIX)}
    assert not unknown, ("declare these as TEST_KNOBS in axondist/backends/settings.py (or fix "
                         f"the spelling): {unknown}")


def test_only_the_settings_module_reads_axondist_variables():
    reads = re.compile(r"""(environ(\.get)?[\[(]|getenv\()\s*["']AXONDIST_""")
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "axondist").rglob("*.py"))
                 if reads.search(p.read_text())]
    assert not offenders, f"read these through axondist.backends.settings: {offenders}"


@given(seconds=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False))
def test_seconds_read_back_as_written(seconds):
    env = {"AXONDIST_TIMEOUT": repr(seconds), "AXONDIST_CUT_OFF_TIMEOUT": f" {seconds!r} "}
    got = Settings.from_environ(env)
    assert got.timeout == seconds and got.cut_off_timeout == seconds


@given(text=st.sampled_from(["0", "-1", "nan", "inf", "-inf", "abc", "1s", "0x10"]),
       var=st.sampled_from(["AXONDIST_TIMEOUT", "AXONDIST_STALL_WARNING",
                            "AXONDIST_CUT_OFF_TIMEOUT", "AXONDIST_TRACE_MB",
                            "AXONDIST_PIECE_MB"]))
def test_a_bad_number_names_the_variable_and_the_fix(text, var):
    with pytest.raises(ValueError) as info:
        Settings.from_environ({var: text})
    message = str(info.value)
    assert message.startswith(f"{var}={text!r} must be a number of ")
    assert "> 0" in message and "unset it for the default" in message


@given(word=st.sampled_from(["1", "true", "YES", "on", "0", "false", "No", "OFF"]))
def test_flags_read_their_words(word):
    want = word.lower() in ("1", "true", "yes", "on")
    got = Settings.from_environ({"AXONDIST_DEBUG": word, "AXONDIST_CHECKS": word})
    assert got.debug is want and got.checks is want


@pytest.mark.parametrize("name, text, expected", [
    ("AXONDIST_DEBUG", "2", "0 or 1"),
    ("AXONDIST_FLIGHT_RECORDER", "0", "an int >= 1"),
    ("AXONDIST_MAX_GROUPS", "-1", "an int >= 0"),
    ("AXONDIST_MPI_CHUNK_BYTES", "2M", "an int >= 0"),
    ("AXONDIST_MPI_HOST_STAGING", "sometimes", "one of auto, always, never"),
    ("AXONDIST_DIAGNOSTICS_PORTS", "9-2", "a port range LO-HI"),
    ("AXONDIST_RESTART_COUNT", "x", "an int >= 0"),
])
def test_bad_values_of_every_kind_are_refused_naming_the_variable(name, text, expected):
    with pytest.raises(ValueError, match=re.escape(f"{name}={text!r} must be {expected}")):
        settings.read(name, {name: text})


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ValueError) as info:
        Settings.from_environ({"AXONDIST_TIMEOUT": "soon", "AXONDIST_FLIGHT_RECORDER": "many"})
    assert "AXONDIST_TIMEOUT='soon'" in str(info.value)
    assert "AXONDIST_FLIGHT_RECORDER='many'" in str(info.value)


def test_values_are_read_into_their_types():
    got = Settings.from_environ({
        "AXONDIST_BACKEND": " MPI ", "AXONDIST_DIAGNOSTICS_PORTS": "29400-29402",
        "AXONDIST_PIECE_MB": "0.5", "AXONDIST_MPI_HOST_STAGING": "Never",
        "AXONDIST_TRACE": "/tmp/t", "AXONDIST_MAX_GROUPS": "0", "AXONDIST_TRACE_MB": ""})
    assert got.backend == "mpi" and got.diagnostics_ports == range(29400, 29403)
    assert got.piece_mb == 0.5 and got.mpi_host_staging == "never"
    assert got.trace == "/tmp/t" and got.max_groups == 0
    assert math.isclose(got.trace_mb, 64.0)  # empty: the default


def test_a_misspelt_name_is_named_with_the_nearest_real_one():
    env = {"AXONDIST_TIMOUT": "5", "AXONDIST_CHECK": "0", "AXONDIST_ZZZ": "1"}
    assert settings.unknown_names(env) == {"AXONDIST_TIMOUT": "AXONDIST_TIMEOUT",
                                           "AXONDIST_CHECK": "AXONDIST_CHECKS",
                                           "AXONDIST_ZZZ": None}
    with pytest.warns(RuntimeWarning) as caught:
        settings.load(env)
    texts = sorted(str(w.message) for w in caught)
    assert len(texts) == 3
    assert "AXONDIST_CHECK is not an axondist setting and is ignored; did you mean " \
           "AXONDIST_CHECKS?" in texts[0]
    assert "did you mean AXONDIST_TIMEOUT?" in texts[1]
    assert "AXONDIST_ZZZ" in texts[2] and "no axondist setting has a similar name" in texts[2]


def test_test_knobs_and_declared_names_are_not_warned_about():
    env = {**{name: "1" for name in TEST_KNOBS}, "AXONDIST_TEST_EXAMPLES": "5",
           "AXONDIST_TEST_ANYTHING": "x", "AXONDIST_TIMEOUT": "5", "PATH": "/bin"}
    assert settings.unknown_names(env) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.load(env).timeout == 5.0


def test_making_a_world_reads_the_settings(monkeypatch):
    monkeypatch.setenv("AXONDIST_STALL_WARNING", "later")
    with pytest.raises(ValueError, match="AXONDIST_STALL_WARNING='later' must be a number"):
        create_backend("mock")
    with pytest.raises(ValueError, match="AXONDIST_STALL_WARNING='later' must be a number"):
        ad.spawn(lambda world: None, 2)
    monkeypatch.delenv("AXONDIST_STALL_WARNING")
    monkeypatch.setenv("AXONDIST_STALL_WARNNG", "5")
    with pytest.warns(RuntimeWarning, match="did you mean AXONDIST_STALL_WARNING"):
        assert ad.spawn(lambda world: world.rank, 2) == [0, 1]
