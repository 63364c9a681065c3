"""Which keyword arguments `MultiHeadAttention` passes its ``attention_fn``.

lamina's attention functions and Linen-style ones name different keyword arguments;
`accepted_arguments` reads a function's signature to choose the ones it takes,
`call_attention_fn` calls it with them (and refuses a call whose options it would drop; with
fewer key and value heads than query heads, a function other than lamina's
`dot_product_attention` gets the keys and values repeated to ``num_heads``), and
`Sower` is the ``module`` a Linen-style function records its weights with.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._core.rng import next_rng_key
from ..records.sow import sow
from .attention import dot_product_attention

# The keyword arguments MultiHeadAttention offers its attention_fn: lamina's names and Linen's.
_OFFERED = frozenset(
    (
        "mask",
        "dropout_rng",
        "dropout_rate",
        "broadcast_dropout",
        "is_training",
        "deterministic",
        "dtype",
        "precision",
        "force_fp32_for_softmax",
        "sow_weights",
        "module",
    )
)


def accepted_arguments(where: str, fn: Callable[..., Any]) -> frozenset[str]:
    """The keyword arguments of `_OFFERED` that `fn`'s signature names.

    As Linen's ``MultiHeadDotProductAttention``, only named parameters count: a ``**kwargs``
    receives nothing, so a Linen-style function never gets lamina's names (and vice versa).
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: attention_fn={function_name(fn)} has no signature that inspect can read, so "
            f"the keyword arguments to pass it cannot be chosen. Wrap it in a def naming them, "
            f"e.g. def attention(query, key, value, mask=None): ..."
        ) from None
    return _OFFERED & {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def function_name(fn: Any) -> str:
    """How messages name an ``attention_fn``: its qualified name, or its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)


class Sower:
    """The ``module`` a Linen-style attention_fn gets with ``sow_weights=True``.

    Linen's attention functions record with ``module.sow(collection, name, value)``; this
    records with `lm.sow` under the path of the `MultiHeadAttention` that called them.
    """

    def sow(
        self, collection: str, name: str, value: Any, reduce_fn: Any = None, init_fn: Any = None
    ) -> bool:
        """Records `value` with `lm.sow` (Linen's ``Module.sow``): whether it was recorded."""
        options = {"reduce_fn": reduce_fn, "init_fn": init_fn}
        return sow(name, value, collection=collection, **{k: f for k, f in options.items() if f})


def call_attention_fn(
    layer: Any,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    is_training: bool,
    dropout_rng: Any,
    sow_weights: bool,
) -> jax.Array:
    """Calls `attention_fn` with the keyword arguments it names (see `accepted_arguments`)."""
    training = is_training and layer.dropout_rate > 0.0
    if training and dropout_rng is None:
        dropout_rng = next_rng_key("dropout")
    offered = {
        "mask": mask,
        "dropout_rng": dropout_rng if training else None,
        # Not training, the rate does not matter: 0.0 lets layers that differ only in
        # their rate share one compiled program.
        "dropout_rate": layer.dropout_rate if training else 0.0,
        "broadcast_dropout": layer.broadcast_dropout,
        "is_training": training,
        "deterministic": not training,
        "dtype": layer.dtype,
        "precision": layer.precision,
        "force_fp32_for_softmax": layer.force_fp32_for_softmax,
        "sow_weights": sow_weights,
        "module": Sower() if sow_weights else None,
    }
    accepted = accepted_arguments(type(layer).__name__, layer.attention_fn)
    needed = (
        (mask is not None, ("mask",), "a mask (mask=, causal=True or decode=True)"),
        (training, ("dropout_rng",), "dropout (is_training=True and a dropout_rate)"),
        (training, ("dropout_rate",), "dropout (is_training=True and a dropout_rate)"),
        (training, ("is_training", "deterministic"), "dropout (is_training=True)"),
        (sow_weights, ("sow_weights", "module"), "sow_weights=True"),
    )
    for used, names, what in needed:
        if used and not accepted & set(names):
            raise TypeError(
                f"{type(layer).__name__}: this call has {what}, but attention_fn="
                f"{function_name(layer.attention_fn)} takes no {' or '.join(names)} argument, "
                f"so it would be dropped. Give the function that parameter (as "
                f"lm.dot_product_attention has), or leave the option out."
            )
    kwargs = {k: v for k, v in offered.items() if k in accepted}
    if key.shape[-2] != query.shape[-2] and layer.attention_fn is not dot_product_attention:
        # Grouped-query heads: lamina's function groups the queries (no copy); another one
        # (Linen's, the user's) gets the keys and values repeated to num_heads, as HF's
        # repeat_kv (key head k serves query heads k * groups ... (k + 1) * groups - 1).
        groups = query.shape[-2] // key.shape[-2]
        key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
    return layer.attention_fn(query, key, value, **kwargs)
