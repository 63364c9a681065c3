"""The control-flow transforms: `cond`, `switch`, `fori_loop` and `while_loop` with modules.

Their operands (loop values) may hold modules: each branch (iteration) runs in a nested
frame bound to the call's variables. A branch's writes come out of the chosen branch (the
other passes the state through); a loop carries its modules' mutable state from one
iteration to the next. Keys are broadcast unless a loop's `split_rngs` folds the iteration
index into the chosen streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .axes import split_of, split_rngs
from .bind import array_leaves, bind, shapes_inside, store
from .body import Body

# --- cond and switch -------------------------------------------------------------------------


def _branches(
    name: str, fns: Sequence[Callable[..., Any]], operands: tuple
) -> tuple[list[Callable[..., Any]], tuple, Callable[..., Any]]:
    """Shared by `cond` and `switch`: one nested-frame runner per branch, with equal outputs.

    Returns:
        The runners (one per branch), the operands to give them, and the function that
        stores the chosen branch's state and puts its returned modules back in place.
    """
    binding = bind(name, operands, None, allow_carry=False)
    arrays, _ = array_leaves(binding)
    shapes = shapes_inside(binding, {})
    mutable = binding.mutable_slots()
    values = binding.frame.values
    bodies = [Body(binding, fn, {}) for fn in fns]

    def runner(body: Body) -> Callable[..., Any]:
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
        store(binding, new)
        return bodies[0].restore(out)

    return [runner(b) for b in bodies], operands_, finish


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
    runs, operands_, finish = _branches("lm.cond", (true_fn, false_fn), operands)
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
    runs, operands_, finish = _branches("lm.switch", tuple(branches), operands)
    return finish(jax.lax.switch(index, runs, *operands_))


# --- loops -----------------------------------------------------------------------------------


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
    body_fun, split = split_of("lm.fori_loop", body_fun, split_rngs)
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
    body_fun, split = split_of("lm.while_loop", body_fun, split_rngs)
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
        self.binding = bind(name, (init_val,), None, allow_carry=False, split=split)
        self.arrays, _ = array_leaves(self.binding)
        self.mutable = self.binding.mutable_slots()
        self.body = Body(self.binding, lambda val: val, {})
        self.shapes = shapes_inside(self.binding, {})
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
        store(self.binding, dict(zip(self.mutable, state, strict=True)))
        if self.treedef is None:
            return self.body.restore(self.binding.treedef.unflatten(self.binding.leaves)[0])
        out = jax.tree_util.tree_unflatten(self.treedef, arrays)
        return self.body.restore(out)
