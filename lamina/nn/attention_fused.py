"""`MultiHeadAttention`'s ``implementation``: its attention by `jax.nn.dot_product_attention`.

``implementation=None`` (the default) attends with the layer's ``attention_fn`` (lamina's
`dot_product_attention`, Linen's numerics). ``"xla"`` and ``"cudnn"`` call
`jax.nn.dot_product_attention` with that implementation: on a GPU, ``"cudnn"`` is cuDNN's
fused (flash) attention, which never forms the ``(q_length, kv_length)`` weights. It applies
when the layer's attention is exactly what that function computes: the default
``attention_fn``, no `precision`, a real floating dtype (set at construction:
`check_implementation`), and per call no dropout while training, no ``sow_weights`` and no
float64 (`attend`). Where it cannot apply, an explicit ``implementation`` is a `ValueError` naming
what stands in the way, never a silent fallback.

Numerics: `jax.nn.dot_product_attention` scales the logits after the product (lamina divides
the queries first) and always computes the softmax in float32, casting the weights back to
the compute dtype before the product with the values. In float32 the two paths agree within
about 1e-6, not bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from .._core.types import Dtype
from . import _dtypes
from .attention import dot_product_attention
from .attention_arguments import call_attention_fn, function_name

_NAMES = ("xla", "cudnn")


def check_implementation(layer: Any, implementation: Any) -> str | None:
    """`implementation` (None, "xla" or "cudnn") once the layer's settings allow it."""
    name = type(layer).__name__
    if implementation is None:
        return None
    if not isinstance(implementation, str) or implementation not in _NAMES:
        raise ValueError(
            f"{name}: implementation must be None (the layer's attention_fn), 'xla' or "
            f"'cudnn' (jax.nn.dot_product_attention with that implementation), got "
            f"{implementation!r}."
        )
    blockers = []
    if layer.attention_fn is not dot_product_attention:
        blockers.append(
            f"attention_fn={function_name(layer.attention_fn)} is not the default "
            f"lm.dot_product_attention, and the fused kernel would replace it"
        )
    if layer.precision is not None:
        blockers.append(
            f"precision={layer.precision!r} is set, and jax.nn.dot_product_attention takes "
            f"no precision"
        )
    if layer.dtype is not None and not jnp.issubdtype(layer.dtype, jnp.floating):
        blockers.append(f"dtype={layer.dtype} is not a real floating dtype")
    if blockers:
        raise ValueError(_refusal(name, implementation, blockers))
    return implementation


def _refusal(where: str, implementation: str, blockers: list[str]) -> str:
    return (
        f"{where}: implementation={implementation!r} calls jax.nn.dot_product_attention, "
        f"which cannot compute this layer's attention: {'; '.join(blockers)}. Remove what "
        f"stands in the way, or leave implementation=None (the layer's attention_fn)."
    )


def attend(
    layer: Any,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    is_training: bool,
    dropout_rng: Any,
    sow_weights: bool,
) -> jax.Array:
    """The heads attended: by `jax.nn.dot_product_attention` or by ``attention_fn``.

    `query` is ``(*batch, q_length, num_heads, head_dim)``, `key` and `value` ``(*batch,
    kv_length, num_kv_heads, head_dim)``, `mask` broadcastable to the weights' shape.
    """
    implementation = layer.implementation
    if implementation is None:
        return call_attention_fn(
            layer, query, key, value, mask, is_training, dropout_rng, sow_weights
        )
    where = _dtypes.layer_name(layer)
    dtype = _dtypes.compute_dtype(layer, layer.dtype, query, key, value)
    blockers = []
    if is_training and layer.dropout_rate > 0.0:
        blockers.append(
            f"this call trains with dropout_rate={layer.dropout_rate}, and "
            f"jax.nn.dot_product_attention has no dropout (call with is_training=False, or "
            f"build the layer with dropout_rate=0.0)"
        )
    if sow_weights:
        blockers.append("sow_weights=True asks for the weights, which the fused kernel never forms")
    if not jnp.issubdtype(dtype, jnp.floating):
        blockers.append(f"the inputs compute in {dtype}, not a real floating dtype")
    elif jnp.finfo(dtype).bits > 32:
        blockers.append(
            f"the inputs compute in {dtype}, and jax.nn.dot_product_attention computes its "
            f"softmax in float32, which would lose {dtype}'s precision"
        )
    if blockers:
        raise ValueError(_refusal(where, implementation, blockers))
    if implementation == "cudnn":
        _check_cudnn(where, dtype, query.shape[-1])
    return fused_attention(query, key, value, mask, dtype, implementation)


def _check_cudnn(where: str, dtype: Dtype, head_dim: int) -> None:
    """Refuses, before anything runs, what cuDNN's fused attention cannot do."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(
            f"{where}: implementation='cudnn' is cuDNN's fused attention, which needs an "
            f"NVIDIA GPU, but JAX runs on {backend!r}. Use implementation='xla' (or None) "
            f"here; the results agree within float tolerance."
        )
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"{where}: implementation='cudnn' computes in float16 or bfloat16, but this layer "
            f"computes in {dtype}. Build it with dtype=jnp.bfloat16 (or load bfloat16 "
            f"weights with dtype=None), or use implementation='xla'."
        )
    if head_dim % 8:
        raise ValueError(
            f"{where}: implementation='cudnn' needs head_dim a multiple of 8 (and at most 128, "
            f"256 on Hopper and later), got head_dim={head_dim}. Use implementation='xla'."
        )


@functools.partial(jax.jit, static_argnames=("dtype", "implementation"))
def fused_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    dtype: Dtype,
    implementation: str,
) -> jax.Array:
    """`jax.nn.dot_product_attention` over any batch shape (flattened to one axis), in `dtype`."""
    *batch, q_len, heads, depth = query.shape
    flat = math.prod(batch)
    query = query.astype(dtype).reshape(flat, q_len, heads, depth)
    key = key.astype(dtype).reshape(flat, *key.shape[-3:])
    value = value.astype(dtype).reshape(flat, *value.shape[-3:])
    if mask is not None:
        rank = len(batch) + 3
        mask = jnp.reshape(mask, (1,) * (rank - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, (*batch, *mask.shape[-3:])).reshape(flat, *mask.shape[-3:])
    # jax.nn.dot_product_attention promotes bfloat16 (or float64) with float32 implicitly,
    # which JAX's strict promotion mode refuses: its own internals run in the standard mode.
    with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            implementation="cudnn" if implementation == "cudnn" else "xla",
        )
    return out.reshape(*batch, q_len, heads, out.shape[-1])
