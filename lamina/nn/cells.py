"""Recurrent cells: `LSTMCell`, `OptimizedLSTMCell`, `GRUCell`, `MGUCell`, `SimpleCell`.

Each equals its Flax Linen namesake and holds Linen's variables (one `Dense` per gate and
source, named as Linen names them), so Linen's variables load directly. A cell computes one
time step, ``cell(carry, x) -> (new_carry, y)``; `RNN` runs it over a sequence.

A step's arithmetic is a compiled kernel (`lstm_step`, `fused_lstm_step`, `gru_step`,
`mgu_step`, `simple_step`) that reads the gates' kernels and biases itself. It runs only where
it is provably the cell's own computation (`_Cell.uses_compiled_step`: exactly a built-in
cell class, every gate exactly the `Dense` it built, nothing capturing module outputs);
then `compiled_step` hands it to `RNN` with the cell's variables, so that the whole scan is
one compiled function. Otherwise the cell calls its gate layers as modules (a `LoRA` gate, a
`Dense` without a bias, a subclass's gates), and the update is the same code (`gru_update`...).

Dtypes: the gates are computed in the cell's `dtype`, or with ``dtype=None`` in the promotion
of the input, the carry and the variables (Linen's ``promote_dtype``); the carry keeps its own
dtype (`param_dtype` from `initialize_carry`), as Linen's does under `RNN`, except that a
complex step makes a real carry complex, as Linen's cells do (`next_carry_dtype`).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.frame import current_frame, require_frame
from .._core.module import Module
from .._core.variables import Initializer, Parameter
from ..activations import sigmoid, tanh
from . import _checks, _dtypes
from .linear import Dense, dense

Carry = Any

_LSTM_GATES = ("i", "f", "g", "o")
_GRU_GATES = ("r", "z", "n")


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


def common_parts(
    x_parts: Sequence[jax.Array], h_parts: Sequence[jax.Array]
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The gates' outputs cast to their promotion (Linen's: gates of different dtypes meet there).

    Each gate `Dense` computes in its own dtype (with ``dtype=None``, the promotion of its
    input and variables: a bfloat16 carry and bfloat16 kernels make a bfloat16 hidden gate
    next to a float32 input gate); the update combines them in the promotion. The compiled
    steps and the cell's own call share this, so that both are the same computation.
    """
    common = _dtypes._promote(tuple(jnp.result_type(p) for p in (*x_parts, *h_parts)))
    return [jnp.asarray(p, common) for p in x_parts], [jnp.asarray(p, common) for p in h_parts]


def next_carry_dtype(carry_dtype: Any, compute_dtype: Any) -> Any:
    """The dtype of a carry after a step computed in `compute_dtype`.

    The carry keeps its dtype (bfloat16 gates leave a float32 carry float32), except that a
    complex step makes a real carry complex, as Linen's cells do (its standard promotion);
    dropping the imaginary part would be a silently wrong result.
    """
    if jnp.issubdtype(compute_dtype, jnp.complexfloating) and not jnp.issubdtype(
        carry_dtype, jnp.complexfloating
    ):
        return _dtypes._promote((jnp.dtype(carry_dtype), jnp.dtype(compute_dtype)))
    return carry_dtype


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


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """A cell's step as a hashable static argument: ``step(weights, carry, x)``."""

    fn: Callable[..., Any]  # lstm_step, gru_step...
    settings: tuple[tuple[str, Any], ...]  # `dtypes` (input's, hidden state's) included
    dtype: Any  # the step's: the promotion of the input, the carry and the weights

    def __call__(self, weights: Any, carry: Carry, x: jax.Array) -> tuple[Carry, Any]:
        return self.fn(carry, x, weights, **dict(self.settings))


def _batch_shape(cls: str, batch_shape: Any) -> tuple[int, ...]:
    if _checks.is_int(batch_shape):
        batch_shape = (batch_shape,)
    try:
        dims = tuple(batch_shape)
    except TypeError:
        dims = None
    if dims is None or not all(_checks.is_int(d) and d >= 0 for d in dims):
        raise TypeError(
            f"{cls}.initialize_carry takes the batch shape (a tuple of non-negative ints, "
            f"without the feature axis), got {batch_shape!r}; e.g. initialize_carry((32,)) "
            f"for inputs of shape (32, in_size)."
        )
    return tuple(int(d) for d in dims)


def tree_shapes(tree: Any) -> Any:
    """The shapes of the arrays of a carry (a pytree), in its structure."""
    return jax.tree.map(lambda a: tuple(jnp.shape(a)), tree)


def step_dtype(cell: Any, dtype: Any, carry: Carry, x: jax.Array, weights: Any) -> Any:
    """The dtype a cell computes a step in: `dtype`, or the promotion of `x`, carry and weights.

    Raises `TypeError`, through `_dtypes.compute_dtype`, for a complex input or variable under
    a real `dtype`. A complex step on a real carry makes the carry complex (`next_carry_dtype`).
    """
    leaves = jax.tree.leaves(carry)
    return _dtypes.compute_dtype(cell, dtype, x, *leaves, *jax.tree.leaves(weights))


def promote_carry(carry: Carry, dtype: Any) -> Carry:
    """`carry` cast to the dtypes a step computed in `dtype` returns (`next_carry_dtype`).

    `RNN` starts its scan from it, so that the loop's carry keeps one dtype.
    """
    if not jnp.issubdtype(dtype, jnp.complexfloating):
        return carry  # a real step keeps every carry's dtype

    def cast(leaf: Any) -> Any:
        leaf = jnp.asarray(leaf)
        target = next_carry_dtype(leaf.dtype, dtype)
        return leaf if target == leaf.dtype else leaf.astype(target)

    return jax.tree.map(cast, carry)


class _Cell(Module, abc.ABC):
    """What the cells share: settings, gate layers, the dtype of a step, checks and the call."""

    num_feature_axes = 1  # the trailing axes that are features, not batch (as Linen's)
    _gates: tuple[str, ...] = ()
    _carry_doc = "h"

    in_size = _checks.Setting()
    hidden_size = _checks.Setting()
    gate_fn = _checks.Setting()
    activation_fn = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        *,
        gate_fn: Callable[..., Any] | None,
        activation_fn: Callable[..., Any],
        kernel_init: Initializer,
        recurrent_kernel_init: Initializer,
        bias_init: Initializer,
        dtype: Any,
        param_dtype: Any,
        gate_bias_inits: dict[str, tuple[str, Initializer]] | None = None,
    ):
        super().__init__()
        cls = type(self).__name__
        self.in_size = _checks.positive_int(cls, "in_size", in_size)
        self.hidden_size = _checks.positive_int(cls, "hidden_size", hidden_size)
        # Passed to the compiled step as static arguments: `transform`'s copy of the cell
        # shares JAX's functions (`lm.sigmoid`, `jnp.tanh`), so every copy hits its cache.
        if gate_fn is not None:  # SimpleCell has no gates
            self.gate_fn = _checks.function(cls, "gate_fn", gate_fn, "lm.sigmoid")
        self.activation_fn = _checks.function(cls, "activation_fn", activation_fn, "lm.tanh")
        self.dtype = _dtypes.layer_dtype(cls, dtype)
        self.param_dtype = _dtypes.storage_dtype(cls, param_dtype, self.dtype)
        kernel_init = _checks.initializer(cls, "kernel_init", kernel_init)
        recurrent_kernel_init = _checks.initializer(
            cls, "recurrent_kernel_init", recurrent_kernel_init
        )
        bias_init = _checks.initializer(cls, "bias_init", bias_init)
        bias_inits = {
            name: _checks.initializer(cls, option, init)
            for name, (option, init) in (gate_bias_inits or {}).items()
        }
        input_biases, hidden_biases = self._biases()
        self._dense_per_gate("i", kernel_init, bias_init, input_biases, bias_inits)
        self._dense_per_gate("h", recurrent_kernel_init, bias_init, hidden_biases, bias_inits)

    def _dense_per_gate(
        self,
        source: str,
        kernel_init: Initializer,
        bias_init: Initializer,
        biased: tuple[str, ...],
        bias_inits: dict[str, Initializer],
    ) -> None:
        """Declares one `Dense` per gate from `source`, named ``source + gate`` as in Linen.

        `source` is ``"i"`` (from the input) or ``"h"`` (from the hidden state); the gates in
        `biased` have a bias, initialised by ``bias_inits[name]`` or else `bias_init`. The
        names include Python keywords (``if``, ``in``), so they are set and read by name.
        """
        size = self.in_size if source == "i" else self.hidden_size
        for gate in self._gates:
            layer = Dense(
                size,
                self.hidden_size,
                use_bias=gate in biased,
                kernel_init=kernel_init,
                bias_init=bias_inits.get(f"{source}{gate}", bias_init),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )
            setattr(self, f"{source}{gate}", layer)

    def _settings(self, dtypes: tuple[Any, Any]) -> tuple[tuple[str, Any], ...]:
        return (
            ("dtypes", dtypes),
            ("gate_fn", self.gate_fn),
            ("activation_fn", self.activation_fn),
        )

    def _describe(self) -> str:
        return f"{type(self).__name__}(in_size={self.in_size}, hidden_size={self.hidden_size})"

    def _zeros(self, batch_shape: Any) -> jax.Array:
        shape = (*_batch_shape(type(self).__name__, batch_shape), self.hidden_size)
        return jnp.zeros(shape, self.param_dtype)

    @abc.abstractmethod
    def _carry_shapes(self, batch: tuple[int, ...]) -> Any:
        """The carry's shapes (a tree of tuples) for inputs of batch shape `batch`."""

    @abc.abstractmethod
    def _weights(self) -> Any:
        """The arrays the step kernel takes, read from the gate layers."""

    @abc.abstractmethod
    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        """The jitted step with this cell's settings: gates in `dtypes`, the step's `dtype`."""

    @abc.abstractmethod
    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The gates whose input and whose hidden `Dense` have a bias (as Linen's)."""

    @abc.abstractmethod
    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        """The step from the gate layers' outputs (``i<gate>(x)`` and ``h<gate>(h)``)."""

    def _compiled(self, carry: Carry, x: jax.Array) -> tuple[Any, _Kernel]:
        """The weights and the step for this carry and input (their dtypes decide the step's).

        Each gate computes in the dtype its `Dense` would: the cell's `dtype`, or with None
        the promotion of its input (`x`, or the hidden state as `RNN` carries it, complex
        from the start for a complex step) and its variables, which `uses_compiled_step`
        has checked all have the one dtype of the cell's gates.
        """
        weights = self._weights()
        dtype = step_dtype(self, self.dtype, carry, x, weights)
        if self.dtype is not None:
            return weights, self._kernel((dtype, dtype), dtype)
        w = jnp.result_type(jax.tree.leaves(weights[0])[0])
        h = next_carry_dtype(jnp.result_type(self._hidden(carry)), dtype)
        dtypes = (_dtypes._promote((jnp.result_type(x), w)), _dtypes._promote((h, w)))
        return weights, self._kernel(dtypes, dtype)

    def uses_compiled_step(self) -> bool:
        """Whether the compiled step is provably this cell's own computation.

        The compiled step (`gru_step`...) reads the gates' kernels and biases and does their
        arithmetic itself, so it may stand in for the cell's `__call__` only when that is the
        same computation: the cell is exactly a built-in class (not a subclass, whose
        `__call__` may differ); each gate is exactly a `Dense` with the configuration the step
        assumes (its sizes, the cell's `dtype` and `param_dtype`, its `kernel` and `bias`
        attributes exactly `Parameter`s of the shapes and dtypes it built, a bias present
        exactly where the cell's gate has one, default precision), not a `LoRA` or another
        module; and the active call does not capture module outputs
        (`lm.capture_intermediates`, which records the gates' calls). Otherwise the cell calls
        its gate layers, and `RNN` calls the cell at every step.
        """
        if type(self) not in _BUILT_IN_CELLS:
            return False
        frame = current_frame()
        if frame is not None and frame.records is not None and frame.records.capture:
            return False
        # Settings are read-only once built, and read from `__dict__` (where `Setting` keeps
        # them): this runs on every call, so it stays a few dictionary lookups per gate.
        own = self.__dict__
        hidden, dtype, param_dtype = own["hidden_size"], own["dtype"], own["param_dtype"]
        sizes = {"i": own["in_size"], "h": hidden}
        read_as = param_dtype if dtype is None else dtype  # the dtype `.value` returns
        for name, source, biased in _gate_table(self._gates, self._biases()):
            layer = own.get(name)
            if type(layer) is not Dense:
                return False
            # What `Dense.__call__` reads: its settings, and its `kernel` and `bias`
            # attributes (which may have been replaced or removed since it was built).
            settings = layer.__dict__
            bias = settings.get("bias")
            if not (
                settings["in_size"] == sizes[source]
                and settings["out_size"] == hidden
                and settings["precision"] is None
                and _same_dtype(settings["dtype"], dtype)
                and _same_dtype(settings["param_dtype"], param_dtype)
                and is_parameter(
                    settings.get("kernel"), (sizes[source], hidden), read_as, param_dtype
                )
                and (
                    is_parameter(bias, (hidden,), read_as, param_dtype) if biased else bias is None
                )
            ):
                return False
        return True

    def _layer(self, source: str, gate: str) -> Any:
        return getattr(self, f"{source}{gate}")

    def _hidden(self, carry: Carry) -> jax.Array:
        """The part of the carry that the hidden-to-gate layers take."""
        return carry

    def __call__(self, carry: Carry, x: jax.Array) -> tuple[Carry, jax.Array]:
        """One step: ``(new_carry, y)`` for the carry and `x` of shape ``(*batch, in_size)``."""
        shape = _checks.check_last_axis(self._describe, x, self.in_size, "in_size")
        self._check_carry(carry, shape[:-1])
        if self.uses_compiled_step():
            weights, kernel = self._compiled(carry, x)
            return kernel(weights, carry, x)
        h = self._hidden(carry)
        x_parts = [self._layer("i", gate)(x) for gate in self._gates]
        h_parts = [self._layer("h", gate)(h) for gate in self._gates]
        x_parts, h_parts = common_parts(x_parts, h_parts)
        return self._update(carry, x_parts, h_parts)

    def scan_dtype(self, carry: Carry, x: jax.Array) -> Any:
        """The dtype the cell computes in for `carry` and inputs `x` (inside a call).

        From the cell's `dtype`, or with None the promotion of `x`, the carry and the values
        of every variable under the cell (whatever its gate layers are). `RNN` casts its
        initial carry with `promote_carry` to this dtype, so that a complex step's carry is
        complex from the first step.
        """
        frame = require_frame(f"{type(self).__name__}.scan_dtype")
        values = [frame.values[slot] for slot in frame.plan.slots_of(self)]
        return step_dtype(self, self.dtype, carry, x, values)

    def _check_carry(self, carry: Any, batch: tuple[int, ...]) -> None:
        expected = self._carry_shapes(batch)
        got = tree_shapes(carry)
        if got != expected:
            raise ValueError(
                f"{self._describe()} got a carry of shapes {got} for an input with batch shape "
                f"{batch}; the carry must be {self._carry_doc} with shapes {expected} (the "
                f"input's batch shape + (hidden_size,)). Create one with "
                f"cell.initialize_carry({batch})."
            )


class LSTMCell(_Cell):
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        return _Kernel(lstm_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), _LSTM_GATES

    def _hidden(self, carry: Carry) -> jax.Array:
        return carry[1]

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        z = [xz + hz for xz, hz in zip(x_parts, h_parts, strict=True)]
        return lstm_update(carry[0], carry[1], z, self.gate_fn, self.activation_fn)


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

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        return _Kernel(fused_lstm_step, self._settings(dtypes), dtype)


class _HiddenStateCell(_Cell):
    """A cell whose carry is one array ``h`` (GRU, MGU, Elman)."""

    _carry_doc = "one array h"

    def _carry_shapes(self, batch: tuple[int, ...]) -> Any:
        return (*batch, self.hidden_size)

    def initialize_carry(self, batch_shape: Sequence[int] | int = ()) -> jax.Array:
        """Returns the zero carry ``h`` of shape ``(*batch_shape, hidden_size)``.

        Args:
            batch_shape: The input's shape without its feature axis (``()`` for one example).

        Returns:
            A zero array of dtype `param_dtype`.
        """
        return self._zeros(batch_shape)


class GRUCell(_HiddenStateCell):
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        return _Kernel(gru_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return _GRU_GATES, ("n",)

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        return gru_update(carry, x_parts, h_parts, self.gate_fn, self.activation_fn)


class MGUCell(_HiddenStateCell):
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        return _Kernel(mgu_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("f", "n"), (("n",) if self.reset_gate else ())

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        return mgu_update(
            carry, x_parts, h_parts, self.gate_fn, self.activation_fn, self.reset_gate
        )


class SimpleCell(_HiddenStateCell):
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
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
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

    def _kernel(self, dtypes: tuple[Any, Any], dtype: Any) -> _Kernel:
        return _Kernel(simple_step, self._settings(dtypes), dtype)

    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("",), ()

    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        (x_part,), (h_part,) = x_parts, h_parts
        return simple_update(carry, x_part, h_part, self.activation_fn, self.residual)


def carry_shapes(cell: Any, batch: tuple[int, ...]) -> Any:
    """The shapes of the carry that `cell` takes for inputs of batch shape `batch`."""
    if type(cell) in _BUILT_IN_CELLS:  # a subclass may override initialize_carry
        return cell._carry_shapes(batch)
    return tree_shapes(jax.eval_shape(lambda: cell.initialize_carry(batch)))


@functools.cache
def _gate_table(
    gates: tuple[str, ...], biases: tuple[tuple[str, ...], tuple[str, ...]]
) -> tuple[tuple[str, str, bool], ...]:
    """``(attribute, source, has a bias)`` of each gate `Dense` a built-in cell declares."""
    sources = (("i", biases[0]), ("h", biases[1]))
    return tuple((f"{s}{g}", s, g in biased) for s, biased in sources for g in gates)


def is_parameter(declaration: Any, shape: tuple[int, ...], dtype: Any, param_dtype: Any) -> bool:
    """Whether `declaration` is exactly a `Parameter` of `shape`, `dtype` and `param_dtype`.

    Such an array is what a fused path may read in place of calling the layer that holds it.
    """
    return (
        type(declaration) is Parameter
        and declaration.shape == shape
        and declaration.dtype == dtype
        and declaration.param_dtype == param_dtype
    )


def _same_dtype(a: Any, b: Any) -> bool:
    """Whether two dtype settings (None for inferred) are the same."""
    return a is b or (a is not None and b is not None and jnp.dtype(a) == jnp.dtype(b))


_BUILT_IN_CELLS = frozenset((LSTMCell, OptimizedLSTMCell, GRUCell, MGUCell, SimpleCell))


def compiled_step(cell: Module, carry: Carry, x: jax.Array) -> tuple[Any, _Kernel] | None:
    """The variables' values and the compiled step of a cell, or None to call the cell.

    Only where the step is provably the cell's own computation (`_Cell.uses_compiled_step`:
    a built-in cell exactly, with untouched gates, nothing capturing the gates' calls); None
    for every other cell (a subclass, a `LoRA` or other gate, `ConvLSTMCell`, a user's).

    Inside a call: the step is a hashable ``step(weights, carry, x)``, for a compiled function
    to take as a static argument with the weights as an argument; it computes in the dtype the
    cell would for `carry` and `x` (an input of one step, or the whole sequence).
    """
    if isinstance(cell, _Cell) and cell.uses_compiled_step():
        return cell._compiled(carry, x)
    return None
