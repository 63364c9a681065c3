"""Lifted transforms: JAX's transforms over functions that take modules as arguments.

Inside a call, ``lm.vmap(f)(module, x)`` runs ``f`` under ``jax.vmap`` with the module's
variables among the mapped inputs. The variables of a module argument are the frame's values
at the module's slots (`Plan.slots_of`); each slot gets an axis from the module's spec (an
int, None, `Carry`, or a `StateAxes` of filters). Inside the JAX transform a nested `Frame` of
the same plan binds those slots to the transform's tracers (with the mapped axis removed from
their shapes), so the module's methods run unchanged; mutable state written there comes back
out with the same axes and is stored in the outer frame. A module used but not passed (one
captured by closure) can be read, not written, and may not be returned: that is the
consistent-aliasing rule of Flax NNX's transforms.

Random streams are forked once per transform call (each stream advances once). By default
the forked keys are broadcast: every iteration draws the same keys. Under `split_rngs`, the
chosen streams are split into one key per iteration (mapped by `vmap`, scanned by `scan`,
folded with the index by the loops), so dropout masks differ per member or per layer.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.errors import RngError, format_path
from ..selection.filters import describe, to_predicate
from .._core.frame import Frame, current_frame
from .._core.graph import Plan
from .._core.module import Module
from .._core.rng import RngStreams, stream_label
from ..sharding.shardings import match_sharding, unshard_leading
from .._core.variables import State


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
        inner = ", ".join(f"{_show_filter(f)}: {_show_axis(a)}" for f, a in self.items)
        return f"StateAxes({{{inner}}})"


def _show_filter(filter: Any) -> str:
    return repr(filter) if isinstance(filter, str) else describe(filter)


def _show_axis(axis: Any) -> str:
    return "lm.Carry" if axis is Carry else repr(axis)


def _check_axis(axis: Any, what: str) -> None:
    if axis is None or axis is Carry or (isinstance(axis, int) and not isinstance(axis, bool)):
        return
    raise TypeError(f"{what}: an axis is an int, None or lm.Carry, got {axis!r}.")


def _is_spec(x: Any) -> bool:
    return x is None or x is Carry or isinstance(x, (int, StateAxes))


# --- split_rngs ------------------------------------------------------------------------------


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
        if isinstance(fn, _Lifted):
            return fn._with_split(self)
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


def _split_of(name: str, fn: Callable[..., Any], argument: Any) -> tuple[Any, Any]:
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


# --- binding module arguments ----------------------------------------------------------------


def _is_node(x: Any) -> bool:
    """Modules and declarations are leaves of a lifted function's arguments."""
    return isinstance(x, (Module, State))


@dataclasses.dataclass
class _Binding:
    """One lifted call's module (and variable) arguments, resolved against the running frame."""

    name: str
    frame: Frame
    treedef: Any
    leaves: list[Any]  # the arguments' leaves; modules and variables stay in place
    leaf_specs: list[Any]
    module_spec: dict[int, Any]  # id(module or variable) -> spec, as first given
    slots: list[int]  # the argument modules' slots, increasing
    slot_axis: dict[int, Any]  # slot -> int | None | Carry
    forked: dict[str, Any]  # stream -> key (split streams: n keys once `split_keys` ran)
    split: frozenset[str]
    stacked_inside: list[int]  # per slot: the stacked axes each iteration still sees

    @property
    def plan(self) -> Plan:
        return self.frame.plan

    def mutable_slots(self) -> list[int]:
        return [s for s in self.slots if self.plan.variables[s].state.mutable]

    def split_keys(self, count: int) -> None:
        """Splits the chosen streams' keys into `count`, one per iteration."""
        self.forked = {
            s: jax.random.split(key, count) if s in self.split else key
            for s, key in self.forked.items()
        }


def _bind(
    name: str,
    args: tuple,
    in_axes: Any,
    allow_carry: bool,
    split: split_rngs | None = None,
) -> _Binding:
    frame = current_frame()
    if frame is None:
        raise RuntimeError(
            f"{name} was called outside init/apply: lifted transforms run inside a model's "
            f"methods, where modules are bound to the call's variables. Outside, use JAX's "
            f"own transforms (jax.vmap(apply), jax.lax.scan over apply)."
        )
    frame.check_trace(
        f"{name} was called",
        f"Its results would be written back into the call from inside that transform. Use "
        f"{name} directly in the model's method, or nest lamina's lifted transforms.",
    )
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_node)
    leaf_specs = _leaf_specs(name, "in_axes", in_axes, args)
    plan = frame.plan
    module_spec: dict[int, Any] = {}
    slot_axis: dict[int, Any] = {}
    slot_owner: dict[int, tuple[Any, Any]] = {}
    stacked = _stacked_counts(frame)
    stacked_inside = list(stacked)
    for leaf, spec in zip(leaves, leaf_specs, strict=True):
        if spec is Carry and not allow_carry:
            raise TypeError(f"{name}: lm.Carry is an axis spec of lm.scan only.")
        if not _is_node(leaf):
            if isinstance(spec, StateAxes):
                raise TypeError(
                    f"{name}: StateAxes is the spec of a module argument, but it was given for "
                    f"a {type(leaf).__name__}."
                )
            continue
        module_spec.setdefault(id(leaf), spec)
        for slot, axis in _resolved_axes(name, plan, leaf, spec).items():
            entry = plan.variables[slot]
            if axis is Carry and not allow_carry:
                raise TypeError(f"{name}: lm.Carry is an axis spec of lm.scan only.")
            if slot in slot_axis and slot_axis[slot] != axis:
                other, other_spec = slot_owner[slot]
                if other is leaf:
                    raise ValueError(
                        f"{name}: {_describe_node(plan, leaf)} is passed twice with different "
                        f"axes for {entry.name}: {_show_axis(slot_axis[slot])} (from "
                        f"{_show_spec(other_spec)}) and {_show_axis(axis)} (from "
                        f"{_show_spec(spec)}). Pass it once, or with specs that give each "
                        f"variable the same axis."
                    )
                raise ValueError(
                    f"{name}: {entry.name} is shared by {_describe_node(plan, other)} "
                    f"(axis {_show_axis(slot_axis[slot])} from {_show_spec(other_spec)}) and "
                    f"{_describe_node(plan, leaf)} (axis {_show_axis(axis)} from "
                    f"{_show_spec(spec)}): one variable, one axis."
                )
            if isinstance(axis, int) and not (
                -len(frame.shapes[slot]) <= axis < len(frame.shapes[slot])
            ):
                raise ValueError(
                    f"{name}: axis {axis} is out of range for {entry.name}, of shape "
                    f"{frame.shapes[slot]}."
                )
            slot_axis[slot] = axis
            slot_owner.setdefault(slot, (leaf, spec))
            stacked_inside[slot] = _check_layout(name, frame, stacked, leaf, spec, slot, axis)
    forked = frame.rngs.fork()
    chosen: frozenset[str] = frozenset()
    if split is not None:
        split.check_streams(name, list(forked))
        chosen = frozenset(s for s in forked if split.selects(s))
    return _Binding(
        name=name,
        frame=frame,
        treedef=treedef,
        leaves=leaves,
        leaf_specs=leaf_specs,
        module_spec=module_spec,
        slots=sorted(slot_axis),
        slot_axis=slot_axis,
        forked=forked,
        split=chosen,
        stacked_inside=stacked_inside,
    )


# --- stored layouts inside lifted transforms -------------------------------------------------


class _Layout(list):
    """The shapes a nested frame holds (one per slot), and its stacked axes.

    `stacked[slot]` counts the stacked axes (`VariableEntry.axes`, a `Stack`'s depth) still
    in front of the slot's declared shape in this frame: all of them at the top of a call,
    one fewer inside each lifted transform that maps the leading one away.
    """

    stacked: list[int]


_TOP_STACKED: dict[int, tuple[Plan, list[int]]] = {}


def _stacked_counts(frame: Frame) -> list[int]:
    """Per slot, the stacked axes the values of `frame` still hold."""
    stacked = getattr(frame.shapes, "stacked", None)
    if stacked is not None:
        return stacked
    cached = _TOP_STACKED.get(id(frame.plan))
    if cached is None or cached[0] is not frame.plan:
        if len(_TOP_STACKED) > 64:
            _TOP_STACKED.clear()
        cached = (frame.plan, [len(entry.axes) for entry in frame.plan.variables])
        _TOP_STACKED[id(frame.plan)] = cached
    return cached[1]


def _layout(shapes: list[tuple[int, ...]], stacked: list[int]) -> _Layout:
    layout = _Layout(shapes)
    layout.stacked = stacked
    return layout


def _check_layout(
    name: str, frame: Frame, stacked: list[int], node: Any, spec: Any, slot: int, axis: Any
) -> int:
    """The stacked axes that `slot` keeps inside the transform.

    A module argument runs unchanged inside the transform, so each member (step) must get
    each of its variables with the shape the module computes with: the stored shape without
    the axes of the Stacks around the module (`Plan.stacked_axes`), which keeps the axes of
    the Stacks inside it (the module maps those away itself). A stacked axis is mapped only
    as the leading one. Anything else (a plain module's variables mapped, a Stack's copies
    mapped twice, a stacked variable broadcast into a block) is an error naming the
    variable, its stored and declared shapes and the spec. A variable passed on its own is an
    array to the function and may be mapped or broadcast freely.
    """
    plan = frame.plan
    entry = plan.variables[slot]
    shape = frame.shapes[slot]
    left = stacked[slot]
    mapped = axis % len(shape) if isinstance(axis, int) and axis is not Carry else None
    if mapped is not None and mapped < left:
        if mapped != 0:
            raise ValueError(
                f"{name}: axis {axis} of {entry.name} (of shape {shape} here, whose first "
                f"{left} axes are stacked copies) is an inner stacked axis: map the outer one "
                f"(axis 0) first."
            )
        left -= 1
    if isinstance(node, State):
        return left
    around = plan.stacked_axes(node)
    wanted = len(entry.axes) - len(around)
    inside = shape if mapped is None else shape[:mapped] + shape[mapped + 1 :]
    expected = entry.shape[len(around) :]
    if left == wanted and inside == expected:
        return left
    where = _describe_node(plan, node)
    member = "step" if name == "lm.scan" else "member"
    given = f"with axis {_show_axis(axis)} (from {_show_spec(spec)})"
    if left > wanted:
        stacks = " and ".join(
            f"the {type(a.owner).__name__} at {format_path(a.path)} ({a.size} copies)"
            for a in around
        )
        why = (
            f"{where} lies inside {stacks} and runs on one copy, so each {member} must get it "
            f"as {expected}, but {given} it would get {inside}, every copy at once. Map the "
            f"stacked axis (axis 0 for this variable: an int spec, or a StateAxes whose first "
            f"matching filter gives 0), or pass the Stack itself"
        )
    elif left < wanted:
        why = (
            f"{where} runs the stacked copies itself, so it must get it as {expected}, but "
            f"{given} it would get {inside}, one copy. Broadcast it (None), or pass the "
            f"Stack's block to map its copies"
        )
    elif mapped is not None:
        reason = (
            "the transform around this one mapped its stacked copies already (each of its "
            "members holds one copy)"
            if entry.axes
            else "it has no axis of copies to map (only a Stack stores copies)"
        )
        fix = (
            "Broadcast it (None), or build the copies with lm.Stack(block, n) and map the "
            "Stack's block once"
        )
        if not entry.axes:
            fix = (
                f"Broadcast it (None); or, to map the variables' own axes, pass the variables "
                f"themselves as arguments with their axes instead of the module (e.g. "
                f"{name}(f, in_axes=(None, 0, 0))(self.mem.w, self.mem.h, x), f computing "
                f"with the arrays it gets); or declare the per-{member} shape and hold the "
                f"copies in lm.Stack(block, n), mapping the Stack's block"
            )
        why = (
            f"{where} computes with {expected}, but {given} each {member} would get it as "
            f"{inside}: {reason}. {fix}"
        )
    else:
        why = (
            f"{where} computes with {expected}, but {given} each {member} would get it as "
            f"{shape}. Map the axis that holds its copies, or pass the module it lies in"
        )
    if entry.axes:
        stored = (
            f"{entry.name} is stored as {entry.shape} (stacked axes {entry.axes} in front of "
            f"its declared shape {entry.state.shape})"
        )
    else:
        stored = f"{entry.name} is stored as {entry.shape}, its declared shape"
    raise ValueError(f"{name}: {stored}; {why}.")


def _resolved_axes(name: str, plan: Plan, node: Any, spec: Any) -> dict[int, Any]:
    """``{slot: axis}`` for the variables of a module (or one variable) given with `spec`.

    Two specs that resolve to the same axes are the same spec (a module given as 0 and as
    ``StateAxes({...: 0})``): aliasing and returned modules compare these, not the specs as
    written.
    """
    if isinstance(node, State):
        if node._lamina_plan is not plan:
            raise ValueError(
                f"{name} got a {type(node).__name__} (shape {node.shape}) that is not a "
                f"variable of the model being applied (lm.transform works on a copy of the "
                f"model): pass variables reached through `self` inside the model's methods."
            )
        slots: tuple[int, ...] = (node._lamina_slot,)  # type: ignore[assignment]
    else:
        _path_of(plan, node, name)
        slots = plan.slots_of(node)
    if isinstance(spec, StateAxes):
        return {s: spec.axis_of(plan, plan.variables[s]) for s in slots}
    return dict.fromkeys(slots, spec)


def _describe_node(plan: Plan, node: Any) -> str:
    if isinstance(node, State):
        return f"the variable {plan.variables[node._lamina_slot].name}"  # type: ignore[index]
    return f"the module at {format_path(plan.module_paths()[id(node)])}"


def _show_spec(spec: Any) -> str:
    return _show_axis(spec) if not isinstance(spec, StateAxes) else repr(spec)


def _path_of(plan: Plan, module: Module, name: str) -> tuple:
    path = plan.module_paths().get(id(module))
    if path is None:
        raise ValueError(
            f"{name} got a {type(module).__name__} that is not part of the model being "
            f"applied (lm.transform works on a copy of the model): pass modules reached "
            f"through `self` inside the model's methods."
        )
    return path


def _leaf_specs(name: str, what: str, specs: Any, tree: Any) -> list[Any]:
    """One spec per leaf (modules and variables are leaves) of `tree`, from `specs`, a prefix."""
    _check_specs(name, what, specs)
    if _is_spec(specs):
        return [specs] * len(jax.tree_util.tree_leaves(tree, is_leaf=_is_node))
    if isinstance(tree, tuple) and isinstance(specs, list):
        specs = tuple(specs)
    try:
        nested = jax.tree_util.tree_map(
            lambda spec, sub: _Group(
                [spec] * len(jax.tree_util.tree_leaves(sub, is_leaf=_is_node))
            ),
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
        specs, is_leaf=lambda x: _is_spec(x) or _is_node(x) or x is None
    )
    for leaf in leaves:
        if isinstance(leaf, StateAxes):
            continue
        if _is_node(leaf) or not _is_spec(leaf) or isinstance(leaf, bool):
            shown = type(leaf).__name__ if _is_node(leaf) else repr(leaf)
            raise TypeError(
                f"{name}: {what} holds {shown}, which is not an axis spec: a spec is an int "
                f"axis, None (broadcast), lm.Carry (lm.scan) or lm.StateAxes({{filter: "
                f"axis}}). Modules and variables are arguments of the function, not specs."
            )


class _Group:
    """The specs of one subtree (a leaf to `jax.tree_util`, unlike a list)."""

    def __init__(self, specs: list[Any]):
        self.specs = specs


# --- inside the transform --------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class _ModuleSlot:
    """Stands for a module among a function's outputs: a pytree node without leaves."""

    def __init__(self, index: int):
        self.index = index

    def tree_flatten(self) -> tuple[tuple, int]:
        return (), self.index

    @classmethod
    def tree_unflatten(cls, index: int, children: tuple) -> _ModuleSlot:
        return cls(index)


def _is_slot(x: Any) -> bool:
    return isinstance(x, _ModuleSlot)


class _Body:
    """Runs the user's function inside a JAX transform, in a nested frame."""

    def __init__(
        self,
        binding: _Binding,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        records: str = "blocked",
    ):
        """A body; `records` says how `lm.sow`/`lm.perturb` records cross the transform.

        ``"mapped"`` (vmap, scan): given records of the argument modules go in with the
        transform's axis, new ones come out with it; ``"plain"`` (checkpoint): in and out as
        they are; ``"blocked"`` (cond, switch, loops): recording inside is an error.
        """
        self.binding = binding
        self.fn = fn
        self.kwargs = kwargs
        self.modules_out: list[Module] = []
        self.records_mode = records
        self.inner_records: Any = None
        # Given records split into those that go in with the transform's axis (`mapped`:
        # recorded by an argument module, so they carry its axis) and those read as they are.
        self.records_in: dict[str, dict[tuple, Any]] = {}
        self.records_shared: dict[str, dict[tuple, Any]] = {}
        outer = binding.frame.records
        if outer is not None and records != "blocked":
            paths = binding.plan.module_paths()
            prefixes = [paths[m] for m in binding.module_spec if m in paths]
            for collection, entries in outer.given.items():
                for key, value in entries.items():
                    mapped = records == "mapped" and any(key[: len(p)] == p for p in prefixes)
                    target = self.records_in if mapped else self.records_shared
                    target.setdefault(collection, {})[key] = value

    def records_out(self) -> dict[str, dict[tuple, Any]]:
        """What the nested frame recorded (call inside the transform, after `run`)."""
        return {} if self.inner_records is None else self.inner_records.out

    def absorb_records(self, produced: Mapping[str, Mapping[tuple, Any]]) -> None:
        """Hands what came out of the transform to the outer frame's records."""
        if self.inner_records is not None:
            self.binding.frame.records.absorb(self.inner_records, produced, self.binding.name)

    def shapes_inside(self, slot_axes: Mapping[int, Any]) -> _Layout:
        """The nested frame's shapes: the frame's, with `slot_axes`'s mapped axes removed."""
        return _shapes_inside(self.binding, slot_axes)

    def run(
        self,
        arrays: Sequence[Any],
        slot_values: Mapping[int, Any],
        keys: Mapping[str, Any],
        shapes: list[tuple[int, ...]],
        fn: Callable[..., Any] | None = None,
        extra: tuple = (),
        records_in: Mapping[str, Mapping[tuple, Any]] | None = None,
    ) -> tuple[Any, dict[int, Any]]:
        """Calls the function in a nested frame.

        `records_in` are the mapped given records (`records_in` of `__init__`), as the
        transform hands them to one iteration.

        Returns:
            Its output, with modules replaced by `_ModuleSlot` nodes, and the values of the
            slots in `slot_values` after the call.
        """
        binding = self.binding
        outer = binding.frame
        values = list(outer.values)
        for slot, value in slot_values.items():
            values[slot] = value
        records = None
        if outer.records is not None:
            given = {c: dict(e) for c, e in self.records_shared.items()}
            for collection, entries in (records_in or {}).items():
                given.setdefault(collection, {}).update(entries)
            blocked = binding.name if self.records_mode == "blocked" else None
            records = outer.records.nested(given, blocked)
            self.inner_records = records
        frame = Frame(
            outer.plan,
            values,
            RngStreams.from_keys(dict(keys)),
            outer.phase,
            shapes,
            inside=binding.name,
            writable=frozenset(binding.slots),
            records=records,
        )
        it = iter(arrays)
        leaves = [leaf if _is_node(leaf) else next(it) for leaf in binding.leaves]
        args = jax.tree_util.tree_unflatten(binding.treedef, leaves)
        with frame:
            out = (fn or self.fn)(*extra, *args, **self.kwargs)
            out = jax.tree_util.tree_map(self._slot_for, out, is_leaf=self._is_argument)
        return out, {s: values[s] for s in slot_values}

    def _is_argument(self, x: Any) -> bool:
        # a module, or a variable passed as an argument (another variable returned is its
        # value, as everywhere else)
        return isinstance(x, Module) or (isinstance(x, State) and id(x) in self.binding.module_spec)

    def _slot_for(self, leaf: Any) -> Any:
        if not self._is_argument(leaf):
            return leaf
        binding = self.binding
        if id(leaf) not in binding.module_spec:
            path = binding.plan.module_paths().get(id(leaf))
            where = format_path(path) if path is not None else "outside the model"
            raise ValueError(
                f"{binding.name}: the function returned the module at {where}, which was not "
                f"passed to it as an argument (a module captured by closure may be read "
                f"inside, not returned). Pass it as an argument."
            )
        for index, module in enumerate(self.modules_out):
            if module is leaf:
                return _ModuleSlot(index)
        self.modules_out.append(leaf)
        return _ModuleSlot(len(self.modules_out) - 1)

    def restore(self, out: Any) -> Any:
        """The output with its modules back in place."""
        return jax.tree_util.tree_map(
            lambda x: self.modules_out[x.index] if isinstance(x, _ModuleSlot) else x,
            out,
            is_leaf=_is_slot,
        )

    def check_module_specs(self, out: Any, out_axes: Any) -> None:
        """A module returned by the function must come out with the spec it came in with."""
        binding = self.binding
        restored = self.restore(out)
        leaves = jax.tree_util.tree_leaves(restored, is_leaf=_is_node)
        specs = _leaf_specs(binding.name, "out_axes", out_axes, restored)
        for leaf, spec in zip(leaves, specs, strict=True):
            if _is_node(leaf):
                spec_in = binding.module_spec[id(leaf)]
                if spec_in == spec:
                    continue
                axes = _resolved_axes(binding.name, binding.plan, leaf, spec)
                if any(binding.slot_axis[s] != a for s, a in axes.items()):
                    raise ValueError(
                        f"{binding.name}: {_describe_node(binding.plan, leaf)} is returned "
                        f"with axes {_show_spec(spec)} but came in with "
                        f"{_show_spec(spec_in)}: a module keeps one spec in and out."
                    )


def _shapes_inside(binding: _Binding, slot_axes: Mapping[int, Any]) -> _Layout:
    shapes = list(binding.frame.shapes)
    for slot, axis in slot_axes.items():
        if isinstance(axis, int) and axis is not Carry:
            shape = list(shapes[slot])
            del shape[axis]
            shapes[slot] = tuple(shape)
    return _layout(shapes, binding.stacked_inside)


def _mapped_size(
    binding: _Binding,
    arrays: list[Any],
    array_axes: list[Any],
    given: int | None,
    given_as: str,
) -> int | None:
    """The size of the axis a transform maps (scans): every mapped input must agree.

    Checks each mapped array's axis against its rank, then compares the sizes of all mapped
    inputs (arrays and the module arguments' variables) and `given` (``axis_size=`` or
    ``length=``); a disagreement names every input and its size.

    Returns:
        The common size, or None when nothing is mapped and nothing was given.
    """
    sizes: list[tuple[int, Any, Any]] = []  # (size, array index or slot, axis)
    for index, (leaf, axis) in enumerate(zip(arrays, array_axes, strict=True)):
        if not _is_scanned(axis):
            continue
        shape = jnp.shape(leaf)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(
                f"{binding.name}: in_axes gives axis {axis} for {_argument_at(binding, index)}, "
                f"of shape {tuple(shape)}, which has no axis {axis}: give an axis in "
                f"[{-len(shape)}, {len(shape)}), or None to broadcast it."
            )
        sizes.append((int(shape[axis]), index, axis))
    arrays_mapped = len(sizes)
    shapes = binding.frame.shapes
    for slot in binding.slots:
        axis = binding.slot_axis[slot]
        if _is_scanned(axis):
            sizes.append((int(shapes[slot][axis]), slot, axis))
    size = given if given is not None else (sizes[0][0] if sizes else None)
    if all(n == size for n, _, _ in sizes):
        return size
    shown = [f"{given_as}={given}"] if given is not None else []
    for i, (n, where, axis) in enumerate(sizes):
        if i < arrays_mapped:
            what = f"{_argument_at(binding, where)} (shape {tuple(jnp.shape(arrays[where]))})"
        else:
            what = f"{binding.plan.variables[where].name} (shape {shapes[where]})"
        shown.append(f"axis {axis} of {what} has size {n}")
    verb = "scans" if binding.name == "lm.scan" else "maps"
    raise ValueError(
        f"{binding.name}: the inputs it {verb} disagree on the size of that axis: "
        f"{'; '.join(shown)}. Every mapped input (and {given_as}=, if given) must have the "
        f"same size there."
    )


def _argument_at(binding: _Binding, index: int) -> str:
    """The `index`-th array argument leaf, as messages write it (``args[1]['x']``)."""
    args = jax.tree_util.tree_unflatten(binding.treedef, binding.leaves)
    paths = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_node)[0]
    arrays = [path for path, leaf in paths if not _is_node(leaf)]
    return f"the argument args{jax.tree_util.keystr(arrays[index])}"


def _array_leaves(binding: _Binding) -> tuple[list[Any], list[Any]]:
    """The non-module argument leaves, and their specs."""
    pairs = [
        (leaf, spec)
        for leaf, spec in zip(binding.leaves, binding.leaf_specs, strict=True)
        if not _is_node(leaf)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _jax_axes(specs: Any) -> Any:
    """`specs` with module specs (StateAxes) replaced by None, for JAX's out_axes."""
    return jax.tree_util.tree_map(
        lambda s: None if isinstance(s, StateAxes) else s, specs, is_leaf=_is_spec
    )


def _store(binding: _Binding, new_values: Mapping[int, Any]) -> None:
    """Writes state that came out of a transform into the outer frame."""
    values = binding.frame.values
    for slot, value in new_values.items():
        values[slot] = value


# --- the transforms --------------------------------------------------------------------------


class _Lifted(abc.ABC):
    """A lifted function; calling it inside a model's method runs the transform."""

    kind = ""
    iterates = True  # whether a split of the keys means anything (vmap, scan, loops)
    split: split_rngs | None

    def __init__(self, fn: Callable[..., Any], split_argument: Any = None):
        if not callable(fn):
            raise TypeError(f"lm.{self.kind} transforms a function, got {type(fn).__name__}.")
        fn, split = _split_of(f"lm.{self.kind}", fn, split_argument)
        self.fn = fn
        self.split = None
        # names and docs only: the wrapped callable's __dict__ must not overwrite ours
        functools.update_wrapper(self, fn, updated=())
        if split is not None:
            self._check_split(split)
        self.split = split

    def _check_split(self, split: split_rngs) -> None:
        if not self.iterates:
            raise TypeError(
                f"lm.{self.kind} runs its function once, so there is nothing to split keys "
                f"over ({split!r}); split_rngs goes on lm.vmap, lm.scan, lm.fori_loop or "
                f"lm.while_loop."
            )

    def _with_split(self, split: split_rngs) -> _Lifted:
        """A copy of this lifted function that splits keys as `split` says."""
        if self.split is not None:
            raise TypeError(
                f"this lm.{self.kind} already splits its keys ({self.split!r}); give the "
                f"split once, not also {split!r}."
            )
        self._check_split(split)
        lifted = copy.copy(self)
        lifted.split = split
        return lifted

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the transform (each kind implements it)."""

    def __repr__(self) -> str:
        return f"<lamina {self.kind} of {getattr(self.fn, '__name__', type(self.fn).__name__)}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As a decorator of a method: bind `self` like a function does.
        return self if instance is None else functools.partial(self.__call__, instance)


class _Vmap(_Lifted):
    kind = "vmap"

    def __init__(
        self,
        fn: Callable[..., Any],
        in_axes: Any,
        out_axes: Any,
        axis_size: int | None,
        axis_name: Any,
        split_argument: Any = None,
    ):
        super().__init__(fn, split_argument)
        self.in_axes, self.out_axes = in_axes, out_axes
        self.axis_size, self.axis_name = axis_size, axis_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.vmap"
        binding = _bind(name, args, self.in_axes, allow_carry=False, split=self.split)
        arrays, array_axes = _array_leaves(binding)
        slot_axes = {s: binding.slot_axis[s] for s in binding.slots}
        size = _mapped_size(binding, arrays, array_axes, self.axis_size, "axis_size")
        if self.split is not None:
            size = self.split.check_size(name, size)
        if size is None:
            raise ValueError(
                f"{name}: nothing is mapped (every in_axes is None), so the axis size is "
                f"unknown: pass axis_size=n."
            )
        if self.split is not None:
            binding.split_keys(size)
        body = _Body(binding, self.fn, kwargs, records="mapped")
        shapes = body.shapes_inside(slot_axes)
        mutable = binding.mutable_slots()
        state_out = {s: slot_axes[s] for s in mutable}
        key_axes = {s: 0 if s in binding.split else None for s in binding.forked}

        def run(arrays: list, slot_values: dict, keys: dict, records_in: dict) -> Any:
            out, new = body.run(arrays, slot_values, keys, shapes, records_in=records_in)
            return out, {s: new[s] for s in mutable}, body.records_out()

        try:
            out, new, records = jax.vmap(
                run,
                in_axes=(array_axes, slot_axes, key_axes, 0),
                out_axes=(_jax_axes(self.out_axes), state_out, 0),
                axis_size=size,
                axis_name=self.axis_name,
            )(
                arrays,
                {s: binding.frame.values[s] for s in binding.slots},
                binding.forked,
                body.records_in,
            )
        except ValueError as error:
            broadcast = [binding.plan.variables[s].name for s in mutable if state_out[s] is None]
            if broadcast and "out_axes" in str(error):
                raise ValueError(
                    f"{name}: a broadcast variable (axis None) was written with a value that "
                    f"differs per member (broadcast state here: {', '.join(broadcast)}). Map "
                    f"it (an int axis, e.g. in StateAxes), or write a value that is the same "
                    f"for every member."
                ) from error
            raise
        body.check_module_specs(out, self.out_axes)
        _store(binding, new)
        body.absorb_records(records)
        return body.restore(out)


class _Scan(_Lifted):
    kind = "scan"

    def __init__(
        self,
        fn: Callable[..., Any],
        in_axes: Any,
        out_axes: Any,
        length: int | None,
        reverse: bool,
        unroll: int | bool,
        split_argument: Any = None,
    ):
        super().__init__(fn, split_argument)
        self.in_axes, self.out_axes = in_axes, out_axes
        self.length, self.reverse, self.unroll = length, reverse, unroll

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.scan"
        binding = _bind(name, args, self.in_axes, allow_carry=True, split=self.split)
        arrays, array_axes = _array_leaves(binding)
        carried = [i for i, a in enumerate(array_axes) if a is Carry]
        scanned = [i for i, a in enumerate(array_axes) if _is_scanned(a)]
        carry_slots = [s for s in binding.slots if binding.slot_axis[s] is Carry]
        xs_slots = [s for s in binding.slots if _is_scanned(binding.slot_axis[s])]
        bcast_slots = [s for s in binding.slots if binding.slot_axis[s] is None]
        mutable = set(binding.mutable_slots())
        xs_written = [s for s in xs_slots if s in mutable]
        length = _mapped_size(binding, arrays, array_axes, self.length, "length")
        if self.split is not None:
            length = self.split.check_size(name, length)
            if length is None:
                raise ValueError(
                    f"{name}: nothing is scanned (no in_axes 0), so the number of steps to "
                    f"split keys into is unknown: pass length=n."
                )
            binding.split_keys(length)
        body = _Body(binding, self.fn, kwargs, records="mapped")
        shapes = body.shapes_inside({s: binding.slot_axis[s] for s in xs_slots})
        values = binding.frame.values
        split_keys = {s: k for s, k in binding.forked.items() if s in binding.split}
        bcast_keys = {s: k for s, k in binding.forked.items() if s not in binding.split}
        out_info: dict[str, Any] = {}

        def step(carry: Any, xs: Any) -> Any:
            carry_arrays, carry_values = carry
            xs_arrays, xs_values, keys, records_in = xs
            merged = list(arrays)
            for i, a in zip(carried, carry_arrays, strict=True):
                merged[i] = a
            for i, a in zip(scanned, xs_arrays, strict=True):
                merged[i] = a
            slot_values = {s: values[s] for s in bcast_slots}
            slot_values.update(zip(carry_slots, carry_values, strict=True))
            slot_values.update(zip(xs_slots, xs_values, strict=True))
            out, new = body.run(
                merged, slot_values, {**bcast_keys, **keys}, shapes, records_in=records_in
            )
            for s in bcast_slots:
                if s in mutable and new[s] is not values[s]:
                    raise ValueError(
                        f"{name}: {binding.plan.variables[s].name} is broadcast (axis None) "
                        f"but was written inside the scan, where each step would see the "
                        f"first value again (Flax NNX's scan refuses broadcast output state "
                        f"too). Carry it (lm.Carry, e.g. in StateAxes) or scan it (an int "
                        f"axis)."
                    )
            specs = _leaf_specs(name, "out_axes", self.out_axes, body.restore(out))
            leaves, treedef = jax.tree_util.tree_flatten(out)
            leaf_specs = [s for s, x in zip(specs, _leaves_with_modules(out), strict=True) if x]
            for spec in leaf_specs:
                if not _is_scanned(spec) and spec is not Carry:
                    raise ValueError(
                        f"{name}: out_axes are lm.Carry (the new carry) or an int (the axis "
                        f"the steps' outputs are stacked on), got {spec!r}."
                    )
            out_info["treedef"], out_info["specs"], out_info["out"] = treedef, leaf_specs, out
            new_carry = [x for x, s in zip(leaves, leaf_specs, strict=True) if s is Carry]
            ys = [x for x, s in zip(leaves, leaf_specs, strict=True) if s is not Carry]
            if len(new_carry) != len(carried):
                raise ValueError(
                    f"{name}: the function takes {len(carried)} carried array(s) (in_axes "
                    f"lm.Carry) but returns {len(new_carry)} (out_axes lm.Carry); the carry "
                    f"goes in and comes out with the same structure."
                )
            for before, after in zip(carry_arrays, new_carry, strict=True):
                _check_carry_type(name, before, after)
            # on an explicit mesh the carry keeps the sharding it came in with
            new_carry = list(map(match_sharding, new_carry, carry_arrays))
            new_values = list(map(match_sharding, [new[s] for s in carry_slots], carry_values))
            stacked = (ys, [new[s] for s in xs_written], body.records_out())
            return (new_carry, new_values), stacked

        init = ([arrays[i] for i in carried], [values[s] for s in carry_slots])
        xs = (  # a scanned axis sharded over explicit mesh axes is gathered for the loop
            [unshard_leading(_to_front(arrays[i], array_axes[i])) for i in scanned],
            [unshard_leading(_to_front(values[s], binding.slot_axis[s])) for s in xs_slots],
            split_keys,
            body.records_in,
        )
        (carry_arrays, carry_values), (ys, xs_values, records) = jax.lax.scan(
            step, init, xs, length=self.length, reverse=self.reverse, unroll=self.unroll
        )
        carry_it, ys_it = iter(carry_arrays), iter(ys)
        leaves = [
            next(carry_it) if s is Carry else _from_front(next(ys_it), s) for s in out_info["specs"]
        ]
        out = jax.tree_util.tree_unflatten(out_info["treedef"], leaves)
        body.check_module_specs(out, self.out_axes)
        _store(binding, dict(zip(carry_slots, carry_values, strict=True)))
        _store(
            binding,
            {
                s: _from_front(v, binding.slot_axis[s])
                for s, v in zip(xs_written, xs_values, strict=True)
            },
        )
        body.absorb_records(records)
        return body.restore(out)


def _is_scanned(axis: Any) -> bool:
    return isinstance(axis, int) and axis is not Carry


def _to_front(x: Any, axis: int) -> Any:
    """`x` with its scanned `axis` first (`jax.lax.scan` scans the leading axis)."""
    return x if axis == 0 else jnp.moveaxis(x, axis, 0)


def _from_front(x: Any, axis: int) -> Any:
    """Stacked outputs (leading axis) moved to `axis`, as `out_axes` asks."""
    return x if axis == 0 else jnp.moveaxis(x, 0, axis)


def _check_carry_type(name: str, before: Any, after: Any) -> None:
    """A carried array must come out of each iteration with the shape and dtype it went in."""
    if jnp.shape(before) == jnp.shape(after) and jnp.result_type(before) == jnp.result_type(after):
        return
    was = f"{jnp.result_type(before)}{list(jnp.shape(before))}"
    now = f"{jnp.result_type(after)}{list(jnp.shape(after))}"
    raise TypeError(
        f"{name}: a carried array goes in as {was} but comes out as {now}; each iteration "
        f"must return the carry as it came in. A layer built with dtype=None computes in the "
        f"promotion of its input and variables (bfloat16 inputs with float32 parameters give "
        f"float32): pass the input in that dtype (x.astype(...)), or build the layers with an "
        f"explicit dtype."
    )


def _leaves_with_modules(out: Any) -> list[bool]:
    """For each leaf of `out` with modules as leaves: whether it is an array leaf."""
    return [
        not isinstance(x, _ModuleSlot) for x in jax.tree_util.tree_leaves(out, is_leaf=_is_slot)
    ]


class _Checkpoint(_Lifted):
    kind = "checkpoint"
    iterates = False

    def __init__(
        self,
        fn: Callable[..., Any],
        prevent_cse: bool,
        policy: Callable[..., bool] | None,
        static_argnums: int | tuple[int, ...],
    ):
        super().__init__(fn)
        self.prevent_cse, self.policy = prevent_cse, policy
        self.static = (static_argnums,) if isinstance(static_argnums, int) else static_argnums

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.checkpoint"
        static = {i % len(args) for i in self.static} if args else set()
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        binding = _bind(name, dynamic, None, allow_carry=False)

        def call(*dynamic_args: Any) -> Any:
            it = iter(dynamic_args)
            full = [args[i] if i in static else next(it) for i in range(len(args))]
            return self.fn(*full, **kwargs)

        out, new = _run_plain(binding, call, self._transform)
        _store(binding, new)
        return out

    def _transform(self, run: Callable[..., Any]) -> Callable[..., Any]:
        return jax.checkpoint(run, prevent_cse=self.prevent_cse, policy=self.policy)


def _run_plain(
    binding: _Binding,
    fn: Callable[..., Any],
    transform: Callable[[Callable[..., Any]], Callable[..., Any]],
    body: _Body | None = None,
) -> tuple[Any, dict[int, Any]]:
    """Runs `fn` under a transform that maps nothing (checkpoint): all state passes through."""
    arrays, _ = _array_leaves(binding)
    body = body or _Body(binding, fn, {}, records="plain")
    shapes = _shapes_inside(binding, {})
    mutable = binding.mutable_slots()

    def run(arrays: list, slot_values: dict, keys: dict) -> Any:
        out, new = body.run(arrays, slot_values, keys, shapes)
        return out, {s: new[s] for s in mutable}, body.records_out()

    values = binding.frame.values
    out, new, records = transform(run)(
        arrays, {s: values[s] for s in binding.slots}, binding.forked
    )
    body.absorb_records(records)
    return body.restore(out), new


def _branches(
    name: str, fns: Sequence[Callable[..., Any]], operands: tuple
) -> tuple[_Binding, list[Callable[..., Any]], list[_Body], Any, Callable[..., Any]]:
    """Shared by `cond` and `switch`: one nested-frame runner per branch, with equal outputs."""
    binding = _bind(name, operands, None, allow_carry=False)
    arrays, _ = _array_leaves(binding)
    shapes = _shapes_inside(binding, {})
    mutable = binding.mutable_slots()
    values = binding.frame.values
    bodies = [_Body(binding, fn, {}) for fn in fns]

    def runner(body: _Body) -> Callable[..., Any]:
        def run(arrays: list, slot_values: dict, keys: dict) -> Any:
            out, new = body.run(arrays, slot_values, keys, shapes)
            return out, {s: new[s] for s in mutable}

        return run

    operands_ = (arrays, {s: values[s] for s in binding.slots}, binding.forked)

    def finish(result: Any) -> Any:
        out, new = result
        first = bodies[0].modules_out
        for body in bodies[1:]:
            if len(body.modules_out) != len(first) or any(
                a is not b for a, b in zip(body.modules_out, first, strict=True)
            ):
                raise ValueError(
                    f"{name}: the branches return different modules; every branch must return "
                    f"the same modules in the same places."
                )
        _store(binding, new)
        return bodies[0].restore(out)

    return binding, [runner(b) for b in bodies], bodies, operands_, finish


def cond(
    pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], *operands: Any
) -> Any:
    """`jax.lax.cond` over functions that take modules (and arrays) as operands.

    Both branches see the operands' modules bound to the call's variables; state either
    branch writes comes out (the other branch passes it through unchanged). Modules not among
    the operands may be read, not written.

    Args:
        pred: A boolean scalar.
        true_fn: Called with the operands when `pred` is true.
        false_fn: Called with the operands otherwise.
        *operands: Modules, arrays and pytrees of them.

    Returns:
        The chosen branch's output (both must have the same structure, shapes and dtypes).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Gate(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(2, 2)
        ...     def __call__(self, x, use):
        ...         return lm.cond(use, lambda d, x: d(x), lambda d, x: x, self.dense, x)
        >>> init, apply = lm.transform(Gate())
        >>> v = init(jax.random.key(0))
        >>> apply(v, None, jnp.ones(2), False)[0].tolist()
        [1.0, 1.0]
    """
    _, runs, _bodies, operands_, finish = _branches("lm.cond", (true_fn, false_fn), operands)
    return finish(jax.lax.cond(pred, runs[0], runs[1], *operands_))


def switch(index: Any, branches: Sequence[Callable[..., Any]], *operands: Any) -> Any:
    """`jax.lax.switch` over functions that take modules (and arrays) as operands.

    Args:
        index: An int scalar; clamped to the branches' range, as in JAX.
        branches: The functions, each called with the operands.
        *operands: Modules, arrays and pytrees of them.

    Returns:
        The chosen branch's output.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Pick(lm.Module):
        ...     def __call__(self, i, x):
        ...         return lm.switch(i, [lambda x: x, lambda x: 2 * x, lambda x: 3 * x], x)
        >>> init, apply = lm.transform(Pick())
        >>> apply({}, None, 2, jnp.ones(2))[0].tolist()
        [3.0, 3.0]
    """
    if not branches:
        raise ValueError("lm.switch needs at least one branch.")
    _, runs, _bodies, operands_, finish = _branches("lm.switch", tuple(branches), operands)
    return finish(jax.lax.switch(index, runs, *operands_))


def fori_loop(
    lower: Any,
    upper: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    split_rngs: Any = None,
) -> Any:
    """`jax.lax.fori_loop` whose loop value may hold modules: their state is carried.

    ``body_fun(i, val) -> val``. The mutable state of the modules (and variables) in
    `init_val` is carried from one iteration to the next; their parameters are read as they
    are. Keys are broadcast unless `split_rngs` selects a stream, which then folds in `i`.

    Args:
        lower: The first index.
        upper: The index after the last.
        body_fun: ``body_fun(i, val) -> val``.
        init_val: The initial value: arrays, modules, variables, pytrees of them.
        split_rngs: Split the random streams into one key per iteration: ``True`` (or
            ``...``) for every stream, a stream name or a tuple of names (``"default"`` for
            the default stream), or an `lm.split_rngs` object; None (the default) broadcasts
            the keys. The iteration index is folded into the chosen streams' keys.

    Returns:
        The final value.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Count(lm.Module):
        ...     def __init__(self):
        ...         self.n = lm.State("counts", (), lm.initializers.zeros(), jnp.int32,
        ...                           mutable=True)
        ...     def __call__(self, x):
        ...         def body(i, val):
        ...             m, x = val
        ...             m.n.value = m.n + 1
        ...             return m, x * 2
        ...         return lm.fori_loop(0, 3, body, (self, x))[1]
        >>> init, apply = lm.transform(Count())
        >>> y, new = apply(init(jax.random.key(0)), None, jnp.ones(()))
        >>> float(y), int(new["counts"]["n"])
        (8.0, 3)
    """
    body_fun, split = _split_of("lm.fori_loop", body_fun, split_rngs)
    loop = _Loop("lm.fori_loop", init_val, split)

    def body(i: Any, carry: Any) -> Any:
        return loop.step(carry, lambda *val: body_fun(i, loop.rebuild(val)), index=i)

    return loop.finish(jax.lax.fori_loop(lower, upper, body, loop.init()))


def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init_val: Any,
    *,
    split_rngs: Any = None,
) -> Any:
    """`jax.lax.while_loop` whose loop value may hold modules: their state is carried.

    Args:
        cond_fun: ``cond_fun(val) -> bool scalar``; it may read, not write.
        body_fun: ``body_fun(val) -> val``.
        init_val: The initial value: arrays, modules, variables, pytrees of them.
        split_rngs: Split the random streams into one key per iteration: ``True`` (or
            ``...``) for every stream, a stream name or a tuple of names (``"default"`` for
            the default stream), or an `lm.split_rngs` object; None (the default) broadcasts
            the keys. The iteration count is folded into the chosen streams' keys.

    Returns:
        The final value.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Double(lm.Module):
        ...     def __call__(self, x):
        ...         return lm.while_loop(lambda x: x < 10, lambda x: 2 * x, x)
        >>> init, apply = lm.transform(Double())
        >>> float(apply({}, None, jnp.ones(()))[0])
        16.0
    """
    body_fun, split = _split_of("lm.while_loop", body_fun, split_rngs)
    loop = _Loop("lm.while_loop", init_val, split)

    def cond(carry: Any) -> Any:
        return loop.peek(carry, lambda *val: cond_fun(loop.rebuild(val)))

    def body(carry: Any) -> Any:
        i = carry[2]
        new = loop.step(carry, lambda *val: body_fun(loop.rebuild(val)), index=i)
        return (*new[:2], i + 1)

    init = loop.init()
    final = jax.lax.while_loop(cond, body, (*init, jnp.zeros((), jnp.int32)))
    return loop.finish(final[:2])


class _Loop:
    """The loops' shared carry: the value's arrays and its modules' mutable state."""

    def __init__(self, name: str, init_val: Any, split: split_rngs | None):
        self.name = name
        self.binding = _bind(name, (init_val,), None, allow_carry=False, split=split)
        self.arrays, _ = _array_leaves(self.binding)
        self.mutable = self.binding.mutable_slots()
        self.body = _Body(self.binding, lambda val: val, {})
        self.shapes = _shapes_inside(self.binding, {})
        self.treedef: Any = None

    def init(self) -> tuple[list, list]:
        values = self.binding.frame.values
        return list(self.arrays), [values[s] for s in self.mutable]

    def rebuild(self, val: tuple) -> Any:
        (value,) = val
        return value

    def _run(self, carry: Any, fn: Callable[..., Any], index: Any) -> tuple[Any, dict]:
        arrays, state = carry[0], carry[1]
        values = self.binding.frame.values
        slot_values = {s: values[s] for s in self.binding.slots}
        slot_values.update(zip(self.mutable, state, strict=True))
        keys = {
            s: jax.random.fold_in(k, index) if s in self.binding.split else k
            for s, k in self.binding.forked.items()
        }
        return self.body.run(arrays, slot_values, keys, self.shapes, fn)

    def step(self, carry: Any, fn: Callable[..., Any], index: Any) -> tuple[list, list]:
        out, new = self._run(carry, fn, index)
        leaves, treedef = jax.tree_util.tree_flatten(out)
        if self.treedef is None:
            self.treedef = treedef
        self.body.check_module_specs(out, None)
        return leaves, [new[s] for s in self.mutable]

    def peek(self, carry: Any, fn: Callable[..., Any]) -> Any:
        out, new = self._run(carry, fn, carry[2] if len(carry) > 2 else 0)
        for s in self.mutable:
            if new[s] is not carry[1][self.mutable.index(s)]:
                raise ValueError(
                    f"{self.name}: cond_fun wrote {self.binding.plan.variables[s].name}; the "
                    f"condition may read state, not write it."
                )
        return out

    def finish(self, final: Any) -> Any:
        arrays, state = final[0], final[1]
        _store(self.binding, dict(zip(self.mutable, state, strict=True)))
        if self.treedef is None:
            return self.body.restore(self.binding.treedef.unflatten(self.binding.leaves)[0])
        out = jax.tree_util.tree_unflatten(self.treedef, arrays)
        return self.body.restore(out)


def _decorator_or(fn: Callable[..., Any] | None, make: Callable[[Callable], Any]) -> Any:
    return make if fn is None else make(fn)


def vmap(
    fn: Callable[..., Any] | None = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_size: int | None = None,
    axis_name: Any = None,
    split_rngs: Any = None,
) -> Any:
    """`jax.vmap` for functions that take modules: a module argument's variables are mapped.

    A module's spec in `in_axes` is an int (every variable mapped on that axis), None
    (broadcast) or a `StateAxes`. Mutable state written inside comes out with the axes it
    came in with (broadcast state may only be written with a value the same for every
    member). Keys are broadcast unless `split_rngs` splits them.

    Args:
        fn: The function; modules may be among its arguments (anywhere in pytrees) and its
            results (returned with their input spec). Without it, returns a decorator.
        in_axes: Specs for the positional arguments, as `jax.vmap`'s (a prefix tree).
        out_axes: Specs for the results.
        axis_size: The mapped size, needed when nothing is mapped.
        axis_name: Names the mapped axis for collectives (`BatchNorm(axis_name=...)`).
        split_rngs: Split the random streams into one key per member: ``True`` (or
            ``...``) for every stream, a stream name or a tuple of names (``"default"`` for
            the default stream), or an `lm.split_rngs` object; None (the default) broadcasts
            the keys. The count is the mapped axis size.

    Returns:
        The lifted function; call it inside a model's method.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Ensemble(lm.Module):
        ...     def __init__(self):
        ...         self.members = lm.Stack(lm.Dense(3, 2), 4)
        ...     def __call__(self, x):
        ...         run = lm.vmap(lambda m, x: m(x), in_axes=(0, None))
        ...         return run(self.members.block, x)
        >>> init, apply = lm.transform(Ensemble())
        >>> apply(init(jax.random.key(0)), None, jnp.ones(3))[0].shape
        (4, 2)
    """
    return _decorator_or(
        fn, lambda f: _Vmap(f, in_axes, out_axes, axis_size, axis_name, split_rngs)
    )


def scan(
    fn: Callable[..., Any] | None = None,
    *,
    in_axes: Any = (Carry, 0),
    out_axes: Any = (Carry, 0),
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    split_rngs: Any = None,
) -> Any:
    """`jax.lax.scan` for functions that take modules: ``lm.scan(f)(carry, xs) -> (carry, ys)``.

    Each positional argument's spec is `Carry` (carried from step to step), 0 (scanned over
    its leading axis) or None (the same at every step); a module's may also be a
    `StateAxes`. The outputs' specs are `Carry` (the new carry, the same structure as the
    carried inputs) or 0 (stacked over the steps). State written inside must be carried or
    scanned; keys are broadcast unless `split_rngs` splits them (one per step).

    Args:
        fn: The step function. Without it, returns a decorator.
        in_axes: Specs for the positional arguments.
        out_axes: Specs for the results.
        length: The number of steps, needed when nothing is scanned.
        reverse: Scan from the end, as `jax.lax.scan`.
        unroll: Steps unrolled per loop iteration, as `jax.lax.scan`.
        split_rngs: Split the random streams into one key per step: ``True`` (or
            ``...``) for every stream, a stream name or a tuple of names (``"default"`` for
            the default stream), or an `lm.split_rngs` object; None (the default) broadcasts
            the keys. The count is the number of steps.

    Returns:
        The lifted function; call it inside a model's method.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Cumsum(lm.Module):
        ...     def __call__(self, xs):
        ...         step = lm.scan(lambda c, x: (c + x, c + x))
        ...         return step(jnp.zeros(()), xs)
        >>> init, apply = lm.transform(Cumsum())
        >>> apply({}, None, jnp.arange(4.0))[0][1].tolist()
        [0.0, 1.0, 3.0, 6.0]
    """
    return _decorator_or(
        fn, lambda f: _Scan(f, in_axes, out_axes, length, reverse, unroll, split_rngs)
    )


def checkpoint(
    fn: Callable[..., Any] | None = None,
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | tuple[int, ...] = (),
) -> Any:
    """`jax.checkpoint` (rematerialisation) for functions that take modules.

    Args:
        fn: The function. Without it, returns a decorator.
        prevent_cse: As `jax.checkpoint`.
        policy: Which intermediates to save, e.g. ``jax.checkpoint_policies.dots_saveable``.
        static_argnums: Positional arguments that are Python values, not arrays.

    Returns:
        The lifted function; call it inside a model's method.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Block(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(2, 2)
        ...     def __call__(self, x):
        ...         return lm.checkpoint(lambda d, x: lm.relu(d(x)))(self.dense, x)
        >>> init, apply = lm.transform(Block())
        >>> apply(init(jax.random.key(0)), None, jnp.ones(2))[0].shape
        (2,)
    """
    return _decorator_or(fn, lambda f: _Checkpoint(f, prevent_cse, policy, static_argnums))


remat = checkpoint
