"""Normalisation of each example over chosen axes: `LayerNorm` and `RMSNorm` (Flax Linen's).

Both take Linen's `LayerNorm` options (`reduction_axes`, `feature_axes`...); the statistics,
dtypes and the kernel are those of every normalisation layer (`normalization`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.types import Dtype, Initializer
from . import _checks
from .normalization import Normalization, axes_setting, canonical_axes


class _OverAxes(Normalization):
    """What `LayerNorm` and `RMSNorm` share: their options (Linen's, `LayerNorm`'s signature).

    The statistics are taken over `reduction_axes` of each example, the scale (and bias) is
    learned over `feature_axes`. Two classes, not one a subclass of the other, so that a
    filter by type (``lm.DiffState(0, lm.LayerNorm)``) picks one kind.
    """

    reduction_axes = _checks.Setting()
    feature_axes = _checks.Setting()

    def __init__(
        self,
        size: int | Sequence[int],
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Initializer = initializers.ones(),
        bias_init: Initializer = initializers.zeros(),
        reduction_axes: int | Sequence[int] = -1,
        feature_axes: int | Sequence[int] = -1,
        use_fast_variance: bool = True,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        self.reduction_axes = axes_setting(where, "reduction_axes", reduction_axes)
        self.feature_axes = axes_setting(where, "feature_axes", feature_axes)
        super().__init__(
            size,
            feature_axes=self.feature_axes,
            epsilon=epsilon,
            use_scale=use_scale,
            use_bias=use_bias,
            scale_init=scale_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
            use_fast_variance=use_fast_variance,
            axis_name=axis_name,
            axis_index_groups=axis_index_groups,
            scale_sharding=scale_sharding,
            bias_sharding=bias_sharding,
        )

    def _reduction_axes(self, shape: tuple[int, ...], features: tuple[int, ...]) -> tuple[int, ...]:
        return canonical_axes(self._describe, "reduction_axes", self.reduction_axes, shape)


class LayerNorm(_OverAxes):
    """Layer normalisation, as Flax Linen's ``LayerNorm``.

    Each example is normalised to zero mean and unit variance over `reduction_axes` (the last
    axis by default), then scaled and shifted per feature (the `feature_axes`). Variables are
    Linen's: params ``scale`` and ``bias`` of the feature axes' shape, ``(size,)`` for one.

    Called as ``norm(x, mask=None)``: with a boolean `mask` broadcastable to `x`, only its
    True entries count in the statistics (every entry is still normalised).

    Args:
        size: Size of the feature axis, or a tuple of sizes, one per feature axis in the order
            the axes have in the input.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        reduction_axes: The axes the statistics are taken over (an int or a tuple).
        feature_axes: The axes with a learned scale and bias each (an int or a tuple).
        use_fast_variance: ``E[|x|^2] - |E[x]|^2`` in one pass (Linen's default); False
            computes ``E[|x - E[x]|^2]``, precise for inputs far from zero.
        axis_name: A mapped axis (``jax.vmap``/``pmap``/``shard_map``) over which the
            statistics are also averaged (Linen's), or None.
        axis_index_groups: Groups of that axis' indices averaged separately.
        dtype: Output dtype; None: the promotion of the input's, the scale's and the bias's
            dtypes (Linen's default). Statistics are computed in at least float32.
        param_dtype: Storage dtype of the learned variables (default: `dtype`, float32 when
            `dtype` is None), which are also applied in it, as Linen does.
        scale_sharding: Logical axis names of the scale, one per feature axis (e.g.
            ``("embed",)``), for `lm.shardings`; None: replicated.
        bias_sharding: Logical axis names of the bias, likewise.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.LayerNorm(2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[1.0, 3.0]]))
        >>> y.round(3)
        Array([[-1.,  1.]], dtype=float32)
        >>> both = lm.LayerNorm((2, 3), reduction_axes=(-2, -1), feature_axes=(-2, -1))
        >>> init, apply = lm.transform(both)
        >>> init(jax.random.key(0))["params"]["scale"].shape
        (2, 3)
    """

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises `x` over the reduction axes (statistics over `mask`'s True entries)."""
        return self._normalize(x, mask)


class RMSNorm(_OverAxes):
    """Root-mean-square normalisation, as Flax Linen's ``RMSNorm``.

    Each example is divided by its root mean square over `reduction_axes` (the last axis by
    default; no centring), then scaled per feature. The variable is Linen's: param ``scale``
    of the feature axes' shape, ``(size,)`` for one.

    Called as ``norm(x, mask=None)``: with a boolean `mask` broadcastable to `x`, only its
    True entries count in the mean square.

    Args:
        size: Size of the feature axis, or a tuple of sizes, one per feature axis in the order
            the axes have in the input.
        epsilon: Added to the mean square before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        scale_init: Initializer of the scale (default: ones, or zeros with
            ``scale_offset=1.0``: the effective scale starts at 1).
        reduction_axes: The axes the mean square is taken over (an int or a tuple).
        feature_axes: The axes with a learned scale each (an int or a tuple).
        use_fast_variance: Accepted for Linen's signature; the mean square has no second pass.
        axis_name: A mapped axis (``jax.vmap``/``pmap``/``shard_map``) over which the
            statistics are also averaged (Linen's), or None.
        axis_index_groups: Groups of that axis' indices averaged separately.
        dtype: Output dtype; None: the promotion of the input's, the scale's and the bias's
            dtypes (Linen's default). Statistics are computed in at least float32.
        param_dtype: Storage dtype of the learned variables (default: `dtype`, float32 when
            `dtype` is None), which are also applied in it, as Linen does.
        scale_sharding: Logical axis names of the scale, one per feature axis (e.g.
            ``("embed",)``), for `lm.shardings`; None: replicated.
        scale_offset: Added to the stored scale: the layer multiplies by ``scale_offset +
            scale`` (Gemma's ``(1 + w)`` is ``scale_offset=1.0``, with the scale initialised
            to zeros by default), in the statistics' dtype, after normalising, and then casts
            to `dtype` (Gemma's order).
        scale_in_input_dtype: Cast the normalised input back to the input's dtype before
            multiplying by the scale, the product in the promotion of the input's and the
            scale's dtypes (Llama's, Mistral's and Qwen's order, as ``transformers``
            computes it). In float32 every order gives the same values up to rounding; in
            bfloat16 only the checkpoint's own order matches it bit for bit, and only with
            ``dtype=None`` (or the checkpoint's dtype, e.g. ``jnp.bfloat16``): the default
            ``dtype=float32`` casts the input to float32 first, so the cast back is to
            float32 and the result is not the bfloat16 checkpoint's.

    Everything after `size` is keyword-only. Default options compute exactly Linen's
    ``RMSNorm`` (the scale folded into ``rsqrt(mean square + epsilon)`` first).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.RMSNorm(2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[3.0, 4.0]]))
        >>> (y**2).mean().round(3)  # unit mean square
        Array(1., dtype=float32)
        >>> gemma = lm.RMSNorm(2, scale_offset=1.0)  # Gemma's: multiplies by (1 + scale)
        >>> init, apply = lm.transform(gemma)
        >>> init(jax.random.key(0))["params"]["scale"]
        Array([0., 0.], dtype=float32)
        >>> llama = lm.RMSNorm(2, epsilon=1e-5, scale_in_input_dtype=True, dtype=None)
    """

    scale_offset = _checks.Setting()
    scale_in_input_dtype = _checks.Setting()

    def __init__(
        self,
        size: int | Sequence[int],
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        scale_init: Initializer | None = None,
        reduction_axes: int | Sequence[int] = -1,
        feature_axes: int | Sequence[int] = -1,
        use_fast_variance: bool = True,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        scale_sharding: Sequence[str | None] | None = None,
        scale_offset: float = 0.0,
        scale_in_input_dtype: bool = False,
    ):
        where = type(self).__name__
        if not (_checks.is_real(scale_offset) and math.isfinite(scale_offset)):
            error = ValueError if _checks.is_real(scale_offset) else _checks.SettingTypeError
            raise error(
                f"{where}: scale_offset must be a finite number (1.0 for Gemma's (1 + scale), "
                f"0.0 otherwise), got {scale_offset!r}."
            )
        self.scale_offset = float(scale_offset)
        self.scale_in_input_dtype = _checks.flag(
            where, "scale_in_input_dtype", scale_in_input_dtype
        )
        if self.scale_offset and not _checks.flag(where, "use_scale", use_scale):
            raise ValueError(
                f"{where}: scale_offset={scale_offset!r} is added to the scale, but use_scale "
                f"is False: there is no scale. Pass use_scale=True, or scale_offset=0.0."
            )
        if scale_init is None:  # the effective scale starts at 1
            scale_init = (
                initializers.ones()
                if self.scale_offset == 0.0
                else initializers.zeros()
                if self.scale_offset == 1.0
                else initializers.constant(1.0 - self.scale_offset)
            )
        super().__init__(
            size,
            epsilon=epsilon,
            use_scale=use_scale,
            use_bias=False,
            scale_init=scale_init,
            reduction_axes=reduction_axes,
            feature_axes=feature_axes,
            use_fast_variance=use_fast_variance,
            axis_name=axis_name,
            axis_index_groups=axis_index_groups,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_sharding=scale_sharding,
        )

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises `x` over the reduction axes (mean square over `mask`'s True entries)."""
        return self._normalize(
            x,
            mask,
            use_mean=False,
            scale_offset=self.scale_offset,
            scale_in_input_dtype=self.scale_in_input_dtype,
        )
