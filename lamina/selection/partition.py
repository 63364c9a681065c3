"""Grouping variables by filters: `split`, `merge`, `filter_variables`, `mask`.

All of them read the model's declarations through a `Plan` and return trees in the
variables' own layout (``{collection: nested dict}``). They are Python-side bookkeeping: under
`jax.jit` they run once, while tracing, and cost nothing per step.

A filter that selects nothing is almost always a mistake (``"param"`` for ``"params"``), and
a silent one: the optimizer trains nothing. So:

- `mask`, `grad`'s `DiffState` and a one-filter `filter_variables` that select nothing raise,
  naming the filter, what the model holds and the closest names.
- `split` and `filter_variables` with several filters allow a filter that matches nothing
  (generic code may ask for ``"batch_stats"`` of a model without them), unless every filter
  other than ``...``/``True`` (take the rest) and ``None``/``False`` (take nothing) matches
  nothing, or the filter looks like a typo (a name close to one the model has), or it does
  match variables but the filters before it took them all (put the specific filter first).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._core.checks import format_list
from .._core.errors import VariablesError
from .._core.graph import Plan, VariableEntry
from .._core.layout import nest, present_variables
from .._core.module import Module
from .._core.types import Variables
from .._core.variables import FrozenParam, Parameter
from .filters import (
    All,
    Everything,
    Filter,
    Not,
    Nothing,
    OfType,
    PathContains,
    Predicate,
    WithTag,
    describe,
    to_predicate,
)
from .filters import Any as AnyOf


def plan_for(model: Module, variables: Any, what: str) -> Plan:
    """The plan of `model`; says so when the model and its variables were swapped."""
    if isinstance(model, Mapping) and isinstance(variables, Module):
        raise TypeError(
            f"{what} takes the model first and its variables second: "
            f"lm.{what}(model, variables, ...); got a {type(model).__name__} and a "
            f"{type(variables).__name__}."
        )
    return Plan(model)


def predicates_for(plan: Plan, filters: Sequence[Filter], what: str) -> list[Predicate]:
    """Converts and resolves `filters` against `plan`; ``...`` may only stand last."""
    if not filters:
        raise ValueError(f"{what} needs at least one filter; use ... for all the variables.")
    predicates = []
    for position, filter in enumerate(filters):
        try:
            predicates.append(to_predicate(filter, plan))
        except TypeError as error:
            where = f" the filter at position {position}:" if len(filters) > 1 else ""
            raise TypeError(f"{what}:{where} {error}") from None
    for position, predicate in enumerate(predicates[:-1]):
        if isinstance(predicate, Everything):
            raise ValueError(
                f"{what}: the filter at position {position} ({describe(filters[position])}) "
                f"takes everything, so the {len(predicates) - position - 1} filter(s) after it "
                f"would get nothing; ... and True may only stand last."
            )
    return predicates


def matches(predicate: Predicate, entry: VariableEntry, filter: Filter) -> bool:
    """``predicate(entry.path, entry.state)``; an error inside it is told which variable."""
    try:
        return bool(predicate(entry.path, entry.state))
    except Exception as error:
        error.add_note(f"(raised by the filter {describe(filter)} on the variable {entry.name})")
        raise


def _group(
    model: Module, variables: Any, filters: tuple[Filter, ...], what: str, exhaustive: bool
) -> tuple[Variables, ...]:
    plan = plan_for(model, variables, what)
    predicates = predicates_for(plan, filters, what)
    present = present_variables(plan, variables, what)
    groups: list[list] = [[] for _ in predicates]
    taken_by: list[int | None] = []
    for entry, leaf in present:
        for position, predicate in enumerate(predicates):
            if matches(predicate, entry, filters[position]):
                groups[position].append((entry.key, leaf))
                taken_by.append(position)
                break
        else:
            taken_by.append(None)
    _check_groups(plan, present, filters, predicates, groups, what)
    if exhaustive and None in taken_by:
        unmatched = [
            f"{e.name} ({type(e.state).__name__})"
            for (e, _), t in zip(present, taken_by, strict=True)
            if t is None
        ]
        shown = ", ".join(map(describe, filters))
        raise ValueError(
            f"{what}: no filter matches {len(unmatched)} variable(s): {format_list(unmatched)}. "
            f"Add a filter for them, or end the filters with ... to take the rest: "
            f"lm.{what}(model, variables, {shown}, ...)."
        )
    return tuple(nest(group) for group in groups)


def _check_groups(
    plan: Plan,
    present: list[tuple[VariableEntry, Any]],
    filters: Sequence[Filter],
    predicates: list[Predicate],
    groups: list[list],
    what: str,
) -> None:
    considered = [i for i, p in enumerate(predicates) if not isinstance(p, (Everything, Nothing))]
    empty = [i for i in considered if not groups[i]]
    for position in empty:
        wanted = [e for e, _ in present if matches(predicates[position], e, filters[position])]
        if wanted:
            takers = sorted({_first_match(predicates, filters, e) for e in wanted})
            first = takers[0]
            if predicates[first] == predicates[position]:
                raise ValueError(
                    f"{what}: the filter at position {position} ({describe(filters[position])}) "
                    f"repeats the one at position {first}, which takes all its variables; "
                    f"remove one of them."
                )
            order = [*filters[:first], filters[position], *filters[first:position]]
            order += filters[position + 1 :]
            raise ValueError(
                f"{what}: the filter at position {position} ({describe(filters[position])}) "
                f"gets no variable: all it matches ({format_list(e.name for e in wanted)}) "
                f"is taken by the filter(s) before it ("
                + ", ".join(f"position {t}: {describe(filters[t])}" for t in takers)
                + "), because the first filter that matches a variable takes it. Put the more "
                f"specific filter first: lm.{what}(model, variables, "
                f"{', '.join(map(describe, order))})."
            )

    def selector(i: int) -> tuple[int | None, Filter, Predicate]:
        return (i if len(filters) > 1 else None), filters[i], predicates[i]

    if not present:
        return  # nothing given: no filter can be shown wrong
    if considered and len(empty) == len(considered):
        raise ValueError(nothing_selected(what, [selector(i) for i in empty], plan, present))
    for position in empty:
        if _suggestions(predicates[position], plan):
            raise ValueError(nothing_selected(what, [selector(position)], plan, present))


def _first_match(
    predicates: list[Predicate], filters: Sequence[Filter], entry: VariableEntry
) -> int:
    return next(i for i, p in enumerate(predicates) if matches(p, entry, filters[i]))


def nothing_selected(
    what: str,
    selectors: list[tuple[int | None, Filter, Predicate]],
    plan: Plan,
    present: Sequence[tuple[VariableEntry, Any]] | None = None,
) -> str:
    """The message for filters that select none of the variables.

    Args:
        what: The caller, as messages name it (``"mask"``, ``"lm.grad"``).
        selectors: ``(position or None, filter as given, resolved predicate)`` for each filter
            that selected nothing.
        plan: The model's plan.
        present: The variables that were given (``(entry, leaf)`` pairs); None: all of them.

    Returns:
        What happened, what the model holds, the closest names and what to do.
    """
    model = type(plan.root).__name__
    subset = present is not None and len(present) < len(plan.variables)
    shown = ", ".join(
        describe(f) + ("" if position is None else f" (position {position})")
        for position, f, _ in selectors
    )
    if len(selectors) == 1:
        where = "none of the variables given" if subset else f"no variable of {model}"
        lines = [f"{what}: the filter {shown} selects {where}."]
    else:
        where = "any of the variables given" if subset else f"any variable of {model}"
        lines = [f"{what}: none of the filters {shown} selects {where}."]
    if subset:
        assert present is not None
        given = sorted({entry.collection for entry, _ in present})
        elsewhere = [
            e.name for e in plan.variables if any(matches(p, e, f) for _, f, p in selectors)
        ]
        lines[0] = lines[0][:-1] + f" (collections given: {', '.join(given) or 'none'})."
        if elsewhere:
            lines.append(
                f"In {model} it selects {format_list(elsewhere)}, which the variables passed "
                f"do not hold: pass those too, or choose a filter for the variables given."
            )
    else:
        elsewhere = []
    lines.append(describe_model(plan))
    hints = [hint for _, _, p in selectors for hint in _suggestions(p, plan)]
    frozen = _frozen_note([p for _, _, p in selectors], plan)
    if hints:
        lines.append("Did you mean " + " or ".join(dict.fromkeys(hints)) + "?")
    if frozen:
        lines.append(frozen)
    elif not hints and not elsewhere:
        lines.append(
            "Choose a filter that selects something: a collection ('params'), a variable "
            "type (lm.Parameter), a module class (lm.Dense) or lm.PathContains('name')."
        )
    return "\n  ".join(lines)


def _frozen_note(predicates: list[Predicate], plan: Plan) -> str | None:
    """What to say when a filter for trainable parameters meets frozen ones (`lm.freeze`)."""
    wants_trainable = any(
        isinstance(leaf, OfType) and issubclass(leaf.type, Parameter)
        for predicate in predicates
        for leaf in leaves(predicate)
    )
    frozen = [entry.name for entry in plan.declared if isinstance(entry.state, FrozenParam)]
    if not wants_trainable or not frozen:
        return None
    which = "parameter" if len(frozen) == 1 else "parameters"
    verb = "is an" if len(frozen) == 1 else "are"
    return (
        f"The {which} {format_list(frozen)} {verb} lm.FrozenParam (made by lm.freeze, kept by "
        f"lm.merge_lora): not lm.Parameter, so nothing trains them, and selecting them anyway "
        f"('params') gives zero gradients. To train them, use the model as it was before "
        f"lm.freeze (after lm.merge_lora: before lm.replace, whose paths the merged variables "
        f"have) holding these values: lm.assign_variables(unfrozen_model, variables)."
    )


def describe_model(plan: Plan) -> str:
    """One line saying what a model holds: collections, tags, variable and module types."""
    model = type(plan.root).__name__
    if not plan.variables:
        return f"{model} has no variables."
    counts: dict[str, int] = {}
    for entry in plan.variables:
        counts[entry.collection] = counts.get(entry.collection, 0) + 1
    tags = sorted({tag for entry in plan.variables for tag in entry.state.tags})
    kinds = dict.fromkeys(type(entry.state).__name__ for entry in plan.declared)
    modules = dict.fromkeys(type(module).__name__ for _, module in plan.modules)
    return (
        f"{model} holds collections "
        + ", ".join(f"{name} ({n})" for name, n in counts.items())
        + (f"; tags {', '.join(tags)}" if tags else "; no tags")
        + f"; variable types {', '.join(kinds)}; module types {', '.join(modules)}."
    )


def leaves(predicate: Predicate) -> Iterable[Predicate]:
    """The filters a combined filter (`Any`, `All`, `Not`) is made of, innermost, in order."""
    if isinstance(predicate, (AnyOf, All)):
        for part in predicate.filters:
            yield from leaves(part)
    elif isinstance(predicate, Not):
        yield from leaves(predicate.filter)
    else:
        yield predicate


def _suggestions(predicate: Predicate, plan: Plan) -> list[str]:
    """Names the model has that the filter's strings and keys look like typos of."""
    names = sorted(
        {e.collection for e in plan.variables} | {t for e in plan.variables for t in e.state.tags}
    )
    parts = sorted({str(k) for e in plan.variables for k in e.path})
    hints = []
    for leaf in leaves(predicate):
        if isinstance(leaf, WithTag) and leaf.tag not in names:
            hints += [repr(name) for name in difflib.get_close_matches(leaf.tag, names, n=2)]
            key = leaf.tag.split("/", 1)[1] if leaf.tag.split("/")[0] in names else leaf.tag
            if key and all(part in parts for part in key.split("/")):
                hints.append(f"lm.PathContains({key!r}) (a string filter is a collection or tag)")
        elif isinstance(leaf, PathContains) and leaf.exact:
            first, _, rest = leaf.key.partition("/")
            if first in names and first not in parts:
                hints.append(
                    f"{first!r} (paths in filters start below the collection"
                    + (f"; lm.PathContains({rest!r}) for the path" if rest else "")
                    + ")"
                )
            else:
                for part in leaf.key.split("/"):
                    if part not in parts:
                        close = difflib.get_close_matches(part, parts, n=2)
                        hints += [f"lm.PathContains({leaf.key.replace(part, c)!r})" for c in close]
    return hints


def split(model: Module, variables: Variables, *filters: Filter) -> Any:
    """Splits `variables` into one tree per filter; the first filter that matches takes it.

    Order matters: put the specific filters first (``LoRAParam`` before ``Parameter``);
    ``...`` takes the rest and may only stand last. Each tree has the variables' own layout.
    A filter that matches nothing gives ``{}`` (generic code may ask for a collection that a
    model lacks), except where that is surely a mistake: every filter but the catch-all
    matches nothing, a string close to a name the model has (a typo), or a filter whose
    variables the filters before it all took (wrong order). `merge` puts the trees back
    together.

    Args:
        model: The model the variables belong to (its declarations are what filters see).
        variables: Its variables, all of them or a subset (``{"params": ...}``).
        *filters: One or more filters (see `to_predicate`).

    Returns:
        One tree for one filter, else a tuple of trees.

    Raises:
        ValueError: Variables no filter matches (the message names them), a filter that
            selects nothing where that is a mistake (see above), no filters, or ``...``
            before the last position.
        TypeError: A filter that is not one; the message says which.
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
        >>> lm.split(model, variables, "param", ...)
        Traceback (most recent call last):
        ...
        ValueError: split: the filter 'param' (position 0) selects no variable of Sequential.
          Sequential holds collections batch_stats (2), params (4); ...
          Did you mean 'params'?
    """
    trees = _group(model, variables, filters, "split", exhaustive=True)
    return trees[0] if len(trees) == 1 else trees


def filter_variables(model: Module, variables: Variables, *filters: Filter) -> Any:
    """As `split`, but variables that no filter matches are left out instead of an error.

    A filter that selects nothing is an error as in `split`; with one filter, that is
    whenever it selects nothing (except ``None``/``False``).

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> kernels = lm.filter_variables(model, variables, lm.PathContains("kernel"))
        >>> sorted(kernels["params"]["layers_0"])
        ['kernel']
        >>> sorted(lm.filter_variables(model, variables, lm.PathContains("layers_1"))["params"])
        ['layers_1']
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

    Raises:
        ValueError: `filter` selects none of the variables (all False is never what an
            optimizer mask means); the message lists what the model holds.

    Example:
        >>> import jax, optax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> params = lm.transform(model).init(jax.random.key(0))
        >>> trainable = lm.mask(model, params, lm.PathContains("layers_1"))
        >>> trainable["params"]["layers_0"]["kernel"], trainable["params"]["layers_1"]["kernel"]
        (False, True)
        >>> optimizer = optax.masked(optax.adam(1e-3), trainable)  # only layers_1 trains
    """
    plan = plan_for(model, variables, "mask")
    (predicate,) = predicates_for(plan, (filter,), "mask")
    present = present_variables(plan, variables, "mask")
    flags = [(entry, matches(predicate, entry, filter)) for entry, _ in present]
    wrong = present and not any(flag for _, flag in flags)
    if wrong and not isinstance(predicate, (Everything, Nothing)):
        raise ValueError(nothing_selected("mask", [(None, filter, predicate)], plan, present))
    return nest((entry.key, flag) for entry, flag in flags)


def merge(*trees: Variables) -> Variables:
    """Puts trees made by `split` (or any disjoint variables trees) back into one.

    Args:
        *trees: Trees in the variables layout; no leaf may appear in two of them.

    Returns:
        A new tree holding every leaf.

    Raises:
        VariablesError: Two trees hold the same path.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Dense(2, 3)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> kernels, rest = lm.split(model, variables, lm.PathContains("kernel"), ...)
        >>> sorted(lm.merge(kernels, rest)["params"])
        ['bias', 'kernel']
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
