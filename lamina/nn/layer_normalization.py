"""Normalisation of each example over chosen axes: `LayerNorm` and `RMSNorm` (Flax Linen's).

Both take Linen's `LayerNorm` options (`reduction_axes`, `feature_axes`...); the statistics,
dtypes and the kernel are those of every normalisation layer (`normalization`).
"""

from __future__ import annotations

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
        scale_init: Initializer of the scale.
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
        size: int | Sequence[int],
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        scale_init: Initializer = initializers.ones(),
        reduction_axes: int | Sequence[int] = -1,
        feature_axes: int | Sequence[int] = -1,
        use_fast_variance: bool = True,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        scale_sharding: Sequence[str | None] | None = None,
    ):
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
        return self._normalize(x, mask, use_mean=False)
