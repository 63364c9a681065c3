"""`save`: variables to a safetensors file, one array shard at a time, atomically.

Everything is checked first (keys, leaves, dtypes, metadata), then the header is laid out
(`_format.layout`), and each tensor's shards are copied from their devices into a memory map
of the preallocated temporary file that `_atomic.atomic_file` renames onto the target.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import VariablesError
from .._core.graph import FlatKey
from ._atomic import atomic_file
from ._format import (
    CODES,
    EMPTY_DICTS_KEY,
    MAX_HEADER_BYTES,
    RESERVED_PREFIX,
    TensorInfo,
    layout,
    unsupported_dtype_hint,
)
from ._tree import PathLike, as_path, flatten

__all__ = ["save"]


def save(
    path: PathLike, variables: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None
) -> None:
    """Writes variables to a safetensors file, atomically.

    Each array is stored under its path (``params/layer1/kernel``) in its own dtype (bfloat16,
    float16, integers, bool and complex64 included), with no pickle. The file is written to a
    temporary file in the same folder, flushed to disk and renamed onto `path` in one step, so
    `path` holds either its old contents or the new ones, whole, even if the process dies
    midway. Sharded `jax.Array`s are written one addressable shard at a time, so nothing is
    gathered onto one device or into one host buffer. Everything is checked before the file
    is opened: bad input leaves `path` as it was.

    Args:
        path: The file to write (conventionally ``*.safetensors``); its folder must exist.
        variables: ``{collection: nested dict of arrays}`` as `init` returns it; any nested
            dict of arrays with string keys (no ``/`` in them) is accepted. Empty dicts are
            kept (in the header's metadata).
        metadata: Text stored in the header's ``__metadata__`` (read it back with
            ``safetensors.safe_open(path, "np").metadata()``). Keys starting with ``lamina.``
            are reserved.

    Raises:
        VariablesError: If `variables` is not a nested dict of arrays with string keys, holds
            a dtype the format cannot store (complex128, int4, ...), a traced or deleted array,
            or an array other processes hold shards of; every problem is listed, by path.
        FileNotFoundError: If the folder does not exist.

    Example:
        >>> import os, tempfile, jax, lamina as lm
        >>> model = lm.Dense(2, 3)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "model.safetensors")
        >>> lm.save(path, variables)
        >>> lm.load(path, model)["params"]["kernel"].shape
        (2, 3)
        >>> folder.cleanup()
    """
    path = as_path(path, "lm.save")
    leaves, empty = flatten(variables, "lm.save's variables", "; nothing was written")
    problems, tensors = [], []
    for key, leaf in leaves.items():
        name = "/".join(key)
        problem = _leaf_problem(leaf)
        if problem is not None:
            problems.append(f"{name}: {problem}")
        else:
            tensors.append((name, _dtype_of(leaf), tuple(leaf.shape)))
    if problems:
        raise VariablesError(
            f"lm.save cannot write {path}; nothing was written:\n  "
            + "\n  ".join(problems[:10])
            + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        )
    header, infos = layout(tensors, _header_metadata(metadata, empty, path))
    if len(header) > MAX_HEADER_BYTES:
        raise VariablesError(
            f"lm.save cannot write {path}: its header (the names, shapes and metadata of "
            f"{len(tensors)} arrays) would take {len(header)} bytes, over the "
            f"{MAX_HEADER_BYTES} that safetensors readers accept; nothing was written. Save "
            f"the collections to separate files."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"lm.save: the folder {folder} does not exist (create it first)")
    if os.path.isdir(path):
        raise IsADirectoryError(f"lm.save: {path} is a folder; give a file name")
    by_name = {"/".join(key): leaf for key, leaf in leaves.items()}
    with atomic_file(path) as file:
        file.write(header)
        file.truncate(len(header) + (infos[-1].end if infos else 0))
        for info in infos:
            _write_tensor(file, len(header) + info.begin, info, by_name[info.name])


def _leaf_problem(leaf: Any) -> str | None:
    """Why `leaf` cannot be written, or None."""
    if isinstance(leaf, jax.core.Tracer):
        return (
            "a traced value (lm.save ran inside jax.jit, grad or vmap); save the concrete "
            "variables outside the transformed function"
        )
    if isinstance(leaf, jax.Array):
        if leaf.is_deleted():
            return "a deleted array (donated to a jitted function?); save before donating"
        if not leaf.is_fully_addressable:
            return (
                "an array with shards in other processes; lm.save writes from one process: "
                "use Orbax for multi-process checkpoints (see docs/checkpoints.md)"
            )
    elif isinstance(leaf, (list, tuple)):
        return (
            f"a {type(leaf).__name__}; variables hold sequences as dicts keyed '0', '1', ... "
            f"(as init returns them): use {{str(i): x for i, x in enumerate(items)}}"
        )
    elif isinstance(leaf, jax.ShapeDtypeStruct):
        return (
            f"a ShapeDtypeStruct (shape {leaf.shape}, {leaf.dtype}) describes an array without "
            f"holding one (jax.eval_shape's output?); save the arrays that init returns"
        )
    elif isinstance(leaf, np.ma.MaskedArray):
        return (
            "a NumPy masked array, whose mask the file cannot keep; save leaf.filled(value) "
            "and, if it matters, the mask (np.ma.getmaskarray(leaf)) as two arrays"
        )
    elif not isinstance(leaf, (np.ndarray, np.generic)):
        return (
            f"{type(leaf).__name__} {leaf!r:.40} is not an array; wrap numbers with "
            f"jnp.asarray(x, dtype) to choose their dtype"
        )
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return "a typed PRNG key array; save jax.random.key_data(key) instead"
    dtype = np.dtype(leaf.dtype)
    if dtype.newbyteorder("=") not in CODES:
        return f"dtype {dtype.name} has no safetensors type; {unsupported_dtype_hint(dtype)}"
    return None


def _dtype_of(leaf: Any) -> np.dtype:
    return np.dtype(leaf.dtype).newbyteorder("=")


def _header_metadata(
    metadata: Mapping[str, str] | None, empty: list[FlatKey], path: str
) -> dict[str, str]:
    result: dict[str, str] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(
                f"lm.save({path!r}): metadata must be a dict of str to str, got "
                f"{type(metadata).__name__}; nothing was written"
            )
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"lm.save({path!r}): metadata must map str to str, got {key!r}: {value!r}; "
                    f"convert values with str() or json.dumps. Nothing was written."
                )
            if key.startswith(RESERVED_PREFIX):
                raise ValueError(
                    f"lm.save({path!r}): metadata key {key!r} starts with {RESERVED_PREFIX!r}, "
                    f"which lamina reserves; choose another name. Nothing was written."
                )
            result[key] = value
    if empty:
        result[EMPTY_DICTS_KEY] = json.dumps([list(key) for key in empty])
    return result


def _host_blocks(array: Any) -> Iterator[tuple[Any, np.ndarray]]:
    """``(index, block)`` pairs that cover `array`, one device shard at a time on the host."""
    if isinstance(array, (np.ndarray, np.generic)):
        yield (), np.asarray(array)
        return
    for shard in array.addressable_shards:
        if shard.replica_id == 0:  # replicas hold the same values: write one of them
            yield shard.index, np.asarray(shard.data)


def _write_tensor(file: IO[bytes], offset: int, info: TensorInfo, array: Any) -> None:
    if info.begin == info.end:
        return  # no elements, no bytes
    target = np.memmap(file, dtype=info.dtype, mode="r+", offset=offset, shape=info.shape)
    for index, block in _host_blocks(array):
        target[index] = block
    target.flush()
    del target
