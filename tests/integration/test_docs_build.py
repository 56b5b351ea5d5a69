"""The documentation site builds with no warning, and its API reference covers every public name.

``mkdocs build --strict`` runs in a subprocess into a temporary folder (nothing generated is
committed), so a docstring that names a parameter the signature lacks, a cross-reference
that resolves nowhere, a broken link or anchor, or a page missing from the nav fails here.
Skipped when the ``docs`` extra (mkdocs, mkdocstrings[python]) is not installed.
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import pkgutil
import subprocess
import sys
import textwrap
import types
import zlib
from pathlib import Path

import pytest
from harness import mock_only
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python",
                    reason="the docs extra is not installed: pip install '.[docs]'")
griffe = pytest.importorskip("griffe")

# One build is enough: under mpiexec every rank would build the same site.
pytestmark = mock_only

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import _griffe_roles  # noqa: E402

sys.path.remove(str(ROOT / "docs"))

BUILD_TIMEOUT = 300


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site``, in a child process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDI_"))}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False)


def read_inventory(path: Path) -> set[str]:
    """The object names of a Sphinx ``objects.inv`` (version 2: four header lines, then zlib)."""
    data = path.read_bytes()
    parts = data.split(b"\n", 4)
    assert parts[0] == b"# Sphinx inventory version 2", parts[0]
    lines = zlib.decompress(parts[4]).decode("utf-8").splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.strip()}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = mkdocs_build(ROOT / "mkdocs.yml", out)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, log
    return out


def test_the_site_has_every_page(site: Path) -> None:
    for page in ["index", "guide", "coming-from-torch"]:
        assert (site / ("index.html" if page == "index" else f"{page}/index.html")).exists()
    for md in (ROOT / "docs" / "reference").glob("*.md"):
        name = "" if md.stem == "index" else md.stem + "/"
        assert (site / "reference" / name / "index.html").exists(), md.name


def _public_names(module: types.ModuleType) -> list[str]:
    """A module's ``__all__``; without one, the names its own source defines at the top
    (functions, classes, assignments) that do not start with ``_``: what the reference's
    ``filters: public`` renders (an imported name is public only where ``__all__`` says).
    A module's logger is left out: it is reached through ``logging`` by name, not as API."""
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return list(declared)
    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")
            and not isinstance(getattr(module, n, None), logging.Logger)]


def test_every_public_name_is_in_the_reference(site: Path) -> None:
    import axondist

    documented = read_inventory(site / "objects.inv")
    missing = []
    for info in pkgutil.walk_packages(axondist.__path__, "axondist."):
        if any(p.startswith("_") for p in info.name.split(".")[1:]):
            continue
        module = importlib.import_module(info.name)
        for name in _public_names(module):
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None) or module.__name__
            if f"{info.name}.{name}" not in documented and f"{home}.{name}" not in documented:
                missing.append(f"{info.name}.{name}")
    for name in axondist.__all__:
        home = getattr(getattr(axondist, name), "__module__", "axondist")
        if f"axondist.{name}" not in documented and f"{home}.{name}" not in documented:
            missing.append(f"axondist.{name}")
    assert not missing, f"not in the API reference: {missing}"


def test_cached_properties_are_documented(site: Path) -> None:
    assert "axondist.fsdp.sharding.FlatUnit.layout" in read_inventory(site / "objects.inv")


def test_roles_become_links_in_the_rendered_pages(site: Path) -> None:
    html = (site / "reference" / "ddp" / "index.html").read_text(encoding="utf-8")
    assert 'href="../errors/#axondist.errors.CollectiveMismatchError"' in html
    assert ":class:`" not in html and ":func:`" not in html and ":meth:`" not in html


def test_a_docstring_that_drifted_fails_the_build(tmp_path: Path) -> None:
    """A parameter renamed in the code but not in its docstring is a warning, hence a failure."""
    pkg = tmp_path / "drifted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """A package."""


        def f(new_name: int) -> int:
            """Do it.

            Args:
                old_name: the argument.
            """
            return new_name
        '''), encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n::: drifted\n", encoding="utf-8")
    (tmp_path / "mkdocs.yml").write_text(textwrap.dedent("""
        site_name: drifted
        plugins:
          - mkdocstrings:
              handlers:
                python:
                  paths: [.]
        """), encoding="utf-8")
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "old_name" in proc.stderr and "does not appear in the function signature" in proc.stderr


def test_a_broken_cross_reference_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\nSee [`nothing`][axondist.no_such_name].\n", encoding="utf-8")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nplugins:\n  - autorefs\n",
                                         encoding="utf-8")
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "axondist.no_such_name" in proc.stderr


# --- the griffe extension (docs/_griffe_roles.py) -----------------------------------------------


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    return griffe.load("axondist", search_paths=[str(ROOT)],
                       extensions=griffe.load_extensions(_griffe_roles.RstRoles))


def test_roles_resolve_relative_to_the_documented_object(package: griffe.Module) -> None:
    collection = package.modules_collection
    ddp = package["ddp.DistributedDataParallel"]
    assert _griffe_roles.resolve(collection, ddp, "GradSyncStrategy") == \
        "axondist.ddp.synchronizer.GradSyncStrategy"
    assert _griffe_roles.resolve(collection, ddp, "sync_parameters") == \
        "axondist.ddp.wrapper.DistributedDataParallel.sync_parameters"
    assert _griffe_roles.resolve(collection, ddp, "axondist.World") == \
        "axondist.process_group.World"
    # private or unknown targets stay code spans rather than broken links
    assert _griffe_roles.resolve(collection, ddp, "_array.namespace") is None
    assert _griffe_roles.resolve(collection, ddp, "no_such_thing") is None
    text = _griffe_roles.rewrite("see :class:`~axondist.World` and :func:`nope`", collection, ddp)
    assert text == "see [`World`][axondist.process_group.World] and `nope`"


def test_the_extension_ran_on_the_package(package: griffe.Module) -> None:
    spawn = package["launching.worlds.spawn"].docstring
    assert ":func:`" not in spawn.value
    raises = [s for s in spawn.parse("google") if s.kind.value == "raises"]
    assert raises and "Exception" in [str(r.annotation) for r in raises[0].value]


_name = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


@given(names=st.lists(_name, min_size=2, max_size=5, unique=True),
       sep=st.sampled_from([", ", ",", " / "]),
       more=st.booleans())
def test_entries_naming_several_parameters_are_split(names: list[str], sep: str,
                                                     more: bool) -> None:
    cont = "\n        continued." if more else ""
    text = f"Do it.\n\nArgs:\n    {sep.join(names)}: shared text.{cont}\n    last: own.\n"
    out = _griffe_roles.normalize_sections(text)
    expected = "".join(f"    {n}: shared text.{cont}\n" for n in names)
    assert out == f"Do it.\n\nArgs:\n{expected}    last: own."


@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=200))
def test_text_without_sections_or_roles_is_unchanged(text: str) -> None:
    if _griffe_roles._SECTION.search(text) is None and "`" not in text:
        lines = text.splitlines()
        assert _griffe_roles.normalize_sections(text) == "\n".join(lines)


def test_a_raises_entry_that_names_no_class_is_named() -> None:
    text = "Do.\n\nRaises:\n    The first failing rank's error,\n    named.\n"
    assert _griffe_roles.normalize_sections(text) == (
        "Do.\n\nRaises:\n    Exception: The first failing rank's error,\n        named.")
    named = "Do.\n\nRaises:\n    ValueError: when x < 0.\n"
    assert _griffe_roles.normalize_sections(named) == named.rstrip("\n")
    after = ("Do.\n\nRaises:\n    ValueError: when x < 0,\n        or more.\n"
             "    Whatever the rank raised,\n    with a note.\n\nReturns:\n    x.")
    assert _griffe_roles.normalize_sections(after) == (
        "Do.\n\nRaises:\n    ValueError: when x < 0,\n        or more.\n"
        "    Exception: Whatever the rank raised,\n        with a note.\n\nReturns:\n    x.")


def test_rst_literal_intros_and_simple_tables_are_translated() -> None:
    text = ("Layout::\n\n    {x: 1}\n\nExample::\n\n    f(1)\n\n::\n\n    g()\n\n"
            "=== ===\na   b\n=== ===\n1   2\n=== ===\nafter")
    assert _griffe_roles.rst_blocks(text) == (
        "Layout:\n\n    {x: 1}\n\nFor example:\n\n    f(1)\n\n\n\n    g()\n\n"
        "```text\n=== ===\na   b\n=== ===\n1   2\n=== ===\n```\nafter")
    # "::" inside a line, or not before a blank line, is left alone
    assert _griffe_roles.rst_blocks("a :: b\nc::\nd") == "a :: b\nc::\nd"
