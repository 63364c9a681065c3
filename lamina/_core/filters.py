"""Filters: predicates ``(path, variable) -> bool`` over a model's variable declarations.

Flax NNX's filter DSL, applied to lamina's declarations. A filter sees the path from the model
root (attribute names and dict keys as ``str``, list indices as ``int``) and the declaration
object (`State` or a subclass). `to_predicate` turns the literals users write into callables:

=================  =====================  ==============================================
literal            callable               matches
=================  =====================  ==============================================
``"name"``         ``WithTag("name")``    the collection ``"name"``, or a tag ``"name"``
a type             ``OfType(type)``       instances of the type (subclasses too)
``True``, ``...``  ``Everything()``       every variable
``False``, None    ``Nothing()``          no variable
(a, b), [a, b]     ``Any(a, b)``          what any of them matches
=================  =====================  ==============================================

``PathContains(key)``, ``All(*filters)`` and ``Not(filter)`` complete the set. Filters compare
equal and hash by value, so they can be dict keys.

Example:
    >>> import lamina as lm
    >>> lm.to_predicate((lm.Parameter, "batch_stats"))
    Any(OfType(Parameter), WithTag('batch_stats'))
    >>> lm.to_predicate(...) == lm.Everything()
    True
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable
from typing import Any as AnyType

from .errors import Path
from .variables import State

Predicate = Callable[[Path, State], bool]
Filter = AnyType  # a predicate or a literal that `to_predicate` converts


def to_predicate(filter: Filter) -> Predicate:
    """Converts a filter literal into a predicate ``(path, variable) -> bool``.

    Args:
        filter: A string (tag or collection), a type, True/``...``, False/None, a callable,
            or a tuple/list of filters.

    Returns:
        The predicate.

    Raises:
        TypeError: `filter` is none of these; the message shows it.
    """
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
    if callable(filter):
        return filter
    raise TypeError(
        f"{filter!r} ({type(filter).__name__}) is not a filter. A filter is a string (a "
        f"collection or tag), a variable type (lm.Parameter), True or ... (everything), False "
        f"or None (nothing), a function (path, variable) -> bool, or a tuple/list of these."
    )


@dataclasses.dataclass(frozen=True, repr=False)
class WithTag:
    """Matches variables in collection `tag`, or carrying `tag` among their `tags`."""

    tag: str

    def __repr__(self) -> str:
        return f"WithTag({self.tag!r})"

    def __call__(self, path: Path, variable: State) -> bool:
        return variable.collection == self.tag or self.tag in variable.tags


@dataclasses.dataclass(frozen=True, repr=False)
class OfType:
    """Matches instances of `type` (subclasses included), e.g. ``OfType(lm.Parameter)``."""

    type: type

    def __call__(self, path: Path, variable: State) -> bool:
        return isinstance(variable, self.type)

    def __repr__(self) -> str:
        return f"OfType({self.type.__name__})"


@dataclasses.dataclass(frozen=True, repr=False)
class PathContains:
    """Matches variables whose path holds `key`; with ``exact=False``, a part containing it.

    Example:
        >>> import lamina as lm
        >>> lm.PathContains("encoder")(("encoder", "kernel"), None)
        True
        >>> lm.PathContains("enc", exact=False)(("encoder", "kernel"), None)
        True
    """

    key: str | int
    exact: bool = True

    def __repr__(self) -> str:
        return f"PathContains({self.key!r}{'' if self.exact else ', exact=False'})"

    def __call__(self, path: Path, variable: State) -> bool:
        if self.exact:
            return self.key in path
        return builtins.any(str(self.key) in str(part) for part in path)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Any:
    """Matches what any of `filters` matches (none given: nothing)."""

    filters: tuple[Predicate, ...]

    def __init__(self, *filters: Filter):
        object.__setattr__(self, "filters", tuple(to_predicate(f) for f in filters))

    def __call__(self, path: Path, variable: State) -> bool:
        return builtins.any(f(path, variable) for f in self.filters)

    def __repr__(self) -> str:
        return f"Any({', '.join(map(repr, self.filters))})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class All:
    """Matches what all of `filters` match (none given: everything)."""

    filters: tuple[Predicate, ...]

    def __init__(self, *filters: Filter):
        object.__setattr__(self, "filters", tuple(to_predicate(f) for f in filters))

    def __call__(self, path: Path, variable: State) -> bool:
        return builtins.all(f(path, variable) for f in self.filters)

    def __repr__(self) -> str:
        return f"All({', '.join(map(repr, self.filters))})"


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Not:
    """Matches what `filter` does not."""

    filter: Predicate

    def __repr__(self) -> str:
        return f"Not({self.filter!r})"

    def __init__(self, filter: Filter):
        object.__setattr__(self, "filter", to_predicate(filter))

    def __call__(self, path: Path, variable: State) -> bool:
        return not self.filter(path, variable)


@dataclasses.dataclass(frozen=True)
class Everything:
    """Matches every variable (the literals ``True`` and ``...``)."""

    def __call__(self, path: Path, variable: State) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Nothing:
    """Matches no variable (the literals ``False`` and ``None``)."""

    def __call__(self, path: Path, variable: State) -> bool:
        return False
