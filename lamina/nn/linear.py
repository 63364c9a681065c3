"""Linear layers: `Dense`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.variables import Initializer, Parameter


@functools.partial(jax.jit, static_argnames=("dtype", "precision"))
def dense(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype: Any, precision: Any = None
) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of `x`, computed in `dtype`.

    One compiled call: eagerly it costs one dispatch instead of three, and inside `jax.jit`
    it inlines into the caller's program.
    """
    x = jnp.asarray(x, dtype)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class Dense(Module):
    """A fully connected layer, ``y = x @ kernel + bias``, over the last axis.

    Variables are Flax Linen's: ``kernel`` of shape ``(in_size, out_size)``, ``bias`` of
    shape ``(out_size,)``.

    Args:
        in_size: Size of the input's last axis.
        out_size: Size of the output's last axis.
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (inputs are cast to it).
        param_dtype: Storage dtype of the variables (default: `dtype`).
        precision: `jax.lax.Precision` of the matrix product.
        kernel_sharding: Logical axis names of the kernel, e.g. ``("embed", "mlp")``.
        bias_sharding: Logical axis name of the bias, e.g. ``("mlp",)``.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dense(4, 2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.ones((3, 4)))
        >>> y.shape
        (3, 2)
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        precision: Any = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        self.in_size = in_size
        self.out_size = out_size
        self.use_bias = use_bias
        self.dtype = dtype
        self.precision = precision
        self.kernel = Parameter(
            (in_size, out_size), kernel_init, dtype, param_dtype, sharding=kernel_sharding
        )
        self.bias = (
            Parameter((out_size,), bias_init, dtype, param_dtype, sharding=bias_sharding)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to `x` of shape ``(..., in_size)``."""
        bias = self.bias.value if self.bias is not None else None
        return dense(x, self.kernel.value, bias, self.kernel.dtype, self.precision)
