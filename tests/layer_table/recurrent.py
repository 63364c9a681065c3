"""Layer-table entries of the recurrent cells, RNN and Bidirectional."""

from __future__ import annotations

import numpy as np

import lamina as lm
from tests.layer_table.case import LayerCase, args, carry, d, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "lstm_cell",
        lambda t, p: lm.LSTMCell(3, 4, **d(t, p)),
        args(carry(2, 4), normal(2, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "optimized_lstm_cell",
        lambda t, p: lm.OptimizedLSTMCell(3, 4, **d(t, p)),
        args(carry(2, 4), normal(2, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "gru_cell",
        lambda t, p: lm.GRUCell(3, 4, **d(t, p)),
        args(carry(2, 4, lstm=False), normal(2, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "mgu_cell",
        lambda t, p: lm.MGUCell(3, 4, **d(t, p)),
        args(carry(2, 4, lstm=False), normal(2, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "simple_cell_residual",
        lambda t, p: lm.SimpleCell(3, 4, residual=True, **d(t, p)),
        args(carry(2, 4, lstm=False), normal(2, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "rnn_mgu",
        lambda t, p: lm.RNN(lm.MGUCell(3, 4, reset_gate=False, **d(t, p))),
        args(normal(2, 5, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "rnn_simple",
        lambda t, p: lm.RNN(lm.SimpleCell(3, 4, **d(t, p))),
        args(normal(2, 5, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "rnn_lstm",
        lambda t, p: lm.RNN(lm.LSTMCell(3, 4, **d(t, p))),
        args(normal(2, 5, 3)),
        output_in_dtype=False,
    ),
    LayerCase(
        "rnn_gru_reverse",
        lambda t, p: lm.RNN(lm.GRUCell(3, 4, **d(t, p)), reverse=True, keep_order=True),
        args(normal(2, 5, 3)),
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
]
