"""A layer-table entry in its inference form, as the export tests build it.

`tests/test_deploy_table.py` (`lm.export`) and `tests/test_deploy_onnx.py`
(`lm.export_onnx`) export every entry of the table the same way: the entry's training flags
(``is_training``, ``update_stats``) set to False, in its call keywords and in a `Function`'s
options; a keyword argument that is data (a batch of lengths) moved to the last input; the
variables drawn with NumPy at the shapes of the entry's ``init`` (`drawn`).
`build_inference_form` builds that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm
from tests.layer_table.case import Function, LayerCase

TRAINING_FLAGS = ("is_training", "update_stats")


class InferenceForm(NamedTuple):
    """What `lm.export` and `lm.export_onnx` take for an entry.

    Attributes:
        model: The entry's layer (float32), a `Function`'s training flags set to False.
        to_callable: The method to export, the call keywords bound (``is_training=False``...).
        variables: NumPy arrays of the shapes of the model's variables (`drawn`).
        inputs: The entry's inputs as NumPy arrays, then the value of ``as_input`` if given.
    """

    model: lm.Module
    to_callable: Callable[[lm.Module], Callable[..., Any]]
    variables: Any
    inputs: tuple


def without_training(options: dict) -> dict:
    """`options` (call keywords, or a `Function`'s) with the training flags set to False."""
    return {k: False if k in TRAINING_FLAGS else v for k, v in options.items()}


def build_inference_form(
    case: LayerCase, as_input: str | None = None, *, keep_layer_flags: bool = False
) -> InferenceForm:
    """`case` built in its inference form (see the module docstring).

    Args:
        case: The table's entry.
        as_input: A keyword of the call whose value (one per sequence of the batch) becomes
            the last input of the exported function instead of a constant.
        keep_layer_flags: Keep a `Function`'s own training flags (the training form, for an
            export that must refuse it, such as dropout fixed in the layer).

    Returns:
        ``(model, to_callable, variables, inputs)``; the inputs are NumPy (no device work).

    Example:
        >>> from tests.layer_table import BY_NAME
        >>> form = build_inference_form(BY_NAME["bidirectional_lengths"], "seq_lengths")
        >>> [x.shape for x in form.inputs]
        [(2, 5, 3), (2,)]
    """
    model = case.make(jnp.float32, None)
    if isinstance(model, Function) and not keep_layer_flags:
        model = Function(model.fn, **without_training(model.options))
    kwargs = without_training(case.kwargs)
    inputs = case.inputs(np.random.default_rng(0), np.float32)
    if as_input is not None:
        inputs = (*inputs, np.asarray(kwargs.pop(as_input)))
    method = case.to_callable or (lambda m: m.__call__)

    def to_callable(m: lm.Module) -> Callable[..., Any]:
        fn = method(m)
        if as_input is None:
            return functools.partial(fn, **kwargs)
        return lambda *args: fn(*args[:-1], **{as_input: args[-1]}, **kwargs)

    init = lm.transform(model, to_callable=to_callable).init
    variables = drawn(jax.eval_shape(init, jax.random.key(0)))
    return InferenceForm(model, to_callable, variables, tuple(inputs))


def drawn(shapes: Any, seed: int = 0) -> Any:
    """Variables of these shapes drawn with NumPy.

    Parameters are normal (halved), other floating variables (statistics: BatchNorm's mean and
    ``var``) uniform in [0.5, 1.5], integer ones zero. The layers' initializers would compile
    JAX's random kernels, seconds per entry; an export is checked on any values.
    """
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: Any) -> np.ndarray:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return np.zeros(leaf.shape, leaf.dtype)
        if path[0].key == "params":
            return (0.5 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        return rng.uniform(0.5, 1.5, leaf.shape).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)
