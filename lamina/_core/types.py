"""Type aliases shared by the core and the layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

Shape = tuple[int, ...]
"""An array shape."""

Dtype = Any
"""Anything `jnp.dtype` accepts: ``jnp.float32``, ``"bfloat16"``, a NumPy dtype."""

Initializer = Callable[..., Any]
"""``init(key, shape, dtype) -> array``; every `jax.nn.initializers` function is one."""

Variables = dict[str, Any]
"""``{collection: nested dict of arrays}``, as `init` returns."""

Key = str | int
"""One step of a path through the module tree: an attribute name or dict key, a list index."""

Path = tuple[Key, ...]
"""Keys from the model root to a module or a variable."""

PrecisionLike = (
    None
    | str
    | lax.Precision
    | tuple[str, str]
    | tuple[lax.Precision, lax.Precision]
    | lax.DotAlgorithm
    | lax.DotAlgorithmPreset
)
"""What a layer's ``precision`` takes: None, a `jax.lax.Precision` or its name, a pair of them
(one per operand), or a `jax.lax.DotAlgorithm` or ``DotAlgorithmPreset``."""

PaddingLike = str | int | Sequence[int | Sequence[int]]
"""A convolution's or pool's ``padding``: ``"SAME"``/``"VALID"``/``"CIRCULAR"``..., one int for
every side, or per spatial axis an int or a ``(low, high)`` pair."""
