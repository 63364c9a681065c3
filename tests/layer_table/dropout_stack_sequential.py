"""Layer-table entries of dropout (the layer and the function), Stack and Sequential."""

from __future__ import annotations

import lamina as lm
from tests.layer_table.case import Function, LayerCase, args, d, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "dropout",
        lambda t, p: lm.Dropout(0.3),
        args(normal(4, 5)),
        kwargs={"is_training": True},
        needs_rng=True,
    ),
    LayerCase(
        "dropout_function",
        lambda t, p: Function(lm.dropout, rate=0.5, is_training=True, broadcast_dims=(0,)),
        args(normal(4, 5)),
        needs_rng=True,
    ),
    LayerCase(
        "stack",
        lambda t, p: lm.Stack(
            lm.Sequential(lm.Dense(4, 4, **d(t, p)), lm.tanh, lm.LayerNorm(4, **d(t, p))), 3
        ),
        args(normal(3, 4)),
    ),
    LayerCase(
        "stack_remat_dropout",
        lambda t, p: lm.Stack(lm.Dropout(0.5), 2, remat=True),
        args(normal(3, 4)),
        kwargs={"is_training": True},
        needs_rng=True,
    ),
    LayerCase(
        "sequential",
        lambda t, p: lm.Sequential(
            lm.Dense(5, 8, **d(t, p)),
            lm.gelu,
            lm.LayerNorm(8, **d(t, p)),
            lm.Dense(8, 2, **d(t, p)),
        ),
        args(normal(3, 5)),
    ),
]
