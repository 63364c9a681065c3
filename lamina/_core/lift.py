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
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .errors import format_path
from .filters import describe, to_predicate
from .frame import Frame, current_frame
from .graph import Plan
from .module import Module
from .rng import RngStreams, stream_label


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


def _is_module(x: Any) -> bool:
    return isinstance(x, Module)


# --- split_rngs ------------------------------------------------------------------------------


class _SplitStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[split_rngs | None] = []


_SPLITS = _SplitStack()


class split_rngs:
    """Splits random streams into one key per iteration of the next lifted transform.

    Use it as a decorator of a lifted function or as a context manager around its call.
    Without it, a lifted transform broadcasts its keys: every vmapped member (every scanned
    layer) draws the same dropout mask.

    Args:
        splits: The number of iterations (the mapped axis size, the scan length); the
            loops fold the iteration index in instead and accept any value.
        only: The streams to split: a name, a tuple of names, or ``...`` (all streams,
            the default stream included).

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
        if only is not Ellipsis and only is not True:
            names = (only,) if isinstance(only, str) else only
            if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"split_rngs: only is a stream name, a tuple of names or ..., got {only!r}."
                )
        self.splits = splits
        self.only = only

    def selects(self, stream: str) -> bool:
        """Whether `stream` (an internal stream name) is split."""
        if self.only is Ellipsis or self.only is True:
            return True
        names = (self.only,) if isinstance(self.only, str) else self.only
        return stream_label(stream) in names or stream in names

    def __enter__(self) -> split_rngs:
        _SPLITS.stack.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _SPLITS.stack.pop()

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapped

    def __repr__(self) -> str:
        only = "..." if self.only is Ellipsis else repr(self.only)
        return f"split_rngs(splits={self.splits}, only={only})"


@contextlib.contextmanager
def _no_split() -> Iterator[None]:
    # A split applies to the next lifted transform only, not to the ones its body calls.
    _SPLITS.stack.append(None)
    try:
        yield
    finally:
        _SPLITS.stack.pop()


def _active_split() -> split_rngs | None:
    return _SPLITS.stack[-1] if _SPLITS.stack else None


# --- binding module arguments ----------------------------------------------------------------


@dataclasses.dataclass
class _Binding:
    """One lifted call's module arguments, resolved against the running frame."""

    name: str
    frame: Frame
    treedef: Any
    leaves: list[Any]  # the arguments' leaves; modules stay in place
    leaf_specs: list[Any]
    module_spec: dict[int, Any]  # id(module) -> spec
    slots: list[int]  # the argument modules' slots, increasing
    slot_axis: dict[int, Any]  # slot -> int | None | Carry
    forked: dict[str, Any]  # stream -> key (split streams: n keys)
    split: frozenset[str]

    @property
    def plan(self) -> Plan:
        return self.frame.plan

    def mutable_slots(self) -> list[int]:
        return [s for s in self.slots if self.plan.variables[s].state.mutable]


def _bind(
    name: str,
    args: tuple,
    in_axes: Any,
    allow_carry: bool,
    length: int | None,
    split_keys: bool = True,
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
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_module)
    leaf_specs = _leaf_specs(name, "in_axes", in_axes, args)
    plan = frame.plan
    module_spec: dict[int, Any] = {}
    slot_axis: dict[int, Any] = {}
    slot_owner: dict[int, tuple[Module, Any]] = {}
    for leaf, spec in zip(leaves, leaf_specs, strict=True):
        if not isinstance(spec, StateAxes):
            _check_axis(spec, f"{name}: in_axes")
        if spec is Carry and not allow_carry:
            raise TypeError(f"{name}: lm.Carry is an axis spec of lm.scan only.")
        if not isinstance(leaf, Module):
            if isinstance(spec, StateAxes):
                raise TypeError(
                    f"{name}: StateAxes is the spec of a module argument, but it was given for "
                    f"a {type(leaf).__name__}."
                )
            continue
        path = _path_of(plan, leaf, name)
        previous = module_spec.get(id(leaf), _UNSET)
        if previous is not _UNSET and previous != spec:
            raise ValueError(
                f"{name}: the module at {format_path(path)} is passed twice with different "
                f"axes, {_show_spec(previous)} and {_show_spec(spec)}. Pass it once, or with "
                f"the same spec."
            )
        module_spec[id(leaf)] = spec
        for slot in plan.slots_of(leaf):
            entry = plan.variables[slot]
            axis = spec.axis_of(plan, entry) if isinstance(spec, StateAxes) else spec
            if axis is Carry and not allow_carry:
                raise TypeError(f"{name}: lm.Carry is an axis spec of lm.scan only.")
            if slot in slot_axis and slot_axis[slot] != axis:
                other, other_spec = slot_owner[slot]
                raise ValueError(
                    f"{name}: {entry.name} is shared by the module at "
                    f"{format_path(_path_of(plan, other, name))} (axis "
                    f"{_show_axis(slot_axis[slot])} from {_show_spec(other_spec)}) and the "
                    f"module at {format_path(path)} (axis {_show_axis(axis)} from "
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
    split = _active_split()
    forked = frame.rngs.fork()
    chosen = frozenset(s for s in forked if split is not None and split.selects(s))
    if split is not None and split_keys:
        if length is not None and split.splits != length:
            raise ValueError(
                f"{name}: split_rngs(splits={split.splits}) but the transform runs {length} "
                f"iterations; make them equal."
            )
        forked = {
            s: jax.random.split(key, split.splits) if s in chosen else key
            for s, key in forked.items()
        }
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
    )


_UNSET = object()


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
    """One spec per leaf (modules are leaves) of `tree`, from `specs`, a prefix of it."""
    if _is_spec(specs):
        return [specs] * len(jax.tree_util.tree_leaves(tree, is_leaf=_is_module))
    if isinstance(tree, tuple) and isinstance(specs, list):
        specs = tuple(specs)
    try:
        nested = jax.tree_util.tree_map(
            lambda spec, sub: _Group(
                [spec] * len(jax.tree_util.tree_leaves(sub, is_leaf=_is_module))
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
            prefixes = [paths[m] for m in binding.module_spec]
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

    def shapes_inside(self, slot_axes: Mapping[int, Any]) -> list[tuple[int, ...]]:
        shapes = list(self.binding.frame.shapes)
        for slot, axis in slot_axes.items():
            if isinstance(axis, int):
                shape = list(shapes[slot])
                del shape[axis]
                shapes[slot] = tuple(shape)
        return shapes

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
        leaves = [leaf if isinstance(leaf, Module) else next(it) for leaf in binding.leaves]
        args = jax.tree_util.tree_unflatten(binding.treedef, leaves)
        with frame, _no_split():
            out = (fn or self.fn)(*extra, *args, **self.kwargs)
            out = jax.tree_util.tree_map(self._slot_for, out, is_leaf=_is_module)
        return out, {s: values[s] for s in slot_values}

    def _slot_for(self, leaf: Any) -> Any:
        if not isinstance(leaf, Module):
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
        restored = self.restore(out)
        leaves = jax.tree_util.tree_leaves(restored, is_leaf=_is_module)
        specs = _leaf_specs(self.binding.name, "out_axes", out_axes, restored)
        for leaf, spec in zip(leaves, specs, strict=True):
            if isinstance(leaf, Module):
                spec_in = self.binding.module_spec[id(leaf)]
                if spec_in != spec:
                    path = format_path(self.binding.plan.module_paths()[id(leaf)])
                    raise ValueError(
                        f"{self.binding.name}: the module at {path} is returned with axes "
                        f"{_show_spec(spec)} but came in with {_show_spec(spec_in)}: a "
                        f"module keeps one spec in and out."
                    )


def _array_leaves(binding: _Binding) -> tuple[list[Any], list[Any]]:
    """The non-module argument leaves, and their specs."""
    pairs = [
        (leaf, spec)
        for leaf, spec in zip(binding.leaves, binding.leaf_specs, strict=True)
        if not isinstance(leaf, Module)
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

    def __init__(self, fn: Callable[..., Any]):
        if not callable(fn):
            raise TypeError(f"lm.{self.kind} transforms a function, got {type(fn).__name__}.")
        self.fn = fn
        functools.update_wrapper(self, fn)

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
    ):
        super().__init__(fn)
        self.in_axes, self.out_axes = in_axes, out_axes
        self.axis_size, self.axis_name = axis_size, axis_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.vmap"
        binding = _bind(name, args, self.in_axes, allow_carry=False, length=self.axis_size)
        arrays, array_axes = _array_leaves(binding)
        slot_axes = {s: binding.slot_axis[s] for s in binding.slots}
        size = self.axis_size
        if (
            size is None
            and not binding.split
            and not any(isinstance(a, int) for a in [*array_axes, *slot_axes.values()])
        ):
            raise ValueError(
                f"{name}: nothing is mapped (every in_axes is None), so the axis size is "
                f"unknown: pass axis_size=n."
            )
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
    ):
        super().__init__(fn)
        self.in_axes, self.out_axes = in_axes, out_axes
        self.length, self.reverse, self.unroll = length, reverse, unroll

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = "lm.scan"
        binding = _bind(name, args, self.in_axes, allow_carry=True, length=self.length)
        arrays, array_axes = _array_leaves(binding)
        for axis in [*array_axes, *binding.slot_axis.values()]:
            if axis not in (0, None) and axis is not Carry:
                raise ValueError(
                    f"{name} scans over axis 0: an axis spec is 0, None or lm.Carry, got "
                    f"{axis!r}. Move the axis first (jnp.moveaxis) to scan over another."
                )
        carried = [i for i, a in enumerate(array_axes) if a is Carry]
        scanned = [i for i, a in enumerate(array_axes) if a == 0 and a is not Carry]
        carry_slots = [s for s in binding.slots if binding.slot_axis[s] is Carry]
        xs_slots = [s for s in binding.slots if binding.slot_axis[s] == 0]
        bcast_slots = [s for s in binding.slots if binding.slot_axis[s] is None]
        mutable = set(binding.mutable_slots())
        xs_written = [s for s in xs_slots if s in mutable]
        body = _Body(binding, self.fn, kwargs, records="mapped")
        shapes = body.shapes_inside({s: 0 for s in xs_slots})
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
                        f"first value again. Carry it (lm.Carry, e.g. in StateAxes) or scan "
                        f"it (axis 0)."
                    )
            specs = _leaf_specs(name, "out_axes", self.out_axes, body.restore(out))
            leaves, treedef = jax.tree_util.tree_flatten(out)
            leaf_specs = [s for s, x in zip(specs, _leaves_with_modules(out), strict=True) if x]
            for spec in leaf_specs:
                if spec is not Carry and spec != 0:
                    raise ValueError(
                        f"{name}: out_axes are lm.Carry (the new carry) or 0 (stacked), got "
                        f"{spec!r}."
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
            stacked = (ys, [new[s] for s in xs_written], body.records_out())
            return (new_carry, [new[s] for s in carry_slots]), stacked

        init = ([arrays[i] for i in carried], [values[s] for s in carry_slots])
        xs = (
            [arrays[i] for i in scanned],
            [values[s] for s in xs_slots],
            split_keys,
            body.records_in,
        )
        (carry_arrays, carry_values), (ys, xs_values, records) = jax.lax.scan(
            step, init, xs, length=self.length, reverse=self.reverse, unroll=self.unroll
        )
        carry_it, ys_it = iter(carry_arrays), iter(ys)
        leaves = [next(carry_it) if s is Carry else next(ys_it) for s in out_info["specs"]]
        out = jax.tree_util.tree_unflatten(out_info["treedef"], leaves)
        body.check_module_specs(out, self.out_axes)
        _store(binding, dict(zip(carry_slots, carry_values, strict=True)))
        _store(binding, dict(zip(xs_written, xs_values, strict=True)))
        body.absorb_records(records)
        return body.restore(out)


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
        binding = _bind(name, dynamic, None, allow_carry=False, length=None)

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
    shapes = list(binding.frame.shapes)
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
    binding = _bind(name, operands, None, allow_carry=False, length=None)
    arrays, _ = _array_leaves(binding)
    shapes = list(binding.frame.shapes)
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


def fori_loop(lower: Any, upper: Any, body_fun: Callable[..., Any], init_val: Any) -> Any:
    """`jax.lax.fori_loop` whose loop value may hold modules: their state is carried.

    ``body_fun(i, val) -> val``. The mutable state of the modules in `init_val` is carried
    from one iteration to the next; their parameters are read as they are. Keys are
    broadcast unless `split_rngs` selects a stream, which then folds in `i`.

    Args:
        lower: The first index.
        upper: The index after the last.
        body_fun: ``body_fun(i, val) -> val``.
        init_val: The initial value: arrays, modules, pytrees of them.

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
    loop = _Loop("lm.fori_loop", init_val)

    def body(i: Any, carry: Any) -> Any:
        return loop.step(carry, lambda *val: body_fun(i, loop.rebuild(val)), index=i)

    return loop.finish(jax.lax.fori_loop(lower, upper, body, loop.init()))


def while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """`jax.lax.while_loop` whose loop value may hold modules: their state is carried.

    Args:
        cond_fun: ``cond_fun(val) -> bool scalar``; it may read, not write.
        body_fun: ``body_fun(val) -> val``.
        init_val: The initial value: arrays, modules, pytrees of them.

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
    loop = _Loop("lm.while_loop", init_val)

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

    def __init__(self, name: str, init_val: Any):
        self.name = name
        self.binding = _bind(
            name, (init_val,), None, allow_carry=False, length=None, split_keys=False
        )
        self.arrays, _ = _array_leaves(self.binding)
        self.mutable = self.binding.mutable_slots()
        self.body = _Body(self.binding, lambda val: val, {})
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
        return self.body.run(arrays, slot_values, keys, list(self.binding.frame.shapes), fn)

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
    return _decorator_or(fn, lambda f: _Vmap(f, in_axes, out_axes, axis_size, axis_name))


def scan(
    fn: Callable[..., Any] | None = None,
    *,
    in_axes: Any = (Carry, 0),
    out_axes: Any = (Carry, 0),
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
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
    return _decorator_or(fn, lambda f: _Scan(f, in_axes, out_axes, length, reverse, unroll))


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
