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
    broadcast_dims: Sequence[int] = (),
    rng: Any = None,
    stream: str = "dropout",
) -> jax.Array:
    """Randomly zeroes elements of `x` while training (inverted dropout, as Flax Linen's).

    Args:
        x: The input.
        rate: Probability of zeroing an element, in ``[0, 1]``.
        is_training: Apply dropout (True) or return `x` unchanged (False). A Python bool:
            under `jax.jit`, pass it as a static argument.
        broadcast_dims: Axes along which the same mask is used.
        rng: A key to use instead of drawing one from the `stream`.
        stream: The random stream to draw from (``next_rng_key(stream)``).

    Returns:
        `x` with elements zeroed and the rest scaled by ``1 / (1 - rate)``.

    Raises:
        ValueError: `rate` outside ``[0, 1]``.
        TypeError: `is_training` is not a Python bool.

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
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"dropout rate must be in [0, 1], got {rate}.")
    _checks.python_bool("dropout", is_training=is_training)
    if not is_training or rate == 0.0:
        return x
    key = next_rng_key(stream) if rng is None else rng
    dims = tuple(sorted(d % jnp.ndim(x) for d in broadcast_dims))
    return dropout_kernel(x, key, float(rate), dims)


class Dropout(Module):
    """`dropout` as a module, called ``layer(x, is_training)``.

    Args:
        rate: Probability of zeroing an element.
        broadcast_dims: Axes along which the same mask is used.
        stream: The random stream to draw from.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dropout(0.5))
        >>> apply({}, None, jnp.ones(4), False)[0]
        Array([1., 1., 1., 1.], dtype=float32)
    """

    def __init__(self, rate: float, broadcast_dims: Sequence[int] = (), stream: str = "dropout"):
        super().__init__()
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1], got {rate}.")
        self.rate = rate
        self.broadcast_dims = tuple(broadcast_dims)
        self.stream = stream

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        """Applies dropout to `x` when `is_training`."""
        return dropout(
            x, self.rate, is_training, broadcast_dims=self.broadcast_dims, stream=self.stream
        )
