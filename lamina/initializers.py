"""Initializer factories: each returns ``init(key, shape, dtype) -> array``.

They are `jax.nn.initializers` under names that print their settings (``lecun_normal()``),
which `lm.summary` and error messages show. Any function with that signature works where an
initializer is expected, `jax.nn.initializers.zeros` included.

Example:
    >>> import jax, lamina as lm
    >>> init = lm.initializers.normal(stddev=0.02)
    >>> init
    normal(stddev=0.02)
    >>> init(jax.random.key(0), (2, 3)).shape
    (2, 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._core.initializer import FACTORIES, Initializer, from_jax
from ._core.types import Dtype

Axes = int | Sequence[int]

__all__ = [
    "Initializer",
    "constant",
    "delta_orthogonal",
    "from_jax",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]


_DEFAULT_AXES = {"in_axis": -2, "out_axis": -1, "batch_axis": ()}


def _scaling(
    name: str, in_axis: Axes, out_axis: Axes, batch_axis: Axes, dtype: Dtype
) -> Initializer:
    axes = {"in_axis": in_axis, "out_axis": out_axis, "batch_axis": batch_axis}
    fn = getattr(jax.nn.initializers, name)(**axes)
    shown = {k: v for k, v in axes.items() if v != _DEFAULT_AXES[k]}
    return Initializer.of_factory(name, fn, axes, dtype, **shown)


def _real(name: str, setting: str, value: Any) -> Any:
    """`value` if it is a real number; a `TypeError` naming the setting otherwise."""
    try:
        kind = np.asarray(value).dtype if np.ndim(value) == 0 else None
    except (TypeError, ValueError):
        kind = None
    if (
        kind is None
        or kind == np.bool_
        or not np.issubdtype(kind, np.number)
        or (np.issubdtype(kind, np.complexfloating))
    ):
        raise TypeError(
            f"{name}: {setting} must be a real number, got {value!r} (a dtype goes in "
            f"dtype=, as in jax.nn.initializers.{name})."
        )
    return value


def zeros(dtype: Dtype = None) -> Initializer:
    """All zeros.

    Example:
        >>> import jax, lamina as lm
        >>> lm.initializers.zeros()(jax.random.key(0), (2,))
        Array([0., 0.], dtype=float32)
    """
    return Initializer.of_factory("zeros", jax.nn.initializers.zeros, {}, dtype)


def ones(dtype: Dtype = None) -> Initializer:
    """All ones.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> lm.initializers.ones(jnp.int32)(jax.random.key(0), (2,))
        Array([1, 1], dtype=int32)
    """
    return Initializer.of_factory("ones", jax.nn.initializers.ones, {}, dtype)


def constant(value: Any, dtype: Dtype = None) -> Initializer:
    """Every element equal to `value` (an array broadcasts to the shape).

    Example:
        >>> import jax, lamina as lm
        >>> lm.initializers.constant(0.5)(jax.random.key(0), (3,))
        Array([0.5, 0.5, 0.5], dtype=float32)
    """
    return Initializer.of_factory(
        "constant", jax.nn.initializers.constant(value), {"value": value}, dtype, value=value
    )


def normal(stddev: float = 1e-2, dtype: Dtype = None) -> Initializer:
    """Normal with mean 0 and the given standard deviation.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.normal(0.02)(jax.random.key(0), (1000,))
        >>> round(float(x.std()), 2)
        0.02
    """
    stddev = _real("normal", "stddev", stddev)
    return Initializer.of_factory(
        "normal", jax.nn.initializers.normal(stddev), {"stddev": stddev}, dtype, stddev=stddev
    )


def uniform(scale: float = 1e-2, dtype: Dtype = None) -> Initializer:
    """Uniform on ``[0, scale)``.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.uniform(0.5)(jax.random.key(0), (1000,))
        >>> bool(x.min() >= 0), bool(x.max() < 0.5)
        (True, True)
    """
    scale = _real("uniform", "scale", scale)
    return Initializer.of_factory(
        "uniform", jax.nn.initializers.uniform(scale), {"scale": scale}, dtype, scale=scale
    )


def truncated_normal(
    stddev: float = 1e-2, dtype: Dtype = None, lower: float = -2.0, upper: float = 2.0
) -> Initializer:
    """Normal truncated to ``[lower, upper]`` standard deviations, then scaled by `stddev`.

    The arguments are in `jax.nn.initializers.truncated_normal`'s order (and Metoryx's):
    `dtype` second.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.truncated_normal(1.0)(jax.random.key(0), (1000,))
        >>> bool(abs(x).max() <= 2.0)
        True
    """
    config = {
        "stddev": _real("truncated_normal", "stddev", stddev),
        "lower": _real("truncated_normal", "lower", lower),
        "upper": _real("truncated_normal", "upper", upper),
    }
    fn = jax.nn.initializers.truncated_normal(stddev, lower=lower, upper=upper)
    return Initializer.of_factory("truncated_normal", fn, config, dtype, **config)


def variance_scaling(
    scale: float,
    mode: str = "fan_in",
    distribution: str = "truncated_normal",
    in_axis: Axes = -2,
    out_axis: Axes = -1,
    batch_axis: Axes = (),
    dtype: Dtype = None,
) -> Initializer:
    """Variance ``scale / fan`` with ``fan`` by `mode` (fan_in, fan_out, fan_avg, fan_geo_avg).

    Args:
        scale: Scaling factor of the variance.
        mode: Which fan divides it.
        distribution: ``"truncated_normal"``, ``"normal"`` or ``"uniform"``.
        in_axis: Axes that count towards fan-in.
        out_axis: Axes that count towards fan-out.
        batch_axis: Axes ignored by the fans.
        dtype: The dtype of a call that names none (default float32).

    Example:
        >>> import jax, lamina as lm
        >>> init = lm.initializers.variance_scaling(2.0, "fan_in", "normal")
        >>> kernel = init(jax.random.key(0), (512, 256))  # variance 2 / 512
        >>> round(float(kernel.var() * 512), 1)
        2.0
    """
    modes = ("fan_in", "fan_out", "fan_avg", "fan_geo_avg")
    distributions = ("truncated_normal", "normal", "uniform")
    if mode not in modes:
        raise ValueError(f"variance_scaling: mode must be one of {modes}, got {mode!r}.")
    if distribution not in distributions:
        raise ValueError(
            f"variance_scaling: distribution must be one of {distributions}, got {distribution!r}."
        )
    fn = jax.nn.initializers.variance_scaling(
        scale,
        mode,  # type: ignore[arg-type]  # checked above
        distribution,  # type: ignore[arg-type]
        in_axis=in_axis,
        out_axis=out_axis,
        batch_axis=batch_axis,
    )
    shown = {"scale": scale, "mode": mode, "distribution": distribution}
    axes = {"in_axis": in_axis, "out_axis": out_axis, "batch_axis": batch_axis}
    shown.update({k: v for k, v in axes.items() if v != _DEFAULT_AXES[k]})
    return Initializer.of_factory("variance_scaling", fn, {**shown, **axes}, dtype, **shown)


def lecun_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Truncated normal, variance ``1 / fan_in`` (the default of `Dense` and `Conv`).

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.lecun_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256), 1)
        1.0
    """
    return _scaling("lecun_normal", in_axis, out_axis, batch_axis, dtype)


def lecun_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Uniform, variance ``1 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.lecun_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256), 1)
        1.0
    """
    return _scaling("lecun_uniform", in_axis, out_axis, batch_axis, dtype)


def glorot_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Truncated normal, variance ``2 / (fan_in + fan_out)``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.glorot_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 384 / 2), 1)
        1.0
    """
    return _scaling("glorot_normal", in_axis, out_axis, batch_axis, dtype)


def glorot_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Uniform, variance ``2 / (fan_in + fan_out)``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.glorot_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 384 / 2), 1)
        1.0
    """
    return _scaling("glorot_uniform", in_axis, out_axis, batch_axis, dtype)


def he_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Truncated normal, variance ``2 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.he_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256 / 2), 1)
        1.0
    """
    return _scaling("he_normal", in_axis, out_axis, batch_axis, dtype)


def he_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Dtype = None
) -> Initializer:
    """Uniform, variance ``2 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.he_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256 / 2), 1)
        1.0
    """
    return _scaling("he_uniform", in_axis, out_axis, batch_axis, dtype)


xavier_normal = glorot_normal
xavier_uniform = glorot_uniform
kaiming_normal = he_normal
kaiming_uniform = he_uniform


def _in_float32(fn: Any) -> Any:
    """`fn` computed in float32 for narrower floats (XLA's CPU has no bfloat16 QR), then cast."""

    def init(key: Any, shape: Sequence[int], dtype: Dtype = jnp.float32) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
            return fn(key, shape, jnp.float32).astype(dtype)
        return fn(key, shape, dtype)

    return init


def orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: Dtype = None) -> Initializer:
    """A (scaled) orthogonal matrix, over all axes but `column_axis`.

    bfloat16 and float16 matrices are made in float32 and rounded (Linen's fails on the CPU).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> q = lm.initializers.orthogonal()(jax.random.key(0), (4, 4))
        >>> bool(jnp.allclose(q.T @ q, jnp.eye(4), atol=1e-5))
        True
    """
    fn = _in_float32(jax.nn.initializers.orthogonal(scale, column_axis))
    config = {"scale": scale, "column_axis": column_axis}
    return Initializer.of_factory("orthogonal", fn, config, dtype, **config)


def delta_orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: Dtype = None) -> Initializer:
    """Delta-orthogonal for convolution kernels (orthogonal at the centre, zero elsewhere).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> kernel = lm.initializers.delta_orthogonal()(jax.random.key(0), (3, 3, 4, 4))
        >>> float(jnp.abs(kernel[0, 0]).sum()), kernel[1, 1].shape  # zero off the centre
        (0.0, (4, 4))
    """
    fn = _in_float32(jax.nn.initializers.delta_orthogonal(scale, column_axis))
    config = {"scale": scale, "column_axis": column_axis}
    return Initializer.of_factory("delta_orthogonal", fn, config, dtype, **config)


# Unpickling an initializer that a factory made calls the factory again, by its name.
FACTORIES.update(
    (name, globals()[name]) for name in __all__ if name not in ("Initializer", "from_jax")
)
