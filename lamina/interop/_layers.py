"""The built-in converters of the feed-forward layers: linear, convolutions, norms, attention.

Each pair maps a PyTorch module's tensors (NumPy arrays) to the lamina layer's variables and
back; the layouts are in docs/pytorch.md. Registered when `lamina.interop` is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..nn.batch_normalization import BatchNorm
from ..nn.conv import Conv, ConvTranspose
from ..nn.group_normalization import GroupNorm, InstanceNorm
from ..nn.layer_normalization import LayerNorm, RMSNorm
from ..nn.linear import Dense, Embed
from ..nn.multi_head_attention import MultiHeadAttention
from ._registry import Unsupported, register_torch, take

Arrays = Mapping[str, Any]


# --- Dense <- Linear, Embed <- Embedding ------------------------------------------------------


def dense_to_lamina(layer: Dense, t: Arrays) -> dict[str, Any]:
    """``weight`` ``(out, in)`` is the transposed ``kernel``; ``bias`` is the bias."""
    shape = (layer.out_size, layer.in_size)
    out = {"kernel": take(t, "weight", shape, "a Linear weight (out_features, in_features)").T}
    if layer.use_bias:
        out["bias"] = take(t, "bias", (layer.out_size,), "(out_features,)")
    return out


def dense_to_torch(layer: Dense, v: Arrays) -> dict[str, Any]:
    """The inverse of `dense_to_lamina`."""
    out = {"weight": v["kernel"].T}
    if layer.use_bias:
        out["bias"] = v["bias"]
    return out


def embed_to_lamina(layer: Embed, t: Arrays) -> dict[str, Any]:
    """``weight`` ``(num_embeddings, embedding_dim)`` is the table as it is."""
    shape = (layer.num_embeddings, layer.size)
    return {"embedding": take(t, "weight", shape, "(num_embeddings, embedding_dim)")}


def embed_to_torch(layer: Embed, v: Arrays) -> dict[str, Any]:
    """The inverse of `embed_to_lamina`."""
    return {"weight": v["embedding"]}


# --- Conv <- Conv1d/2d/3d, ConvTranspose <- ConvTranspose1d/2d/3d ------------------------------


def conv_to_lamina(layer: Conv, t: Arrays) -> dict[str, Any]:
    """The weight ``(out, in // groups, *window)`` as kernel ``(*window, in // groups, out)``."""
    n = len(layer.kernel_size)
    shape = (layer.out_size, layer.in_size // layer.groups, *layer.kernel_size)
    layout = "a Conv weight (out_channels, in_channels // groups, *kernel_size)"
    weight = take(t, "weight", shape, layout)
    out = {"kernel": np.transpose(weight, (*range(2, n + 2), 1, 0))}
    if layer.use_bias:
        out["bias"] = take(t, "bias", (layer.out_size,), "(out_channels,)")
    return out


def conv_to_torch(layer: Conv, v: Arrays) -> dict[str, Any]:
    """The inverse of `conv_to_lamina`."""
    n = len(layer.kernel_size)
    out = {"weight": np.transpose(v["kernel"], (n + 1, n, *range(n)))}
    if layer.use_bias:
        out["bias"] = v["bias"]
    return out


def conv_transpose_to_lamina(layer: ConvTranspose, t: Arrays) -> dict[str, Any]:
    """``weight`` ``(in, out, *window)`` becomes ``kernel``, flipped unless `transpose_kernel`.

    PyTorch's transposed convolution is the gradient of a convolution with ``weight``, which
    is `jax.lax.conv_transpose` with ``transpose_kernel=True`` and the kernel ``(*window, out,
    in)``; without `transpose_kernel` lax does not flip the window, so the kernel is stored
    flipped, ``(*window, in, out)``.
    """
    n = len(layer.kernel_size)
    shape = (layer.in_size, layer.out_size, *layer.kernel_size)
    layout = "a ConvTranspose weight (in_channels, out_channels, *kernel_size), groups=1"
    weight = take(t, "weight", shape, layout)
    if layer.transpose_kernel:
        kernel = np.transpose(weight, (*range(2, n + 2), 1, 0))
    else:
        kernel = np.flip(np.transpose(weight, (*range(2, n + 2), 0, 1)), tuple(range(n)))
    out = {"kernel": kernel}
    if layer.use_bias:
        out["bias"] = take(t, "bias", (layer.out_size,), "(out_channels,)")
    return out


def conv_transpose_to_torch(layer: ConvTranspose, v: Arrays) -> dict[str, Any]:
    """The inverse of `conv_transpose_to_lamina`."""
    n = len(layer.kernel_size)
    kernel = v["kernel"]
    if layer.transpose_kernel:
        weight = np.transpose(kernel, (n + 1, n, *range(n)))
    else:
        weight = np.transpose(np.flip(kernel, tuple(range(n))), (n, n + 1, *range(n)))
    out = {"weight": weight}
    if layer.use_bias:
        out["bias"] = v["bias"]
    return out


# --- the norms: weight -> scale, bias -> bias (BatchNorm: and the running statistics) --------


def norm_to_lamina(layer: Any, t: Arrays) -> dict[str, Any]:
    """``weight`` is ``scale`` and ``bias`` the bias, both of the feature shape."""
    shape, out = layer.feature_shape, {}
    if layer.scale is not None:
        out["scale"] = take(t, "weight", shape, "the normalized shape (weight)")
    if layer.bias is not None:
        out["bias"] = take(t, "bias", shape, "the normalized shape (bias)")
    return out


def norm_to_torch(layer: Any, v: Arrays) -> dict[str, Any]:
    """The inverse of `norm_to_lamina`."""
    out = {}
    if layer.scale is not None:
        out["weight"] = v["scale"]
    if layer.bias is not None:
        out["bias"] = v["bias"]
    return out


def batch_norm_to_lamina(layer: BatchNorm, t: Arrays) -> dict[str, Any]:
    """`norm_to_lamina`, and ``running_mean``/``running_var`` as ``mean``/``var``.

    ``num_batches_tracked`` is read (so it counts as used) and dropped: lamina's running
    averages use a fixed `momentum`.
    """
    out = norm_to_lamina(layer, t)
    shape = layer.feature_shape
    out["mean"] = take(t, "running_mean", shape, "(num_features,)")
    out["var"] = take(t, "running_var", shape, "(num_features,)")
    t.get("num_batches_tracked")
    return out


def batch_norm_to_torch(layer: BatchNorm, v: Arrays) -> dict[str, Any]:
    """The inverse of `batch_norm_to_lamina` (without ``num_batches_tracked``)."""
    return {**norm_to_torch(layer, v), "running_mean": v["mean"], "running_var": v["var"]}


# --- MultiHeadAttention <- nn.MultiheadAttention ----------------------------------------------

_SOURCES = ("query", "key", "value")


def _check_attention(layer: MultiHeadAttention) -> None:
    if layer.normalize_qk:
        raise Unsupported(
            "normalize_qk=True adds LayerNorms of the queries and keys, which "
            "torch.nn.MultiheadAttention does not have"
        )


def attention_to_lamina(layer: MultiHeadAttention, t: Arrays) -> dict[str, Any]:
    """``in_proj_weight`` (or ``q/k/v_proj_weight``) split into the three projections.

    PyTorch's rows ``h * head_dim + d`` are head ``h``, feature ``d``: each ``(qkv, in)``
    block transposed and reshaped is a ``(in, num_heads, head_dim)`` kernel.
    """
    _check_attention(layer)
    heads, qkv = (layer.num_heads, layer.head_dim), layer.qkv_size
    sizes = (layer.in_size, layer.key_size, layer.value_size)
    if "in_proj_weight" in t:
        layout = "(3 * embed_dim, embed_dim): the query, key and value weights stacked"
        weights = np.split(take(t, "in_proj_weight", (3 * qkv, layer.in_size), layout), 3)
    else:
        weights = [
            take(t, f"{s[0]}_proj_weight", (qkv, size), f"(embed_dim, {s}_dim)")
            for s, size in zip(("q", "k", "v"), sizes, strict=True)
        ]
    out = {
        f"{source}/kernel": w.T.reshape(size, *heads)
        for source, w, size in zip(_SOURCES, weights, sizes, strict=True)
    }
    layout = "(out_features, embed_dim)"
    w_out = take(t, "out_proj.weight", (layer.out_size, qkv), layout)
    out["out/kernel"] = w_out.T.reshape(*heads, layer.out_size)
    if layer.use_bias:
        biases = np.split(take(t, "in_proj_bias", (3 * qkv,), "(3 * embed_dim,)"), 3)
        out.update({f"{s}/bias": b.reshape(heads) for s, b in zip(_SOURCES, biases, strict=True)})
        out["out/bias"] = take(t, "out_proj.bias", (layer.out_size,), "(embed_dim,)")
    return out


def attention_to_torch(layer: MultiHeadAttention, v: Arrays) -> dict[str, Any]:
    """The inverse of `attention_to_lamina`; separate q/k/v weights when the sizes differ."""
    _check_attention(layer)
    qkv = layer.qkv_size
    weights = [v[f"{s}/kernel"].reshape(-1, qkv).T for s in _SOURCES]
    if layer.in_size == layer.key_size == layer.value_size:
        out = {"in_proj_weight": np.concatenate(weights, axis=0)}
    else:
        out = {f"{s}_proj_weight": w for s, w in zip(("q", "k", "v"), weights, strict=True)}
    out["out_proj.weight"] = v["out/kernel"].reshape(qkv, layer.out_size).T
    if layer.use_bias:
        out["in_proj_bias"] = np.concatenate([v[f"{s}/bias"].reshape(qkv) for s in _SOURCES])
        out["out_proj.bias"] = v["out/bias"]
    return out


def register() -> None:
    """Registers the converters of this file."""
    register_torch(Dense, dense_to_lamina, dense_to_torch)
    register_torch(Embed, embed_to_lamina, embed_to_torch)
    register_torch(Conv, conv_to_lamina, conv_to_torch)
    register_torch(ConvTranspose, conv_transpose_to_lamina, conv_transpose_to_torch)
    for norm in (LayerNorm, GroupNorm, RMSNorm, InstanceNorm):
        register_torch(norm, norm_to_lamina, norm_to_torch)
    register_torch(BatchNorm, batch_norm_to_lamina, batch_norm_to_torch)
    register_torch(MultiHeadAttention, attention_to_lamina, attention_to_torch)
