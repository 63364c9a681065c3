"""A model's inference call as one pure function of arrays, ready for a format to write.

The contract shared by stablehlo.py and onnx_export.py:

    info = inference_function(model, variables, example_args, *, to_callable=None,
                              with_variables=True, batch_dims=None, allow_training=False,
                              where="lm.export")

returns an `InferenceFunction` whose

- ``fn(*inputs)`` is pure; ``inputs`` are, in order: the variables dict (only when
  ``with_variables=False``; without the cache collections, which come next), the cache
  collections ``{"cache": {...}}`` (only when the call writes `Cache` variables: decoding),
  the random key (only with ``allow_training=True``: one typed key, ``jax.random.key(seed)``,
  the default stream that every named stream falls back to, as ``apply(variables, key,
  ...)``), then the example arguments that are arrays (array-likes and pytrees of them,
  structure kept; the static ones, e.g. a Python ``False`` for ``is_training``, are closed
  over). It returns the model's outputs, or ``(outputs, updated_collections)`` when caches
  are written or ``allow_training=True`` (``updated_collections``: ``{collection: the whole
  collection}`` for each collection the call wrote, the cache's first; ``{}`` when none);
- ``specs`` is a tuple of pytrees of ``jax.ShapeDtypeStruct`` matching ``inputs`` exactly,
  with symbolic dimensions (one `jax.export.symbolic_shape` scope) where ``batch_dims`` asks,
  weak types kept; ``jax.export.export(jax.jit(info.fn), platforms=...)(*info.specs)`` traces
  (lowering fails only for what the format itself cannot hold: a call back into Python, a
  custom call without stability guarantees, which the format reports);
- ``arguments`` is the concrete inputs built from the example arguments (same structure as
  ``specs``; what a format's check runs on; a ``jax.ShapeDtypeStruct`` example gives random
  values: normal floats, integers in ``[0, 2)``, booleans),
  built when first read (an `ExportError` then for an example whose shape is symbolic);
- ``input_names`` / ``output_names`` name the flattened inputs / outputs by pytree path:
  parameter names of the called method (``x``, ``ids``; ``feats/tokens``, ``pair/0`` for the
  leaves of a pytree argument; an argument without a named parameter, as `Sequential`'s
  ``*args``: ``x`` when it is the only input, else ``x_<position>``); ``output`` for one
  array, else ``output/logits``, ``output/0``...; variables by their paths
  (``params/dense/w``, ``cache/attention/cached_key``), the collections the call returns as
  ``updated/cache/attention/cached_key``; the key ``rngs``. All of them distinct: a later
  duplicate (a parameter named ``output``) gets ``_2``;
- ``model_name`` is the model's class name (also ``fn``'s name, which JAX's messages show).

Errors (all before anything is written): `VariablesError` unchanged for variables that do not
fit; `ExportError` for training mode (naming the layer's path; records written by `lm.sow`
count as state), abstract variables to bake in, inputs or outputs an artifact cannot hold,
and a trace that fails on the example arguments (the layer's own error as ``__cause__``);
``TypeError`` for a static argument that is a list of numbers (it would be a constant);
``ValueError`` for bad ``batch_dims`` (a rank that does not fit, one symbol bound to two
sizes by the examples, ``batch_dims`` without array inputs).

The call is traced once abstractly (`jax.eval_shape`, with the specs) before a format traces
it again: that trace finds the training mode (an `RngError` from a key drawn under
``rngs=None``; a variable outside the caches written, found by leaf identity: `apply` returns
the leaves it did not write as it got them, through lifted transforms too) and the cache
writes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._core.checks import format_path, without_run_time_checks
from .._core.errors import ExportError, RngError, VariablesError
from .._core.graph import Plan
from .._core.module import Module
from .._core.transform import transform
from .._core.variables import BatchStat, Cache
from ..io._atomic import check_target as check_target  # the formats' path check
from .locate import failing_layer
from .specs import concrete_example, shape_specs, spec_of, symbolic_specs


@dataclasses.dataclass(frozen=True)
class InferenceFunction:
    """What `inference_function` returns (see the module's docstring)."""

    fn: Callable[..., Any]
    specs: tuple[Any, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    model_name: str
    make_arguments: Callable[[], tuple[Any, ...]]

    @functools.cached_property
    def arguments(self) -> tuple[Any, ...]:
        """The concrete inputs (see the module's docstring), built on first use."""
        return self.make_arguments()


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def inference_function(
    model: Module,
    variables: Any,
    example_args: tuple[Any, ...],
    *,
    to_callable: Callable[[Module], Callable[..., Any]] | None = None,
    with_variables: bool = True,
    batch_dims: Any = None,
    allow_training: bool = False,
    where: str = "lm.export",
) -> InferenceFunction:
    """The model's call as one pure function of arrays (see the module's docstring).

    Args:
        model: The model definition.
        variables: Its variables, as `init` returns them.
        example_args: The positional arguments of one call: arrays become inputs, the rest
            (Python values) are closed over.
        to_callable: Picks the method to run, as `lm.transform`'s.
        with_variables: Bake the variables in (True) or take them as the first input.
        batch_dims: None (static shapes), a dimension name for axis 0 of every array input
            (``"b"``), a polymorphic shape for every input (``"b, t"``, ``"b, ..."``), or a
            tuple of those (None: static) with one entry per array input.
        allow_training: Export a call that draws random keys or updates batch statistics:
            the function then takes a key first and returns the updated collections too.
        where: The caller's name, for messages.

    Returns:
        An `InferenceFunction`.

    Raises:
        VariablesError: The variables do not fit the model.
        ExportError: Training mode, outputs an artifact cannot hold, or a failing trace.
        ValueError: A bad `batch_dims`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.deploy.inference import inference_function
        >>> model = lm.Dense(3, 2)
        >>> variables = lm.init(model)(jax.random.key(0))
        >>> info = inference_function(model, variables, (jnp.ones((4, 3)),), batch_dims="b")
        >>> info.specs, info.input_names, info.output_names
        ((ShapeDtypeStruct(shape=(b, 3), dtype=float32),), ('x',), ('output',))
        >>> info.fn(jnp.ones((7, 3))).shape
        (7, 2)
        >>> sequential = lm.Sequential(model, lm.relu)  # __call__(*args): the one input is x
        >>> seq_variables = lm.init(sequential)(jax.random.key(0))
        >>> inference_function(sequential, seq_variables, (jnp.ones((4, 3)),)).input_names
        ('x',)
        >>> two = lambda m: lambda *xs: m(xs[0] + xs[1])  # several inputs without names
        >>> x = jnp.ones((4, 3))
        >>> inference_function(model, variables, (x, x), to_callable=two).input_names
        ('x_0', 'x_1')
    """
    for name, flag in (("with_variables", with_variables), ("allow_training", allow_training)):
        if not isinstance(flag, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {flag!r}.")
    if not isinstance(example_args, tuple):
        example_args = tuple(example_args)
    model_name = type(model).__name__
    apply = transform(model, to_callable).apply
    plan = Plan(model)
    method = _method(model, to_callable)
    slots, inputs, arg_names = _split_arguments(example_args, method, where)
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{where}: variables must be the dict that init returns ({{collection: ...}}), "
            f"got {type(variables).__name__}; the call is {where}(model, variables, *args)."
        )
    variables = dict(variables)
    if with_variables:
        _check_concrete(variables, where)
    shapes = shape_specs(inputs, arg_names, batch_dims, where)
    key = jax.random.key(0)

    def run(variables: Any, rngs: Any, arrays: list[Any]) -> Any:
        # A decoding step's run-time overflow check calls the host, which no artifact can
        # hold: left out, see `without_run_time_checks` for what an overflowing step does.
        with without_run_time_checks():
            return apply(variables, rngs, *_rebuild(example_args, slots, arrays))

    # One abstract trace: training mode, cache writes and the outputs, with the final specs.
    var_specs = jax.tree.map(spec_of, variables)
    symbolic = symbolic_specs(inputs, arg_names, shapes, where)
    probe_rngs = jax.ShapeDtypeStruct(key.shape, key.dtype) if allow_training else None
    seen: dict[str, Any] = {}

    def probe(variables: Any, rngs: Any, arrays: list[Any]) -> Any:
        outputs, new = run(variables, rngs, arrays)
        given = {id(leaf) for leaf in jax.tree_util.tree_leaves(variables)}
        flat = jax.tree_util.tree_flatten_with_path(new)[0]
        seen["written"] = {
            tuple(_key_name(k) for k in path) for path, leaf in flat if id(leaf) not in given
        }
        seen["new"] = new
        return outputs

    try:
        outputs = jax.eval_shape(probe, var_specs, probe_rngs, list(symbolic))
    except (VariablesError, ExportError):
        raise
    except RngError as error:
        raise ExportError(
            _draws_keys(apply, var_specs, example_args, slots, symbolic, where, model_name)
        ) from error
    except Exception as error:
        raise ExportError(
            _trace_failed(apply, var_specs, example_args, slots, symbolic, where, model_name, error)
        ) from error
    _check_tree(outputs, (), f"{model_name} returns", where)

    written = [entry for entry in plan.variables if entry.key in seen["written"]]
    cache_collections = sorted({e.collection for e in written if isinstance(e.state, Cache)})
    others = [e for e in written if e.collection not in cache_collections]
    if others and not allow_training:
        raise ExportError(_updates_state(plan, others[0], where, model_name))
    # records (lm.sow) into a collection given among the variables but not the model's own
    declared = {e.collection for e in plan.variables}
    recorded = sorted({path for path in seen["written"] if path[0] not in declared})
    if recorded and not allow_training:
        raise ExportError(_records(recorded[0], where, model_name))
    updated = cache_collections + sorted({e.collection for e in others} | {p[0] for p in recorded})
    pair = bool(cache_collections) or allow_training

    baked = {c: v for c, v in variables.items() if c not in cache_collections}
    caches = {c: variables[c] for c in cache_collections}

    def fn(*given: Any) -> Any:
        position = 0
        if with_variables:
            full = dict(baked)
        else:
            full = dict(given[position])
            position += 1
        if cache_collections:
            full.update(given[position])
            position += 1
        rngs = None
        if allow_training:
            rngs = given[position]
            position += 1
        outputs, new = run(full, rngs, list(given[position:]))
        if not pair:
            return outputs
        return outputs, {c: new[c] for c in updated}

    fn.__name__ = fn.__qualname__ = model_name  # JAX's messages name the exported function

    specs: list[Any] = []
    concrete: list[tuple[Any, str]] = []  # (example, name) per input, for `arguments`
    names: list[str] = []
    if not with_variables:
        specs.append(jax.tree.map(spec_of, baked))
        concrete.append((baked, "variables"))
        names += _paths(baked)
    if cache_collections:
        specs.append(jax.tree.map(spec_of, caches))
        concrete.append((caches, "cache"))
        names += _paths(caches)
    if allow_training:
        specs.append(probe_rngs)
        concrete.append((key, "rngs"))
        names.append("rngs")
    specs += symbolic
    concrete += list(zip(inputs, arg_names, strict=True))
    names += _input_names(inputs, arg_names)
    output_names = _output_names(outputs)
    if pair:
        output_names += [f"updated/{p}" for p in _paths({c: seen["new"][c] for c in updated})]
    unique = _unique([*names, *output_names])
    names, output_names = unique[: len(names)], unique[len(names) :]
    all_specs = tuple(specs)

    def make_arguments() -> tuple[Any, ...]:
        rng = np.random.default_rng(0)
        return tuple(
            jax.tree.map(
                functools.partial(concrete_example, name=name, where=where, rng=rng), x, spec
            )
            for (x, name), spec in zip(concrete, all_specs, strict=True)
        )

    return InferenceFunction(
        fn=fn,
        specs=all_specs,
        input_names=tuple(names),
        output_names=tuple(output_names),
        model_name=model_name,
        make_arguments=make_arguments,
    )


def _method(model: Module, to_callable: Callable[[Module], Callable[..., Any]] | None) -> Any:
    """The method the call runs (for its parameter names), or None."""
    try:
        return model if to_callable is None else to_callable(model)  # signature: __call__'s
    except Exception:  # transform has already checked the picker on its copy
        return None


def _split_arguments(
    example_args: tuple[Any, ...], method: Any, where: str
) -> tuple[list[bool], list[Any], list[str]]:
    """Which example arguments are inputs (pytrees of arrays), those inputs and their names."""
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    slots, inputs, names = [], [], []
    leaves_of = [jax.tree_util.tree_leaves(arg) for arg in example_args]
    kinds = [[isinstance(leaf, _ARRAYS) for leaf in leaves] for leaves in leaves_of]
    count = sum(1 for arrays in kinds if arrays and all(arrays))
    for i, (arg, leaves, arrays) in enumerate(zip(example_args, leaves_of, kinds, strict=True)):
        name = _parameter_name(parameters, i, count)
        label = f"example argument {i} ({name})"
        if leaves and all(arrays):
            _check_tree(arg, (), f"{label} is", where)
            slots.append(True)
            inputs.append(arg)
            names.append(name)
        elif any(arrays):
            raise TypeError(
                f"{where}: {label} mixes arrays and Python values ({type(arg).__name__}); an "
                f"input must be an array or a pytree of arrays, a static argument (closed "
                f"over) must hold no arrays."
            )
        elif isinstance(arg, (list, tuple)) and any(_is_number(leaf) for leaf in leaves):
            raise TypeError(
                f"{where}: {label} is a {type(arg).__name__} of numbers, which the artifact "
                f"would hold as a constant (the same values whatever it is called with). Pass "
                f"np.asarray(...) of it to make it an input; a setting such as a kernel size "
                f"is fixed through to_callable (to_callable=lambda m: lambda x: m(x, (3, 3)))."
            )
        else:
            slots.append(False)
    return slots, inputs, names


def _is_number(leaf: Any) -> bool:
    return isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)


def _parameter_name(parameters: list[inspect.Parameter], i: int, inputs: int) -> str:
    """Argument `i`'s name: its parameter's, or ``x`` / ``x_<i>`` without one.

    Without a named parameter (a ``*args`` method, as `Sequential`'s, or no signature): ``x``
    when the call has one input (`inputs`), else ``x_<i>``.
    """
    named = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if i < len(named):
        return named[i].name
    return "x" if inputs == 1 else f"x_{i}"


def _rebuild(example_args: tuple[Any, ...], slots: list[bool], arrays: list[Any]) -> list[Any]:
    """The call's arguments: the inputs in their slots, the static ones as given."""
    it = iter(arrays)
    return [next(it) if slot else arg for arg, slot in zip(example_args, slots, strict=True)]


def _check_concrete(variables: dict[str, Any], where: str) -> None:
    """Variables to bake in must be arrays, not the specs `jax.eval_shape` of init gives."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            shown = "/".join(_key_name(k) for k in path)
            raise ExportError(
                f"{where}: the variables hold a ShapeDtypeStruct at {shown} (abstract "
                f"variables, as jax.eval_shape of init gives), which cannot be baked into an "
                f"artifact. Pass with_variables=False to export f(variables, *inputs) from "
                f"them, or the real variables (from init or a checkpoint)."
            )


def _draws_keys(
    apply: Callable[..., Any],
    var_specs: Any,
    example_args: tuple,
    slots: list[bool],
    symbolic: list[Any],
    where: str,
    model_name: str,
) -> str:
    layer = failing_layer(apply, var_specs, _rebuild(example_args, slots, symbolic))
    return (
        f"{where}: {model_name} draws random keys{f' in {layer}' if layer else ''} (dropout "
        f"on, or another layer that samples): this is exporting in training mode. Pass "
        f"is_training=False (or the model's own flag) among the example arguments"
        f"{_or_allow_training(where)}."
    )


def _or_allow_training(where: str) -> str:
    """The suggestion of ``allow_training``, which only `lm.export` takes."""
    if where != "lm.export":
        return ""
    return (
        ", or allow_training=True to export a function that takes a key: "
        "f(key, *inputs) -> (outputs, updated_collections)"
    )


def _trace_failed(
    apply: Callable[..., Any],
    var_specs: Any,
    example_args: tuple,
    slots: list[bool],
    symbolic: list[Any],
    where: str,
    model_name: str,
    error: Exception,
) -> str:
    layer = failing_layer(apply, var_specs, _rebuild(example_args, slots, symbolic))
    shapes = ", ".join(
        str(s.shape) if isinstance(s, jax.ShapeDtypeStruct) else type(s).__name__
        for s in jax.tree_util.tree_leaves(symbolic)
    )
    return (
        f"{where}: tracing {model_name} with the example arguments failed"
        f"{f' in {layer}' if layer else ''}: "
        f"{type(error).__name__}: {error} (array inputs of shapes {shapes or 'none'}). Pass "
        f"example arguments that apply accepts."
    )


def _updates_state(plan: Plan, entry: Any, where: str, model_name: str) -> str:
    # the innermost module holding the variable (a variable may sit in a dict of its module)
    module_path: tuple = ()
    layer = type(plan.root).__name__
    for path, module in plan.modules:
        if len(module_path) < len(path) < len(entry.path) and entry.path[: len(path)] == path:
            module_path, layer = path, type(module).__name__
    if isinstance(entry.state, BatchStat):
        why = (
            "in training mode): an exported artifact would compute batch statistics instead "
            "of using the stored ones"
        )
    else:
        why = (
            "a variable outside the decoding caches): an inference artifact neither takes nor "
            "returns it, so the update would be lost"
        )
    return (
        f"{where}: {model_name} updates {format_path(entry.path, entry.collection)} "
        f"({layer} at {format_path(module_path)}, {why}. Pass is_training=False (or the "
        f"model's own flag) among the example arguments{_or_allow_training(where)}."
    )


def _records(path: tuple[str, ...], where: str, model_name: str) -> str:
    collection = path[0]
    return (
        f"{where}: {model_name} records {'/'.join(path)} (lm.sow into the collection "
        f"{collection!r}, given among the variables), which an inference artifact neither "
        f"takes nor returns, so the values would be lost. Leave {collection!r} out of the "
        f"variables (nothing is recorded then), or return the value from the exported method "
        f"(to_callable){_or_allow_training(where)}."
    )


def _check_tree(tree: Any, path: tuple, what: str, where: str) -> None:
    """Refuses containers an artifact cannot hold (T9): only tuple, list, dict(str), None.

    `what` starts the message: ``"Model returns"`` (outputs), ``"example argument 0 (x)
    is"`` (inputs, checked before anything is traced).
    """
    if tree is None or isinstance(tree, (jax.ShapeDtypeStruct, *_ARRAYS)):
        return
    kind = type(tree)
    at = f" at [{']['.join(repr(k) for k in path)}]" if path else ""
    if kind in (tuple, list):
        for i, item in enumerate(tree):
            _check_tree(item, (*path, i), what, where)
        return
    fix = (
        "Return a tuple or dict instead (e.g. to_callable=lambda m: lambda *a: tuple(m(*a)))"
        if what.endswith("returns")
        else "Pass a tuple or dict with string keys instead (and rebuild yours in to_callable)"
    )
    if kind is dict:
        for key, item in tree.items():
            if not isinstance(key, str):
                raise ExportError(
                    f"{where}: {what} a dict with the key {key!r}{at}; an exported artifact "
                    f"holds dicts with string keys only. {fix}."
                )
            _check_tree(item, (*path, key), what, where)
        return
    raise ExportError(
        f"{where}: {what} a {kind.__name__}{at}, which an exported artifact cannot hold (only "
        f"arrays in tuples, lists, dicts with string keys and None). {fix}."
    )


def _paths(tree: Any) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ["/".join(_key_name(k) for k in path) for path, _ in flat]


def _key_name(key: Any) -> str:
    """A pytree path entry as text: a dict's key, a sequence's index."""
    return str(getattr(key, "key", getattr(key, "idx", key)))


def _input_names(inputs: list[Any], names: list[str]) -> list[str]:
    """The parameter's name for an array, ``name/<path>`` for each leaf of a pytree."""
    result = []
    for arg, name in zip(inputs, names, strict=True):
        if isinstance(arg, _ARRAYS):
            result.append(name)
        else:
            result += [f"{name}/{path}" for path in _paths(arg)]
    return result


def _output_names(outputs: Any) -> list[str]:
    """``output`` for one array, ``output/<path>`` for each leaf of a pytree."""
    if isinstance(outputs, _ARRAYS):
        return ["output"]
    return [f"output/{path}" for path in _paths(outputs)]


def _unique(names: list[str]) -> list[str]:
    """The names, a later duplicate suffixed ``_2``, ``_3``... (formats name each value once)."""
    taken = set(names)
    seen: set[str] = set()
    result = []
    for name in names:
        unique, count = name, 1
        while unique in seen or (unique != name and unique in taken):
            count += 1
            unique = f"{name}_{count}"
        seen.add(unique)
        result.append(unique)
    return result
