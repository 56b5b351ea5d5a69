"""Generate ``docs/api.md``, the API reference, from axondist's docstrings.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 when docs/api.md is out of date
    python docs/gen_api.py --stdout   # print it instead

Every public module of the package is imported (modules whose name or a
parent's name starts with ``_`` are private and skipped) and its public
names are documented where they are defined: the module's ``__all__``, or,
without one, the functions, classes and constants it defines whose names do
not start with ``_``. A name a module re-exports from another is listed
with a link to its definition. Classes show their constructor, public
methods and properties, and the docstrings under their fields (read from
the source, since Python keeps no attribute docstrings at run time).

Docstrings are Google style with reStructuredText roles; they are turned
into Markdown: ``Args:``/``Raises:``... sections become bold headings with
bullet lists, roles like :func:`~axondist.X` become code spans, and
literal blocks (``::`` and ``>>>``) become fenced ``text`` blocks (never
``python``: the docs' tests execute ``python`` blocks, and these examples
are fragments).
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import itertools
import pkgutil
import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
OUTPUT = DOCS / "api.md"
PACKAGE = "axondist"

SECTIONS = ("Args", "Arguments", "Parameters", "Returns", "Return", "Raises", "Yields",
            "Attributes", "Example", "Examples", "Note", "Notes", "Warning", "See also")
_LIST_SECTIONS = {"Args", "Arguments", "Parameters", "Raises", "Attributes"}
_RST_BORDER = re.compile(r"^=+( +=+)+$")
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`~?([^`]+)`")


# --- discovery -----------------------------------------------------------------------


def public_modules() -> list[types.ModuleType]:
    """``axondist`` and every public submodule, in name order (each imported)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        parts = info.name.split(".")[1:]
        if any(p.startswith("_") for p in parts):
            continue
        names.append(info.name)
    modules = []
    for name in sorted(names):
        modules.append(importlib.import_module(name))
    return modules


def public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``, else the public things it defines itself."""
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return list(declared)
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        home = getattr(obj, "__module__", None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and home != module.__name__:
            continue  # imported from elsewhere
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) and name in _typing_names():
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) \
                and not _defined_in_source(module, name):
            continue
        names.append(name)
    return sorted(names)


def _typing_names() -> set[str]:
    import typing

    return set(dir(typing)) | {"annotations", "TYPE_CHECKING"}


def _defined_in_source(module: types.ModuleType, name: str) -> bool:
    """A module-level assignment of ``name`` in the module's own source."""
    return name in _module_assignments(module)


_ASSIGN_CACHE: dict[str, dict[str, str]] = {}


def _module_assignments(module: types.ModuleType) -> dict[str, str]:
    """``{name: '#:' comment}`` for every module-level assignment (comment may be '')."""
    if module.__name__ in _ASSIGN_CACHE:
        return _ASSIGN_CACHE[module.__name__]
    out: dict[str, str] = {}
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        _ASSIGN_CACHE[module.__name__] = out
        return out
    lines = source.splitlines()
    for node in ast.parse(source).body:
        targets: list[str] = []
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        comment = []
        k = node.lineno - 2
        while k >= 0 and lines[k].lstrip().startswith("#:"):
            comment.insert(0, lines[k].lstrip()[2:].strip())
            k -= 1
        for t in targets:
            out[t] = " ".join(comment)
    _ASSIGN_CACHE[module.__name__] = out
    return out


def home_of(obj: Any, fallback: str) -> str:
    """The module a function or class is defined in (``fallback`` for other objects)."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return getattr(obj, "__module__", fallback) or fallback
    return fallback


# --- docstrings to Markdown ----------------------------------------------------------


def convert_roles(text: str) -> str:
    """``:func:`~a.b.c``` -> ```c``` (``~`` keeps the last part), ````x```` -> ```x```."""
    def role(m: re.Match[str]) -> str:
        target = m.group(1)
        whole = m.group(0)
        shown = target.rsplit(".", 1)[-1] if ":`~" in whole else target
        return f"`{shown}`"

    text = _ROLE.sub(role, text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def docstring_markdown(doc: str | None) -> str:
    """A cleaned docstring as Markdown (see the module docstring for the rules)."""
    if not doc:
        return "*(no docstring)*"
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    section: str | None = None
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        header = stripped[:-1] if stripped.endswith(":") else None
        if header in SECTIONS and not line.startswith(" "):
            section = header
            out += ["", f"**{header}**", ""]
            i += 1
            if header in ("Example", "Examples"):
                block, i = _indented_block(lines, i)
                if block:
                    out += ["```text", *block, "```", ""]
            continue
        if _RST_BORDER.match(stripped):  # an RST simple table: verbatim, borders included
            block, borders = [], 0
            while i < len(lines) and borders < 3:
                borders += bool(_RST_BORDER.match(lines[i].strip()))
                block.append(lines[i])
                i += 1
            out += ["", "```text", *block, "```", ""]
            continue
        if stripped.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i].strip() if lines[i].strip().startswith(">>>")
                             else lines[i])
                i += 1
            out += ["```text", *block, "```", ""]
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            text = stripped[:-1] if stripped != "::" else ""
            if text:
                out.append(convert_roles(_unindent(line)[:-1]))
            block, i = _indented_block(lines, i + 1)
            out += ["", "```text", *block, "```", ""]
            continue
        if section in _LIST_SECTIONS and line.startswith(" ") and stripped:
            entry, i = _list_entry(lines, i)
            out.append(entry)
            continue
        if section and not line.startswith(" ") and stripped:
            section = None  # the section ended: back to body text
        if line.startswith("    ") and section is None and stripped:
            block, i = _indented_block(lines, i)  # an indented table or layout: verbatim
            out += ["", "```text", *block, "```", ""]
            continue
        out.append(convert_roles(stripped) if section else convert_roles(line))
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _unindent(line: str) -> str:
    return line.strip()


def _indented_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented block starting at ``lines[i]`` (blank lines inside kept), dedented."""
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines):
        return [], i
    indent = len(lines[i]) - len(lines[i].lstrip())
    if indent == 0:
        return [], i
    block = []
    while i < len(lines) and (not lines[i].strip()
                              or len(lines[i]) - len(lines[i].lstrip()) >= indent):
        block.append(lines[i][indent:] if lines[i].strip() else "")
        i += 1
    while block and not block[-1]:
        block.pop()
    return block, i


def _list_entry(lines: list[str], i: int) -> tuple[str, int]:
    """``name: text`` plus its deeper-indented continuation lines -> one bullet."""
    first = lines[i]
    indent = len(first) - len(first.lstrip())
    parts = [first.strip()]
    i += 1
    while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
        parts.append(lines[i].strip())
        i += 1
    text = " ".join(parts)
    m = re.match(r"^([\w*., ]+?)(\s*\([^)]*\))?:\s+(.*)$", text)
    if m:
        return f"- `{m.group(1).strip()}`{m.group(2) or ''}: {convert_roles(m.group(3))}", i
    return f"- {convert_roles(text)}", i


# --- rendering -----------------------------------------------------------------------


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than ``-``/``_`` dropped."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def signature_of(obj: Any, name: str) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    sig = re.sub(r"<([\w.]+): ([^>]+)>", r"\1", sig)  # enum defaults: <A.B: 1> -> A.B
    sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)  # postponed annotations are strings
    sig = re.sub(r" at 0x[0-9a-f]+>", ">", sig)
    return f"{name}{sig}"


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under class-level fields (``x: int = 0`` then ``\"\"\"...\"\"\"``)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    node = tree.body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for a, b in itertools.pairwise(body):
        target = None
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            target = a.target.id
        elif isinstance(a, ast.Assign) and len(a.targets) == 1 and isinstance(a.targets[0],
                                                                               ast.Name):
            target = a.targets[0].id
        if (target and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)):
            docs[target] = inspect.cleandoc(b.value.value)
    return docs


def _own_members(cls: type) -> list[tuple[str, Any]]:
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            members.append((name, value.__func__))
        elif isinstance(value, property) or inspect.isfunction(value):
            members.append((name, value))
    return members


def render_class(qualname: str, cls: type) -> list[str]:
    out = [f"### {qualname}", ""]
    bases = [b for b in cls.__bases__ if b not in (object, enum.Enum)]
    kind = "enum" if issubclass(cls, enum.Enum) else "class"
    if issubclass(cls, enum.Enum):
        out += [f"*{kind}*" + (f", a subclass of {', '.join(_name(b) for b in bases)}"
                              if bases else ""), ""]
    else:
        out += ["```text", f"class {signature_of(cls, cls.__name__)}", "```", ""]
        if bases:
            out += [f"Subclass of {', '.join(_name(b) for b in bases)}.", ""]
    out += [docstring_markdown(cls.__doc__), ""]
    fdocs = field_docs(cls)
    if issubclass(cls, enum.Enum):
        rows = [f"- `{m.name}` = `{m.value!r}`"
                + (f": {convert_roles(' '.join(fdocs[m.name].split()))}"
                   if m.name in fdocs else "")
                for m in cls]
        out += ["**Members**", "", *rows, ""]
    elif fdocs:
        out += ["**Fields**", ""]
        out += [f"- `{k}`: {convert_roles(' '.join(v.split()))}" for k, v in fdocs.items()]
        out.append("")
    for name, member in _own_members(cls):
        doc = member.__doc__ or _inherited_doc(cls, name)
        if isinstance(member, property):
            out += [f"#### {cls.__name__}.{name}", "", "*property*", "",
                    docstring_markdown(doc), ""]
        else:
            out += [f"#### {cls.__name__}.{name}", "", "```text",
                    signature_of(member, name), "```", "", docstring_markdown(doc), ""]
    return out


def _inherited_doc(cls: type, name: str) -> str | None:
    """The docstring of the base-class member ``name`` overrides, with a line saying so."""
    for base in cls.__mro__[1:]:
        member = vars(base).get(name)
        doc = getattr(member, "__doc__", None) if member is not None else None
        if doc:
            return (f"(Documented on `{base.__module__}.{base.__qualname__}.{name}`.)\n\n"
                    + inspect.cleandoc(doc))
    return None


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", "")
    return f"`{module}.{obj.__qualname__}`" if module.startswith(PACKAGE) else \
        f"`{obj.__qualname__}`"


def render_constant(qualname: str, value: Any, comment: str) -> list[str]:
    text = repr(value)
    text = re.sub(r" at 0x[0-9a-f]+>", ">", text)
    if len(text) > 300:
        text = text[:297] + "..."
    out = [f"### {qualname}", "", f"*{type(value).__name__}*", ""]
    if comment:
        out += [convert_roles(comment), ""]
    out += ["```text", text, "```", ""]
    return out


@dataclass
class Entry:
    """One documented name: where it is defined and what it is."""

    module: str
    name: str
    obj: Any
    summary: str = ""
    lines: list[str] = field(default_factory=list)


def _summary(obj: Any, comment: str = "") -> str:
    doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
    text = (doc or comment or "").strip().split("\n\n")[0].replace("\n", " ")
    return convert_roles(text)


def generate() -> tuple[str, dict[str, set[str]]]:
    """The Markdown text, and ``{module: names documented or listed in its section}``."""
    modules = public_modules()
    covered: dict[str, set[str]] = {}
    defined_at: dict[int, str] = {}
    blocks: list[list[str]] = []
    index: list[str] = []
    for module in modules:
        names = public_names(module)
        covered[module.__name__] = set()
        own, reexported = [], []
        comments = _module_assignments(module)
        for name in names:
            obj = getattr(module, name, None)
            if obj is None and not hasattr(module, name):
                continue  # a name __all__ promises but the module lacks: shown as missing
            home = home_of(obj, module.__name__)
            if home == module.__name__ or home not in {m.__name__ for m in modules}:
                own.append((name, obj))
            else:
                reexported.append((name, obj, home))
        if module.__name__ == PACKAGE:  # the top level: a table, except for private homes
            documented = {m.__name__ for m in modules}
            everything = own + [(r[0], r[1]) for r in reexported]
            own = [(n, o) for n, o in everything if home_of(o, PACKAGE) not in documented
                   or home_of(o, PACKAGE) == PACKAGE]
            own_names = {n for n, _ in own}
            reexported = [(n, o, home_of(o, PACKAGE)) for n, o in everything
                          if n not in own_names]
        lines = [f"## {module.__name__}", "", docstring_markdown(module.__doc__), ""]
        index.append(f"- [{module.__name__}](#{anchor(module.__name__)})")
        real_names = {n for n, _ in own}
        for name, obj in own:
            qual = f"{module.__name__}.{name}"
            real = getattr(obj, "__name__", name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and real != name \
                    and real in real_names:  # an alias (DDP = DistributedDataParallel)
                target = f"{module.__name__}.{real}"
                lines += [f"### {qual}", "", f"Alias of [`{real}`](#{anchor(target)}).", ""]
                covered[module.__name__].add(name)
                continue
            if inspect.isclass(obj):
                lines += render_class(qual, obj)
            elif callable(obj) and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                lines += [f"### {qual}", "", "```text", signature_of(obj, name), "```", "",
                          docstring_markdown(obj.__doc__), ""]
            elif inspect.isclass(type(obj)) and callable(obj) and hasattr(obj, "__wrapped__"):
                lines += [f"### {qual}", "", docstring_markdown(obj.__doc__), ""]
            else:
                lines += render_constant(qual, obj, comments.get(name, ""))
            defined_at.setdefault(id(obj), qual)
            covered[module.__name__].add(name)
        if reexported:
            lines += ["**Also available here**" if own else "**Names**", "", "| name | what |",
                      "|---|---|"]
            for name, obj, home in reexported:
                target = f"{home}.{getattr(obj, '__name__', name)}"
                if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    target = f"{home}.{name}"
                lines.append(f"| [`{name}`](#{anchor(target)}) | "
                             f"{_summary(obj, comments.get(name, '')).replace('|', '/')} |")
                covered[module.__name__].add(name)
            lines.append("")
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            lines += [f"*Listed in `__all__` but missing: {', '.join(missing)}*", ""]
        blocks.append(lines)
    head = ["# API reference", "",
            ("Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. "
             "Every public module is listed, each name documented in the module that defines "
             "it; the top-level `axondist` names link there."), "", "## Modules", "", *index, ""]
    text = "\n".join(head + [line for block in blocks for line in block])
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return text, covered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/api.md differs from what would be generated")
    parser.add_argument("--stdout", action="store_true", help="print instead of writing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text, _ = generate()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
