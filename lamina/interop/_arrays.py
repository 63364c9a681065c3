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
        tensor = value.detach()
        if tensor.is_meta:
            raise ValueError(
                f"lm.from_torch: state_dict[{name!r}] is a meta tensor, a shape without data "
                f"(torch.device('meta'), or loading with low_cpu_mem_usage before the weights "
                f"arrive). Load the real weights into the PyTorch model first."
            )
        tensor = tensor.cpu()
        bits = _bits(torch).get(tensor.dtype)  # NumPy lacks it: reinterpret the bits
        if bits is not None:
            return tensor.view(bits[0]).numpy().view(bits[1])
        try:
            return tensor.numpy()
        except TypeError as error:
            raise TypeError(
                f"lm.from_torch: state_dict[{name!r}] has dtype {tensor.dtype}, which lamina "
                f"cannot import; convert it first, e.g. state_dict[{name!r}].float()."
            ) from error
    raise TypeError(
        f"lm.from_torch: state_dict[{name!r}] is a {type(value).__name__}; expected a torch "
        f"tensor or a NumPy array (what model.state_dict() holds)."
    )


def to_tensor(array: Any) -> Any:
    """A NumPy (or jax) array as a torch tensor that owns its memory."""
    torch = import_torch()
    array = np.array(array, order="C")  # a contiguous copy: the tensor shares no memory
    for torch_dtype, (torch_bits, dtype) in _bits(torch).items():
        if array.dtype == dtype:
            view = np.int16 if torch_bits == torch.int16 else np.uint8
            return torch.from_numpy(array.view(view)).view(torch_dtype)
    return torch.from_numpy(array)


def _bits(torch: Any) -> dict[Any, tuple[Any, Any]]:
    """PyTorch dtypes NumPy lacks: the integer of their width, and JAX's (ml_dtypes) kind."""
    return {
        torch.bfloat16: (torch.int16, jnp.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, jnp.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, jnp.float8_e5m2),
    }
