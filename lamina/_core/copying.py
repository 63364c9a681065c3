"""Copying model objects, as `transform` and `assign_variables` do.

A copy of a model is deep, except for JAX's arrays and functions: they are immutable, so the
copy shares them. Sharing arrays keeps pretrained weights from being duplicated in memory, and
sharing functions (``jax.jit``-compiled ones, ``custom_jvp`` activations such as
``jax.nn.relu``) keeps them the same objects, so a layer that passes one as a static argument
to a compiled kernel hits the same compilation cache after every copy.
"""

from __future__ import annotations

import copy
from typing import Any

import jax


def _is_jax_immutable(value: Any) -> bool:
    if isinstance(value, jax.Array):
        return True
    return callable(value) and type(value).__module__.partition(".")[0] in ("jax", "jaxlib")


def copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """Deep-copies `value`, sharing JAX arrays and functions (also inside lists and dicts)."""
    if _is_jax_immutable(value):
        return value
    kind = type(value)
    if kind not in (list, tuple, dict):
        return copy.deepcopy(value, memo)
    if id(value) in memo:
        return memo[id(value)]
    if kind is tuple:
        result: Any = tuple(copy_value(item, memo) for item in value)
    elif kind is list:
        result = memo[id(value)] = []
        result.extend(copy_value(item, memo) for item in value)
    else:
        result = memo[id(value)] = {}
        for key, item in value.items():
            result[key] = copy_value(item, memo)
    memo[id(value)] = result
    return result


def copy_object(obj: Any, memo: dict[int, Any]) -> Any:
    """`__deepcopy__` for modules and declarations: a new object with copied attributes."""
    result = type(obj).__new__(type(obj))
    memo[id(obj)] = result
    for name, value in vars(obj).items():
        result.__dict__[name] = copy_value(value, memo)
    return result
