"""The iteration transforms: `vmap` and `scan` over functions that take modules.

A module argument's variables are mapped (scanned) with the axes its spec gives them; the
function runs in a nested frame where each member (step) sees its own slice, and mutable
state written there comes back out with the same axes. Keys are broadcast unless the call
splits them (`split_rngs`), one key per member or per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..sharding.explicit import match_sharding, unshard_leading
from .axes import Carry, is_scanned, jax_axes, leaf_specs
from .bind import Binding, Layout, array_leaves, bind, mapped_size, store
from .body import Body, leaves_with_modules
from .lifted import Lifted, decorator_or

# --- vmap ------------------------------------------------------------------------------------


class _Vmap(Lifted):
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
        binding = bind("lm.vmap", args, self.in_axes, allow_carry=False, split=self.split)
        arrays, array_axes = array_leaves(binding)
        size = self._axis_size(binding, arrays, array_axes)
        if self.split is not None:
            binding.split_keys(size)
        body = Body(binding, self.fn, kwargs, records="mapped")
        out, new, records = self._map(binding, body, arrays, array_axes, size)
        body.check_module_specs(out, self.out_axes)
        store(binding, new)
        body.absorb_records(records)
        return body.restore(out)

    def _axis_size(self, binding: Binding, arrays: list[Any], array_axes: list[Any]) -> int:
        """The mapped size: the mapped inputs', ``axis_size=``, and the split's, all equal."""
        size = mapped_size(binding, arrays, array_axes, self.axis_size, "axis_size")
        if self.split is not None:
            size = self.split.check_size("lm.vmap", size)
        if size is None:
            raise ValueError(
                "lm.vmap: nothing is mapped (every in_axes is None), so the axis size is "
                "unknown: pass axis_size=n."
            )
        return size

    def _map(
        self, binding: Binding, body: Body, arrays: list[Any], array_axes: list[Any], size: int
    ) -> tuple[Any, dict[int, Any], Any]:
        """Runs the body under `jax.vmap`: its output, the mutable state, the records."""
        slot_axes = {s: binding.slot_axis[s] for s in binding.slots}
        shapes = body.shapes_inside(slot_axes)
        mutable = binding.mutable_slots()
        state_out = {s: slot_axes[s] for s in mutable}
        key_axes = {s: 0 if s in binding.split else None for s in binding.forked}

        def run(arrays: list, slot_values: dict, keys: dict, records_in: dict) -> Any:
            out, new = body.run(arrays, slot_values, keys, shapes, records_in=records_in)
            return out, {s: new[s] for s in mutable}, body.records_out()

        try:
            return jax.vmap(
                run,
                in_axes=(array_axes, slot_axes, key_axes, 0),
                out_axes=(jax_axes(self.out_axes), state_out, 0),
                axis_size=size,
                axis_name=self.axis_name,
            )(
                arrays,
                {s: binding.frame.values[s] for s in binding.slots},
                binding.forked,
                body.records_in,
            )
        except ValueError as error:
            refused = _broadcast_write(binding, state_out, error)
            if refused is not None:
                raise refused from error
            raise


def _broadcast_write(
    binding: Binding, state_out: dict[int, Any], error: ValueError
) -> ValueError | None:
    """The error to raise when `jax.vmap` refused to broadcast written state, else None."""
    broadcast = [binding.plan.variables[s].name for s, axis in state_out.items() if axis is None]
    if broadcast and "out_axes" in str(error):
        return ValueError(
            f"lm.vmap: a broadcast variable (axis None) was written with a value that "
            f"differs per member (broadcast state here: {', '.join(broadcast)}). Map "
            f"it (an int axis, e.g. in StateAxes), or write a value that is the same "
            f"for every member."
        )
    return None


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
    return decorator_or(fn, lambda f: _Vmap(f, in_axes, out_axes, axis_size, axis_name, split_rngs))


# --- scan ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _ScanInputs:
    """A scan's inputs split by spec: carried, scanned and broadcast arrays and slots."""

    arrays: list[Any]  # the array argument leaves
    array_axes: list[Any]
    carried: list[int]  # indices into `arrays`
    scanned: list[int]
    carry_slots: list[int]
    xs_slots: list[int]
    bcast_slots: list[int]
    mutable: set[int]
    xs_written: list[int]  # the scanned slots whose state is mutable


def _split_inputs(binding: Binding) -> _ScanInputs:
    """Sorts the arguments' arrays and the module arguments' slots by their specs."""
    arrays, array_axes = array_leaves(binding)
    axis = binding.slot_axis
    xs_slots = [s for s in binding.slots if is_scanned(axis[s])]
    mutable = set(binding.mutable_slots())
    return _ScanInputs(
        arrays=arrays,
        array_axes=array_axes,
        carried=[i for i, a in enumerate(array_axes) if a is Carry],
        scanned=[i for i, a in enumerate(array_axes) if is_scanned(a)],
        carry_slots=[s for s in binding.slots if axis[s] is Carry],
        xs_slots=xs_slots,
        bcast_slots=[s for s in binding.slots if axis[s] is None],
        mutable=mutable,
        xs_written=[s for s in xs_slots if s in mutable],
    )


def _scan_inits(binding: Binding, inputs: _ScanInputs) -> tuple[list, list]:
    """The initial carry: the carried arrays and the carried slots' values."""
    values = binding.frame.values
    return [inputs.arrays[i] for i in inputs.carried], [values[s] for s in inputs.carry_slots]


def _scanned_inputs(binding: Binding, inputs: _ScanInputs, body: Body) -> tuple:
    """The scanned arrays and slots (scanned axis first), split keys and mapped records."""
    values = binding.frame.values
    # a scanned axis sharded over explicit mesh axes is gathered for the loop
    return (
        [
            unshard_leading(_to_front(inputs.arrays[i], inputs.array_axes[i]))
            for i in inputs.scanned
        ],
        [unshard_leading(_to_front(values[s], binding.slot_axis[s])) for s in inputs.xs_slots],
        {s: k for s, k in binding.forked.items() if s in binding.split},
        body.records_in,
    )


@jax.tree_util.register_pytree_node_class
class _OutputLayout:
    """A step's output structure and its array leaves' specs: static, it crosses the scan."""

    def __init__(self, treedef: Any, specs: tuple[Any, ...]):
        self.treedef = treedef
        self.specs = specs

    def tree_flatten(self) -> tuple[tuple, tuple[Any, tuple[Any, ...]]]:
        return (), (self.treedef, self.specs)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, tuple[Any, ...]], children: tuple) -> _OutputLayout:
        return cls(*aux)


class _ScanStep:
    """One step of the scan: merges its inputs, runs the body, splits its outputs."""

    def __init__(self, binding: Binding, inputs: _ScanInputs, body: Body, out_axes: Any):
        self.binding = binding
        self.inputs = inputs
        self.body = body
        self.out_axes = out_axes
        self.shapes: Layout = body.shapes_inside({s: binding.slot_axis[s] for s in inputs.xs_slots})
        self.bcast_keys = {s: k for s, k in binding.forked.items() if s not in binding.split}

    def __call__(self, carry: Any, xs: Any) -> Any:
        carry_arrays, carry_values = carry
        xs_arrays, xs_values, keys, records_in = xs
        merged = self._merge_arrays(carry_arrays, xs_arrays)
        slot_values = self._slot_values(carry_values, xs_values)
        out, new = self.body.run(
            merged, slot_values, {**self.bcast_keys, **keys}, self.shapes, records_in=records_in
        )
        self._check_broadcast_unwritten(new)
        leaves, layout = self._output_layout(out)
        new_carry, ys = self._split_outputs(leaves, layout, carry_arrays)
        inputs = self.inputs
        new_values = list(map(match_sharding, [new[s] for s in inputs.carry_slots], carry_values))
        stacked = (ys, [new[s] for s in inputs.xs_written], self.body.records_out(), layout)
        return (new_carry, new_values), stacked

    def _merge_arrays(self, carry_arrays: list, xs_arrays: list) -> list:
        """The step's array arguments: the carried and scanned ones in their places."""
        inputs = self.inputs
        merged = list(inputs.arrays)
        for i, a in zip(inputs.carried, carry_arrays, strict=True):
            merged[i] = a
        for i, a in zip(inputs.scanned, xs_arrays, strict=True):
            merged[i] = a
        return merged

    def _slot_values(self, carry_values: list, xs_values: list) -> dict[int, Any]:
        """The step's slot values: broadcast as they are, carried and scanned as given."""
        inputs = self.inputs
        values = self.binding.frame.values
        slot_values = {s: values[s] for s in inputs.bcast_slots}
        slot_values.update(zip(inputs.carry_slots, carry_values, strict=True))
        slot_values.update(zip(inputs.xs_slots, xs_values, strict=True))
        return slot_values

    def _check_broadcast_unwritten(self, new: dict[int, Any]) -> None:
        values = self.binding.frame.values
        for s in self.inputs.bcast_slots:
            if s in self.inputs.mutable and new[s] is not values[s]:
                raise ValueError(
                    f"lm.scan: {self.binding.plan.variables[s].name} is broadcast (axis None) "
                    f"but was written inside the scan, where each step would see the "
                    f"first value again (Flax NNX's scan refuses broadcast output state "
                    f"too). Carry it (lm.Carry, e.g. in StateAxes) or scan it (an int "
                    f"axis)."
                )

    def _output_layout(self, out: Any) -> tuple[list[Any], _OutputLayout]:
        """The output's array leaves, and its structure with their specs (checked)."""
        specs = leaf_specs("lm.scan", "out_axes", self.out_axes, self.body.restore(out))
        leaves, treedef = jax.tree_util.tree_flatten(out)
        array_specs = [s for s, x in zip(specs, leaves_with_modules(out), strict=True) if x]
        for spec in array_specs:
            if not is_scanned(spec) and spec is not Carry:
                raise ValueError(
                    f"lm.scan: out_axes are lm.Carry (the new carry) or an int (the axis "
                    f"the steps' outputs are stacked on), got {spec!r}."
                )
        return leaves, _OutputLayout(treedef, tuple(array_specs))

    def _split_outputs(
        self, leaves: list[Any], layout: _OutputLayout, carry_arrays: list
    ) -> tuple[list, list]:
        """The new carry (checked against the old) and the outputs to stack."""
        new_carry = [x for x, s in zip(leaves, layout.specs, strict=True) if s is Carry]
        ys = [x for x, s in zip(leaves, layout.specs, strict=True) if s is not Carry]
        if len(new_carry) != len(self.inputs.carried):
            raise ValueError(
                f"lm.scan: the function takes {len(self.inputs.carried)} carried array(s) "
                f"(in_axes lm.Carry) but returns {len(new_carry)} (out_axes lm.Carry); the "
                f"carry goes in and comes out with the same structure."
            )
        for before, after in zip(carry_arrays, new_carry, strict=True):
            _check_carry_type("lm.scan", before, after)
        # on an explicit mesh the carry keeps the sharding it came in with
        return list(map(match_sharding, new_carry, carry_arrays)), ys


class _Scan(Lifted):
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
        binding = bind("lm.scan", args, self.in_axes, allow_carry=True, split=self.split)
        inputs = _split_inputs(binding)
        self._split_keys(binding, inputs)
        body = Body(binding, self.fn, kwargs, records="mapped")
        step = _ScanStep(binding, inputs, body, self.out_axes)
        init = _scan_inits(binding, inputs)
        xs = _scanned_inputs(binding, inputs, body)
        (carry_arrays, carry_values), (ys, xs_values, records, layout) = jax.lax.scan(
            step, init, xs, length=self.length, reverse=self.reverse, unroll=self.unroll
        )
        out = _merge_outputs(carry_arrays, ys, layout)
        body.check_module_specs(out, self.out_axes)
        store(binding, dict(zip(inputs.carry_slots, carry_values, strict=True)))
        store(
            binding,
            {
                s: _from_front(v, binding.slot_axis[s])
                for s, v in zip(inputs.xs_written, xs_values, strict=True)
            },
        )
        body.absorb_records(records)
        return body.restore(out)

    def _split_keys(self, binding: Binding, inputs: _ScanInputs) -> None:
        """Checks the scanned sizes agree; under a split, splits the keys into one per step."""
        length = mapped_size(binding, inputs.arrays, inputs.array_axes, self.length, "length")
        if self.split is None:
            return
        length = self.split.check_size("lm.scan", length)
        if length is None:
            raise ValueError(
                "lm.scan: nothing is scanned (no in_axes 0), so the number of steps to "
                "split keys into is unknown: pass length=n."
            )
        binding.split_keys(length)


def _merge_outputs(carry_arrays: list, ys: list, layout: _OutputLayout) -> Any:
    """The function's output: the final carry and the stacked outputs, in its structure."""
    carry_it, ys_it = iter(carry_arrays), iter(ys)
    leaves = [next(carry_it) if s is Carry else _from_front(next(ys_it), s) for s in layout.specs]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


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
    return decorator_or(
        fn, lambda f: _Scan(f, in_axes, out_axes, length, reverse, unroll, split_rngs)
    )
