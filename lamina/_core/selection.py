"""Grouping variables by filters: `split`, `merge`, `filter_variables`, `mask`.

All of them read the model's declarations through a `Plan` and return trees in the
variables' own layout (``{collection: nested dict}``). They are Python-side bookkeeping: under
`jax.jit` they run once, while tracing, and cost nothing per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import VariablesError
from .filters import Everything, Filter, Predicate, to_predicate
from .graph import Plan
from .layout import nest, present_variables
from .module import Module

Variables = dict[str, Any]


def _predicates(filters: tuple[Filter, ...], what: str) -> list[Predicate]:
    if not filters:
        raise ValueError(f"{what} needs at least one filter; use ... for all the variables.")
    predicates = [to_predicate(f) for f in filters]
    for position, predicate in enumerate(predicates[:-1]):
        if isinstance(predicate, Everything):
            raise ValueError(
                f"{what}: the filter at position {position} ({filters[position]!r}) takes "
                f"everything, so the {len(predicates) - position - 1} filter(s) after it would "
                f"get nothing; ... and True may only stand last."
            )
    return predicates


def _group(
    model: Module, variables: Any, filters: tuple[Filter, ...], what: str, exhaustive: bool
) -> tuple[Variables, ...]:
    predicates = _predicates(filters, what)
    groups: list[list] = [[] for _ in predicates]
    for entry, leaf in present_variables(Plan(model), variables, what):
        for group, predicate in zip(groups, predicates, strict=True):
            if predicate(entry.path, entry.state):
                group.append((entry.key, leaf))
                break
        else:
            if exhaustive:
                shown = ", ".join(map(repr, filters))
                raise ValueError(
                    f"{what}: no filter matches {entry.name} ({type(entry.state).__name__}). "
                    f"Add a filter for it, or end the filters with ... to take the rest: "
                    f"lm.{what}(model, variables, {shown}, ...)."
                )
    return tuple(nest(group) for group in groups)


def split(model: Module, variables: Variables, *filters: Filter) -> Any:
    """Splits `variables` into one tree per filter; the first filter that matches takes it.

    Order matters: put the specific filters first (``LoRAParam`` before ``Parameter``);
    ``...`` takes the rest and may only stand last. Each tree has the variables' own layout;
    a filter that matches nothing gives ``{}``. `merge` puts the trees back together.

    Args:
        model: The model the variables belong to (its declarations are what filters see).
        variables: Its variables, all of them or a subset (``{"params": ...}``).
        *filters: One or more filters (see `to_predicate`).

    Returns:
        One tree for one filter, else a tuple of trees.

    Raises:
        ValueError: A variable no filter matches (the message names it), no filters, or
            ``...`` before the last position.
        VariablesError: `variables` holds a path the model lacks, or a wrong shape.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.BatchNorm(3))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> params, rest = lm.split(model, variables, lm.Parameter, ...)
        >>> sorted(params), sorted(rest)
        (['params'], ['batch_stats'])
        >>> lm.merge(params, rest) == variables
        True
    """
    trees = _group(model, variables, filters, "split", exhaustive=True)
    return trees[0] if len(trees) == 1 else trees


def filter_variables(model: Module, variables: Variables, *filters: Filter) -> Any:
    """As `split`, but variables that no filter matches are left out instead of an error.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> kernels = lm.filter_variables(model, variables, lm.PathContains("kernel"))
        >>> sorted(kernels["params"]["layers_0"])
        ['kernel']
    """
    trees = _group(model, variables, filters, "filter_variables", exhaustive=False)
    return trees[0] if len(trees) == 1 else trees


def mask(model: Module, variables: Variables, filter: Filter) -> Variables:
    """A tree like `variables` with True where `filter` matches, for `optax.masked`.

    Args:
        model: The model the variables belong to.
        variables: Its variables, all of them or a subset.
        filter: Which variables are True.

    Returns:
        Booleans in the variables' layout.

    Example:
        >>> import jax, optax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> params = lm.transform(model).init(jax.random.key(0))
        >>> trainable = lm.mask(model, params, lm.PathContains("layers_1"))
        >>> trainable["params"]["layers_0"]["kernel"], trainable["params"]["layers_1"]["kernel"]
        (False, True)
        >>> optimizer = optax.masked(optax.adam(1e-3), trainable)  # only layers_1 trains
    """
    predicate = to_predicate(filter)
    return nest(
        (entry.key, bool(predicate(entry.path, entry.state)))
        for entry, _ in present_variables(Plan(model), variables, "mask")
    )


def merge(*trees: Variables) -> Variables:
    """Puts trees made by `split` (or any disjoint variables trees) back into one.

    Args:
        *trees: Trees in the variables layout; no leaf may appear in two of them.

    Returns:
        A new tree holding every leaf.

    Raises:
        VariablesError: Two trees hold the same path.
    """
    merged: Variables = {}
    for tree in trees:
        if not isinstance(tree, Mapping):
            raise VariablesError(f"merge takes variables trees (dicts), got {type(tree).__name__}.")
        _merge_into(merged, tree, ())
    return merged


def _merge_into(target: dict, tree: Mapping, prefix: tuple[str, ...]) -> None:
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            existing = target.setdefault(key, {})
            if not isinstance(existing, dict):
                raise VariablesError(
                    f"merge: {'/'.join(path)} is a leaf in one tree and a group in another."
                )
            _merge_into(existing, value, path)
        elif key in target:
            raise VariablesError(
                f"merge: {'/'.join(path)} is in more than one tree; the trees must be disjoint "
                f"(as split makes them)."
            )
        else:
            target[key] = value
