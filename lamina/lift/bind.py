"""Binding a lifted call's module arguments to the running frame's variables, and back.

A lifted call flattens its arguments with modules and variables as leaves; each module's
variables are the frame's values at its slots (`Plan.slots_of`), and each slot gets the axis
the module's spec gives it. The checks here refuse, before JAX sees anything, a variable
given two axes, an axis out of range, a stored layout the module could not compute with
(the layout check), and mapped inputs that disagree on the mapped size (`mapped_size`). State
that comes out of the transform is written back into the running frame (`store`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._core.checks import as_dim, format_path
from .._core.frame import Frame, current_frame
from .._core.graph import Plan
from .._core.module import Module
from .._core.types import Path, Shape
from .._core.variables import State
from .axes import (
    Carry,
    StateAxes,
    is_node,
    is_scanned,
    leaf_specs,
    show_axis,
    show_spec,
    split_rngs,
)


@dataclasses.dataclass
class Binding:
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
    # The slots some run of the function wrote (its inner value is no longer the one it was
    # given); `store` writes back only these, as a transform may hand back every value anew.
    written: set[int] = dataclasses.field(default_factory=set)

    @property
    def plan(self) -> Plan:
        """The plan of the running frame."""
        return self.frame.plan

    def mutable_slots(self) -> list[int]:
        """The argument modules' slots whose variables are mutable state."""
        return [s for s in self.slots if self.plan.variables[s].state.mutable]

    def split_keys(self, count: int) -> None:
        """Splits the chosen streams' keys into `count`, one per iteration."""
        self.forked = {
            s: jax.random.split(key, count) if s in self.split else key
            for s, key in self.forked.items()
        }


def bind(
    name: str,
    args: tuple,
    in_axes: Any,
    allow_carry: bool,
    split: split_rngs | None = None,
) -> Binding:
    """Resolves a lifted call's arguments against the running frame.

    Args:
        name: The transform, as messages write it (``"lm.vmap"``).
        args: The positional arguments; modules and variables may be anywhere in them.
        in_axes: Their specs (a prefix tree).
        allow_carry: Whether `Carry` is a spec here (`scan` only).
        split: The call's `split_rngs`, if any.

    Returns:
        The binding: each argument module's slots with their axes, and the forked keys.
    """
    frame = _running_frame(name)
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_node)
    specs = leaf_specs(name, "in_axes", in_axes, args)
    axes = _SlotAxes(name, frame, allow_carry)
    for leaf, spec in zip(leaves, specs, strict=True):
        axes.add_argument(leaf, spec)
    forked, chosen = _fork_keys(name, frame, split)
    return Binding(
        name=name,
        frame=frame,
        treedef=treedef,
        leaves=leaves,
        leaf_specs=specs,
        module_spec=axes.module_spec,
        slots=sorted(axes.slot_axis),
        slot_axis=axes.slot_axis,
        forked=forked,
        split=chosen,
        stacked_inside=axes.stacked_inside,
    )


def _running_frame(name: str) -> Frame:
    """The frame of the call in progress; refuses outside one or inside a raw JAX transform."""
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
    return frame


class _SlotAxes:
    """The axes that a lifted call's module arguments give their variables, checked as added."""

    def __init__(self, name: str, frame: Frame, allow_carry: bool):
        self.name = name
        self.frame = frame
        self.allow_carry = allow_carry
        self.module_spec: dict[int, Any] = {}
        self.slot_axis: dict[int, Any] = {}
        self.slot_owner: dict[int, tuple[Any, Any]] = {}
        self.stacked = _stacked_counts(frame)
        self.stacked_inside = list(self.stacked)

    def add_argument(self, leaf: Any, spec: Any) -> None:
        """Gives the slots of `leaf` (a module, a variable or an array) their axes."""
        self._check_carry_allowed(spec)
        if not is_node(leaf):
            if isinstance(spec, StateAxes):
                raise TypeError(
                    f"{self.name}: StateAxes is the spec of a module argument, but it was "
                    f"given for a {type(leaf).__name__}."
                )
            return
        self.module_spec.setdefault(id(leaf), spec)
        for slot, axis in resolved_axes(self.name, self.frame.plan, leaf, spec).items():
            self._assign(leaf, spec, slot, axis)

    def _assign(self, leaf: Any, spec: Any, slot: int, axis: Any) -> None:
        self._check_carry_allowed(axis)
        self._check_one_axis(leaf, spec, slot, axis)
        self._check_in_range(slot, axis)
        self.slot_axis[slot] = axis
        self.slot_owner.setdefault(slot, (leaf, spec))
        self.stacked_inside[slot] = _check_layout(
            self.name, self.frame, self.stacked, leaf, spec, slot, axis
        )

    def _check_carry_allowed(self, axis: Any) -> None:
        if axis is Carry and not self.allow_carry:
            raise TypeError(f"{self.name}: lm.Carry is an axis spec of lm.scan only.")

    def _check_one_axis(self, leaf: Any, spec: Any, slot: int, axis: Any) -> None:
        """A variable reached through two arguments (or twice) must get one axis."""
        if slot not in self.slot_axis or self.slot_axis[slot] == axis:
            return
        plan, name, entry = self.frame.plan, self.name, self.frame.plan.variables[slot]
        other, other_spec = self.slot_owner[slot]
        if other is leaf:
            raise ValueError(
                f"{name}: {describe_node(plan, leaf)} is passed twice with different "
                f"axes for {entry.name}: {show_axis(self.slot_axis[slot])} (from "
                f"{show_spec(other_spec)}) and {show_axis(axis)} (from "
                f"{show_spec(spec)}). Pass it once, or with specs that give each "
                f"variable the same axis."
            )
        raise ValueError(
            f"{name}: {entry.name} is shared by {describe_node(plan, other)} "
            f"(axis {show_axis(self.slot_axis[slot])} from {show_spec(other_spec)}) and "
            f"{describe_node(plan, leaf)} (axis {show_axis(axis)} from "
            f"{show_spec(spec)}): one variable, one axis."
        )

    def _check_in_range(self, slot: int, axis: Any) -> None:
        shape = self.frame.shapes[slot]
        if isinstance(axis, int) and not (-len(shape) <= axis < len(shape)):
            raise ValueError(
                f"{self.name}: axis {axis} is out of range for "
                f"{self.frame.plan.variables[slot].name}, of shape {shape}."
            )


def _fork_keys(
    name: str, frame: Frame, split: split_rngs | None
) -> tuple[dict[str, Any], frozenset[str]]:
    """The call's forked keys (each stream advances once) and the streams to split."""
    forked = frame.rngs.fork()
    chosen: frozenset[str] = frozenset()
    if split is not None:
        split.check_streams(name, list(forked))
        chosen = frozenset(s for s in forked if split.selects(s))
    return forked, chosen


def resolved_axes(name: str, plan: Plan, node: Any, spec: Any) -> dict[int, Any]:
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


def describe_node(plan: Plan, node: Any) -> str:
    """A module or variable argument, as messages write it."""
    if isinstance(node, State):
        return f"the variable {plan.variables[node._lamina_slot].name}"  # type: ignore[index]
    return f"the module at {format_path(plan.module_paths()[id(node)])}"


def _path_of(plan: Plan, module: Module, name: str) -> Path:
    path = plan.module_paths().get(id(module))
    if path is None:
        raise ValueError(
            f"{name} got a {type(module).__name__} that is not part of the model being "
            f"applied (lm.transform works on a copy of the model): pass modules reached "
            f"through `self` inside the model's methods."
        )
    return path


# --- stored layouts inside lifted transforms -------------------------------------------------


class Layout(list):
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


def _layout(shapes: list[Shape], stacked: list[int]) -> Layout:
    layout = Layout(shapes)
    layout.stacked = stacked
    return layout


def shapes_inside(binding: Binding, slot_axes: Mapping[int, Any]) -> Layout:
    """The nested frame's shapes: the frame's, with `slot_axes`'s mapped axes removed."""
    shapes = list(binding.frame.shapes)
    for slot, axis in slot_axes.items():
        if is_scanned(axis):
            shape = list(shapes[slot])
            del shape[axis]
            shapes[slot] = tuple(shape)
    return _layout(shapes, binding.stacked_inside)


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
    mapped = axis % len(shape) if is_scanned(axis) else None
    left = _stacked_left(name, entry, shape, stacked[slot], axis, mapped)
    if isinstance(node, State):
        return left
    around = plan.stacked_axes(node)
    wanted = len(entry.axes) - len(around)
    inside = shape if mapped is None else shape[:mapped] + shape[mapped + 1 :]
    expected = entry.shape[len(around) :]
    if left == wanted and inside == expected:
        return left
    mismatch = _LayoutMismatch(
        name=name,
        where=describe_node(plan, node),
        entry=entry,
        shape=shape,
        axis=axis,
        spec=spec,
        mapped=mapped,
        left=left,
        wanted=wanted,
        around=around,
        inside=inside,
        expected=expected,
    )
    raise mismatch.error()


def _stacked_left(
    name: str, entry: Any, shape: Shape, left: int, axis: Any, mapped: int | None
) -> int:
    """The stacked axes left after mapping `axis`: one fewer if it maps the leading one."""
    if mapped is not None and mapped < left:
        if mapped != 0:
            raise ValueError(
                f"{name}: axis {axis} of {entry.name} (of shape {shape} here, whose first "
                f"{left} axes are stacked copies) is an inner stacked axis: map the outer one "
                f"(axis 0) first."
            )
        left -= 1
    return left


@dataclasses.dataclass
class _LayoutMismatch:
    """A module argument's variable that would reach the function in the wrong shape."""

    name: str
    where: str  # the module, as messages write it
    entry: Any  # its `VariableEntry`
    shape: Shape  # stored in the running frame
    axis: Any
    spec: Any
    mapped: int | None  # the axis mapped away, non-negative; None if none is
    left: int  # stacked axes each member would see
    wanted: int  # stacked axes the module computes with
    around: tuple  # the `StackedAxis`es of the Stacks around the module
    inside: Shape  # the shape each member would get
    expected: Shape  # the shape the module computes with

    def error(self) -> ValueError:
        return ValueError(f"{self.name}: {self._stored()}; {self._why()}.")

    @property
    def member(self) -> str:
        return "step" if self.name == "lm.scan" else "member"

    @property
    def given(self) -> str:
        return f"with axis {show_axis(self.axis)} (from {show_spec(self.spec)})"

    def _why(self) -> str:
        if self.left > self.wanted:
            return self._inside_stacks()
        if self.left < self.wanted:
            return self._runs_the_copies()
        if self.mapped is not None:
            return self._nothing_to_map()
        return self._copies_not_mapped()

    def _inside_stacks(self) -> str:
        stacks = " and ".join(
            f"the {type(a.owner).__name__} at {format_path(a.path)} ({a.size} copies)"
            for a in self.around
        )
        return (
            f"{self.where} lies inside {stacks} and runs on one copy, so each {self.member} "
            f"must get it as {self.expected}, but {self.given} it would get {self.inside}, "
            f"every copy at once. Map the stacked axis (axis 0 for this variable: an int "
            f"spec, or a StateAxes whose first matching filter gives 0), or pass the Stack "
            f"itself"
        )

    def _runs_the_copies(self) -> str:
        return (
            f"{self.where} runs the stacked copies itself, so it must get it as "
            f"{self.expected}, but {self.given} it would get {self.inside}, one copy. "
            f"Broadcast it (None), or pass the Stack's block to map its copies"
        )

    def _nothing_to_map(self) -> str:
        if self.entry.axes:
            reason = (
                "the transform around this one mapped its stacked copies already (each of its "
                "members holds one copy)"
            )
            fix = (
                "Broadcast it (None), or build the copies with lm.Stack(block, n) and map the "
                "Stack's block once"
            )
        else:
            reason = "it has no axis of copies to map (only a Stack stores copies)"
            fix = (
                f"Broadcast it (None); or, to map the variables' own axes, pass the variables "
                f"themselves as arguments with their axes instead of the module (e.g. "
                f"{self.name}(f, in_axes=(None, 0, 0))(self.mem.w, self.mem.h, x), f "
                f"computing with the arrays it gets); or declare the per-{self.member} shape "
                f"and hold the copies in lm.Stack(block, n), mapping the Stack's block"
            )
        return (
            f"{self.where} computes with {self.expected}, but {self.given} each "
            f"{self.member} would get it as {self.inside}: {reason}. {fix}"
        )

    def _copies_not_mapped(self) -> str:
        return (
            f"{self.where} computes with {self.expected}, but {self.given} each "
            f"{self.member} would get it as {self.shape}. Map the axis that holds its "
            f"copies, or pass the module it lies in"
        )

    def _stored(self) -> str:
        entry = self.entry
        if entry.axes:
            return (
                f"{entry.name} is stored as {entry.shape} (stacked axes {entry.axes} in front "
                f"of its declared shape {entry.state.shape})"
            )
        return f"{entry.name} is stored as {entry.shape}, its declared shape"


# --- mapped inputs and state back out --------------------------------------------------------


def mapped_size(
    binding: Binding,
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
    sizes = _array_sizes(binding, arrays, array_axes)
    arrays_mapped = len(sizes)
    shapes = binding.frame.shapes
    for slot in binding.slots:
        axis = binding.slot_axis[slot]
        if is_scanned(axis):
            sizes.append((as_dim(shapes[slot][axis]), slot, axis))
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


def _array_sizes(
    binding: Binding, arrays: list[Any], array_axes: list[Any]
) -> list[tuple[int, Any, Any]]:
    """``(size, array index, axis)`` of each mapped array, its axis checked against its rank."""
    sizes: list[tuple[int, Any, Any]] = []
    for index, (leaf, axis) in enumerate(zip(arrays, array_axes, strict=True)):
        if not is_scanned(axis):
            continue
        shape = jnp.shape(leaf)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(
                f"{binding.name}: in_axes gives axis {axis} for {_argument_at(binding, index)}, "
                f"of shape {tuple(shape)}, which has no axis {axis}: give an axis in "
                f"[{-len(shape)}, {len(shape)}), or None to broadcast it."
            )
        sizes.append((as_dim(shape[axis]), index, axis))
    return sizes


def _argument_at(binding: Binding, index: int) -> str:
    """The `index`-th array argument leaf, as messages write it (``args[1]['x']``)."""
    args = jax.tree_util.tree_unflatten(binding.treedef, binding.leaves)
    paths = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_node)[0]
    arrays = [path for path, leaf in paths if not is_node(leaf)]
    return f"the argument args{jax.tree_util.keystr(arrays[index])}"


def array_leaves(binding: Binding) -> tuple[list[Any], list[Any]]:
    """The non-module argument leaves, and their specs."""
    pairs = [
        (leaf, spec)
        for leaf, spec in zip(binding.leaves, binding.leaf_specs, strict=True)
        if not is_node(leaf)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def store(binding: Binding, new_values: Mapping[int, Any]) -> None:
    """Writes state that came out of a transform into the outer frame.

    Only the slots the function wrote (`Binding.written`): a transform such as
    ``jax.checkpoint`` hands every value back as a new array, and a slot it merely passed
    through must stay the outer frame's own value (unwritten, as `apply` reports it).
    """
    values = binding.frame.values
    for slot, value in new_values.items():
        if slot in binding.written:
            values[slot] = value
