"""Dynamic loss scaling for float16 training: `DynamicLossScale`, `all_finite`.

float16 has 5 exponent bits: values below about 6e-8 round to zero. Gradients flowing back
through float16 computations are often that small, so they vanish and nothing trains.
Multiplying the loss by a large scale before differentiating lifts every cotangent by the same
factor (the chain rule is linear); dividing the gradients by it afterwards gives them back,
now computed without underflow. Too large a scale overflows instead (inf or nan in the
gradients): then the step is skipped and the scale halved. After `period` finite steps in a
row the scale doubles again, so it stays near the largest one that works.

The rule and the numbers are jmp's (google-deepmind/jmp, ``jmp.DynamicLossScale``), so a
training loop written for jmp gives the same sequence of scales; unlike jmp's, this one keeps
`min_loss_scale` through `jax.jit`. As jmp's (by promotion), `scale` and `unscale` give
floating leaves narrower than float32 back in float32: a float16 loss times 2 ** 15 would
overflow float16, and an unscaled float16 gradient would underflow again. bfloat16 has
float32's exponent range and needs no loss scaling.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import is_concrete, is_int, is_real

T = TypeVar("T")


class DynamicLossScale:
    """A loss scale that halves when gradients overflow and doubles after `period` good steps.

    A pytree (its arrays are the scale and the step counter; `period`, `factor` and
    `min_loss_scale` are static), so it goes in and out of `jax.jit` and `lax.scan` as part of
    the training state. It never changes: `adjust` returns the next one. A training step:

    1. ``loss_scale.scale(loss)`` before differentiating (the loss in float32),
    2. ``grads = loss_scale.unscale(grads)``,
    3. ``finite = lm.all_finite(grads)``,
    4. keep the updated variables and optimizer state only where ``finite``
       (``jnp.where(finite, new, old)`` on each leaf), else the old ones (the step is skipped),
    5. ``loss_scale = loss_scale.adjust(finite)``.

    Args:
        loss_scale: The starting scale, a positive finite number (default ``2 ** 15``, as
            Keras); stored as a float32 scalar.
        counter: Finite steps since the scale last changed (default 0); an int32 scalar.
        period: After this many finite steps in a row the scale grows by `factor` (default
            2000), a positive int.
        factor: What the scale is multiplied by after `period` finite steps and divided by
            after a non-finite one (default 2), a number > 1.
        min_loss_scale: The scale never drops below this (default 1), a positive number.

    Raises:
        ValueError: A scale, factor or minimum out of range.
        TypeError: A setting of the wrong type (a string, a bool, an array for `period`).

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> scale = lm.DynamicLossScale(2.0**15, period=2)
        >>> float(scale.scale(jnp.float32(1e-3)))
        32.768001556396484
        >>> for finite in (True, True, False):
        ...     scale = scale.adjust(jnp.asarray(finite))
        ...     print(float(scale.loss_scale), int(scale.counter))
        32768.0 1
        65536.0 0
        32768.0 0
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: int
    factor: float | int
    min_loss_scale: float

    def __init__(
        self,
        loss_scale: Any = 2.0**15,
        counter: Any = 0,
        period: int = 2000,
        factor: float | int = 2,
        min_loss_scale: float = 1.0,
    ):
        where = "DynamicLossScale"
        if not is_int(period) or period < 1:
            error = ValueError if is_int(period) else TypeError
            raise error(
                f"{where}: period must be a positive int (the finite steps in a row after "
                f"which the scale grows), got {period!r}."
            )
        if not is_real(factor) or not (factor > 1 and math.isfinite(factor)):
            error = ValueError if is_real(factor) else TypeError
            raise error(
                f"{where}: factor must be a finite number > 1 (the scale is multiplied by it "
                f"after {period} finite steps and divided by it after a non-finite one), got "
                f"{factor!r}."
            )
        if not is_real(min_loss_scale) or not (
            min_loss_scale > 0 and math.isfinite(min_loss_scale)
        ):
            error = ValueError if is_real(min_loss_scale) else TypeError
            raise error(
                f"{where}: min_loss_scale must be a positive finite number, got {min_loss_scale!r}."
            )
        self.loss_scale = _scalar(where, "loss_scale", loss_scale, jnp.float32)
        self.counter = _scalar(where, "counter", counter, jnp.int32)
        self.period = int(period)
        self.factor = factor if is_int(factor) else float(factor)
        self.min_loss_scale = float(min_loss_scale)
        if is_concrete(self.loss_scale) and not (
            np.isfinite(self.loss_scale) and self.loss_scale >= self.min_loss_scale
        ):
            raise ValueError(
                f"{where}: loss_scale must be finite and at least min_loss_scale="
                f"{self.min_loss_scale}, got {float(self.loss_scale)}. Start from 2.0 ** 15 "
                f"(the default) and let the scale adapt."
            )
        if is_concrete(self.counter) and not 0 <= int(self.counter) < self.period:
            raise ValueError(
                f"{where}: counter must be in [0, period={self.period}), got {int(self.counter)}."
            )

    def scale(self, tree: T) -> T:
        """`tree` times the loss scale, per floating leaf, in float32 at least.

        A float16 or bfloat16 leaf comes back as float32 (a float16 loss of 3.0 times 2 ** 15
        would overflow float16), a float32 or wider one in its dtype; integer and bool leaves
        are returned as they are.
        """
        return jax.tree.map(lambda leaf: _times(leaf, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """`tree` divided by the loss scale (times its float32 reciprocal, as jmp), per leaf.

        A float16 or bfloat16 leaf (the gradient of a float16 parameter) comes back as
        float32, as jmp's does: divided in float16 it would underflow to zero again, the very
        thing the scale was for. `optax.apply_updates` casts the update back to the
        parameter's dtype. A float32 or wider leaf keeps its dtype; integer and bool leaves
        are returned as they are.
        """
        inverse = 1 / self.loss_scale
        return jax.tree.map(lambda leaf: _times(leaf, inverse), tree)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, after a step whose gradients were finite or not.

        Finite: the counter counts the step; at `period` steps the scale grows by `factor`
        (unless that would overflow float32) and the counter restarts. Not finite: the scale
        is divided by `factor` (at least `min_loss_scale`) and the counter restarts.

        Args:
            grads_finite: One bool for the whole step, a scalar (`lm.all_finite(grads)`).

        Returns:
            A new `DynamicLossScale`; this one is unchanged.

        Raises:
            TypeError: `grads_finite` is not a scalar bool.
        """
        finite = _finite_flag(grads_finite)
        grown = self.loss_scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        at_period = self.counter == self.period - 1
        loss_scale = jnp.where(
            finite,
            jnp.where(at_period, grown, self.loss_scale),
            jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor),
        )
        counter = jnp.where(finite, (self.counter + 1) % self.period, 0)
        return _build(self, loss_scale.astype(jnp.float32), counter.astype(jnp.int32))

    def __repr__(self) -> str:
        def shown(x: Any) -> str:
            if is_concrete(x) and np.ndim(x) == 0:
                return repr(x.item())
            return f"<{jnp.dtype(x.dtype).name}{list(np.shape(x))}>"

        return (
            f"DynamicLossScale(loss_scale={shown(self.loss_scale)}, counter="
            f"{shown(self.counter)}, period={self.period}, factor={self.factor}, "
            f"min_loss_scale={self.min_loss_scale})"
        )


def _build(like: DynamicLossScale, loss_scale: Any, counter: Any) -> DynamicLossScale:
    """A loss scale with `like`'s settings, without checks (leaves may be tracers)."""
    new = object.__new__(DynamicLossScale)
    new.loss_scale, new.counter = loss_scale, counter
    new.period, new.factor, new.min_loss_scale = (
        like.period,
        like.factor,
        like.min_loss_scale,
    )
    return new


def _flatten(scale: DynamicLossScale) -> tuple[tuple[Any, Any], tuple[int, Any, float]]:
    return (scale.loss_scale, scale.counter), (scale.period, scale.factor, scale.min_loss_scale)


def _unflatten(static: tuple[int, Any, float], leaves: Any) -> DynamicLossScale:
    new = object.__new__(DynamicLossScale)
    new.loss_scale, new.counter = leaves
    new.period, new.factor, new.min_loss_scale = static
    return new


jax.tree_util.register_pytree_node(DynamicLossScale, _flatten, _unflatten)


def _scalar(where: str, name: str, value: Any, dtype: Any) -> jax.Array:
    """`value` as a scalar array of `dtype`: a number, or a real scalar array."""
    kind = np.dtype(value.dtype) if hasattr(value, "dtype") else None
    numeric = is_real(value) if kind is None else kind.kind in "iuf"
    if not numeric or np.ndim(value) != 0:
        raise TypeError(
            f"{where}: {name} must be a real number or a scalar array, got "
            f"{type(value).__name__} {value!r:.60}."
        )
    if dtype == jnp.int32 and not (is_int(value) or (kind is not None and kind.kind in "iu")):
        raise TypeError(f"{where}: {name} must be an int, got {value!r:.60}.")
    return jnp.asarray(value, dtype)


def _times(leaf: Any, factor: jax.Array) -> Any:
    """A floating (or complex) `leaf` times `factor`, in float32 at least (or the leaf's dtype)."""
    if not hasattr(leaf, "dtype"):
        if not isinstance(leaf, (float, complex)):
            return leaf  # an int, a bool, None, a string: nothing to scale
        leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return leaf
    wide = jnp.float32 if jnp.dtype(leaf.dtype).itemsize < 4 else leaf.dtype
    return leaf.astype(wide) * factor.astype(wide)


def _finite_flag(value: Any) -> jax.Array:
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (bool, np.bool_)):
        return jnp.asarray(value)
    if dtype is None or dtype != jnp.bool_ or np.ndim(value) != 0:
        shown = f"{dtype}{list(np.shape(value))}" if dtype is not None else type(value).__name__
        raise TypeError(
            f"DynamicLossScale.adjust takes one bool for the whole step, whether every "
            f"gradient is finite: adjust(lm.all_finite(grads)); got {shown}."
        )
    return value


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of `tree` is finite (no inf, no nan): a scalar bool array.

    Integer and bool leaves are always finite and not looked at; an empty tree is finite.
    Works under `jax.jit` (the answer is an array, not a Python bool).

    Args:
        tree: Any pytree of arrays and numbers (gradients, updates, variables).

    Returns:
        A bool array of shape ``()``.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> bool(lm.all_finite({"w": jnp.ones(3), "step": jnp.int32(4)}))
        True
        >>> bool(lm.all_finite({"w": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2)}))
        False
    """
    checks = []
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "dtype"):
            if not is_real(leaf):
                continue
            leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            checks.append(jnp.isfinite(leaf).all())
    if not checks:
        return jnp.asarray(True)
    return jnp.stack(checks).all()
