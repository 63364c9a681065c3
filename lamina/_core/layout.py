"""The variables layout, ``{collection: nested dict mirroring the module tree}``, checked.

`bind_variables` turns a user's variables into the per-slot list a frame binds, with one fast
structural comparison on the way in; everything slower runs only when that comparison fails,
to say exactly what is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import VariablesError, format_list
from .graph import FlatKey, Plan


def flatten_variables(variables: Any, what: str = "variables") -> dict[FlatKey, Any]:
    """Flattens nested mappings into ``{(collection, *path): leaf}``.

    Args:
        variables: ``{collection: nested dict}``; any `Mapping` type is accepted.
        what: How messages name the argument.

    Returns:
        The leaves by key, in the mappings' own order.

    Raises:
        VariablesError: If `variables` is not a mapping, or holds a list or None.
    """
    if not isinstance(variables, Mapping):
        raise VariablesError(
            f"{what} must be a dict {{collection: {{...}}}} such as init returns, got "
            f"{type(variables).__name__}."
        )
    flat: dict[FlatKey, Any] = {}

    def visit(prefix: FlatKey, node: Mapping) -> None:
        for key, child in node.items():
            path = (*prefix, str(key))
            if isinstance(child, Mapping):
                visit(path, child)
            elif child is None or isinstance(child, (list, tuple)):
                raise VariablesError(
                    f"{what} hold {type(child).__name__} at {'/'.join(path)}; expected an "
                    f"array or a nested dict of arrays."
                )
            else:
                flat[path] = child

    visit((), variables)
    return flat


def nest(items: Iterable[tuple[FlatKey, Any]]) -> dict[str, Any]:
    """Builds ``{collection: nested dict}`` from ``(key, leaf)`` pairs (inverse of flatten)."""
    tree: dict[str, Any] = {}
    for key, leaf in items:
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = leaf
    return tree


def bind_variables(plan: Plan, variables: Any, what: str) -> list:
    """Checks `variables` against `plan` and returns one array per slot, in slot order.

    Args:
        plan: The model's plan.
        variables: The user's variables.
        what: Where the check happens, for messages (``"apply"``).

    Returns:
        The leaves in the plan's slot order.

    Raises:
        VariablesError: Missing or unexpected paths, or a wrong shape; the message lists them.
    """
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    if treedef == plan.treedef:
        try:
            if [leaf.shape for leaf in leaves] == plan.shapes:
                return leaves
        except AttributeError:
            pass  # Python scalars or other leaves without a shape: the careful path decides
    return _bind_checked(plan, variables, what)


def _bind_checked(plan: Plan, variables: Any, what: str) -> list:
    flat = flatten_variables(variables, f"{what}'s variables")
    check_variables(plan, flat, what, strict=True)
    return [_as_array(flat[entry.key]) for entry in plan.variables]


def check_variables(plan: Plan, flat: dict[FlatKey, Any], what: str, strict: bool) -> None:
    """Raises one `VariablesError` listing every mismatch between `flat` and `plan`.

    Args:
        plan: The model's plan.
        flat: Variables flattened by `flatten_variables`.
        what: Where the check happens, for messages.
        strict: Whether missing and unexpected paths are errors (shape mismatches always are).
    """
    problems = []
    if strict:
        missing = [entry.name for entry in plan.variables if entry.key not in flat]
        unexpected = ["/".join(key) for key in flat if key not in plan.index]
        if missing:
            problems.append(f"missing ({len(missing)}): {format_list(missing)}")
        if unexpected:
            problems.append(f"unexpected ({len(unexpected)}): {format_list(unexpected)}")
    wrong = []
    for entry in plan.variables:
        if entry.key in flat:
            got = tuple(np.shape(flat[entry.key]))
            if got != entry.state.shape:
                wrong.append(f"{entry.name}: expected {entry.state.shape}, got {got}")
    if wrong:
        problems.append(f"wrong shape ({len(wrong)}): {format_list(wrong, limit=5)}")
    if not problems:
        return
    model = type(plan.root).__name__
    hint = (
        "Pass the dict that init (or a previous apply) returned for this same model; after "
        "changing the model, run init again or carry weights over with lm.assign_variables."
    )
    collections = {entry.collection for entry in plan.variables}
    if strict and collections and not collections & {key[0] for key in flat}:
        hint = (
            f"The top-level keys should be collections ({', '.join(sorted(collections))}): "
            f"did you pass variables['params'] where {{'params': ...}} was expected?"
        )
    raise VariablesError(
        f"{what} got variables that do not match {model}:\n  " + "\n  ".join(problems) + f"\n{hint}"
    )


def _as_array(leaf: Any) -> Any:
    return leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else jnp.asarray(leaf)
