"""Layer-table entries of attention: MultiHeadAttention and the attention functions."""

from __future__ import annotations

import lamina as lm
from tests.layer_table.case import Function, LayerCase, args, d, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "attention_self",
        lambda t, p: lm.MultiHeadAttention(2, 8, qkv_size=8, **d(t, p)),
        args(normal(2, 5, 8)),
    ),
    LayerCase(
        "attention_cross_causal",
        lambda t, p: lm.MultiHeadAttention(2, 6, qkv_size=4, out_size=3, key_size=5, **d(t, p)),
        args(normal(2, 4, 6), normal(2, 4, 5)),
        kwargs={"causal": True},
    ),
    LayerCase(
        "attention_dropout",
        lambda t, p: lm.MultiHeadAttention(2, 4, dropout_rate=0.5, **d(t, p)),
        args(normal(2, 3, 4)),
        kwargs={"is_training": True},
        needs_rng=True,
    ),
    LayerCase(
        "attention_normalize_qk",
        lambda t, p: lm.MultiHeadAttention(2, 6, qkv_size=8, normalize_qk=True, **d(t, p)),
        args(normal(2, 4, 6)),
        kwargs={"causal": True, "sow_weights": True},  # recorded only on request: not here
    ),
    LayerCase(  # Llama-family options: GQA, head_dim != in_size / heads, RoPE, RMS q/k norms
        "attention_gqa_rope_rms",
        lambda t, p: lm.MultiHeadAttention(
            4,
            8,
            num_kv_heads=2,
            head_dim=4,
            rope=lm.RotaryEmbedding(4),
            qk_norm="rms",
            out_use_bias=False,
            **d(t, p),
        ),
        args(normal(2, 5, 8)),
        kwargs={"causal": True},
    ),
    LayerCase(  # multi-query, a sliding window (implementation="xla" refuses float64)
        "attention_mqa_window",
        lambda t, p: lm.MultiHeadAttention(2, 6, num_kv_heads=1, sliding_window=2, **d(t, p)),
        args(normal(2, 4, 6)),
        kwargs={"causal": True},
    ),
    LayerCase(
        "dot_product_attention",
        lambda t, p: Function(lm.dot_product_attention),
        args(normal(2, 5, 2, 4), normal(2, 3, 2, 4), normal(2, 3, 2, 6)),
    ),
    LayerCase(
        "dot_product_attention_weights",
        lambda t, p: Function(lm.dot_product_attention_weights),
        args(normal(2, 5, 2, 4), normal(2, 3, 2, 4)),
    ),
]
