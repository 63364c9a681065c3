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

Axes = int | Sequence[int]

__all__ = [
    "Initializer",
    "constant",
    "delta_orthogonal",
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


class Initializer:
    """A named initializer: ``init(key, shape, dtype=float32) -> array``.

    Args:
        name: The factory's name, for printing.
        fn: The function that makes the array.
        config: The factory's arguments, for printing.
    """

    # A pure function of its key: `init` may vectorise it over many variables' keys.
    lamina_batchable = True

    def __init__(self, name: str, fn: Any, **config: Any):
        self.name = name
        self.fn = fn
        self.config = config

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self) and (self.name, self._key()) == (other.name, other._key())  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash((self.name, self._key()))

    def _key(self) -> tuple:
        # Settings by value where they are hashable (numbers, strings), else by identity.
        return tuple(
            (k, v if isinstance(v, (int, float, str, tuple, type(None))) else id(v))
            for k, v in self.config.items()
        )

    def __call__(self, key: Any, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        """Makes an array of `shape` and `dtype` from `key`."""
        return self.fn(key, shape, dtype)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.name}({args})"


_DEFAULT_AXES = {"in_axis": -2, "out_axis": -1, "batch_axis": ()}


def _scaling(name: str, in_axis: Axes, out_axis: Axes, batch_axis: Axes) -> Initializer:
    axes = {"in_axis": in_axis, "out_axis": out_axis, "batch_axis": batch_axis}
    fn = getattr(jax.nn.initializers, name)(**axes)
    return Initializer(name, fn, **{k: v for k, v in axes.items() if v != _DEFAULT_AXES[k]})


def zeros() -> Initializer:
    """All zeros."""
    return Initializer("zeros", jax.nn.initializers.zeros)


def ones() -> Initializer:
    """All ones."""
    return Initializer("ones", jax.nn.initializers.ones)


def constant(value: Any) -> Initializer:
    """Every element equal to `value` (an array broadcasts to the shape)."""
    return Initializer("constant", jax.nn.initializers.constant(value), value=value)


def normal(stddev: float = 1e-2) -> Initializer:
    """Normal with mean 0 and the given standard deviation."""
    return Initializer("normal", jax.nn.initializers.normal(stddev), stddev=stddev)


def uniform(scale: float = 1e-2) -> Initializer:
    """Uniform on ``[0, scale)``."""
    return Initializer("uniform", jax.nn.initializers.uniform(scale), scale=scale)


def truncated_normal(stddev: float = 1e-2, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """Normal truncated to ``[lower, upper]`` standard deviations, then scaled by `stddev`."""
    fn = jax.nn.initializers.truncated_normal(stddev, lower=lower, upper=upper)
    return Initializer("truncated_normal", fn, stddev=stddev, lower=lower, upper=upper)


def variance_scaling(
    scale: float,
    mode: str,
    distribution: str,
    in_axis: Axes = -2,
    out_axis: Axes = -1,
    batch_axis: Axes = (),
) -> Initializer:
    """Variance ``scale / fan`` with ``fan`` by `mode` (fan_in, fan_out, fan_avg, fan_geo_avg).

    Args:
        scale: Scaling factor of the variance.
        mode: Which fan divides it.
        distribution: ``"truncated_normal"``, ``"normal"`` or ``"uniform"``.
        in_axis: Axes that count towards fan-in.
        out_axis: Axes that count towards fan-out.
        batch_axis: Axes ignored by the fans.
    """
    fn = jax.nn.initializers.variance_scaling(
        scale, mode, distribution, in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )
    return Initializer("variance_scaling", fn, scale=scale, mode=mode, distribution=distribution)


def lecun_normal(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Truncated normal, variance ``1 / fan_in`` (the default of `Dense` and `Conv`)."""
    return _scaling("lecun_normal", in_axis, out_axis, batch_axis)


def lecun_uniform(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Uniform, variance ``1 / fan_in``."""
    return _scaling("lecun_uniform", in_axis, out_axis, batch_axis)


def glorot_normal(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Truncated normal, variance ``2 / (fan_in + fan_out)``."""
    return _scaling("glorot_normal", in_axis, out_axis, batch_axis)


def glorot_uniform(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Uniform, variance ``2 / (fan_in + fan_out)``."""
    return _scaling("glorot_uniform", in_axis, out_axis, batch_axis)


def he_normal(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Truncated normal, variance ``2 / fan_in``."""
    return _scaling("he_normal", in_axis, out_axis, batch_axis)


def he_uniform(in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = ()) -> Initializer:
    """Uniform, variance ``2 / fan_in``."""
    return _scaling("he_uniform", in_axis, out_axis, batch_axis)


xavier_normal = glorot_normal
xavier_uniform = glorot_uniform
kaiming_normal = he_normal
kaiming_uniform = he_uniform


def orthogonal(scale: float = 1.0, column_axis: int = -1) -> Initializer:
    """A (scaled) orthogonal matrix, over all axes but `column_axis`."""
    fn = jax.nn.initializers.orthogonal(scale, column_axis)
    return Initializer("orthogonal", fn, scale=scale, column_axis=column_axis)


def delta_orthogonal(scale: float = 1.0, column_axis: int = -1) -> Initializer:
    """Delta-orthogonal for convolution kernels (orthogonal at the centre, zero elsewhere)."""
    fn = jax.nn.initializers.delta_orthogonal(scale, column_axis)
    return Initializer("delta_orthogonal", fn, scale=scale, column_axis=column_axis)
