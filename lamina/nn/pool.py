"""Pooling: `max_pool`, `avg_pool`, `min_pool` over the spatial axes of channels-last input."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from . import _checks

PaddingLike = str | int | Sequence[int | Sequence[int]]


@functools.partial(
    jax.jit, static_argnames=("kind", "window", "strides", "padding", "count_include_pad")
)
def pool_kernel(
    x: jax.Array,
    kind: str,
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: str | tuple[tuple[int, int], ...],
    count_include_pad: bool = True,
) -> jax.Array:
    """Reduces windows of `x` (``(*batch, *spatial, features)``) with max, min or mean."""
    batch_dims = x.ndim - len(window) - 1
    dims = (1,) * batch_dims + window + (1,)
    steps = (1,) * batch_dims + strides + (1,)
    pads = padding if isinstance(padding, str) else ((0, 0),) * batch_dims + padding + ((0, 0),)
    if kind == "avg":
        total = lax.reduce_window(x, 0.0, lax.add, dims, steps, pads)
        if count_include_pad:
            return total / math.prod(window)
        ones = jnp.ones((1,) * batch_dims + x.shape[batch_dims:-1] + (1,), x.dtype)
        return total / lax.reduce_window(ones, 0.0, lax.add, dims, steps, pads)
    # Python-scalar identities: lax.reduce_window then knows the monoid, and differentiates it.
    if jnp.issubdtype(x.dtype, jnp.floating):
        identity = -math.inf if kind == "max" else math.inf
    else:
        info = jnp.iinfo(x.dtype)
        identity = int(info.min if kind == "max" else info.max)
    return lax.reduce_window(x, identity, lax.max if kind == "max" else lax.min, dims, steps, pads)


def _pool(
    kind: str,
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None,
    padding: PaddingLike,
    count_include_pad: bool = True,
) -> jax.Array:
    where = f"{kind}_pool"
    window = _checks.window(where, "kernel_size", kernel_size)
    n = len(window)
    if not isinstance(kernel_size, Sequence) and getattr(x, "ndim", 0) > 3:
        raise TypeError(
            f"{where}: kernel_size={kernel_size!r} is a window over one spatial axis, but the "
            f"input of shape {tuple(x.shape)} has more axes than (batch, length, features), "
            f"so which axes are spatial is ambiguous. Pass one size per spatial axis: "
            f"kernel_size=({kernel_size}, {kernel_size}) for images, or ({kernel_size},) to "
            f"pool only the axis before the features."
        )
    steps = (1,) * n if strides is None else _checks.per_axis(where, "strides", strides, n)
    pads = _checks.padding(where, padding, n, ("SAME", "VALID"))
    include_pad = _checks.flag(where, "count_include_pad", count_include_pad)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    shape = tuple(x.shape)
    if len(shape) < n + 1:
        raise ValueError(
            f"{where}: a kernel_size of {n} axes needs input of shape (batch..., {n} spatial "
            f"axes, features), channels last; got shape {shape}."
        )
    if kind == "avg":
        fits, need = jnp.issubdtype(x.dtype, jnp.floating), "a floating"
    else:
        fits = jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)
        need = "an integer or floating"
    if not fits:
        raise TypeError(
            f"{where} needs {need} input, got dtype {x.dtype}; convert it first, e.g. "
            f"x.astype(jnp.float32)."
        )
    _checks.check_window_fits(where, shape, window, (1,) * n, pads)
    return pool_kernel(x, kind, window, steps, pads, include_pad)


def max_pool(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
) -> jax.Array:
    """The maximum over each window of the spatial axes (Flax Linen's ``max_pool``).

    The spatial axes are the ``len(kernel_size)`` axes before the last (the features); any
    axes before them are batch axes.

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
    return _pool("max", x, kernel_size, strides, padding)


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
    return _pool("min", x, kernel_size, strides, padding)


def avg_pool(
    x: jax.Array,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """The mean over each window of the spatial axes (arguments as `max_pool`).

    Args:
        x: Input of shape ``(batch..., *spatial, features)``, floating.
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
    """
    return _pool("avg", x, kernel_size, strides, padding, count_include_pad)
