"""`BatchNorm`: normalisation with the batch's statistics, and their running averages.

Numerically Flax Linen's ``BatchNorm``, with Linen's variables; the statistics and the
normalisation are those of the other normalisation layers (`lamina.nn.norm`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.variables import BatchStat, Initializer
from . import _checks
from .norm import Normalization, moments, normalize, promote


@functools.partial(
    jax.jit, static_argnames=("is_training", "momentum", "epsilon", "dtype", "axis_name")
)
def batch_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    mean: jax.Array,
    var: jax.Array,
    *,
    is_training: bool,
    momentum: float,
    epsilon: float,
    dtype: Any,
    axis_name: Hashable | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Batch normalisation over all axes but the last: returns ``(y, new_mean, new_var)``.

    Training: normalises with the batch's statistics (averaged over the mapped `axis_name`
    when given) and returns the running averages ``momentum * ra + (1 - momentum) * stat``.
    Not training: normalises with the running averages `mean` and `var`; ``new_mean`` and
    ``new_var`` are None.
    """
    x = jnp.asarray(x)
    feature_shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    if not is_training:
        y = normalize(
            x,
            jnp.reshape(mean, feature_shape),
            jnp.reshape(var, feature_shape),
            scale,
            bias,
            epsilon,
            dtype,
        )
        return y, None, None
    batch_mean, batch_var = moments(x, tuple(range(x.ndim - 1)), dtype, True, axis_name)
    assert batch_mean is not None
    y = normalize(x, batch_mean, batch_var, scale, bias, epsilon, dtype)
    ra_dtype = promote(mean.dtype, batch_mean.dtype)
    batch_mean = jnp.reshape(batch_mean, mean.shape).astype(ra_dtype)
    batch_var = jnp.reshape(batch_var, var.shape).astype(ra_dtype)
    new_mean = momentum * mean.astype(ra_dtype) + (1 - momentum) * batch_mean
    new_var = momentum * var.astype(ra_dtype) + (1 - momentum) * batch_var
    return y, new_mean, new_var


class BatchNorm(Normalization):
    """Batch normalisation over all axes but the last (the features), as Flax Linen's.

    Called as ``bn(x, is_training)``. While training, `x` is normalised with the mean and
    variance of the batch (every axis but the last) and the running averages are updated,
    ``ra = momentum * ra + (1 - momentum) * batch_stat``; otherwise the running averages
    normalise `x` and nothing is written. Variables are Linen's: params ``scale`` and
    ``bias``, and batch stats ``mean`` and ``var`` (collection ``"batch_stats"``, float32),
    all of shape ``(size,)``.

    `is_training` must be a Python bool, because it decides whether state is written: under
    `jax.jit`, make it static (``jax.jit(step, static_argnames="is_training")``) or call
    ``apply`` with a literal ``True``/``False`` inside the jitted function.

    Args:
        size: Size of the input's last axis.
        momentum: Decay of the running averages, in ``[0, 1]``.
        epsilon: Added to the variance before the square root.
        use_scale: Whether to multiply by a learned ``scale``.
        use_bias: Whether to add a learned ``bias``.
        axis_name: Name of a mapped axis (``jax.vmap``/``pmap``/``shard_map``) over which the
            batch statistics are averaged (``lax.pmean``), so that data-parallel replicas
            normalise with the statistics of the whole batch.
        scale_init: Initializer of the scale.
        bias_init: Initializer of the bias.
        dtype: Output dtype; statistics are computed in at least float32.
        param_dtype: Storage dtype of ``scale`` and ``bias`` (default: `dtype`), which are
            also applied in it, as Linen does.

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
    axis_name = _checks.Setting()

    def __init__(
        self,
        size: int,
        *,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        axis_name: Hashable | None = None,
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
        where = type(self).__name__
        self.momentum = _checks.non_negative(
            where,
            "momentum",
            momentum,
            at_most=1.0,
            meaning=" (the weight of the old running average, typically 0.9 to 0.999)",
        )
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        if axis_name is not None and not all(isinstance(n, str) and n for n in names):
            raise TypeError(
                f"{where}: axis_name must be None, the name of a mapped axis (a string, as "
                f"in jax.vmap(f, axis_name='batch')) or a tuple of names; got {axis_name!r}."
            )
        self.axis_name = axis_name
        self.mean = BatchStat((self.size,), initializers.zeros(), jnp.float32)
        self.var = BatchStat((self.size,), initializers.ones(), jnp.float32)

    def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
        """Normalises `x` of shape ``(..., size)``; updates the averages if training."""
        _checks.python_bool(type(self).__name__, is_training=is_training)
        self._check_input(x)
        if is_training and jnp.ndim(x) < 2:
            raise ValueError(
                f"{self._describe()} got an input of shape {jnp.shape(x)} while training: batch "
                f"statistics need a batch axis, (batch..., {self.size}); a single example would "
                f"be normalised to zeros. Add one: x[None]."
            )
        scale, bias = self._scale_and_bias()
        try:
            y, new_mean, new_var = batch_norm(
                x,
                scale,
                bias,
                self.mean.value,
                self.var.value,
                is_training=is_training,
                momentum=self.momentum,
                epsilon=self.epsilon,
                dtype=self.dtype,
                axis_name=self.axis_name if is_training else None,
            )
        except NameError as error:
            if self.axis_name is None:
                raise
            raise NameError(
                f"BatchNorm(axis_name={self.axis_name!r}) averages the batch statistics over "
                f"the mapped axis {self.axis_name!r}, but no jax.vmap, jax.pmap or "
                f"jax.shard_map with that axis name encloses this call ({error}). Call apply "
                f"inside one, e.g. jax.vmap(step, axis_name={self.axis_name!r}), or build the "
                f"layer with axis_name=None."
            ) from None
        if is_training:
            self.mean.value = new_mean
            self.var.value = new_var
        return y
