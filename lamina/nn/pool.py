"""Pooling: `max_pool`, `avg_pool`, `min_pool` over the spatial axes of channels-last input."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Padding = str | Sequence[tuple[int, int]]


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
    kernel_size: Sequence[int],
    strides: Sequence[int] | None,
    padding: Padding,
    count_include_pad: bool = True,
) -> jax.Array:
    window = tuple(int(k) for k in kernel_size)
    name = f"{kind}_pool"
    if not window:
        raise ValueError(f"{name}: kernel_size must name at least one spatial axis.")
    if x.ndim < len(window) + 1:
        raise ValueError(
            f"{name}: a kernel_size of {len(window)} axes needs input of shape "
            f"(batch, {len(window)} spatial axes, features); got shape {tuple(x.shape)}."
        )
    steps = (1,) * len(window) if strides is None else tuple(int(s) for s in strides)
    if len(steps) != len(window):
        raise ValueError(
            f"{name}: strides {tuple(steps)} must have one entry per axis of kernel_size {window}."
        )
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(
                f"{name}: padding must be 'SAME', 'VALID' or (low, high) pairs, got {padding!r}."
            )
        pads: Any = padding.upper()
    else:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
        if len(pads) != len(window):
            raise ValueError(
                f"{name}: padding needs one (low, high) pair per axis of "
                f"kernel_size {window}, got {len(pads)}."
            )
    return pool_kernel(x, kind, window, steps, pads, count_include_pad)


def max_pool(
    x: jax.Array,
    kernel_size: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> jax.Array:
    """The maximum over each window of the spatial axes (Flax Linen's ``max_pool``).

    Args:
        x: Input of shape ``(batch, *spatial, features)``.
        kernel_size: The window, one size per spatial axis.
        strides: Step between windows (default: 1 on every axis).
        padding: ``"VALID"``, ``"SAME"``, or one ``(low, high)`` pair per spatial axis.

    Returns:
        The pooled array.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
        >>> lm.max_pool(x, kernel_size=(2, 2), strides=(2, 2))[0, :, :, 0]
        Array([[ 5.,  7.],
               [13., 15.]], dtype=float32)
    """
    return _pool("max", x, kernel_size, strides, padding)


def min_pool(
    x: jax.Array,
    kernel_size: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> jax.Array:
    """The minimum over each window of the spatial axes (arguments as `max_pool`)."""
    return _pool("min", x, kernel_size, strides, padding)


def avg_pool(
    x: jax.Array,
    kernel_size: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """The mean over each window of the spatial axes (arguments as `max_pool`).

    Args:
        x: Input of shape ``(batch, *spatial, features)``.
        kernel_size: The window, one size per spatial axis.
        strides: Step between windows (default: 1 on every axis).
        padding: ``"VALID"``, ``"SAME"``, or one ``(low, high)`` pair per spatial axis.
        count_include_pad: Whether padded positions count in the mean's denominator.

    Returns:
        The pooled array.
    """
    return _pool("avg", x, kernel_size, strides, padding, count_include_pad)
