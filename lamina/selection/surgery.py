"""Model surgery by filter: `replace` submodules, `freeze` parameters.

Both edit a deep copy of the model (JAX arrays shared, as every lamina copy does) and return
it; the model given is left as it was. `replace` chooses *modules* (``where`` is a module
filter: a Module class, `PathContains` on the module's path, a function ``(path, module)``);
`freeze` chooses *variables* (``where`` is a variable filter, as `lm.split` takes).

`replace` keeps the model's sharing: an object reachable by two paths (a tied module) is
handed to ``fn`` once and its replacement is put at every path (`graph.substitute`, as
`lm.merge_lora` does). When one match holds another, the outermost wins: ``fn`` gets the outer
module and what it returns is not searched again (call `replace` once more for the inner
ones).
"""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Callable
from typing import Any

from .._core.checks import format_list, format_path
from .._core.graph import Plan, children, substitute, walk
from .._core.module import Module
from .._core.types import Path
from .._core.variables import FrozenParam, Parameter, State
from .filters import (
    Filter,
    OfType,
    PathContains,
    describe,
    module_predicate,
    to_predicate,
)
from .partition import describe_model, leaves, matches, nothing_selected, predicates_for


def replace(model: Module, fn: Callable[[Path, Module], Module], *, where: Filter) -> Module:
    """A copy of `model` in which every submodule `where` matches is replaced by ``fn(path, m)``.

    ``fn`` is called once per matched object, with its path (the first one, for an object
    reachable by several) and the module itself, taken from the copy: wrap it
    (``lm.LoRA(m, rank=4)``), or build a new module in its place. What it returns goes
    everywhere the old module was, so a tied module stays one object. When a match lies
    inside another (a `Dense` inside a matched block), the outermost one wins: ``fn`` sees the
    block alone, and what ``fn`` returns is not searched again; call `replace` again for the
    inner modules. A match for the root (``where=...`` matches every module, the root
    included) replaces the whole model: ``fn((), model)`` is what comes back.

    The new modules declare their variables as any module does: new ones (a LoRA's adapters)
    are initialized by ``init``, and a module that keeps the old one's variables (LoRA keeps
    its base under ``base``) keeps them, including values put in by `lm.assign_variables`.

    Args:
        model: The model to copy.
        fn: ``fn(path, module) -> Module``: the module to put in the matched one's place.
        where: Which modules to replace: a Module class (``lm.Dense``, subclasses too),
            ``lm.PathContains("encoder")`` (on the module's path), ``...`` (every module:
            the root), a function ``(path, module) -> bool``, or a tuple or
            ``lm.Any``/``lm.All``/``lm.Not`` of these. Keyword-only, required.

    Returns:
        The new model. `model` is unchanged.

    Raises:
        ValueError: `where` matches no module (the message lists what the model holds, the
            closest names, and a tied module that `where` would match at a later path), a
            matched module is held in a read-only setting of another (a `LoRA`'s ``base``:
            replace the LoRA instead), or the new model cannot be planned (an object put both
            inside and outside a `Stack`).
        TypeError: `model` is not a Module; `fn` is not callable, cannot be called as
            ``fn(path, module)`` (checked before any call; a Module class such as ``lm.LoRA``
            is refused, wrap it in a lambda), or returns something that is not a Module; or
            `where` selects variables rather than modules (a string or a `State` kind).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
        >>> lora = lm.replace(model, lambda path, m: lm.LoRA(m, rank=2), where=lm.Dense)
        >>> type(lora.layers_0).__name__, type(lora.layers_2).__name__, lora.layers_1 is lm.relu
        ('LoRA', 'LoRA', True)
        >>> type(model.layers_0).__name__  # the model given is unchanged
        'Dense'
        >>> variables = lm.transform(lora).init(jax.random.key(0))
        >>> sorted(variables["params"]["layers_0"])
        ['base', 'lora_a', 'lora_b']
    """
    _check_model(model, "replace")
    _check_fn(fn)
    predicate = module_predicate(where, "lm.replace")
    originals = {id(node): path for path, node, _ in walk(model)}
    result = copy.deepcopy(model)
    plan = Plan(result)
    found = [(path, m) for path, m in plan.modules if _module_matches(predicate, where, path, m)]
    if not found:
        raise ValueError(no_module_matched("lm.replace", plan, where, predicate))
    chosen = _outermost(found)
    replacements: dict[int, Module] = {}
    for path, module in chosen:
        try:
            new = fn(path, module)
        except Exception as error:
            error.add_note(
                f"(raised by lm.replace's fn, called as fn(path, module), on the "
                f"{type(module).__name__} at {format_path(path)})"
            )
            raise
        if not isinstance(new, Module):
            raise TypeError(
                f"lm.replace: fn returned {type(new).__name__} {new!r:.60} for the "
                f"{type(module).__name__} at {format_path(path)}; it must return an lm.Module "
                f"to put in its place (return the module itself to keep it)."
            )
        _check_not_original(new, originals, path, module)
        if new is not module:
            replacements[id(module)] = new
    if id(result) in replacements:
        result = replacements[id(result)]  # the root matched: nothing else can be chosen
    else:
        _check_settable(result, replacements, plan.module_paths(), where)
        substitute(result, replacements)
    try:
        Plan(result)
    except (ValueError, TypeError) as error:
        error.add_note("(raised planning the model that lm.replace built from fn's modules)")
        raise
    return result


def freeze(model: Module, *, where: Filter) -> Module:
    """A copy of `model` whose parameters `where` matches are `FrozenParam`s: not trained.

    A `FrozenParam` keeps the parameter's path, collection (``"params"``), shape, dtypes,
    initializer, sharding and tags (plus the tag ``"frozen"``), so the same variables and
    checkpoints fit the frozen model; but it is not a `Parameter`, so everything that selects
    ``lm.Parameter`` leaves it out: `lm.grad` and `lm.value_and_grad` by default, and an
    optimizer over ``lm.split(model, variables, lm.Parameter, ...)``. Their values are read
    through `jax.lax.stop_gradient`, so plain `jax.grad` over every variable gives them zero
    gradients; weight decay over the whole tree still shrinks them (mask it with
    ``lm.mask(model, variables, lm.Parameter)``). Subclasses of `Parameter` (`LoRAParam`)
    become plain `FrozenParam`s too, so ``lm.LoRAParam`` no longer matches them. Every filter
    but ``lm.Parameter`` and its kinds still matches frozen parameters (``"params"``,
    ``lm.Dense``, ``lm.PathContains(...)``): write ``lm.All(lm.Dense, lm.Parameter)`` to mean
    the trainable ones. A variable reached by several paths (tied) is matched at its first.

    Args:
        model: The model to copy.
        where: Which variables to freeze, a variable filter as `lm.split` takes: a module
            class (``lm.Dense``: the variables of every Dense), ``lm.PathContains(...)``,
            ``lm.Not(lm.LoRAParam)``, ``"params"``, ``...``. Matched variables that are not
            parameters (batch statistics, caches) are left as they are, and so are ones
            already frozen. Keyword-only, required.

    Returns:
        The new model. `model` is unchanged.

    Raises:
        ValueError: `where` selects no variable (the message lists what the model holds, the
            closest names, and a tied variable that `where` would match at a later path), or
            only variables that are not parameters.
        TypeError: `model` is not a Module, or `where` is not a filter.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> frozen = lm.freeze(model, where=lm.PathContains("layers_0"))
        >>> type(frozen.layers[0].kernel).__name__, type(frozen.layers[1].kernel).__name__
        ('FrozenParam', 'Parameter')
        >>> variables = lm.transform(frozen).init(jax.random.key(0))
        >>> trainable, rest = lm.split(frozen, variables, lm.Parameter, ...)
        >>> sorted(trainable["params"]), sorted(rest["params"])
        (['layers_1'], ['layers_0'])
    """
    _check_model(model, "freeze")
    result = copy.deepcopy(model)
    plan = Plan(result)
    (predicate,) = predicates_for(plan, (where,), "lm.freeze")
    selected = [entry for entry in plan.declared if matches(predicate, entry, where)]
    if not selected:
        message = nothing_selected("lm.freeze", [(None, where, predicate)], plan)
        raise ValueError(message + _tied_note(plan, predicate, modules=False))
    chosen = [entry for entry in selected if isinstance(entry.state, Parameter)]
    already = [entry for entry in selected if isinstance(entry.state, FrozenParam)]
    if not chosen and not already:
        shown = format_list(f"{entry.name} ({type(entry.state).__name__})" for entry in selected)
        raise ValueError(
            f"lm.freeze: the filter {describe(where)} selects no parameter, only {shown}. "
            f"freeze turns trainable parameters (lm.Parameter and its kinds) into "
            f"lm.FrozenParam; other variables are never trained by lm.grad. Choose a filter "
            f"that selects parameters, e.g. lm.PathContains('encoder') or lm.Dense."
        )
    for entry in chosen:
        _make_frozen(entry.state, entry.name)
    return result


def _make_frozen(state: State, name: str) -> None:
    """Turns a `Parameter` into a `FrozenParam` in place, keeping every attribute."""
    try:
        state.__class__ = FrozenParam
    except TypeError:  # a subclass with __slots__: another memory layout
        raise TypeError(
            f"lm.freeze cannot freeze the {type(state).__name__} at {name}: its class "
            f"defines __slots__, so it cannot become an lm.FrozenParam in place. Leave it out "
            f"of where, or give the class no __slots__."
        ) from None
    if "frozen" not in state.tags:
        state.tags = (*state.tags, "frozen")


def _check_model(model: Any, what: str) -> None:
    if not isinstance(model, Module):
        raise TypeError(
            f"lm.{what} takes an lm.Module (the model definition) first, got "
            f"{type(model).__name__}; pass the model, not its variables or a transformed "
            f"function."
        )


def _check_fn(fn: Any) -> None:
    """Refuses an `fn` that cannot be called as ``fn(path, module)``, before any call."""
    example = "lm.replace(model, lambda path, m: lm.LoRA(m, rank=4), where=lm.Dense)"
    if not callable(fn):
        raise TypeError(
            f"lm.replace takes fn(path, module) -> Module as its second argument, got "
            f"{type(fn).__name__}: {example}."
        )
    if isinstance(fn, type) and issubclass(fn, Module):
        raise TypeError(
            f"lm.replace: fn is called as fn(path, module), so the Module class "
            f"{_class_name(fn)} would be built as {fn.__name__}(path, module), with the path "
            f"first. Pass a function that builds it from the module: {example}."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: calling it will tell
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"lm.replace: fn is called as fn(path, module) (the module's path, a tuple of keys, "
            f"and the module), but the fn given takes {signature}. For example {example}."
        ) from None


def _check_not_original(
    new: Module, originals: dict[int, Path], path: Path, module: Module
) -> None:
    """Refuses a new module that holds an object of the model given (not of its copy)."""
    for inner, node, _ in walk(new):
        if id(node) in originals:
            held = "is" if node is new else f"holds, at {format_path(inner)},"
            raise ValueError(
                f"lm.replace: fn's result for the {type(module).__name__} at "
                f"{format_path(path)} {held} the {type(node).__name__} at "
                f"{format_path(originals[id(node)])} of the model given. lm.replace edits a "
                f"copy and leaves the model given untouched, so the new model cannot share its "
                f"objects (a tie to it would silently be a tie to nothing). Build the new "
                f"module from fn's second argument (the copy's module), or from new objects."
            )


def _module_matches(predicate: Callable, where: Filter, path: Path, module: Module) -> bool:
    try:
        return bool(predicate(path, module))
    except Exception as error:
        error.add_note(
            f"(raised by the filter {describe(where)} on the {type(module).__name__} at "
            f"{format_path(path)})"
        )
        raise


def _outermost(found: list[tuple[Path, Module]]) -> list[tuple[Path, Module]]:
    """The matches that no other match holds (by reachability, so ties count)."""
    inside: set[int] = set()
    for _, module in found:
        inside.update(id(node) for _, node, _ in walk(module) if node is not module)
    chosen = [(path, module) for path, module in found if id(module) not in inside]
    return chosen or found[:1]  # modules that hold each other: the first in walk order


def _check_settable(
    root: Module, replacements: dict[int, Module], paths: dict[int, Path], where: Filter
) -> None:
    """Refuses a replacement that a read-only setting (`LoRA.base`) would have to take."""
    seen: set[int] = set()
    pending: list[Any] = [root]
    while pending:
        node = pending.pop()
        if id(node) in seen or id(node) in replacements:
            continue
        seen.add(id(node))
        for key, child in children(node):
            if not isinstance(child, (Module, list, tuple, dict)):
                continue
            pending.append(child)
            if not isinstance(node, Module) or not _read_only(type(node), str(key)):
                continue
            held = _replaced_in(child, replacements)
            if held is not None:
                holder = format_path(paths[id(node)])
                raise ValueError(
                    f"lm.replace: the {type(held).__name__} at {format_path(paths[id(held)])} "
                    f"is held in the read-only setting {type(node).__name__}.{key} of the "
                    f"{type(node).__name__} at {holder}, which was built around it (its "
                    f"variables and checks depend on it), so it cannot be swapped inside. "
                    f"Replace the {type(node).__name__} itself (where= matching it, and fn "
                    f"building a new one from its .{key}), or leave it out of where "
                    f"(where=lm.All({describe(where)}, lm.Not(lm.PathContains({str(key)!r}))))."
                )


def _read_only(cls: type, name: str) -> bool:
    """Whether the class defines `name` as a data descriptor (a layer's `Setting`)."""
    attribute = inspect.getattr_static(cls, name, None)
    return hasattr(type(attribute), "__set__")


def _replaced_in(value: Any, replacements: dict[int, Module]) -> Module | None:
    """The replaced module `value` is, or holds in its lists, tuples and dicts (not deeper)."""
    if id(value) in replacements:
        return value
    if isinstance(value, (list, tuple, dict)):
        for _, item in children(value):
            found = _replaced_in(item, replacements)
            if found is not None:
                return found
    return None


def no_module_matched(what: str, plan: Plan, where: Filter, predicate: Callable) -> str:
    """The message for a module filter (`lm.replace`, `lm.with_policy`) that matches nothing.

    Args:
        what: The caller, as messages name it (``"lm.replace"``).
        plan: The model's plan.
        where: The filter as given.
        predicate: ``module_predicate(where, what)``.

    Returns:
        What happened, what the model holds, the closest names, and, when the filter would
        match a tied module at another of its paths, that it is matched at its first path.
    """
    model = type(plan.root).__name__
    shown = format_list(
        f"{format_path(path) if path else '<root>'} ({type(module).__name__})"
        for path, module in plan.modules
    )
    lines = [
        f"{what}: the filter {describe(where)} matches no module of {model}.",
        describe_model(plan),
        f"Its modules: {shown}.",
    ]
    hints = list(dict.fromkeys(_module_hints(to_predicate(where), plan, what)))
    if hints:
        lines.append("Did you mean " + " or ".join(hints) + "?")
    else:
        lines.append(
            "Choose a filter that matches modules: a module class (lm.Dense), "
            "lm.PathContains('name') on a module's path, ... for every module, or a function "
            "(path, module) -> bool."
        )
    return "\n  ".join(lines) + _tied_note(plan, predicate, modules=True)


def _module_hints(predicate: Any, plan: Plan, what: str) -> list[str]:
    """Module types and path parts of the model that the filter's classes and keys resemble."""
    types = {type(module).__name__: type(module) for _, module in plan.modules}
    parts = sorted({str(key) for path, _ in plan.modules for key in path})
    variables = {str(entry.path[-1]) for entry in plan.variables}
    hints = []
    for leaf in leaves(predicate):
        if isinstance(leaf, OfType) and issubclass(leaf.type, Module):
            wanted = leaf.type.__name__
            close = difflib.get_close_matches(wanted, list(types), n=3, cutoff=0.5)
            close += [name for name in types if wanted in name or name in wanted]
            hints += [_class_name(types[name]) for name in dict.fromkeys(close)]
        elif isinstance(leaf, PathContains) and leaf.exact:
            keys = leaf.key.split("/")
            if keys[-1] in variables and keys[-1] not in parts:
                # a variable's name: the module holding it is what replace can choose
                rest = "/".join(keys[:-1])
                hints.append(
                    (
                        f"lm.PathContains({rest!r})"
                        if rest and all(part in parts for part in keys[:-1])
                        else "a module class"
                    )
                    + f" ({keys[-1]!r} names a variable; {what} chooses modules)"
                )
                continue
            for part in keys:
                if part not in parts:
                    close = difflib.get_close_matches(part, parts, n=2)
                    hints += [f"lm.PathContains({leaf.key.replace(part, c)!r})" for c in close]
    return hints


def _class_name(cls: type) -> str:
    return f"lm.{cls.__name__}" if cls.__module__.startswith("lamina") else cls.__name__


def _tied_note(plan: Plan, predicate: Callable, *, modules: bool) -> str:
    """For a filter that matched nothing: the tied objects it would match at another path.

    A module (or variable) reachable by several paths is matched at its first one only, so
    ``PathContains("decoder")`` misses a ``decoder`` that is the ``encoder``.
    """
    objects: dict[int, Module | State]
    if modules:
        first = dict(plan.module_paths())
        objects = {id(module): module for _, module in plan.modules}
    else:
        first = {id(entry.state): entry.path for entry in plan.declared}
        objects = {id(entry.state): entry.state for entry in plan.declared}
    every = _every_path(plan.root)
    owner = {path: key for key, paths in every.items() for path in paths}
    for key, paths in every.items():
        if key not in first:
            continue
        node = objects[key]
        for path in paths:
            if path == first[key]:
                continue
            try:
                hit = predicate(path, node)
            except Exception:
                continue  # a filter that cannot judge this path: no hint from it
            if hit:
                alias, at = path, first[key]
                while (  # name the tied module that holds it, if one is tied
                    len(alias) > 1
                    and alias[-1] == at[-1]
                    and owner.get(alias[:-1]) == owner.get(at[:-1])
                ):
                    alias, at = alias[:-1], at[:-1]
                kind = "module" if modules else "variable"
                return (
                    f"\n  {format_path(alias)!r} is the same object as {format_path(at)!r} "
                    f"(tied): a {kind} reached by several paths is matched at its first path "
                    f"only ({format_path(first[key])}, not {format_path(path)}). Match it there: "
                    f"lm.PathContains({format_path(at)!r})"
                    + (", or by its class." if modules else ".")
                )
    return ""


def _every_path(root: Any, limit: int = 10_000) -> dict[int, list[Path]]:
    """``{id: paths}``: every path to each Module and State under `root` (`limit` in all)."""
    found: dict[int, list[Path]] = {}
    count = 0
    pending: list[tuple[Path, Any, frozenset[int]]] = [((), root, frozenset())]
    while pending and count < limit:
        path, node, above = pending.pop()
        if isinstance(node, (Module, State)):
            found.setdefault(id(node), []).append(path)
            count += 1
        if id(node) in above:
            continue  # a cycle
        inner = above | {id(node)}
        for key, child in reversed(list(children(node))):
            if isinstance(child, (Module, State, list, tuple, dict)):
                pending.append(((*path, key), child, inner))
    return found
