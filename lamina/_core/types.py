"""Type aliases shared by the core and the layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Shape = tuple[int, ...]
"""An array shape."""

Dtype = Any
"""Anything `jnp.dtype` accepts: ``jnp.float32``, ``"bfloat16"``, a NumPy dtype."""

Initializer = Callable[..., Any]
"""``init(key, shape, dtype) -> array``; every `jax.nn.initializers` function is one."""

Variables = dict[str, Any]
"""``{collection: nested dict of arrays}``, as `init` returns."""
