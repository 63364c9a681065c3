"""Normalisation of each example: `LayerNorm`, `RMSNorm`, `GroupNorm`; the shared numerics.

Each layer is numerically Flax Linen's layer of the same name, with Linen's variable names,
shapes and dtype handling: statistics are computed in at least float32 (bfloat16 inputs
included), the variance is Linen's fast one, ``max(0, E[x^2] - E[x]^2)``, and the learned
scale and bias are applied in their storage dtype; `dtype` is the dtype of the output.
`BatchNorm` (`lamina.nn.batch_normalization`) computes with the same functions.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.variables import Initializer, Parameter
from . import _checks


def promote(*dtypes: Any) -> Any:
    """The dtype that Linen's arithmetic would produce (JAX's standard promotion lattice)."""
    with jax.numpy_dtype_promotion("standard"):
        result = dtypes[0]
        for dtype in dtypes[1:]:
            result = jnp.promote_types(result, dtype)
    return result


def _abs_sq(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def moments(
    x: jax.Array,
    axes: tuple[int, ...],
    dtype: Any,
    use_mean: bool = True,
    axis_name: Hashable | None = None,
) -> tuple[jax.Array | None, jax.Array]:
    """Mean and variance of `x` over `axes` (kept as size-1 axes), as Linen computes them.

    The statistics are computed in ``promote_types(dtype, float32)``; the variance is
    ``max(0, E[|x|^2] - |E[x]|^2)``. With `axis_name`, both are averaged over that mapped
    axis by one ``lax.pmean``. Without `use_mean`, the mean is None and the "variance" is
    the mean square.
    """
    x = x.astype(promote(dtype, jnp.float32))
    if not use_mean:
        mean_sq = jnp.mean(_abs_sq(x), axes, keepdims=True)
        if axis_name is not None:
            mean_sq = lax.pmean(mean_sq, axis_name)
        return None, mean_sq
    mean = jnp.mean(x, axes, keepdims=True)
    mean_sq = jnp.mean(_abs_sq(x), axes, keepdims=True)
    if axis_name is not None:
        both = lax.pmean(jnp.stack([mean, mean_sq]), axis_name)  # one collective
        mean, mean_sq = both[0], both[1]
    return mean, jnp.maximum(0.0, mean_sq - _abs_sq(mean))


def normalize(
    x: jax.Array,
    mean: jax.Array | None,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    epsilon: float,
    dtype: Any,
) -> jax.Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias``, cast to `dtype`.

    `mean` and `var` have the rank of `x`; `scale` and `bias` are feature vectors. The
    operations, their order and their dtypes are Linen's: ``x - mean`` in the promoted dtype
    of both, ``rsqrt`` in the statistics' dtype, the scale folded into that factor first.
    """
    feature_shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    if mean is None:  # Linen subtracts a zero mean, which changes nothing
        y = x.astype(promote(x.dtype, var.dtype))
    else:
        y_dtype = promote(x.dtype, mean.dtype)
        y = x.astype(y_dtype) - mean.astype(y_dtype)
    mul = lax.rsqrt(var + epsilon)
    if scale is not None:
        mul_dtype = promote(mul.dtype, scale.dtype)
        mul = mul.astype(mul_dtype) * jnp.reshape(scale, feature_shape).astype(mul_dtype)
    y_dtype = promote(y.dtype, mul.dtype)
    y = y.astype(y_dtype) * mul.astype(y_dtype)
    if bias is not None:
        y_dtype = promote(y.dtype, bias.dtype)
        y = y.astype(y_dtype) + jnp.reshape(bias, feature_shape).astype(y_dtype)
    return y.astype(dtype)


@functools.partial(jax.jit, static_argnames=("epsilon", "dtype"))
def layer_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    epsilon: float,
    dtype: Any,
) -> jax.Array:
    """Layer normalisation over the last axis of `x` (Linen's ``LayerNorm``)."""
    x = jnp.asarray(x)
    mean, var = moments(x, (x.ndim - 1,), dtype)
    return normalize(x, mean, var, scale, bias, epsilon, dtype)


@functools.partial(jax.jit, static_argnames=("epsilon", "dtype"))
def rms_norm(x: jax.Array, scale: jax.Array | None, *, epsilon: float, dtype: Any) -> jax.Array:
    """Root-mean-square normalisation over the last axis of `x` (Linen's ``RMSNorm``)."""
    x = jnp.asarray(x)
    _, mean_sq = moments(x, (x.ndim - 1,), dtype, use_mean=False)
    return normalize(x, None, mean_sq, scale, None, epsilon, dtype)


@functools.partial(jax.jit, static_argnames=("num_groups", "epsilon", "dtype"))
def group_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    num_groups: int,
    epsilon: float,
    dtype: Any,
) -> jax.Array:
    """Group normalisation (Linen's ``GroupNorm``).

    The channels (last axis) are split into `num_groups` consecutive groups; each group's
    statistics are taken over its channels and all axes but the first (the batch axis).
    """
    x = jnp.asarray(x)
    channels = x.shape[-1]
    group_size = channels // num_groups
    grouped = jnp.reshape(x, (*x.shape[:-1], num_groups, group_size))
    axes = (*range(1, x.ndim - 1), x.ndim)  # spatial axes and the channels within a group
    mean, var = moments(grouped, axes, dtype)
    assert mean is not None

    def per_channel(stat: jax.Array) -> jax.Array:  # (..., G, 1) -> (..., G * group_size)
        stat = jnp.broadcast_to(stat, (*stat.shape[:-1], group_size))
        return jnp.reshape(stat, (*stat.shape[:-2], channels))

    return normalize(x, per_channel(mean), per_channel(var), scale, bias, epsilon, dtype)


class Normalization(Module):
    """What the normalisation layers share: their size, epsilon, dtypes, scale and bias.

    `BatchNorm`, `LayerNorm`, `RMSNorm` and `GroupNorm` declare ``scale`` and ``bias`` of
    shape ``(size,)`` here, as Linen does: stored in `param_dtype` and applied in it (never
    cast to the compute dtype), so `.value` returns them in `param_dtype`.
    """

    size = _checks.Setting()
    epsilon = _checks.Setting()
    use_scale = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()

    def __init__(
        self,
        size: int,
        *,
        epsilon: float,
        use_scale: bool,
        use_bias: bool,
        scale_init: Initializer,
        bias_init: Initializer,
        dtype: Any,
        param_dtype: Any,
    ):
        super().__init__()
        where = type(self).__name__
        meaning = ", the size of the input's last axis (its features or channels)"
        self.size = _checks.positive_int(where, "size", size, meaning)
        meaning = " (it is added to the variance before the square root)"
        self.epsilon = _checks.non_negative(where, "epsilon", epsilon, meaning=meaning)
        self.use_scale = _checks.flag(where, "use_scale", use_scale)
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.dtype = _checks.inexact_dtype(where, "dtype", dtype)
        self.param_dtype = _checks.storage_dtype(where, param_dtype, self.dtype)
        scale_init = _checks.initializer(where, "scale_init", scale_init)
        bias_init = _checks.initializer(where, "bias_init", bias_init)
        stored, shape = self.param_dtype, (self.size,)
        self.scale = Parameter(shape, scale_init, stored, stored) if self.use_scale else None
        self.bias = Parameter(shape, bias_init, stored, stored) if self.use_bias else None

    def _describe(self) -> str:
        return f"{type(self).__name__}(size={self.size})"

    def _check_input(self, x: Any) -> None:
        """Raises unless the last axis of `x` holds `size` features."""
        hint = "The features must be on the last axis."
        _checks.check_last_axis(self._describe, x, self.size, "size", hint=hint)

    def _scale_and_bias(self) -> tuple[jax.Array | None, jax.Array | None]:
        scale = self.scale.value if self.scale is not None else None
        bias = self.bias.value if self.bias is not None else None
        return scale, bias


class LayerNorm(Normalization):
    """Layer normalisation over the last axis, as Flax Linen's ``LayerNorm``.

    Each vector along the last axis is normalised to zero mean and unit variance, then scaled
    and shifted per feature. Variables are Linen's: params ``scale`` and ``bias`` of shape
    ``(size,)``.

    Args:
        size: Size of the input's last axis.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        dtype: Output dtype; statistics are computed in at least float32.
        param_dtype: Storage dtype of ``scale`` and ``bias`` (default: `dtype`), which are
            also applied in it, as Linen does.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.LayerNorm(2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[1.0, 3.0]]))
        >>> y.round(3)
        Array([[-1.,  1.]], dtype=float32)
    """

    def __init__(
        self,
        size: int,
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Initializer = initializers.ones(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            size,
            epsilon=epsilon,
            use_scale=use_scale,
            use_bias=use_bias,
            scale_init=scale_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises `x` of shape ``(..., size)`` over its last axis."""
        self._check_input(x)
        scale, bias = self._scale_and_bias()
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


class RMSNorm(Normalization):
    """Root-mean-square normalisation over the last axis, as Flax Linen's ``RMSNorm``.

    Each vector along the last axis is divided by its root mean square (no centring), then
    scaled per feature. The variable is Linen's: param ``scale`` of shape ``(size,)``.

    Args:
        size: Size of the input's last axis.
        epsilon: Added to the mean square before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        scale_init: Initializer of the scale.
        dtype: Output dtype; statistics are computed in at least float32.
        param_dtype: Storage dtype of ``scale`` (default: `dtype`), which is also applied
            in it, as Linen does.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.RMSNorm(2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[3.0, 4.0]]))
        >>> (y**2).mean().round(3)  # unit mean square
        Array(1., dtype=float32)
    """

    def __init__(
        self,
        size: int,
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        scale_init: Initializer = initializers.ones(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            size,
            epsilon=epsilon,
            use_scale=use_scale,
            use_bias=False,
            scale_init=scale_init,
            bias_init=initializers.zeros(),
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises `x` of shape ``(..., size)`` over its last axis."""
        self._check_input(x)
        scale, _ = self._scale_and_bias()
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype)


class GroupNorm(Normalization):
    """Group normalisation, as Flax Linen's ``GroupNorm``.

    The channels (the last axis) are split into `num_groups` groups of consecutive channels;
    each group is normalised with the mean and variance over its channels and every axis but
    the first (the batch axis): for images ``(batch, height, width, channels)``, over height,
    width and the group's channels. ``num_groups=1`` normalises over all non-batch axes,
    ``num_groups=size`` is instance normalisation. Variables are Linen's: params ``scale`` and
    ``bias`` of shape ``(size,)``.

    Args:
        num_groups: Number of channel groups; must divide `size`.
        size: Size of the input's last axis (the channels).
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        dtype: Output dtype; statistics are computed in at least float32.
        param_dtype: Storage dtype of ``scale`` and ``bias`` (default: `dtype`), which are
            also applied in it, as Linen does.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.GroupNorm(2, 4))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[1.0, 3.0, 5.0, 5.0]]))
        >>> y.round(3)
        Array([[-1.,  1.,  0.,  0.]], dtype=float32)
    """

    num_groups = _checks.Setting()

    def __init__(
        self,
        num_groups: int,
        size: int,
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Initializer = initializers.ones(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            size,
            epsilon=epsilon,
            use_scale=use_scale,
            use_bias=use_bias,
            scale_init=scale_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        where, size = type(self).__name__, self.size
        num_groups = _checks.positive_int(where, "num_groups", num_groups)
        if size % num_groups:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
            raise ValueError(
                f"{where}: num_groups={num_groups} does not divide size={size}: every group "
                f"must hold the same number of channels. Choose num_groups among the divisors "
                f"of {size}: {shown}."
            )
        self.num_groups = num_groups

    def _describe(self) -> str:
        return f"{type(self).__name__}(num_groups={self.num_groups}, size={self.size})"

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalises `x` of shape ``(batch, ..., size)`` per group of channels."""
        self._check_input(x)
        scale, bias = self._scale_and_bias()
        return group_norm(
            x, scale, bias, num_groups=self.num_groups, epsilon=self.epsilon, dtype=self.dtype
        )
