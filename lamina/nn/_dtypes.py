"""A layer's dtypes: the compute dtype it is built with, or inferred from what it computes on.

Every layer takes ``dtype`` (the compute dtype) and ``param_dtype`` (the storage dtype of its
variables). ``dtype=jnp.float32`` (the default, as in Metoryx) computes in
float32 whatever the inputs; ``dtype=None`` infers it as Flax Linen's ``promote_dtype`` does:
the promotion of the inputs' and the variables' dtypes (at least a float), so bfloat16 inputs
and parameters compute in bfloat16 and complex ones in complex. With ``dtype=None`` the
variables are stored in ``param_dtype`` (default float32, Linen's).

A cast that would lose the imaginary part is never silent: a complex input or variable in a
layer built with a real ``dtype`` is a `TypeError` naming the layer, its path and the dtypes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import as_dtype, format_path
from .._core.types import Dtype


def layer_dtype(where: str, value: Dtype) -> np.dtype | None:
    """A layer's `dtype` setting: a floating or complex dtype, or None (inferred per call)."""
    if value is None:
        return None
    return inexact(where, "dtype", value)


def inexact(where: str, name: str, value: Dtype) -> np.dtype:
    """Returns `value` as a floating or complex dtype; raises `TypeError` otherwise."""
    dtype = as_dtype(where, name, value)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"{where}: {name} must be a floating or complex dtype such as jnp.float32, "
            f"jnp.bfloat16 or jnp.complex64, got {dtype}: weights and activations are not "
            f"integers."
        )
    return dtype


def storage_dtype(where: str, param_dtype: Dtype, dtype: np.dtype | None) -> np.dtype:
    """The storage dtype: `param_dtype` checked, else `dtype`, else float32 (`dtype=None`).

    A complex storage dtype under a real compute dtype is refused: every read would drop the
    imaginary part.
    """
    if param_dtype is None:
        return np.dtype(jnp.float32) if dtype is None else dtype
    stored = inexact(where, "param_dtype", param_dtype)
    if dtype is not None and _is_complex(stored) and not _is_complex(dtype):
        raise TypeError(
            f"{where}: param_dtype={stored} is complex but dtype={dtype} is real: every read "
            f"of the variables would drop their imaginary part. Pass dtype={stored} (or "
            f"dtype=None to compute in the dtype of the inputs and variables)."
        )
    return stored


def compute_dtype(layer: Any, dtype: np.dtype | None, *values: Any) -> np.dtype:
    """The dtype `layer` computes in on `values` (its inputs and variables; None skipped).

    Args:
        layer: The layer, for messages (its ``_describe()`` and path), or a function's name.
        dtype: The layer's `dtype` setting; None infers it from `values`.
        *values: Arrays (or None) whose dtypes take part.

    Raises:
        TypeError: A complex value under a real `dtype`.
    """
    if dtype is None:
        return promote(tuple(jnp.result_type(v) for v in values if v is not None))
    if not _is_complex(dtype):
        for value in values:
            if value is None:
                continue
            # Every layer call comes here, so arrays (and tracers) skip `jnp.result_type`
            # (about 3 microseconds each): only whether the dtype is complex matters, and
            # NumPy's kind "c" says that for every canonicalised or uncanonicalised dtype.
            value_dtype = getattr(value, "dtype", None)
            if isinstance(value_dtype, np.dtype):
                is_complex = value_dtype.kind == "c"
            else:
                value_dtype = jnp.result_type(value)
                is_complex = _is_complex(value_dtype)
            if is_complex:
                value_dtype = jnp.result_type(value)  # canonical, as the message always said
                raise TypeError(
                    f"{layer_name(layer)} got a {value_dtype} value but computes in {dtype} "
                    f"(dtype={dtype}): the cast would drop the imaginary part. Build the "
                    f"layer with dtype={value_dtype}, or dtype=None to compute in the dtype "
                    f"of its inputs and variables."
                )
    return dtype


@functools.cache
def promote(dtypes: tuple[np.dtype, ...]) -> np.dtype:
    """Linen's ``promote_dtype``: the dtypes' promotion, at least float32 for integers."""
    with jax.numpy_dtype_promotion("standard"):
        result = jnp.result_type(*dtypes) if dtypes else np.dtype(jnp.float32)
        if not jnp.issubdtype(result, jnp.inexact):
            result = jnp.promote_types(jnp.float32, result)
    return np.dtype(result)


def _is_complex(dtype: Dtype) -> bool:
    if isinstance(dtype, np.dtype):
        return dtype.kind == "c"  # the same answer as below, without its 1-2 microseconds
    return bool(jnp.issubdtype(dtype, jnp.complexfloating))


def layer_name(layer: Any) -> str:
    """How messages name `layer`: its description and its path in the model (or a given str)."""
    if isinstance(layer, str):
        return layer
    describe = getattr(layer, "_describe", None)
    name = describe() if callable(describe) else type(layer).__name__
    path = getattr(layer, "_lamina_path", None)
    return f"{name} at {format_path(path) if path else 'the root'}"
