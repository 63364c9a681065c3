"""What the normalisation layers share: the statistics, the normalising kernel, the base class.

The layers (`LayerNorm` and `RMSNorm` in `layer_normalization`, `GroupNorm` and
`InstanceNorm` in `group_normalization`, `BatchNorm` in `batch_normalization`) are each
numerically Flax Linen's layer of the same name, with Linen's options, variable names, shapes
and dtype handling: statistics are computed in at least float32
(``promote_types(float32, dtype)``, bfloat16 inputs included, complex ones kept complex); the
variance is Linen's fast one, ``max(0, E[|x|^2] - |E[x]|^2)``, or with
``use_fast_variance=False`` the two-pass ``E[|x - E[x]|^2]`` (stable for inputs far from zero);
a `mask` given to the call restricts the statistics to its True entries; the learned scale and
bias are applied in their storage dtype, and `dtype` is the dtype of the output (None: the
promotion of the input's, the scale's and the bias's, as Linen's default).

The layers differ only in the axes they reduce and the axes that carry features (those hold
the scale and bias): one kernel, `normalization`, serves them all; `BatchNorm` computes with
its `moments` and `normalize`. `Normalization` is their base class: sizes, epsilon, dtypes,
scale and bias, and the checks of the input's axes.

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

from .._core.module import Module
from .._core.types import Dtype, Initializer
from .._core.variables import Parameter
from . import _checks, _dtypes


def promote(*dtypes: Any) -> Any:
    """The dtype that Linen's arithmetic would produce (JAX's standard promotion lattice)."""
    with jax.numpy_dtype_promotion("standard"):
        result = dtypes[0]
        for dtype in dtypes[1:]:
            result = jnp.promote_types(result, dtype)
    return result


@functools.cache
def statistics_dtype(dtype: Dtype) -> np.dtype:
    """The dtype statistics are computed in: ``promote_types(float32, dtype)`` (Linen's)."""
    return np.dtype(promote(dtype, jnp.float32))


def _abs_sq(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def moments(
    x: jax.Array,
    axes: tuple[int, ...],
    dtype: Dtype,
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
    dtype: Dtype,
    scale_offset: float = 0.0,
    scale_in_input_dtype: bool = False,
) -> jax.Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias``, cast to `dtype`.

    `mean` and `var` have the rank of `x`; `scale` and `bias` have the shape of `x`'s
    `feature_axes` (non-negative, increasing). The operations, their order and their dtypes
    are Linen's: ``x - mean`` in the promoted dtype of both, ``rsqrt`` in the statistics'
    dtype, the scale folded into that factor first.

    The two options change the order and dtypes of the scale's product (Hugging Face's
    RMSNorms; `scaled_rms`): with `scale_in_input_dtype`, the normalised `x` is cast to `x`'s
    dtype before the product (Llama's); with a nonzero `scale_offset` alone, the product is
    ``(x * rsqrt(var + epsilon)) * (scale_offset + scale)`` in the statistics' dtype
    (Gemma's).
    """
    if scale_offset or scale_in_input_dtype:
        return scaled_rms(
            x, mean, var, scale, feature_axes, epsilon, dtype, scale_offset, scale_in_input_dtype
        )
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


def scaled_rms(
    x: jax.Array,
    mean: jax.Array | None,
    var: jax.Array,
    scale: jax.Array | None,
    feature_axes: tuple[int, ...],
    epsilon: float,
    dtype: Dtype,
    scale_offset: float,
    scale_in_input_dtype: bool,
) -> jax.Array:
    """The normalisation of Hugging Face's RMSNorms (``transformers``' order and dtypes).

    Llama's (`scale_in_input_dtype`): ``scale * (x32 * rsqrt(var + eps)).astype(x.dtype)``,
    the product in the promotion of `x`'s and the scale's dtypes. Gemma's (`scale_offset`
    1.0): ``(x32 * rsqrt(var + eps)) * (1 + scale32)`` in the statistics' dtype, cast after.
    The effective scale is ``scale_offset + scale``; the result is cast to `dtype`.
    """
    feature_shape = tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))
    stats = var.dtype
    if mean is None:
        y = x.astype(promote(x.dtype, stats))
    else:
        y_dtype = promote(x.dtype, mean.dtype)
        y = x.astype(y_dtype) - mean.astype(y_dtype)
    y = y * lax.rsqrt(var + epsilon).astype(y.dtype)
    if scale_in_input_dtype:
        y = y.astype(x.dtype)
    if scale is None:
        return y.astype(dtype)
    product = promote(y.dtype, scale.dtype)
    factor = jnp.reshape(scale, feature_shape).astype(product)
    if scale_offset:
        factor = jnp.asarray(scale_offset, product) + factor
    return (y.astype(product) * factor).astype(dtype)


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
        "scale_offset",
        "scale_in_input_dtype",
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
    dtype: Dtype,
    stats_dtype: Dtype,
    use_mean: bool = True,
    use_fast_variance: bool = True,
    group_size: int | None = None,
    axis_name: Hashable | None = None,
    axis_index_groups: Any = None,
    scale_offset: float = 0.0,
    scale_in_input_dtype: bool = False,
) -> jax.Array:
    """Normalises `x` with its statistics over `reduction_axes` (every per-example norm).

    With `group_size`, the last axis (which `reduction_axes` must include) is split into
    groups of `group_size` consecutive channels, and each group has its own statistics
    (Linen's ``GroupNorm``). Axes are non-negative and increasing. `scale_offset` and
    `scale_in_input_dtype` are `normalize`'s (RMSNorm's options).
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
        return normalize(
            x, mean, var, scale, bias, feature_axes, epsilon, dtype, scale_offset,
            scale_in_input_dtype,
        )  # fmt: skip
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
            f"{where()} got an input of shape {shape}, which has no axis {show_axes(axes)} "
            f"({name}): its axes are {-ndim} to {ndim - 1}. Pass an input with the axes the "
            f"layer was built for, or build it with other {name}."
        )
    result = sorted({a % ndim for a in axes})
    if len(result) != len(axes):
        raise ValueError(
            f"{where()} got an input of shape {shape}: {name}={show_axes(axes)} names the same "
            f"axis twice for {ndim} axes ({show_axes(tuple(a % ndim for a in axes))}). Name each "
            f"axis once."
        )
    return tuple(result)


def show_axes(axes: tuple[int, ...]) -> str:
    """`axes` as an option shows them: ``-1`` for one axis, ``(-2, -1)`` for several."""
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
    if not _checks.broadcasts_to(mask.shape, shape):
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
        dtype: Dtype,
        param_dtype: Dtype,
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
                    f"{option}={show_axes(self._features)} names {count} axes: give one size per "
                    f"feature axis, in the order the axes have in the input."
                )
            return sizes
        size = _checks.positive_int(where, "size", size, meaning)
        if count != 1:
            raise ValueError(
                f"{where}: size={size} is one size but {option}={show_axes(self._features)} names "
                f"{count} axes: give a tuple of sizes, one per feature axis, in the order the "
                f"axes have in the input."
            )
        return size

    def _describe(self) -> str:
        option, axes = self._features_option, self._features
        axes_text = "" if axes == (-1,) else f", {option}={show_axes(axes)}"
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
                f"{show_axes(features)} must have sizes {self.feature_shape}, got {got}. Pass an "
                f"input with those sizes, or build the layer with size={got}."
            )
        return self._reduction_axes(shape, features), features

    def _scale_and_bias(self) -> tuple[jax.Array | None, jax.Array | None]:
        scale = self.scale.value if self.scale is not None else None
        bias = self.bias.value if self.bias is not None else None
        return scale, bias

    def _normalize(
        self,
        x: Any,
        mask: Any,
        use_mean: bool = True,
        group_size: int | None = None,
        scale_offset: float = 0.0,
        scale_in_input_dtype: bool = False,
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
                scale_offset=scale_offset,
                scale_in_input_dtype=scale_in_input_dtype,
            )
