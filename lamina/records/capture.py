"""`capture_intermediates`, `calls` and `probe`: every module's output, and a model's records.

`capture_intermediates` records what each module's ``__call__`` returns without editing the
model: a profile function (`sys.setprofile`) watches the calls while a wrapped `apply` runs, and
recognises a module's ``__call__`` by its code object (`module.CALL_CODES`), so calling a module
costs nothing extra otherwise. `calls` watches the same way, abstractly (`jax.eval_shape`), and
returns every module call with its arguments and output as shapes (what `lm.summary` lowers one
module at a time). `probe` runs a model once under `jax.jit` and returns its loss, its `lm.sow`
records and the loss's gradient at every `lm.perturb` point.
"""

from __future__ import annotations

import inspect
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
from ..selection.filters import module_predicate


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
        filter: None for every module, or a module filter as `lm.replace` takes: a Module
            class, ``lm.PathContains``, a tuple or combination of them, or a function
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
    predicate = (
        (lambda path, module: True)
        if filter is None
        else module_predicate(filter, "lm.capture_intermediates")
    )

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
    module = _called_module(frame, event)
    if module is None:
        return
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


def _called_module(frame: Any, event: str) -> Module | None:
    """The module whose ``__call__`` `frame` runs, at a "call" or "return" event; else None."""
    if event not in ("call", "return") or id(frame.f_code) not in CALL_CODES:
        return None
    code = frame.f_code
    module = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    # not a module: a decorator's wrapper (`*args`) around a __call__, the inner call counts
    return module if isinstance(module, Module) else None


class Lift(NamedTuple):
    """A lifted transform that lies between a module call and its parent's (`Call.lifts`).

    Attributes:
        name: The transform as lamina names it (``"lm.scan"``, ``"lm.checkpoint"``,
            ``"lm.switch"``, ``"RNN's cell LSTMCell"``).
        run: Numbers the transform's runs in the traced call: every branch of one `lm.cond`
            or `lm.switch` has the same number, two calls of a transform have different ones.
        branch: Which branch of an `lm.cond` or `lm.switch` (in the order they are traced,
            counting only branches that call a module); 0 for other transforms.
    """

    name: str
    run: int
    branch: int


class Call(NamedTuple):
    """One module call that `calls` saw (arrays as `jax.ShapeDtypeStruct`).

    Attributes:
        path: The module's path in the model (its first, for a shared module).
        module: The module (the transformed copy's object).
        args: The positional arguments it received; arrays as shapes, other values as given.
        kwargs: Its keyword arguments, likewise.
        output: What it returned, arrays as shapes.
        parent: The index in the list of the call it ran in; None for the outermost.
        lifts: The lifted transforms that run this call inside its parent's call, outermost
            first (a `Stack` with ``remat=True`` runs its block in ``lm.scan`` then
            ``lm.checkpoint``); empty when none lies between them.
    """

    path: tuple
    module: Module
    args: tuple
    kwargs: dict[str, Any]
    output: Any
    parent: int | None
    lifts: tuple[Lift, ...]

    @property
    def transform(self) -> str | None:
        """The innermost lifted transform between this call and its parent's, or None."""
        return self.lifts[-1].name if self.lifts else None


class CallFailed(Exception):
    """What `calls` raises when the model fails: the innermost failing module and the error.

    Attributes:
        path: The path of the innermost module whose call failed (None: outside any module).
        module: That module, or None.
        error: The exception the model raised.
    """

    def __init__(self, path: tuple | None, module: Module | None, error: Exception):
        super().__init__(str(error))
        self.path, self.module, self.error = path, module, error


def calls(apply: Callable[..., Any]) -> Callable[..., list[Call]]:
    """A function that traces one call of `apply` abstractly and returns its module calls.

    Nothing is computed: the call runs under `jax.eval_shape`, arrays (given or made inside)
    are seen as shapes. Calls are listed in the order they start; the ``super().__call__`` of
    a subclass's call is part of its call, not another. The model runs as under
    `capture_intermediates` (an `RNN` calls its cell at each step), so every module call
    inside a lifted transform is seen once, with the shapes of one step.

    Args:
        apply: A transformed model's `apply`.

    Returns:
        ``recorded(variables, rngs, *args, **kwargs) -> list[Call]``: the variables may be
        shapes (``jax.eval_shape(init, key)``); array arguments (or `jax.ShapeDtypeStruct`)
        are traced, everything else is passed as it is. It raises `CallFailed` (naming the
        innermost module that failed) from the model's error.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.records.capture import calls
        >>> init, apply = lm.transform(lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 2)))
        >>> variables = jax.eval_shape(init, jax.random.key(0))
        >>> [(c.path, c.output.shape) for c in calls(apply)(variables, None, jnp.ones((1, 3)))]
        [((), (1, 2)), (('layers_0',), (1, 4)), (('layers_2',), (1, 2))]
    """

    def recorded(variables: Any, rngs: Any = None, /, *args: Any, **kwargs: Any) -> list[Call]:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        is_array = [isinstance(leaf, (*_ARRAYS, jax.ShapeDtypeStruct)) for leaf in leaves]
        arrays = [_abstract(leaf) for leaf, a in zip(leaves, is_array, strict=True) if a]

        def run(variables: Any, arrays: list) -> Any:
            it = iter(arrays)
            given = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
            a, k = jax.tree_util.tree_unflatten(treedef, given)
            return apply(variables, rngs, *a, **k)

        watcher = _CallWatcher()
        previous, profiler = CAPTURE.request, sys.getprofile()
        register_calls()  # a __call__ assigned to a class after it was created
        # A capture that records nothing: the model runs as it does under capture (an RNN
        # calls its cell, the cell its gates), so that every module call is seen.
        CAPTURE.request = (_CALLS, lambda path, module: False)
        sys.setprofile(watcher)
        try:
            jax.eval_shape(run, _with_request(variables), arrays)
        except Exception as error:
            raise watcher.failure(error) from error
        finally:
            sys.setprofile(profiler)
            CAPTURE.request = previous
        return watcher.calls

    return recorded


_CALLS = "__lamina_calls__"  # the (always empty) collection `calls` requests


def _with_request(variables: Any) -> Any:
    return {**variables, _CALLS: {}} if isinstance(variables, Mapping) else variables


def _abstract(x: Any) -> Any:
    """An array as a `jax.ShapeDtypeStruct` (weak type kept); any other value as it is."""
    if not isinstance(x, _ARRAYS):
        return x
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak)


def _arguments(frame: Any) -> tuple[tuple, dict[str, Any]]:
    """The arguments a ``__call__`` frame received (at its "call" event), without ``self``."""
    code, values = frame.f_code, frame.f_locals
    names, count = code.co_varnames, code.co_argcount
    args = tuple(values[name] for name in names[1:count])
    end = count + code.co_kwonlyargcount
    kwargs = {name: values[name] for name in names[count:end]}
    if code.co_flags & inspect.CO_VARARGS:
        args += tuple(values[names[end]])
        end += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(values[names[end]])
    return args, kwargs


def _shapes(tree: Any) -> Any:
    """`tree` with its arrays as shapes; as it is when it cannot be flattened."""
    try:
        return jax.tree.map(_abstract, tree)
    except Exception:  # a value whose flattening fails here (a State read outside its call)
        return tree


_BRANCHES = ("lm.cond", "lm.switch")


class _CallWatcher:
    """The profile function of `calls`: a stack of the module calls running, and their list."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.plan: Any = None  # the plan of the outermost call: calls of others are not listed
        # (module, index into calls or None for a super().__call__, lamina frame)
        self.running: list[tuple[Module, int | None, Any]] = []
        self.paths: dict[int, tuple] = {}
        # Runs of lifted transforms by the identity of what marks one (a nested frame; for a
        # branch, the layout of shapes its runner gives every branch's frame), and branches
        # by their frame's identity. `kept` holds those objects so that no identity is reused.
        self.runs: dict[int, int] = {}
        self.branches: dict[int, tuple[int, int]] = {}
        self.branch_counts: dict[int, int] = {}
        self.kept: list[Any] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        module = _called_module(frame, event)
        if module is None:
            return
        call_frame = current_frame()
        if call_frame is None:
            return
        if event == "return":
            if self.running and self.running[-1][0] is module:
                _, index, _ = self.running.pop()
                if index is not None:
                    self.calls[index] = self.calls[index]._replace(output=_shapes(arg))
            return
        if self.running and self.running[-1][0] is module:  # super().__call__ of a subclass
            self.running.append((module, None, call_frame))
            return
        if self.plan is None:
            self.plan = call_frame.plan
        path = self.plan.module_paths().get(id(module)) if call_frame.plan is self.plan else None
        if path is None:  # a module of another transformed model called inside this one
            self.running.append((module, None, call_frame))
            return
        self.paths[id(module)] = path
        parent = next((e for e in reversed(self.running) if e[1] is not None), None)
        lifts = () if parent is None else self._lifts(call_frame, parent[2])
        args, kwargs = _shapes(_arguments(frame))
        index = len(self.calls)
        call = Call(path, module, args, kwargs, None, None if parent is None else parent[1], lifts)
        self.calls.append(call)
        self.running.append((module, index, call_frame))

    def _lifts(self, inner: Any, outer: Any) -> tuple[Lift, ...]:
        """The lifted transforms whose nested frames lie from `outer` (excluded) to `inner`."""
        chain = []
        frame = inner
        while frame is not None and frame is not outer:
            chain.append(frame)
            frame = frame.parent
        lifts = []
        for nested in reversed(chain):
            name = nested.inside or "a nested call"
            if name in _BRANCHES:
                # The branches of one lm.cond/lm.switch run in frames of their own that share
                # the layout of shapes their runner computed once for the call.
                run = self._number(nested.shapes)
                found = self.branches.get(id(nested))
                if found is None:
                    found = (run, self.branch_counts.get(run, 0))
                    self.branch_counts[run] = found[1] + 1
                    self.branches[id(nested)] = found
                    self.kept.append(nested)
                lifts.append(Lift(name, *found))
            else:
                lifts.append(Lift(name, self._number(nested), 0))
        return tuple(lifts)

    def _number(self, marker: Any) -> int:
        found = self.runs.get(id(marker))
        if found is None:
            found = self.runs[id(marker)] = len(self.runs)
            self.kept.append(marker)
        return found

    def failure(self, error: Exception) -> CallFailed:
        """`error` with the innermost module call on its traceback that this watcher saw."""
        found: tuple[tuple | None, Module | None] = (None, None)
        tb = error.__traceback__
        while tb is not None:
            module = _called_module(tb.tb_frame, "call")
            if module is not None and id(module) in self.paths:
                found = (self.paths[id(module)], module)
            tb = tb.tb_next
        return CallFailed(*found, error)


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
