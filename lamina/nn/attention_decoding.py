"""The decoding cache of `MultiHeadAttention`: writing a step, its mask, and the overflow checks.

`cache_and_mask` writes a step's keys and values at ``cache_index`` and builds the mask of
the positions each query may attend to; `check_at_run_time` refuses, when the program runs, a
traced step that would go past ``max_length`` (`_core.checks.without_run_time_checks` lets a
caller that sized the cache itself leave that check out); `dtype_kind` orders the kinds of
dtypes that a cache may hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.checks import check_cast, run_time_checks_wanted
from .._core.types import Dtype
from . import _checks, _dtypes


@functools.partial(jax.jit, static_argnames=("q_len", "causal", "window"))
def cache_and_mask(
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    cache: tuple[jax.Array, jax.Array, jax.Array] | None,
    q_len: int,
    causal: bool,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, tuple | None, jax.Array | None]:
    """Writes this step's keys and values to the cache (`cache`), and builds the mask.

    Returns the keys and values to attend to, the mask, the new cache and whether the step
    fitted in it (None without a cache). The mask is `mask` AND the causal (or cached
    positions') mask AND the sliding `window` (a query at slot ``q`` sees the keys at slots
    ``k > q - window``; slots count from the first position of the sequences, or of the
    cache), ``(*batch, heads, q_length, kv_length)`` where ``heads`` is `mask`'s heads axis
    or 1: the attention broadcasts it over the heads.
    """
    batch = key.shape[:-3]
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    if cache is None:
        kv_len = key.shape[-3]
        q_slots, kv_slots = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
        allowed = _allowed(q_slots, kv_slots, causal, window)
        if allowed is not None:
            mask = _and_masks(mask, allowed, batch)
        return key, value, mask, None, None
    cached_key, cached_value, index = cache
    max_length = cached_key.shape[-3]
    fits = (index >= 0) & (index <= max_length - q_len)  # no int32 wrap of index + q_len
    zero = jnp.zeros((), index.dtype)
    starts = (zero,) * len(batch) + (index, zero, zero)
    # The cache keeps its own dtype (the compute dtype, or param_dtype with dtype=None).
    key, value = key.astype(cached_key.dtype), value.astype(cached_value.dtype)
    # Past max_length (traced index only: eagerly it raised before) write back what is
    # there, so the cache is unchanged; dynamic_slice clamps `starts` as the update does.
    key = jnp.where(fits, key, lax.dynamic_slice(cached_key, starts, key.shape))
    value = jnp.where(fits, value, lax.dynamic_slice(cached_value, starts, value.shape))
    key = lax.dynamic_update_slice(cached_key, key, starts)
    value = lax.dynamic_update_slice(cached_value, value, starts)
    q_slots = (index + jnp.arange(q_len, dtype=index.dtype))[:, None]
    kv_slots = jnp.arange(max_length, dtype=index.dtype)[None, :]
    allowed = _allowed(q_slots, kv_slots, True, window)
    assert allowed is not None  # causal
    mask = _and_masks(mask, allowed, batch)
    return key, value, mask, (key, value, index + q_len), fits


def _allowed(
    q_slots: jax.Array, kv_slots: jax.Array, causal: bool, window: int | None
) -> jax.Array | None:
    """The ``(q_length, kv_length)`` pairs the causal mask and the window keep (None: all)."""
    allowed = kv_slots <= q_slots if causal else None
    if window is not None:
        inside = kv_slots > q_slots - window
        allowed = inside if allowed is None else allowed & inside
    return allowed


def _and_masks(mask: jax.Array | None, allowed: jax.Array, batch: tuple[int, ...]) -> jax.Array:
    """``mask & allowed``, ``(*batch, heads, q_length, kv_length)``; heads is `mask`'s or 1."""
    rank = len(batch) + 3
    heads = 1 if mask is None or mask.ndim < 3 else mask.shape[-3]
    shape = (*batch, heads, *allowed.shape)
    allowed = jnp.broadcast_to(allowed, shape)
    if mask is None:
        return allowed
    mask = jnp.reshape(mask, (1,) * (rank - mask.ndim) + mask.shape)
    return jnp.logical_and(jnp.broadcast_to(mask, shape), allowed)


def dtype_kind(dtype: Dtype) -> int:
    """0 bool, 1 integer, 2 float, 3 complex: a cast to a lower kind loses a part."""
    kinds = (jnp.complexfloating, jnp.floating, jnp.integer)
    return next((3 - i for i, kind in enumerate(kinds) if jnp.issubdtype(dtype, kind)), 0)


def check_at_run_time(
    index: jax.Array, q_len: int, max_length: int, message: Callable[[Any], str]
) -> None:
    """Raises, when the program runs, if a traced `index` is negative or past `max_length`.

    The traced program holds a `lax.cond` whose taken branch calls the host
    (`jax.debug.callback`) only when the step overflows, so a step that fits costs one
    comparison on the device. The callback raises `ValueError`; JAX reports it as a
    `JaxRuntimeError` whose message contains it, from the call (or from the first use of its
    result, where dispatch is asynchronous). Under `jax.vmap` the branch runs for every
    member, so the callback checks the values again.
    """

    def refuse(start: Any) -> None:
        starts = np.asarray(start, np.int64)
        wrong = starts[(starts < 0) | (starts > max_length - q_len)]
        if wrong.size:
            raise ValueError(message(int(wrong.min() if wrong.min() < 0 else wrong.max())))

    # `max_length - q_len` is a Python int: ``index + q_len`` could wrap past 2**31 - 1.
    lax.cond(
        jnp.any((index < 0) | (index > max_length - q_len)),
        lambda: jax.debug.callback(refuse, index),
        lambda: None,
    )


def checked_decode_shape(where: str, shape: Any) -> tuple[int, ...]:
    """`decode_shape`, ``(*batch, max_length)``, as a tuple of positive ints; else `ValueError`."""
    try:
        dims = tuple(shape)
    except TypeError:
        dims = ()
    if not dims or not all(_checks.is_int(d) and d > 0 for d in dims):
        raise ValueError(
            f"{where}: decode_shape must be a non-empty tuple of positive ints, "
            f"(*batch, max_length); got {shape!r}."
        )
    return tuple(int(d) for d in dims)


def check_cache_kind(layer: Any, key: jax.Array, value: jax.Array) -> None:
    """Refuses keys or values whose kind `layer`'s cache dtype cannot hold.

    Complex ones in a real cache would lose their imaginary part (`check_cast` says so).
    The cache stores the compute dtype (`param_dtype` with ``dtype=None``), so a wider
    float (float32 keys in a bfloat16 cache) is rounded to it, as declared; a change of
    kind is not a rounding.
    """
    for what, array, cached in (
        ("keys", key, layer.cached_key),
        ("values", value, layer.cached_value),
    ):
        target = cached.param_dtype
        if dtype_kind(array.dtype) <= dtype_kind(target):
            continue
        message = (
            f"{_dtypes.layer_name(layer)} cannot write this step's {array.dtype} {what} to its "
            f"decoding cache, stored as {target} (the layer's dtype, or param_dtype with "
            f"dtype=None; set with dtype={layer.dtype}, param_dtype={layer.param_dtype}). "
            f"Build the layer with dtype={array.dtype} (or param_dtype={array.dtype} with "
            f"dtype=None) to decode {array.dtype} inputs"
        )
        check_cast(array, target, functools.partial(str, message))


def check_decoding_step(
    layer: Any, batch: tuple[int, ...], q_len: int, k_shape: tuple[int, ...]
) -> jax.Array:
    """`layer`'s ``cache_index``, once this step is checked to fit its decoding cache.

    The step's inputs have batch shape `batch` and `q_len` positions (the keys' shape is
    `k_shape`). A concrete index past ``max_length`` raises `ValueError` now; a traced one
    is checked when the program runs (`check_at_run_time`).
    """
    name = "MultiHeadAttention"
    if layer.decode_shape is None:
        raise ValueError(
            f"{name}: decode=True needs a decoding cache, and this layer has none. Build "
            f"it with decode_shape=(*batch, max_length), e.g. "
            f"MultiHeadAttention(..., decode_shape=(batch_size, max_length)), and pass "
            f"the 'cache' collection of init to apply."
        )
    *cache_batch, max_length = layer.decode_shape
    if tuple(cache_batch) != batch:
        raise ValueError(
            f"{name}: decode=True with inputs of batch shape {batch}, but the cache was "
            f"sized for batch shape {tuple(cache_batch)} (decode_shape={layer.decode_shape})."
        )
    if k_shape[-2] != q_len:
        raise ValueError(
            f"{name}: with decode=True the keys and values are cached at the queries' "
            f"positions, so inputs_k must have the queries' length {q_len}; got shape "
            f"{k_shape}."
        )
    index = layer.cache_index.value
    where = _dtypes.layer_name(layer)

    def overflow(start: Any) -> str:
        if start < 0:
            return (
                f"{where}: cache_index is {start}, but it counts the positions written "
                f"so far (0 to max_length={max_length}): the 'cache' variables were "
                f"edited or corrupted. Start a new sequence with fresh 'cache' variables "
                f"(from init, or zeros)."
            )
        return (
            f"{where}: decoding past max_length: cache_index is {start} and this step "
            f"writes {q_len} position(s), but the cache holds max_length={max_length} "
            f"(decode_shape={layer.decode_shape}). Start a new sequence with fresh "
            f"'cache' variables, or build the layer with a larger decode_shape."
        )

    if not isinstance(index, jax.core.Tracer):
        if not 0 <= int(index) <= max_length - q_len:
            raise ValueError(overflow(int(index)))
    elif run_time_checks_wanted():
        check_at_run_time(index, q_len, max_length, overflow)
    return index
