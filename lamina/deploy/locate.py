"""`failing_layer`: the layer a format's error names, found by tracing its calls again.

Shared by `inference.inference_function` (a trace that fails, a key drawn in training mode)
and `onnx_export.export_onnx` (an operation ONNX cannot express: the innermost call whose own
jaxpr holds it). Only on error paths: it traces the model once more, abstractly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core.checks import format_path
from .._core.graph import Plan
from .._core.transform import transform
from ..records.capture import CallFailed, calls


def failing_layer(
    apply: Callable[..., Any],
    variables: Any,
    args: list[Any],
    matches: Callable[[Any], bool] | None = None,
) -> str:
    """``<Layer> at <path>`` of the innermost module call that fails, or ``""``.

    The call ``apply(variables, None, *args)`` is traced abstractly (`records.capture.calls`);
    a failing call names its innermost module. When nothing fails and `matches` is given
    (a predicate on a jaxpr), the innermost call whose own jaxpr matches is named (each call
    traced alone, its variables as shapes): where a format meets an operation it cannot hold.
    Only on error paths.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.deploy.locate import failing_layer
        >>> model = lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 2))
        >>> init, apply = lm.transform(model)
        >>> variables = jax.eval_shape(init, jax.random.key(0))
        >>> failing_layer(apply, variables, [jnp.ones((1, 5))])
        'Dense at layers_0'
    """
    try:
        recorded = calls(apply)(variables, None, *args)
    except CallFailed as failed:
        if failed.path is not None and failed.module is not None:
            return f"{type(failed.module).__name__} at {format_path(failed.path)}"
        return ""
    except Exception:
        return ""
    found = None
    for call in recorded:
        if matches is None:
            break
        if (found is None or len(call.path) > len(found.path)) and _call_matches(call, matches):
            found = call
    return "" if found is None else f"{type(found.module).__name__} at {format_path(found.path)}"


def _call_matches(call: Any, matches: Callable[[Any], bool]) -> bool:
    """Whether the jaxpr of one recorded call, traced alone, `matches`."""
    try:
        plan = Plan(call.module)
        shapes = [jax.ShapeDtypeStruct(e.shape, e.state.param_dtype) for e in plan.variables]
        leaves, treedef = jax.tree_util.tree_flatten((call.args, call.kwargs))
        is_array = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]
        apply = transform(call.module).apply

        def run(variables: Any, arrays: list) -> Any:
            it = iter(arrays)
            merged = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, merged)
            return apply(variables, None, *args, **kwargs)

        arrays = [leaf for leaf, a in zip(leaves, is_array, strict=True) if a]
        return bool(matches(jax.make_jaxpr(run)(plan.treedef.unflatten(shapes), arrays)))
    except Exception:
        return False
