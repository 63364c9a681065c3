"""One table of layers: a constructor and example inputs per entry.

`tests/test_layers_common.py` runs every check that applies to all layers over this table
(jit, grad with a numeric check, vmap, checkpoint, dtypes, the golden file of variable paths
and shapes). A new layer gets an entry here and inherits all of them; a public layer (an
`lm.Module` subclass, or a function of `lamina.nn`) that has none fails
`test_every_public_layer_is_in_the_table`, unless it is in `NOT_LAYERS` with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

import lamina as lm


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """A layer and how to call it.

    Attributes:
        name: The entry's id (also its key in the golden file).
        make: ``make(dtype, param_dtype) -> module``.
        inputs: ``inputs(rng, dtype) -> tuple`` of positional call arguments (arrays, or
            pytrees of arrays).
        kwargs: Static keyword arguments of the call (``is_training``...).
        to_callable: Which method apply runs (default ``__call__``).
        needs_rng: The call draws random keys (dropout).
        differentiable_inputs: Gradients with respect to the inputs make sense (not ids).
        output_in_dtype: The outputs come out in the compute dtype (the recurrent cells keep
            their carry, and so their outputs, in the storage dtype, as Linen's do).
    """

    name: str
    make: Callable[[Any, Any], lm.Module]
    inputs: Callable[[np.random.Generator, Any], tuple]
    kwargs: dict = dataclasses.field(default_factory=dict)
    to_callable: Callable | None = None
    needs_rng: bool = False
    differentiable_inputs: bool = True
    output_in_dtype: bool = True


def normal(*shape):
    def make(rng, dtype):
        return rng.standard_normal(shape).astype(dtype)

    return make


def args(*makers):
    return lambda rng, dtype: tuple(m(rng, dtype) for m in makers)


def ids(*shape, high=10):
    return lambda rng, dtype: rng.integers(0, high, shape).astype(np.int32)


def carry(*shape, lstm=True):
    def make(rng, dtype):
        one = lambda: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
        return (one(), one()) if lstm else one()

    return make


def d(dtype, param_dtype):
    return {"dtype": dtype, "param_dtype": param_dtype}


class Function(lm.Module):
    """A layer function (`lm.max_pool`, `lm.dropout`...) as a module, with fixed options."""

    def __init__(self, fn, **options):
        super().__init__()
        self.fn = fn
        self.options = options

    def __call__(self, *inputs):
        return self.fn(*inputs, **self.options)


# Public names of `lamina.nn` that are not layers, and why they have no entry in `LAYERS`.
NOT_LAYERS = {
    "Module": "the base class of every layer and model, tested in test_module.py",
    "make_attention_mask": "builds masks, holds nothing; tested against Linen in test_nn_attention",
    "make_causal_mask": "builds masks, holds nothing; tested against Linen in test_nn_attention",
    "combine_masks": "combines masks, holds nothing; tested against Linen in test_nn_attention",
    "merge_lora": "transforms a model and its variables; tested in test_lora.py",
    "LoRAParam": "a kind of Parameter (a declaration), not a layer; tested in test_lora.py",
}


LAYERS = [
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
    LayerCase("group_norm", lambda t, p: lm.GroupNorm(2, 4, **d(t, p)), args(normal(2, 3, 3, 4))),
    LayerCase(
        "dropout",
        lambda t, p: lm.Dropout(0.3),
        args(normal(4, 5)),
        kwargs={"is_training": True},
        needs_rng=True,
    ),
    LayerCase(
        "attention_self",
        lambda t, p: lm.MultiHeadAttention(2, 8, qkv_size=8, **d(t, p)),
        args(normal(2, 5, 8)),
    ),
    LayerCase(
        "attention_cross_causal",
        lambda t, p: lm.MultiHeadAttention(2, 6, qkv_size=4, out_size=3, key_size=5, **d(t, p)),
        args(normal(2, 4, 6), normal(2, 4, 5)),
        kwargs={"causal": True},
    ),
    LayerCase(
        "attention_dropout",
        lambda t, p: lm.MultiHeadAttention(2, 4, dropout_rate=0.5, **d(t, p)),
        args(normal(2, 3, 4)),
        kwargs={"is_training": True},
        needs_rng=True,
    ),
    LayerCase(
        "lstm_cell",
        lambda t, p: lm.LSTMCell(3, 4, **d(t, p)),
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
    LayerCase(
        "lora_dense",
        lambda t, p: lm.LoRA(
            lm.Dense(5, 4, **d(t, p)), rank=2, alpha=4.0, b_init=lm.initializers.normal(0.5)
        ),
        args(normal(3, 5)),
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
        "lora_conv",
        lambda t, p: lm.LoRA(
            lm.Conv(3, 4, (3, 3), **d(t, p)), rank=2, b_init=lm.initializers.normal(0.5)
        ),
        args(normal(2, 5, 5, 3)),
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

LAYERS += [
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
        "dropout_function",
        lambda t, p: Function(lm.dropout, rate=0.5, is_training=True, broadcast_dims=(0,)),
        args(normal(4, 5)),
        needs_rng=True,
    ),
    LayerCase(
        "dot_product_attention",
        lambda t, p: Function(lm.dot_product_attention),
        args(normal(2, 5, 2, 4), normal(2, 3, 2, 4), normal(2, 3, 2, 6)),
    ),
]

# The entries of layer families kept in their own files (one table: they join it here).
from tests import table_attention, table_linear, table_norm, table_recurrent  # noqa: E402

for _part in (table_linear, table_norm, table_recurrent, table_attention):
    LAYERS += _part.LAYERS
    NOT_LAYERS.update(_part.NOT_LAYERS)

BY_NAME = {case.name: case for case in LAYERS}
IDS = [case.name for case in LAYERS]


def cast_inputs(inputs, dtype):
    """Floating inputs in `dtype` (bfloat16 through float32); integer ones unchanged."""

    def cast(x):
        x = np.asarray(x)
        return jnp.asarray(x, dtype) if np.issubdtype(x.dtype, np.floating) else jnp.asarray(x)

    import jax

    return jax.tree.map(cast, inputs)
