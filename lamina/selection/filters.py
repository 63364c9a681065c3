"""Filters: predicates ``(path, variable) -> bool`` over a model's variable declarations.

Flax NNX's filter DSL, applied to lamina's declarations. A filter sees the path from the model
root (attribute names and dict keys as ``str``, list indices as ``int``) and the declaration
object (`State` or a subclass). `to_predicate` turns the literals users write into callables:

=================  =====================  ==============================================
literal            callable               matches
=================  =====================  ==============================================
``"name"``         ``WithTag("name")``    the collection ``"name"``, or a tag ``"name"``
a `State` kind     ``OfType(type)``       instances of the type (subclasses too)
a `Module` class   ``OfType(type)``       the variables reachable from such a module
``True``, ``...``  ``Everything()``       every variable
``False``, None    ``Nothing()``          no variable
(a, b), [a, b]     ``Any(a, b)``          what any of them matches
=================  =====================  ==============================================

``PathContains(key)``, ``All(*filters)`` and ``Not(filter)`` complete the set. Filters compare
equal and hash by value, so they can be dict keys.

A module-class filter (``lm.Dense``) depends on the model, not on one declaration: `split`,
`filter_variables`, `mask` and `grad` resolve it against the model's plan first
(``to_predicate(filter, plan)``), which turns it into the set of variables reachable from the
modules of that type, tied variables included.

Example:
    >>> import lamina as lm
    >>> lm.to_predicate((lm.Parameter, "batch_stats"))
    Any(OfType(Parameter), WithTag('batch_stats'))
    >>> lm.to_predicate(...) == lm.Everything()
    True
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, cast
from typing import Any as AnyType

from .._core.module import Module
from .._core.types import Path
from .._core.variables import State

if TYPE_CHECKING:
    from .._core.graph import Plan

Predicate = Callable[[Path, State], bool]
Filter = AnyType  # a predicate or a literal that `to_predicate` converts

_LITERALS = (
    "a string (a collection or tag: 'params'), a variable type (lm.Parameter), a module class "
    "(lm.Dense), True or ... (everything), False or None (nothing), a function "
    "(path, variable) -> bool, or a tuple/list of these"
)


def to_predicate(filter: Filter, plan: Plan | None = None) -> Predicate:
    """Converts a filter literal into a predicate ``(path, variable) -> bool``.

    Args:
        filter: A string (tag or collection), a `State` kind or `Module` class,
            True/``...``, False/None, a function ``(path, variable) -> bool``, or a
            tuple/list of filters.
        plan: The model's plan. Module-class filters need it: with it, they match the
            variables reachable from the model's modules of that class; without it, calling
            them is an error.

    Returns:
        The predicate.

    Raises:
        TypeError: `filter` is none of these, or a function that cannot be called as
            ``filter(path, variable)``; the message shows it (and, inside a tuple, where).

    Example:
        >>> import lamina as lm
        >>> lm.to_predicate("params")
        WithTag('params')
        >>> lm.to_predicate(lambda v: True)
        Traceback (most recent call last):
        ...
        TypeError: the filter function <lambda> ... takes (v); a filter is called as ...
    """
    predicate = _convert(filter)
    return predicate if plan is None else resolve(predicate, plan)


def _convert(filter: Filter) -> Predicate:
    if isinstance(filter, _FILTER_CLASSES):
        return filter
    if isinstance(filter, str):
        return WithTag(filter)
    if isinstance(filter, type):
        return OfType(filter)
    if filter is True or filter is Ellipsis:
        return Everything()
    if filter is False or filter is None:
        return Nothing()
    if isinstance(filter, (tuple, list)):
        return Any(*filter)
    if isinstance(filter, (Module, State)):
        kind = type(filter).__name__
        raise TypeError(
            f"a {kind} object is not a filter: filters describe variables by type, collection "
            f"or path. Use its class (lm.{kind}, or {kind}) for every such "
            f"{'module' if isinstance(filter, Module) else 'variable'}, or lm.PathContains("
            f"'name') for the one under that attribute."
        )
    if callable(filter):
        _check_arity(filter)
        return cast(Predicate, filter)
    raise TypeError(
        f"{filter!r} ({type(filter).__name__}) is not a filter. A filter is {_LITERALS}."
    )


def _check_arity(function: Callable) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: calling it will tell
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"the filter function {describe(function)} takes {signature}; a filter is called as "
            f"filter(path, variable) with the path (a tuple of keys) and the declaration, e.g. "
            f"lambda path, variable: 'kernel' in path."
        ) from None


def describe(filter: Filter) -> str:
    """How messages show a filter: literals as written, functions by name and place."""
    if isinstance(filter, type):
        return filter.__name__
    if filter is Ellipsis:
        return "..."
    if isinstance(filter, (tuple, list)):
        inner = ", ".join(map(describe, filter))
        return (
            f"({inner}{',' if len(filter) == 1 else ''})"
            if isinstance(filter, tuple)
            else f"[{inner}]"
        )
    code = getattr(filter, "__code__", None)
    if code is not None and not isinstance(filter, _FILTER_CLASSES):
        name = getattr(filter, "__qualname__", "<function>").rsplit(".", 1)[-1]
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    return repr(filter)


def _convert_all(filters: tuple[Filter, ...], combinator: str) -> tuple[Predicate, ...]:
    predicates = []
    for position, filter in enumerate(filters):
        try:
            predicates.append(_convert(filter))
        except TypeError as error:
            raise TypeError(f"{combinator}(...), item {position}: {error}") from None
    return tuple(predicates)


def resolve(predicate: Predicate, plan: Plan) -> Predicate:
    """Resolves the module-class filters inside `predicate` against `plan` (see `OfType`).

    Args:
        predicate: A predicate from `to_predicate`.
        plan: The plan of the model whose variables will be matched.

    Returns:
        An equivalent predicate that needs no plan; user functions are returned as they are.
    """
    if isinstance(predicate, _Combinator):
        return predicate._resolve(plan)
    if isinstance(predicate, OfType) and not isinstance(predicate, _ResolvedOfType):
        return _ResolvedOfType(predicate.type, _paths_reachable_from(plan, predicate.type))
    return predicate


def _paths_reachable_from(plan: Plan, module_type: type) -> frozenset[Path]:
    """The paths of the variables reachable from the plan's modules that are `module_type`s."""
    owners = [module for _, module in plan.modules if isinstance(module, module_type)]
    return frozenset(plan.variables[slot].path for owner in owners for slot in plan.slots_of(owner))


ModulePredicate = Callable[[Path, Module], bool]


_MODULE_LITERALS = (
    "A module filter is a Module class (lm.Dense), lm.PathContains('name'), True or ... (every "
    "module), False or None (none), a function (path, module) -> bool, or a tuple/list or "
    "lm.Any/lm.All/lm.Not of these."
)


def module_predicate(filter: Filter, what: str) -> ModulePredicate:
    """Converts a filter into a predicate ``(path, module) -> bool`` over a model's modules.

    For the functions that choose modules, not variables (`lm.replace`, `lm.with_policy`,
    `lm.capture_intermediates`): a `Module` class matches its instances (subclasses too), a
    `PathContains` the modules whose path holds the key (the same text rule as for
    variables), ``...``/True every module, False/None none, ``Any``/``All``/``Not`` and
    tuples combine, and a function is called as ``fn(path, module)``.

    Args:
        filter: The filter.
        what: The caller, as messages name it (``"lm.replace"``).

    Returns:
        The predicate.

    Raises:
        TypeError: The filter selects variables, not modules (a string, a `State` kind, or
            ``lm.WithTag``), or is not a filter; the message says what to write instead.

    Example:
        >>> import lamina as lm
        >>> from lamina.selection.filters import module_predicate
        >>> is_dense = module_predicate((lm.Dense, lm.PathContains("head")), "example")
        >>> is_dense(("body",), lm.Dense(2, 3)), is_dense(("head",), lm.LayerNorm(3))
        (True, True)
    """
    try:
        predicate = _convert(filter)
    except TypeError as error:
        message = (
            str(error)
            .replace("filter(path, variable)", "fn(path, module)")
            .replace(
                "and the declaration, e.g. lambda path, variable: 'kernel' in path",
                "and the module, e.g. lambda path, module: 'encoder' in path",
            )
        )
        raise TypeError(f"{what}: {message.split(' A filter is ')[0]} {_MODULE_LITERALS}") from None
    return _for_modules(predicate, what)


def _for_modules(predicate: Predicate, what: str) -> ModulePredicate:
    if isinstance(predicate, (Everything, Nothing)):
        answer = isinstance(predicate, Everything)
        return lambda path, module: answer
    if isinstance(predicate, PathContains):
        return lambda path, module: predicate(path, None)  # type: ignore[arg-type]
    if isinstance(predicate, OfType) and issubclass(predicate.type, Module):
        kind = predicate.type
        return lambda path, module: isinstance(module, kind)
    if isinstance(predicate, (OfType, WithTag)):
        raise TypeError(
            f"{what}: the filter {predicate!r} selects variables, not modules. {what} chooses "
            f"modules: pass a Module class (lm.Dense), lm.PathContains('name'), ... for every "
            f"module, or a function (path, module) -> bool."
        )
    if isinstance(predicate, (Any, All)):
        parts = [_for_modules(p, what) for p in predicate.filters]
        combine = builtins.any if isinstance(predicate, Any) else builtins.all
        return lambda path, module: combine(p(path, module) for p in parts)
    if isinstance(predicate, Not):
        inner = _for_modules(predicate.filter, what)
        return lambda path, module: not inner(path, module)
    return predicate  # type: ignore[return-value]  # a user's function (path, module)


@dataclasses.dataclass(frozen=True, repr=False)
class WithTag:
    """Matches variables in collection `tag`, or carrying `tag` among their `tags`.

    Example:
        >>> import lamina as lm
        >>> lm.WithTag("params")((), lm.Parameter((2,), lm.initializers.zeros()))
        True
    """

    tag: str

    def __post_init__(self) -> None:
        if not isinstance(self.tag, str) or not self.tag:
            raise TypeError(
                f"WithTag takes a non-empty string (a collection or tag), got {self.tag!r}."
            )

    def __repr__(self) -> str:
        return f"WithTag({self.tag!r})"

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether the variable is in the collection, or carries the tag."""
        return variable.collection == self.tag or self.tag in variable.tags


@dataclasses.dataclass(frozen=True, repr=False)
class OfType:
    """Matches variables of a type, or the variables of modules of a type.

    A `State` kind (``OfType(lm.Parameter)``) matches instances of it, subclasses included.
    A `Module` class (``OfType(lm.Dense)``) matches every variable reachable from a module of
    that class, so tied variables count for each module that holds them; this depends on the
    model, so the filter is resolved against its plan before matching (`split`, `mask`,
    ``to_predicate(filter, plan)`` do it), and calling it unresolved is an error.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.LayerNorm(3))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> sorted(lm.filter_variables(model, variables, lm.LayerNorm)["params"])
        ['layers_1']
    """

    type: type

    def __post_init__(self) -> None:
        if not isinstance(self.type, type):
            raise TypeError(
                f"OfType takes a class (lm.Parameter, lm.Dense), got {self.type!r} "
                f"({type(self.type).__name__})."
            )

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether the variable is of the type (a module class needs the plan: `to_predicate`)."""
        if issubclass(self.type, Module):
            raise TypeError(
                f"{self!r} matches the variables of {self.type.__name__} modules, so it needs "
                f"the model: use it through lm.split, lm.filter_variables, lm.mask or lm.grad, "
                f"or resolve it first with lm.to_predicate(filter, plan)."
            )
        return isinstance(variable, self.type)

    def __repr__(self) -> str:
        return f"OfType({self.type.__name__})"


@dataclasses.dataclass(frozen=True, repr=False)
class _ResolvedOfType(OfType):
    """`OfType` resolved against a plan: also matches the paths reachable from its modules."""

    paths: frozenset[Path] = frozenset()

    def __call__(self, path: Path, variable: State) -> bool:
        return isinstance(variable, self.type) or path in self.paths


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class PathContains:
    """Matches variables whose path holds `key`, compared as text, as paths are shown.

    ``PathContains(0)`` and ``PathContains("0")`` are the same filter and match list item 0
    and dict key ``"0"`` alike. A key with ``/`` matches consecutive parts
    (``"encoder/kernel"``). With ``exact=False``, the key may be part of a name. The path
    starts below the collection: use the string ``"params"`` to select a collection.

    Example:
        >>> import lamina as lm
        >>> lm.PathContains("encoder")(("encoder", "kernel"), None)
        True
        >>> lm.PathContains("0")(("layers", 0, "kernel"), None)
        True
        >>> lm.PathContains("layers/0")(("layers", 0, "kernel"), None)
        True
        >>> lm.PathContains("enc", exact=False)(("encoder", "kernel"), None)
        True
    """

    key: str
    exact: bool

    def __init__(self, key: str | int, exact: bool = True):
        if isinstance(key, bool) or not isinstance(key, (str, numbers.Integral)):
            raise TypeError(
                f"PathContains takes an attribute name, dict key or list index (a str or int), "
                f"got {key!r} ({type(key).__name__})."
            )
        key = key if isinstance(key, str) else str(int(key))
        if not key.strip("/"):
            raise ValueError(
                f"PathContains needs a key with a name in it, got {key!r}: it would match "
                f"{'nothing' if exact else 'everything'}."
            )
        object.__setattr__(self, "key", key.strip("/"))
        object.__setattr__(self, "exact", bool(exact))

    def __repr__(self) -> str:
        return f"PathContains({self.key!r}{'' if self.exact else ', exact=False'})"

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether the key's parts stand in the path in a row (not exact: a substring of it)."""
        if not self.exact:
            return self.key in "/".join(map(str, path))
        parts = self.key.split("/")
        shown = [str(part) for part in path]
        n = len(parts)
        return builtins.any(shown[i : i + n] == parts for i in range(len(shown) - n + 1))


class _Combinator(abc.ABC):
    """Filters built from other filters; resolving them resolves their parts."""

    @abc.abstractmethod
    def _resolve(self, plan: Plan) -> Predicate:
        """The same filter with its module-class parts resolved against `plan`."""


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Any(_Combinator):
    """Matches what any of `filters` matches (none given: nothing).

    Example:
        >>> import lamina as lm
        >>> lm.Any("params", lm.PathContains("head"))
        Any(WithTag('params'), PathContains('head'))
    """

    filters: tuple[Predicate, ...]

    def __init__(self, *filters: Filter):
        object.__setattr__(self, "filters", _convert_all(filters, "lm.Any"))

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether any of the filters matches."""
        return builtins.any(f(path, variable) for f in self.filters)

    def __repr__(self) -> str:
        return f"Any({', '.join(map(repr, self.filters))})"

    def _resolve(self, plan: Plan) -> Predicate:
        return type(self)(*(resolve(f, plan) for f in self.filters))


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class All(_Combinator):
    """Matches what all of `filters` match (none given: everything).

    Example:
        >>> import lamina as lm
        >>> lm.All(lm.Parameter, lm.Not(lm.PathContains("head")))
        All(OfType(Parameter), Not(PathContains('head')))
    """

    filters: tuple[Predicate, ...]

    def __init__(self, *filters: Filter):
        object.__setattr__(self, "filters", _convert_all(filters, "lm.All"))

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether every filter matches."""
        return builtins.all(f(path, variable) for f in self.filters)

    def __repr__(self) -> str:
        return f"All({', '.join(map(repr, self.filters))})"

    def _resolve(self, plan: Plan) -> Predicate:
        return type(self)(*(resolve(f, plan) for f in self.filters))


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Not(_Combinator):
    """Matches what `filter` does not.

    Example:
        >>> import lamina as lm
        >>> lm.Not("batch_stats")((), lm.Parameter((2,), lm.initializers.zeros()))
        True
    """

    filter: Predicate

    def __repr__(self) -> str:
        return f"Not({self.filter!r})"

    def __init__(self, filter: Filter):
        object.__setattr__(self, "filter", _convert_all((filter,), "lm.Not")[0])

    def __call__(self, path: Path, variable: State) -> bool:
        """Whether the filter does not match."""
        return not self.filter(path, variable)

    def _resolve(self, plan: Plan) -> Predicate:
        return Not(resolve(self.filter, plan))


@dataclasses.dataclass(frozen=True)
class Everything:
    """Matches every variable (the literals ``True`` and ``...``).

    Example:
        >>> import jax, lamina as lm
        >>> variables = lm.transform(lm.Dense(2, 3)).init(jax.random.key(0))
        >>> sorted(lm.filter_variables(lm.Dense(2, 3), variables, lm.Everything())["params"])
        ['bias', 'kernel']
    """

    def __call__(self, path: Path, variable: State) -> bool:
        """Always True."""
        return True


@dataclasses.dataclass(frozen=True)
class Nothing:
    """Matches no variable (the literals ``False`` and ``None``).

    Example:
        >>> import lamina as lm
        >>> lm.Nothing()(("kernel",), lm.Dense(2, 3).kernel)
        False
    """

    def __call__(self, path: Path, variable: State) -> bool:
        """Always False."""
        return False


_FILTER_CLASSES = (WithTag, OfType, PathContains, Any, All, Not, Everything, Nothing)
