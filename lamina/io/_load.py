"""`load`: variables from a safetensors file, checked against a model, read slice by slice.

The `safetensors` package validates the file (header, dtypes, offsets); the model's plan is
compared with the header before any data is read; then each array is read from a memory map
of the file, whole or, with shardings, one device's slice at a time.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import zlib
from typing import IO, Any, NamedTuple

import jax
import numpy as np
import safetensors

from .._core.checks import flags, format_list, format_problems
from .._core.errors import CheckpointError, VariablesError
from .._core.graph import FlatKey, Plan
from .._core.layout import check_variables, nest
from .._core.module import Module
from .._core.types import Dtype, Shape
from ._format import (
    CHECKSUMS_KEY,
    DTYPES,
    EMPTY_DICTS_KEY,
    RESERVED_PREFIX,
    TensorInfo,
    checksum_seed,
    format_checksum,
    read_entries,
)
from ._tree import PathLike, as_path, flatten, key_part
from .tensors import read_array

__all__ = ["load"]


def load(
    path: PathLike,
    model: Module | None = None,
    *,
    like: Any = None,
    shardings: Any = None,
    verify: bool = True,
) -> Any:
    """Reads variables, or any pytree `save` wrote, from a safetensors file.

    With `model`, every path, shape and dtype in the file is checked against the model before
    any data is read, and one error lists every mismatch. With `like` (any pytree: a whole
    training state with Optax's named tuples, as `orbax`'s ``restore(path, target)`` takes
    it), the file is checked against its leaves the same way and the result has its exact
    structure. With `shardings`, each array is created sharded
    (`jax.make_array_from_callback`): every device reads only its own slice from the
    memory-mapped file, so no array passes whole through one device.

    Args:
        path: The file: a regular file (a folder, a named pipe or a device is refused).
        model: The model the variables are for. Its variables must all be in the file, with
            the same shapes and storage dtypes (``param_dtype``), and the file must hold
            nothing else. The result then has exactly the structure `init` returns.
        like: The structure to restore into, instead of `model`: a pytree whose leaves are
            arrays or `jax.ShapeDtypeStruct`s (``jax.eval_shape`` of the function that creates
            the state). The file must hold exactly its leaves, by path, with their shapes and
            dtypes; the result is that pytree with the file's arrays in it (placed on each
            leaf's ``sharding`` where it has one and `shardings` is not given).
        shardings: Where the arrays go: one `jax.sharding.Sharding` for all of them, or a tree
            of them shaped like the result (as `lm.shardings` returns for variables), with an
            entry for every array. None puts each array on the default device.
        verify: Whether to check each array's bytes against the CRC-32 that `save` stored
            (every byte is read once more: well under a second per GB). False skips it, e.g.
            in a multi-process load, where each process would otherwise read the whole file.
            Files of other writers (and of lamina before checksums) have none to check.

    Returns:
        ``{collection: nested dict of jax.Array}`` (tensor names split at ``/``), or the
        structure of `like`.

    Raises:
        FileNotFoundError: If there is no file at `path`.
        IsADirectoryError: If `path` is a folder.
        CheckpointError: If `path` is not a regular file, or the file is not a readable
            safetensors file (truncated, corrupted or of another format), its data does not
            match its checksums (naming the arrays), or it holds a type this JAX cannot
            (64-bit types without ``jax_enable_x64``, float4 and float6).
        VariablesError: If the file does not match `model` or `like`, or `shardings` does not
            match the arrays.
        TypeError: If `model` is not an `lm.Module`, or both `model` and `like` are given.

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
        >>> state = {"variables": variables, "step": jax.numpy.asarray(7)}
        >>> lm.save(path, state)
        >>> int(lm.load(path, like=state)["step"])
        7
        >>> folder.cleanup()
    """
    path = as_path(path, "lm.load")
    flags("lm.load", verify=verify)
    if model is not None and like is not None:
        raise TypeError(
            "lm.load takes a model or like=, not both: like= restores any structure, and "
            "a model's variables as lm.transform(model).init returns them need only the model."
        )
    if model is not None and not isinstance(model, Module):
        raise TypeError(
            f"lm.load: expected an lm.Module, got {type(model).__name__}; to restore another "
            f"structure (an optimizer state, a whole training state), pass it as like=."
        )
    target = _Target(like) if like is not None else None
    with _open_regular(path) as file:
        start, tensors, user_metadata = _read_header(path, file)
        keys = _tensor_keys(path, tensors)
        plan = None
        if model is not None:
            plan = Plan(model)
            _check_against_plan(plan, path, keys, tensors)
        elif target is not None:
            target.check(path, keys, tensors)
        _check_types(path, tensors)
        if verify:
            _verify(path, file, start, tensors, user_metadata)
        empty = [] if plan is not None or target is not None else _empty_dicts(path, user_metadata)
        if shardings is None and target is not None:
            placement = target.shardings()
        else:
            placement = _placements(shardings, keys, tensors)
        arrays = {
            key: read_array(file, start + info.begin, info, placement.get(key))
            for key, info in zip(keys, tensors, strict=True)
        }
    if plan is not None:
        return nest((entry.key, arrays[entry.key]) for entry in plan.variables)
    if target is not None:
        return target.restore(arrays)
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


_KINDS = [
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
]


def _open_regular(path: str) -> IO[bytes]:
    """Opens `path` for reading if it is a regular file; never blocks on a pipe or device."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"lm.load: no checkpoint at {path} (no such file)")
    if os.path.isdir(path):
        raise IsADirectoryError(f"lm.load: {path} is a folder, not a safetensors file")
    # O_NONBLOCK: opening a named pipe would otherwise wait for a writer, forever
    open_flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, open_flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"lm.load: no checkpoint at {path} (no such file)") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(
            f"lm.load: {path} is {kind}, not a regular file; lm.load reads files (it maps "
            f"them into memory and reads them twice). Copy the data into a file first."
        )
    return os.fdopen(fd, "rb")


class _Target:
    """The structure `load(..., like=)` restores into: its leaves by path, and its treedef."""

    def __init__(self, like: Any):
        paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(like)
        self.keys: list[FlatKey] = []
        self.leaves: dict[FlatKey, Any] = {}
        bad = []
        for path, leaf in paths_and_leaves:
            parts = [key_part(entry) for entry in path]
            name = "/".join(str(p) for p in parts) or "the top level"
            if not parts:
                bad.append("the top level: a single array has no name in a file; give a dict")
            elif not all(isinstance(p, str) and p and "/" not in p for p in parts):
                bad.append(f"{name}: a key that is not a non-empty str without '/'")
            elif not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                bad.append(
                    f"{name}: {type(leaf).__name__} {leaf!r:.30} has no shape and dtype (lm.save "
                    f"stores arrays: give the array, or jax.ShapeDtypeStruct(shape, dtype))"
                )
            else:
                key = tuple(parts)
                self.keys.append(key)
                self.leaves[key] = leaf
        if bad:
            raise VariablesError(
                "lm.load's like= cannot name its leaves as arrays of a file:\n  "
                + "\n  ".join(bad[:10])
            )

    def check(self, path: str, keys: list[FlatKey], tensors: list[TensorInfo]) -> None:
        """Raises one `VariablesError` listing every difference between the file and `like`."""
        found = dict(zip(keys, tensors, strict=True))
        missing = ["/".join(k) for k in self.keys if k not in found]
        unexpected = ["/".join(k) for k in keys if k not in self.leaves]
        shapes, kinds = [], []
        for key in self.keys:
            if key in found:
                leaf, info = self.leaves[key], found[key]
                name = "/".join(key)
                if tuple(leaf.shape) != info.shape:
                    shapes.append(f"{name}: expected {tuple(leaf.shape)}, got {info.shape}")
                got = DTYPES.get(info.code)
                if got is None or np.dtype(leaf.dtype) != got:
                    kinds.append(
                        f"{name}: expected {np.dtype(leaf.dtype).name}, got "
                        f"{got.name if got is not None else info.code}"
                    )
        problems = format_problems(
            [
                ("missing", missing, 8),
                ("unexpected", unexpected, 8),
                ("wrong shape", shapes, 5),
                ("wrong dtype", kinds, 5),
            ]
        )
        if problems:
            raise VariablesError(
                f"lm.load of {path} got arrays that do not match like=:\n  "
                + "\n  ".join(problems)
                + "\nWas it saved from another state, or another version of it? lm.load(path) "
                "without like= reads the file as it is (nested dicts); cast dtypes with "
                "jax.tree.map."
            )

    def shardings(self) -> dict[FlatKey, jax.sharding.Sharding]:
        """The shardings the leaves of `like` carry (a `ShapeDtypeStruct` may carry none)."""
        result = {}
        for key, leaf in self.leaves.items():
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, jax.sharding.Sharding):
                result[key] = sharding
        return result

    def restore(self, arrays: dict[FlatKey, jax.Array]) -> Any:
        """`like`'s structure, holding the arrays read from the file."""
        return jax.tree_util.tree_unflatten(self.treedef, [arrays[key] for key in self.keys])


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
    hint = (
        "Was it saved from another model, or another version of this one? lm.load(path) "
        "without a model reads it as it is; carry the matching weights over with "
        "lm.assign_variables, and cast dtypes with jax.tree.map."
    )
    same_layout = set(found) == set(plan.index) and all(
        tuple(found[entry.key].shape) == entry.shape for entry in plan.variables
    )
    if same_layout:  # only dtypes differ: a float32 file for a model that stores bfloat16...
        hint = (
            "The file holds the model's variables in other dtypes (a float32 checkpoint for a "
            "model whose lm.with_policy stores bfloat16, say), and lm.load never casts "
            "silently. Cast explicitly, either into the model's initial values: model = "
            "lm.assign_variables(model, lm.load(path)) (each value rounded to its variable's "
            "storage dtype; overflow is an error), or into a variables dict: variables = "
            "jax.tree.map(lambda a, t: a.astype(t.dtype), lm.load(path), "
            "jax.eval_shape(lm.transform(model).init, jax.random.key(0)))."
        )
    check_variables(plan, found, f"lm.load of {path}", dtypes=True, hint=hint)


class _Described(NamedTuple):
    """A tensor of the file as the plan check sees it: its shape and dtype."""

    shape: Shape
    dtype: Dtype


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
        given, _ = flatten(
            shardings,
            "lm.load's shardings",
            is_leaf=lambda x: isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec)),
        )
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


_CHECKSUM = re.compile(r"[0-9a-f]{8}")


def _verify(
    path: str, file: IO[bytes], start: int, tensors: list[TensorInfo], metadata: dict[str, str]
) -> None:
    """Raises `CheckpointError` naming every tensor whose bytes do not match their checksum."""
    text = metadata.get(CHECKSUMS_KEY)
    if text is None:
        # lm.save writes the checksums in every file; a file with lamina's other entries but
        # not this one had its header damaged (a renamed key must not switch checking off)
        ours = sorted(key for key in metadata if key.startswith(RESERVED_PREFIX))
        if ours:
            raise CheckpointError(
                f"{path} is corrupted: its header has lamina's metadata ({format_list(ours)}) "
                f"but no checksum entry {CHECKSUMS_KEY!r}, which lm.save writes in every file, "
                f"so the header was damaged or edited after it was written. Restore the file "
                f"from another copy; lm.load(path, verify=False) reads it unchecked."
            )
        return  # a file of another writer, or of lamina before checksums: nothing to compare
    names = {info.name for info in tensors}
    try:
        stored = json.loads(text)
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
        bad = [n for n, v in stored.items() if not (isinstance(v, str) and _CHECKSUM.fullmatch(v))]
        if bad:
            raise ValueError(f"not 8 hex digits for {format_list(sorted(bad))}")
        if set(stored) != names:
            odd = sorted(set(stored) ^ names)
            raise ValueError(f"it and the tensors' names differ in {format_list(odd)}")
    except ValueError as error:
        raise CheckpointError(
            f"{path} is corrupted: its header's checksum entry {CHECKSUMS_KEY!r} is damaged "
            f"({error}), so the header was damaged or edited after lm.save wrote it. Restore "
            f"the file from another copy; lm.load(path, verify=False) reads it unchecked."
        ) from error
    wrong = []
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for info in tensors:
            seed = checksum_seed(info.code, info.shape)
            with memoryview(data)[start + info.begin : start + info.end] as view:
                found = format_checksum(zlib.crc32(view, seed))
            if found != stored[info.name]:
                wrong.append(info.name)
    if wrong:
        raise CheckpointError(
            f"{path} is corrupted: the data of {len(wrong)} array(s) does not match the "
            f"checksum lm.save stored for it: {format_list(wrong)}. The file was damaged after "
            f"it was written (a failing disk, a bad copy or download, an edit); restore it from "
            f"another copy. lm.load(path, verify=False) reads it anyway, damage included."
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
