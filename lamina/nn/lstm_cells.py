"""The LSTM cells: `LSTMCell` and `OptimizedLSTMCell`, Flax Linen's, and their compiled steps.

`lstm_step` computes a step gate by gate, `fused_lstm_step` with the gates' kernels
concatenated; `lstm_update` is the update from the gates' pre-activations, shared with
`ConvLSTMCell`. What the cells share with the other cells is in `cells`.
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
from .cells import Carry, DenseCell, StepKernel, built_in, common_parts, next_carry_dtype
from .linear import dense

_LSTM_GATES = ("i", "f", "g", "o")


@functools.partial(jax.jit, static_argnames=("dtypes", "gate_fn", "activation_fn"))
def lstm_step(
    carry: tuple[jax.Array, jax.Array],
    x: jax.Array,
    weights: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]],
    dtypes: tuple[Any, Any],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """One LSTM step, as Flax Linen's `LSTMCell` computes it: ``((c', h'), h')``.

    `weights` is ``(input_kernels, hidden_kernels, hidden_biases)``, each a tuple over the
    gates ``i, f, g, o``. Each gate is ``dense(x, W_i?) + dense(h, W_h?, b_h?)``, the input's
    products computed in ``dtypes[0]`` and the hidden state's in ``dtypes[1]`` (each gate
    `Dense` in its own dtype, as Linen's), then `lstm_update`.
    """
    c, h = carry
    x_dtype, h_dtype = dtypes
    x_parts, h_parts = common_parts(
        [dense(x, wi, None, x_dtype) for wi in weights[0]],
        [dense(h, wh, bh, h_dtype) for wh, bh in zip(weights[1], weights[2], strict=True)],
    )
    z = [xz + hz for xz, hz in zip(x_parts, h_parts, strict=True)]
    return lstm_update(c, h, z, gate_fn, activation_fn)


@functools.partial(jax.jit, static_argnames=("dtypes", "gate_fn", "activation_fn"))
def fused_lstm_step(
    carry: tuple[jax.Array, jax.Array],
    x: jax.Array,
    weights: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]],
    dtypes: tuple[Any, Any],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """`lstm_step` with two matrix products instead of eight (Linen's `OptimizedLSTMCell`).

    The same `weights`; the four input kernels are concatenated into one ``(in, 4 * hidden)``
    kernel and the hidden kernels and biases likewise, so each step multiplies `x` and `h`
    once. The concatenation does not depend on the step: inside `RNN`'s scan it is
    loop-invariant, and XLA computes it once.
    """
    c, h = carry
    input_kernels, hidden_kernels, hidden_biases = (jnp.concatenate(w, -1) for w in weights)
    (zx,), (zh,) = common_parts(
        [dense(x, input_kernels, None, dtypes[0])],
        [dense(h, hidden_kernels, hidden_biases, dtypes[1])],
    )
    z = zh + zx
    return lstm_update(c, h, jnp.split(z, 4, axis=-1), gate_fn, activation_fn)


def lstm_update(
    c: jax.Array,
    h: jax.Array,
    z: Sequence[jax.Array],
    gate_fn: Callable[..., Any],
    activation_fn: Callable[..., Any],
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """The LSTM update from the gates' pre-activations ``z = (i, f, g, o)``: ``((c', h'), h')``.

    ``c' = gate(f) c + gate(i) act(g)``, ``h' = gate(o) act(c')``; computed in the carry's
    dtype (Linen's result under standard promotion when the carry is float32 and the gates
    bfloat16), so the carry keeps its dtype, unless the gates are complex
    (`next_carry_dtype`). Shared by every LSTM cell (`ConvLSTMCell`
    included).
    """
    i, f, g, o = gate_fn(z[0]), gate_fn(z[1]), activation_fn(z[2]), gate_fn(z[3])
    gates = jnp.result_type(i, f, g, o)
    cdt = next_carry_dtype(c.dtype, gates)
    new_c = f.astype(cdt) * c.astype(cdt) + (i * g).astype(cdt)
    new_h = (o.astype(cdt) * activation_fn(new_c)).astype(next_carry_dtype(h.dtype, gates))
    return (new_c, new_h), new_h


@built_in
class LSTMCell(DenseCell):
    r"""A long short-term memory cell, equal to Flax Linen's `LSTMCell`.

    .. math::

        i = \sigma(W_{ii} x + W_{hi} h + b_{hi}), \quad
        f = \sigma(W_{if} x + W_{hf} h + b_{hf}), \quad
        g = \tanh(W_{ig} x + W_{hg} h + b_{hg}), \quad
        o = \sigma(W_{io} x + W_{ho} h + b_{ho}),

        c' = f c + i g, \qquad h' = o \tanh(c').

    ``cell(carry, x)`` takes the carry ``(c, h)`` and an input of shape
    ``(*batch, in_size)`` and returns ``((c', h'), h')``. Variables are Linen's: `Dense`
    submodules ``ii, if, ig, io`` (input to gate: ``kernel`` of shape
    ``(in_size, hidden_size)``, no bias) and ``hi, hf, hg, ho`` (hidden to gate:
    ``kernel`` of shape ``(hidden_size, hidden_size)`` and ``bias``).

    The gates are computed in `dtype`; the carry keeps its own dtype (`param_dtype` from
    `initialize_carry`), so bfloat16 compute with float32 storage keeps ``c`` and ``h`` in
    float32, as Linen does.

    Args:
        in_size: Size of the input's last axis.
        hidden_size: Size of ``c`` and ``h`` (Linen's `features`).
        gate_fn: Activation of the gates ``i, f, o``.
        activation_fn: Activation of ``g`` and of the output ``tanh(c')``.
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
        >>> cell = lm.LSTMCell(3, 4)
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"])
        ['hf', 'hg', 'hi', 'ho', 'if', 'ig', 'ii', 'io']
        >>> carry = cell.initialize_carry((2,))  # zeros of shape (2, 4), no key needed
        >>> (c, h), y = apply(variables, None, carry, jnp.ones((2, 3)))[0]
        >>> c.shape, y.shape
        ((2, 4), (2, 4))
    """

    _gates = _LSTM_GATES
    _carry_doc = "a tuple (c, h)"

    def _carry_shapes(self, batch: tuple[int, ...]) -> Any:
        return ((*batch, self.hidden_size),) * 2

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

    def initialize_carry(
        self, batch_shape: Sequence[int] | int = ()
    ) -> tuple[jax.Array, jax.Array]:
        """Returns the zero carry ``(c, h)``, each of shape ``(*batch_shape, hidden_size)``.

        Args:
            batch_shape: The input's shape without its feature axis (``()`` for one example).

        Returns:
            Two zero arrays of dtype `param_dtype`.
        """
        return self._zeros(batch_shape), self._zeros(batch_shape)

    def _weights(self) -> Any:
        ins = [getattr(self, f"i{g}") for g in self._gates]
        hid = [getattr(self, f"h{g}") for g in self._gates]
        return (
            tuple(d.kernel.value for d in ins),
            tuple(d.kernel.value for d in hid),
            tuple(d.bias.value for d in hid),
        )

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        return StepKernel(lstm_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), _LSTM_GATES

    def _hidden(self, carry: Carry) -> jax.Array:
        return carry[1]

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        z = [xz + hz for xz, hz in zip(x_parts, h_parts, strict=True)]
        return lstm_update(carry[0], carry[1], z, self.gate_fn, self.activation_fn)


@built_in
class OptimizedLSTMCell(LSTMCell):
    r"""`LSTMCell` with its gates' matrix products fused, as Flax Linen's `OptimizedLSTMCell`.

    The same cell, variables and numbers as `LSTMCell` (Linen's two cells have the same
    variables too, and the same initial values from the same key): each step concatenates the
    four input kernels into one ``(in_size, 4 * hidden_size)`` kernel and the four hidden
    kernels and biases likewise, and multiplies the input and the hidden state once each
    instead of four times (see `fused_lstm_step`). Linen recommends it for hidden sizes up to
    about 2048; time both on your shapes (``benchmarks/lstm_cells.py``).

    Arguments, carry and outputs are `LSTMCell`'s.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> cell = lm.OptimizedLSTMCell(3, 4)
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]) == sorted(lm.transform(lm.LSTMCell(3, 4)).init(
        ...     jax.random.key(0))["params"])
        True
        >>> (c, h), y = apply(variables, None, cell.initialize_carry((2,)), jnp.ones((2, 3)))[0]
        >>> y.shape
        (2, 4)
    """

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        return StepKernel(fused_lstm_step, self._settings(dtypes), dtype)
