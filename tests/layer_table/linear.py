"""Layer-table entries of the projections (Dense, Embed, DenseGeneral, Einsum, LoRA, GatedMLP)
and of the rotary position embeddings (RotaryEmbedding, apply_rotary: no variables)."""

from __future__ import annotations

import numpy as np

import lamina as lm
from tests.layer_table.case import Function, LayerCase, args, d, ids, normal

# Fixed positions (the table's inputs are floats): (batch 2, length 3), far apart.
POSITIONS = np.array([[0, 5, 1000], [7, 3, 64]], np.int32)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

LAYERS: list[LayerCase] = [
    LayerCase("dense", lambda t, p: lm.Dense(5, 4, **d(t, p)), args(normal(3, 5))),
    LayerCase(
        "dense_nobias",
        lambda t, p: lm.Dense(5, 4, use_bias=False, **d(t, p)),
        args(normal(2, 3, 5)),
    ),
    LayerCase(
        "embed",
        lambda t, p: lm.Embed(10, 6, **d(t, p)),
        args(ids(3, 4)),
        differentiable_inputs=False,
    ),
    LayerCase(
        "embed_attend",
        lambda t, p: lm.Embed(10, 6, **d(t, p)),
        args(normal(3, 6)),
        to_callable=lambda m: m.attend,
    ),
    LayerCase(
        "dense_general_batch_axes",
        lambda t, p: lm.DenseGeneral((3, 4), (2, 5), axis=(1, -1), batch_shape=(2,), **d(t, p)),
        args(normal(2, 3, 5, 4)),
    ),
    LayerCase(
        "einsum_ellipsis",
        lambda t, p: lm.Einsum((4, 3, 2), "...d,dhk->...kh", **d(t, p)),
        args(normal(2, 3, 4)),
    ),
    LayerCase(
        "lora_dense",
        lambda t, p: lm.LoRA(
            lm.Dense(5, 4, **d(t, p)), rank=2, alpha=4.0, b_init=lm.initializers.normal(0.5)
        ),
        args(normal(3, 5)),
    ),
    LayerCase(
        "lora_conv",
        lambda t, p: lm.LoRA(
            lm.Conv(3, 4, (3, 3), **d(t, p)), rank=2, b_init=lm.initializers.normal(0.5)
        ),
        args(normal(2, 5, 5, 3)),
    ),
    LayerCase(
        "gated_mlp_gelu_tanh_bias",
        lambda t, p: lm.GatedMLP(5, 7, activation="gelu_tanh", use_bias=True, **d(t, p)),
        args(normal(2, 3, 5)),
    ),
    LayerCase("gated_mlp", lambda t, p: lm.GatedMLP(5, 6, **d(t, p)), args(normal(3, 5))),
    LayerCase(
        "rotary_embedding_llama3_partial",
        lambda t, p: Function(
            lm.RotaryEmbedding(8, scaling=LLAMA3, partial_rotary_factor=0.5), positions=POSITIONS
        ),
        args(normal(2, 3, 2, 8)),
    ),
    LayerCase(
        "apply_rotary_interleaved",
        lambda t, p: Function(
            lm.apply_rotary,
            positions=POSITIONS[0],
            inv_freq=lm.rope_frequencies(6, theta=500_000.0),
            layout="interleaved",
        ),
        args(normal(2, 3, 2, 6)),
    ),
]
