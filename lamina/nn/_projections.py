"""`Projection`: the projections of `MultiHeadAttention`, Flax Linen's ``DenseGeneral``.

A projection's kernel has several input or output axes (``(features, num_heads, head_dim)``
for the queries, ``(num_heads, head_dim, out_features)`` for the output), and is initialised
as Linen initialises it: as the matrix of those axes flattened, then reshaped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core.module import Module
from .._core.variables import Initializer, Parameter


@functools.partial(jax.jit, static_argnames=("n_contract", "dtype", "precision"))
def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    n_contract: int,
    dtype: Any,
    precision: Any = None,
) -> jax.Array:
    """Contracts the last `n_contract` axes of `x` with the first ones of `kernel`, plus bias.

    Linen's ``DenseGeneral`` with ``axis=-1`` (``n_contract=1``, the q/k/v projections) or
    ``axis=(-2, -1)`` (``n_contract=2``, the output projection).
    """
    x = jnp.asarray(x, dtype)
    lhs = tuple(range(x.ndim - n_contract, x.ndim))
    y = lax.dot_general(x, kernel, ((lhs, tuple(range(n_contract))), ((), ())), precision=precision)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)
    return y


class _Flattened2d:
    """An initializer seen through Linen's ``DenseGeneral``: called with the 2-d shape.

    Linen initialises a ``(in..., out...)`` kernel as a ``(prod(in), prod(out))`` matrix
    reshaped (and a bias as a vector), so fan-in and fan-out are those of the matrix.
    """

    def __init__(self, init: Initializer, n_in: int):
        self.init = init
        self.n_in = n_in
        self.lamina_batchable = getattr(init, "lamina_batchable", False)

    def __call__(self, key: Any, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        shape = tuple(shape)
        flat: tuple[int, ...]
        if self.n_in:
            flat = (math.prod(shape[: self.n_in]), math.prod(shape[self.n_in :]))
        else:
            flat = (math.prod(shape),)
        return self.init(key, flat, dtype).reshape(shape)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Flattened2d and self.n_in == other.n_in and self.init == other.init

    def __hash__(self) -> int:
        return hash((_Flattened2d, self.n_in, self.init))

    def __repr__(self) -> str:
        name = getattr(self.init, "__qualname__", None) or repr(self.init)
        return f"{name} (as a {'matrix' if self.n_in else 'vector'})"


class Projection(Module):
    """The variables of one Linen ``DenseGeneral`` of the attention: ``kernel`` and ``bias``."""

    def __init__(
        self,
        kernel_shape: tuple[int, ...],
        bias_shape: tuple[int, ...],
        n_in: int,
        use_bias: bool,
        kernel_init: Initializer,
        bias_init: Initializer,
        dtype: Any,
        param_dtype: Any,
    ):
        super().__init__()
        self.kernel = Parameter(kernel_shape, _Flattened2d(kernel_init, n_in), dtype, param_dtype)
        self.bias = (
            Parameter(bias_shape, _Flattened2d(bias_init, 0), dtype, param_dtype)
            if use_bias
            else None
        )

    def arrays(self) -> tuple[jax.Array, jax.Array | None]:
        """The kernel and bias values (inside a call)."""
        return self.kernel.value, None if self.bias is None else self.bias.value
