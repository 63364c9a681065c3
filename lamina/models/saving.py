"""`save_pretrained`: a `CausalLM`'s variables as a Hugging Face folder ``transformers`` loads.

The inverse of `from_pretrained`: each stacked variable unstacked per layer and laid out as
transformers stores it (`checkpoint_names`), written with the `safetensors` package into
shards of a bounded size, with ``config.json`` from `ModelConfig.to_hf`; the folder is built
beside its target and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from .._core.checks import format_problems
from .._core.errors import VariablesError
from .checkpoint_names import INDEX, WEIGHTS, Variable, expected_variables
from .config import ModelConfig
from .llama import CausalLM

__all__ = ["remember_source", "save_pretrained"]

# files `save_pretrained` copies from the folder a model was loaded from
# (what transformers 5's tokenizers and generation config write: the tokenizer's own files,
# its chat template, the slow tokenizers' vocabularies)
COPIED = re.compile(
    r"tokenizer.*\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|generation_config\.json"
)
# the folder each model object `from_pretrained` returned was read from, by identity (a model
# equal to it but made elsewhere, say CausalLM(config), is not that model)
_SOURCES: dict[int, tuple[weakref.ref[Any], str]] = {}


def remember_source(model: CausalLM, folder: str) -> None:
    """Records the folder this model object was loaded from, whose tokenizer it saves."""
    key = id(model)
    with contextlib.suppress(TypeError):  # a model that cannot be weakly referenced
        ref = weakref.ref(model, lambda _: _SOURCES.pop(key, None))
        _SOURCES[key] = (ref, os.path.abspath(folder))


def _source_of(model: CausalLM) -> str | None:
    """The folder this very model object was loaded from, else None."""
    entry = _SOURCES.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else None


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _shard_bytes(max_shard_size: int | str) -> int:
    if (
        isinstance(max_shard_size, int)
        and not isinstance(max_shard_size, bool)
        and max_shard_size > 0
    ):
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(max_shard_size).upper())
    if match is None or not isinstance(max_shard_size, (int, str)) or float(match.group(1)) <= 0:
        raise ValueError(
            f"save_pretrained: max_shard_size={max_shard_size!r}; expected a positive number of "
            f'bytes or a size such as "5GB", "500MB", "2GiB"'
        )
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _check_variables(
    config: ModelConfig, variables: list[Variable], given: Any
) -> dict[tuple[str, ...], Any]:
    if not isinstance(given, Mapping) or "params" not in given:
        raise VariablesError(
            f"save_pretrained: variables must be {{'params': ...}} as lm.transform(model).init or "
            f"from_pretrained returns them, got {type(given).__name__}"
            + (f" with keys {sorted(given)}" if isinstance(given, Mapping) else "")
        )
    leaves = jax.tree_util.tree_flatten_with_path({"params": given["params"]})[0]
    flat = {tuple(str(getattr(p, "key", p)) for p in path): leaf for path, leaf in leaves}
    expected = {v.key: v for v in variables}
    missing = ["/".join(k) for k in expected if k not in flat]
    unexpected = ["/".join(k) for k in flat if k not in expected]
    shapes = [
        f"{'/'.join(k)}: expected {expected[k].shape}, got {tuple(np.shape(a))}"
        for k, a in flat.items()
        if k in expected and tuple(np.shape(a)) != expected[k].shape
    ]
    kinds = [
        f"{'/'.join(k)}: {np.dtype(a.dtype).name}"
        for k, a in flat.items()
        if k in expected and not jnp.issubdtype(a.dtype, jnp.floating)
    ]
    problems = format_problems(
        [
            ("missing", sorted(missing), 8),
            ("unexpected", sorted(unexpected), 8),
            ("wrong shape", sorted(shapes), 8),
            ("not floating point", sorted(kinds), 8),
        ]
    )
    if problems:
        lora = any("lora" in name for name in unexpected)
        raise VariablesError(
            "save_pretrained: the variables do not match the model's config:\n  "
            + "\n  ".join(problems)
            + (
                "\nLoRA adapters have no place in a Hugging Face checkpoint: merge them into "
                "the kernels first (lm.merge_lora), then save the merged model."
                if lora
                else "\nSave the variables of this model (as init or from_pretrained made them)."
            )
        )
    return flat


def save_pretrained(
    model: CausalLM,
    variables: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    source: str | os.PathLike[str] | None = None,
) -> None:
    """Writes a model as a Hugging Face folder that ``transformers`` loads.

    ``config.json`` (`ModelConfig.to_hf`), ``model.safetensors`` (or shards of at most
    `max_shard_size` with ``model.safetensors.index.json``) with transformers' names and
    layouts, each layer unstacked; tied embeddings are stored once (no ``lm_head.weight``).
    The folder is written beside `path` and renamed into place at the end, so a failed save
    leaves `path` as it was. When `path` exists, its other files are kept and its old
    weights replaced; a `path` that is a symlink keeps pointing at its folder, which is
    replaced. The tokenizer files, chat template and ``generation_config.json`` of the
    folder the model was loaded from (`source`) are copied.

    Args:
        model: The `CausalLM`.
        variables: Its variables, ``{"params": ...}`` (in any float dtype: it is kept).
        path: The folder to write.
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MB"``, ``"2GiB"``.
        source: The folder whose tokenizer, chat template and generation config to copy. By
            default the one `from_pretrained` loaded `model` from when `model` is the very
            object it returned; a model made from it (``lm.replace``, ``lm.merge_lora``) or
            from its config needs ``source=`` (else nothing is copied and a
            ``generation_config.json`` is written from the config).

    Raises:
        lm.VariablesError: If `variables` do not match the model (missing, unexpected or
            misshapen variables, such as unmerged LoRA adapters), before anything is
            written.
        ValueError: If the config cannot be written as its architecture's (`ModelConfig.to_hf`),
            or `path` is (or contains) the current working directory.
        FileExistsError: If `path` is a file.
        FileNotFoundError: If a given `source` is not a folder.

    Example:
        >>> import json, os, tempfile, jax, lamina as lm
        >>> from lamina.models import CausalLM, ModelConfig, save_pretrained
        >>> config = ModelConfig("qwen2", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
        ...                      qkv_bias=True, tie_embeddings=True)
        >>> model = CausalLM(config)
        >>> folder = tempfile.TemporaryDirectory()
        >>> save_pretrained(model, lm.transform(model).init(jax.random.key(0)), folder.name)
        >>> sorted(os.listdir(folder.name))
        ['config.json', 'generation_config.json', 'model.safetensors']
        >>> with open(os.path.join(folder.name, "config.json")) as f:
        ...     json.load(f)["architectures"]
        ['Qwen2ForCausalLM']
        >>> folder.cleanup()
    """
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"save_pretrained: expected a lamina.models.CausalLM, got {type(model).__name__}"
        )
    config = model.config
    limit = _shard_bytes(max_shard_size)
    expected = expected_variables(config)
    flat = _check_variables(config, expected, variables)
    embedding = flat[("params", "embed", "embedding")]
    dtype_name = np.dtype(embedding.dtype).name
    hf_config = config.to_hf()
    hf_config["dtype"] = (
        dtype_name if dtype_name in ("float32", "bfloat16", "float16") else "float32"
    )
    if source is None:
        source = _source_of(model)
    elif not os.path.isdir(source):
        raise FileNotFoundError(f"save_pretrained: source={os.fspath(source)!r} is not a folder")
    # a symlink's folder is replaced, the link kept; the current directory cannot be replaced
    target = os.path.realpath(os.fspath(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"save_pretrained: {target} exists and is not a folder")
    cwd = os.path.realpath(os.getcwd())
    if cwd == target or cwd.startswith(target.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"save_pretrained: {os.fspath(path)!r} is (or contains) the current working "
            f"directory {cwd}; the folder is replaced as a whole, which would leave this "
            f"process in a deleted directory. Save to another folder, or os.chdir out first."
        )
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)

    # plan the files: tensors in name-map order, a new shard whenever the next would overflow
    tensors = []  # (hf name, variable, layer)
    for v in expected:
        for i, name in enumerate(v.hf_names()):
            tensors.append((name, v, None if v.layers is None else i))
    shards: list[list[tuple[str, Variable, int | None]]] = [[]]
    size = 0
    total = 0
    for item in tensors:
        nbytes = math.prod(item[1].stored) * np.dtype(flat[item[1].key].dtype).itemsize
        total += nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )

    temp = tempfile.mkdtemp(
        prefix=f".{os.path.basename(target)}.", suffix=".lamina-tmp", dir=parent
    )
    try:
        for file, shard in zip(names, shards, strict=True):
            arrays = {name: _stored(flat[v.key], v, layer) for name, v, layer in shard}
            safetensors.numpy.save_file(arrays, os.path.join(temp, file), metadata={"format": "pt"})
            del arrays
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {
                    name: file
                    for file, shard in zip(names, shards, strict=True)
                    for name, _, _ in shard
                },
            }
            _write_json(os.path.join(temp, INDEX), index)
        _write_json(os.path.join(temp, "config.json"), hf_config)
        copied = set()
        if source is not None and os.path.isdir(source):  # (a loaded folder may be gone)
            for entry in sorted(os.listdir(source)):
                if COPIED.fullmatch(entry) and os.path.isfile(os.path.join(source, entry)):
                    shutil.copy2(os.path.join(source, entry), os.path.join(temp, entry))
                    copied.add(entry)
        if "generation_config.json" not in copied:
            generation = {"bos_token_id": config.bos_token_id, "pad_token_id": config.pad_token_id}
            eos = hf_config["eos_token_id"]
            generation["eos_token_id"] = eos
            _write_json(
                os.path.join(temp, "generation_config.json"),
                {k: v for k, v in generation.items() if v is not None},
            )
        if os.path.isdir(target):
            _carry_other_files(target, temp)
        _swap_into_place(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _stored(array: Any, variable: Variable, layer: int | None) -> np.ndarray:
    """One stored tensor from a (stacked) variable: the layer's slice, laid out as HF's."""
    host = _on_host(array, layer)
    moved = [math.prod(group) for group in _groups(variable)]
    host = host.reshape(moved)
    if variable.name.transpose:
        host = host.T
    return np.ascontiguousarray(host)


def _on_host(array: Any, layer: int | None) -> np.ndarray:
    """``array[layer]`` (or the whole array) in host memory, gathered shard by shard.

    Each device's shard is sliced on its own device, so a sharded array (on explicit mesh
    axes too) never needs a collective, and the host holds one layer at a time.
    """
    if not isinstance(array, jax.Array):
        host = np.asarray(array)
        return host if layer is None else host[layer]
    if not array.is_fully_addressable:
        raise ValueError(
            "save_pretrained: a variable is spread over several processes; gather the "
            "variables to one process first (jax.experimental.multihost_utils."
            "process_allgather) and save from it"
        )
    shape = array.shape if layer is None else array.shape[1:]
    out = np.empty(shape, array.dtype)
    done = set()
    for shard in array.addressable_shards:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(shard.index, array.shape, strict=True))
        if bounds in done:
            continue  # a replica of a block already copied
        done.add(bounds)
        if layer is None:
            out[shard.index] = np.asarray(shard.data)
        elif bounds[0][0] <= layer < bounds[0][1]:
            out[shard.index[1:]] = np.asarray(shard.data[layer - bounds[0][0]])
    return out


def _groups(variable: Variable) -> list[list[int]]:
    shape = list(variable.relayout.shape)
    result, k = [], 0
    for group in variable.name.layout.split("|"):
        n = len(group.split())
        result.append(shape[k : k + n])
        k += n
    return result


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


# files of an old checkpoint in the target folder that the new one replaces
_OLD_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json")


def _carry_other_files(target: str, temp: str) -> None:
    """Hard-links (or copies) the target's files that this save does not write into `temp`."""
    for entry in os.listdir(target):
        if _OLD_WEIGHTS.fullmatch(entry) or os.path.exists(os.path.join(temp, entry)):
            continue
        src, dst = os.path.join(target, entry), os.path.join(temp, entry)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _swap_into_place(temp: str, target: str) -> None:
    """Renames `temp` to `target`; an existing `target` is renamed aside first, then removed."""
    if not os.path.exists(target):
        os.replace(temp, target)
        return
    old = tempfile.mkdtemp(
        prefix=f".{os.path.basename(target)}.", suffix=".lamina-old", dir=os.path.dirname(target)
    )
    os.rmdir(old)
    os.replace(target, old)
    try:
        os.replace(temp, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
