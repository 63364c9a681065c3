"""`Bidirectional`: two recurrent layers over a sequence, one each way, merged (Linen's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._core.module import Module
from . import _checks
from .cells import Carry


@jax.jit
def concatenate(forward: jax.Array, backward: jax.Array) -> jax.Array:
    """Joins the two directions' outputs on the last axis (`Bidirectional`'s default merge)."""
    return jnp.concatenate([forward, backward], axis=-1)


class Bidirectional(Module):
    """Runs one RNN forward and one backward over a sequence and merges their outputs (Linen's).

    ``Bidirectional(forward_rnn, backward_rnn)(inputs)`` runs ``forward_rnn`` over `inputs` as
    they are and ``backward_rnn`` from the end of each sequence to its start, puts the
    backward outputs back in the inputs' time order, and returns
    ``merge_fn(forward_outputs, backward_outputs)`` (by default concatenated on the feature
    axis: ``(*batch, time, 2 * hidden_size)`` for two cells of `hidden_size`). With
    `seq_lengths`, the backward RNN reverses only each sequence's valid part and the padding
    stays at the end (see `RNN`), so its first output at step ``t`` has seen steps ``t`` to
    ``seq_lengths[b] - 1``. Variables are Linen's: ``forward_rnn/...`` and
    ``backward_rnn/...``; passing the same RNN twice shares its variables.

    Args:
        forward_rnn: An `RNN` (or a module with its call: ``rnn(inputs, initial_carry,
            seq_lengths, return_carry=, time_major=, reverse=, keep_order=)``).
        backward_rnn: The same for the backward direction; it is called with
            ``reverse=True, keep_order=True`` whatever its own settings.
        merge_fn: ``merge_fn(forward, backward)`` for each pair of output leaves (default:
            `concatenate`, on the last axis).
        time_major: Whether inputs are ``(time, *batch, *features)``; passed to both RNNs.
        return_carry: Return ``((forward_carry, backward_carry), outputs)``.

    Everything after `backward_rnn` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.Bidirectional(lm.RNN(lm.GRUCell(3, 4)), lm.RNN(lm.GRUCell(3, 4)))
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"])
        ['backward_rnn', 'forward_rnn']
        >>> y, _ = apply(variables, None, jnp.ones((2, 5, 3)), seq_lengths=jnp.array([5, 3]))
        >>> y.shape
        (2, 5, 8)
    """

    merge_fn = _checks.Setting()
    time_major = _checks.Setting()
    return_carry = _checks.Setting()

    def __init__(
        self,
        forward_rnn: Module,
        backward_rnn: Module,
        *,
        merge_fn: Callable[[jax.Array, jax.Array], jax.Array] = concatenate,
        time_major: bool = False,
        return_carry: bool = False,
    ):
        super().__init__()
        where = type(self).__name__
        for name, rnn in (("forward_rnn", forward_rnn), ("backward_rnn", backward_rnn)):
            if not isinstance(rnn, Module):
                raise TypeError(
                    f"{where}'s {name} must be a recurrent layer such as "
                    f"lm.RNN(lm.LSTMCell(in_size, hidden_size)), got {type(rnn).__name__}. "
                    f"Wrap a cell in lm.RNN."
                )
            if callable(getattr(rnn, "initialize_carry", None)):
                raise TypeError(
                    f"{where}'s {name} must be a recurrent layer over sequences, got the cell "
                    f"{type(rnn).__name__}, which computes one step. Wrap it: "
                    f"lm.RNN({type(rnn).__name__}(...))."
                )
        self.forward_rnn = forward_rnn
        self.backward_rnn = backward_rnn
        self.merge_fn = _checks.function(where, "merge_fn", merge_fn, "jnp.add")
        self.time_major = _checks.flag(where, "time_major", time_major)
        self.return_carry = _checks.flag(where, "return_carry", return_carry)

    def __call__(
        self,
        inputs: jax.Array,
        initial_carry: tuple[Carry, Carry] | None = None,
        seq_lengths: jax.Array | None = None,
        *,
        return_carry: bool | None = None,
        time_major: bool | None = None,
    ) -> Any:
        """Runs both RNNs over `inputs` and merges their outputs.

        Args:
            inputs: ``(*batch, time, *features)``, or ``(time, *batch, *features)`` when
                `time_major`.
            initial_carry: ``(forward_carry, backward_carry)``, or None for each RNN's zeros.
            seq_lengths: Integer lengths of shape ``batch`` (see `RNN`).
            return_carry: Overrides the layer's `return_carry` for this call (as Linen's).
            time_major: Overrides the layer's `time_major` for this call.

        Returns:
            The merged outputs; with `return_carry`, ``((forward_carry, backward_carry),
            outputs)``, each carry the one after its RNN's last valid step.
        """
        where = f"{type(self).__name__}.__call__"
        chosen = {"return_carry": return_carry, "time_major": time_major}
        _checks.static_flags(where, **{k: v for k, v in chosen.items() if v is not None})
        time_major = self.time_major if time_major is None else time_major
        return_carry = self.return_carry if return_carry is None else return_carry
        if initial_carry is None:
            carry_forward = carry_backward = None
        elif isinstance(initial_carry, tuple) and len(initial_carry) == 2:
            carry_forward, carry_backward = initial_carry
        else:
            raise TypeError(
                f"{where}: initial_carry must be a tuple (forward_carry, backward_carry), one "
                f"carry per direction, got {type(initial_carry).__name__}."
            )
        forward: Any = self.forward_rnn
        backward: Any = self.backward_rnn
        carry_forward, outputs_forward = forward(
            inputs,
            carry_forward,
            seq_lengths,
            return_carry=True,
            time_major=time_major,
            reverse=False,
        )
        carry_backward, outputs_backward = backward(
            inputs,
            carry_backward,
            seq_lengths,
            return_carry=True,
            time_major=time_major,
            reverse=True,
            keep_order=True,
        )
        outputs = jax.tree.map(self.merge_fn, outputs_forward, outputs_backward)
        carry = (carry_forward, carry_backward)
        return (carry, outputs) if return_carry else outputs
