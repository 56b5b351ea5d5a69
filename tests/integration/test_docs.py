"""The docs' code runs, their links resolve, and the API reference covers every public module.

Every ```python block of ``docs/*.md`` and ``README.md`` is executed, the
blocks of one file in order in one namespace (a guide's examples build on
each other), in a fresh interpreter per file with the mock world. A block
whose first line is ``# doc: skip ...`` is not run (it needs MPI or a GPU);
``# doc: needs MODULE ...`` runs it only when MODULE can be imported. Building the
site itself (mkdocs, strict) is tests/integration/test_docs_build.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import mock_only

ROOT = Path(__file__).resolve().parents[2]
# Variables an MPI launcher sets: a child started without them is not part of a launch.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_")
DOCS = ROOT / "docs"
FILES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_DIRECTIVE = re.compile(r"^#\s*doc:\s*(skip|needs)\b\s*([\w.]*)")

# Runs in the child: exec each block, report the first failure with its line number.
_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__doc_example__"}
for start, code in blocks:
    try:
        exec(compile(code, f"{sys.argv[1]}:{start}", "exec"), namespace)
    except BaseException:
        print(f"block at line {start} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason-to-skip or None)`` for each python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        code = m.group(1)
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        d = _DIRECTIVE.match(first)
        reason = None
        if d and d.group(1) == "skip":
            reason = first
        elif d and d.group(1) == "needs" and importlib.util.find_spec(d.group(2)) is None:
            reason = f"needs {d.group(2)}"
        out.append((line, code, reason))
    return out


def test_the_docs_are_there():
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"index.md", "guide.md", "coming-from-torch.md"} <= names
    assert (DOCS / "reference" / "index.md").exists()
    # The reference is generated at build time; nothing generated is committed.
    assert not (DOCS / "api.md").exists() and not (DOCS / "gen_api.py").exists()


@mock_only
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path):
    blocks = python_blocks(path)
    runnable = [(line, code) for line, code, reason in blocks if reason is None]
    if not runnable:
        pytest.skip(f"{path.name} has no runnable python blocks")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("AXONDIST_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path.relative_to(ROOT))],
                          input=json.dumps(runnable), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_directives_are_honoured(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```python\n# doc: skip (needs MPI)\nraise SystemExit(1)\n```\n\n"
                   "```python\n# doc: needs surely_not_a_module_name\nimport x\n```\n\n"
                   "```python\nx = 1\n```\n", encoding="utf-8")
    blocks = python_blocks(doc)
    assert [b[0] for b in blocks] == [2, 7, 12]
    assert blocks[0][2].startswith("# doc: skip") and blocks[1][2].startswith("needs")
    assert blocks[2][2] is None and blocks[2][1] == "x = 1\n"


def test_guide_skips_only_what_needs_mpi_or_a_gpu():
    blocks = python_blocks(DOCS / "guide.md")
    skipped = [code for _, code, reason in blocks if reason and reason.startswith("# doc: skip")]
    assert len(blocks) >= 15
    assert all(("mpiexec" in c or "GPU" in c or "nccl" in c) for c in skipped)


# --- the environment variables -----------------------------------------------------------------

_VARIABLE = re.compile(r"AXONDIST_[A-Z][A-Z_]*[A-Z]")


def variables_the_code_reads() -> dict[str, str]:
    """``{AXONDIST_* name: a file that names it}`` over the package's source, less the test
    suite's knobs (which the settings module names only so as not to warn about them)."""
    from axondist.backends.settings import TEST_KNOBS, TEST_PREFIX

    found: dict[str, str] = {}
    for path in sorted((ROOT / "axondist").rglob("*.py")):
        for name in _VARIABLE.findall(path.read_text(encoding="utf-8")):
            if name not in TEST_KNOBS and not name.startswith(TEST_PREFIX):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def variables_in_the_guides_table() -> set[str]:
    """The first column of the guide's table of environment variables."""
    text = (DOCS / "guide.md").read_text(encoding="utf-8")
    table = text[text.index("Environment variables:"):text.index("### The mock world")]
    return set(re.findall(r"^\| `(AXONDIST_[A-Z_]+)", table, flags=re.MULTILINE))


def test_every_environment_variable_the_code_reads_is_in_the_guides_table():
    code, table = variables_the_code_reads(), variables_in_the_guides_table()
    assert len(code) >= 15, code  # the scan found the variables at all
    missing = {name: where for name, where in code.items() if name not in table}
    assert not missing, (f"environment variables named in the code but not in the table of "
                         f"docs/guide.md (\"Environment variables:\"): {missing}; add a row")
    stale = table - set(code)
    assert not stale, f"docs/guide.md's table lists variables no code reads: {sorted(stale)}"


# --- the README's commands ------------------------------------------------------------------


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [line.strip() for block in re.findall(r"^```bash\n(.*?)^```", text,
                                                 flags=re.DOTALL | re.MULTILINE)
            for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command_exactly():
    tests = [c for c in _readme_commands() if "pip install" in c and "pytest" in c]
    assert len(tests) == 1, tests
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert tests[0] in [line.strip() for line in ci], (tests[0], ci)


def test_the_quick_tier_the_readme_names_is_a_registered_marker():
    assert 'AXONDIST_TEST_EXAMPLES=10 .venv/bin/python -m pytest -m "not slow"' in \
        _readme_commands()
    config = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^\s+"slow: ', config, flags=re.MULTILINE), "no slow marker in pyproject"


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than ``-``/``_`` dropped."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    # headings inside code blocks are not headings
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_anchor_is_githubs():
    assert anchor("MPI: rules and settings") == "mpi-rules-and-settings"
    assert anchor("`full_state_dict` (a collective)") == "full_state_dict-a-collective"


@pytest.mark.parametrize("path", sorted(DOCS.rglob("*.md")),
                         ids=lambda p: str(p.relative_to(DOCS)))
def test_relative_links_and_anchors_resolve(path):
    broken = []
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, frag = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists() or frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(target)
    assert not broken, f"{path.name}: broken links {broken}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = [t for t in _LINK.findall(text)
              if "://" not in t and not (ROOT / t.partition("#")[0]).exists()]
    assert not broken, broken


# --- the API reference (its pages; the build is tests/integration/test_docs_build.py) ----------

_DIRECTIVE_LINE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def public_modules() -> list[str]:
    """``axondist`` and every submodule with no ``_``-prefixed part, by name."""
    import axondist

    names = []
    for info in pkgutil.walk_packages(axondist.__path__, "axondist."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return sorted(names)


def reference_directives() -> dict[str, str]:
    """``{object path: reference page}`` for each ``::: path`` of ``docs/reference``."""
    found = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        for path in _DIRECTIVE_LINE.findall(page.read_text(encoding="utf-8")):
            assert path not in found, f"{path} is rendered on {found[path]} and {page.name}"
            found[path] = page.name
    return found


def test_every_public_module_has_a_reference_page():
    rendered = reference_directives()
    missing = [m for m in public_modules() if m not in rendered and m != "axondist"]
    assert not missing, (f"{missing} appear on no page of docs/reference: add a "
                         "'::: module' line to the page of its concept")
    for path in rendered:
        module, _, name = path.rpartition(".")
        exists = path in public_modules() or hasattr(importlib.import_module(module), name)
        assert exists, f"docs/reference/{rendered[path]} renders {path}, which does not exist"


def test_every_docs_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    in_nav = set(re.findall(r"^\s+- [^:]+: ([\w/-]+\.md)$", config, flags=re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not pages - in_nav, (f"{sorted(pages - in_nav)} are in docs/ but not in the nav: "
                                "add a '- Title: page.md' line to mkdocs.yml")
    assert not in_nav - pages, f"the nav of mkdocs.yml names missing pages {in_nav - pages}"


def test_reference_pages_are_all_in_the_nav_user_facing_first():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    in_nav = re.findall(r"^\s+- [^:]+: (reference/[\w-]+\.md)$", config, flags=re.MULTILINE)
    pages = {f"reference/{p.name}" for p in (DOCS / "reference").glob("*.md")}
    assert set(in_nav) == pages
    assert in_nav[:2] == ["reference/index.md", "reference/collectives.md"]
    assert in_nav.index("reference/backends.md") > max(
        in_nav.index(f"reference/{p}.md") for p in ("ddp", "fsdp", "zero", "pipeline",
                                                       "tensor-parallel", "checkpoints",
                                                       "optimizers", "data"))
