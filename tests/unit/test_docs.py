"""The docs' code runs, their links resolve, and the API reference covers every public name.

Every ```python block of ``docs/*.md`` and ``README.md`` is executed, the
blocks of one file in order in one namespace (a guide's examples build on
each other), in a fresh interpreter per file with the mock world. A block
whose first line is ``# doc: skip ...`` is not run (it needs MPI or a GPU);
``# doc: needs MODULE ...`` runs it only when MODULE can be imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
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
    assert {"guide.md", "api.md", "coming-from-torch.md"} <= names


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


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    sys.path.insert(0, str(DOCS))
    try:
        import gen_api
    finally:
        sys.path.remove(str(DOCS))
    text = path.read_text(encoding="utf-8")
    # headings inside code blocks are not headings
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {gen_api.anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
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


# --- the API reference -------------------------------------------------------------------------


def _gen_api():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_api
    finally:
        sys.path.remove(str(DOCS))
    return gen_api


def test_gen_api_documents_every_public_name():
    gen_api = _gen_api()
    text, covered = gen_api.generate()
    import axondist

    for module in gen_api.public_modules():
        names = set(gen_api.public_names(module))
        present = {n for n in names if hasattr(module, n)}
        missing = present - covered[module.__name__]
        assert not missing, f"{module.__name__}: {sorted(missing)} not documented"
    for name in axondist.__all__:
        assert f"`{name}`" in text or f"axondist.{name}\n" in text, name
    # Each documented definition has a heading, and each link into the page has its anchor.
    headings = {gen_api.anchor(h) for h in re.findall(r"^#+ (.+)$", re.sub(
        r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE), flags=re.MULTILINE)}
    targets = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert targets <= headings, sorted(targets - headings)[:10]


def test_gen_api_renders_docstring_sections():
    gen_api = _gen_api()
    md = gen_api.docstring_markdown('''Do it.

    Args:
        x: the :class:`~axondist.World` input, described over
            two lines.
        y (int): another.

    Returns:
        ``x`` again.

    Example::

        f(1)
    ''')
    assert "**Args**" in md and "- `x`: the `World` input, described over two lines." in md
    assert "- `y` (int): another." in md
    assert "**Returns**" in md and "`x` again." in md
    assert "```text\nf(1)\n```" in md
    assert "```python" not in md  # docstring examples never become executed doc blocks


def test_committed_api_reference_lists_every_top_level_name():
    import axondist

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [n for n in axondist.__all__ if f"`{n}`" not in text and f".{n}\n" not in text]
    assert not missing, (f"docs/api.md lacks {missing}: regenerate it with "
                         "python docs/gen_api.py")
