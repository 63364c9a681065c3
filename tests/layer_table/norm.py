"""Layer-table entries of the normalisations, the weight normalisations included.

The entries with options combine several of them, to keep the table's time down; their
equality with Linen is in tests/test_nn_norm.py and tests/test_nn_weight_normalization.py.
"""

from __future__ import annotations

import numpy as np

import lamina as lm
from tests.layer_table.case import Function, LayerCase, args, d, normal

# Fixed masks (the table's inputs are floats). LayerNorm's: some entries of rows 1 and 2 do
# not count; BatchNorm reduces the batch axis: example 2 of 4 does not count.
MASK = np.array([[True] * 4, [True, True, False, False], [True, False, True, False]])
BATCH_MASK = np.array([True, True, False, True])[:, None, None]

LAYERS: list[LayerCase] = [
    LayerCase(
        "batch_norm_train",
        lambda t, p: lm.BatchNorm(4, momentum=0.9, **d(t, p)),
        args(normal(6, 4)),
        kwargs={"is_training": True},
    ),
    LayerCase(
        "batch_norm_eval",
        lambda t, p: lm.BatchNorm(4, **d(t, p)),
        args(normal(2, 3, 3, 4)),
        kwargs={"is_training": False},
    ),
    LayerCase("layer_norm", lambda t, p: lm.LayerNorm(5, **d(t, p)), args(normal(3, 5))),
    LayerCase("rms_norm", lambda t, p: lm.RMSNorm(5, **d(t, p)), args(normal(2, 3, 5))),
    LayerCase(
        "rms_norm_gemma_offset",
        lambda t, p: lm.RMSNorm(5, scale_offset=1.0, epsilon=1e-5, **d(t, p)),
        args(normal(2, 3, 5)),
    ),
    LayerCase(
        "rms_norm_llama_order_two_axes",
        lambda t, p: lm.RMSNorm(
            (3, 4),
            reduction_axes=(1, 2),
            feature_axes=(-2, -1),
            scale_in_input_dtype=True,
            **d(t, p),
        ),
        args(normal(2, 3, 4)),
    ),
    LayerCase("group_norm", lambda t, p: lm.GroupNorm(2, 4, **d(t, p)), args(normal(2, 3, 3, 4))),
    LayerCase(
        "instance_norm", lambda t, p: lm.InstanceNorm(4, **d(t, p)), args(normal(2, 3, 3, 4))
    ),
    LayerCase(
        "layer_norm_two_axes_mask",
        lambda t, p: Function(
            lm.LayerNorm((3, 4), reduction_axes=(1, 2), feature_axes=(-2, -1), **d(t, p)),
            mask=MASK,
        ),
        args(normal(2, 3, 4)),
    ),
    LayerCase(
        "group_norm_group_size_two_pass",
        lambda t, p: lm.GroupNorm(None, 6, group_size=3, use_fast_variance=False, **d(t, p)),
        args(normal(2, 4, 6)),
    ),
    LayerCase(
        "batch_norm_two_axes_mask_two_pass",
        lambda t, p: Function(
            lm.BatchNorm((3, 5), axis=(1, 2), momentum=0.9, use_fast_variance=False, **d(t, p)),
            is_training=True,
            mask=BATCH_MASK,
        ),
        args(normal(4, 3, 5)),
    ),
    # Enough power iteration to converge: the singular vectors are not differentiated (as in
    # Linen), which the finite differences only agree with at convergence.
    LayerCase(
        "spectral_norm_dense",
        lambda t, p: lm.SpectralNorm(lm.Dense(5, 4, **d(t, p)), n_steps=40, **d(t, p)),
        args(normal(3, 5)),
        kwargs={"update_stats": True},
    ),
    LayerCase(
        "weight_norm_conv_whole",
        lambda t, p: lm.WeightNorm(lm.Conv(3, 4, (3, 3), **d(t, p)), feature_axes=None, **d(t, p)),
        args(normal(2, 5, 5, 3)),
    ),
]
