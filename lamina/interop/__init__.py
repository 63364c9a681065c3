"""Weights from other libraries: PyTorch state dicts to lamina variables and back.

A reader of the plan beside `io/`: the model's `Plan` says which modules it holds, and each
module with a converter (`_registry.py`, `register_torch`) reads and writes its own PyTorch
tensors. `torch.py` holds `from_torch`/`to_torch`, `_naming.py` where each layer finds its
tensors, `_layers.py` and `_recurrent.py` the built-in converters, `_arrays.py` the tensor
conversions. It imports the core and the layers (`nn`), which it converts.
"""

from ._registry import register_torch as register_torch
from .torch import from_torch as from_torch
from .torch import to_torch as to_torch
