"""`export` and `load_exported`: StableHLO artifacts through ``jax.export``.

`export` lowers `inference.inference_function`'s pure function with ``jax.export`` for the
asked platforms (CPU always, and by default this machine's accelerator too) and, given a
path, writes ``Exported.serialize()`` atomically.
`load_exported` is ``jax.export.deserialize`` with errors that name the file; the artifact
itself needs only JAX and flatbuffers (``pip install jax flatbuffers``;
``jax.export.deserialize(data).call(x)``), never lamina.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._core.errors import ExportError
from .._core.module import Module
from ..io._atomic import atomic_file, check_target
from .inference import inference_function

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# Flatbuffers cannot hold more than 2 GiB; baked variables beyond this are refused up front.
MAX_BAKED_BYTES = 3 << 29  # 1.5 GiB


def export(
    model: Module,
    variables: Any,
    *example_args: Any,
    to_callable: Callable[[Module], Callable[..., Any]] | None = None,
    with_variables: bool = True,
    batch_dims: Any = None,
    platforms: Sequence[str] | None = None,
    allow_training: bool = False,
    path: str | os.PathLike[str] | None = None,
) -> jax.export.Exported:
    """Exports the model's inference call as StableHLO (a ``jax.export.Exported``).

    The artifact is a function of arrays that runs without lamina:
    ``jax.export.deserialize(data).call(*inputs)`` in any process with JAX and flatbuffers
    (``pip install jax flatbuffers``: deserializing needs flatbuffers, which jax does not
    install). By default the variables are baked in (constants of the program: the file is
    the model's size), so it takes the example arguments that are arrays and returns the
    outputs; Python values among the example arguments (``is_training=False``) are fixed at
    export.

    Args:
        model: The model definition.
        variables: Its variables, as `init` (or training) made them.
        *example_args: One call's positional arguments: arrays (or ``jax.ShapeDtypeStruct``,
            or pytrees of them) are the artifact's inputs; other values are fixed.
        to_callable: Picks the method to export (``lambda m: m.encode``), as
            `lm.transform`'s; default ``__call__``.
        with_variables: False: the variables dict is the artifact's first input (one
            artifact for many checkpoints; big models); True: baked in.
        batch_dims: None: the example shapes, fixed. ``"b"``: axis 0 of every array input is
            a symbolic size ``b`` (one artifact runs any batch). A polymorphic shape
            (``"b, t"``, ``"b, ..."``) for every input, or a tuple with one entry (None for
            static) per array input.
        platforms: Where the artifact may run: ``"cpu"`` (always included), ``"cuda"``,
            ``"rocm"``, ``"tpu"``; lowered on any machine. Default: ``"cpu"`` and this
            machine's default platform when it is not the CPU
            (``jax.export.default_export_platform()``, ``"cuda"`` on an NVIDIA GPU, giving
            ``("cpu", "cuda")``), so an artifact runs where it was exported and on CPU
            servers.
        allow_training: Export a training-mode call (dropout drawing keys, batch statistics
            updated, `lm.sow` records into a collection given among the variables),
            refused otherwise: the artifact is then ``f(key, *inputs) -> (outputs,
            updated_collections)`` with ``key = jax.random.key(seed)``. Such an artifact
            does not re-check what `apply` checks on concrete shapes: with a symbolic batch,
            a batch of 1 runs (BatchNorm's batch variance is then 0) where `apply` refuses.
        path: If given, the serialized artifact is written there, atomically (its folder
            must exist).

    Returns:
        The ``jax.export.Exported``; ``exported.serialize()`` gives the bytes `path` holds.
        A call that writes `Cache` variables (decoding) exports as ``f(cache, *inputs) ->
        (outputs, cache)``, ``cache`` being ``{"cache": ...}`` of the variables. A step that
        does not fit (past the cache's ``max_length``, or a negative ``cache_index``) gives
        NaN and keeps the cached keys and values, but ``cache_index`` still advances by the
        step's length, so every later step gives NaN too: compare ``cache_index`` with
        ``max_length`` between calls (the layer's run-time error needs a call to the host,
        which an artifact cannot make).

    Raises:
        ExportError: Training mode without `allow_training` (naming the layer), inputs or
            outputs an artifact cannot hold (a NamedTuple, a dataclass, a dict with int
            keys), example arguments the model refuses (the model's error as
            ``__cause__``), abstract variables (``jax.eval_shape`` of init) to bake in, a
            custom call without stability guarantees (``implementation="cudnn"``
            attention), a call back into Python (``jax.debug.print``).
        VariablesError: Variables that do not fit the model.
        TypeError: An example argument that is a list or tuple of numbers (it would be a
            constant of the artifact: pass ``np.asarray`` of it).
        ValueError: An unknown platform, a bad `batch_dims` (one that does not fit an
            input's rank, a symbol given two sizes by the examples, no array inputs).
        FileNotFoundError, IsADirectoryError, PermissionError: A `path` that cannot be
            written (checked before anything is traced; nothing is ever half-written).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(3, 8), lm.relu, lm.Dense(8, 2))
        >>> variables = lm.init(model)(jax.random.key(0))
        >>> path = os.path.join(tempfile.mkdtemp(), "model.stablehlo")
        >>> exported = lm.export(model, variables, jnp.ones((4, 3)), batch_dims="b", path=path)
        >>> exported.in_avals, exported.platforms[0]
        ((ShapedArray(float32[b,3]),), 'cpu')
        >>> with open(path, "rb") as file:  # JAX + flatbuffers from here on, no lamina
        ...     artifact = jax.export.deserialize(bytearray(file.read()))
        >>> artifact.call(jnp.ones((7, 3))).shape
        (7, 2)
    """
    where = "lm.export"
    chosen = check_platforms(platforms, where)
    if path is not None:
        path = check_target(path, where)
    if with_variables is True:
        size = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree_util.tree_leaves(variables))
        if size > MAX_BAKED_BYTES:
            raise ExportError(
                f"{where}: the variables take {size / 2**30:.2f} GiB, too many to bake into "
                f"one artifact (a flatbuffer holds under 2 GiB). Export with "
                f"with_variables=False and save the variables beside it (lm.save)."
            )
    info = inference_function(
        model,
        variables,
        example_args,
        to_callable=to_callable,
        with_variables=with_variables,
        batch_dims=batch_dims,
        allow_training=allow_training,
        where=where,
    )
    try:
        exported = jax.export.export(jax.jit(info.fn), platforms=chosen)(*info.specs)
    except NotImplementedError as error:
        if "host_callbacks" not in str(error):
            raise
        raise ExportError(
            f"{where}: {info.model_name} calls back into Python while it runs "
            f"(jax.debug.print, jax.debug.callback, jax.pure_callback...), which an exported "
            f"artifact cannot hold: remove those calls from the exported method."
        ) from error
    except ValueError as error:
        if "custom call" not in str(error).lower():
            raise
        raise ExportError(
            f"{where}: {info.model_name} lowers to a custom call that jax.export cannot keep "
            f"stable ({str(error).splitlines()[0]}). The fused cuDNN attention is one: build "
            f"the attention with implementation=None or 'xla' for export."
        ) from error
    if path is not None:
        write(exported, path, where)
    return exported


def write(exported: jax.export.Exported, path: str, where: str = "lm.export") -> None:
    """Writes ``exported.serialize()`` to `path` atomically: the whole file or nothing."""
    try:
        blob = exported.serialize()
    except ImportError as error:
        raise ImportError(
            f"{where}: writing an artifact needs the flatbuffers package "
            f"(pip install flatbuffers): {error}"
        ) from error
    except Exception as error:
        raise ExportError(
            f"{where}: the artifact could not be serialized ({type(error).__name__}: "
            f"{error}); nothing was written to {path}."
        ) from error
    with atomic_file(path) as file:
        file.write(blob)


def check_platforms(platforms: Sequence[str] | None, where: str) -> tuple[str, ...]:
    """The platforms to lower for: the given ones, lowercased, with ``"cpu"`` added.

    None: ``"cpu"`` and, when it is another one, this machine's default platform.
    """
    if platforms is None:
        return tuple(dict.fromkeys(("cpu", jax.export.default_export_platform())))
    if isinstance(platforms, str):
        platforms = (platforms,)
    known = ", ".join(repr(p) for p in PLATFORMS)
    chosen: list[str] = []
    for platform in platforms:
        name = platform.lower() if isinstance(platform, str) else platform
        if name == "gpu":
            raise ValueError(
                f"{where}: platform 'gpu' is ambiguous: name the GPU runtime, 'cuda' (NVIDIA) "
                f"or 'rocm' (AMD). Known platforms: {known}."
            )
        if name not in PLATFORMS:
            raise ValueError(
                f"{where}: unknown platform {platform!r}; the platforms are {known} ('cpu' is "
                f"always included)."
            )
        if name not in chosen:
            chosen.append(name)
    if "cpu" not in chosen:
        chosen.append("cpu")
    return tuple(chosen)


def load_exported(path: str | os.PathLike[str]) -> jax.export.Exported:
    """Reads an artifact written by `export` (``jax.export.deserialize``).

    Only JAX and flatbuffers (``pip install jax flatbuffers``) are needed to read one; this
    wrapper adds errors that name the file. Plain JAX does the same with
    ``jax.export.deserialize(bytearray(open(path, "rb").read()))``.

    Args:
        path: The file.

    Returns:
        The ``jax.export.Exported``: ``exported.call(*inputs)`` runs it.

    Raises:
        FileNotFoundError: No such file.
        IsADirectoryError: `path` is a folder.
        ExportError: The file is not an artifact (garbage, truncated), or was written by a
            JAX whose calling convention this one does not support.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Dense(3, 2)
        >>> variables = lm.init(model)(jax.random.key(0))
        >>> path = os.path.join(tempfile.mkdtemp(), "dense.stablehlo")
        >>> _ = lm.export(model, variables, jnp.ones((1, 3)), path=path)
        >>> lm.load_exported(path).call(jnp.ones((1, 3))).shape
        (1, 2)
    """
    where = "lm.load_exported"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a file path (str), got {type(path).__name__}.")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}: no such file: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{where}: {path} is a folder; give the artifact file in it")
    with open(path, "rb") as file:
        data = file.read()
    try:
        exported = jax.export.deserialize(bytearray(data))
    except ImportError:
        raise
    except Exception as error:
        raise ExportError(
            f"{where}: {path} is not a jax.export artifact (a file written by lm.export or "
            f"Exported.serialize()), or it is truncated: {type(error).__name__}: {error}"
        ) from error
    low = jax.export.minimum_supported_calling_convention_version
    high = jax.export.maximum_supported_calling_convention_version
    version = exported.calling_convention_version
    if not low <= version <= high:
        raise ExportError(
            f"{where}: {path} was exported with calling convention {version}, but this JAX "
            f"({jax.__version__}) runs versions {low} to {high}: load it with the JAX that "
            f"exported it (StableHLO artifacts stay readable for about 6 months)."
        )
    return exported
