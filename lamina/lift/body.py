"""The user's function inside a lifted transform, run in a nested frame of the same plan.

`Body.run` binds the module arguments' slots to the transform's tracers in a nested `Frame`
(with per-member shapes), calls the function there, and hands back its output with the
modules it returned replaced by `ModuleSlot` placeholders (pytree nodes without leaves, so
they cross the JAX transform) and the slots' values after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from .._core.checks import format_path
from .._core.frame import Frame
from .._core.module import Module
from .._core.rng import RngStreams
from .._core.types import Shape
from .._core.variables import State
from .axes import is_node, leaf_specs, show_spec
from .bind import Binding, Layout, describe_node, resolved_axes, shapes_inside

Records = dict[str, dict[tuple, Any]]  # {collection: {path: value}}


@jax.tree_util.register_pytree_node_class
class ModuleSlot:
    """Stands for a module among a function's outputs: a pytree node without leaves."""

    def __init__(self, index: int):
        self.index = index

    def tree_flatten(self) -> tuple[tuple, int]:
        """No children; the index is the static part."""
        return (), self.index

    @classmethod
    def tree_unflatten(cls, index: int, children: tuple) -> ModuleSlot:
        """The placeholder for the `index`-th module returned."""
        return cls(index)


def _is_slot(x: Any) -> bool:
    return isinstance(x, ModuleSlot)


def leaves_with_modules(out: Any) -> list[bool]:
    """For each leaf of `out` with modules as leaves: whether it is an array leaf."""
    return [not isinstance(x, ModuleSlot) for x in jax.tree_util.tree_leaves(out, is_leaf=_is_slot)]


class Body:
    """Runs the user's function inside a JAX transform, in a nested frame."""

    def __init__(
        self,
        binding: Binding,
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
        self.records_in, self.records_shared = self._split_given_records()

    def _split_given_records(self) -> tuple[Records, Records]:
        """The outer frame's given records: (mapped with the transform's axis, shared)."""
        records_in: Records = {}
        records_shared: Records = {}
        binding = self.binding
        outer = binding.frame.records
        if outer is None or self.records_mode == "blocked":
            return records_in, records_shared
        paths = binding.plan.module_paths()
        prefixes = [paths[m] for m in binding.module_spec if m in paths]
        for collection, entries in outer.given.items():
            for key, value in entries.items():
                mapped = self.records_mode == "mapped" and any(key[: len(p)] == p for p in prefixes)
                target = records_in if mapped else records_shared
                target.setdefault(collection, {})[key] = value
        return records_in, records_shared

    def records_out(self) -> Records:
        """What the nested frame recorded (call inside the transform, after `run`)."""
        return {} if self.inner_records is None else self.inner_records.out

    def absorb_records(self, produced: Mapping[str, Mapping[tuple, Any]]) -> None:
        """Hands what came out of the transform to the outer frame's records."""
        if self.inner_records is not None:
            self.binding.frame.records.absorb(self.inner_records, produced, self.binding.name)

    def shapes_inside(self, slot_axes: Mapping[int, Any]) -> Layout:
        """The nested frame's shapes: the frame's, with `slot_axes`'s mapped axes removed."""
        return shapes_inside(self.binding, slot_axes)

    def run(
        self,
        arrays: Sequence[Any],
        slot_values: Mapping[int, Any],
        keys: Mapping[str, Any],
        shapes: list[Shape],
        fn: Callable[..., Any] | None = None,
        extra: tuple = (),
        records_in: Mapping[str, Mapping[tuple, Any]] | None = None,
    ) -> tuple[Any, dict[int, Any]]:
        """Calls the function in a nested frame.

        `records_in` are the mapped given records (`records_in` of `__init__`), as the
        transform hands them to one iteration.

        Returns:
            Its output, with modules replaced by `ModuleSlot` nodes, and the values of the
            slots in `slot_values` after the call.
        """
        binding = self.binding
        outer = binding.frame
        values = list(outer.values)
        for slot, value in slot_values.items():
            values[slot] = value
        frame = Frame(
            outer.plan,
            values,
            RngStreams.from_keys(dict(keys)),
            outer.phase,
            shapes,
            inside=binding.name,
            writable=frozenset(binding.slots),
            records=self._nested_records(records_in),
        )
        it = iter(arrays)
        leaves = [leaf if is_node(leaf) else next(it) for leaf in binding.leaves]
        args = jax.tree_util.tree_unflatten(binding.treedef, leaves)
        with frame:
            out = (fn or self.fn)(*extra, *args, **self.kwargs)
            out = jax.tree_util.tree_map(self._slot_for, out, is_leaf=self._is_argument)
        binding.written.update(s for s, given in slot_values.items() if values[s] is not given)
        return out, {s: values[s] for s in slot_values}

    def _nested_records(self, records_in: Mapping[str, Mapping[tuple, Any]] | None) -> Any:
        """The records of one iteration's nested frame (None when the call records none)."""
        outer = self.binding.frame
        if outer.records is None:
            return None
        given = {c: dict(e) for c, e in self.records_shared.items()}
        for collection, entries in (records_in or {}).items():
            given.setdefault(collection, {}).update(entries)
        blocked = self.binding.name if self.records_mode == "blocked" else None
        records = outer.records.nested(given, blocked)
        self.inner_records = records
        return records

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
                return ModuleSlot(index)
        self.modules_out.append(leaf)
        return ModuleSlot(len(self.modules_out) - 1)

    def restore(self, out: Any) -> Any:
        """The output with its modules back in place."""
        return jax.tree_util.tree_map(
            lambda x: self.modules_out[x.index] if isinstance(x, ModuleSlot) else x,
            out,
            is_leaf=_is_slot,
        )

    def check_module_specs(self, out: Any, out_axes: Any) -> None:
        """A module returned by the function must come out with the spec it came in with."""
        binding = self.binding
        restored = self.restore(out)
        leaves = jax.tree_util.tree_leaves(restored, is_leaf=is_node)
        specs = leaf_specs(binding.name, "out_axes", out_axes, restored)
        for leaf, spec in zip(leaves, specs, strict=True):
            if is_node(leaf):
                spec_in = binding.module_spec[id(leaf)]
                if spec_in == spec:
                    continue
                axes = resolved_axes(binding.name, binding.plan, leaf, spec)
                if any(binding.slot_axis[s] != a for s, a in axes.items()):
                    raise ValueError(
                        f"{binding.name}: {describe_node(binding.plan, leaf)} is returned "
                        f"with axes {show_spec(spec)} but came in with "
                        f"{show_spec(spec_in)}: a module keeps one spec in and out."
                    )
