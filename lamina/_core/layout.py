"""The variables layout, ``{collection: nested dict mirroring the module tree}``, checked.

`bind_variables` turns a user's variables into the per-slot list a frame binds, with one fast
structural comparison on the way in; everything slower runs only when that comparison fails,
to say exactly what is wrong.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checks import format_list
from .errors import VariablesError
from .graph import FlatKey, Plan, VariableEntry
from .types import Dtype


def flatten_variables(variables: Any, where: str = "variables") -> dict[FlatKey, Any]:
    """Flattens nested mappings into ``{(collection, *path): leaf}``.

    Args:
        variables: ``{collection: nested dict}``; any `Mapping` type is accepted.
        where: How messages name the argument (or its caller).

    Returns:
        The leaves by key, in the mappings' own order.

    Raises:
        VariablesError: If `variables` is not a mapping, or holds a list or None.
    """
    if not isinstance(variables, Mapping):
        raise VariablesError(
            f"{where} must be a dict {{collection: {{...}}}} such as init returns, got "
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
                    f"{where} hold {type(child).__name__} at {'/'.join(path)}; expected an "
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


def bind_variables(plan: Plan, variables: Any, where: str) -> list:
    """Checks `variables` against `plan` and returns one array per slot, in slot order.

    Args:
        plan: The model's plan.
        variables: The user's variables.
        where: Where the check happens, for messages (``"apply"``).

    Returns:
        The leaves in the plan's slot order.

    Raises:
        VariablesError: Missing or unexpected paths, or a wrong shape; the message lists them.
    """
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    if treedef == plan.treedef:
        try:
            # Every eager apply comes here, so the loops run in C (`map`), and the array check
            # runs once per distinct leaf type (usually one: jaxlib's array) rather than once
            # per leaf (`isinstance(leaf, jax.Array)` costs about 0.2 microseconds).
            kinds = set(map(type, leaves))
            if list(map(_SHAPE, leaves)) == plan.shapes and (
                all(issubclass(kind, _ARRAYS) for kind in kinds)
                or all(isinstance(leaf, _ARRAYS) for leaf in leaves)
            ):
                return leaves
        except AttributeError:
            pass  # Python scalars or other leaves without a shape: the careful path decides
    return _bind_checked(plan, variables, where)


_ARRAYS = (jax.Array, np.ndarray, np.generic)

_SHAPE = operator.attrgetter("shape")


def _bind_checked(plan: Plan, variables: Any, where: str) -> list:
    flat = flatten_variables(variables, f"{where}'s variables")
    check_variables(plan, flat, where)
    return [_as_array(flat[entry.key], entry.name, where) for entry in plan.variables]


def check_variables(
    plan: Plan,
    flat: dict[FlatKey, Any],
    where: str,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    dtypes: bool = False,
    hint: str | None = None,
) -> None:
    """Raises one `VariablesError` listing every mismatch between `flat` and `plan`.

    Args:
        plan: The model's plan.
        flat: Variables flattened by `flatten_variables` (arrays, or anything with ``shape``
            and, when `dtypes`, ``dtype``).
        where: Where the check happens, for messages.
        allow_missing: Whether the model may have variables that `flat` lacks.
        allow_unexpected: Whether `flat` may hold paths the model lacks. Shape mismatches are
            always errors.
        dtypes: Whether each leaf's dtype must be its variable's storage dtype (a file that
            is loaded must hold exactly what `init` makes; arguments to `apply` may be cast).
        hint: What to do about a mismatch (the default speaks of `init` and
            `assign_variables`).
    """
    problems = []
    missing = [] if allow_missing else [e.name for e in plan.variables if e.key not in flat]
    unexpected = [] if allow_unexpected else ["/".join(k) for k in flat if k not in plan.index]
    if missing:
        problems.append(f"missing ({len(missing)}): {format_list(missing)}")
    if unexpected:
        problems.append(f"unexpected ({len(unexpected)}): {format_list(unexpected)}")
    wrong = []
    stacked: tuple[int, ...] | None = None  # extra leading axes: a Stack's block, every copy
    for entry in plan.variables:
        if entry.key in flat:
            leaf = flat[entry.key]
            got = tuple(leaf.shape) if hasattr(leaf, "shape") else _shape_of(leaf)
            if got != entry.shape:
                wrong.append(f"{entry.name}: expected {entry.shape}, got {got}")
                lead = len(got) - len(entry.shape)
                if isinstance(got, tuple) and lead > 0 and got[lead:] == entry.shape:
                    stacked = got[:lead]
    if wrong:
        problems.append(f"wrong shape ({len(wrong)}): {format_list(wrong, limit=5)}")
    if dtypes:
        kinds = []
        for entry in plan.variables:
            if entry.key in flat:
                got, expected = flat[entry.key].dtype, np.dtype(entry.state.param_dtype)
                if not isinstance(got, np.dtype) or got != expected:
                    kinds.append(f"{entry.name}: expected {expected.name}, got {_name(got)}")
        if kinds:
            problems.append(f"wrong dtype ({len(kinds)}): {format_list(kinds, limit=5)}")
    if not problems:
        return
    model = type(plan.root).__name__
    if hint is None and stacked is not None and not missing and not unexpected:
        hint = (
            f"The arrays have the leading axes {stacked} in front of the shapes {model} "
            f"declares: that is how a Stack stores its block (every copy at once, as "
            f"take_variables(model, variables, stack.block) returns them). {model} alone runs "
            f"one copy: pass jax.tree.map(lambda a: a[i], variables) for copy i."
        )
    hint = hint or (
        "Pass the dict that init (or a previous apply) returned for this same model; after "
        "changing the model, run init again or carry weights over with lm.assign_variables."
    )
    collections = {entry.collection for entry in plan.variables}
    if unexpected and collections and not collections & {key[0] for key in flat}:
        hint = (
            f"The top-level keys should be collections ({', '.join(sorted(collections))}): "
            f"did you pass variables['params'] where {{'params': ...}} was expected?"
        )
    listed = "\n  ".join(problems)
    raise VariablesError(f"{where} got variables that do not match {model}:\n  {listed}\n{hint}")


def _name(dtype: Dtype) -> str:
    """A dtype's name (``bfloat16``), or what stands for one (a file's unknown type code)."""
    return getattr(dtype, "name", str(dtype))


def _shape_of(leaf: Any) -> tuple[int, ...] | str:
    if isinstance(leaf, (bool, int, float, complex)):
        return ()
    return f"{type(leaf).__name__} {leaf!r:.40}"


def _as_array(leaf: Any, name: str, where: str) -> Any:
    if isinstance(leaf, _ARRAYS):
        return leaf
    if isinstance(leaf, (bool, int, float, complex)):
        return jnp.asarray(leaf)
    hint = ""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        hint = (
            " It is a ShapeDtypeStruct (from jax.eval_shape), which describes an array "
            "without holding one: run init itself for values."
        )
    raise VariablesError(
        f"{where} got {type(leaf).__name__} {leaf!r:.60} at {name}; variables must be arrays "
        f"(or Python numbers).{hint}"
    )


def present_variables(plan: Plan, variables: Any, where: str) -> list[tuple[VariableEntry, Any]]:
    """The model's variables that `variables` holds, in the plan's order, with their arrays.

    `variables` may hold a subset of the model's variables (``{"params": params}`` alone, or
    one group of `split`); a path the model lacks, or a wrong shape, is an error.

    Args:
        plan: The model's plan.
        variables: ``{collection: nested dict}``, complete or not.
        where: The caller, for messages.

    Returns:
        ``(entry, array)`` pairs in the order of ``plan.variables``.
    """
    flat = flatten_variables(variables, f"{where}'s variables")
    check_variables(plan, flat, where, allow_missing=True)
    return [(entry, flat[entry.key]) for entry in plan.variables if entry.key in flat]
