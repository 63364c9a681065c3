"""Layer-table entries of the convolutions: Conv, ConvTranspose and ConvLocal."""

from __future__ import annotations

import numpy as np

import lamina as lm
from tests.layer_table.case import LayerCase, args, d, normal


def _mask(*shape: int) -> np.ndarray:
    """A fixed boolean mask (booleans keep the inferred compute dtype, as in Linen)."""
    return np.random.default_rng(7).random(shape) < 0.7


LAYERS: list[LayerCase] = [
    LayerCase(
        "conv1d", lambda t, p: lm.Conv(3, 4, (3,), strides=2, **d(t, p)), args(normal(2, 9, 3))
    ),
    LayerCase(
        "conv2d",
        lambda t, p: lm.Conv(3, 4, (3, 3), padding="VALID", **d(t, p)),
        args(normal(2, 6, 6, 3)),
    ),
    LayerCase(
        "conv2d_groups_circular",
        lambda t, p: lm.Conv(4, 6, (3, 3), padding="CIRCULAR", groups=2, **d(t, p)),
        args(normal(2, 5, 5, 4)),
    ),
    LayerCase(
        "conv3d",
        lambda t, p: lm.Conv(2, 3, (2, 2, 2), dilation=(1, 2, 1), **d(t, p)),
        args(normal(1, 4, 5, 4, 2)),
    ),
    LayerCase(
        "conv_transpose2d",
        lambda t, p: lm.ConvTranspose(3, 2, (3, 3), strides=2, **d(t, p)),
        args(normal(2, 4, 4, 3)),
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
