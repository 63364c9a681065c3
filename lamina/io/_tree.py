"""Pytrees to flat names (``params/layer1/kernel``, ``opt/0/mu/kernel``) and back.

The way back is `layout.nest` for nested dicts, and the structure's own treedef for anything
else (`load(..., like=...)`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._core.errors import VariablesError
from .._core.graph import FlatKey
from ._format import METADATA_KEY

PathLike = str | os.PathLike[str]


def as_path(path: Any, what: str) -> str:
    """`path` as a string; a `TypeError` naming `what` for anything but a str or PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def key_part(entry: Any) -> Any:
    """The name part of one step of a JAX key path (a dict key is returned as it is)."""
    if isinstance(entry, jax.tree_util.DictKey):
        return entry.key
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def flatten(
    tree: Any, what: str, note: str = "", *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[dict[FlatKey, Any], list[FlatKey]]:
    """``{path: leaf}`` of a pytree, and the paths of its empty containers (not the root's).

    A path's parts are dict keys, sequence indices (``"0"``, ``"1"``, ...) and the field
    names of named tuples and other keyed pytree nodes, as in `jax.tree_util`'s key paths, so
    that `paths_of` names the leaves of a structure to restore the same way. Any `Mapping` is
    a container; ``None`` is an empty subtree with no path (as to JAX). Dict keys must be
    non-empty strings without ``/``: anything else could not come back as the same key from a
    flat name.

    Args:
        tree: The pytree; a leaf or None at the top is an error (a leaf needs a name).
        what: How messages name it (``"lm.save's variables"``).
        note: Appended to the messages (``"; nothing was written"``).
        is_leaf: What else counts as a leaf (as in `jax.tree_util.tree_flatten`).

    Raises:
        VariablesError: Listing every bad key, by path.
    """
    leaves: dict[FlatKey, Any] = {}
    empty: list[FlatKey] = []
    bad: list[str] = []

    def children(node: Any) -> list[tuple[Any, Any]] | None:
        """``(key, child)`` pairs of a container; None for a leaf."""
        if is_leaf is not None and is_leaf(node):
            return None
        if isinstance(node, Mapping):
            return list(node.items())
        flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        if len(flat) == 1 and flat[0][0] == ():
            return None
        return [(key_part(path[0]), child) for path, child in flat]

    def visit(prefix: FlatKey, node: Any) -> None:
        items = children(node)
        if items is None:
            leaves[prefix] = node
            return
        if prefix and not items:
            empty.append(prefix)
        for key, child in items:
            where = "/".join(prefix) or "the top level"
            if not isinstance(key, str):
                bad.append(f"key {key!r} ({type(key).__name__}) in {where}: keys must be str")
            elif not key or "/" in key:
                bad.append(f"key {key!r} in {where}: keys must be non-empty and without '/'")
            elif child is not None:
                visit((*prefix, key), child)

    if tree is None or children(tree) is None:
        raise VariablesError(
            f"{what} must be a pytree of arrays (a dict {{collection: {{...}}}} such as init "
            f"returns, or any dict, list, tuple or named tuple of arrays, whose paths name "
            f"them), got {type(tree).__name__}{note}."
        )
    visit((), tree)
    if (METADATA_KEY,) in leaves:
        bad.append("key '__metadata__' at the top level: the format reserves that name")
    if bad:
        raise VariablesError(
            f"{what} have keys that cannot name an array{note}:\n  " + "\n  ".join(bad[:10])
        )
    return leaves, empty
