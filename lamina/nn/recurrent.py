"""`RNN`: runs a recurrent cell over the time axis of a sequence (`jax.lax.scan`), as Linen's.

No lifted transform is involved and nothing is written inside the loop. Where the compiled
step is provably the cell's own computation (`cells.compiled_step`: exactly `LSTMCell`,
`OptimizedLSTMCell`, `GRUCell`, `MGUCell` or `SimpleCell`, its gates untouched `Dense`
layers, nothing capturing module outputs), `RNN` reads the cell's variables once and passes
them to one compiled function, `rnn_scan` (so an eager call compiles once per configuration,
not once per call). Every other cell (a subclass, a cell with a `LoRA` or otherwise replaced
gate, `ConvLSTMCell`, a user's) has its own `__call__` called inside the scan body, which
closes over the arrays that the active `apply` call has bound to the cell's variables; what
it records (`lm.sow`, `lm.perturb`, `lm.capture_intermediates`) comes out with a leading
axis of the steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.frame import require_frame
from .._core.module import Module
from . import _checks
from .cells import Carry, DenseCell, carry_shapes, compiled_step, promote_carry, tree_shapes


@functools.partial(jax.jit, static_argnames=("num_batch_dims", "time_major"))
def flip_sequences(
    inputs: jax.Array, seq_lengths: jax.Array | None, num_batch_dims: int, time_major: bool
) -> jax.Array:
    """Reverses each sequence along the time axis, keeping padding at the end (as Linen's).

    Without `seq_lengths` the whole time axis is reversed. With them, the first
    ``seq_lengths[b]`` steps of sequence ``b`` are reversed and the padding after them stays
    where it is (it is permuted among itself), which is what a backward RNN over padded
    sequences needs.

    Args:
        inputs: ``(*batch, time, ...)``, or ``(time, *batch, ...)`` when `time_major`.
        seq_lengths: Integer lengths of shape ``batch``, or None.
        num_batch_dims: The number of batch axes.
        time_major: Whether the time axis comes first.

    Returns:
        An array of the shape of `inputs`.

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina.nn.recurrent import flip_sequences
        >>> x = jnp.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]])
        >>> flip_sequences(x, jnp.array([1, 2, 3]), num_batch_dims=1, time_major=False)
        Array([[1, 0, 0],
               [3, 2, 0],
               [6, 5, 4]], dtype=int32)
    """
    time_axis = 0 if time_major else num_batch_dims
    if seq_lengths is None:
        return jnp.flip(inputs, axis=time_axis)
    steps = inputs.shape[time_axis]
    lengths = jnp.expand_dims(jnp.asarray(seq_lengths, jnp.int32), time_axis)
    idxs = jnp.arange(steps - 1, -1, -1, dtype=jnp.int32)
    if time_major:
        idxs = jnp.reshape(idxs, (steps,) + (1,) * num_batch_dims)
    else:
        idxs = jnp.reshape(idxs, (1,) * num_batch_dims + (steps,))
    idxs = (idxs + lengths) % steps
    idxs = jnp.reshape(idxs, idxs.shape + (1,) * (inputs.ndim - idxs.ndim))
    return jnp.take_along_axis(inputs, idxs, axis=time_axis)


@jax.jit
def _select_carry(valid: jax.Array, new: Carry, old: Carry) -> Carry:
    """``new`` where `valid` (of the batch shape), else ``old``, for every leaf of a carry."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        mask = jnp.reshape(valid, valid.shape + (1,) * (a.ndim - valid.ndim))
        return jnp.where(mask, a, b)

    return jax.tree.map(pick, new, old)


def _scan_sequence(
    step: Callable[[Carry, jax.Array, jax.Array], tuple[Carry, Any]],
    carry: Carry,
    inputs: jax.Array,
    seq_lengths: jax.Array | None,
    *,
    time_major: bool,
    reverse: bool,
    keep_order: bool,
    return_carry: bool,
    unroll: int | bool,
    feature_axes: int,
    extras: bool = False,
) -> tuple[Carry, Any]:
    """Linen's `RNN` over ``step(carry, x, t)``: returns ``(final_carry, outputs)``.

    With `extras`, the step returns ``(carry, (y, extra))`` and the outputs are ``(outputs,
    extras)``, the extras stacked over the steps in the order they ran (axis 0).
    """
    time_axis = 0 if time_major else inputs.ndim - feature_axes - 1
    num_batch_dims = inputs.ndim - feature_axes - 1
    if seq_lengths is not None:
        seq_lengths = seq_lengths.astype(jnp.int32)
    if reverse:
        inputs = flip_sequences(inputs, seq_lengths, num_batch_dims, time_major)
    xs = jnp.moveaxis(inputs, time_axis, 0)
    steps = jnp.arange(xs.shape[0], dtype=jnp.int32)
    if seq_lengths is not None and return_carry:
        # Keep the running carry (so the outputs are Linen's, padding steps included) and,
        # beside it, the carry after each sequence's last valid step.
        def masked_step(state: Any, x_t: Any) -> Any:
            (run, last), (x, t) = state, x_t
            run, y = step(run, x, t)
            return (run, _select_carry(t < seq_lengths, run, last)), y

        (_, carry), ys = lax.scan(masked_step, (carry, carry), (xs, steps), unroll=unroll)
    else:
        carry, ys = lax.scan(lambda c, x_t: step(c, *x_t), carry, (xs, steps), unroll=unroll)
    ys, stacked = ys if extras else (ys, None)
    outputs = jax.tree.map(lambda y: jnp.moveaxis(y, 0, time_axis), ys)
    if reverse and keep_order:
        outputs = jax.tree.map(
            lambda y: flip_sequences(y, seq_lengths, num_batch_dims, time_major), outputs
        )
    return carry, ((outputs, stacked) if extras else outputs)


@functools.partial(
    jax.jit,
    static_argnames=("kernel", "time_major", "reverse", "keep_order", "return_carry", "unroll"),
)
def rnn_scan(
    weights: Any,
    carry: Carry,
    inputs: jax.Array,
    seq_lengths: jax.Array | None,
    kernel: Callable[[Any, Carry, jax.Array], tuple[Carry, Any]],
    time_major: bool,
    reverse: bool,
    keep_order: bool,
    return_carry: bool,
    unroll: int | bool,
) -> tuple[Carry, Any]:
    """Runs ``kernel(weights, carry, x)`` over the time axis of `inputs`, as Linen's `RNN`.

    Returns ``(final_carry, outputs)``; the final carry is the one after each sequence's
    last valid step when `seq_lengths` and `return_carry` are given (else after the last
    step). One compiled function: `RNN` calls it for the cells of `cells.py`.
    """

    def step(state: Carry, x: jax.Array, t: jax.Array) -> tuple[Carry, Any]:
        del t
        return kernel(weights, state, x)

    return _scan_sequence(
        step,
        carry,
        inputs,
        seq_lengths,
        time_major=time_major,
        reverse=reverse,
        keep_order=keep_order,
        return_carry=return_carry,
        unroll=unroll,
        feature_axes=1,
    )


class RNN(Module):
    """Runs a cell over the time axis of a sequence (`jax.lax.scan`), as Flax Linen's `RNN`.

    ``rnn(inputs)`` takes inputs of shape ``(*batch, time, in_size)`` (``(time, *batch,
    in_size)`` when `time_major`) and returns the cell's outputs, ``(*batch, time,
    hidden_size)``, or ``(final_carry, outputs)`` when `return_carry`. The cell's variables
    live under ``cell``, as in Linen, and are shared by all time steps.

    Variable-length sequences: with ``seq_lengths`` (integers of the batch shape, each in
    ``[0, time]``), steps at or after ``seq_lengths[b]`` are padding. The lengths are checked
    when their values are known (eager calls); under `jax.jit` they are traced and cannot be
    checked, so check them before the jitted step. The returned carry is the one after each
    sequence's last valid step (the initial carry for a length of 0). As in Linen, outputs at
    padding steps are not zeroed: the cell keeps running over the padding and its outputs
    there are meaningless. With `reverse`, each sequence is reversed within its length and the
    padding stays at the end (see `flip_sequences`).

    Args:
        cell: The cell to run: `LSTMCell`, `GRUCell`, or any `Module` with the same protocol
            (``cell(carry, x) -> (carry, y)`` and ``cell.initialize_carry(batch_shape)``).
        time_major: Whether the time axis comes first, ``(time, *batch, features)``.
        reverse: Process each sequence from its end to its start. The outputs come out in
            processing order (reversed) unless `keep_order`.
        keep_order: With `reverse`, put the outputs back in the inputs' time order (what a
            bidirectional RNN needs). Ignored without `reverse`, as in Linen.
        return_carry: Return ``(final_carry, outputs)`` instead of the outputs alone.
        unroll: Scan iterations unrolled into one loop iteration (`jax.lax.scan`'s `unroll`).

    Records: what the cell records with `lm.sow` (or `lm.perturb`, or what
    `lm.capture_intermediates` captures inside it) at each step comes out under the cell's
    path with a leading axis of the steps, in the order the cell ran them (reversed with
    `reverse`), as `lm.scan`'s records do; given entries under the cell's path go in with
    that axis. (Linen's `RNN` needs ``variable_axes={"intermediates": 1}`` for that.)

    Dtypes: with a cell of ``dtype=None``, a complex input makes the carry complex from the
    first step (the cells' promotion, as Linen's cells; Linen's `RNN` fails there).

    As in Linen, a call can override `time_major`, `reverse`, `keep_order` and `return_carry`
    (``rnn(x, reverse=True, keep_order=True)``: what `Bidirectional` does with its backward
    RNN).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.RNN(lm.LSTMCell(3, 8), return_carry=True))
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]["cell"])
        ['hf', 'hg', 'hi', 'ho', 'if', 'ig', 'ii', 'io']
        >>> x = jnp.ones((2, 5, 3))  # (batch, time, features)
        >>> ((c, h), y), _ = apply(variables, None, x, seq_lengths=jnp.array([5, 2]))
        >>> h.shape, y.shape
        ((2, 8), (2, 5, 8))
        >>> bool(jnp.all(h[1] == y[1, 1]))  # the carry after the last valid step
        True
    """

    time_major = _checks.Setting()
    reverse = _checks.Setting()
    keep_order = _checks.Setting()
    return_carry = _checks.Setting()
    unroll = _checks.Setting()

    def __init__(
        self,
        cell: Module,
        *,
        time_major: bool = False,
        reverse: bool = False,
        keep_order: bool = False,
        return_carry: bool = False,
        unroll: int | bool = 1,
    ):
        super().__init__()
        where = type(self).__name__
        if not isinstance(cell, Module) or not callable(getattr(cell, "initialize_carry", None)):
            raise TypeError(
                f"{where}'s cell must be a cell module such as LSTMCell(in_size, hidden_size): "
                f"a Module with __call__(carry, x) and initialize_carry(batch_shape); got "
                f"{type(cell).__name__}."
            )
        if not (isinstance(unroll, bool) or (_checks.is_int(unroll) and unroll >= 1)):
            error = ValueError if _checks.is_int(unroll) else _checks.SettingTypeError
            raise error(
                f"{where}: unroll must be a positive int (or True to unroll the whole loop), "
                f"got {unroll!r}."
            )
        self.cell = cell
        self.time_major = _checks.flag(where, "time_major", time_major)
        self.reverse = _checks.flag(where, "reverse", reverse)
        self.keep_order = _checks.flag(where, "keep_order", keep_order)
        self.return_carry = _checks.flag(where, "return_carry", return_carry)
        self.unroll = unroll if isinstance(unroll, bool) else int(unroll)

    def __call__(
        self,
        inputs: jax.Array,
        initial_carry: Carry | None = None,
        seq_lengths: jax.Array | None = None,
        *,
        return_carry: bool | None = None,
        time_major: bool | None = None,
        reverse: bool | None = None,
        keep_order: bool | None = None,
    ) -> Any:
        """Runs the cell over `inputs`.

        Args:
            inputs: ``(*batch, time, *features)``, or ``(time, *batch, *features)`` when
                `time_major`; the cell's feature axes are last (one for LSTM and GRU cells,
                the spatial axes and the channels for `ConvLSTMCell`).
            initial_carry: The carry before the first step (default:
                ``cell.initialize_carry(shape)``, zeros, with ``shape`` the shape of one
                step's input without its last axis).
            seq_lengths: Integer lengths of shape ``batch``, each in ``[0, time]``; see the
                class docstring. They are checked when their values are known (eager
                calls); under `jax.jit` they are traced and cannot be checked.
            return_carry: Overrides the layer's `return_carry` for this call (as Linen's).
            time_major: Overrides the layer's `time_major` for this call.
            reverse: Overrides the layer's `reverse` for this call.
            keep_order: Overrides the layer's `keep_order` for this call.

        Returns:
            The outputs, with the time axis where the inputs have it; with `return_carry`,
            ``(final_carry, outputs)``.
        """
        settings = self._call_settings(return_carry, time_major, reverse, keep_order)
        time_major = settings["time_major"]
        cell: Any = self.cell  # any module with the cell protocol
        inputs = jnp.asarray(inputs)
        feature_axes, time_axis = self._check_inputs(inputs, time_major)
        shape = tuple(inputs.shape)
        batch = shape[1 : inputs.ndim - feature_axes] if time_major else shape[:time_axis]
        # The carry's shape: one step's input without its last axis (the batch, and the
        # spatial axes of a convolutional cell).
        carry_batch = (shape[:time_axis] + shape[time_axis + 1 :])[:-1]
        if seq_lengths is not None:
            seq_lengths = _checked_seq_lengths(seq_lengths, shape, batch, time_axis, time_major)
        carry = self._initial_carry(initial_carry, carry_batch, shape, batch, time_major)

        compiled = compiled_step(cell, carry, inputs)
        if compiled is not None:
            weights, kernel = compiled
            carry = promote_carry(carry, kernel.dtype)
            carry, outputs = rnn_scan(weights, carry, inputs, seq_lengths, kernel, **settings)
        else:
            if isinstance(cell, DenseCell):
                carry = promote_carry(carry, cell.scan_dtype(carry, inputs))
            carry, outputs = self._scan_cell(
                cell, carry, inputs, seq_lengths, feature_axes, settings
            )
        return (carry, outputs) if settings["return_carry"] else outputs

    def _call_settings(
        self,
        return_carry: bool | None,
        time_major: bool | None,
        reverse: bool | None,
        keep_order: bool | None,
    ) -> dict[str, Any]:
        """The layer's settings of the scan, with this call's overrides (checked) applied."""
        where = f"{type(self).__name__}.__call__"
        overrides = {"return_carry": return_carry, "time_major": time_major}
        overrides |= {"reverse": reverse, "keep_order": keep_order}
        chosen = {k: v for k, v in overrides.items() if v is not None}
        _checks.static_flags(where, **chosen)
        return {
            "time_major": self.time_major,
            "reverse": self.reverse,
            "keep_order": self.keep_order,
            "return_carry": self.return_carry,
            "unroll": self.unroll,
        } | chosen

    def _check_inputs(self, inputs: jax.Array, time_major: bool) -> tuple[int, int]:
        """Checks the inputs' rank and size for the cell: ``(feature_axes, time_axis)``."""
        cell: Any = self.cell
        shape = tuple(inputs.shape)
        feature_axes = getattr(cell, "num_feature_axes", 1)
        layout = "(time, *batch, *features)" if time_major else "(*batch, time, *features)"
        if inputs.ndim < feature_axes + 1:
            raise ValueError(
                f"RNN(time_major={time_major}) expects inputs of shape {layout}, with at "
                f"least {feature_axes + 1} axes (time and {feature_axes} feature axis), got "
                f"shape {shape}. For one sequence of scalars add a feature axis: x[..., None]."
            )
        in_size = getattr(cell, "in_size", None)
        if in_size is not None:
            cell_name = f"RNN({type(cell).__name__}(in_size={in_size}))"
            _checks.check_last_axis(cell_name, inputs, in_size, "in_size", what="inputs")
        return feature_axes, 0 if time_major else inputs.ndim - feature_axes - 1

    def _initial_carry(
        self,
        initial_carry: Carry | None,
        carry_batch: tuple[int, ...],
        shape: tuple[int, ...],
        batch: tuple[int, ...],
        time_major: bool,
    ) -> Carry:
        """`initial_carry` checked against the cell's carry, or the cell's zero carry."""
        cell: Any = self.cell
        if initial_carry is None:
            return cell.initialize_carry(carry_batch)
        carry = initial_carry
        expected = carry_shapes(cell, carry_batch)
        got = tree_shapes(carry)
        if got != expected:
            raise ValueError(
                f"RNN got an initial_carry of shapes {got}, but its cell "
                f"{type(cell).__name__} needs a carry of shapes {expected} for inputs of "
                f"shape {shape} (batch shape {batch}, time_major={time_major}). "
                f"Create one with rnn.cell.initialize_carry({carry_batch})."
            )
        return carry

    def _scan_cell(
        self,
        cell: Any,
        carry: Carry,
        inputs: jax.Array,
        seq_lengths: jax.Array | None,
        feature_axes: int,
        settings: dict[str, Any],
    ) -> tuple[Carry, Any]:
        """Calls the cell at every step (the general path), its records carried through.

        Each step runs in a frame of its own, so the cell's keys differ per time step. What
        the cell records (`lm.sow`, `lm.perturb`, `lm.capture_intermediates`) comes out with
        a leading axis of the steps, in the order the cell ran them; given entries under the
        cell's path go in with that axis, others as they are.
        """
        frame = require_frame(f"{type(self).__name__}.__call__")
        inside = f"RNN's cell {type(cell).__name__}"
        frame_for = frame.iterations(inside)
        outer = frame.records
        mapped: dict[str, dict[tuple, Any]] = {}
        shared: dict[str, dict[tuple, Any]] = {}
        if outer is not None:
            path = frame.plan.module_paths()[id(cell)]
            for collection, entries in outer.given.items():
                mapped[collection], shared[collection] = {}, {}
                for key, value in entries.items():
                    target = mapped if key[: len(path)] == path else shared
                    target[collection][key] = value
        inner: list[Any] = []

        # A fresh function per call: `lax.scan` caches its trace (constants included, and
        # the cell's values are constants of the body) by the identity of the function.
        def step(state: Carry, x: jax.Array, t: jax.Array) -> tuple[Carry, Any]:
            with frame_for(t) as step_frame:
                if outer is None:
                    return cell(state, x)
                given = {c: dict(entries) for c, entries in shared.items()}
                for collection, entries in mapped.items():
                    for key, value in entries.items():
                        given[collection][key] = jax.tree.map(lambda a: a[t], value)
                step_frame.records = records = outer.nested(given)
                inner[:] = [records]
                new_state, y = cell(state, x)
                return new_state, (y, records.out)

        carry, outputs = _scan_sequence(
            step,
            carry,
            inputs,
            seq_lengths,
            feature_axes=feature_axes,
            extras=outer is not None,
            **settings,
        )
        if outer is not None:
            outputs, produced = outputs
            outer.absorb(inner[0], produced, inside)
        return carry, outputs


def _checked_seq_lengths(
    seq_lengths: Any,
    shape: tuple[int, ...],
    batch: tuple[int, ...],
    time_axis: int,
    time_major: bool,
) -> jax.Array:
    """`seq_lengths` as an integer array of the batch shape, in ``[0, time]`` when concrete."""
    seq_lengths = jnp.asarray(seq_lengths)
    if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
        raise TypeError(
            f"RNN's seq_lengths must be integers, got dtype {seq_lengths.dtype}; "
            f"convert with seq_lengths.astype(jnp.int32)."
        )
    if tuple(seq_lengths.shape) != batch:
        raise ValueError(
            f"RNN's seq_lengths must have the batch shape {batch} of inputs of shape "
            f"{shape} (time_major={time_major}), one length per sequence; got "
            f"shape {tuple(seq_lengths.shape)}."
        )
    time = shape[time_axis]
    if _checks.is_concrete(seq_lengths) and seq_lengths.size:
        values = np.asarray(seq_lengths)  # not a jax op: no tracer under an outer jit
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > time:
            raise ValueError(
                f"RNN's seq_lengths must be in [0, {time}] (the inputs' time axis has "
                f"{time} steps, shape {shape}, time_major={time_major}); got "
                f"{low if low < 0 else high}. A length counts the valid steps at the "
                f"start of a sequence."
            )
    return seq_lengths
