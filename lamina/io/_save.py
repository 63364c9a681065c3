"""`save`: variables to a safetensors file, one array shard at a time, atomically.

Everything is checked first (keys, leaves, dtypes, metadata), then the header is laid out
(`_format.layout`), and each tensor's shards are copied from their devices into a memory map
of the preallocated temporary file that `_atomic.atomic_file` renames onto the target.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import CheckpointError, VariablesError
from .._core.graph import FlatKey
from .._core.types import Shape
from ._atomic import atomic_file, check_target, pread, pwrite_all, reserve
from ._format import (
    CHECKSUMS_KEY,
    CODES,
    EMPTY_DICTS_KEY,
    MAX_HEADER_BYTES,
    RESERVED_PREFIX,
    TensorInfo,
    checksum_seed,
    format_checksum,
    layout,
    unsupported_dtype_hint,
)
from ._tree import PathLike, as_path, flatten

__all__ = ["save"]


def save(path: PathLike, variables: Any, *, metadata: Mapping[str, str] | None = None) -> None:
    """Writes variables, or any pytree of arrays, to a safetensors file, atomically.

    Each array is stored under its path (``params/layer1/kernel``; ``opt/0/mu/kernel`` for
    the ``mu`` field of the first state of an Optax chain) in its own dtype (bfloat16,
    float16, integers, bool and complex64 included), with no pickle, and with a CRC-32 of its
    bytes in the header, which `load` verifies. The file is written to a temporary file in
    the same folder, whose disk space is reserved first, flushed to disk and renamed onto
    `path` in one step, so `path` holds either its old contents or the new ones, whole, even
    if the process dies midway or the disk fills. Sharded `jax.Array`s are written one
    addressable shard at a time, so nothing is gathered onto one device or into one host
    buffer. Everything is checked before the file is opened: bad input leaves `path` as it
    was.

    Args:
        path: The file to write (conventionally ``*.safetensors``); its folder must exist.
        variables: ``{collection: nested dict of arrays}`` as `init` returns it, or any pytree
            of arrays: a whole training state such as ``{"variables": variables, "opt":
            opt_state, "step": jnp.asarray(step)}`` is one file. Dict keys must be strings
            without ``/``; lists, tuples and named tuples name their items by index or field.
            `load` rebuilds the structure with ``like=``. Empty dicts and containers are kept
            (in the header's metadata); ``None`` holds no array and comes back only with
            ``like=``.
        metadata: Text stored in the header's ``__metadata__`` (read it back with
            ``safetensors.safe_open(path, "np").metadata()``). Keys starting with ``lamina.``
            are reserved.

    Raises:
        VariablesError: If `variables` is not a pytree of arrays with string keys, holds a
            dtype the format cannot store (complex128, int4, ...), a Python number, a traced
            or deleted array, or an array other processes hold shards of; every problem is
            listed, by path.
        FileNotFoundError: If the folder does not exist.
        IsADirectoryError: If `path` is a folder.
        CheckpointError: If the file cannot be written (a full disk, a quota, a file-size
            limit, no permission): the message names the file and the bytes it needs; the old
            file is untouched and no temporary file is left.

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
    user = _header_metadata(metadata, empty, path)
    placeholder = _checksums_text(dict.fromkeys((name for name, _, _ in tensors), 0))
    header, infos = layout(tensors, {**user, CHECKSUMS_KEY: placeholder})
    if len(header) > MAX_HEADER_BYTES:
        raise VariablesError(
            f"lm.save cannot write {path}: its header (the names, shapes and metadata of "
            f"{len(tensors)} arrays) would take {len(header)} bytes, over the "
            f"{MAX_HEADER_BYTES} that safetensors readers accept; nothing was written. Save "
            f"the collections to separate files."
        )
    path = check_target(path, "lm.save", writable=False)  # no permission: CheckpointError
    by_name = {"/".join(key): leaf for key, leaf in leaves.items()}
    size = len(header) + (infos[-1].end if infos else 0)
    try:
        with atomic_file(path) as file:
            checksums = _write_data(file, len(header), infos, by_name)
            final, _ = layout(tensors, {**user, CHECKSUMS_KEY: _checksums_text(checksums)})
            assert len(final) == len(header)  # fixed-width checksums: the same layout
            pwrite_all(file.fileno(), final, 0)
    except OSError as error:
        raise CheckpointError(_write_failure(path, size, error)) from error


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


def _write_data(
    file: IO[bytes], start: int, infos: list[TensorInfo], arrays: dict[str, Any]
) -> dict[str, int]:
    """Writes every tensor after the header; returns their checksums, read back from the file.

    The file's space is reserved first: then a memory map of it takes each shard in place
    (strided shards included) and cannot fault. Where the file system cannot reserve, the
    shards are written with ordinary writes, one contiguous run of bytes at a time, so that a
    full disk is an `OSError`, never a `SIGBUS`.
    """
    size = start + (infos[-1].end if infos else 0)
    mapped = reserve(file.fileno(), size)
    return {
        info.name: _write_tensor(file, start + info.begin, info, arrays[info.name], mapped)
        for info in infos
    }


def _write_tensor(file: IO[bytes], offset: int, info: TensorInfo, array: Any, mapped: bool) -> int:
    """Writes one tensor's shards at `offset`; returns its checksum, read from the file."""
    if info.begin == info.end:  # no elements, no bytes
        return checksum_seed(info.code, info.shape)
    if mapped:
        return _write_mapped(file, offset, info, array)
    return _write_runs(file.fileno(), offset, info, array)


def _write_mapped(file: IO[bytes], offset: int, info: TensorInfo, array: Any) -> int:
    raw = np.memmap(file, np.uint8, mode="r+", offset=offset, shape=(info.end - info.begin,))
    target = raw.view(info.dtype).reshape(info.shape)
    for index, block in _host_blocks(array):
        target[index] = block
    raw.flush()
    checksum = zlib.crc32(raw.data, checksum_seed(info.code, info.shape))
    del target, raw
    return checksum


def _write_runs(fd: int, offset: int, info: TensorInfo, array: Any) -> int:
    itemsize = info.dtype.itemsize
    for index, block in _host_blocks(array):
        block = np.ascontiguousarray(block, info.dtype)
        for at, run in _runs(info.shape, index, block):
            pwrite_all(fd, run.reshape(-1).view(np.uint8).data, offset + at * itemsize)
    checksum, size, done = checksum_seed(info.code, info.shape), info.end - info.begin, 0
    while done < size:  # read back what the file holds, in chunks of at most 64 MiB
        chunk = pread(fd, min(size - done, 1 << 26), offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"{info.name}: the file ended {size - done} bytes early")
        checksum, done = zlib.crc32(chunk, checksum), done + len(chunk)
    return checksum


def _runs(shape: Shape, index: Any, block: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(element offset, contiguous part of block)`` for each run `block` fills in the tensor.

    `index` (a shard's index: a tuple of slices, or ``()`` for the whole) places `block` in a
    C-ordered tensor of `shape`. Past the last axis that the block does not cover whole, a
    block row lies contiguously in the tensor, so there is one run per index of the axes
    before it: one run for an unsharded array or a shard along the first axis.
    """
    bounds = [
        range(*(index[d] if d < len(index) else slice(None)).indices(n))
        for d, n in enumerate(shape)
    ]
    partial = [d for d, r in enumerate(bounds) if len(r) != shape[d]]
    if not partial:
        yield 0, block
        return
    last = partial[-1]
    strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
    for outer in np.ndindex(*block.shape[:last]):
        at = sum((bounds[d][i]) * strides[d] for d, i in enumerate(outer))
        yield at + bounds[last].start * strides[last], block[outer]


def _checksums_text(checksums: Mapping[str, int]) -> str:
    return json.dumps({name: format_checksum(checksums[name]) for name in sorted(checksums)})


def _write_failure(path: str, size: int, error: OSError) -> str:
    """What `CheckpointError` says when the file could not be written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        stats = os.statvfs(folder)
        free = f", {stats.f_bavail * stats.f_frsize} free on its file system"
    except (OSError, AttributeError):
        free = ""
    if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        advice = "Free space on that disk (or raise your quota), or save to another folder."
    elif error.errno == errno.EFBIG:
        advice = (
            "The file is larger than this process may write: a file-size limit (ulimit -f, "
            "RLIMIT_FSIZE) or the file system's largest file; raise the limit, or save to "
            "another file system."
        )
    else:
        advice = "Check that the folder is writable and the disk healthy."
    return (
        f"lm.save could not write {path} ({size} bytes needed{free}): "
        f"{error.strerror or error}. The file at {path} is as it was before (if there was "
        f"one), and no temporary file was left. {advice}"
    )
