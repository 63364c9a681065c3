"""One table of layers: a constructor and example inputs per entry.

`tests/test_layers_common.py` runs every check that applies to all layers over this table
(jit, grad with a numeric check, vmap, checkpoint, dtypes, the golden file of variable paths
and shapes). A new layer gets an entry in the file of its family (`linear.py`, `conv.py`,
`norm.py`, `dropout_stack_sequential.py`, `attention.py`, `recurrent.py`, `pool.py`) and
inherits all of them; what an entry is, and the makers of layers and inputs, are in `case.py`.
A public layer (an `lm.Module` subclass, or a function of `lamina.nn`) that has no entry fails
`test_every_public_layer_is_in_the_table`, unless it is in `NOT_LAYERS` with the reason.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tests.layer_table import (
    attention,
    conv,
    dropout_stack_sequential,
    linear,
    norm,
    pool,
    recurrent,
)
from tests.layer_table.case import Function, LayerCase, args, carry, d, ids, normal
from tests.layer_table.inference_form import InferenceForm, build_inference_form, drawn

__all__ = [
    "BY_NAME",
    "IDS",
    "LAYERS",
    "NOT_LAYERS",
    "Function",
    "InferenceForm",
    "LayerCase",
    "args",
    "build_inference_form",
    "carry",
    "cast_inputs",
    "d",
    "drawn",
    "ids",
    "normal",
]

# Public names of `lamina.nn` that are not layers, and why they have no entry in `LAYERS`.
NOT_LAYERS = {
    "Module": "the base class of every layer and model, tested in test_module.py",
    "make_attention_mask": "builds masks, holds nothing; tested against Linen in test_nn_attention",
    "make_causal_mask": "builds masks, holds nothing; tested against Linen in test_nn_attention",
    "combine_masks": "combines masks, holds nothing; tested against Linen in test_nn_attention",
    "merge_lora": "transforms a model and its variables; tested in test_lora.py",
    "LoRAParam": "a kind of Parameter (a declaration), not a layer; tested in test_lora.py",
    "rope_frequencies": "returns NumPy frequencies, holds nothing; tested against transformers "
    "in test_nn_rotary",
}

# The entries, family by family (one file each).
LAYERS: list[LayerCase] = [
    *linear.LAYERS,
    *conv.LAYERS,
    *norm.LAYERS,
    *dropout_stack_sequential.LAYERS,
    *attention.LAYERS,
    *recurrent.LAYERS,
    *pool.LAYERS,
]
BY_NAME = {case.name: case for case in LAYERS}
IDS = [case.name for case in LAYERS]


def cast_inputs(inputs: Any, dtype: Any) -> Any:
    """Floating inputs in `dtype` (bfloat16 through float32); integer ones unchanged."""

    def cast(x: Any) -> Any:
        x = np.asarray(x)
        return jnp.asarray(x, dtype) if np.issubdtype(x.dtype, np.floating) else jnp.asarray(x)

    return jax.tree.map(cast, inputs)
