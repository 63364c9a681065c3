"""Weights from other libraries: PyTorch state dicts, converted both ways, and the hook."""

from ._registry import register_torch as register_torch
from .torch import from_torch as from_torch
from .torch import to_torch as to_torch
