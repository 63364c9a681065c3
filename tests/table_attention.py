"""Layer-table entries of the attention options of issue 12 (joined into `tests/layer_table.py`)."""

from __future__ import annotations

import lamina as lm
from tests.layer_table import Function, LayerCase, args, d, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "attention_normalize_qk",
        lambda t, p: lm.MultiHeadAttention(2, 6, qkv_size=8, normalize_qk=True, **d(t, p)),
        args(normal(2, 4, 6)),
        kwargs={"causal": True, "sow_weights": True},  # recorded only on request: not here
    ),
    LayerCase(
        "dot_product_attention_weights",
        lambda t, p: Function(lm.dot_product_attention_weights),
        args(normal(2, 5, 2, 4), normal(2, 3, 2, 4)),
    ),
]
NOT_LAYERS: dict[str, str] = {}
