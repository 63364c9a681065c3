"""What lamina's recurrent cells share: the `DenseCell` base, the carry and the compiled step.

The cells (`LSTMCell` and `OptimizedLSTMCell` in `lstm_cells`, `GRUCell` and `MGUCell` in
`gru_cells`, `SimpleCell` in `simple_cell`) each equal their Flax Linen namesake and hold
Linen's variables (one `Dense` per gate and source, named as Linen names them), so Linen's
variables load directly. A cell computes one time step, ``cell(carry, x) -> (new_carry, y)``;
`RNN` runs it over a sequence.

A step's arithmetic is a compiled kernel (`lstm_step`, `fused_lstm_step`, `gru_step`,
`mgu_step`, `simple_step`) that reads the gates' kernels and biases itself. It runs only where
it is provably the cell's own computation (`DenseCell.uses_compiled_step`: exactly a built-in
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

from .._core.frame import current_frame, require_frame
from .._core.module import Module
from .._core.types import Dtype, Initializer
from .._core.variables import FrozenParam, Parameter
from . import _checks, _dtypes
from .linear import Dense

Carry = Any


def common_parts(
    x_parts: Sequence[jax.Array], h_parts: Sequence[jax.Array]
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The gates' outputs cast to their promotion (Linen's: gates of different dtypes meet there).

    Each gate `Dense` computes in its own dtype (with ``dtype=None``, the promotion of its
    input and variables: a bfloat16 carry and bfloat16 kernels make a bfloat16 hidden gate
    next to a float32 input gate); the update combines them in the promotion. The compiled
    steps and the cell's own call share this, so that both are the same computation.
    """
    common = _dtypes.promote(tuple(jnp.result_type(p) for p in (*x_parts, *h_parts)))
    return [jnp.asarray(p, common) for p in x_parts], [jnp.asarray(p, common) for p in h_parts]


def next_carry_dtype(carry_dtype: Dtype, compute_dtype: Dtype) -> Dtype:
    """The dtype of a carry after a step computed in `compute_dtype`.

    The carry keeps its dtype (bfloat16 gates leave a float32 carry float32), except that a
    complex step makes a real carry complex, as Linen's cells do (its standard promotion);
    dropping the imaginary part would be a silently wrong result.
    """
    if jnp.issubdtype(compute_dtype, jnp.complexfloating) and not jnp.issubdtype(
        carry_dtype, jnp.complexfloating
    ):
        return _dtypes.promote((jnp.dtype(carry_dtype), jnp.dtype(compute_dtype)))
    return carry_dtype


@dataclasses.dataclass(frozen=True)
class StepKernel:
    """A cell's step as a hashable static argument: ``step(weights, carry, x)``."""

    fn: Callable[..., Any]  # lstm_step, gru_step...
    settings: tuple[tuple[str, Any], ...]  # `dtypes` (input's, hidden state's) included
    dtype: Dtype  # the step's: the promotion of the input, the carry and the weights

    def __call__(self, weights: Any, carry: Carry, x: jax.Array) -> tuple[Carry, Any]:
        """One step of the cell: ``(new_carry, y)``."""
        return self.fn(carry, x, weights, **dict(self.settings))


def checked_batch_shape(cls: str, batch_shape: Any) -> tuple[Any, ...]:
    """`batch_shape` of `cls.initialize_carry` as a tuple of dims; `TypeError` if it is none.

    A dim is an int >= 0 or a symbolic one (`jax.export`'s ``b``), kept as it is.
    """
    if _checks.is_dim(batch_shape):
        batch_shape = (batch_shape,)
    try:
        dims = tuple(batch_shape)
    except TypeError:
        dims = None
    if dims is None or not all(_checks.is_dim(d) for d in dims):
        raise TypeError(
            f"{cls}.initialize_carry takes the batch shape (a tuple of non-negative ints, "
            f"without the feature axis), got {batch_shape!r}; e.g. initialize_carry((32,)) "
            f"for inputs of shape (32, in_size)."
        )
    return tuple(_checks.as_dim(d) for d in dims)


def tree_shapes(tree: Any) -> Any:
    """The shapes of the arrays of a carry (a pytree), in its structure."""
    return jax.tree.map(lambda a: tuple(jnp.shape(a)), tree)


def step_dtype(cell: Any, dtype: Dtype, carry: Carry, x: jax.Array, weights: Any) -> Any:
    """The dtype a cell computes a step in: `dtype`, or the promotion of `x`, carry and weights.

    Raises `TypeError`, through `_dtypes.compute_dtype`, for a complex input or variable under
    a real `dtype`. A complex step on a real carry makes the carry complex (`next_carry_dtype`).
    """
    leaves = jax.tree.leaves(carry)
    return _dtypes.compute_dtype(cell, dtype, x, *leaves, *jax.tree.leaves(weights))


def promote_carry(carry: Carry, dtype: Dtype) -> Carry:
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


class DenseCell(Module, abc.ABC):
    """What the cells with `Dense` gates share: settings, gates, the dtype of a step, the call.

    The base of `LSTMCell`, `OptimizedLSTMCell`, `GRUCell`, `MGUCell` and `SimpleCell`.
    """

    # lm.with_policy: the carry this method makes goes in and out of every call, so under
    # a policy it is made in the dtype the calls exchange it in (_core/casting.py).
    _lamina_carry_methods = ("initialize_carry",)

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
        dtype: Dtype,
        param_dtype: Dtype,
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
        shape = (*checked_batch_shape(type(self).__name__, batch_shape), self.hidden_size)
        return jnp.zeros(shape, self.param_dtype)

    @abc.abstractmethod
    def _carry_shapes(self, batch: tuple[int, ...]) -> Any:
        """The carry's shapes (a tree of tuples) for inputs of batch shape `batch`."""

    @abc.abstractmethod
    def _weights(self) -> Any:
        """The arrays the step kernel takes, read from the gate layers."""

    @abc.abstractmethod
    def _kernel(self, dtypes: tuple[Any, Any], dtype: Dtype) -> StepKernel:
        """The jitted step with this cell's settings: gates in `dtypes`, the step's `dtype`."""

    @abc.abstractmethod
    def _biases(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The gates whose input and whose hidden `Dense` have a bias (as Linen's)."""

    @abc.abstractmethod
    def _update(self, carry: Carry, x_parts: list[Any], h_parts: list[Any]) -> Any:
        """The step from the gate layers' outputs (``i<gate>(x)`` and ``h<gate>(h)``)."""

    def _compiled(self, carry: Carry, x: jax.Array) -> tuple[Any, StepKernel]:
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
        dtypes = (_dtypes.promote((jnp.result_type(x), w)), _dtypes.promote((h, w)))
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
        if not is_built_in(self):
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


class HiddenStateCell(DenseCell):
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


BUILT_IN_CELLS: set[type] = set()


def built_in(cls: type) -> type:
    """Registers `cls` as one of lamina's own cell classes (a class decorator).

    Only the registered classes themselves compile their step (`is_built_in`); their
    subclasses, whose `__call__` or `initialize_carry` may differ, never do.
    """
    BUILT_IN_CELLS.add(cls)
    return cls


def is_built_in(cell: Any) -> bool:
    """Whether `cell` is exactly one of lamina's cell classes, not a subclass of one."""
    return type(cell) in BUILT_IN_CELLS


def carry_shapes(cell: Any, batch: tuple[int, ...]) -> Any:
    """The shapes of the carry that `cell` takes for inputs of batch shape `batch`."""
    if is_built_in(cell):  # a subclass may override initialize_carry
        return cell._carry_shapes(batch)
    return tree_shapes(jax.eval_shape(lambda: cell.initialize_carry(batch)))


@functools.cache
def _gate_table(
    gates: tuple[str, ...], biases: tuple[tuple[str, ...], tuple[str, ...]]
) -> tuple[tuple[str, str, bool], ...]:
    """``(attribute, source, has a bias)`` of each gate `Dense` a built-in cell declares."""
    sources = (("i", biases[0]), ("h", biases[1]))
    return tuple((f"{s}{g}", s, g in biased) for s, biased in sources for g in gates)


def is_parameter(
    declaration: Any, shape: tuple[int, ...], dtype: Dtype, param_dtype: Dtype
) -> bool:
    """Whether `declaration` is exactly a `Parameter` (or `FrozenParam`) of `shape` and dtypes.

    Such an array is what a fused path may read in place of calling the layer that holds it.
    """
    return (
        type(declaration) in (Parameter, FrozenParam)
        and declaration.shape == shape
        and declaration.dtype == dtype
        and declaration.param_dtype == param_dtype
    )


def _same_dtype(a: Any, b: Any) -> bool:
    """Whether two dtype settings (None for inferred) are the same."""
    return a is b or (a is not None and b is not None and jnp.dtype(a) == jnp.dtype(b))


def compiled_step(cell: Module, carry: Carry, x: jax.Array) -> tuple[Any, StepKernel] | None:
    """The variables' values and the compiled step of a cell, or None to call the cell.

    Only where the step is provably the cell's own computation (`DenseCell.uses_compiled_step`:
    a built-in cell exactly, with untouched gates, nothing capturing the gates' calls); None
    for every other cell (a subclass, a `LoRA` or other gate, `ConvLSTMCell`, a user's).

    Inside a call: the step is a hashable ``step(weights, carry, x)``, for a compiled function
    to take as a static argument with the weights as an argument; it computes in the dtype the
    cell would for `carry` and `x` (an input of one step, or the whole sequence).
    """
    if isinstance(cell, DenseCell) and cell.uses_compiled_step():
        return cell._compiled(carry, x)
    return None
