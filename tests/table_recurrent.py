"""Layer-table entries of the pooling and recurrent layers of issue 12 (joined in layer_table)."""

from __future__ import annotations

import numpy as np
from jax import lax

import lamina as lm
from tests.layer_table import Function, LayerCase, args, carry, d, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "optimized_lstm_cell",
        lambda t, p: lm.OptimizedLSTMCell(3, 4, **d(t, p)),
        args(carry(2, 4), normal(2, 3)),
        output_in_dtype=False,
    ),
    # ConvLSTMCell inside RNN (the generic scan path; 2-D is tested against Linen elsewhere).
    LayerCase(
        "rnn_conv_lstm_1d",
        lambda t, p: lm.RNN(lm.ConvLSTMCell(2, 3, 2, padding="CAUSAL", **d(t, p))),
        args(normal(2, 3, 4, 2)),
        output_in_dtype=False,
    ),
    LayerCase(
        "bidirectional_lengths",
        lambda t, p: lm.Bidirectional(
            lm.RNN(lm.OptimizedLSTMCell(3, 4, **d(t, p))), lm.RNN(lm.SimpleCell(3, 2, **d(t, p)))
        ),
        args(normal(2, 5, 3)),
        kwargs={"seq_lengths": np.array([5, 3], np.int32)},
        output_in_dtype=False,
    ),
    LayerCase(
        "pool_sum_padded",
        lambda t, p: Function(
            lm.pool, init=0.0, reduce_fn=lax.add, kernel_size=(2, 2), padding=((1, 0), (0, 1))
        ),
        args(normal(2, 4, 4, 3)),
    ),
]
NOT_LAYERS: dict[str, str] = {}
