"""The Elman cell `SimpleCell` (Flax Linen's), its compiled step and its update.

What the cells share is in `cells`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.types import Dtype, Initializer
from ..activations import tanh
from . import _checks
from .cells import Carry, HiddenStateCell, StepKernel, built_in, common_parts, next_carry_dtype
from .linear import dense


def simple_update(
    h: jax.Array,
    x_part: jax.Array,
    h_part: jax.Array,
    activation_fn: Callable[..., Any],
    residual: bool,
) -> tuple[jax.Array, jax.Array]:
    """The Elman update ``activation(x_part + h_part [+ h])``: ``(h', h')``, carry's dtype."""
    z = x_part + h_part
    if residual:
        z = z + h.astype(z.dtype)
    new_h = activation_fn(z)
    new_h = new_h.astype(next_carry_dtype(h.dtype, new_h.dtype))
    return new_h, new_h


@functools.partial(jax.jit, static_argnames=("dtypes", "activation_fn", "residual"))
def simple_step(
    carry: jax.Array,
    x: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    dtypes: tuple[Any, Any],
    activation_fn: Callable[..., Any],
    residual: bool,
) -> tuple[jax.Array, jax.Array]:
    """One Elman step, as Flax Linen's `SimpleCell` computes it: ``(h', h')``.

    `weights` is ``(W_i, b_i, W_h)``; ``h' = activation(W_i x + b_i + W_h h [+ h])``, in the
    carry's dtype; ``W_i x`` is computed in ``dtypes[0]``, ``W_h h`` in ``dtypes[1]``.
    """
    h = carry
    w_i, b_i, w_h = weights
    (x_part,), (h_part,) = common_parts(
        [dense(x, w_i, b_i, dtypes[0])], [dense(h, w_h, None, dtypes[1])]
    )
    return simple_update(h, x_part, h_part, activation_fn, residual)


@built_in
class SimpleCell(HiddenStateCell):
    r"""An Elman cell, equal to Flax Linen's `SimpleCell`.

    .. math::

        h' = \tanh(W_i x + b_i + W_h h) \quad (+\, h \text{ inside the tanh with residual}).

    ``cell(h, x)`` returns ``(h', h')``. Variables are Linen's: `Dense` submodules ``i``
    (``kernel`` of shape ``(in_size, hidden_size)`` and ``bias``) and ``h`` (``kernel``).

    Args:
        in_size: Size of the input's last axis.
        hidden_size: Size of ``h`` (Linen's `features`).
        activation_fn: The activation.
        kernel_init: Initializer of the input kernel.
        recurrent_kernel_init: Initializer of the hidden kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype of the gates; None infers it from the input, the carry and
            the variables (Linen's ``promote_dtype``).
        param_dtype: Storage dtype of the variables and of `initialize_carry`'s carry
            (default: `dtype`,
            float32 when `dtype` is None).
        residual: Adds ``h`` before the activation (a pre-activation residual).

    Everything after `hidden_size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> cell = lm.SimpleCell(3, 4)
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]), sorted(variables["params"]["h"])
        (['h', 'i'], ['kernel'])
        >>> h, y = apply(variables, None, cell.initialize_carry((2,)), jnp.ones((2, 3)))[0]
        >>> h.shape
        (2, 4)
    """

    _gates = ("",)  # one Dense per source, named "i" and "h" as in Linen
    residual = _checks.Setting()
    i: Any  # the Dense layers, set by name in __init__
    h: Any

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        *,
        activation_fn: Callable[..., Any] = tanh,
        kernel_init: Initializer = initializers.lecun_normal(),
        recurrent_kernel_init: Initializer = initializers.orthogonal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        residual: bool = False,
    ):
        self.residual = _checks.flag(type(self).__name__, "residual", residual)
        super().__init__(
            in_size,
            hidden_size,
            gate_fn=None,
            activation_fn=activation_fn,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def _weights(self) -> Any:
        return (self.i.kernel.value, self.i.bias.value, self.h.kernel.value)

    def _settings(self, dtypes: tuple[Any, Any]) -> tuple[tuple[str, Any], ...]:
        return (
            ("dtypes", dtypes),
            ("activation_fn", self.activation_fn),
            ("residual", self.residual),
        )

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        return StepKernel(simple_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("",), ()

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        (x_part,), (h_part,) = x_parts, h_parts
        return simple_update(carry, x_part, h_part, self.activation_fn, self.residual)
