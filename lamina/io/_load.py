"""`load`: variables from a safetensors file, checked against a model, read slice by slice.

The `safetensors` package validates the file (header, dtypes, offsets); the model's plan is
compared with the header before any data is read; then each array is read from a memory map
of the file, whole or, with shardings, one device's slice at a time.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any, NamedTuple

import jax
import numpy as np
import safetensors

from .._core.errors import CheckpointError, VariablesError, format_list
from .._core.graph import FlatKey, Plan
from .._core.layout import check_variables, nest
from .._core.module import Module
from ._format import DTYPES, EMPTY_DICTS_KEY, TensorInfo, read_entries
from ._tree import PathLike, as_path, flatten

__all__ = ["load"]


def load(path: PathLike, model: Module | None = None, *, shardings: Any = None) -> dict[str, Any]:
    """Reads variables from a safetensors file (one that `save` wrote, or any other).

    With `model`, every path, shape and dtype in the file is checked against the model before
    any data is read, and one error lists every mismatch. With `shardings`, each array is
    created sharded (`jax.make_array_from_callback`): every device reads only its own slice
    from the memory-mapped file, so no array passes whole through one device.

    Args:
        path: The file.
        model: The model the variables are for. Its variables must all be in the file, with
            the same shapes and storage dtypes (``param_dtype``), and the file must hold
            nothing else. The result then has exactly the structure `init` returns.
        shardings: Where the arrays go: one `jax.sharding.Sharding` for all of them, or a tree
            of them shaped like the variables (as `lm.shardings` returns), with an entry for
            every array. None puts each array on the default device.

    Returns:
        ``{collection: nested dict of jax.Array}``: tensor names split at ``/``.

    Raises:
        FileNotFoundError: If there is no file at `path`.
        CheckpointError: If the file is not a readable safetensors file (truncated, corrupted
            or of another format), or holds a type this JAX cannot (64-bit types without
            ``jax_enable_x64``, float4 and float6).
        VariablesError: If the file does not match `model`, or `shardings` does not match the
            variables.

    Example:
        >>> import os, tempfile, jax, lamina as lm
        >>> model = lm.Dense(2, 3)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "model.safetensors")
        >>> lm.save(path, variables)
        >>> loaded = lm.load(path, model)
        >>> bool((loaded["params"]["kernel"] == variables["params"]["kernel"]).all())
        True
        >>> folder.cleanup()
    """
    path = as_path(path, "lm.load")
    if not os.path.exists(path):
        raise FileNotFoundError(f"lm.load: no checkpoint at {path} (no such file)")
    if os.path.isdir(path):
        raise IsADirectoryError(f"lm.load: {path} is a folder, not a safetensors file")
    with open(path, "rb") as file:
        start, tensors, user_metadata = _read_header(path, file)
        keys = _tensor_keys(path, tensors)
        plan = None
        if model is not None:
            plan = Plan(model)
            _check_against_plan(plan, path, keys, tensors)
        _check_types(path, tensors)
        empty = [] if plan is not None else _empty_dicts(path, user_metadata)
        placement = _placements(shardings, keys, tensors)
        arrays = {
            key: _read_array(file, start + info.begin, info, placement.get(key))
            for key, info in zip(keys, tensors, strict=True)
        }
    if plan is not None:
        return nest((entry.key, arrays[entry.key]) for entry in plan.variables)
    tree = nest(sorted(arrays.items()))
    for empty_path in empty:
        node = tree
        for part in empty_path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CheckpointError(
                    f"{path}: its metadata marks {'/'.join(empty_path)} as an empty dict, but "
                    f"a tensor has that name; the file was not written by lm.save."
                )
    return tree


def _read_header(path: str, file: IO[bytes]) -> tuple[int, list[TensorInfo], dict[str, str]]:
    """Validates the file with the `safetensors` package and returns its tensors in name order."""
    try:
        with safetensors.safe_open(path, framework="np") as reader:
            metadata = reader.metadata() or {}
            described = {}
            for name in reader.keys():  # noqa: SIM118 - a safe_open, not a dict
                view = reader.get_slice(name)
                described[name] = (view.get_dtype(), tuple(view.get_shape()))
    except safetensors.SafetensorError as error:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({error}). It may be truncated (an "
            f"interrupted copy or download), corrupted, or in another format (a pickle, an "
            f"Orbax folder, an .npz); lm.load reads files that lm.save or the safetensors "
            f"package wrote."
        ) from error
    try:
        start, entries = read_entries(file, os.fstat(file.fileno()).st_size)
        if {name: (e.code, e.shape) for name, e in entries.items()} != described:
            raise ValueError("its tensors differ from those just validated")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{path} changed while it was being opened ({error}); load it again."
        ) from error
    tensors = [entries[name] for name in sorted(entries)]
    return start, tensors, metadata


def _tensor_keys(path: str, tensors: list[TensorInfo]) -> list[FlatKey]:
    keys = []
    for info in tensors:
        key = tuple(info.name.split("/"))
        if not all(key):
            raise CheckpointError(
                f"{path}: tensor name {info.name!r} has an empty part between '/'s, so it is "
                f"not a variables path; read the file with safetensors.safe_open instead."
            )
        keys.append(key)
    names = set(keys)
    for key in keys:
        for i in range(1, len(key)):
            if key[:i] in names:
                raise CheckpointError(
                    f"{path}: {'/'.join(key[:i])} is a tensor and also a folder of "
                    f"{'/'.join(key)}, so the names do not form a tree; read the file with "
                    f"safetensors.safe_open instead."
                )
    return keys


def _check_against_plan(
    plan: Plan, path: str, keys: list[FlatKey], tensors: list[TensorInfo]
) -> None:
    """Raises one `VariablesError` listing every difference between the file and the model."""
    # Unknown type codes compare as their code (never equal to a dtype); _check_types names them.
    found = {
        key: _Described(info.shape, DTYPES.get(info.code, info.code))
        for key, info in zip(keys, tensors, strict=True)
    }
    check_variables(
        plan,
        found,
        f"lm.load of {path}",
        dtypes=True,
        hint="Was it saved from another model, or another version of this one? lm.load(path) "
        "without a model reads it as it is; carry the matching weights over with "
        "lm.assign_variables, and cast dtypes with jax.tree.map.",
    )


class _Described(NamedTuple):
    """A tensor of the file as the plan check sees it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: Any


def _check_types(path: str, tensors: list[TensorInfo]) -> None:
    unknown = [f"{i.name} ({i.code})" for i in tensors if i.code not in DTYPES]
    if unknown:
        raise CheckpointError(
            f"{path} holds types JAX has no arrays for: {format_list(unknown)}; read them with "
            f"safetensors.safe_open and unpack them yourself."
        )
    if not jax.config.read("jax_enable_x64"):
        wide = [
            f"{i.name} ({DTYPES[i.code].name})"
            for i in tensors
            if DTYPES[i.code] in (np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.uint64))
        ]
        if wide:
            raise CheckpointError(
                f"{path} holds 64-bit arrays, which JAX keeps only with jax_enable_x64 (it "
                f"would silently narrow them to 32 bits): {format_list(wide)}. Enable it with "
                f'jax.config.update("jax_enable_x64", True), or save 32-bit arrays.'
            )


def _placements(
    shardings: Any, keys: list[FlatKey], tensors: list[TensorInfo]
) -> dict[FlatKey, jax.sharding.Sharding]:
    """Each key's sharding, checked against the keys and shapes before anything is read."""
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        given: dict[FlatKey, Any] = dict.fromkeys(keys, shardings)
    else:
        given, _ = flatten(shardings, "lm.load's shardings")
        missing = ["/".join(k) for k in keys if k not in given]
        unexpected = ["/".join(k) for k in given if k not in set(keys)]
        wrong = [
            f"{'/'.join(k)}: {v!r:.40}"
            for k, v in given.items()
            if not isinstance(v, jax.sharding.Sharding)
        ]
        problems = [
            f"{label} ({len(items)}): {format_list(items)}"
            for label, items in [
                ("no sharding for", missing),
                ("no such variable", unexpected),
                ("not a jax.sharding.Sharding", wrong),
            ]
            if items
        ]
        if problems:
            raise VariablesError(
                "lm.load's shardings do not match the variables:\n  "
                + "\n  ".join(problems)
                + "\nGive one sharding per variable (lm.shardings(model, mesh, rules) builds "
                "them; a PartitionSpec needs its mesh: NamedSharding(mesh, spec)), or one "
                "Sharding for all."
            )
    for key, info in zip(keys, tensors, strict=True):
        try:
            given[key].check_compatible_aval(info.shape)
            given[key].shard_shape(info.shape)
        except (ValueError, TypeError) as error:
            raise VariablesError(
                f"lm.load: the sharding for {'/'.join(key)} does not fit its shape "
                f"{info.shape}: {error}"
            ) from error
    return given


def _read_block(source: np.ndarray, index: Any) -> np.ndarray:
    """Copies ``source[index]`` out of the memory-mapped file (only those bytes are read)."""
    block = np.array(source[index])
    return block.astype(block.dtype.newbyteorder("="), copy=False)


def _read_array(
    file: IO[bytes], offset: int, info: TensorInfo, sharding: jax.sharding.Sharding | None
) -> jax.Array:
    if info.begin == info.end:
        source = np.zeros(info.shape, info.dtype)  # no bytes to map
    else:
        source = np.memmap(file, dtype=info.dtype, mode="r", offset=offset, shape=info.shape)
    if sharding is None:
        return jax.device_put(_read_block(source, ()))
    return jax.make_array_from_callback(
        info.shape, sharding, lambda index: _read_block(source, index)
    )


def _empty_dicts(path: str, metadata: dict[str, str]) -> list[FlatKey]:
    text = metadata.get(EMPTY_DICTS_KEY)
    if text is None:
        return []
    try:
        paths = json.loads(text)
        if not all(isinstance(p, list) and all(isinstance(k, str) for k in p) for p in paths):
            raise ValueError("not a list of paths")
    except (ValueError, TypeError) as error:
        raise CheckpointError(
            f"{path}: its metadata entry {EMPTY_DICTS_KEY!r} is not a JSON list of paths "
            f"({error}); the file was not written by lm.save, or was edited."
        ) from error
    return [tuple(p) for p in paths]
