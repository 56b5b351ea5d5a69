"""Nested gradients: flatten a list, tuple, dict (a torch ``state_dict``) or JAX pytree of
arrays into leaves, and rebuild the same structure around new leaves.

Leaves come in a fixed order every rank agrees on whatever order its dicts were filled in:
dict keys sorted (as JAX sorts them), sequences in order. ``None`` is a leaf here (a missing
gradient), so a caller can name it instead of losing it. Each leaf has a path for messages,
``grads['fc.weight']`` or ``grads[2]``. JAX's own pytrees (a Flax ``FrozenDict``, a
registered dataclass) go through ``jax.tree_util`` when JAX is loaded; nothing is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._frameworks import framework_of

#: ``(leaves, paths, rebuild)``: ``rebuild(new_leaves)`` is the input's structure around them.
Flat = tuple[list[Any], list[str], Callable[[list[Any]], Any]]


def _is_leaf(x: Any) -> bool:
    """An array, tensor, scalar or None: what is not a container."""
    return (x is None or hasattr(x, "__array_interface__") or hasattr(x, "__dlpack__")
            or hasattr(x, "__cuda_array_interface__") or framework_of(x) is not None
            or isinstance(x, (int, float, complex)))


def _sorted_keys(d: Mapping[Any, Any]) -> list[Any]:
    keys = list(d)
    try:
        return sorted(keys)
    except TypeError:  # keys of mixed types: the mapping's own order
        return keys


def flatten(tree: Any, root: str) -> Flat:
    """The leaves of ``tree`` in the agreed order, their paths under ``root``, and the
    function that rebuilds ``tree``'s structure around new leaves.

    A bare array is one leaf; a generator or other iterable counts as a list.
    """
    if _is_leaf(tree):
        return [tree], [root], lambda leaves: leaves[0]
    if isinstance(tree, (Mapping, list, tuple)):
        return _flatten_native(tree, root)
    jax = sys.modules.get("jax")
    if jax is not None and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tree)):
        jax = None
    if jax is not None:
        return _flatten_jax(jax, tree, root)
    if isinstance(tree, (str, bytes)) or not isinstance(tree, Iterable):
        raise TypeError(f"{root} must be an array, or a list, tuple or dict of arrays (any "
                        f"nesting; a JAX pytree), got {type(tree).__name__} {tree!r}")
    return _flatten_native(list(tree), root)


def _flatten_native(tree: Any, root: str) -> Flat:
    leaves: list[Any] = []
    paths: list[str] = []

    def walk(node: Any, path: str) -> Callable[[Callable[[], Any]], Any]:
        """Collect ``node``'s leaves; return what rebuilds it from a source of new leaves."""
        if _is_leaf(node):
            leaves.append(node)
            paths.append(path)
            return lambda take: take()
        if isinstance(node, Mapping):
            keys = _sorted_keys(node)
            parts = dict(zip(keys, [walk(node[k], f"{path}[{k!r}]") for k in keys]))

            def build_map(take: Callable[[], Any], node: Any = node) -> Any:
                values = {k: part(take) for k, part in parts.items()}
                ordered = {k: values[k] for k in node}  # the mapping's own order
                try:
                    copy = node.copy()  # an OrderedDict or defaultdict keeps its type
                    copy.update(ordered)
                    return copy
                except (AttributeError, TypeError):
                    try:
                        return type(node)(ordered)  # an immutable mapping
                    except TypeError:
                        return ordered
            return build_map
        if isinstance(node, (list, tuple)):
            parts_seq = [walk(item, f"{path}[{i}]") for i, item in enumerate(node)]

            def build_seq(take: Callable[[], Any], node: Any = node) -> Any:
                items = [part(take) for part in parts_seq]
                if hasattr(node, "_fields"):  # a namedtuple
                    return type(node)(*items)
                return tuple(items) if isinstance(node, tuple) else items
            return build_seq
        raise TypeError(f"{path} is {type(node).__name__} {node!r}; expected an array (or a "
                        "list, tuple or dict of arrays)")

    build = walk(tree, root)

    def rebuild(new_leaves: list[Any]) -> Any:
        return build(iter(list(new_leaves)).__next__)
    return leaves, paths, rebuild


def _flatten_jax(jax: Any, tree: Any, root: str) -> Flat:
    """A JAX pytree (a registered node type), with ``None`` kept as a leaf."""
    tree_util = jax.tree_util
    pairs, treedef = tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    paths = [root + tree_util.keystr(path) for path, _ in pairs]
    leaves = [leaf for _, leaf in pairs]
    return leaves, paths, lambda new: tree_util.tree_unflatten(treedef, list(new))


__all__ = ["flatten"]
