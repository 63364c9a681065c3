"""Layer-table entries of the linear and convolution layers of issue 12 (in `layer_table.py`)."""

from __future__ import annotations

import numpy as np

import lamina as lm
from tests.layer_table import LayerCase, args, d, normal


def _mask(*shape: int) -> np.ndarray:
    """A fixed boolean mask (booleans keep the inferred compute dtype, as in Linen)."""
    return np.random.default_rng(7).random(shape) < 0.7


LAYERS: list[LayerCase] = [
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
        "conv_masked_input_dilation",
        lambda t, p: lm.Conv(
            3, 4, (3, 2), input_dilation=(2, 1), mask=_mask(3, 2, 3, 4), **d(t, p)
        ),
        args(normal(2, 4, 5, 3)),
    ),
    LayerCase(
        "conv_transpose_masked",
        lambda t, p: lm.ConvTranspose(3, 2, 3, strides=2, mask=_mask(3, 3, 2), **d(t, p)),
        args(normal(2, 4, 3)),
    ),
    LayerCase(
        "conv_local_2d_masked",
        lambda t, p: lm.ConvLocal(
            2, 3, (2, 2), (4, 5), padding="VALID", mask=_mask(3, 4, 8, 3), **d(t, p)
        ),
        args(normal(2, 4, 5, 2)),
    ),
]
NOT_LAYERS: dict[str, str] = {}
