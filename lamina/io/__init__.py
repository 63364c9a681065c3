"""Checkpoints: variables to and from safetensors files (`save`, `load`).

The file format and its dtype table are in `_format.py`, the atomic write in `_atomic.py`.
"""

from .._core.errors import CheckpointError as CheckpointError
from ._load import load as load
from ._save import save as save
