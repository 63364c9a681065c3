"""`export_onnx`: ONNX files through ``jax2onnx``, checked with ONNX Runtime before writing.

The model's inference call (`inference.inference_function`: variables baked in, training
refused) is traced by lamina (``jax.make_jaxpr``); ``jax2onnx.to_onnx`` converts a function
that replays that jaxpr (`jaxpr_replay.replay`: calls inlined, pools rewritten into the form
ONNX Runtime runs), never lamina's code itself (``jax2onnx`` patches ``jax.numpy`` while it
traces, which lamina's shape checks do not survive). ``onnx.checker`` checks the model, ONNX
Runtime runs it on the example inputs (and at other sizes of each symbol when `batch_dims` is
given) and compares it with `apply`; only a model that converts *and* runs *and* agrees is
written, atomically. The layer named in an error is found by `locate.failing_layer`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import pathlib
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from .._core.errors import ExportError
from .._core.module import Module
from .._core.transform import transform
from ..io._atomic import atomic_file
from .inference import check_target, inference_function
from .jaxpr_replay import Unsupported, equations, replay
from .locate import failing_layer

WHERE = "lm.export_onnx"
LIMIT = 2**31 - 1  # protobuf's limit on one message: bigger models need external data
CHECK_BATCHES = (1, 7)
EXTRA = "pip install 'lamina[onnx]', or pip install -c constraints.txt -e '.[onnx]' in a checkout"
QUICK: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}
# The opsets jax2onnx 0.17 converts to (its plugins branch on opsets from 9 on) that ONNX 1.20
# and ONNX Runtime 1.32 know (28 at most); what one model needs is checked on its file.
OPSETS = range(9, 29)


def export_onnx(
    model: Module,
    variables: Any,
    *example_args: Any,
    path: str,
    to_callable: Callable[[Module], Callable[..., Any]] | None = None,
    batch_dims: Any = None,
    opset: int = 23,
    check: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> Any:
    """Exports the model's inference call as an ONNX file, checked with ONNX Runtime.

    Needs the ``onnx`` extra (``pip install 'lamina[onnx]'``, or from a checkout
    ``pip install -c constraints.txt -e '.[onnx]'``: ``jax2onnx`` and ``onnxruntime``). The
    variables are baked into the file (initializers); its inputs are the example arguments
    that are arrays, named by pytree path after the called method's parameters (``x``;
    ``feats/tokens`` for a leaf of a pytree; ``x``, or ``x_0``, ``x_1``... for several,
    where the method takes ``*args`` as `Sequential` does), its outputs ``output``
    (``output/logits``, ``output/0``... for a pytree; a decoding step's caches come in as
    ``cache/...`` and out as ``updated/cache/...``), all distinct. The model
    runs in its inference form: a call that draws random keys or updates batch statistics is
    refused (pass ``is_training=False``). ONNX export is float32 only.

    Before anything is written, ``onnx.checker`` checks the file, and ONNX Runtime runs it on
    the example inputs and its outputs are compared with `apply` (``|onnx - apply| <= atol +
    rtol * |apply|``); with `batch_dims`, again with each symbolic size changed (the
    examples' rows repeated or cut): the symbols on axis 0 (the batch) at 1 and 7, every
    other symbol at one less than in the examples. A ``jax.ShapeDtypeStruct`` example is
    checked on random values: standard normal floats, integers in ``[0, 2)``. A model that
    ``jax2onnx`` converts into something ONNX Runtime cannot run, or runs differently, is an
    error, never a file.

    Args:
        model: The model definition.
        variables: Its variables, as `init` returns them (float32).
        *example_args: The positional arguments of one call, as `apply` takes them after the
            rngs: arrays become the file's inputs (their shapes and dtypes), anything else
            (``is_training=False`` given positionally) is fixed in the file.
        path: The ``.onnx`` file to write (its folder must exist); replaced atomically.
        to_callable: Picks the method to export, as `lm.transform`'s (default ``__call__``).
        batch_dims: None for the examples' shapes; a name (``"b"``) for a symbolic axis 0 of
            every input; a polymorphic shape (``"b, t"``) for every input, or a tuple with
            one entry per array input (None: static), as `lm.export` takes it.
        opset: The ONNX opset to target, 9 to 28.
        check: Run the file with ONNX Runtime and compare it with `apply` before writing
            (``onnx.checker`` checks it either way).
        rtol: Relative tolerance of the check.
        atol: Absolute tolerance of the check.

    Returns:
        The ``onnx.ModelProto`` written to `path`.

    Raises:
        ImportError: ``jax2onnx`` (or, with `check`, ``onnxruntime``) is not installed.
        FileNotFoundError: The folder of `path` does not exist.
        IsADirectoryError: `path` is a folder.
        PermissionError: The folder of `path` is not writable.
        VariablesError: The variables do not fit the model.
        ExportError: Training mode; another compute dtype than float32; an operation ONNX
            cannot express (naming the layer's path; `lm.export` writes StableHLO, which
            runs it), or cannot convert at a symbolic size (naming it: export with static
            shapes); an invalid ONNX file; a file ONNX Runtime cannot run or whose outputs
            differ from `apply`; a model over 2 GiB.
        ValueError: A bad `batch_dims`, `opset`, `rtol` or `atol`.

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp, numpy as np, lamina as lm
        >>> import onnxruntime as ort
        >>> model = lm.Dense(3, 2)
        >>> variables = lm.init(model)(jax.random.key(0))
        >>> path = os.path.join(tempfile.mkdtemp(), "dense.onnx")
        >>> proto = lm.export_onnx(model, variables, jnp.ones((4, 3)), path=path, batch_dims="b")
        >>> session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        >>> [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
        (['x'], ['output'])
        >>> x = np.ones((5, 3), np.float32)  # any batch size
        >>> (out,) = session.run(None, {"x": x})
        >>> bool(np.allclose(out, lm.apply(model)(variables, None, x)[0], atol=1e-5))
        True
    """
    path = check_target(path, WHERE)
    _check_options(opset, rtol, atol)
    info = inference_function(
        model,
        variables,
        example_args,
        to_callable=to_callable,
        with_variables=True,
        batch_dims=batch_dims,
        allow_training=False,
        where=WHERE,
    )
    closed = jax.make_jaxpr(info.fn)(*info.specs)
    apply = transform(model, to_callable).apply

    def locate(matches: Callable[[Any], bool]) -> str:
        return failing_layer(apply, variables, list(example_args), matches)

    _check_float32(closed, info.model_name, locate)
    jax2onnx = _needed("jax2onnx")
    onnx = _needed("onnx")
    ort = _needed("onnxruntime") if check else None
    specs = jax.tree.leaves(info.specs)
    try:  # the replay alone first: its own refusals, outside jax2onnx's patched world
        replayed = jax.make_jaxpr(lambda *xs: replay(closed, *xs))(*specs)
    except Unsupported as error:
        raise _cannot_express(error.primitive, error.reason, info.model_name, locate) from error
    try:
        with _quiet("onnx_ir"):  # warnings about values it does not serialize: not the user's
            proto = jax2onnx.to_onnx(
                lambda *xs: _distinct(replay(closed, *xs), xs),
                specs,
                model_name=info.model_name,
                opset=opset,
                input_names=list(info.input_names),
                output_names=list(info.output_names),
                return_mode="proto",
            )
    except Exception as error:
        primitives = {eqn.primitive.name for eqn in equations(replayed)}
        raise _conversion_failed(error, primitives, info.model_name, locate) from error
    data = _serialized(proto, info.model_name)
    try:
        onnx.checker.check_model(proto)
    except Exception as error:
        raise ExportError(
            f"{WHERE}: the converted {info.model_name} is not a valid ONNX model ({error}); "
            f"nothing written. lm.export writes the model as StableHLO (jax.export)."
        ) from error
    if ort is not None:
        _verify(ort, data, info, rtol, atol)
    with atomic_file(path) as file:
        file.write(data)
    return proto


def _distinct(outputs: list[Any], inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The outputs, each a value of its own (an output that is an input or another is copied).

    ONNX names every value once: an output that is an input (dropout off) or another output (a
    cell's carry and output) would carry two names.
    """
    seen = {id(x) for x in inputs}
    distinct = []
    for out in outputs:
        if id(out) in seen:
            out = lax.copy_p.bind(out)
        seen.add(id(out))
        distinct.append(out)
    return tuple(distinct)


def _check_options(opset: Any, rtol: Any, atol: Any) -> None:
    if isinstance(opset, bool) or not isinstance(opset, int) or opset not in OPSETS:
        raise ValueError(
            f"{WHERE}: opset must be an int from {OPSETS.start} to {OPSETS.stop - 1} (the "
            f"opsets jax2onnx converts to; 23 by default), got {opset!r}."
        )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{WHERE}: {name} must be a number >= 0, got {value!r}.")


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger `name` shows errors only while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def _needed(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(
            f"{WHERE} needs {name}, part of the onnx extra: {EXTRA} (or lm.export, which "
            f"writes StableHLO that runs with JAX and flatbuffers: pip install jax flatbuffers)."
        ) from error


def _float_dtype(jaxpr: Any) -> Any:
    """The first floating dtype other than float32 the jaxpr computes in (None: none)."""
    closed = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    variables = [*closed.constvars, *closed.invars]
    variables += [v for eqn in equations(closed) for v in (*eqn.invars, *eqn.outvars)]
    for var in variables:
        dtype = getattr(var.aval, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float32:
            return dtype
    return None


def _check_float32(closed: Any, model_name: str, locate: Callable[..., str]) -> None:
    dtype = _float_dtype(closed)
    if dtype is None:
        return
    layer = locate(lambda jaxpr: _float_dtype(jaxpr) == dtype)
    raise ExportError(
        f"{WHERE}: {model_name} computes in {dtype} ({_where(layer, model_name)}); ONNX export "
        f"is float32 only. Build the model with dtype=jnp.float32 and float32 variables for "
        f"export (jax.tree.map(lambda v: v.astype(jnp.float32), variables)), or use lm.export "
        f"(StableHLO keeps every dtype)."
    )


def _where(layer: str, model_name: str) -> str:
    return f"in {layer}" if layer else f"in {model_name}"


def _uses(primitive: str, rank: int | None) -> Callable[[Any], bool]:
    def matches(jaxpr: Any) -> bool:
        return any(
            eqn.primitive.name == primitive
            and (rank is None or getattr(eqn.invars[0].aval, "ndim", None) == rank)
            for eqn in equations(jaxpr)
        )

    return matches


def _cannot_express(
    primitive: str,
    reason: str,
    model_name: str,
    locate: Callable[..., str],
    rank: int | None = None,
    fix: str = "lm.export writes the model as StableHLO, which runs it (jax.export), or "
    "change the layer.",
) -> ExportError:
    layer = locate(_uses(primitive, rank))
    return ExportError(
        f"{WHERE}: ONNX cannot express {primitive!r} ({reason}), used {_where(layer, model_name)}"
        f". {fix}"
    )


# jax2onnx's messages that name what failed: a primitive without a plugin, and the layouts of
# a convolution (its rank: 3-D convolutions have none). Anything else is located by the
# plugin's file in the traceback (jax2onnx/plugins/jax/<package>/<primitive>.py).
_PRIMITIVE = re.compile(r"primitive '([A-Za-z_][\w]*)'")
_CONV = re.compile(r"Unsupported conv layouts: lhs=\(([\d, ]*)\)")
_SYMBOLIC = "InconclusiveDimensionOperation"


def _conversion_failed(
    error: Exception, primitives: set[str], model_name: str, locate: Callable[..., str]
) -> ExportError:
    """jax2onnx's error as an `ExportError` naming the primitive and the layer when it can."""
    message = f"{type(error).__name__}: {error}"
    found = _PRIMITIVE.search(message)
    if found:
        return _cannot_express(
            found.group(1), "jax2onnx has no conversion for it", model_name, locate
        )
    conv = _CONV.search(message)
    if conv:
        rank = len(conv.group(1).split(","))
        return _cannot_express(
            "conv_general_dilated",
            f"a convolution over {rank - 2} spatial axes: jax2onnx converts 1-D and 2-D ones",
            model_name,
            locate,
            rank,
        )
    primitive = _plugin_primitive(error, primitives)
    symbolic = [line for line in _chain(error) if line.startswith(_SYMBOLIC)]
    if primitive is not None and symbolic:
        return _cannot_express(
            primitive,
            f"jax2onnx cannot convert it at a symbolic size: {symbolic[0]}",
            model_name,
            locate,
            fix="Export with static shapes (batch_dims=None: one file per batch size), or "
            "use lm.export (StableHLO), which runs symbolic sizes.",
        )
    if primitive is not None:
        return _cannot_express(primitive, f"jax2onnx: {message}", model_name, locate)
    return ExportError(
        f"{WHERE}: jax2onnx could not convert {model_name} ({message}). lm.export writes the "
        f"model as StableHLO (jax.export)."
    )


def _chain(error: BaseException) -> list[str]:
    """``<type>: <first line>`` of an exception and of its causes and contexts."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {str(current).strip().splitlines()[0]}")
        current = current.__cause__ or current.__context__
    return parts


def _plugin_primitive(error: BaseException, primitives: set[str]) -> str | None:
    """The primitive whose jax2onnx plugin raised (the innermost plugin frame), or None."""
    current: BaseException | None = error
    seen: set[int] = set()
    stems: list[str] = []
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in traceback.extract_tb(current.__traceback__):
            parts = pathlib.PurePath(frame.filename).parts
            if len(parts) > 4 and parts[-5:-2] == ("jax2onnx", "plugins", "jax"):
                stems.append(pathlib.PurePath(frame.filename).stem)
        current = current.__cause__ or current.__context__
    for stem in reversed(stems):
        if stem in primitives:
            return stem
        named = sorted(p for p in primitives if p.startswith(stem))
        if named:
            return named[0]
    return None


def _serialized(proto: Any, model_name: str) -> bytes:
    try:
        size = proto.ByteSize()
    except Exception:  # protobuf refuses to measure past its limit
        size = LIMIT + 1
    if size > LIMIT:
        raise ExportError(
            f"{WHERE}: {model_name} makes an ONNX file of {size / 2**30:.1f} GiB, past "
            f"protobuf's 2 GiB limit (weights as external data are not supported yet); use "
            f"lm.export(..., with_variables=False) and lm.save for the variables."
        )
    return proto.SerializeToString()


def _verify(ort: Any, data: bytes, info: Any, rtol: float, atol: float) -> None:
    """Runs the file with ONNX Runtime on the examples (and other sizes); compares."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as error:
        raise ExportError(
            f"{WHERE}: ONNX Runtime cannot load the converted {info.model_name} ({error}); "
            f"nothing written. lm.export writes the model as StableHLO (jax.export)."
        ) from error
    wanted = {i.name for i in session.get_inputs()}  # an unused input is left out
    checks = list(_check_arguments(info))
    # apply's outputs on every check, compiled once for one run (XLA's quick compile: the same
    # program, less optimized).
    every = [arguments for _, arguments in checks]
    compiled = jax.jit(lambda every: [info.fn(*a) for a in every]).lower(every).compile(QUICK)
    for (label, arguments), outputs in zip(checks, compiled(every), strict=True):
        leaves = [np.asarray(x) for x in jax.tree.leaves(arguments)]
        feed = {n: x for n, x in zip(info.input_names, leaves, strict=True) if n in wanted}
        try:
            got = session.run(None, feed)
        except Exception as error:
            raise ExportError(
                f"{WHERE}: ONNX Runtime cannot run the converted {info.model_name} on {label} "
                f"({error}); nothing written. lm.export writes the model as StableHLO "
                f"(jax.export)."
            ) from error
        expected = [np.asarray(x) for x in jax.tree.leaves(outputs)]
        for name, want, have in zip(info.output_names, expected, got, strict=True):
            _compare(info.model_name, label, name, want, np.asarray(have), rtol, atol)


def _compare(
    model_name: str, label: str, name: str, want: Any, have: Any, rtol: float, atol: float
) -> None:
    if want.shape == have.shape and np.allclose(have, want, rtol=rtol, atol=atol, equal_nan=True):
        return
    if want.shape != have.shape:
        detail = f"shape {have.shape} where apply gives {want.shape}"
    else:
        diff = np.abs(have.astype(np.float64) - want.astype(np.float64))
        detail = f"max |onnx - apply| = {np.nanmax(diff):.3g} (rtol={rtol}, atol={atol})"
    raise ExportError(
        f"{WHERE}: ONNX Runtime's output {name!r} of {model_name} differs from apply on "
        f"{label}: {detail}; nothing written. Raise rtol/atol if this is rounding, or use "
        f"lm.export (StableHLO), which runs the model as JAX does."
    )


def _check_arguments(info: Any) -> Iterator[tuple[str, Any]]:
    """The examples, then each symbolic size changed.

    The symbols on axis 0 (the batch) go to 1 and 7 together, every other symbol alone to one
    less (2 for a size of 1).
    """
    yield "the example inputs", info.arguments
    specs = jax.tree.leaves(info.specs)
    leaves, treedef = jax.tree.flatten(info.arguments)
    sizes: dict[str, int] = {}  # each symbol's size in the examples
    batch: set[str] = set()
    for x, spec in zip(leaves, specs, strict=True):
        for axis, dim in enumerate(spec.shape):
            if _symbol(dim):
                sizes[str(dim)] = np.shape(x)[axis]
                if axis == 0:
                    batch.add(str(dim))
    changes = [({s: n for s in batch}, f"a batch of {n}") for n in CHECK_BATCHES if batch]
    for symbol in sorted(set(sizes) - batch):
        n = sizes[symbol] - 1 if sizes[symbol] > 1 else 2
        changes.append(({symbol: n}, f"{symbol} = {n}"))
    for change, label in changes:
        if all(sizes[s] == n for s, n in change.items()):
            continue
        resized = []
        for x, spec in zip(leaves, specs, strict=True):
            x = np.asarray(x)
            for axis, dim in enumerate(spec.shape):
                if str(dim) in change:
                    x = np.take(x, np.arange(change[str(dim)]), axis=axis, mode="wrap")
            resized.append(x)
        yield label, jax.tree.unflatten(treedef, resized)


def _symbol(dim: Any) -> bool:
    """Whether a dimension is one symbol (``b``), not a number or an expression (``2*b``)."""
    return not isinstance(dim, int) and str(dim).isidentifier()
