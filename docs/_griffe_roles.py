"""Griffe extension for the API reference: docstrings as written here, rendered by mkdocstrings.

axondist's docstrings are Google style with Sphinx roles (:func:`~axondist.init`).
mkdocstrings renders Markdown, so each role is rewritten before rendering: to a
cross-reference (``[`init`][axondist.launching.worlds.init]``) when its target resolves to a
public object that the reference renders, else to a plain code span. Targets are
resolved as Sphinx does: as written, then relative to the documented object and each
of its parents, then under ``axondist``. A cross-reference that does not resolve at
build time fails ``mkdocs build --strict``, so the links cannot rot silently. Two
conventions of the docstrings that Google style lacks are spelled out too: an ``Args`` entry
naming several parameters (``bias, dtype: ...`` or ``a / b: ...``) becomes one entry per name
(each still checked against the signature), and a ``Raises`` entry that names no class
(``The first failing rank's own exception...``) is listed under ``Exception``. Two
reStructuredText block forms are translated as well: ``text::`` before a literal block
loses its second colon, and a simple table (``=== ===`` borders) is shown preformatted.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Raises|Returns|Yields|Attributes|"
                      r"Examples?|Notes?|Warnings?|See Also|Other Parameters):\s*$")
_MULTI_NAME = re.compile(r"^(\s+)(\w+(?:\s*[,/]\s*\w+)+)(\s*\([^)]*\))?:(\s.*)?$")
_NAMED_RAISE = re.compile(r"^\s+[\w.]+(\s*\([^)]*\))?:(\s|$)")
_BORDER = re.compile(r"^\s*=+( +=+)+\s*$")
_LITERAL_INTRO = re.compile(r"^(\s*)(.*?)\s*::\s*$")
_ROLE = re.compile(r":(?:py:)?(func|class|meth|attr|mod|data|exc|obj|const):`(~?)\.?([^`<>]+)`")
PACKAGE = "axondist"


def _lookup(collection: Any, path: str) -> griffe.Object | None:
    try:
        found = collection[path]
        return found.final_target if found.is_alias else found
    except Exception:  # KeyError, AliasResolutionError, CyclicAliasError: not a target
        return None


def _rendered(obj: griffe.Object) -> bool:
    """True when the reference shows ``obj`` (public on every level of its path)."""
    node: griffe.Object | None = obj
    while node is not None and node.path != PACKAGE:
        if node.name.startswith("_") or not node.is_public:
            return False
        node = node.parent
    return True


def resolve(collection: Any, scope: griffe.Object, target: str) -> str | None:
    """The canonical path of the public object ``target`` names from ``scope``, or None."""
    candidates = [target]
    node: griffe.Object | None = scope
    while node is not None:
        candidates.append(f"{node.path}.{target}")
        node = node.parent
    candidates.append(f"{PACKAGE}.{target}")
    for path in candidates:
        obj = _lookup(collection, path)
        if obj is not None and _rendered(obj):
            return obj.path
    return None


def rewrite(text: str, collection: Any, scope: griffe.Object) -> str:
    """``text`` with every role replaced by a cross-reference or a code span."""

    def one(m: re.Match[str]) -> str:
        short, target = m.group(2), m.group(3).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        path = resolve(collection, scope, target.removesuffix("()"))
        return f"[`{shown}`][{path}]" if path else f"`{shown}`"

    return _ROLE.sub(one, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _expand_args(lines: list[str]) -> list[str]:
    """Split ``a, b: text`` entries (with their continuation lines) into one per name."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _MULTI_NAME.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(m.group(1))):
            j += 1
        rest = (m.group(3) or "") + ":" + (m.group(4) or "")
        for name in re.split(r"\s*[,/]\s*", m.group(2)):
            out.append(f"{m.group(1)}{name}{rest}")
            out.extend(lines[i + 1:j])
        i = j
    return out


def _name_raises(body: list[str]) -> list[str]:
    """Entries of a ``Raises`` section that name no class: ``Exception: text``, their
    continuation lines (at the entry's own indent) indented under it."""
    first = next((line for line in body if line.strip()), None)
    if first is None:
        return body
    item = _indent(first)
    out: list[str] = []
    unnamed = False
    for line in body:
        if not line.strip() or _indent(line) > item:
            out.append(line)
        elif _NAMED_RAISE.match(line):
            unnamed = False
            out.append(line)
        elif unnamed:
            out.append("    " + line)
        else:
            unnamed = True
            out.append(f"{' ' * item}Exception: {line.strip()}")
    return out


def normalize_sections(text: str) -> str:
    """``text`` with multi-name ``Args`` entries split and unnamed ``Raises`` entries named."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        head = _SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if not head or head.group(2) not in ("Args", "Arguments", "Parameters", "Raises"):
            continue
        j = i
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(head.group(1))):
            j += 1
        body = lines[i:j]
        if head.group(2) == "Raises":
            body = _name_raises(body)
        else:
            body = _expand_args(body)
        out.extend(body)
        i = j
    return "\n".join(out)


def rst_blocks(text: str) -> str:
    """``text`` with ``::`` literal-block intros made plain and simple tables fenced."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _BORDER.match(line):
            borders = [j for j in range(i, len(lines)) if _BORDER.match(lines[j])][:3]
            if len(borders) == 3:
                pad = line[:len(line) - len(line.lstrip())]
                out += [f"{pad}```text", *lines[i:borders[2] + 1], f"{pad}```"]
                i = borders[2] + 1
                continue
        m = _LITERAL_INTRO.match(line)
        if m and i + 1 < len(lines) and not lines[i + 1].strip():
            words = m.group(2)
            if words.lower() in ("example", "examples"):
                words = "For example"
            out.append(f"{m.group(1)}{words}:" if words else "")
        else:
            out.append(line)
        i += 1
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Rewrite roles in every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                text = normalize_sections(rst_blocks(obj.docstring.value))
                obj.docstring.value = rewrite(text, loader.modules_collection, obj)
            stack.extend(m for m in obj.members.values() if not m.is_alias)
