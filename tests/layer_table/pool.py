"""Layer-table entries of pooling: max_pool, min_pool, avg_pool and the generic pool."""

from __future__ import annotations

from jax import lax

import lamina as lm
from tests.layer_table.case import Function, LayerCase, args, normal

LAYERS: list[LayerCase] = [
    LayerCase(
        "max_pool",
        lambda t, p: Function(lm.max_pool, kernel_size=(2, 2), strides=2),
        args(normal(2, 4, 6, 3)),
    ),
    LayerCase(
        "min_pool_int_window",
        lambda t, p: Function(lm.min_pool, kernel_size=3, padding="SAME"),
        args(normal(2, 5, 3)),
    ),
    LayerCase(
        "avg_pool",
        lambda t, p: Function(
            lm.avg_pool, kernel_size=(3, 3), padding="SAME", count_include_pad=False
        ),
        args(normal(2, 4, 4, 3)),
    ),
    LayerCase(
        "pool_sum_padded",
        lambda t, p: Function(
            lm.pool, init=0.0, reduce_fn=lax.add, kernel_size=(2, 2), padding=((1, 0), (0, 1))
        ),
        args(normal(2, 4, 4, 3)),
    ),
]
