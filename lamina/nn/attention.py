"""Attention functions: `dot_product_attention`, its weights, and the masks it takes.

The numerics and layouts are Flax Linen's (`dot_product_attention`,
`dot_product_attention_weights`, `make_attention_mask`, `make_causal_mask`, `combine_masks`).
`MultiHeadAttention` projects its inputs to heads and calls `dot_product_attention` (its
default ``attention_fn``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._core.rng import is_key, next_rng_key
from .._core.types import Dtype, PrecisionLike
from ..records.sow import sow
from . import _checks, _dtypes

__all__ = [
    "combine_masks",
    "dot_product_attention",
    "dot_product_attention_weights",
    "make_attention_mask",
    "make_causal_mask",
]


def _weights(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dropout_rng: jax.Array | None,
    dropout_rate: float,
    broadcast_dropout: bool,
    dtype: Dtype,
    precision: PrecisionLike,
    force_fp32_for_softmax: bool,
) -> tuple[jax.Array, jax.Array]:
    """Linen's ``dot_product_attention_weights``: the weights, and the weights after dropout.

    Every operand is cast to `dtype`; dropout only when `dropout_rng` is given.
    """
    query, key = jnp.asarray(query, dtype), jnp.asarray(key, dtype)
    depth = query.shape[-1]
    query = query / jnp.sqrt(jnp.asarray(depth, jnp.float32)).astype(dtype)
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if heads == kv_heads:
        weights = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    else:  # grouped: query head h attends with key head h // (heads // kv_heads), no copy
        grouped = query.reshape(*query.shape[:-2], kv_heads, heads // kv_heads, depth)
        weights = jnp.einsum("...qhgd,...khd->...hgqk", grouped, key, precision=precision)
        weights = weights.reshape(*weights.shape[:-4], heads, *weights.shape[-2:])
    if bias is not None:
        weights = weights + jnp.broadcast_to(jnp.asarray(bias, dtype), weights.shape)
    if mask is not None:
        mask = jnp.broadcast_to(mask, weights.shape)
        weights = jnp.where(mask, weights, jnp.asarray(jnp.finfo(dtype).min, dtype))
    if force_fp32_for_softmax and dtype != jnp.float32:
        weights = jax.nn.softmax(weights.astype(jnp.float32))
    else:
        weights = jax.nn.softmax(weights).astype(dtype)
    dropped = weights
    if dropout_rng is not None and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        if broadcast_dropout:  # one mask for every batch element and head, as Linen
            shape = (1,) * (key.ndim - 2) + weights.shape[-2:]
        else:
            shape = weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
        dropped = weights * multiplier.astype(weights.dtype)
    return weights, dropped


_STATIC = (
    "dropout_rate",
    "broadcast_dropout",
    "dtype",
    "precision",
    "force_fp32_for_softmax",
    "with_weights",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def weights_kernel(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dropout_rng: jax.Array | None,
    dropout_rate: float,
    broadcast_dropout: bool,
    dtype: Dtype,
    precision: PrecisionLike,
    force_fp32_for_softmax: bool,
    with_weights: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """The weights after dropout, and (`with_weights`) before it, for `lm.sow`."""
    weights, dropped = _weights(
        query,
        key,
        bias,
        mask,
        dropout_rng,
        dropout_rate,
        broadcast_dropout,
        dtype,
        precision,
        force_fp32_for_softmax,
    )
    return dropped, weights if with_weights else None


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_kernel(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dropout_rng: jax.Array | None,
    dropout_rate: float,
    broadcast_dropout: bool,
    dtype: Dtype,
    precision: PrecisionLike,
    force_fp32_for_softmax: bool,
    with_weights: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Linen's ``dot_product_attention``, and (`with_weights`) the weights before dropout."""
    weights, dropped = _weights(
        query,
        key,
        bias,
        mask,
        dropout_rng,
        dropout_rate,
        broadcast_dropout,
        dtype,
        precision,
        force_fp32_for_softmax,
    )
    # With force_fp32_for_softmax the weights stay float32 and so does the product (Linen's
    # promotion); MultiHeadAttention's output projection casts back to its compute dtype.
    value = jnp.asarray(value, dtype).astype(dropped.dtype)
    heads, kv_heads = query.shape[-2], value.shape[-2]
    if heads == kv_heads:
        out = jnp.einsum("...hqk,...khd->...qhd", dropped, value, precision=precision)
    else:  # grouped: the weights of kv_heads groups of heads // kv_heads heads each
        *batch, _, q_len, kv_len = dropped.shape
        grouped = dropped.reshape(*batch, kv_heads, heads // kv_heads, q_len, kv_len)
        out = jnp.einsum("...hgqk,...khd->...qhgd", grouped, value, precision=precision)
        out = out.reshape(*out.shape[:-3], heads, out.shape[-1])
    return out, weights if with_weights else None


@functools.partial(jax.jit, static_argnames=("pairwise_fn", "extra_batch_dims", "dtype"))
def _attention_mask(
    query_input: jax.Array,
    key_input: jax.Array,
    pairwise_fn: Callable[..., Any],
    extra_batch_dims: int,
    dtype: Dtype,
) -> jax.Array:
    mask = pairwise_fn(jnp.expand_dims(query_input, axis=-1), jnp.expand_dims(key_input, axis=-2))
    mask = jnp.expand_dims(mask, axis=-3)
    mask = jnp.expand_dims(mask, axis=tuple(range(extra_batch_dims)))
    return mask.astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _combine_masks(masks: tuple[jax.Array, ...], dtype: Dtype) -> jax.Array:
    mask = masks[0]
    for other in masks[1:]:
        mask = jnp.logical_and(mask, other)
    return mask.astype(dtype)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    is_training: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    broadcast_dropout: bool = True,
    dtype: Dtype = None,
    precision: PrecisionLike = None,
    force_fp32_for_softmax: bool = False,
    sow_weights: bool = False,
) -> jax.Array:
    """Scaled dot-product attention of heads already projected (Flax Linen's numerics).

    ``softmax(query @ key / sqrt(depth) + bias, masked) @ value`` per head: attention weights
    of shape ``(batch..., heads, q_length, kv_length)``, where the mask is False (zero) are
    set to the dtype's lowest value before the softmax. It is `MultiHeadAttention`'s default
    ``attention_fn``.

    Args:
        query: ``(batch..., q_length, num_heads, depth)``.
        key: ``(batch..., kv_length, num_kv_heads, depth)``: ``num_kv_heads`` is
            ``num_heads`` (multi-head attention) or divides it (grouped-query attention;
            multi-query with 1): query head ``h`` attends with key and value head ``h //
            (num_heads // num_kv_heads)``, as Hugging Face's ``repeat_kv``, without copying
            the keys and values.
        value: ``(batch..., kv_length, num_kv_heads, v_depth)``.
        mask: A boolean array broadcastable to ``(batch..., num_heads, q_length,
            kv_length)``; attention is kept where it is True (`make_attention_mask`,
            `make_causal_mask`). Only bool masks are accepted: a 0/1 mask of numbers is
            ``mask.astype(bool)``, and an additive mask (0 keeps, -inf drops) is a `bias`.
        bias: Added to the attention logits; broadcastable like `mask`.
        is_training: Apply dropout to the attention weights (a Python bool).
        dropout_rate: Probability of dropping an attention weight, in ``[0, 1)``.
        dropout_rng: Key for dropout; default ``lm.next_rng_key("dropout")`` (inside a call).
        broadcast_dropout: One dropout mask for all batch elements and heads (Linen's default).
        dtype: Compute dtype (every operand is cast to it); None (the default) infers it from
            `query`, `key` and `value`, as Linen's ``promote_dtype``: bfloat16 stays bfloat16,
            complex stays complex.
        precision: `jax.lax.Precision` of the two products.
        force_fp32_for_softmax: Compute the softmax (and the weighted sum) in float32 when
            `dtype` is lower, as Linen; the result is then float32.
        sow_weights: Record the attention weights (before dropout) with
            ``lm.sow("attention_weights", weights)`` under the calling module's path, as
            Linen's ``module=``; they are kept when the caller of `apply` asks for
            ``"intermediates"``. Only inside a module's method.

    Returns:
        ``(batch..., q_length, num_heads, v_depth)``.

    Raises:
        ValueError: Shapes that do not fit together, a mask or bias that does not broadcast,
            or a dropout rate outside ``[0, 1)``.
        TypeError: A mask that is not boolean; `is_training` is not a Python bool; a dtype
            that is not floating or complex, or a real one for complex inputs; a
            `dropout_rng` that is not a key.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> q = k = v = jnp.ones((2, 5, 4, 8))  # (batch, length, heads, depth)
        >>> mask = lm.make_causal_mask(jnp.ones((2, 5)))
        >>> lm.dot_product_attention(q, k, v, mask=mask).shape
        (2, 5, 4, 8)
    """
    where = "dot_product_attention"
    _check_heads(where, jnp.shape(query), jnp.shape(key), jnp.shape(value))
    options = _options(
        where, query, key, value, mask, bias, is_training, dropout_rate, dropout_rng,
        broadcast_dropout, dtype, precision, force_fp32_for_softmax, sow_weights,
    )  # fmt: skip
    out, weights = attention_kernel(query, key, value, **options)
    if weights is not None:
        sow("attention_weights", weights)
    return out


def dot_product_attention_weights(
    query: jax.Array,
    key: jax.Array,
    *,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    is_training: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    broadcast_dropout: bool = True,
    dtype: Dtype = None,
    precision: PrecisionLike = None,
    force_fp32_for_softmax: bool = False,
    sow_weights: bool = False,
) -> jax.Array:
    """The attention weights of `dot_product_attention` (Flax Linen's numerics).

    ``softmax(query @ key / sqrt(depth) + bias, masked)``, with dropout while training: what
    `dot_product_attention` multiplies the values by.

    Args:
        query: ``(batch..., q_length, num_heads, depth)``.
        key: ``(batch..., kv_length, num_kv_heads, depth)``, `num_kv_heads` dividing
            `num_heads` (grouped-query attention, as `dot_product_attention`'s).
        mask: As `dot_product_attention`'s: bool, True keeps a query-key pair.
        bias: Added to the logits, as `dot_product_attention`'s.
        is_training: Apply dropout to the weights (a Python bool).
        dropout_rate: Probability of dropping a weight, in ``[0, 1)``.
        dropout_rng: Key for dropout; default ``lm.next_rng_key("dropout")``.
        broadcast_dropout: One dropout mask for all batch elements and heads.
        dtype: Compute dtype; None infers it from `query` and `key` (Linen's default).
        precision: `jax.lax.Precision` of the product.
        force_fp32_for_softmax: Compute the softmax in float32 when `dtype` is lower.
        sow_weights: Record the weights before dropout, as `dot_product_attention`'s.

    Returns:
        ``(batch..., num_heads, q_length, kv_length)``; each row sums to 1 (before dropout).

    Raises:
        ValueError: Shapes that do not fit together, a mask or bias that does not broadcast,
            or a dropout rate outside ``[0, 1)``.
        TypeError: A mask that is not boolean; `is_training` is not a Python bool; a dtype
            that is not floating or complex, or a real one for complex inputs; a
            `dropout_rng` that is not a key.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> q = k = jnp.ones((2, 5, 4, 8))  # (batch, length, heads, depth)
        >>> weights = lm.dot_product_attention_weights(q, k)
        >>> weights.shape, float(weights[0, 0, 0].sum())
        ((2, 4, 5, 5), 1.0)
    """
    where = "dot_product_attention_weights"
    _check_heads(where, jnp.shape(query), jnp.shape(key), None)
    options = _options(
        where, query, key, None, mask, bias, is_training, dropout_rate, dropout_rng,
        broadcast_dropout, dtype, precision, force_fp32_for_softmax, sow_weights,
    )  # fmt: skip
    dropped, weights = weights_kernel(query, key, **options)
    if weights is not None:
        sow("attention_weights", weights)
    return dropped


def _options(
    where: str,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    bias: Any,
    is_training: Any,
    dropout_rate: Any,
    dropout_rng: Any,
    broadcast_dropout: Any,
    dtype: Dtype,
    precision: PrecisionLike,
    force_fp32_for_softmax: Any,
    sow_weights: Any,
) -> dict[str, Any]:
    """Checks the options of the attention functions; returns the kernels' keyword arguments."""
    _checks.static_flags(where, is_training=is_training)
    dropout_rate = _checks.non_negative(where, "dropout_rate", dropout_rate, below=1.0)
    q_shape, k_shape = jnp.shape(query), jnp.shape(key)
    weights_shape = (*q_shape[:-3], q_shape[-2], q_shape[-3], k_shape[-3])
    if mask is not None:
        check_mask(where, mask)
        check_broadcast(where, "mask", jnp.shape(mask), weights_shape)
    if bias is not None:
        check_broadcast(where, "bias", jnp.shape(bias), weights_shape)
    if dropout_rng is not None:
        check_key(where, "dropout_rng", dropout_rng)
    rng = None
    if is_training and dropout_rate > 0.0:
        rng = next_rng_key("dropout") if dropout_rng is None else dropout_rng
    dtype = _dtypes.compute_dtype(where, _dtypes.layer_dtype(where, dtype), query, key, value)
    return {
        "bias": bias,
        "mask": mask,
        "dropout_rng": rng,
        "dropout_rate": 0.0 if rng is None else dropout_rate,  # one program when not training
        "broadcast_dropout": _checks.flag(where, "broadcast_dropout", broadcast_dropout),
        "dtype": dtype,
        "precision": _checks.precision(where, precision),
        "force_fp32_for_softmax": _checks.flag(
            where, "force_fp32_for_softmax", force_fp32_for_softmax
        ),
        "with_weights": _checks.flag(where, "sow_weights", sow_weights),
    }


def check_key(where: str, name: str, value: Any) -> None:
    """Raises `TypeError` unless `value` is one PRNG key (typed, or a raw ``uint32`` one)."""
    if not is_key(value):
        got = type(value).__name__
        if getattr(value, "dtype", None) is not None:
            got = f"an array of dtype {value.dtype} and shape {tuple(jnp.shape(value))}"
        raise TypeError(
            f"{where}: {name} must be one PRNG key, jax.random.key(seed) (or "
            f"jax.random.PRNGKey(seed)), got {got}. For a seed, pass jax.random.key(seed); "
            f"to draw from the 'dropout' stream of apply's rngs, leave {name} out."
        )


def make_attention_mask(
    query_input: jax.Array,
    key_input: jax.Array,
    *,
    pairwise_fn: Callable[..., Any] = jnp.multiply,
    extra_batch_dims: int = 0,
    dtype: Dtype = jnp.bool_,
) -> jax.Array:
    """A mask of every query position against every key position, as Linen's.

    ``mask[..., 0, i, j] = pairwise_fn(query_input[..., i], key_input[..., j])``. With the
    default `pairwise_fn` and 0/1 (or bool) validity flags, it keeps the pairs whose query and
    key are both valid: a padding mask.

    Args:
        query_input: ``(batch..., q_length)``.
        key_input: ``(batch..., kv_length)``.
        pairwise_fn: Broadcasting elementwise function of the two.
        extra_batch_dims: Leading singleton axes to add.
        dtype: Dtype of the mask: bool (the default; Linen's is float32), the only dtype that
            `dot_product_attention` and `MultiHeadAttention` take as a mask.

    Returns:
        ``(1,) * extra_batch_dims + (batch..., 1, q_length, kv_length)``.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> valid = jnp.array([[1, 1, 0]])
        >>> lm.make_attention_mask(valid, valid)[0, 0]
        Array([[ True,  True, False],
               [ True,  True, False],
               [False, False, False]], dtype=bool)
    """
    where = "make_attention_mask"
    pairwise_fn = _checks.function(where, "pairwise_fn", pairwise_fn, "jnp.multiply")
    extra = _checks.non_negative_int(where, "extra_batch_dims", extra_batch_dims)
    dtype = _checks.as_dtype(where, "dtype", dtype)
    return _attention_mask(query_input, key_input, pairwise_fn, extra, dtype)


def make_causal_mask(
    x: jax.Array, *, extra_batch_dims: int = 0, dtype: Dtype = jnp.bool_
) -> jax.Array:
    """A causal mask for self-attention over `x`'s last axis, as Linen's.

    Position ``i`` may attend to positions ``j <= i``.

    Args:
        x: ``(batch..., length)``; only its shape is used.
        extra_batch_dims: Leading singleton axes to add.
        dtype: Dtype of the mask: bool (the default; Linen's is float32).

    Returns:
        ``(1,) * extra_batch_dims + (batch..., 1, length, length)``.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> lm.make_causal_mask(jnp.ones((1, 3)))[0, 0]
        Array([[ True, False, False],
               [ True,  True, False],
               [ True,  True,  True]], dtype=bool)
    """
    where = "make_causal_mask"
    extra = _checks.non_negative_int(where, "extra_batch_dims", extra_batch_dims)
    dtype = _checks.as_dtype(where, "dtype", dtype)
    shape = jnp.shape(x)
    if not shape:
        raise ValueError(
            f"{where}: x must have a length axis, (batch..., length), got a scalar; for one "
            f"sequence pass an array of shape (length,)."
        )
    idxs = jnp.broadcast_to(jnp.arange(shape[-1], dtype=jnp.int32), shape)
    return _attention_mask(idxs, idxs, jnp.greater_equal, extra, dtype)


def combine_masks(*masks: jax.Array | None, dtype: Dtype = jnp.bool_) -> jax.Array | None:
    """The logical AND of the masks that are not None, as Linen's.

    Args:
        *masks: Masks of the same rank (or None, ignored).
        dtype: Dtype of the result: bool (the default; Linen's is float32).

    Returns:
        The combined mask, or None when every mask is None.

    Raises:
        ValueError: The masks have different ranks.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> valid = jnp.array([[1, 1, 0]])
        >>> padding = lm.make_attention_mask(valid, valid)
        >>> mask = lm.combine_masks(padding, lm.make_causal_mask(valid))
        >>> mask[0, 0]
        Array([[ True, False, False],
               [ True,  True, False],
               [False, False, False]], dtype=bool)
    """
    dtype = _checks.as_dtype("combine_masks", "dtype", dtype)
    present = tuple(m for m in masks if m is not None)
    if not present:
        return None
    ranks = tuple(jnp.ndim(m) for m in present)
    if len(set(ranks)) > 1:
        raise ValueError(
            f"combine_masks: the masks must have the same rank, got shapes "
            f"{', '.join(str(jnp.shape(m)) for m in present)}."
        )
    return _combine_masks(present, dtype)


def _check_heads(
    where: str, q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...] | None
) -> None:
    """Raises unless query, key (and value, unless None) are heads that fit together."""
    names, shapes = ("query, key and value", f"query {q}, key {k}, value {v}")
    if v is None:
        names, shapes, v = "query and key", f"query {q}, key {k}", k
    if not len(q) == len(k) == len(v) or len(q) < 3:
        raise ValueError(
            f"{where}: {names} must have the same rank, at least 3 "
            f"(batch..., length, num_heads, depth); got {shapes}."
        )
    if not q[:-3] == k[:-3] == v[:-3]:
        raise ValueError(f"{where}: {names} must have the same batch axes; {shapes}.")
    if k[-2] != v[-2]:
        raise ValueError(f"{where}: key and value must have the same number of heads; {shapes}.")
    if q[-2] % k[-2]:
        raise ValueError(
            f"{where}: the query's number of heads ({q[-2]}) must be a multiple of the key's "
            f"({k[-2]}): equal for multi-head attention, a divisor for grouped-query "
            f"attention; {shapes}."
        )
    if q[-1] != k[-1]:
        raise ValueError(f"{where}: query and key must have the same depth (last axis); {shapes}.")
    if k[-3] != v[-3]:
        raise ValueError(f"{where}: key and value must have the same length (axis -3); {shapes}.")


def check_mask(where: str, mask: Any) -> None:
    """Raises `TypeError` unless `mask` is boolean (True keeps an attention pair)."""
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_:
        if jnp.issubdtype(dtype, jnp.floating):
            fix = (
                "If it is an additive mask (0 keeps, -inf or a large negative number drops), "
                "pass it as bias= instead (dot_product_attention), or convert it: mask == 0. "
                "If it is a 0/1 mask, convert it: mask.astype(bool)"
            )
        else:
            fix = "If it is a 0/1 mask, convert it: mask.astype(bool)"
        raise TypeError(
            f"{where}: mask must be a boolean array (True keeps a query-key pair), got dtype "
            f"{dtype}. {fix}. make_attention_mask and make_causal_mask return bool masks."
        )


def check_broadcast(where: str, what: str, shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    """Raises unless a mask or bias of `shape` broadcasts to the attention weights' `target`."""
    shape = tuple(shape)
    fits = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not fits:
        raise ValueError(
            f"{where}: {what} of shape {shape} does not broadcast to the attention weights' "
            f"shape (batch..., num_heads, q_length, kv_length) = {target}; each of its axes "
            f"must be 1 or equal to the weights' (e.g. make_attention_mask gives "
            f"(batch, 1, q_length, kv_length))."
        )
