"""Axis specs of the lifted transforms: `Carry`, `StateAxes`, `split_rngs` and spec trees.

A lifted transform's ``in_axes``/``out_axes`` are trees whose leaves are specs: an int axis,
None (broadcast), `Carry` (`scan` only) or a `StateAxes` giving a module's variables axes by
filter. `split_rngs` says which random streams a lifted call splits into one key per
iteration. The helpers at the end match a spec tree to the arguments' leaves (modules and
variables are leaves).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from .._core.errors import RngError
from .._core.graph import Plan
from .._core.module import Module
from .._core.rng import stream_label
from .._core.variables import State
from ..selection.filters import describe, to_predicate


class Carry:
    """The axis spec of a `scan` argument (or state) carried from one iteration to the next.

    Example:
        >>> import lamina as lm
        >>> lm.scan(lambda c, x: (c + x, c), in_axes=(lm.Carry, 0), out_axes=(lm.Carry, 0))
        <lamina scan of <lambda>>
    """

    def __init__(self) -> None:
        raise TypeError("lm.Carry is a marker: write lm.Carry, not lm.Carry().")


class StateAxes:
    """Axis specs for a module's variables by filter: ``StateAxes({filter: axis, ...})``.

    The mapping is ordered and the first filter that matches a variable decides its axis (an
    int, None for broadcast, or `Carry` in `scan`). A variable that no filter matches is an
    error naming its path; end with ``...: None`` to broadcast the rest.

    Args:
        axes: ``{filter: axis}``; filters as `to_predicate` accepts.

    Example:
        >>> import lamina as lm
        >>> lm.StateAxes({"params": 0, ...: None})
        StateAxes({'params': 0, ...: None})
    """

    def __init__(self, axes: Mapping[Any, Any]):
        if not isinstance(axes, Mapping):
            raise TypeError(
                f"StateAxes takes a mapping {{filter: axis}}, got {type(axes).__name__}."
            )
        self.items = tuple(axes.items())
        for filter, axis in self.items:
            _check_axis(axis, f"StateAxes entry {describe(filter)}")
            to_predicate(filter)  # a bad filter fails here, not later
        self._resolved: dict[int, list[tuple[Any, Any]]] = {}

    def axis_of(self, plan: Plan, entry: Any) -> Any:
        """The axis of `entry` (a `VariableEntry` of `plan`), or raises naming its path."""
        resolved = self._resolved.get(id(plan))
        if resolved is None:
            resolved = [(to_predicate(f, plan), axis) for f, axis in self.items]
            self._resolved = {id(plan): resolved}  # one plan at a time
        for predicate, axis in resolved:
            if predicate(entry.path, entry.state):
                return axis
        raise ValueError(
            f"{entry.name} matches no filter of {self!r}: every variable of a module passed "
            f"with StateAxes needs an axis. Add an entry for it, or end with `...: None` to "
            f"broadcast the rest."
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateAxes) and self.items == other.items

    def __hash__(self) -> int:
        return hash(self.items)

    def __repr__(self) -> str:
        inner = ", ".join(f"{_show_filter(f)}: {show_axis(a)}" for f, a in self.items)
        return f"StateAxes({{{inner}}})"


def _show_filter(filter: Any) -> str:
    return repr(filter) if isinstance(filter, str) else describe(filter)


def show_axis(axis: Any) -> str:
    """An axis as messages write it (``lm.Carry`` for `Carry`)."""
    return "lm.Carry" if axis is Carry else repr(axis)


def show_spec(spec: Any) -> str:
    """A spec (an axis or a `StateAxes`) as messages write it."""
    return show_axis(spec) if not isinstance(spec, StateAxes) else repr(spec)


def _check_axis(axis: Any, what: str) -> None:
    if axis is None or axis is Carry or (isinstance(axis, int) and not isinstance(axis, bool)):
        return
    raise TypeError(f"{what}: an axis is an int, None or lm.Carry, got {axis!r}.")


def _is_spec(x: Any) -> bool:
    """Whether `x` is a spec: an int, None, `Carry` or a `StateAxes`."""
    return x is None or x is Carry or isinstance(x, (int, StateAxes))


def is_scanned(axis: Any) -> bool:
    """Whether `axis` maps (scans) an axis: an int, not `Carry`."""
    return isinstance(axis, int) and axis is not Carry


# --- split_rngs ------------------------------------------------------------------------------


class Splittable(abc.ABC):
    """A lifted function, which a `split_rngs` decorating it gives its split."""

    @abc.abstractmethod
    def with_split(self, split: split_rngs) -> Splittable:
        """A copy of this lifted function that splits keys as `split` says."""


class split_rngs:
    """Splits random streams into one key per iteration of the lifted transform it decorates.

    The split is part of the lifted function itself, never ambient state: decorate the
    lifted function (``lm.split_rngs(splits=3)(lm.vmap(f))``, as Flax NNX stacks
    ``@nnx.split_rngs`` on ``@nnx.vmap``) or the function given to the transform
    (``lm.vmap(lm.split_rngs(splits=3)(f))``), or pass ``split_rngs=`` to the transform
    (``lm.vmap(f, split_rngs="dropout")``, the count then being the transform's own size).
    A traced program (``jax.jit(apply)``) therefore splits exactly where the model says, and
    no lifted transform splits unless asked. Without a split, a lifted transform broadcasts
    its keys: every vmapped member (every scanned layer) draws the same dropout mask.

    The ``with lm.split_rngs(...):`` form of earlier versions is refused: state read while
    tracing applied to whichever lifted transform ran next (one inside a layer that did not
    ask for it, or none), and a cached trace kept splitting after the block had ended.

    Args:
        splits: The number of iterations (the mapped axis size, the scan length); a different
            size is an error. The loops fold the iteration index in instead and accept any
            value.
        only: The streams to split: a name (``"default"`` for the default stream), a tuple
            of names, or ``...`` (every stream, the default one included). A name that the
            call's ``rngs`` lack is an error (its draws would fall back to the unsplit
            default stream).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Noisy(lm.Module):
        ...     def __call__(self, x):
        ...         @lm.split_rngs(splits=3)
        ...         @lm.vmap
        ...         def noise(x):
        ...             return x + jax.random.normal(lm.next_rng_key(), x.shape)
        ...         return noise(x)
        >>> init, apply = lm.transform(Noisy())
        >>> y, _ = apply({}, jax.random.key(0), jnp.zeros((3, 2)))
        >>> bool(y[0, 0] != y[1, 0])
        True
    """

    def __init__(self, splits: int, only: Any = ...):
        if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
            raise TypeError(f"split_rngs: splits must be a positive int, got {splits!r}.")
        self.splits: int | None = splits
        self.only = _check_only("split_rngs: only", only)

    @classmethod
    def _sized_by_transform(cls, only: Any) -> split_rngs:
        """A split whose count is the transform's own size (``split_rngs=`` of a transform)."""
        split = cls.__new__(cls)
        split.splits = None
        split.only = only
        return split

    def names(self) -> tuple[str, ...] | None:
        """The stream names chosen (``"default"`` for the default stream); None for all."""
        if self.only is Ellipsis:
            return None
        return (self.only,) if isinstance(self.only, str) else self.only

    def selects(self, stream: str) -> bool:
        """Whether `stream` (an internal stream name) is split."""
        names = self.names()
        return names is None or stream_label(stream) in names or stream in names

    def check_streams(self, name: str, streams: Sequence[str]) -> None:
        """Refuses chosen names that the call's streams lack (their draws would not split)."""
        names = self.names()
        if names is None or not streams:
            return  # a call without keys draws nothing (next_rng_key says so)
        labels = [stream_label(s) for s in streams]
        missing = [n for n in names if n not in labels]
        if missing:
            raise RngError(
                f"{name}: {self!r} splits the stream(s) {', '.join(map(repr, missing))}, but "
                f"this call's rngs have only {', '.join(map(repr, labels))}; "
                f"next_rng_key({missing[0]!r}) would fall back to the unsplit default stream "
                f"and every iteration would draw the same keys. Pass the stream "
                f"(apply(variables, {{{missing[0]!r}: key, ...}}, ...)), or split "
                f'only="default" (or ...).'
            )

    def check_size(self, name: str, size: int | None) -> int | None:
        """The count to split into: `splits`, which must equal the transform's `size`."""
        if self.splits is None:
            return size
        if size is not None and size != self.splits:
            raise ValueError(
                f"{name}: split_rngs(splits={self.splits}) but the mapped axis has size "
                f"{size}: each iteration takes one key, so the count must be {size}. Write "
                f"split_rngs(splits={size}), or pass split_rngs= to the transform, which "
                f"splits into its own size."
            )
        return self.splits

    def __enter__(self) -> split_rngs:
        raise TypeError(
            f"`with lm.{self!r}:` is no longer supported: a split read from the surrounding "
            f"context reached lifted transforms that did not ask for it and stayed in cached "
            f"traces. Attach it to the lifted call: `lm.{self!r}(lm.vmap(f))` (or as a "
            f"decorator over @lm.vmap / @lm.scan), or `lm.vmap(f, split_rngs=...)`."
        )

    def __exit__(self, *exc_info: object) -> None:
        """Never reached: `__enter__` refuses."""

    def __call__(self, fn: Callable[..., Any]) -> Any:
        """Attaches the split to a lifted function, or to the function given to one."""
        if isinstance(fn, Splittable):
            return fn.with_split(self)
        if isinstance(fn, _SplitFunction):
            shown = getattr(fn.fn, "__name__", type(fn.fn).__name__)
            raise TypeError(
                f"{shown} is already decorated with {fn.split!r}; give the split once, not "
                f"also {self!r}."
            )
        if not callable(fn):
            raise TypeError(
                f"{self!r} decorates a lifted transform (lm.vmap(f), lm.scan(f), ...) or the "
                f"function given to one, got {type(fn).__name__}."
            )
        return _SplitFunction(fn, self)

    def __repr__(self) -> str:
        only = "..." if self.only is Ellipsis else repr(self.only)
        count = "" if self.splits is None else f"splits={self.splits}, "
        return f"split_rngs({count}only={only})"


def _check_only(what: str, only: Any) -> Any:
    if only is Ellipsis or only is True:
        return Ellipsis
    names = (only,) if isinstance(only, str) else only
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} is a stream name, a tuple of names or ..., got {only!r}.")
    return only


class _SplitFunction:
    """A function with a split attached, for the lifted transform it is given to."""

    def __init__(self, fn: Callable[..., Any], split: split_rngs):
        self.fn = fn
        self.split = split
        # names and docs only: the wrapped callable's __dict__ must not overwrite ours
        functools.update_wrapper(self, fn, updated=())

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As a decorator of a method: `self.method` is the bound method, split attached.
        get = getattr(self.fn, "__get__", None)
        if instance is None or get is None:
            return self
        return _SplitFunction(get(instance, owner), self.split)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        raise TypeError(
            f"{name} was decorated with {self.split!r} and then called directly, so nothing "
            f"would be split. The split belongs to a lifted transform: pass the function to "
            f"one (lm.vmap(f), lm.scan(f), lm.fori_loop(..., f, ...)), or decorate the lifted "
            f"function: lm.{self.split!r}(lm.vmap(f))."
        )


def split_of(name: str, fn: Callable[..., Any], argument: Any) -> tuple[Any, Any]:
    """The function to run and its split: from a `split_rngs` decorator or `split_rngs=`."""
    split = None
    if isinstance(fn, _SplitFunction):
        split = fn.split
        fn = fn.fn
    if argument is None or argument is False:
        return fn, split
    if split is not None:
        raise TypeError(
            f"{name}: the function is decorated with {split!r} and split_rngs={argument!r} "
            f"was given too; give the split once."
        )
    if isinstance(argument, split_rngs):
        return fn, argument
    return fn, split_rngs._sized_by_transform(_check_only(f"{name}: split_rngs", argument))


# --- spec trees ------------------------------------------------------------------------------


def is_node(x: Any) -> bool:
    """Modules and declarations are leaves of a lifted function's arguments."""
    return isinstance(x, (Module, State))


def leaf_specs(name: str, what: str, specs: Any, tree: Any) -> list[Any]:
    """One spec per leaf (modules and variables are leaves) of `tree`, from `specs`, a prefix."""
    _check_specs(name, what, specs)
    if _is_spec(specs):
        return [specs] * len(jax.tree_util.tree_leaves(tree, is_leaf=is_node))
    if isinstance(tree, tuple) and isinstance(specs, list):
        specs = tuple(specs)
    try:
        nested = jax.tree_util.tree_map(
            lambda spec, sub: _Group([spec] * len(jax.tree_util.tree_leaves(sub, is_leaf=is_node))),
            specs,
            tree,
            is_leaf=_is_spec,
        )
    except ValueError as error:
        raise ValueError(
            f"{name}: {what}={specs!r} does not fit the structure of the "
            f"{'arguments' if what == 'in_axes' else 'outputs'}: give one spec, or a "
            f"tuple/list/dict that is a prefix of them ({error})."
        ) from None
    groups = jax.tree_util.tree_leaves(nested, is_leaf=lambda x: isinstance(x, _Group))
    return [spec for group in groups for spec in group.specs]


def _check_specs(name: str, what: str, specs: Any) -> None:
    """Every leaf of a spec tree is an int, None, `Carry` or a `StateAxes`."""
    leaves = jax.tree_util.tree_leaves(
        specs, is_leaf=lambda x: _is_spec(x) or is_node(x) or x is None
    )
    for leaf in leaves:
        if isinstance(leaf, StateAxes):
            continue
        if is_node(leaf) or not _is_spec(leaf) or isinstance(leaf, bool):
            shown = type(leaf).__name__ if is_node(leaf) else repr(leaf)
            raise TypeError(
                f"{name}: {what} holds {shown}, which is not an axis spec: a spec is an int "
                f"axis, None (broadcast), lm.Carry (lm.scan) or lm.StateAxes({{filter: "
                f"axis}}). Modules and variables are arguments of the function, not specs."
            )


class _Group:
    """The specs of one subtree (a leaf to `jax.tree_util`, unlike a list)."""

    def __init__(self, specs: list[Any]):
        self.specs = specs


def jax_axes(specs: Any) -> Any:
    """`specs` with module specs (StateAxes) replaced by None, for JAX's out_axes."""
    return jax.tree_util.tree_map(
        lambda s: None if isinstance(s, StateAxes) else s, specs, is_leaf=_is_spec
    )
