"""Running code with some variables read as computed values (Linen's ``nn.map_variables``).

``with substituted({declaration: array, ...}):`` makes each declaration's `.value` return the
given array instead of the array the call bound to it, for the duration of the block; when the
block ends, normally or by an exception, the bound arrays are back. Wrappers such as
`SpectralNorm` and `WeightNorm` compute a normalised kernel from the bound one and run the
wrapped layer inside the block, so the layer, unchanged, computes with the normalised kernel.

How it works: a read is ``frame.values[slot]`` in the innermost frame of the variable's plan
(`frame.Frame`); the block replaces that entry and puts the saved one back in a ``finally``.
Hence:

- gradients reach the original variable through the computation of the substituted value
  (it is an ordinary function of the bound value, traced in the same JAX trace);
- it works under ``jax.jit``/``vmap``/``grad`` around ``apply`` (the frame opens inside them),
  and inside lifted transforms: the block edits the frame that is running (a lifted
  transform's nested frame, whose per-iteration shapes the values must have), and a lifted
  transform started inside the block copies the substituted values into its own frame;
- nothing outlives the block: the entry is restored before the block's exit returns or
  raises, so a substituted value (possibly a tracer of a transform run inside the call) never
  reaches the variables that `apply` returns.

Only immutable variables (parameters) can be substituted: a write to a mutable one inside the
block would be undone by the restore.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax.numpy as jnp

from .._core.checks import check_cast
from .._core.frame import Frame, current_frame, frame_of, where_is
from .._core.variables import State


@contextlib.contextmanager
def substituted(replacements: Mapping[State, Any], where: str = "substituted") -> Iterator[None]:
    """While the block runs, each declaration reads as the array it is mapped to.

    Args:
        replacements: ``{declaration: array}``; each declaration must belong to the running
            call and be immutable; each array must have the shape the running frame holds for
            it and a dtype of the same kind (no complex value for a real variable).
        where: Who substitutes, for messages (``"SpectralNorm at params/sn"``).

    Raises:
        TypeError: A mutable declaration, or a value of another kind (complex for a real
            variable).
        ValueError: A value of the wrong shape.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.nn._substitution import substituted
        >>> class Doubled(lm.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = lm.Dense(2, 2)
        ...     def __call__(self, x):
        ...         with substituted({self.layer.kernel: 2 * self.layer.kernel.value}):
        ...             return self.layer(x)
        >>> init, apply = lm.transform(Doubled())
        >>> v = init(jax.random.key(0))
        >>> y, _ = apply(v, None, jnp.ones((1, 2)))
        >>> bool(jnp.allclose(y, 2 * jnp.ones((1, 2)) @ v["params"]["layer"]["kernel"]))
        True
    """
    edits: list[tuple[Frame, int, Any]] = []
    for state, value in replacements.items():
        frame = current_frame()
        if frame is None or frame.plan is not state._lamina_plan:
            frame = frame_of(state)
        slot: Any = state._lamina_slot
        value = jnp.asarray(value)
        _check(where, state, value, frame.shapes[slot])
        edits.append((frame, slot, value))
    saved = [(frame.values, slot, frame.values[slot]) for frame, slot, _ in edits]
    try:
        for frame, slot, value in edits:
            frame.values[slot] = value
        yield
    finally:
        for values, slot, old in reversed(saved):
            values[slot] = old


def _check(where: str, state: State, value: Any, shape: tuple[int, ...]) -> None:
    name = f"{type(state).__name__} at {where_is(state)}"
    if state.mutable:
        raise TypeError(
            f"{where}: {name} is mutable and cannot be substituted: a write to it inside the "
            f"block would be undone when the block ends. Substitute parameters (immutable "
            f"variables) only."
        )
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{where}: the value substituted for {name} has shape {tuple(value.shape)}, but "
            f"the variable holds shape {shape} here; compute a value of that shape."
        )
    check_cast(
        value,
        state.param_dtype,
        lambda: (
            f"{where}: the value substituted for {name} is {value.dtype}, but the "
            f"variable is read as {state.dtype} and stored as {state.param_dtype}"
        ),
        state.dtype,
    )
