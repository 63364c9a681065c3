"""The checks that layers run on their settings and inputs, worded the same way everywhere.

Each check takes `where`, the layer or function as messages name it (``"LSTMCell"``,
``"Conv(in_size=3, out_size=8, kernel_size=(3, 3))"``), and raises with what was wrong and
what to do; the checks of settings return the value in its canonical type.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._core.variables import as_dtype as _core_as_dtype


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type where a number is needed (a float size, a string rate).

    Also a `ValueError`, the error a wrong setting raises, so that code catching either one
    catches it.
    """


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether `value` is a real number (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(where: str, name: str, value: Any, meaning: str = "") -> int:
    """Returns `value` as an int; raises unless it is an integer >= 1.

    Args:
        where: The layer, as messages name it.
        name: The setting's name.
        value: The setting.
        meaning: Appended to "must be a positive int", e.g. ``", the size of the input's last
            axis"``.
    """
    if not is_int(value) or value < 1:
        error = ValueError if is_int(value) else SettingTypeError
        raise error(f"{where}: {name} must be a positive int{meaning}, got {value!r}.")
    return int(value)


def non_negative(
    where: str,
    name: str,
    value: Any,
    *,
    at_most: float | None = None,
    below: float | None = None,
    meaning: str = "",
) -> float:
    """Returns `value` as a float; raises unless it is a real number >= 0 (and in bounds).

    Args:
        where: The layer, as messages name it.
        name: The setting's name.
        value: The setting.
        at_most: An upper bound that `value` may equal (``[0, at_most]``).
        below: An upper bound that `value` must stay under (``[0, below)``).
        meaning: Appended to the requirement, e.g. ``" (the weight of the old average)"``.
    """
    if below is not None:
        requirement = f"a number in [0, {below:g})"
    elif at_most is not None:
        requirement = f"a number in [0, {at_most:g}]"
    else:
        requirement = "a non-negative number"
    fits = is_real(value) and value >= 0
    fits = fits and (below is None or value < below) and (at_most is None or value <= at_most)
    if not fits:
        error = ValueError if is_real(value) else SettingTypeError
        raise error(f"{where}: {name} must be {requirement}{meaning}, got {value!r}.")
    return float(value)


def python_bool(where: str, /, **flags: Any) -> None:
    """Raises `TypeError` unless every one of `flags` (name=value) is a Python bool.

    The flags of a call (``is_training``, ``decode``...) choose what is computed, so they must
    be known while tracing: under `jax.jit`, static.
    """
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(
                f"{where}: {flag} must be a Python bool, got {type(value).__name__}: it chooses "
                f"what is computed, so it cannot be a traced value. Under jax.jit, make it "
                f"static: jax.jit(step, static_argnames='{flag}'), or call apply with a literal "
                f"True/False inside the jitted function."
            )


def as_dtype(where: str, name: str, value: Any) -> np.dtype:
    """Returns `value` as a NumPy dtype; raises `TypeError` if it names none.

    The same check and message as the variables' own (``Parameter(..., dtype=...)``).
    """
    return _core_as_dtype(value, where, name)


def check_last_axis(
    where: str | Callable[[], str],
    x: Any,
    expected: int,
    setting: str,
    what: str = "an input",
    hint: str = "",
) -> tuple[int, ...]:
    """Returns the shape of `x`; raises `ValueError` unless its last axis has size `expected`.

    Args:
        where: The layer, as messages name it (with its settings: ``"Dense(in_size=4, ...)"``),
            or a function that returns it, so that a layer's call formats it only on error.
        x: The input.
        expected: The size the layer was built for.
        setting: The name of the layer's setting that holds `expected` (``"in_size"``).
        what: The input, as the message names it (``"an input"``, ``"inputs_q"``).
        hint: A sentence appended to the message.
    """
    try:
        shape = tuple(x.shape)
    except AttributeError:
        shape = tuple(jnp.shape(x))
    if shape[-1:] != (expected,):
        if shape:
            got = f"got {shape[-1]}"
            fix = f", or build the layer with {setting}={shape[-1]}"
        else:
            got, fix = "but a scalar has none", ""
        raise ValueError(
            f"{where() if callable(where) else where} got {what} of shape {shape}: its last axis "
            f"must be {setting}={expected}, {got}. Pass {what} of shape (..., {expected}){fix}."
            f"{hint and ' ' + hint}"
        )
    return shape
