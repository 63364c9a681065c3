"""Flax Linen's ``DenseGeneral`` arithmetic and variables: `contract`, `declare`, `Projection`.

`DenseGeneral` and the projections of `MultiHeadAttention` (`Projection`, `dense_general`)
share them. A projection's kernel has several input or output axes (``(features, num_heads,
head_dim)`` for the queries, ``(num_heads, head_dim, out_features)`` for the output), and is
initialised as Linen initialises it: as the matrix of those axes flattened, then reshaped.
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
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import Parameter
from ..sharding.explicit import result_sharding
from . import _dtypes


@functools.partial(jax.jit, static_argnames=("axis", "n_batch", "dtype", "precision"))
def contract(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    axis: tuple[int, ...],
    n_batch: int,
    dtype: Dtype,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Linen's ``DenseGeneral``: contracts the `axis` of `x` with `kernel`, plus `bias`.

    `kernel` is ``(*batch, *contracted, *features)``: its first `n_batch` axes pair with the
    first `n_batch` axes of `x` (one kernel per batch entry), the next ``len(axis)`` are
    contracted with the axes `axis` of `x` (non-negative, in the kernel's order). `bias` is
    ``(*batch, *features)``. The output is ``(*batch, *other axes of x, *features)``; every
    operand is cast to `dtype` first. On a mesh with explicit axes the output is sharded as
    `result_sharding` says.
    """
    x, kernel = jnp.asarray(x, dtype), jnp.asarray(kernel, dtype)
    batch = tuple(range(n_batch))
    contracted = tuple(range(n_batch, n_batch + len(axis)))
    x_labels = [("x", d) for d in range(x.ndim)]
    k_labels = [("k", d) for d in range(kernel.ndim)]
    for k, d in [*zip(batch, batch, strict=True), *zip(contracted, axis, strict=True)]:
        k_labels[k] = x_labels[d]
    free = [x_labels[d] for d in range(n_batch, x.ndim) if d not in axis]
    out_labels = (*x_labels[:n_batch], *free, *k_labels[n_batch + len(axis) :])
    out = result_sharding(out_labels, (x, x_labels), (kernel, k_labels))
    y = lax.dot_general(
        x,
        kernel,
        ((axis, contracted), (batch, batch)),
        precision=precision,
        out_sharding=out,
    )
    if bias is not None:
        ones = (1,) * (y.ndim - bias.ndim)
        bias = jnp.asarray(bias, dtype)
        y = y + jnp.reshape(bias, bias.shape[:n_batch] + ones + bias.shape[n_batch:])
    return y


@functools.partial(jax.jit, static_argnames=("n_contract", "dtype", "precision"))
def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    n_contract: int,
    dtype: Dtype,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Contracts the last `n_contract` axes of `x` with the first ones of `kernel`, plus bias.

    Linen's ``DenseGeneral`` with ``axis=-1`` (``n_contract=1``, the q/k/v projections) or
    ``axis=(-2, -1)`` (``n_contract=2``, the output projection): `contract` without batch
    axes. Every operand is cast to `dtype`.
    """
    axis = tuple(range(x.ndim - n_contract, x.ndim))
    return contract(x, kernel, bias, axis, 0, dtype, precision)


class _Flattened2d:
    """An initializer seen through Linen's ``DenseGeneral``: called with the 2-d shape.

    Linen initialises a ``(in..., out...)`` kernel as a ``(prod(in), prod(out))`` matrix
    reshaped (and a bias as a vector), so fan-in and fan-out are those of the matrix.
    """

    def __init__(self, init: Initializer, n_in: int):
        self.init = init
        self.n_in = n_in
        self.lamina_batchable = getattr(init, "lamina_batchable", False)

    def __call__(self, key: Any, shape: Sequence[int], dtype: Dtype = jnp.float32) -> jax.Array:
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


def declare(
    kernel_shape: tuple[int, ...],
    bias_shape: tuple[int, ...],
    n_in: int,
    use_bias: bool,
    kernel_init: Initializer,
    bias_init: Initializer,
    dtype: Dtype,
    param_dtype: Dtype,
    kernel_sharding: tuple[str | None, ...] | None = None,
    bias_sharding: tuple[str | None, ...] | None = None,
) -> tuple[Parameter, Parameter | None]:
    """Linen's ``DenseGeneral`` variables: ``kernel``, and ``bias`` (None without `use_bias`).

    The kernel's first `n_in` axes are its fan-in (batch and contracted axes), the rest its
    fan-out: the initializers see the ``(prod(in), prod(out))`` matrix and the flat bias.
    """
    kernel = Parameter(
        kernel_shape, _Flattened2d(kernel_init, n_in), dtype, param_dtype, sharding=kernel_sharding
    )
    if not use_bias:
        return kernel, None
    bias_init = _Flattened2d(bias_init, 0)
    return kernel, Parameter(bias_shape, bias_init, dtype, param_dtype, sharding=bias_sharding)


class Projection(Module):
    """The variables of one Linen ``DenseGeneral`` of the attention: ``kernel`` and ``bias``."""

    # lm.with_policy: MultiHeadAttention reads these variables in its own computation (it
    # calls a Projection only as the base of a LoRA put in its place).
    _lamina_read_by_parent = True

    def __init__(
        self,
        kernel_shape: tuple[int, ...],
        bias_shape: tuple[int, ...],
        n_in: int,
        use_bias: bool,
        kernel_init: Initializer,
        bias_init: Initializer,
        dtype: Dtype,
        param_dtype: Dtype,
        kernel_sharding: tuple[str | None, ...] | None = None,
        bias_sharding: tuple[str | None, ...] | None = None,
    ):
        super().__init__()
        self.n_in = n_in
        self.kernel, self.bias = declare(
            kernel_shape,
            bias_shape,
            n_in,
            use_bias,
            kernel_init,
            bias_init,
            dtype,
            param_dtype,
            kernel_sharding,
            bias_sharding,
        )

    def arrays(self) -> tuple[jax.Array, jax.Array | None]:
        """The kernel and bias values (inside a call)."""
        return self.kernel.value, None if self.bias is None else self.bias.value

    def _describe(self) -> str:
        return f"Projection(kernel {tuple(self.kernel.shape)})"

    @property
    def in_shape(self) -> tuple[int, ...]:
        """The contracted (last) axes of the input: the kernel's first `n_in` axes."""
        return tuple(self.kernel.shape[: self.n_in])

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The axes the projection adds: the kernel's last axes (``(heads, head_dim)``)."""
        return tuple(self.kernel.shape[self.n_in :])

    def __call__(self, x: jax.Array) -> jax.Array:
        """The projection alone (as a LoRA base calls it): `dense_general` of `x`.

        Computes in the promotion of `x` and the variables. The attention itself reads the
        kernel and bias and projects the queries, keys and values in one compiled call.
        """
        kernel, bias = self.arrays()
        dtype = _dtypes.compute_dtype(self, None, x, kernel, bias)
        return dense_general(x, kernel, bias, self.n_in, dtype)


@functools.partial(jax.jit, static_argnames=("dtypes", "precision"))
def project_qkv(
    inputs: tuple[jax.Array, jax.Array, jax.Array],
    params: tuple[tuple[jax.Array, jax.Array | None], ...],
    dtypes: tuple[Any, Any, Any],
    precision: PrecisionLike,
) -> tuple[jax.Array, ...]:
    """The query, key and value projections (Linen's three ``DenseGeneral``), in one call."""
    return tuple(
        dense_general(x, kernel, bias, 1, dtype, precision)
        for x, (kernel, bias), dtype in zip(inputs, params, dtypes, strict=True)
    )


@functools.partial(jax.jit, static_argnames=("dtype", "precision"))
def project_heads_out(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    fits: jax.Array | None,
    dtype: Dtype,
    precision: PrecisionLike,
) -> jax.Array:
    """The output projection of the heads; NaN where a decoding step overflowed the cache."""
    out = dense_general(x, kernel, bias, 2, dtype, precision)
    return out if fits is None else jnp.where(fits, out, jnp.nan)
