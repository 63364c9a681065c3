"""Nested dicts to flat names (``params/layer1/kernel``); the way back is `layout.nest`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._core.errors import VariablesError
from .._core.graph import FlatKey
from ._format import METADATA_KEY

PathLike = str | os.PathLike[str]


def as_path(path: Any, what: str) -> str:
    """`path` as a string; a `TypeError` naming `what` for anything but a str or PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def flatten(tree: Any, what: str, note: str = "") -> tuple[dict[FlatKey, Any], list[FlatKey]]:
    """``{path: leaf}`` of a nested dict, and the paths of its empty dicts (not the root's).

    Keys must be non-empty strings without ``/``: anything else could not come back as the
    same key from a flat name.

    Args:
        tree: The nested dict (any `Mapping`); anything else is a leaf.
        what: How messages name it (``"lm.save's variables"``).
        note: Appended to the messages (``"; nothing was written"``).

    Raises:
        VariablesError: Listing every bad key, by path.
    """
    if not isinstance(tree, Mapping):
        raise VariablesError(
            f"{what} must be a dict {{collection: {{...}}}} such as init returns, got "
            f"{type(tree).__name__}{note}."
        )
    leaves: dict[FlatKey, Any] = {}
    empty: list[FlatKey] = []
    bad: list[str] = []

    def visit(prefix: FlatKey, node: Mapping) -> None:
        if prefix and not node:
            empty.append(prefix)
        for key, child in node.items():
            where = "/".join(prefix) or "the top level"
            if not isinstance(key, str):
                bad.append(f"key {key!r} ({type(key).__name__}) in {where}: keys must be str")
                continue
            if not key or "/" in key:
                bad.append(f"key {key!r} in {where}: keys must be non-empty and without '/'")
                continue
            if isinstance(child, Mapping):
                visit((*prefix, key), child)
            else:
                leaves[(*prefix, key)] = child

    visit((), tree)
    if (METADATA_KEY,) in leaves:
        bad.append("key '__metadata__' at the top level: the format reserves that name")
    if bad:
        raise VariablesError(
            f"{what} are not a nested dict with string keys{note}:\n  " + "\n  ".join(bad[:10])
        )
    return leaves, empty
