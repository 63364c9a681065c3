"""Regularisation: `dropout` (a function) and `Dropout` (the same as a module)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.module import Module
from .._core.rng import next_rng_key
from . import _checks


@functools.partial(jax.jit, static_argnames=("rate", "broadcast_dims"))
def dropout_kernel(
    x: jax.Array, key: jax.Array, rate: float, broadcast_dims: tuple[int, ...] = ()
) -> jax.Array:
    """Zeroes each element with probability `rate` and scales the rest by ``1 / (1 - rate)``.

    The mask is shared along `broadcast_dims` (e.g. the time axis of a sequence).
    """
    if rate >= 1.0:
        return jnp.zeros_like(x)
    keep = 1.0 - rate
    shape = tuple(1 if d in broadcast_dims else n for d, n in enumerate(x.shape))
    mask = jax.random.bernoulli(key, keep, shape)
    mask = jnp.broadcast_to(mask, x.shape)
    return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros_like(x))


def dropout(
    x: jax.Array,
    rate: float,
    is_training: bool,
    *,
    broadcast_dims: Sequence[int] | int = (),
    rng: Any = None,
    stream: str = "dropout",
) -> jax.Array:
    """Randomly zeroes elements of `x` while training (inverted dropout, as Flax Linen's).

    Args:
        x: The input, floating.
        rate: Probability of zeroing an element, a number in ``[0, 1]`` (not a bool or a
            string).
        is_training: Apply dropout (True) or return `x` unchanged (False). A Python bool:
            under `jax.jit`, pass it as a static argument.
        broadcast_dims: Axes of `x` along which the same mask is used (an int for one axis;
            negative axes count from the end).
        rng: A key to use instead of drawing one from the `stream`.
        stream: The random stream to draw from (``next_rng_key(stream)``).

    Returns:
        `x` with elements zeroed and the rest scaled by ``1 / (1 - rate)``.

    Raises:
        ValueError: `rate` outside ``[0, 1]``; an axis of `broadcast_dims` that `x` lacks,
            or named twice.
        TypeError: `rate` not a number; `is_training` not a Python bool; `x` not floating
            (dropout scales the kept elements by ``1 / (1 - rate)``).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Net(lm.Module):
        ...     def __call__(self, x, is_training):
        ...         return lm.dropout(x, rate=0.5, is_training=is_training)
        >>> init, apply = lm.transform(Net())
        >>> y, _ = apply({}, {"dropout": jax.random.key(0)}, jnp.ones(8), is_training=True)
        >>> sorted(set(y.tolist()))
        [0.0, 2.0]
    """
    where = "dropout"
    rate = _checks.non_negative(where, "rate", rate, at_most=1.0)
    _checks.static_flags(where, is_training=is_training)
    dims = _broadcast_dims(where, broadcast_dims)
    stream = _stream(where, stream)
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"{where} needs a floating input, got dtype {dtype}: it scales the kept elements "
            f"by 1 / (1 - rate). Convert first, e.g. x.astype(jnp.float32)."
        )
    ndim = jnp.ndim(x)
    for d in dims:
        if not -ndim <= d < ndim:
            raise ValueError(
                f"{where}: broadcast_dims={dims} names axis {d}, but the input of shape "
                f"{jnp.shape(x)} has {ndim} axes (valid: {-ndim} to {ndim - 1})."
            )
    normalized = tuple(sorted(d % ndim for d in dims))
    if len(set(normalized)) != len(normalized):
        raise ValueError(
            f"{where}: broadcast_dims={dims} names the same axis twice for an input of "
            f"{ndim} axes; name each axis once."
        )
    if not is_training or rate == 0.0:
        return x
    key = next_rng_key(stream) if rng is None else rng
    return dropout_kernel(x, key, rate, normalized)


def _broadcast_dims(where: str, value: Any) -> tuple[int, ...]:
    if _checks.is_int(value):
        return (int(value),)
    dims = None if isinstance(value, str) or not isinstance(value, Sequence) else tuple(value)
    if dims is None or not all(_checks.is_int(d) for d in dims):
        raise TypeError(
            f"{where}: broadcast_dims must be an int or a tuple of ints (axes of the input), "
            f"got {value!r}."
        )
    return tuple(int(d) for d in dims)


def _stream(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{where}: stream must be the name of a random stream (a non-empty string, e.g. "
            f"'dropout'), got {value!r}."
        )
    return value


class Dropout(Module):
    """`dropout` as a module, called ``layer(x, is_training)``.

    Args:
        rate: Probability of zeroing an element, a number in ``[0, 1]``.
        broadcast_dims: Axes along which the same mask is used (keyword-only).
        stream: The random stream to draw from (keyword-only).

    Raises:
        ValueError: `rate` outside ``[0, 1]``.
        TypeError: `rate` not a number (``Dropout(True)``, ``Dropout("0.5")``); bad
            `broadcast_dims` or `stream`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dropout(0.5))
        >>> apply({}, None, jnp.ones(4), False)[0]
        Array([1., 1., 1., 1.], dtype=float32)
    """

    rate = _checks.Setting()
    broadcast_dims = _checks.Setting()
    stream = _checks.Setting()

    def __init__(
        self, rate: float, *, broadcast_dims: Sequence[int] | int = (), stream: str = "dropout"
    ):
        super().__init__()
        where = type(self).__name__
        self.rate = _checks.non_negative(where, "rate", rate, at_most=1.0)
        self.broadcast_dims = _broadcast_dims(where, broadcast_dims)
        self.stream = _stream(where, stream)

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        """Applies dropout to `x` when `is_training`."""
        return dropout(
            x, self.rate, is_training, broadcast_dims=self.broadcast_dims, stream=self.stream
        )
