"""The gated recurrent cells `GRUCell` and `MGUCell` (Flax Linen's), and their compiled steps.

`gru_step` and `mgu_step` are the compiled steps, `gru_update` and `mgu_update` the updates
from the gates' outputs (shared by the compiled step and the call through the gate layers).
What the cells share with the other cells is in `cells`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.types import Dtype, Initializer
from ..activations import sigmoid, tanh
from . import _checks
from .cells import Carry, HiddenStateCell, StepKernel, built_in, common_parts, next_carry_dtype
from .linear import dense

_GRU_GATES = ("r", "z", "n")


def gru_update(
    h: jax.Array,
    x_parts: Sequence[jax.Array],
    h_parts: Sequence[jax.Array],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
) -> tuple[jax.Array, jax.Array]:
    """The GRU update from the gates' transforms of ``x`` and ``h`` (``r, z, n``): ``(h', h')``.

    ``(1 - z) * n + z * h`` is computed in the carry's dtype (`next_carry_dtype`).
    """
    (xr, xz, xn), (hr, hz, hn) = x_parts, h_parts
    r = gate_fn(xr + hr)
    z = gate_fn(xz + hz)
    n = activation_fn(xn + r * hn)
    hdt = next_carry_dtype(h.dtype, jnp.result_type(n))
    new_h = ((1.0 - z) * n).astype(hdt) + z.astype(hdt) * h.astype(hdt)
    return new_h, new_h


@functools.partial(jax.jit, static_argnames=("dtypes", "gate_fn", "activation_fn"))
def gru_step(
    carry: jax.Array,
    x: jax.Array,
    weights: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array],
    dtypes: tuple[Any, Any],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
) -> tuple[jax.Array, jax.Array]:
    """One GRU step, as Flax Linen's `GRUCell` computes it: ``(h', h')``.

    `weights` is ``(input_kernels, input_biases, hidden_kernels, hidden_bias_n)``, the tuples
    over the gates ``r, z, n``: the input transforms carry the biases, and of the hidden ones
    only ``n``'s (it is gated by ``r`` before the sum); the input's products are computed in
    ``dtypes[0]``, the hidden state's in ``dtypes[1]``. Then `gru_update`.
    """
    h = carry
    x_dtype, h_dtype = dtypes
    (w_ir, w_iz, w_in), (b_ir, b_iz, b_in), (w_hr, w_hz, w_hn), b_hn = weights
    x_parts, h_parts = common_parts(
        [
            dense(x, w_ir, b_ir, x_dtype),
            dense(x, w_iz, b_iz, x_dtype),
            dense(x, w_in, b_in, x_dtype),
        ],
        [
            dense(h, w_hr, None, h_dtype),
            dense(h, w_hz, None, h_dtype),
            dense(h, w_hn, b_hn, h_dtype),
        ],
    )
    return gru_update(h, x_parts, h_parts, gate_fn, activation_fn)


def mgu_update(
    h: jax.Array,
    x_parts: Sequence[jax.Array],
    h_parts: Sequence[jax.Array],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
    reset_gate: bool,
) -> tuple[jax.Array, jax.Array]:
    """The MGU update from the transforms of ``x`` and ``h`` (``f, n``): ``(h', h')``.

    ``(1 - f) * n + f * h`` is computed in the carry's dtype (`next_carry_dtype`).
    """
    (xf, xn), (hf, hn) = x_parts, h_parts
    f = gate_fn(xf + hf)
    recurrent = hn * f if reset_gate else hn
    n = activation_fn(xn + recurrent)
    hdt = next_carry_dtype(h.dtype, jnp.result_type(n))
    new_h = ((1.0 - f) * n).astype(hdt) + f.astype(hdt) * h.astype(hdt)
    return new_h, new_h


@functools.partial(jax.jit, static_argnames=("dtypes", "gate_fn", "activation_fn", "reset_gate"))
def mgu_step(
    carry: jax.Array,
    x: jax.Array,
    weights: tuple[Any, ...],
    dtypes: tuple[Any, Any],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
    reset_gate: bool,
) -> tuple[jax.Array, jax.Array]:
    """One minimal gated unit step, as Flax Linen's `MGUCell` computes it: ``(h', h')``.

    `weights` is ``(W_if, b_if, W_in, b_in, W_hf, W_hn, b_hn)`` (`b_hn` None without the reset
    gate); the input's products in ``dtypes[0]``, the hidden state's in ``dtypes[1]``. Then
    `mgu_update`.
    """
    h = carry
    x_dtype, h_dtype = dtypes
    w_if, b_if, w_in, b_in, w_hf, w_hn, b_hn = weights
    x_parts, h_parts = common_parts(
        [dense(x, w_if, b_if, x_dtype), dense(x, w_in, b_in, x_dtype)],
        [dense(h, w_hf, None, h_dtype), dense(h, w_hn, b_hn, h_dtype)],
    )
    return mgu_update(h, x_parts, h_parts, gate_fn, activation_fn, reset_gate)


@built_in
class GRUCell(HiddenStateCell):
    r"""A gated recurrent unit cell, equal to Flax Linen's `GRUCell`.

    .. math::

        r = \sigma(W_{ir} x + b_{ir} + W_{hr} h), \quad
        z = \sigma(W_{iz} x + b_{iz} + W_{hz} h),

        n = \tanh(W_{in} x + b_{in} + r (W_{hn} h + b_{hn})), \qquad
        h' = (1 - z) n + z h.

    ``cell(h, x)`` takes the carry ``h`` and an input of shape ``(*batch, in_size)`` and
    returns ``(h', h')``. Variables are Linen's: `Dense` submodules ``ir, iz, in`` (input to
    gate: ``kernel`` of shape ``(in_size, hidden_size)`` and ``bias``), ``hr, hz``
    (hidden to gate: ``kernel`` only) and ``hn`` (``kernel`` and ``bias``).

    Args:
        in_size: Size of the input's last axis.
        hidden_size: Size of ``h`` (Linen's `features`).
        gate_fn: Activation of the gates ``r, z``.
        activation_fn: Activation of the candidate ``n``.
        kernel_init: Initializer of the input kernels.
        recurrent_kernel_init: Initializer of the hidden kernels.
        bias_init: Initializer of the biases.
        dtype: Compute dtype of the gates; None infers it from the input, the carry and
            the variables (Linen's ``promote_dtype``).
        param_dtype: Storage dtype of the variables and dtype of `initialize_carry`'s carry
            (default: `dtype`,
            float32 when `dtype` is None).

    Everything after `hidden_size` is keyword-only. Linen's ``features`` is `hidden_size`;
    `in_size` is declared here because lamina does not infer shapes.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> cell = lm.GRUCell(3, 4)
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]), sorted(variables["params"]["hn"])
        (['hn', 'hr', 'hz', 'in', 'ir', 'iz'], ['bias', 'kernel'])
        >>> h, y = apply(variables, None, cell.initialize_carry((2,)), jnp.ones((2, 3)))[0]
        >>> h.shape
        (2, 4)
    """

    _gates = _GRU_GATES
    hn: Any  # the hidden-to-candidate Dense, set with the other gates in __init__

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        *,
        gate_fn: Callable[..., Any] = sigmoid,
        activation_fn: Callable[..., Any] = tanh,
        kernel_init: Initializer = initializers.lecun_normal(),
        recurrent_kernel_init: Initializer = initializers.orthogonal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
    ):
        super().__init__(
            in_size,
            hidden_size,
            gate_fn=gate_fn,
            activation_fn=activation_fn,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def _weights(self) -> Any:
        ins = [getattr(self, f"i{g}") for g in self._gates]
        hid = [getattr(self, f"h{g}") for g in self._gates]
        return (
            tuple(d.kernel.value for d in ins),
            tuple(d.bias.value for d in ins),
            tuple(d.kernel.value for d in hid),
            self.hn.bias.value,
        )

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        return StepKernel(gru_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return _GRU_GATES, ("n",)

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        return gru_update(carry, x_parts, h_parts, self.gate_fn, self.activation_fn)


@built_in
class MGUCell(HiddenStateCell):
    r"""A minimal gated unit cell, equal to Flax Linen's `MGUCell`.

    .. math::

        f = \sigma(W_{if} x + b_{if} + W_{hf} h), \quad
        n = \tanh(W_{in} x + b_{in} + f (W_{hn} h + b_{hn})), \qquad
        h' = (1 - f) n + f h.

    ``cell(h, x)`` returns ``(h', h')``. Variables are Linen's: `Dense` submodules ``if, in``
    (input to gate, ``kernel`` of shape ``(in_size, hidden_size)`` and ``bias``), ``hf``
    (``kernel`` only) and ``hn`` (``kernel``, and ``bias`` with the reset gate). Without the
    reset gate (``reset_gate=False``) ``n = tanh(W_{in} x + b_{in} + W_{hn} h)``.

    Args:
        in_size: Size of the input's last axis.
        hidden_size: Size of ``h`` (Linen's `features`).
        gate_fn: Activation of the gate ``f``.
        activation_fn: Activation of the candidate ``n``.
        kernel_init: Initializer of the input kernels.
        recurrent_kernel_init: Initializer of the hidden kernels.
        forget_bias_init: Initializer of ``b_{if}`` (ones, as Linen: a gate that starts
            half open keeps gradients alive).
        activation_bias_init: Initializer of ``b_{in}`` and ``b_{hn}``.
        dtype: Compute dtype of the gates; None infers it from the input, the carry and
            the variables (Linen's ``promote_dtype``).
        param_dtype: Storage dtype of the variables and of `initialize_carry`'s carry
            (default: `dtype`,
            float32 when `dtype` is None).
        reset_gate: Whether ``f`` gates the recurrent term of ``n``.

    Everything after `hidden_size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> cell = lm.MGUCell(3, 4)
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]), variables["params"]["if"]["bias"].tolist()
        (['hf', 'hn', 'if', 'in'], [1.0, 1.0, 1.0, 1.0])
        >>> h, y = apply(variables, None, cell.initialize_carry((2,)), jnp.ones((2, 3)))[0]
        >>> h.shape
        (2, 4)
    """

    _gates = ("f", "n")
    reset_gate = _checks.Setting()
    hf: Any  # the Dense layers, set by name in __init__ ("if" and "in" are keywords)
    hn: Any

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        *,
        gate_fn: Callable[..., Any] = sigmoid,
        activation_fn: Callable[..., Any] = tanh,
        kernel_init: Initializer = initializers.lecun_normal(),
        recurrent_kernel_init: Initializer = initializers.orthogonal(),
        forget_bias_init: Initializer = initializers.ones(),
        activation_bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        reset_gate: bool = True,
    ):
        self.reset_gate = _checks.flag(type(self).__name__, "reset_gate", reset_gate)
        super().__init__(
            in_size,
            hidden_size,
            gate_fn=gate_fn,
            activation_fn=activation_fn,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_kernel_init,
            bias_init=activation_bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
            gate_bias_inits={"if": ("forget_bias_init", forget_bias_init)},
        )

    def _weights(self) -> Any:
        f_in, n_in = getattr(self, "if"), getattr(self, "in")
        f_h, n_h = self.hf, self.hn
        return (
            f_in.kernel.value,
            f_in.bias.value,
            n_in.kernel.value,
            n_in.bias.value,
            f_h.kernel.value,
            n_h.kernel.value,
            None if n_h.bias is None else n_h.bias.value,
        )

    def _settings(self, dtypes: tuple[Any, Any]) -> tuple[tuple[str, Any], ...]:
        return (*super()._settings(dtypes), ("reset_gate", self.reset_gate))

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        return StepKernel(mgu_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("f", "n"), (("n",) if self.reset_gate else ())

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        return mgu_update(
            carry, x_parts, h_parts, self.gate_fn, self.activation_fn, self.reset_gate
        )
