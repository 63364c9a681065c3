"""Pooling over the spatial axes of channels-last input: `pool`, `max_pool`, `min_pool`, `avg_pool`.

`pool` is Flax Linen's (and Metoryx's) generic pooling, a reduction of every window with a
function of two arrays and its identity; the three named pools are `pool` with ``lax.max``,
``lax.min`` and ``lax.add`` (then a division), the same checks and the same compiled kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.types import PaddingLike
from . import _checks


@functools.partial(jax.jit, static_argnames=("init", "reduce_fn", "window", "strides", "padding"))
def reduce_windows(
    x: jax.Array,
    init: Any,
    reduce_fn: Callable[[Any, Any], Any],
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: str | tuple[tuple[int, int], ...],
) -> jax.Array:
    """Reduces each window of `x` (``(*batch, *spatial, features)``) with `reduce_fn` from `init`.

    `init` is a Python scalar: with ``lax.add``, ``lax.max`` or ``lax.min`` and their identity
    (0, the lowest value, the highest value), `lax.reduce_window` knows the monoid and its
    derivative; padded positions hold `init`.
    """
    batch_dims = x.ndim - len(window) - 1
    dims = (1,) * batch_dims + window + (1,)
    steps = (1,) * batch_dims + strides + (1,)
    pads = padding if isinstance(padding, str) else ((0, 0),) * batch_dims + padding + ((0, 0),)
    return lax.reduce_window(x, init, reduce_fn, dims, steps, pads)


@functools.partial(jax.jit, static_argnames=("window", "strides", "padding", "count_include_pad"))
def average_windows(
    x: jax.Array,
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: str | tuple[tuple[int, int], ...],
    count_include_pad: bool = True,
) -> jax.Array:
    """The mean of each window of `x`: its sum over the window size, or over its unpadded count."""
    total = reduce_windows(x, 0, lax.add, window, strides, padding)
    if count_include_pad:
        return total / jnp.asarray(math.prod(window), total.dtype)
    batch_dims = x.ndim - len(window) - 1
    ones = jnp.ones((1,) * batch_dims + x.shape[batch_dims:-1] + (1,), x.dtype)
    return total / reduce_windows(ones, 0, lax.add, window, strides, padding)


def _windows(
    where: str,
    x: Any,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None,
    padding: PaddingLike,
) -> tuple[jax.Array, tuple[int, ...], tuple[int, ...], str | tuple[tuple[int, int], ...]]:
    """Checks a pool's arguments; returns the input, window, strides and padding canonical."""
    window = _checks.window(where, "kernel_size", kernel_size)
    n = len(window)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    shape = tuple(x.shape)
    if not isinstance(kernel_size, Sequence) and len(shape) > 3:
        raise TypeError(
            f"{where}: kernel_size={kernel_size!r} is a window over one spatial axis, but the "
            f"input of shape {shape} has more axes than (batch, length, features), so which "
            f"axes are spatial is ambiguous. Pass one size per spatial axis: "
            f"kernel_size=({kernel_size}, {kernel_size}) for images, or ({kernel_size},) to "
            f"pool only the axis before the features."
        )
    steps = (1,) * n if strides is None else _checks.per_axis(where, "strides", strides, n)
    pads = _checks.padding(where, padding, n, ("SAME", "VALID"))
    if len(shape) < n + 1:
        raise ValueError(
            f"{where}: a kernel_size of {n} axes needs input of shape (batch..., {n} spatial "
            f"axes, features), channels last; got shape {shape}."
        )
    _checks.check_window_fits(where, shape, window, (1,) * n, pads)
    return x, window, steps, pads


def _check_dtype(where: str, x: jax.Array, kinds: tuple[Any, ...], need: str) -> None:
    if not any(jnp.issubdtype(x.dtype, kind) for kind in kinds):
        raise TypeError(
            f"{where} needs {need}, got dtype {x.dtype}; convert it first, e.g. "
            f"x.astype(jnp.float32)."
        )


def pool(
    x: jax.Array,
    init: Any,
    reduce_fn: Callable[[Any, Any], Any],
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
) -> jax.Array:
    """Reduces each window of the spatial axes with `reduce_fn` (Flax Linen's ``pool``).

    The spatial axes are the ``len(kernel_size)`` axes before the last (the features); any axes
    before them are batch axes (none, one or several). `max_pool`, `min_pool` and `avg_pool` are
    this function with ``lax.max``, ``lax.min`` and ``lax.add``.

    Args:
        x: Input of shape ``(batch..., *spatial, features)``.
        init: The reduction's initial value, a scalar known when tracing (a Python number or
            a concrete 0-d array), which padded positions also hold. With ``lax.add``,
            ``lax.max`` or ``lax.min`` and their identity (0, ``-inf``, ``inf``) the pool is
            differentiable; other reductions are not (as in Linen).
        reduce_fn: A function ``(T, T) -> T`` of two arrays, such as ``lax.add`` (hashed as a
            static argument: pass the same function each call, not a new lambda, to reuse the
            compiled kernel).
        kernel_size: The window (Linen's ``window_shape``): one size per spatial axis, or an
            int for one spatial axis of inputs ``(batch, length, features)``.
        strides: Step between windows: an int for every axis or one per axis (default: 1).
        padding: ``"VALID"``, ``"SAME"``, an int for every side, or one entry per spatial
            axis, each an int or a ``(low, high)`` pair.

    Returns:
        The reduction over each window.

    Raises:
        ValueError: A window, stride or padding that does not fit the input (a ``"VALID"``
            window larger than the input, which would give an empty output, included).
        TypeError: A window or strides that are not ints; an `init` that is not a concrete
            scalar.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> from jax import lax
        >>> x = jnp.arange(6.0).reshape(1, 6, 1)
        >>> lm.pool(x, 1.0, lax.mul, kernel_size=(2,), strides=2)[0, :, 0]  # window products
        Array([ 0.,  6., 20.], dtype=float32)
    """
    where = "pool"
    x, window, steps, pads = _windows(where, x, kernel_size, strides, padding)
    if not callable(reduce_fn):
        raise TypeError(
            f"{where}: reduce_fn must be a function of two arrays such as lax.add, got "
            f"{reduce_fn!r}."
        )
    if not _checks.is_concrete(init) or np.ndim(init) != 0:
        raise TypeError(
            f"{where}: init must be a scalar known when tracing (a Python number such as 0.0 "
            f"or -jnp.inf, or a concrete 0-d array), got {init!r}."
        )
    return reduce_windows(x, np.asarray(init).item(), reduce_fn, window, steps, pads)


def max_pool(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
) -> jax.Array:
    """The maximum over each window of the spatial axes (Flax Linen's ``max_pool``).

    The spatial axes are the ``len(kernel_size)`` axes before the last (the features); any
    axes before them are batch axes. This is `pool` with ``lax.max`` from the lowest value of
    the input's dtype (``-inf``, or the lowest integer).

    Args:
        x: Input of shape ``(batch..., *spatial, features)``, integer or floating.
        kernel_size: The window: one size per spatial axis, or an int for a window over one
            spatial axis, for inputs ``(batch, length, features)`` (an int on an input with
            more axes is an error: for images pass ``(2, 2)``).
        strides: Step between windows: an int for every axis or one per axis (default: 1).
        padding: ``"VALID"``, ``"SAME"``, an int for every side, or one entry per spatial
            axis, each an int or a ``(low, high)`` pair.

    Returns:
        The pooled array.

    Raises:
        ValueError: A window, stride or padding that does not fit the input (a ``"VALID"``
            window larger than the input, which would give an empty output, included).
        TypeError: A window or strides that are not ints; an input of another dtype.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
        >>> lm.max_pool(x, kernel_size=(2, 2), strides=2)[0, :, :, 0]
        Array([[ 5.,  7.],
               [13., 15.]], dtype=float32)
    """
    return _extremum("max_pool", x, kernel_size, strides, padding)


def min_pool(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
) -> jax.Array:
    """The minimum over each window of the spatial axes (arguments as `max_pool`).

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> lm.min_pool(jnp.arange(4.0).reshape(1, 4, 1), kernel_size=2, strides=2)[0, :, 0]
        Array([0., 2.], dtype=float32)
    """
    return _extremum("min_pool", x, kernel_size, strides, padding)


def _extremum(
    where: str,
    x: Any,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None,
    padding: PaddingLike,
) -> jax.Array:
    """`max_pool` or `min_pool`: `pool` with ``lax.max``/``lax.min`` from their identity."""
    x, window, steps, pads = _windows(where, x, kernel_size, strides, padding)
    _check_dtype(where, x, (jnp.integer, jnp.floating), "an integer or floating input")
    is_max = where == "max_pool"
    if jnp.issubdtype(x.dtype, jnp.floating):
        identity: Any = -math.inf if is_max else math.inf
    else:
        info = jnp.iinfo(x.dtype)
        identity = int(info.min if is_max else info.max)
    return reduce_windows(x, identity, lax.max if is_max else lax.min, window, steps, pads)


def avg_pool(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """The mean over each window of the spatial axes (Flax Linen's ``avg_pool``).

    `pool` with ``lax.add``, divided by the window size, or with ``count_include_pad=False``
    by the number of unpadded positions in each window (as Linen's, in every padding mode).
    The result keeps the input's dtype (Linen's comes out in float32 for a bfloat16 input
    with ``count_include_pad=False``).

    Args:
        x: Input of shape ``(batch..., *spatial, features)``, floating or complex.
        kernel_size: The window: one size per spatial axis, or an int for one spatial axis.
        strides: Step between windows: an int for every axis or one per axis (default: 1).
        padding: ``"VALID"``, ``"SAME"``, an int for every side, or one entry per spatial
            axis, each an int or a ``(low, high)`` pair.
        count_include_pad: Whether padded positions count in the mean's denominator.

    Returns:
        The pooled array.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> lm.avg_pool(jnp.arange(4.0).reshape(1, 4, 1), kernel_size=2, strides=2)[0, :, 0]
        Array([0.5, 2.5], dtype=float32)
        >>> x = jnp.ones((1, 3, 1))
        >>> lm.avg_pool(x, 3, padding="SAME", count_include_pad=False)[0, :, 0]
        Array([1., 1., 1.], dtype=float32)
    """
    where = "avg_pool"
    x, window, steps, pads = _windows(where, x, kernel_size, strides, padding)
    _check_dtype(where, x, (jnp.inexact,), "a floating input")
    include_pad = _checks.flag(where, "count_include_pad", count_include_pad)
    return average_windows(x, window, steps, pads, include_pad)
