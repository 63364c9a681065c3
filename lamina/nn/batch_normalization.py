"""`BatchNorm`: normalisation with the batch's statistics, and their running averages.

Numerically Flax Linen's ``BatchNorm``, with Linen's options and variables; the statistics and
the normalisation are those of the other normalisation layers (`lamina.nn.normalization`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import initializers
from .._core.types import Dtype, Initializer
from .._core.variables import BatchStat
from . import _checks, _dtypes
from .normalization import (
    Normalization,
    axes_setting,
    check_mask,
    moments,
    normalize,
    promote,
    statistics_dtype,
    unbound_axis_message,
)


@functools.partial(
    jax.jit,
    static_argnames=(
        "is_training",
        "feature_axes",
        "momentum",
        "epsilon",
        "dtype",
        "stats_dtype",
        "use_fast_variance",
        "axis_name",
        "axis_index_groups",
    ),
)
def batch_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    mean: jax.Array,
    var: jax.Array,
    mask: jax.Array | None = None,
    *,
    is_training: bool,
    feature_axes: tuple[int, ...],
    momentum: float,
    epsilon: float,
    dtype: Dtype,
    stats_dtype: Dtype,
    use_fast_variance: bool = True,
    axis_name: Hashable | None = None,
    axis_index_groups: Any = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Batch normalisation over all axes but `feature_axes`: returns ``(y, new_mean, new_var)``.

    Training: normalises with the batch's statistics (over `mask`'s True entries, averaged
    over the mapped `axis_name` when given) and returns the running averages
    ``momentum * ra + (1 - momentum) * stat``. Not training: normalises with the running
    averages `mean` and `var`; ``new_mean`` and ``new_var`` are None. `feature_axes` are
    non-negative and increasing; `mean` and `var` have their shape.
    """
    x = jnp.asarray(x)
    feature_shape = tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))
    if not is_training:
        mean, var = jnp.reshape(mean, feature_shape), jnp.reshape(var, feature_shape)
        return normalize(x, mean, var, scale, bias, feature_axes, epsilon, dtype), None, None
    reduction = tuple(a for a in range(x.ndim) if a not in feature_axes)
    batch_mean, batch_var = moments(
        x,
        reduction,
        stats_dtype,
        use_fast_variance=use_fast_variance,
        mask=mask,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    )
    assert batch_mean is not None
    y = normalize(x, batch_mean, batch_var, scale, bias, feature_axes, epsilon, dtype)
    new_mean = _average(mean, jnp.reshape(batch_mean, mean.shape), momentum)
    new_var = _average(var, jnp.reshape(batch_var, var.shape), momentum)
    return y, new_mean, new_var


def _average(running: jax.Array, batch: jax.Array, momentum: float) -> jax.Array:
    """``momentum * running + (1 - momentum) * batch`` in the promotion of their dtypes."""
    dtype = promote(running.dtype, batch.dtype)
    return momentum * running.astype(dtype) + (1 - momentum) * batch.astype(dtype)


class BatchNorm(Normalization):
    """Batch normalisation over all axes but the features (the last), as Flax Linen's.

    Called as ``bn(x, is_training, mask=None)``. While training, `x` is normalised with the
    mean and variance of the batch (every axis but the feature axes; with a boolean `mask`
    broadcastable to `x`, over its True entries only) and the running averages are updated,
    ``ra = momentum * ra + (1 - momentum) * batch_stat``; otherwise the running averages
    normalise `x` and nothing is written. Variables are Linen's: params ``scale`` and
    ``bias``, and batch stats ``mean`` and ``var`` (collection ``"batch_stats"``), all of the
    feature axes' shape, ``(size,)`` for one.

    The running averages are stored in the dtype the statistics are computed in:
    ``promote_types(float32, dtype)`` (``dtype``: `param_dtype` when `dtype` is None), so
    float32 for bfloat16 or float32 layers; the mean of a complex layer is complex and its
    variance real, as Linen's become.

    `is_training` must be a Python bool, because it decides whether state is written: under
    `jax.jit`, make it static (``jax.jit(step, static_argnames="is_training")``) or call
    ``apply`` with a literal ``True``/``False`` inside the jitted function.

    Args:
        size: Size of the feature axis, or a tuple of sizes, one per feature axis in the order
            the axes have in the input.
        momentum: Decay of the running averages, in ``[0, 1]``.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        axis: The feature axes (Linen's name): an int or a tuple; every other axis is
            reduced.
        axis_name: Name of a mapped axis (``jax.vmap``/``pmap``/``shard_map``) over which the
            batch statistics are averaged (``lax.pmean``), so that data-parallel replicas
            normalise with the statistics of the whole batch.
        axis_index_groups: Groups of the mapped axis' indices whose statistics are averaged
            separately (``lax.pmean``'s, Linen's), e.g. ``[[0, 1], [2, 3]]``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        use_fast_variance: ``E[|x|^2] - |E[x]|^2`` in one pass (Linen's default); False
            computes ``E[|x - E[x]|^2]``, precise for inputs far from zero.
        dtype: Output dtype; None: the promotion of the input's, the scale's and the bias's
            dtypes (Linen's default). Statistics are computed in at least float32.
        param_dtype: Storage dtype of ``scale`` and ``bias`` (default: `dtype`, float32 when
            `dtype` is None), which are also applied in it, as Linen does.
        scale_sharding: Logical axis names of the scale, one per feature axis (e.g.
            ``("embed",)``), for `lm.shardings`; the running ``mean`` and ``var`` have the
            same axes and take the same names. None: replicated.
        bias_sharding: Logical axis names of the bias, likewise.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.BatchNorm(3, momentum=0.9))
        >>> variables = init(jax.random.key(0))
        >>> x = jnp.array([[0.0, 1.0, 2.0], [2.0, 3.0, 6.0]])
        >>> y, new = apply(variables, None, x, True)
        >>> y.round(3)
        Array([[-1., -1., -1.],
               [ 1.,  1.,  1.]], dtype=float32)
        >>> new["batch_stats"]["mean"]
        Array([0.1, 0.2, 0.4], dtype=float32)
        >>> y, same = apply(new, None, x, False)  # evaluation: running averages, no writes
    """

    momentum = _checks.Setting()
    axis = _checks.Setting()

    _features_option = "axis"

    def __init__(
        self,
        size: int | Sequence[int],
        *,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        axis: int | Sequence[int] = -1,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        scale_init: Initializer = initializers.ones(),
        bias_init: Initializer = initializers.zeros(),
        use_fast_variance: bool = True,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        self.axis = axes_setting(where, "axis", axis)
        super().__init__(
            size,
            feature_axes=self.axis,
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
        self.momentum = _checks.non_negative(
            where,
            "momentum",
            momentum,
            at_most=1.0,
            meaning=" (the weight of the old running average, typically 0.9 to 0.999)",
        )
        stats = statistics_dtype(self.param_dtype if self.dtype is None else self.dtype)
        shape = self.feature_shape
        names = _checks.sharding(where, "scale_sharding", scale_sharding, len(shape))
        self.mean = BatchStat(shape, initializers.zeros(), stats, sharding=names)
        self.var = BatchStat(shape, initializers.ones(), _real(stats), sharding=names)

    def _reduction_axes(self, shape: tuple[int, ...], features: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(a for a in range(len(shape)) if a not in features)

    def __call__(
        self, x: jax.Array, is_training: bool, *, mask: jax.Array | None = None
    ) -> jax.Array:
        """Normalises `x`; updates the running averages if training."""
        _checks.static_flags(type(self).__name__, is_training=is_training)
        reduction, features = self._axes(x)
        mask = check_mask(self._describe, mask, tuple(jnp.shape(x)))
        if is_training:
            self._check_batch(tuple(jnp.shape(x)), reduction, mask)
        scale, bias = self._scale_and_bias()
        dtype = _dtypes.compute_dtype(self, self.dtype, x, scale, bias)
        stats = statistics_dtype(jnp.result_type(x) if self.dtype is None else self.dtype)
        if is_training and _is_complex(stats) and not _is_complex(self.mean.param_dtype):
            raise TypeError(
                f"{self._describe()} got a {jnp.result_type(x)} input, whose batch mean is "
                f"complex, but stores its running mean as {self.mean.param_dtype}: the "
                f"imaginary part would be lost. Build the layer with dtype={stats} (or "
                f"param_dtype={stats} with dtype=None)."
            )
        with unbound_axis_message(self):
            y, new_mean, new_var = batch_norm(
                x,
                scale,
                bias,
                self.mean.value,
                self.var.value,
                mask,
                is_training=is_training,
                feature_axes=features,
                momentum=self.momentum,
                epsilon=self.epsilon,
                dtype=dtype,
                stats_dtype=stats,
                use_fast_variance=self.use_fast_variance,
                axis_name=self.axis_name if is_training else None,
                axis_index_groups=self.axis_index_groups if is_training else None,
            )
        if is_training:
            self.mean.value = new_mean
            self.var.value = new_var
        return y

    def _check_batch(
        self, shape: tuple[int, ...], reduction: tuple[int, ...], mask: jax.Array | None
    ) -> None:
        """Refuses training statistics over fewer than two entries per feature.

        Over one entry the batch mean is the entry itself, so ``x - mean`` is zero and every
        output is the bias: a silent wrong result, not a normalisation; over none the
        statistics are NaN. The count per feature is known while tracing (so the check holds
        under `jax.jit`): the product of the reduced axes' sizes, or with a concrete `mask`
        its fewest True entries over the features (a traced mask is not counted), times the
        size of the mapped axis the statistics are averaged over (`axis_name`; its group's
        size with `axis_index_groups`), which is static. A symbolic size (`jax.export`'s
        ``b``) is not known while tracing: that count is not checked.
        """
        if not all(_checks.is_int(n) for n in shape):
            return
        per_member = math.prod(shape[a] for a in reduction)
        masked = mask is not None and not isinstance(mask, jax.core.Tracer) and per_member > 0
        if masked:
            selected = np.broadcast_to(np.asarray(mask), shape).sum(axis=reduction)
            per_member = int(np.min(selected)) if selected.size else per_member
        members = self._mapped_size()
        count = per_member * members
        if count >= 2:
            return
        axes = f"axes {reduction}" if reduction else "no axis (the input has only the feature axes)"
        where = f"{_dtypes.layer_name(self)} got an input of shape {shape} while training"
        mapped = (
            f", over {members} member(s) of the mapped axis {self.axis_name!r}"
            if self.axis_name is not None
            else ""
        )
        fix = (
            "Train on batches of at least 2 examples, normalise with the running averages "
            "(is_training=False, Linen's use_running_average=True), or average the statistics "
            "over a mapped axis (axis_name=, inside lm.vmap or shard_map)."
        )
        if count == 0 and not masked:
            raise ValueError(
                f"{where}: the batch is empty (no entry along the reduced {axes}{mapped}), so "
                f"its mean and variance are NaN (0/0) and would overwrite the running averages. "
                f"Skip empty batches; {fix[0].lower()}{fix[1:]}"
            )
        if masked:
            what = (
                f"its mask selects {per_member} entr{'y' if per_member == 1 else 'ies'} for "
                f"some feature (over {axes}{mapped})"
            )
        else:
            what = f"its batch statistics reduce over {axes}{mapped}, {count} entry per feature"
        outcome = (
            "so its statistics are NaN (0/0)"
            if count == 0
            else "so the batch mean is the input itself and every output would be the bias"
        )
        if masked:
            fix = (
                f"Let the mask select at least 2 entries per feature, or: {fix[0].lower()}{fix[1:]}"
            )
        raise ValueError(f"{where}: {what}, {outcome}. {fix}")

    def _mapped_size(self) -> int:
        """The number of members whose statistics are averaged together (1 without a map).

        `lax.axis_size` is static while tracing; an axis that no map binds is left to the
        statistics' own `NameError` (`unbound_axis_message`).
        """
        if self.axis_name is None:
            return 1
        if self.axis_index_groups is not None:
            return min(len(group) for group in self.axis_index_groups)
        try:
            return int(jax.lax.axis_size(self.axis_name))
        except NameError:
            return 2  # unbound: the call raises its own, clearer error


def _is_complex(dtype: Dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.complexfloating))


def _real(dtype: np.dtype) -> np.dtype:
    """The real dtype of `dtype`'s parts (float32 for complex64); `dtype` itself if real."""
    return np.dtype(jnp.finfo(dtype).dtype) if _is_complex(dtype) else dtype
