"""PyTorch tensors to NumPy arrays and back, bfloat16 included; torch is imported lazily."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def import_torch() -> Any:
    """The `torch` module, or an ImportError that says how to install it."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            "lm.to_torch needs PyTorch, which is not installed: pip install torch (the CPU "
            "build is enough to convert weights)."
        ) from None
    return torch


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def to_numpy(value: Any, name: str) -> np.ndarray:
    """A state dict's entry as a NumPy array (torch tensors copied to the CPU, bfloat16 kept).

    Raises:
        TypeError: If `value` is neither a tensor nor an array.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (jax.Array, np.generic)):
        return np.asarray(value)
    if _is_torch_tensor(value):
        torch = import_torch()
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: reinterpret the bits
            return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
        return tensor.numpy()
    raise TypeError(
        f"lm.from_torch: state_dict[{name!r}] is a {type(value).__name__}; expected a torch "
        f"tensor or a NumPy array (what model.state_dict() holds)."
    )


def to_tensor(array: Any) -> Any:
    """A NumPy (or jax) array as a torch tensor that owns its memory."""
    torch = import_torch()
    array = np.array(array, order="C")  # a contiguous copy: the tensor shares no memory
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
