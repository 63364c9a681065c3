"""Normalisation per group of channels and per instance: `GroupNorm` and `InstanceNorm`.

Each is Flax Linen's layer of the same name; the statistics, dtypes and the kernel are those
of every normalisation layer (`normalization`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.types import Dtype, Initializer
from . import _checks
from .normalization import Normalization, axes_setting, canonical_axes, show_axes


class GroupNorm(Normalization):
    """Group normalisation, as Flax Linen's ``GroupNorm``.

    The channels (the last axis) are split into groups of consecutive channels, given as
    `num_groups` or as `group_size` (exactly one; ``GroupNorm(None, 64, group_size=16)``);
    each group is normalised with the mean and variance over its channels and the other
    `reduction_axes`: by default every axis but the first (the batch axis), so for images
    ``(batch, height, width, channels)``, over height, width and the group's channels.
    ``num_groups=1`` normalises over all non-batch axes, ``group_size=1`` is instance
    normalisation. Variables are Linen's: params ``scale`` and ``bias`` of shape ``(size,)``.

    Called as ``norm(x, mask=None)``: with a boolean `mask` broadcastable to `x`, only its
    True entries count in the statistics.

    Args:
        num_groups: Number of channel groups (it must divide `size`), or None with
            `group_size`.
        size: Size of the input's last axis (the channels).
        group_size: Number of channels per group (it must divide `size`), instead of
            `num_groups`.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        reduction_axes: The axes of the statistics, which must include the last one (an int
            or a tuple); None: every axis but the first.
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
        >>> init, apply = lm.transform(lm.GroupNorm(2, 4))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.array([[1.0, 3.0, 5.0, 5.0]]))
        >>> y.round(3)
        Array([[-1.,  1.,  0.,  0.]], dtype=float32)
        >>> lm.GroupNorm(None, 4, group_size=2).num_groups
        2
    """

    num_groups = _checks.Setting()
    group_size = _checks.Setting()
    reduction_axes = _checks.Setting()

    def __init__(
        self,
        num_groups: int | None,
        size: int,
        *,
        group_size: int | None = None,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Initializer = initializers.ones(),
        bias_init: Initializer = initializers.zeros(),
        reduction_axes: int | Sequence[int] | None = None,
        use_fast_variance: bool = True,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        size = _channels(where, size)
        super().__init__(
            size,
            feature_axes=(-1,),
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
        self.num_groups, self.group_size = self._groups(where, num_groups, group_size)
        self.reduction_axes = (
            None
            if reduction_axes is None
            else axes_setting(where, "reduction_axes", reduction_axes)
        )

    def _groups(self, where: str, num_groups: Any, group_size: Any) -> tuple[int, int]:
        """``(num_groups, group_size)`` from exactly one of them, which must divide `size`."""
        size = self.size
        if (num_groups is None) == (group_size is None):
            raise ValueError(
                f"{where}: give exactly one of num_groups and group_size, got "
                f"num_groups={num_groups!r} and group_size={group_size!r}: "
                f"GroupNorm({size // 2 if size % 2 == 0 else 1}, {size}) splits the channels "
                f"into groups by count, GroupNorm(None, {size}, group_size=...) by size."
            )
        if num_groups is not None:
            num_groups = _checks.positive_int(where, "num_groups", num_groups)
            self._check_divides(where, "num_groups", num_groups)
            return num_groups, size // num_groups
        group_size = _checks.positive_int(where, "group_size", group_size)
        self._check_divides(where, "group_size", group_size)
        return size // group_size, group_size

    def _check_divides(self, where: str, name: str, value: int) -> None:
        size = self.size
        if size % value:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
            what = "group must hold" if name == "num_groups" else "channel must be in a group of"
            raise ValueError(
                f"{where}: {name}={value} does not divide size={size}: every {what} the same "
                f"number of channels. Choose {name} among the divisors of {size}: {shown}."
            )

    def _describe(self) -> str:
        return f"{type(self).__name__}(num_groups={self.num_groups}, size={self.size})"

    def _reduction_axes(self, shape: tuple[int, ...], features: tuple[int, ...]) -> tuple[int, ...]:
        if self.reduction_axes is None:
            return (*range(1, len(shape) - 1), len(shape) - 1)
        axes = canonical_axes(self._describe, "reduction_axes", self.reduction_axes, shape)
        if axes[-1] != len(shape) - 1:
            raise ValueError(
                f"{self._describe()}: reduction_axes={show_axes(self.reduction_axes)} must include "
                f"the last axis (the channels, which the groups split); add -1."
            )
        return axes

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises `x` of shape ``(batch, ..., size)`` per group of channels."""
        return self._normalize(x, mask, group_size=self.group_size)


class InstanceNorm(Normalization):
    """Instance normalisation, as Flax Linen's ``InstanceNorm``.

    Each example (the first axis is the batch) and each feature is normalised on its own, with
    the statistics over every other axis: for images ``(batch, height, width, channels)``,
    over height and width, per channel. Variables are Linen's: params ``scale`` and ``bias``
    of the feature axes' shape, ``(size,)`` for one.

    Called as ``norm(x, mask=None)``: with a boolean `mask` broadcastable to `x`, only its
    True entries count in the statistics.

    Args:
        size: Size of the feature axis, or a tuple of sizes, one per feature axis in the order
            the axes have in the input.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        feature_axes: The axes with a learned scale and bias each (not the first, the batch
            axis); the statistics are taken over the others but the first.
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
        >>> init, apply = lm.transform(lm.InstanceNorm(2))
        >>> x = jnp.array([[[1.0, 0.0], [3.0, 0.0]]])  # (batch, length, channels)
        >>> y, _ = apply(init(jax.random.key(0)), None, x)
        >>> y.round(3)
        Array([[[-1.,  0.],
                [ 1.,  0.]]], dtype=float32)
    """

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
        self.feature_axes = axes_setting(where, "feature_axes", feature_axes)
        if 0 in self.feature_axes:
            raise ValueError(
                f"{where}: feature_axes={show_axes(self.feature_axes)} includes axis 0, the batch "
                f"axis, which InstanceNorm never normalises over or scales. Put the features "
                f"on other axes (the last, by default)."
            )
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
        if 0 in features:
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}, where "
                f"feature_axes={show_axes(self.feature_axes)} include axis 0, the batch axis. "
                f"Pass an input with a batch axis in front, (batch, ..., features)."
            )
        return tuple(a for a in range(1, len(shape)) if a not in features)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises `x` of shape ``(batch, ...)`` per example and feature."""
        return self._normalize(x, mask)


def _channels(where: str, size: Any) -> int:
    """`size`, a positive int: the one channel axis that the groups split."""
    if _checks.is_int(size) or not isinstance(size, (tuple, list)):
        return _checks.positive_int(
            where, "size", size, ", the size of the input's last axis (its channels)"
        )
    raise TypeError(
        f"{where}: size must be a positive int, the size of the input's last axis (its "
        f"channels), got {size!r}: groups split one channel axis."
    )
