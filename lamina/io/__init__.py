"""Checkpoints: variables to and from safetensors files (`save`, `load`).

A reader of the plan beside `interop/`: given a model, `load` checks a file's arrays
against its declarations (the `Plan`: paths, shapes, dtypes) before it reads them, slice by
slice; `save` writes any pytree of arrays. `_save.py` and `_load.py` hold the two directions,
`_format.py` the file format and its dtype table, `_atomic.py` the atomic write and
`_tree.py` the flat names of a pytree. It imports the core only.
"""

from .._core.errors import CheckpointError as CheckpointError
from ._load import load as load
from ._save import save as save
