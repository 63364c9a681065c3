"""`MultiHeadAttention`: Flax Linen's ``MultiHeadDotProductAttention``.

The variables and numerics are Linen's, so Linen's variables, its ``"cache"`` collection
included, load directly. The attention itself is `dot_product_attention`'s kernel.

Incremental decoding. lamina declares every shape up front, so the decoding cache is sized
when the layer is built: ``MultiHeadAttention(..., decode_shape=(batch, max_length))``
declares three `Cache` variables (collection ``"cache"``, Linen's names and layout):

- ``cached_key`` and ``cached_value``: ``(*batch, max_length, num_heads, head_dim)``, in the
  compute dtype, zeros at `init`;
- ``cache_index``: an int32 scalar, the number of positions written so far.

``layer(x, decode=True)`` then writes the keys and values of `x`'s positions at
``cache_index``, advances it, and returns the outputs of those positions, each attending to
the cached positions up to and including its own. A step may hold one position (Linen's
decoding) or several (a prompt, in one call): decoding a sequence in steps gives the outputs
of the full ``causal=True`` pass. To start a new sequence, use fresh ``"cache"`` variables
(from `init`, or zeros). A step that would go past ``max_length`` raises `ValueError` when
the index is concrete (eager calls); under `jax.jit` (or `jax.vmap`) the index is traced and
cannot raise, so such a step leaves ``cached_key`` and ``cached_value`` unchanged, still
advances ``cache_index`` and returns NaN outputs: the overflow shows instead of silently
overwriting the last position as Linen does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.rng import next_rng_key
from .._core.variables import Cache, Initializer
from . import _checks
from ._projections import Projection, dense_general
from .attention import attention_kernel, check_broadcast, check_mask


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "dropout_rate",
        "broadcast_dropout",
        "dtype",
        "precision",
        "force_fp32_for_softmax",
    ),
)
def _multi_head_attention(
    params: dict[str, tuple[jax.Array, jax.Array | None]],
    inputs_q: jax.Array,
    inputs_k: jax.Array,
    inputs_v: jax.Array,
    mask: jax.Array | None,
    dropout_rng: jax.Array | None,
    cache: tuple[jax.Array, jax.Array, jax.Array] | None,
    causal: bool,
    dropout_rate: float,
    broadcast_dropout: bool,
    dtype: Any,
    precision: Any,
    force_fp32_for_softmax: bool,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array] | None]:
    """The whole layer in one compiled call: projections, cache update, attention, output."""
    query = dense_general(inputs_q, *params["query"], 1, dtype, precision)
    key = dense_general(inputs_k, *params["key"], 1, dtype, precision)
    value = dense_general(inputs_v, *params["value"], 1, dtype, precision)
    *batch, q_len, num_heads, _ = query.shape
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    new_cache = None
    fits = None
    if cache is not None:
        cached_key, cached_value, index = cache
        max_length = cached_key.shape[-3]
        fits = index + q_len <= max_length
        zero = jnp.zeros((), index.dtype)
        starts = (zero,) * len(batch) + (index, zero, zero)
        # Past max_length (traced index only: eagerly it raised before) write back what is
        # there, so the cache is unchanged; dynamic_slice clamps `starts` as the update does.
        key = jnp.where(fits, key, lax.dynamic_slice(cached_key, starts, key.shape))
        value = jnp.where(fits, value, lax.dynamic_slice(cached_value, starts, value.shape))
        key = lax.dynamic_update_slice(cached_key, key, starts)
        value = lax.dynamic_update_slice(cached_value, value, starts)
        new_cache = (key, value, index + q_len)
        positions = index + jnp.arange(q_len, dtype=index.dtype)
        allowed = jnp.arange(max_length, dtype=index.dtype)[None, :] <= positions[:, None]
        mask = _and_masks(mask, allowed, (*batch, num_heads, q_len, max_length))
    elif causal:
        kv_len = key.shape[-3]
        allowed = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        mask = _and_masks(mask, allowed, (*batch, num_heads, q_len, kv_len))
    x = attention_kernel(
        query,
        key,
        value,
        None,
        mask,
        dropout_rng,
        dropout_rate,
        broadcast_dropout,
        dtype,
        precision,
        force_fp32_for_softmax,
    )
    out = dense_general(x, *params["out"], 2, dtype, precision)
    if fits is not None:
        out = jnp.where(fits, out, jnp.nan)
    return out, new_cache


def _and_masks(mask: jax.Array | None, allowed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    allowed = jnp.broadcast_to(allowed, shape)
    return allowed if mask is None else jnp.logical_and(jnp.broadcast_to(mask, shape), allowed)


class MultiHeadAttention(Module):
    """Multi-head dot-product attention, Flax Linen's ``MultiHeadDotProductAttention``.

    Projects the queries, keys and values to ``num_heads`` heads of ``head_dim =
    qkv_size // num_heads`` features, attends (`dot_product_attention`) and projects the
    heads back to ``out_size``. Variables are Linen's: submodules ``query``, ``key`` and
    ``value`` (``kernel`` ``(in_size, num_heads, head_dim)``, ``bias`` ``(num_heads,
    head_dim)``) and ``out`` (``kernel`` ``(num_heads, head_dim, out_size)``, ``bias``
    ``(out_size,)``); with `decode_shape`, the cache ``cached_key``, ``cached_value`` and
    ``cache_index`` (see the module's documentation for incremental decoding).

    Cross-attention: the keys and values may come from other inputs, whose feature sizes
    (`key_size`, `value_size`) are declared here because the key and value kernels
    are sized by them.

    Args:
        num_heads: Number of heads; must divide `qkv_size`.
        in_size: Feature size of the queries' input (``inputs_q.shape[-1]``).
        qkv_size: Total size of the projected queries, keys and values (default
            `in_size`).
        out_size: Size of the output's last axis (default `in_size`).
        key_size: Feature size of ``inputs_k`` (default `in_size`).
        value_size: Feature size of ``inputs_v`` (default `key_size`).
        dropout_rate: Dropout on the attention weights while training, in ``[0, 1)``.
        use_bias: Whether the four projections add a bias.
        kernel_init: Initializer of the projection kernels, called (as Linen's) with the
            kernel seen as a ``(fan_in, fan_out)`` matrix.
        bias_init: Initializer of the biases.
        out_kernel_init: Initializer of the output kernel (default `kernel_init`).
        out_bias_init: Initializer of the output bias (default `bias_init`).
        dtype: Compute dtype (inputs, variables and cache are used in it).
        param_dtype: Storage dtype of the parameters (default: `dtype`).
        precision: `jax.lax.Precision` of the products.
        broadcast_dropout: One dropout mask shared by the batch and the heads (Linen's).
        force_fp32_for_softmax: Compute the softmax in float32 when `dtype` is lower.
        decode_shape: ``(*batch, max_length)``: declares the decoding cache for inputs with
            that batch shape and up to `max_length` positions. None: no cache, and calls
            with ``decode=True`` are an error.

    Everything after `in_size` is keyword-only. Linen's names differ: ``qkv_features``,
    ``out_features`` are `qkv_size`, `out_size` here, and Linen infers the input sizes
    (`in_size`, `key_size`, `value_size`) that lamina declares.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> mha = lm.MultiHeadAttention(num_heads=2, in_size=8)
        >>> init, apply = lm.transform(mha)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["query"]["kernel"].shape
        (8, 2, 4)
        >>> x = jnp.ones((3, 5, 8))  # (batch, length, features)
        >>> y, _ = apply(variables, None, x, causal=True)
        >>> y.shape
        (3, 5, 8)

        Decoding one position at a time, with a cache for batch 3 and 5 positions:

        >>> mha = lm.MultiHeadAttention(num_heads=2, in_size=8, decode_shape=(3, 5))
        >>> init, apply = lm.transform(mha)
        >>> variables = init(jax.random.key(0))
        >>> y0, variables = apply(variables, None, x[:, :1], decode=True)
        >>> int(variables["cache"]["cache_index"]), y0.shape
        (1, (3, 1, 8))
    """

    num_heads = _checks.Setting()
    in_size = _checks.Setting()
    qkv_size = _checks.Setting()
    out_size = _checks.Setting()
    key_size = _checks.Setting()
    value_size = _checks.Setting()
    head_dim = _checks.Setting()
    dropout_rate = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()
    broadcast_dropout = _checks.Setting()
    force_fp32_for_softmax = _checks.Setting()
    decode_shape = _checks.Setting()

    def __init__(
        self,
        num_heads: int,
        in_size: int,
        *,
        qkv_size: int | None = None,
        out_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        dropout_rate: float = 0.0,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        out_kernel_init: Initializer | None = None,
        out_bias_init: Initializer | None = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        precision: Any = None,
        broadcast_dropout: bool = True,
        force_fp32_for_softmax: bool = False,
        decode_shape: Sequence[int] | None = None,
    ):
        super().__init__()
        name = type(self).__name__
        self.num_heads = _checks.positive_int(name, "num_heads", num_heads)
        self.in_size = _checks.positive_int(name, "in_size", in_size)

        def size(setting: str, value: Any, default: int) -> int:
            return _checks.positive_int(name, setting, default if value is None else value)

        self.qkv_size = size("qkv_size", qkv_size, self.in_size)
        self.out_size = size("out_size", out_size, self.in_size)
        self.key_size = size("key_size", key_size, self.in_size)
        self.value_size = size("value_size", value_size, self.key_size)
        if self.qkv_size % self.num_heads:
            raise ValueError(
                f"{name}: qkv_size={self.qkv_size} is not divisible by "
                f"num_heads={self.num_heads}; each head gets qkv_size // num_heads "
                f"features, so choose qkv_size as a multiple of num_heads."
            )
        self.head_dim = self.qkv_size // self.num_heads
        self.dropout_rate = _checks.non_negative(name, "dropout_rate", dropout_rate, below=1.0)
        self.use_bias = _checks.flag(name, "use_bias", use_bias)
        self.dtype = _checks.inexact_dtype(name, "dtype", dtype)
        self.param_dtype = _checks.storage_dtype(name, param_dtype, self.dtype)
        self.precision = _checks.precision(name, precision)
        self.broadcast_dropout = _checks.flag(name, "broadcast_dropout", broadcast_dropout)
        self.force_fp32_for_softmax = _checks.flag(
            name, "force_fp32_for_softmax", force_fp32_for_softmax
        )
        kernel_init = _checks.initializer(name, "kernel_init", kernel_init)
        bias_init = _checks.initializer(name, "bias_init", bias_init)
        out_kernel_init = kernel_init if out_kernel_init is None else out_kernel_init
        out_kernel_init = _checks.initializer(name, "out_kernel_init", out_kernel_init)
        out_bias_init = bias_init if out_bias_init is None else out_bias_init
        out_bias_init = _checks.initializer(name, "out_bias_init", out_bias_init)
        use_bias, dtype, param_dtype = self.use_bias, self.dtype, self.param_dtype

        heads = (self.num_heads, self.head_dim)

        def projection(kernel_shape: tuple, bias_shape: tuple, n_in: int, k_init: Any, b_init: Any):
            return Projection(
                kernel_shape, bias_shape, n_in, use_bias, k_init, b_init, dtype, param_dtype
            )

        self.query = projection((self.in_size, *heads), heads, 1, kernel_init, bias_init)
        self.key = projection((self.key_size, *heads), heads, 1, kernel_init, bias_init)
        self.value = projection((self.value_size, *heads), heads, 1, kernel_init, bias_init)
        self.out = projection(
            (*heads, self.out_size),
            (self.out_size,),
            2,
            out_kernel_init,
            out_bias_init,
        )

        self.decode_shape = None if decode_shape is None else _decode_shape(name, decode_shape)
        # The cache: three Cache declarations when decoding, else None (Any: read only then).
        self.cached_key: Any
        self.cached_value: Any
        self.cache_index: Any
        if self.decode_shape is None:
            self.cached_key = self.cached_value = self.cache_index = None
        else:
            cache_shape = (*self.decode_shape, *heads)
            zeros = initializers.zeros()
            self.cached_key = Cache(cache_shape, zeros, self.dtype)
            self.cached_value = Cache(cache_shape, zeros, self.dtype)
            self.cache_index = Cache((), zeros, jnp.int32)

    @property
    def max_length(self) -> int | None:
        """The number of positions the decoding cache holds (None without a cache)."""
        return None if self.decode_shape is None else self.decode_shape[-1]

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        causal: bool = False,
        is_training: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        """Attends from `inputs_q` to `inputs_k`/`inputs_v` (self-attention when omitted).

        Args:
            inputs_q: ``(batch..., q_length, in_size)``.
            inputs_k: ``(batch..., kv_length, key_size)``; default `inputs_q`.
            inputs_v: ``(batch..., kv_length, value_size)``; default `inputs_k`.
            mask: A bool array broadcastable to ``(batch..., num_heads, q_length,
                kv_length)`` (with ``decode=True``, kv_length is ``max_length``); True keeps a
                pair. Masks of other dtypes are an error: a 0/1 mask is ``mask.astype(bool)``,
                an additive one (0 keeps, -inf drops) is ``mask == 0``.
            causal: Also keep only the pairs with key position <= query position (positions
                count from the start of both sequences). Implied by `decode`.
            is_training: Apply dropout to the attention weights, with keys from
                ``lm.next_rng_key("dropout")``. A Python bool.
            decode: Write this step's keys and values to the cache at ``cache_index`` and
                attend to the cache (needs `decode_shape`). A Python bool.

        Returns:
            ``(batch..., q_length, out_size)``.
        """
        name = type(self).__name__
        _checks.python_bool(name, causal=causal, is_training=is_training, decode=decode)
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(
                    f"{name}: inputs_v was given without inputs_k. Pass inputs_k too; to use "
                    f"the same array for keys and values, pass it as inputs_k alone."
                )
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        q_shape = _check_input("inputs_q", inputs_q, "in_size", self.in_size)
        k_shape = _check_input("inputs_k", inputs_k, "key_size", self.key_size)
        v_shape = _check_input("inputs_v", inputs_v, "value_size", self.value_size)
        batch, q_len = q_shape[:-2], q_shape[-2]
        if not k_shape[:-2] == v_shape[:-2] == batch:
            raise ValueError(
                f"{name}: inputs_q, inputs_k and inputs_v must have the same batch shape "
                f"(all axes but the last two); got shapes {q_shape}, {k_shape} and {v_shape}."
            )
        if k_shape[-2] != v_shape[-2]:
            raise ValueError(
                f"{name}: inputs_k and inputs_v must have the same length (axis -2); got "
                f"shapes {k_shape} and {v_shape}."
            )
        cache = None
        kv_len = k_shape[-2]
        if decode:
            cache = self._cache_for_step(batch, q_len, k_shape)
            kv_len = self.decode_shape[-1]
        if mask is not None:
            check_mask(name, mask)
            weights_shape = (*batch, self.num_heads, q_len, kv_len)
            check_broadcast(name, "mask", jnp.shape(mask), weights_shape)
        rng = None
        if is_training and self.dropout_rate > 0.0:
            rng = next_rng_key("dropout")
        # Not training, the rate does not matter: 0.0 lets layers that differ only in their
        # rate share one compiled program.
        dropout_rate = 0.0 if rng is None else self.dropout_rate
        params = {
            "query": self.query.arrays(),
            "key": self.key.arrays(),
            "value": self.value.arrays(),
            "out": self.out.arrays(),
        }
        out, new_cache = _multi_head_attention(
            params,
            inputs_q,
            inputs_k,
            inputs_v,
            mask,
            rng,
            cache,
            causal and not decode,
            dropout_rate,
            self.broadcast_dropout,
            self.dtype,
            self.precision,
            self.force_fp32_for_softmax,
        )
        if new_cache is not None:
            self.cached_key.value, self.cached_value.value, self.cache_index.value = new_cache
        return out

    def _cache_for_step(
        self, batch: tuple[int, ...], q_len: int, k_shape: tuple[int, ...]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        name = "MultiHeadAttention"
        if self.decode_shape is None:
            raise ValueError(
                f"{name}: decode=True needs a decoding cache, and this layer has none. Build "
                f"it with decode_shape=(*batch, max_length), e.g. "
                f"MultiHeadAttention(..., decode_shape=(batch_size, max_length)), and pass "
                f"the 'cache' collection of init to apply."
            )
        *cache_batch, max_length = self.decode_shape
        if tuple(cache_batch) != batch:
            raise ValueError(
                f"{name}: decode=True with inputs of batch shape {batch}, but the cache was "
                f"sized for batch shape {tuple(cache_batch)} (decode_shape={self.decode_shape})."
            )
        if k_shape[-2] != q_len:
            raise ValueError(
                f"{name}: with decode=True the keys and values are cached at the queries' "
                f"positions, so inputs_k must have the queries' length {q_len}; got shape "
                f"{k_shape}."
            )
        index = self.cache_index.value
        if not isinstance(index, jax.core.Tracer):
            start = int(index)
            if start + q_len > max_length:
                raise ValueError(
                    f"{name}: decoding past max_length: cache_index is {start} and this step "
                    f"writes {q_len} position(s), but the cache holds max_length={max_length} "
                    f"(decode_shape={self.decode_shape}). Start a new sequence with fresh "
                    f"'cache' variables, or build the layer with a larger decode_shape."
                )
        return self.cached_key.value, self.cached_value.value, index


def _check_input(arg: str, x: Any, setting: str, expected: int) -> tuple[int, ...]:
    shape = tuple(jnp.shape(x))
    if len(shape) < 2:
        raise ValueError(
            f"MultiHeadAttention: {arg} must have shape (batch..., length, features), got "
            f"shape {shape}; add a length axis for a single position."
        )
    return _checks.check_last_axis("MultiHeadAttention", x, expected, setting, what=arg)


def _decode_shape(where: str, shape: Any) -> tuple[int, ...]:
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
