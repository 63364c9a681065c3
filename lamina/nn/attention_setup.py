"""The settings checks and declarations of `MultiHeadAttention`, as functions of the layer.

`MultiHeadAttention.__init__` calls them in order: `set_sizes` (heads and feature sizes),
`set_options` (dropout, dtypes, ``attention_fn``...), `set_modern_options` (q/k
normalisation, output bias, window, ``implementation``), `declare_projections` (the
``query``, ``key``, ``value`` and ``out`` projections, Linen's), `declare_qk_norms`,
`declare_rope` and `declare_cache` (the decoding cache). Each writes the layer's settings or
submodules and raises with what was wrong and what to do. `check_window_call` and
`checked_positions` check a call's arguments the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import Cache
from . import _checks, _dtypes
from ._projections import Projection
from .attention_arguments import accepted_arguments
from .attention_decoding import checked_decode_shape
from .attention_fused import check_implementation
from .layer_normalization import LayerNorm, RMSNorm


def set_sizes(
    layer: Any,
    num_heads: int,
    in_size: int,
    qkv_size: int | None,
    out_size: int | None,
    key_size: int | None,
    value_size: int | None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Checks and sets the heads and the sizes (defaults: `in_size`), `head_dim`, `num_kv_heads`.

    `head_dim` given: `qkv_size` defaults to ``num_heads * head_dim`` (and must equal it);
    else ``head_dim = qkv_size // num_heads``. `num_kv_heads` (default `num_heads`) must divide
    `num_heads`.
    """
    name = type(layer).__name__
    layer.num_heads = _checks.positive_int(name, "num_heads", num_heads)
    layer.in_size = _checks.positive_int(name, "in_size", in_size)

    def size(setting: str, value: Any, default: int) -> int:
        return _checks.positive_int(name, setting, default if value is None else value)

    if head_dim is not None:
        head_dim = _checks.positive_int(name, "head_dim", head_dim)
        layer.qkv_size = size("qkv_size", qkv_size, layer.num_heads * head_dim)
        if layer.qkv_size != layer.num_heads * head_dim:
            raise ValueError(
                f"{name}: qkv_size={layer.qkv_size} and head_dim={head_dim} disagree: the "
                f"queries have num_heads * head_dim = {layer.num_heads} * {head_dim} = "
                f"{layer.num_heads * head_dim} features. Give one of them (head_dim alone "
                f"sets qkv_size), or make them agree."
            )
    else:
        layer.qkv_size = size("qkv_size", qkv_size, layer.in_size)
    layer.out_size = size("out_size", out_size, layer.in_size)
    layer.key_size = size("key_size", key_size, layer.in_size)
    layer.value_size = size("value_size", value_size, layer.key_size)
    if layer.qkv_size % layer.num_heads:
        raise ValueError(
            f"{name}: qkv_size={layer.qkv_size} is not divisible by "
            f"num_heads={layer.num_heads}; each head gets qkv_size // num_heads "
            f"features, so choose qkv_size as a multiple of num_heads (or give head_dim)."
        )
    layer.head_dim = layer.qkv_size // layer.num_heads
    layer.num_kv_heads = size("num_kv_heads", num_kv_heads, layer.num_heads)
    if layer.num_heads % layer.num_kv_heads:
        raise ValueError(
            f"{name}: num_kv_heads={layer.num_kv_heads} does not divide "
            f"num_heads={layer.num_heads}; in grouped-query attention each key and value "
            f"head serves num_heads // num_kv_heads query heads. Choose a divisor of "
            f"num_heads (num_heads itself: multi-head attention; 1: multi-query)."
        )


def set_options(
    layer: Any,
    dropout_rate: float,
    use_bias: bool,
    dtype: Dtype,
    param_dtype: Dtype,
    precision: PrecisionLike,
    broadcast_dropout: bool,
    force_fp32_for_softmax: bool,
    attention_fn: Callable[..., jax.Array],
) -> None:
    """Checks and sets the options of the attention: dropout, dtypes, `attention_fn`..."""
    name = type(layer).__name__
    layer.dropout_rate = _checks.non_negative(name, "dropout_rate", dropout_rate, below=1.0)
    layer.use_bias = _checks.flag(name, "use_bias", use_bias)
    layer.dtype = _dtypes.layer_dtype(name, dtype)
    layer.param_dtype = _dtypes.storage_dtype(name, param_dtype, layer.dtype)
    layer.precision = _checks.precision(name, precision)
    layer.broadcast_dropout = _checks.flag(name, "broadcast_dropout", broadcast_dropout)
    layer.force_fp32_for_softmax = _checks.flag(
        name, "force_fp32_for_softmax", force_fp32_for_softmax
    )
    layer.attention_fn = _checks.function(
        name, "attention_fn", attention_fn, "lm.dot_product_attention"
    )
    accepted_arguments(name, layer.attention_fn)  # its signature must be readable


def set_modern_options(
    layer: Any,
    normalize_qk: bool,
    qk_norm: str | None,
    qk_norm_eps: float,
    out_use_bias: bool | None,
    sliding_window: int | None,
    implementation: str | None,
) -> None:
    """Checks and sets the options of Llama-family attention (after `set_options`).

    `qk_norm` "layer" is `normalize_qk` (which stays its alias); `out_use_bias` None is
    `use_bias`; `implementation` is checked against the layer's other settings
    (`check_implementation`).
    """
    name = type(layer).__name__
    if qk_norm not in (None, "layer", "rms"):
        raise ValueError(
            f"{name}: qk_norm must be None, 'layer' (LayerNorm without bias, Linen's "
            f"normalize_qk) or 'rms' (RMSNorm, Qwen3's), got {qk_norm!r}."
        )
    normalize_qk = _checks.flag(name, "normalize_qk", normalize_qk)
    if normalize_qk and qk_norm == "rms":
        raise ValueError(
            f"{name}: normalize_qk=True asks for the 'layer' normalisation of the queries and "
            f"keys, qk_norm='rms' for another. Give qk_norm alone."
        )
    layer.qk_norm = "layer" if normalize_qk else qk_norm
    layer.normalize_qk = layer.qk_norm == "layer"  # the alias of qk_norm="layer"
    eps = _checks.non_negative(name, "qk_norm_eps", qk_norm_eps)
    if eps <= 0.0:
        raise ValueError(
            f"{name}: qk_norm_eps must be > 0 (it is added under a square root), got {eps}."
        )
    layer.qk_norm_eps = eps
    layer.out_use_bias = (
        layer.use_bias if out_use_bias is None else _checks.flag(name, "out_use_bias", out_use_bias)
    )
    layer.sliding_window = (
        None
        if sliding_window is None
        else _checks.positive_int(name, "sliding_window", sliding_window)
    )
    layer.implementation = check_implementation(layer, implementation)


def declare_projections(
    layer: Any,
    inits: tuple[Initializer, Initializer, Initializer | None, Initializer | None],
    shardings: tuple[Sequence[str | None] | None, ...],
) -> None:
    """Declares the ``query``, ``key``, ``value`` and ``out`` projections (Linen's).

    `inits` is ``(kernel_init, bias_init, out_kernel_init, out_bias_init)``, the output's
    None for the others'; `shardings` the six shardings ``(kernel, bias, out_kernel,
    out_bias, kv_kernel, kv_bias)``, the key and value ones None for the queries'. The key
    and value projections have `num_kv_heads` heads.
    """
    name = type(layer).__name__
    kernel_init, bias_init, out_kernel_init, out_bias_init = inits
    kernel_init = _checks.initializer(name, "kernel_init", kernel_init)
    bias_init = _checks.initializer(name, "bias_init", bias_init)
    out_kernel_init = kernel_init if out_kernel_init is None else out_kernel_init
    out_kernel_init = _checks.initializer(name, "out_kernel_init", out_kernel_init)
    out_bias_init = bias_init if out_bias_init is None else out_bias_init
    out_bias_init = _checks.initializer(name, "out_bias_init", out_bias_init)
    dtype, param_dtype = layer.dtype, layer.param_dtype

    kernel, bias, out_kernel, out_bias, kv_kernel, kv_bias = shardings
    kernel_names = _checks.sharding(name, "kernel_sharding", kernel, 3)
    bias_names = _checks.sharding(name, "bias_sharding", bias, 2)
    out_kernel_names = _checks.sharding(name, "out_kernel_sharding", out_kernel, 3)
    out_bias_names = _checks.sharding(name, "out_bias_sharding", out_bias, 1)
    kv_kernel_names = _checks.sharding(name, "kv_kernel_sharding", kv_kernel, 3)
    kv_bias_names = _checks.sharding(name, "kv_bias_sharding", kv_bias, 2)
    kv_kernel_names = kernel_names if kv_kernel is None else kv_kernel_names
    kv_bias_names = bias_names if kv_bias is None else kv_bias_names

    def projection(
        size: int,
        heads: tuple[int, int],
        names: tuple[str | None, ...] | None,
        bias_names: tuple[str | None, ...] | None,
    ) -> Projection:
        return Projection(
            (size, *heads),
            heads,
            1,
            layer.use_bias,
            kernel_init,
            bias_init,
            dtype,
            param_dtype,
            names,
            bias_names,
        )

    heads = (layer.num_heads, layer.head_dim)
    kv_heads = (layer.num_kv_heads, layer.head_dim)
    layer.query = projection(layer.in_size, heads, kernel_names, bias_names)
    layer.key = projection(layer.key_size, kv_heads, kv_kernel_names, kv_bias_names)
    layer.value = projection(layer.value_size, kv_heads, kv_kernel_names, kv_bias_names)
    layer.out = Projection(
        (*heads, layer.out_size),
        (layer.out_size,),
        2,
        layer.out_use_bias,
        out_kernel_init,
        out_bias_init,
        dtype,
        param_dtype,
        out_kernel_names,
        out_bias_names,
    )


def declare_qk_norms(layer: Any) -> None:
    """The normalisations of the queries and keys per head, over `head_dim` (None without).

    ``qk_norm="layer"`` (``normalize_qk``): Linen's LayerNorms without bias, ``query_ln`` and
    ``key_ln`` (ViT-22B's); ``"rms"``: RMSNorms ``query_norm`` and ``key_norm`` that scale in
    the input dtype, as Hugging Face's Qwen3.
    """
    layer.query_ln = layer.key_ln = layer.query_norm = layer.key_norm = None
    options = {"epsilon": layer.qk_norm_eps, "dtype": layer.dtype, "param_dtype": layer.param_dtype}
    if layer.qk_norm == "layer":
        layer.query_ln, layer.key_ln = (
            LayerNorm(layer.head_dim, use_bias=False, **options) for _ in range(2)
        )
    elif layer.qk_norm == "rms":
        layer.query_norm, layer.key_norm = (
            RMSNorm(layer.head_dim, scale_in_input_dtype=True, **options) for _ in range(2)
        )


def declare_rope(layer: Any, rope: Any) -> None:
    """Checks and sets the rotary embedding `rope` (a submodule, or None)."""
    name = type(layer).__name__
    if rope is not None:
        if not isinstance(rope, Module) or not callable(rope):
            raise TypeError(
                f"{name}: rope must be an lm.RotaryEmbedding (a module called as rope(x, "
                f"positions)), got {type(rope).__name__}. Build one with "
                f"lm.RotaryEmbedding(head_dim, theta=...)."
            )
        rope_dim = getattr(rope, "head_dim", layer.head_dim)
        if rope_dim != layer.head_dim:
            raise ValueError(
                f"{name}: rope rotates vectors of head_dim={rope_dim}, but this layer's heads "
                f"have head_dim={layer.head_dim} (qkv_size // num_heads). Build it with "
                f"lm.RotaryEmbedding({layer.head_dim}, ...)."
            )
    layer.rope = rope


def check_window_call(layer: Any, causal: bool, decode: bool) -> None:
    """Raises if `layer` has a `sliding_window` and the call is neither causal nor decoding.

    The window bounds only the past keys (``k > q - w``): without the causal mask an encoder
    would see every future key and cross-attention would mask almost nothing.
    """
    if layer.sliding_window is not None and not (causal or decode):
        raise ValueError(
            f"{_dtypes.layer_name(layer)}: sliding_window={layer.sliding_window} bounds the "
            f"past keys only, so without the causal mask every future key stays visible. "
            f"Call with causal=True (or decode=True); for a two-sided window (or windowed "
            f"cross-attention), build the layer without sliding_window and pass a mask."
        )


def checked_positions(
    layer: Any,
    positions: Any,
    batch: tuple[int, ...],
    q_len: int,
    kv_len: int,
    cache: tuple[jax.Array, jax.Array, jax.Array] | None,
) -> jax.Array | None:
    """The positions `layer`'s rope rotates by (checked, default filled in); None without rope.

    Given positions broadcast to ``(*batch, q_len)`` along the batch axes (Hugging Face's
    ``position_ids`` are ``(1, q_len)`` for any batch); their last axis must be `q_len`.
    """
    name = _dtypes.layer_name(layer)
    if layer.rope is None:
        if positions is not None:
            raise ValueError(
                f"{name}: positions were given, but this layer has no rope to rotate by "
                f"them (they are used by nothing else). Build it with "
                f"rope=lm.RotaryEmbedding(head_dim, ...), or leave positions out."
            )
        return None
    if kv_len != q_len:
        raise ValueError(
            f"{name}: rope rotates the queries and keys by the same positions, so the keys "
            f"must have the queries' length {q_len}; got {kv_len} (cross-attention with "
            f"rope is not supported)."
        )
    if positions is None:
        start = jnp.zeros((), jnp.int32) if cache is None else cache[2]
        return start + jnp.arange(q_len, dtype=jnp.int32)
    shape, dtype = tuple(jnp.shape(positions)), jnp.result_type(positions)
    target = (*batch, q_len)
    fits = len(shape) <= len(target) and shape[-1:] == (q_len,)
    fits = fits and all(n in (1, m) for n, m in zip(shape[::-1], target[::-1], strict=False))
    if not fits or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{name}: positions must be integers of shape (batch..., q_length) = {target}, "
            f"or one that broadcasts to it along the batch axes (e.g. (q_length,) or "
            f"(1, q_length)); got {dtype} of shape {shape}."
        )
    positions = jnp.asarray(positions)
    return positions if shape in ((q_len,), target) else jnp.broadcast_to(positions, target)


def declare_cache(layer: Any, decode_shape: Sequence[int] | None) -> None:
    """Checks `decode_shape` and declares the decoding cache (three `Cache`), or None."""
    name = type(layer).__name__
    layer.decode_shape = None if decode_shape is None else checked_decode_shape(name, decode_shape)
    if layer.decode_shape is None:
        layer.cached_key = layer.cached_value = layer.cache_index = None
    else:
        cache_shape = (*layer.decode_shape, layer.num_kv_heads, layer.head_dim)
        zeros = initializers.zeros()
        cache_dtype = layer.param_dtype if layer.dtype is None else layer.dtype
        layer.cached_key = Cache(cache_shape, zeros, cache_dtype)
        layer.cached_value = Cache(cache_shape, zeros, cache_dtype)
        layer.cache_index = Cache((), zeros, jnp.int32)


def redeclare_cache(layer: Any, decode_shape: Sequence[int] | None) -> None:
    """Declares `layer`'s decoding cache again, for `decode_shape`, on a copy being made.

    `decode_shape` is a write-once setting: this removes it from the layer's ``__dict__``
    first, then runs `declare_cache` (the cache follows the layer's ``dtype``, which a policy
    sets to its compute dtype). Only for a fresh copy of a model (as
    ``CausalLM.with_cache`` makes): a layer in use would change under its users.
    """
    layer.__dict__.pop("decode_shape", None)
    declare_cache(layer, decode_shape)
