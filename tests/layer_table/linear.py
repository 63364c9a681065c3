"""Layer-table entries of the projections: Dense, Embed, DenseGeneral, Einsum and LoRA."""

from __future__ import annotations

import lamina as lm
from tests.layer_table.case import LayerCase, args, d, ids, normal

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
]
