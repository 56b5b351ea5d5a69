"""The NCCL backend's shape, read without CuPy: a backend holding its parts (no mixin
chain), plans and messages that use only the communicator's public surface, and no private
copy of the shared cross-rank check."""

from __future__ import annotations

import ast
from pathlib import Path

import axondist.backends.nccl as nccl_package
from axondist.backends import checks
from axondist.backends.base import Backend
from axondist.backends.nccl import communicator, runtime
from axondist.backends.nccl.backend import NcclBackend
from axondist.backends.nccl.communicator import Communicator

PACKAGE = Path(nccl_package.__file__).parent


def test_the_backend_is_one_class_on_the_contract():
    assert NcclBackend.__mro__[1:] == Backend.__mro__
    assert not issubclass(Communicator, Backend)


def _attributes_of_the_communicator(path: Path) -> set[str]:
    """Attribute names the module reads on what holds the communicator (``self._comm``,
    ``self.comm``, or a local ``c`` bound to either)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        if isinstance(holder, ast.Name) and holder.id == "c":
            found.add(node.attr)
        elif (isinstance(holder, ast.Attribute) and holder.attr in ("_comm", "comm")
              and isinstance(holder.value, ast.Name) and holder.value.id == "self"):
            found.add(node.attr)
    return found


def test_plans_and_messages_use_the_communicators_public_surface_only():
    for name in ("plans.py", "messages.py"):
        used = _attributes_of_the_communicator(PACKAGE / name)
        assert used, name
        private = sorted(a for a in used if a.startswith("_"))
        assert not private, f"{name} reads {private} of the communicator"
        declared = {a for a in dir(Communicator) if not a.startswith("_")}
        made_in_init = set(Communicator.__init__.__code__.co_names)
        unknown = sorted(used - declared - made_in_init)
        assert not unknown, f"{name} reads {unknown}, which the communicator does not have"


def test_the_check_words_are_the_shared_checks():
    assert communicator.check_words is checks.check_words
    assert not hasattr(runtime, "check_pair")
