"""What `check_gradients` differentiates: the model's loss as a function of the checked arrays.

`Problem` picks the checked arrays (the variables `wrt` selects, the float inputs `inputs`
names) and holds the rest fixed; `default_loss` and `user_loss` turn the model's outputs into
the scalar whose derivatives are checked, with the size of its rounding error.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import format_list
from .._core.graph import FlatKey
from .._core.layout import flatten_variables, nest

Selection = str | Sequence[str] | Mapping[str, Any] | None
"""Which variables `check_gradients` checks: collection name(s) or a boolean mask tree."""

FlatVariables = dict[FlatKey, Any]
"""Variables by flat key (``("params", "layer1", "kernel")``), as `flatten_variables` gives."""


Function = Callable[[list, list, Any], tuple[jax.Array, jax.Array]]
"""``f(xs, rest, rngs) -> (value, scale)``: a scalar of the checked arrays `xs` and its
rounding scale; `rest` holds the arrays held fixed."""


ARRAYS = (jax.Array, np.ndarray, np.generic)
"""The array types among variables and inputs (Python numbers aside)."""


def is_float_array(leaf: Any, python_scalars: bool) -> bool:
    """Whether `leaf` is a floating-point array (or, with `python_scalars`, a Python float)."""
    if isinstance(leaf, ARRAYS):
        return bool(jnp.issubdtype(leaf.dtype, jnp.floating))
    return python_scalars and isinstance(leaf, float)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One checked array: its name in messages and where it sits among the arguments."""

    name: str
    value: jax.Array
    variable: FlatKey | None  # its flat key in the variables, or None for an input
    position: int  # its index among the leaves of the inputs (inputs only)


class Problem:
    """The model's call as a function of the checked arrays, the rest held fixed."""

    def __init__(
        self,
        apply: Callable[..., Any],
        flat: FlatVariables,
        chosen: set[FlatKey],
        args: tuple,
        inputs: bool | Sequence[int],
        kwargs: dict[str, Any],
    ):
        self.apply, self.kwargs = apply, kwargs
        self.keys = sorted(flat)
        arg_leaves, self.arg_def = jax.tree_util.tree_flatten_with_path(args)
        positions = input_positions(inputs, len(args))
        self.leaves = _checked_leaves(self.keys, flat, chosen, arg_leaves, positions)
        if not self.leaves:
            raise ValueError(_nothing_to_check(flat, chosen, args, positions))
        checked_vars = {leaf.variable for leaf in self.leaves}
        checked_args = {leaf.position for leaf in self.leaves if leaf.variable is None}
        self.fixed_keys = [key for key in self.keys if key not in checked_vars]
        self.arg_values = [leaf for _, leaf in arg_leaves]
        # Arrays held fixed travel as arguments (not as constants baked into the program);
        # other leaves of the inputs (Python numbers, strings) stay as they are.
        self.rest_args = [
            j
            for j, leaf in enumerate(self.arg_values)
            if j not in checked_args and isinstance(leaf, ARRAYS)
        ]
        self.xs = [leaf.value for leaf in self.leaves]
        self.rest = [flat[key] for key in self.fixed_keys] + [
            self.arg_values[j] for j in self.rest_args
        ]
        self.loss: Callable[[Any], tuple[jax.Array, jax.Array]] | None = None

    def outputs(self, xs: list, rest: list, rngs: Any) -> Any:
        """The model's outputs, given the checked arrays `xs` and the fixed ones `rest`."""
        values = dict(zip(self.fixed_keys, rest[: len(self.fixed_keys)], strict=True))
        arg_values = list(self.arg_values)
        for j, x in zip(self.rest_args, rest[len(self.fixed_keys) :], strict=True):
            arg_values[j] = x
        for leaf, x in zip(self.leaves, xs, strict=True):
            if leaf.variable is None:
                arg_values[leaf.position] = x
            else:
                values[leaf.variable] = x
        call_args = jax.tree.unflatten(self.arg_def, arg_values)
        outputs, _ = self.apply(nest(values.items()), rngs, *call_args, **self.kwargs)
        return outputs

    def evaluate(self, xs: list, rest: list, rngs: Any) -> tuple[jax.Array, jax.Array]:
        """The loss and its rounding scale."""
        assert self.loss is not None
        return self.loss(self.outputs(xs, rest, rngs))


def _checked_leaves(
    keys: list[FlatKey],
    flat: FlatVariables,
    chosen: set[FlatKey],
    arg_leaves: list[tuple[Any, Any]],
    positions: set[int],
) -> list[Leaf]:
    """The arrays to check: the chosen float variables (in key order), then the float inputs."""
    leaves: list[Leaf] = []
    for key in keys:
        if key in chosen and is_float_array(flat[key], python_scalars=True):
            leaves.append(Leaf("/".join(key), jnp.asarray(flat[key]), key, -1))
    for j, (path, leaf) in enumerate(arg_leaves):
        position = path[0].idx
        if position in positions and is_float_array(leaf, python_scalars=False):
            name = f"inputs[{position}]{jax.tree_util.keystr(path[1:])}"
            leaves.append(Leaf(name, jnp.asarray(leaf), None, j))
    return leaves


def total(arrays: Iterable[jax.Array]) -> jax.Array:
    """The sum of every element of every array."""
    return jnp.sum(jnp.stack([jnp.sum(a) for a in arrays]))


def default_loss(outputs: Any, seed: int) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """``sum(w * y)`` over the float outputs `y` (fixed normal `w`), and its scale ``sum|w y|``."""
    shapes = jax.tree.leaves(outputs)
    floats = [i for i, s in enumerate(shapes) if jnp.issubdtype(s.dtype, jnp.floating)]
    if not floats:
        described = ", ".join(f"{s.dtype}{list(s.shape)}" for s in shapes) or "no arrays"
        raise ValueError(
            f"lm.check_gradients: the model's outputs hold no floating-point array "
            f"({described}), so the default loss (a random projection of the float outputs) "
            f"has nothing to project. Pass loss=, a function of the outputs returning a float "
            f"scalar."
        )
    rng = np.random.default_rng(seed)
    size = sum(int(np.prod(shapes[i].shape)) for i in floats)
    weights = {i: rng.standard_normal(shapes[i].shape) / math.sqrt(max(1, size)) for i in floats}

    def loss(outputs: Any) -> tuple[jax.Array, jax.Array]:
        terms = []
        for i, y in enumerate(jax.tree.leaves(outputs)):
            if i in weights:
                if jnp.finfo(y.dtype).bits < 32:  # sum 16-bit outputs in float32
                    y = y.astype(jnp.float32)
                terms.append(y * jnp.asarray(weights[i], y.dtype))
        return total(terms), jax.lax.stop_gradient(total(jnp.abs(t) for t in terms))

    return loss


def user_loss(loss: Callable[[Any], Any]) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """`loss`, checked to return a float scalar, with the scale ``max(1, |L|)``."""
    if not callable(loss):
        raise TypeError(
            f"lm.check_gradients: loss must be a function of the model's outputs returning a "
            f"float scalar; got {type(loss).__name__} {loss!r:.60}."
        )

    def scalar_loss(outputs: Any) -> tuple[jax.Array, jax.Array]:
        value = loss(outputs)
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape != () or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"lm.check_gradients: loss must return a float scalar; it returned "
                f"{type(value).__name__} of shape {shape} and dtype {dtype}. Reduce it, e.g. "
                f"jnp.sum(...), and cast integer results to float."
            )
        value = jnp.asarray(value)
        return value, jax.lax.stop_gradient(jnp.maximum(1.0, jnp.abs(value)))

    return scalar_loss


def selected_keys(flat: FlatVariables, wrt: Selection) -> set[FlatKey]:
    """The keys of the variables `wrt` selects (float or not)."""
    if wrt is None:
        return set()
    if isinstance(wrt, Mapping):
        return _masked(flat, wrt)
    names = [wrt] if isinstance(wrt, str) else wrt
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"lm.check_gradients: wrt is a collection name ('params'), a sequence of them, a "
            f"tree of booleans (lm.mask(model, variables, filter)) or None; got {wrt!r:.80}."
        )
    collections = sorted({key[0] for key in flat})
    missing = [name for name in names if name not in collections]
    if missing and flat:
        close = [c for name in missing for c in difflib.get_close_matches(name, collections, n=1)]
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"lm.check_gradients: wrt names {format_list(map(repr, missing))}, which the "
            f"variables do not hold; they hold {', '.join(map(repr, collections))}.{hint}"
        )
    return {key for key in flat if key[0] in names}


def _masked(flat: FlatVariables, mask: Mapping[str, Any]) -> set[FlatKey]:
    """The keys a boolean mask selects; a mask leaf may stand for a whole group."""
    flags = flatten_variables(mask, "lm.check_gradients's wrt mask")
    chosen = set()
    for prefix, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)) and not (
            isinstance(flag, ARRAYS) and flag.shape == () and flag.dtype == bool
        ):
            raise TypeError(
                f"lm.check_gradients: the wrt mask holds {type(flag).__name__} {flag!r:.40} at "
                f"{'/'.join(prefix)}; a mask holds booleans (lm.mask(model, variables, filter))."
            )
        below = [key for key in flat if key[: len(prefix)] == prefix]
        if not below:
            raise ValueError(
                f"lm.check_gradients: the wrt mask names {'/'.join(prefix)}, which the "
                f"variables do not hold. Build the mask from the same variables: "
                f"lm.mask(model, variables, filter)."
            )
        if flag:
            chosen.update(below)
    return chosen


def input_positions(inputs: bool | Sequence[int], count: int) -> set[int]:
    """The positions of the arguments whose float arrays are checked."""
    if isinstance(inputs, bool):
        return set(range(count)) if inputs else set()
    if not isinstance(inputs, Sequence) or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in inputs
    ):
        raise TypeError(
            f"lm.check_gradients: inputs is True (every float input), False (none) or the "
            f"positions of the inputs to check, such as (0,); got {inputs!r:.60}."
        )
    wrong = [int(i) for i in inputs if not -count <= i < count]
    if wrong:
        raise ValueError(
            f"lm.check_gradients: inputs names position(s) {format_list(map(str, wrong))}, but "
            f"the model was given {count} positional input(s)."
        )
    return {int(i) % count for i in inputs}


def _nothing_to_check(
    flat: FlatVariables,
    chosen: set[FlatKey],
    args: tuple,
    positions: set[int],
) -> str:
    """The message for a call with no float array to check."""
    chosen_floats = [k for k in chosen if is_float_array(flat[k], python_scalars=True)]
    described = (
        "no variables"
        if not flat
        else f"{len(chosen)} selected variable(s), none of them float"
        if chosen and not chosen_floats
        else "no variable selected by wrt"
    )
    given = (
        "no inputs" if not args else f"{len(args)} input(s), {len(positions)} selected by inputs"
    )
    return (
        f"lm.check_gradients: nothing to check: {described}, and no float array among the "
        f"inputs checked ({given}; integer inputs such as token ids are never checked). Select "
        f"float variables with wrt= (collections: "
        f"{', '.join(sorted({k[0] for k in flat})) or 'none'}) or float inputs with inputs=."
    )
