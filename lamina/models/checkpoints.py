"""`from_pretrained`: a Hugging Face folder (``config.json`` + safetensors) into lamina variables.

No PyTorch: the `safetensors` package validates each file, the headers are checked against
the name map (`checkpoint_names`) before any data is read, and every tensor is read from a
memory map of its file (`lamina.io.tensors`), the layers stacked into the `Stack`'s leading
axis, laid out and cast one block at a time, each device reading only its slice when
shardings are given. `save_pretrained` (`saving.py`) writes the folder back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from .._core.checks import format_list, format_problems
from .._core.errors import CheckpointError, VariablesError
from .._core.layout import nest
from .._core.transform import transform
from ..io._format import DTYPES, TensorInfo, read_entries
from ..io.tensors import memmap, read_block, read_stacked
from .checkpoint_names import IGNORED, INDEX, WEIGHTS, Variable, expected_variables
from .config import ModelConfig
from .llama import CausalLM
from .saving import remember_source, save_pretrained

__all__ = ["from_pretrained", "save_pretrained"]


def _weight_files(folder: str) -> dict[str, str]:
    """Each tensor's file (``{name: file}``), from the index or the single file.

    Like transformers, a ``model.safetensors`` wins over an index beside it.
    """
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return {}  # filled from the file's header
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map' of "
                f"tensor name -> file): {error}"
            ) from error
        missing = sorted(
            {f for f in weight_map.values() if not os.path.isfile(os.path.join(folder, f))}
        )
        if missing:
            raise CheckpointError(
                f"{folder}: the index {INDEX} lists shard(s) that are not in the folder: "
                f"{format_list(missing)}. An interrupted download or copy? Fetch them again."
            )
        return {str(name): str(file) for name, file in weight_map.items()}
    others = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".h5")))
    hint = (
        f" It holds {format_list(others)}: PyTorch or TensorFlow weights, which lamina reads "
        f"only as safetensors; convert once with transformers (AutoModelForCausalLM."
        f"from_pretrained(folder).save_pretrained(folder))."
        if others
        else ""
    )
    raise CheckpointError(f"{folder} has neither {WEIGHTS} nor {INDEX}.{hint}")


def _read_headers(
    folder: str, weight_map: dict[str, str]
) -> dict[str, tuple[str, int, TensorInfo]]:
    """``{tensor: (file path, data start, info)}`` for every tensor, validated by safetensors."""
    files = sorted(set(weight_map.values())) if weight_map else [WEIGHTS]
    found: dict[str, tuple[str, int, TensorInfo]] = {}
    for file in files:
        path = os.path.join(folder, file)
        try:
            with safetensors.safe_open(path, framework="np") as reader:
                names = set(reader.keys())
            with open(path, "rb") as f:
                start, entries = read_entries(f, os.fstat(f.fileno()).st_size)
        except (safetensors.SafetensorError, ValueError, KeyError, OSError) as error:
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({error}): truncated (an "
                f"interrupted download?), corrupted, or of another format."
            ) from error
        if set(entries) != names:
            raise CheckpointError(f"{path} changed while it was being opened; load it again.")
        for name, info in entries.items():
            if not weight_map or weight_map.get(name) == file:
                found[name] = (path, start, info)
    if weight_map:
        absent = sorted(n for n in weight_map if n not in found)
        if absent:
            raise CheckpointError(
                f"{folder}: {INDEX} places tensor(s) in shards that do not hold them: "
                + format_list(f"{n} (in {weight_map[n]})" for n in absent)
                + ". The index and the shards are from different saves; fetch them again."
            )
    return found


_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _tied_head(
    folder: str, config: ModelConfig, found: dict[str, tuple[str, int, TensorInfo]]
) -> tuple[ModelConfig, dict[str, tuple[str, int, TensorInfo]]]:
    """A tied config's file that holds ``lm_head.weight``, read as transformers reads it.

    The head alone is the embedding; a head equal to the embedding is ignored; a head that
    differs unties the model (with a warning), so its logits use the file's head.
    """
    if not config.tie_embeddings or _HEAD not in found:
        return config, found
    if _EMBED not in found:
        found = {(_EMBED if n == _HEAD else n): entry for n, entry in found.items()}
        return config, found
    (head_file, head_start, head), (embed_file, embed_start, embed) = found[_HEAD], found[_EMBED]
    if head.shape != embed.shape or _equal(
        (head_file, head_start, head), (embed_file, embed_start, embed)
    ):
        return config, found  # equal: stay tied; misshapen: _check_headers says so
    warnings.warn(
        f"{folder}: config.json ties the output head to the embedding (tie_word_embeddings), "
        f"but its {_HEAD} differs from {_EMBED}; loading them untied, with the file's head "
        f"(the model's config has tie_embeddings=False), as transformers does. Set "
        f'"tie_word_embeddings": false in config.json to silence this.',
        stacklevel=3,
    )
    return dataclasses.replace(config, tie_embeddings=False), found


def _equal(*entries: tuple[str, int, TensorInfo], rows: int = 4096) -> bool:
    """Whether two stored tensors of one shape hold the same values (read a block at a time)."""
    with contextlib.ExitStack() as stack:
        arrays = []
        for file, start, info in entries:
            handle = stack.enter_context(open(file, "rb"))
            arrays.append(memmap(handle, start + info.begin, info))
        a, b = arrays
        same_type = a.dtype == b.dtype
        for row in range(0, max(len(a), 1), rows):
            x, y = read_block(a, slice(row, row + rows)), read_block(b, slice(row, row + rows))
            if same_type:
                if x.tobytes() != y.tobytes():
                    return False
            elif not np.array_equal(x.astype(np.float64), y.astype(np.float64)):
                return False
    return True


def _check_headers(
    folder: str,
    config: ModelConfig,
    variables: list[Variable],
    found: dict[str, tuple[str, int, TensorInfo]],
) -> None:
    """Raises one `CheckpointError` listing every missing, unexpected and misshapen tensor."""
    expected = {}
    for variable in variables:
        for name in variable.hf_names():
            expected[name] = variable
    missing = [
        f"{n} (-> {'/'.join(v.key)}, {v.stored})" for n, v in expected.items() if n not in found
    ]
    tolerated = {}
    if config.tie_embeddings:  # files of tied models may hold the head anyway: ignored
        tolerated["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    unexpected, shapes, kinds = [], [], []
    for name, (_, _, info) in found.items():
        if name in expected:
            variable = expected[name]
            if info.shape != variable.stored:
                shapes.append(
                    f"{name} (-> {'/'.join(variable.key)}): expected {variable.stored}, "
                    f"found {info.shape}"
                )
        elif name in tolerated:
            if info.shape != tolerated[name]:
                shapes.append(
                    f"{name} (tied to the embedding): expected {tolerated[name]}, "
                    f"found {info.shape}"
                )
            continue
        elif not IGNORED.fullmatch(name):
            unexpected.append(f"{name} {info.shape}")
        if name in expected or name in tolerated:
            dtype = DTYPES.get(info.code)
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                kinds.append(f"{name}: {info.code}")
    problems = format_problems(
        [
            ("missing", sorted(missing), 8),
            ("unexpected", sorted(unexpected), 8),
            ("wrong shape", sorted(shapes), 6),
            ("not floating point", sorted(kinds), 6),
        ]
    )
    if problems:
        raise CheckpointError(
            f"{folder} does not hold the tensors its config.json describes (a "
            f"{config.model_type} model, {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_heads} heads of {config.head_dim}, {config.num_kv_heads} key/value "
            f"heads):\n  "
            + "\n  ".join(problems)
            + "\nAre config.json and the weights from the same model? A tensor name's lamina "
            "variable follows its '->'."
        )


def _load_dtype(
    dtype: Any, config: ModelConfig, found: dict[str, tuple[str, int, TensorInfo]], names: list[str]
) -> np.dtype:
    """The variables' dtype: the one asked for, else the file's (its config's, if it mixes)."""
    if dtype is not None:
        try:
            result = np.dtype(jnp.dtype(dtype))
        except TypeError as error:
            raise TypeError(f"from_pretrained: dtype={dtype!r} is not a dtype") from error
        if not jnp.issubdtype(result, jnp.floating):
            raise TypeError(f"from_pretrained: dtype={dtype!r} is not a floating-point dtype")
    else:
        stored = {DTYPES[found[n][2].code] for n in names}
        if len(stored) == 1:
            result = stored.pop()
        elif config.dtype is not None:  # F32 norms in a BF16 file: the one the config names
            result = np.dtype(jnp.dtype(config.dtype))
        else:
            result = DTYPES[found["model.embed_tokens.weight"][2].code]
    if result.itemsize == 8 and not jax.config.read("jax_enable_x64"):
        if dtype is not None:
            raise TypeError(
                f"from_pretrained: dtype={dtype!r} asks for float64, which JAX keeps only with "
                f"jax_enable_x64 (it would silently narrow it); ask for jnp.float32 (or "
                f'bfloat16), or enable it with jax.config.update("jax_enable_x64", True)'
            )
        raise TypeError(
            "from_pretrained: the checkpoint is float64, which JAX keeps only with "
            "jax_enable_x64 (it would silently narrow it); pass dtype=jnp.float32, or enable "
            'it with jax.config.update("jax_enable_x64", True)'
        )
    return result


def _placements(shardings: Any, variables: list[Variable]) -> dict[tuple[str, ...], Any]:
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        given: dict[tuple[str, ...], Any] = {v.key: shardings for v in variables}
    else:
        leaves = jax.tree_util.tree_flatten_with_path(
            shardings,
            is_leaf=lambda x: isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec)),
        )[0]
        given = {}  # filled below
        for path, leaf in leaves:
            key = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
            given[key] = leaf
        keys = {v.key for v in variables}
        problems = [
            f"{label} ({len(items)}): {format_list(sorted(items))}"
            for label, items in [
                ("no sharding for", ["/".join(k) for k in keys if k not in given]),
                ("no such variable", ["/".join(k) for k in given if k not in keys]),
                (
                    "not a jax.sharding.Sharding",
                    [
                        f"{'/'.join(k)}: {v!r:.40}"
                        for k, v in given.items()
                        if not isinstance(v, jax.sharding.Sharding)
                    ],
                ),
            ]
            if items
        ]
        if problems and given and all(("params", *k) in keys for k in given):
            raise VariablesError(
                "from_pretrained: the shardings tree lacks the variables' 'params' level (it "
                f"has {format_list(sorted('/'.join(k) for k in given))}); wrap it in "
                "{'params': ...}, as lm.shardings(model, mesh, rules) builds it"
            )
        if problems:
            raise VariablesError(
                "from_pretrained's shardings do not match the model's variables:\n  "
                + "\n  ".join(problems)
                + "\nGive a tree like the variables (lm.shardings(model, mesh, rules) builds one; "
                "a PartitionSpec needs its mesh: NamedSharding(mesh, spec)), or one Sharding."
            )
    for v in variables:
        try:
            given[v.key].check_compatible_aval(v.shape)
            given[v.key].shard_shape(v.shape)
        except (ValueError, TypeError) as error:
            raise VariablesError(
                f"from_pretrained: the sharding for {'/'.join(v.key)} does not fit its shape "
                f"{v.shape}: {error}"
            ) from error
    return given


def from_pretrained(
    path: str | os.PathLike[str], *, dtype: Any = None, shardings: Any = None
) -> tuple[CausalLM, dict[str, Any]]:
    """Reads a Hugging Face checkpoint folder into a `CausalLM` and its variables.

    The folder holds ``config.json`` and ``model.safetensors`` (or shards
    ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``), as
    ``transformers``' ``save_pretrained`` and the Hub publish them; PyTorch is not needed.
    Supported: Llama 2/3 (``model_type`` llama), Mistral, Qwen2/2.5 (qwen2), Qwen3, Gemma.
    Every tensor's name, shape and type is checked against the config before any data is
    read; then each is read from a memory map of its file, the layers stacked on the
    `Stack`'s leading axis and cast one block at a time. As in transformers, a
    ``model.safetensors`` wins over an index beside it, and a tied config
    (``tie_word_embeddings``) whose file holds an ``lm_head.weight`` is read as the file
    says: a head equal to the embedding is ignored, a head alone is the embedding, and a
    head that differs unties the model (a warning; the returned model's config then has
    ``tie_embeddings=False``). Quantised checkpoints (``quantization_config``) are refused.

    Args:
        path: The folder.
        dtype: The variables' dtype (``jnp.float32`` to cast a bfloat16 checkpoint); None keeps
            the file's (bfloat16 stays bfloat16; a file that mixes dtypes is cast to its
            config's ``dtype``). The model stores this dtype and, like transformers, computes
            in it.
        shardings: Where the variables go: a tree of `jax.sharding.Sharding` like the
            variables (``lm.shardings(model, mesh, rules)``) or one Sharding for all. Each
            device then reads only its slice of each tensor (the layers and rows it holds).
            None puts everything on the default device.

    Returns:
        ``(model, variables)``: the `CausalLM` and ``{"params": ...}`` for its
        ``apply``.

    Raises:
        FileNotFoundError: If `path` is not a folder with a ``config.json``.
        ValueError: If the config is of an unsupported architecture or setting, or
            quantised (the message names the ``config.json`` and the supported ones).
        TypeError: If `dtype` is not a floating-point dtype, or float64 without
            ``jax_enable_x64``.
        lm.CheckpointError: If the weights are missing or unreadable, or do not match the
            config: one error lists every missing, unexpected or misshapen tensor, with its
            Hugging Face name, the lamina variable and the expected shape.
        lm.VariablesError: If `shardings` does not match the variables.

    Example:
        >>> import tempfile, jax, lamina as lm
        >>> from lamina.models import CausalLM, ModelConfig, from_pretrained, save_pretrained
        >>> config = ModelConfig("llama", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
        >>> model = CausalLM(config)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> folder = tempfile.TemporaryDirectory()
        >>> save_pretrained(model, variables, folder.name)
        >>> loaded, params = from_pretrained(folder.name)
        >>> params["params"]["layers"]["block"]["attention"]["query"]["kernel"].shape
        (2, 8, 2, 4)
        >>> folder.cleanup()
    """
    folder = os.fspath(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        parent = os.path.dirname(os.path.abspath(folder))
        hint = (
            f"; it takes the folder that holds the checkpoint: from_pretrained({parent!r})"
            if os.path.isfile(folder) and os.path.isfile(os.path.join(parent, "config.json"))
            else ""
        )
        raise FileNotFoundError(f"from_pretrained: {folder} is not a folder{hint}")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"from_pretrained: {folder} has no config.json; it takes a Hugging Face model "
            f"folder (config.json and safetensors weights)"
        )
    with open(config_path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{config_path} is not valid JSON: {error}") from error
    try:
        config = ModelConfig.from_hf(raw)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{config_path}: {error}") from error
    found = _read_headers(folder, _weight_files(folder))
    config, found = _tied_head(folder, config, found)
    variables = expected_variables(config)
    _check_headers(folder, config, variables, found)
    target = _load_dtype(dtype, config, found, [n for v in variables for n in v.hf_names()])
    model = CausalLM(config, param_dtype=target)
    _check_against_model(model, variables, target)
    placements = _placements(shardings, variables)
    arrays = []
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}

        def source(name: str) -> np.ndarray:
            file, start, info = found[name]
            if file not in opened:
                opened[file] = stack.enter_context(open(file, "rb"))
            return memmap(opened[file], start + info.begin, info)

        for v in variables:
            array = read_stacked(
                [source(n) for n in v.hf_names()],
                relayout=v.relayout,
                dtype=target,
                sharding=placements.get(v.key),
                stack=v.layers is not None,
            )
            arrays.append((v.key, array))
    remember_source(model, folder)
    return model, nest(arrays)


def _check_against_model(model: CausalLM, variables: list[Variable], dtype: np.dtype) -> None:
    """The name map's variables are exactly the model's (shapes from `jax.eval_shape`)."""
    shapes = jax.eval_shape(transform(model).init, jax.random.key(0))
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    declared = {
        tuple(str(p.key) for p in path): (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in leaves
    }
    mapped = {v.key: (v.shape, dtype) for v in variables}
    if declared != mapped:
        differ = sorted(
            f"{'/'.join(k)}: model {declared.get(k)}, map {mapped.get(k)}"
            for k in set(declared) | set(mapped)
            if declared.get(k) != mapped.get(k)
        )
        raise RuntimeError(
            "lamina.models: the checkpoint name map and CausalLM disagree (a bug in lamina; "
            f"please report it): {format_list(differ)}"
        )
