"""Normalisation of each example: `LayerNorm`, `RMSNorm`, `GroupNorm`, `InstanceNorm`.

Each layer is numerically Flax Linen's layer of the same name, with Linen's options,
variable names, shapes and dtype handling: statistics are computed in at least float32
(``promote_types(float32, dtype)``, bfloat16 inputs included, complex ones kept complex); the
variance is Linen's fast one, ``max(0, E[|x|^2] - |E[x]|^2)``, or with
``use_fast_variance=False`` the two-pass ``E[|x - E[x]|^2]`` (stable for inputs far from zero);
a `mask` given to the call restricts the statistics to its True entries; the learned scale and
bias are applied in their storage dtype, and `dtype` is the dtype of the output (None: the
promotion of the input's, the scale's and the bias's, as Linen's default).

The layers differ only in the axes they reduce and the axes that carry features (those hold
the scale and bias): one kernel, `normalization`, serves them all; `BatchNorm`
(`lamina.nn.batch_normalization`) computes with its `moments` and `normalize`.

Sizes of several feature axes: lamina declares the scale and bias when the layer is built, so
``size`` is the size of the one feature axis, or a tuple with the size of each feature axis in
the order the axes have in the input (``LayerNorm((4, 5), reduction_axes=(-2, -1),
feature_axes=(-2, -1))`` normalises ``(..., 4, 5)`` inputs over their last two axes, with a
``(4, 5)`` scale, as Linen's does).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.variables import Initializer, Parameter
from . import _checks, _dtypes


def promote(*dtypes: Any) -> Any:
    """The dtype that Linen's arithmetic would produce (JAX's standard promotion lattice)."""
    with jax.numpy_dtype_promotion("standard"):
        result = dtypes[0]
        for dtype in dtypes[1:]:
            result = jnp.promote_types(result, dtype)
    return result


@functools.cache
def statistics_dtype(dtype: Any) -> np.dtype:
    """The dtype statistics are computed in: ``promote_types(float32, dtype)`` (Linen's)."""
    return np.dtype(promote(dtype, jnp.float32))


def _abs_sq(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def moments(
    x: jax.Array,
    axes: tuple[int, ...],
    dtype: Any,
    *,
    use_mean: bool = True,
    use_fast_variance: bool = True,
    mask: jax.Array | None = None,
    axis_name: Hashable | None = None,
    axis_index_groups: Any = None,
) -> tuple[jax.Array | None, jax.Array]:
    """Mean and variance of `x` over `axes` (kept as size-1 axes), as Linen computes them.

    Args:
        x: The values.
        axes: The axes to reduce (non-negative).
        dtype: The statistics' dtype (`statistics_dtype`); `x` is cast to it first.
        use_mean: Without it, the mean is None and the "variance" is the mean of ``|x|^2``.
        use_fast_variance: ``max(0, E[|x|^2] - |E[x]|^2)`` in one pass (Linen's default), or
            else ``E[|x - E[x]|^2]``, which keeps its precision when ``|E[x]|`` is large.
        mask: Booleans broadcastable to `x`: only the True entries count.
        axis_name: A mapped axis over which the statistics are averaged (``lax.pmean``; the
            fast variance's two means in one collective).
        axis_index_groups: Groups of the mapped axis' indices averaged separately.
    """
    x = x.astype(dtype)
    where = None if mask is None else jnp.broadcast_to(mask, x.shape)

    def mean(*values: jax.Array) -> list[jax.Array]:
        means = [jnp.mean(v, axes, keepdims=True, where=where) for v in values]
        if axis_name is None:
            return means
        if len(means) == 1:
            return [lax.pmean(means[0], axis_name, axis_index_groups=axis_index_groups)]
        common = promote(*(m.dtype for m in means))
        stacked = jnp.stack([m.astype(common) for m in means])
        both = lax.pmean(stacked, axis_name, axis_index_groups=axis_index_groups)
        return [b if b.dtype == m.dtype else lax.real(b) for b, m in zip(both, means, strict=True)]

    if not use_mean:
        (mean_sq,) = mean(_abs_sq(x))
        return None, mean_sq
    if use_fast_variance:
        mu, mean_sq = mean(x, _abs_sq(x))
        return mu, jnp.maximum(0.0, mean_sq - _abs_sq(mu))
    (mu,) = mean(x)
    (var,) = mean(_abs_sq(x - mu))
    return mu, var


def normalize(
    x: jax.Array,
    mean: jax.Array | None,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    feature_axes: tuple[int, ...],
    epsilon: float,
    dtype: Any,
) -> jax.Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias``, cast to `dtype`.

    `mean` and `var` have the rank of `x`; `scale` and `bias` have the shape of `x`'s
    `feature_axes` (non-negative, increasing). The operations, their order and their dtypes
    are Linen's: ``x - mean`` in the promoted dtype of both, ``rsqrt`` in the statistics'
    dtype, the scale folded into that factor first.
    """
    feature_shape = tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "reduction_axes",
        "feature_axes",
        "epsilon",
        "dtype",
        "stats_dtype",
        "use_mean",
        "use_fast_variance",
        "group_size",
        "axis_name",
        "axis_index_groups",
    ),
)
def normalization(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    mask: jax.Array | None = None,
    *,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    epsilon: float,
    dtype: Any,
    stats_dtype: Any,
    use_mean: bool = True,
    use_fast_variance: bool = True,
    group_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_index_groups: Any = None,
) -> jax.Array:
    """Normalises `x` with its statistics over `reduction_axes` (every per-example norm).

    With `group_size`, the last axis (which `reduction_axes` must include) is split into
    groups of `group_size` consecutive channels, and each group has its own statistics
    (Linen's ``GroupNorm``). Axes are non-negative and increasing.
    """
    x = jnp.asarray(x)
    if group_size is None:
        mean, var = moments(
            x,
            reduction_axes,
            stats_dtype,
            use_mean=use_mean,
            use_fast_variance=use_fast_variance,
            mask=mask,
            axis_name=axis_name,
            axis_index_groups=axis_index_groups,
        )
        return normalize(x, mean, var, scale, bias, feature_axes, epsilon, dtype)
    channels = x.shape[-1]
    grouped = (*x.shape[:-1], channels // group_size, group_size)
    if mask is not None:
        mask = jnp.reshape(jnp.broadcast_to(mask, x.shape), grouped)
    mean, var = moments(
        jnp.reshape(x, grouped),
        (*reduction_axes[:-1], x.ndim),  # the other axes, and the channels within a group
        stats_dtype,
        use_mean=use_mean,
        use_fast_variance=use_fast_variance,
        mask=mask,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    )

    def per_channel(stat: jax.Array) -> jax.Array:  # (..., G, 1) -> (..., G * group_size)
        stat = jnp.broadcast_to(stat, (*stat.shape[:-1], group_size))
        return jnp.reshape(stat, (*stat.shape[:-2], channels))

    assert mean is not None
    mean, var = per_channel(mean), per_channel(var)
    return normalize(x, mean, var, scale, bias, feature_axes, epsilon, dtype)


def axes_setting(where: str, name: str, value: Any) -> tuple[int, ...]:
    """Returns axes (an int, or a sequence of distinct ints) as a tuple; raises otherwise."""
    axes = (int(value),) if _checks.is_int(value) else _ints(value)
    if axes is None:
        raise TypeError(
            f"{where}: {name} must be an int or a tuple of ints (axes of the input; negative "
            f"ones count from the end), got {value!r}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where}: {name}={value!r} names an axis twice; name each axis once.")
    return axes


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, str) or not isinstance(value, Sequence):
        return None
    if not all(_checks.is_int(v) for v in value):
        return None
    return tuple(int(v) for v in value)


def canonical_axes(
    where: Callable[[], str], name: str, axes: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...]:
    """`axes` of an input of `shape` as increasing non-negative ints; raises if out of range."""
    ndim = len(shape)
    if not all(-ndim <= a < ndim for a in axes):
        raise ValueError(
            f"{where()} got an input of shape {shape}, which has no axis {_show(axes)} "
            f"({name}): its axes are {-ndim} to {ndim - 1}. Pass an input with the axes the "
            f"layer was built for, or build it with other {name}."
        )
    result = sorted({a % ndim for a in axes})
    if len(result) != len(axes):
        raise ValueError(
            f"{where()} got an input of shape {shape}: {name}={_show(axes)} names the same "
            f"axis twice for {ndim} axes ({_show(tuple(a % ndim for a in axes))}). Name each "
            f"axis once."
        )
    return tuple(result)


def _show(axes: tuple[int, ...]) -> str:
    return str(axes[0]) if len(axes) == 1 else str(axes)


def check_mask(where: Callable[[], str], mask: Any, shape: tuple[int, ...]) -> jax.Array | None:
    """Returns `mask` as an array; raises unless it is boolean and broadcasts to `shape`."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{where()} got a mask of dtype {mask.dtype}: a mask is boolean, True where an "
            f"entry counts in the statistics. Pass mask.astype(bool) or a comparison such as "
            f"x != pad."
        )
    try:
        fits = np.broadcast_shapes(mask.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{where()} got a mask of shape {mask.shape} for an input of shape {shape}: the "
            f"mask must broadcast to the input (size-1 or equal axes, aligned at the end). "
            f"Reshape it, e.g. mask[..., None] to share it across the features."
        )
    return mask


def mapped_axis(where: str, axis_name: Any, axis_index_groups: Any) -> tuple[Any, Any]:
    """Checks `axis_name` (None, a name or a tuple of names) and `axis_index_groups`."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"{where}: axis_name must be None, the name of a mapped axis (a string, as in "
            f"jax.vmap(f, axis_name='batch')) or a tuple of names; got {axis_name!r}."
        )
    if axis_index_groups is None:
        return axis_name, None
    if axis_name is None:
        raise ValueError(
            f"{where}: axis_index_groups={axis_index_groups!r} groups the indices of a mapped "
            f"axis, but axis_name is None. Give the axis_name too."
        )
    try:
        groups = tuple(
            tuple(_checks.non_negative_int(where, "axis_index_groups", i) for i in g)
            for g in axis_index_groups
        )
    except TypeError:
        raise TypeError(
            f"{where}: axis_index_groups must be a list of lists of axis indices, such as "
            f"[[0, 1], [2, 3]], got {axis_index_groups!r}."
        ) from None
    return axis_name, groups


@contextlib.contextmanager
def unbound_axis_message(layer: Any) -> Iterator[None]:
    """Turns JAX's unbound-axis `NameError` into one that names the layer and the fix."""
    try:
        yield
    except NameError as error:
        if layer.axis_name is None:
            raise
        name = layer.axis_name
        raise NameError(
            f"{layer._describe()} averages its statistics over the mapped axis {name!r} "
            f"(axis_name={name!r}), but no jax.vmap, jax.pmap or jax.shard_map with that axis "
            f"name encloses this call ({error}). Call apply inside one, e.g. jax.vmap(step, "
            f"axis_name={name!r}), or build the layer with axis_name=None."
        ) from None


class Normalization(Module, abc.ABC):
    """What the normalisation layers share: sizes, epsilon, dtypes, scale and bias.

    `BatchNorm`, `LayerNorm`, `RMSNorm`, `GroupNorm` and `InstanceNorm` declare ``scale``
    and ``bias`` with the shape of the input's feature axes, ``(size,)`` for one, as Linen
    does: stored in `param_dtype` and applied in it (never cast to the compute dtype), so
    `.value` returns them in `param_dtype`.

    Subclasses give `feature_axes` (the axes that hold features, as the user wrote them) and
    the name of that option (``"axis"`` for `BatchNorm`), and implement `_reduction_axes`.
    """

    size = _checks.Setting()
    epsilon = _checks.Setting()
    use_scale = _checks.Setting()
    use_bias = _checks.Setting()
    use_fast_variance = _checks.Setting()
    axis_name = _checks.Setting()
    axis_index_groups = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()

    _features_option = "feature_axes"

    def __init__(
        self,
        size: int | Sequence[int],
        *,
        feature_axes: tuple[int, ...],
        epsilon: float,
        use_scale: bool,
        use_bias: bool,
        scale_init: Initializer,
        bias_init: Initializer,
        dtype: Any,
        param_dtype: Any,
        use_fast_variance: bool,
        axis_name: Hashable | None = None,
        axis_index_groups: Any = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        self.axis_name, self.axis_index_groups = mapped_axis(where, axis_name, axis_index_groups)
        self._features = feature_axes
        self.size = self._sizes(where, size)
        meaning = " (it is added to the variance before the square root)"
        self.epsilon = _checks.non_negative(where, "epsilon", epsilon, meaning=meaning)
        self.use_scale = _checks.flag(where, "use_scale", use_scale)
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.use_fast_variance = _checks.flag(where, "use_fast_variance", use_fast_variance)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        scale_init = _checks.initializer(where, "scale_init", scale_init)
        bias_init = _checks.initializer(where, "bias_init", bias_init)
        stored, shape = self.param_dtype, self.feature_shape
        scale_sharding = _checks.sharding(where, "scale_sharding", scale_sharding, len(shape))
        bias_sharding = _checks.sharding(where, "bias_sharding", bias_sharding, len(shape))
        self.scale = (
            Parameter(shape, scale_init, stored, stored, sharding=scale_sharding)
            if self.use_scale
            else None
        )
        self.bias = (
            Parameter(shape, bias_init, stored, stored, sharding=bias_sharding)
            if self.use_bias
            else None
        )

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """The sizes of the feature axes: the shape of ``scale`` and ``bias``."""
        return (self.size,) if _checks.is_int(self.size) else tuple(self.size)

    def _sizes(self, where: str, size: Any) -> int | tuple[int, ...]:
        option, count = self._features_option, len(self._features)
        meaning = (
            ", the size of the input's last axis (its features or channels), or the sizes of "
            f"the axes that {option} names, a tuple"
        )
        if isinstance(size, (tuple, list)):
            sizes = tuple(_checks.positive_int(where, "size", s, meaning) for s in size)
            if len(sizes) != count:
                raise ValueError(
                    f"{where}: size={tuple(size)!r} gives {len(sizes)} sizes but "
                    f"{option}={_show(self._features)} names {count} axes: give one size per "
                    f"feature axis, in the order the axes have in the input."
                )
            return sizes
        size = _checks.positive_int(where, "size", size, meaning)
        if count != 1:
            raise ValueError(
                f"{where}: size={size} is one size but {option}={_show(self._features)} names "
                f"{count} axes: give a tuple of sizes, one per feature axis, in the order the "
                f"axes have in the input."
            )
        return size

    def _describe(self) -> str:
        option, axes = self._features_option, self._features
        axes_text = "" if axes == (-1,) else f", {option}={_show(axes)}"
        return f"{type(self).__name__}(size={self.size}{axes_text})"

    @abc.abstractmethod
    def _reduction_axes(self, shape: tuple[int, ...], features: tuple[int, ...]) -> tuple[int, ...]:
        """The axes the statistics reduce, for an input of `shape` with feature axes `features`."""

    def _axes(self, x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The reduction and feature axes for input `x`, checked: ``(reduction, features)``."""
        if self._features == (-1,) and _checks.is_int(self.size):
            hint = "The features must be on the last axis."
            shape = _checks.check_last_axis(self._describe, x, self.size, "size", hint=hint)
        else:
            shape = tuple(jnp.shape(x))
        features = canonical_axes(self._describe, self._features_option, self._features, shape)
        got = tuple(shape[a] for a in features)
        if got != self.feature_shape:
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: its feature axes "
                f"{_show(features)} must have sizes {self.feature_shape}, got {got}. Pass an "
                f"input with those sizes, or build the layer with size={got}."
            )
        return self._reduction_axes(shape, features), features

    def _scale_and_bias(self) -> tuple[jax.Array | None, jax.Array | None]:
        scale = self.scale.value if self.scale is not None else None
        bias = self.bias.value if self.bias is not None else None
        return scale, bias

    def _normalize(
        self, x: Any, mask: Any, use_mean: bool = True, group_size: int | None = None
    ) -> jax.Array:
        """The call of every per-example norm: checks, dtypes, then the `normalization` kernel."""
        reduction, features = self._axes(x)
        mask = check_mask(self._describe, mask, tuple(jnp.shape(x)))
        scale, bias = self._scale_and_bias()
        dtype = _dtypes.compute_dtype(self, self.dtype, x, scale, bias)
        stats = statistics_dtype(jnp.result_type(x) if self.dtype is None else self.dtype)
        with unbound_axis_message(self):
            return normalization(
                x,
                scale,
                bias,
                mask,
                reduction_axes=reduction,
                feature_axes=features,
                epsilon=self.epsilon,
                dtype=dtype,
                stats_dtype=stats,
                use_mean=use_mean,
                use_fast_variance=self.use_fast_variance,
                group_size=group_size,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
            )


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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        if _checks.is_int(size) or not isinstance(size, (tuple, list)):
            size = _checks.positive_int(
                where, "size", size, ", the size of the input's last axis (its channels)"
            )
        else:
            raise TypeError(
                f"{where}: size must be a positive int, the size of the input's last axis (its "
                f"channels), got {size!r}: groups split one channel axis."
            )
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
            group_size = size // num_groups
        else:
            group_size = _checks.positive_int(where, "group_size", group_size)
            self._check_divides(where, "group_size", group_size)
            num_groups = size // group_size
        self.num_groups = num_groups
        self.group_size = group_size
        self.reduction_axes = (
            None
            if reduction_axes is None
            else axes_setting(where, "reduction_axes", reduction_axes)
        )

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
                f"{self._describe()}: reduction_axes={_show(self.reduction_axes)} must include "
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        scale_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        self.feature_axes = axes_setting(where, "feature_axes", feature_axes)
        if 0 in self.feature_axes:
            raise ValueError(
                f"{where}: feature_axes={_show(self.feature_axes)} includes axis 0, the batch "
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
                f"feature_axes={_show(self.feature_axes)} include axis 0, the batch axis. "
                f"Pass an input with a batch axis in front, (batch, ..., features)."
            )
        return tuple(a for a in range(1, len(shape)) if a not in features)

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises `x` of shape ``(batch, ...)`` per example and feature."""
        return self._normalize(x, mask)
