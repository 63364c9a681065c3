"""`capture_intermediates` and `probe`: every module's output, and a model's records in one call.

`capture_intermediates` records what each module's ``__call__`` returns without editing the
model: a profile function (`sys.setprofile`) watches the calls while a wrapped `apply` runs, and
recognises a module's ``__call__`` by its code object (`module.CALL_CODES`), so calling a module
costs nothing extra otherwise. `probe` runs a model once under `jax.jit` and returns its loss,
its `lm.sow` records and the loss's gradient at every `lm.perturb` point.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import format_path
from .._core.errors import VariablesError
from .._core.frame import current_frame
from .._core.module import CALL_CODES, Module, register_calls
from .._core.recording import CAPTURE, MISSING, flatten_records


def _module_predicate(filter: Any) -> Callable[[tuple, Module], bool]:
    if filter is None:
        return lambda path, module: True
    if isinstance(filter, type) or (
        isinstance(filter, tuple) and filter and all(isinstance(f, type) for f in filter)
    ):
        return lambda path, module: isinstance(module, filter)
    if callable(filter):
        return filter
    raise TypeError(
        f"capture_intermediates: filter is None (every module), a Module class or tuple of "
        f"classes, or a function (path, module) -> bool, got {type(filter).__name__}."
    )


def capture_intermediates(
    apply: Callable[..., Any], filter: Any = None, *, collection: str = "intermediates"
) -> Callable[..., Any]:
    """An `apply` that also records the output of every module call (or those `filter` picks).

    Like Linen's ``capture_intermediates``: the model is not edited. Each output is recorded
    under the module's path with the name ``"__call__"`` (a tuple, one entry per call), in
    `collection` of the new variables, together with anything `lm.sow` records there.
    Wrap the transformed `apply` itself, then jit the result
    (``jax.jit(lm.capture_intermediates(apply))``): the outputs are seen while the model is
    traced, so a `jax.jit(apply)` that has already traced the same call would replay a
    program without them.

    Args:
        apply: A transformed model's `apply`.
        filter: None for every module; a Module class or a tuple of them; or a function
            ``(path, module) -> bool``.
        collection: Where to record.

    Returns:
        A function with `apply`'s signature.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 2))
        >>> init, apply = lm.transform(model)
        >>> variables = init(jax.random.key(0))
        >>> _, new = lm.capture_intermediates(apply, lm.Dense)(variables, None, jnp.ones((1, 3)))
        >>> jax.tree.map(jnp.shape, new["intermediates"])
        {'layers_0': {'__call__': ((1, 4),)}, 'layers_2': {'__call__': ((1, 2),)}}
    """
    predicate = _module_predicate(filter)

    def captured(variables: Any, rngs: Any = None, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(variables, Mapping) and collection not in variables:
            variables = {**variables, collection: {}}
        previous, profiler = CAPTURE.request, sys.getprofile()
        register_calls()  # a __call__ assigned to a class after it was created
        CAPTURE.request = (collection, predicate)
        sys.setprofile(_watch_calls)
        try:
            return apply(variables, rngs, *args, **kwargs)
        finally:
            sys.setprofile(profiler)
            CAPTURE.request = previous

    return captured


def _watch_calls(frame: Any, event: str, arg: Any) -> None:
    """Records what each module's ``__call__`` returns.

    A profile function (`sys.setprofile`), for this thread only and only while a captured
    apply runs: modules cost nothing extra otherwise.
    """
    if event not in ("call", "return") or id(frame.f_code) not in CALL_CODES:
        return
    code = frame.f_code
    module = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    if not isinstance(module, Module):
        return  # a decorator's wrapper (`*args`) around a __call__: the inner call records
    call_frame = current_frame()
    records = None if call_frame is None else call_frame.records
    if records is None or records.capture is None or records.blocked is not None:
        return  # no capture here, or a raw transform lamina runs (an RNN's time steps)
    if event == "call":
        records.calling[id(module)] = records.calling.get(id(module), 0) + 1
        return
    depth = records.calling.pop(id(module), 1) - 1
    if depth:  # the super().__call__ of a subclass's call: the outer call records
        records.calling[id(module)] = depth
        return
    collection, predicate = records.capture
    path = call_frame.plan.module_paths().get(id(module))  # type: ignore[union-attr]
    if path is None or not predicate(path, module):
        return
    key = (*path, "__call__")
    previous = records.read(collection, key)
    records.write(collection, key, (*(() if previous is MISSING else previous), arg))


class Probe(NamedTuple):
    """What `probe` returns.

    Attributes:
        loss: The loss's value.
        outputs: The model's outputs.
        intermediates: Every record of the ``"intermediates"`` collection, by path
            (``"layer1/h"``).
        gradients: The loss's gradient with respect to every `lm.perturb`-tagged value, by
            path.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Scaled(lm.Module):
        ...     def __call__(self, x):
        ...         return 3.0 * lm.perturb("x", x)
        >>> init, apply = lm.transform(Scaled())
        >>> result = lm.probe(apply, {}, None, jnp.ones(2), loss=jnp.sum)
        >>> float(result.loss), result.gradients["x"].tolist()
        (6.0, [3.0, 3.0])
    """

    loss: Any
    outputs: Any
    intermediates: dict[str, Any]
    gradients: dict[str, Any]


def probe(
    apply: Callable[..., Any],
    variables: Any,
    rngs: Any,
    *args: Any,
    loss: Callable[[Any], Any],
    capture: Any = False,
    **kwargs: Any,
) -> Probe:
    """Runs a model once and returns its loss, intermediates and perturbation gradients.

    One jitted program computes the loss, every record `lm.sow` makes in "intermediates" and
    the loss's gradient at every `lm.perturb` point, each keyed by path.

    Args:
        apply: A transformed model's `apply`.
        variables: Its variables.
        rngs: Its random keys (or None).
        *args: The model's inputs.
        loss: ``outputs -> scalar``.
        capture: Also record each module's output (`capture_intermediates`): False, True
            (every module), or a filter as `capture_intermediates` takes.
        **kwargs: The model's keyword arguments.

    Returns:
        A `Probe`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Model(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(3, 2)
        ...     def __call__(self, x):
        ...         h = lm.perturb("h", self.dense(x))
        ...         lm.sow("h", h)
        ...         return h
        >>> init, apply = lm.transform(Model())
        >>> variables = init(jax.random.key(0))
        >>> result = lm.probe(apply, variables, None, jnp.ones((1, 3)), loss=jnp.sum)
        >>> sorted(result.gradients), result.gradients["h"].tolist()
        (['h'], [[1.0, 1.0]])
    """
    if not callable(loss):
        raise TypeError(
            f"lm.probe: loss is a function outputs -> scalar, got {type(loss).__name__}."
        )
    if isinstance(variables, Mapping) and any(
        c in variables for c in ("intermediates", "perturbations")
    ):
        raise VariablesError(
            "lm.probe makes the 'intermediates' and 'perturbations' collections itself: pass "
            "the model's variables without them."
        )
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = tuple(isinstance(leaf, _ARRAYS) for leaf in leaves)
    static = tuple(leaf for leaf, d in zip(leaves, dynamic, strict=True) if not d)
    arrays = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
    key: Any = (apply, loss, capture, treedef, dynamic, static)
    try:
        program = _PROGRAMS.pop(key, None)
    except TypeError:  # an unhashable argument: compiled for this call only
        key, program = None, None
    if program is None:
        program = _probe_program(apply, loss, capture, treedef, dynamic, static)
    if key is not None:
        _PROGRAMS[key] = program  # the most recently used last
        while len(_PROGRAMS) > 32:
            del _PROGRAMS[next(iter(_PROGRAMS))]
    value, outputs, intermediates, grads = program(variables, rngs, arrays)
    return Probe(value, outputs, _by_path(intermediates), _by_path(grads))


_ARRAYS = (jax.Array, np.ndarray, np.generic)
# Compiled probes by (apply, loss, capture, the inputs' structure and non-array values): a
# second probe of the same model with new arrays of the same shapes reuses the program.
_PROGRAMS: dict[Any, Any] = {}


def _probe_program(
    apply: Callable[..., Any],
    loss: Callable[[Any], Any],
    capture: Any,
    treedef: Any,
    dynamic: tuple[bool, ...],
    static: tuple,
) -> Callable[..., Any]:
    """The jitted probe.

    Array inputs are traced; everything else (flags such as ``is_training``) is a constant
    of the program.
    """
    run = apply
    if capture is not False:
        run = capture_intermediates(apply, None if capture is True else capture)

    @jax.jit
    def program(variables: Any, rngs: Any, arrays: list) -> Any:
        it_arrays, it_static = iter(arrays), iter(static)
        leaves = [next(it_arrays) if d else next(it_static) for d in dynamic]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)

        def call(perturbations: Any) -> Any:
            given = {**variables, "intermediates": {}, "perturbations": perturbations}
            outputs, new = run(given, rngs, *args, **kwargs)
            return loss(outputs), (outputs, new["intermediates"])

        # The perturbations' shapes: an abstract call that asks for them (no computation).
        requested = {**variables, "intermediates": {}, "perturbations": {}}
        shapes = jax.eval_shape(lambda v: run(v, rngs, *args, **kwargs)[1], requested)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["perturbations"])
        (value, (outputs, intermediates)), grads = jax.value_and_grad(call, has_aux=True)(zeros)
        return value, outputs, intermediates, grads

    return program


def _by_path(tree: Mapping) -> dict[str, Any]:
    return {format_path(key): value for key, value in flatten_records(tree, "").items()}
