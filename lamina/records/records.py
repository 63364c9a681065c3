"""Intermediates and perturbations: collections a call records into when the caller asks.

Flax Linen's ``sow``/``perturb`` semantics over a pure `apply`. A collection the model does not
declare, passed to `apply` among the variables (``{**variables, "intermediates": {}}``), is a
*request*: `sow` and `perturb` record into it, and `apply` returns it in the new variables.
Without the request they do nothing (the traced program is the same as without the call).

A record's key is the recording module's path plus its name (the recording module is the
innermost one whose method is running, found on the Python stack by the methods' code objects,
so calling a module costs nothing extra; a method is any function among the attributes of the
module's classes, including one assigned to a class after it was created); the collection is
returned as a
nested dict like the variables (``{"intermediates": {"layer1": {"h": (array,)}}}``). Entries
given in a requested collection are inputs: `sow` reduces into them, `perturb` adds them;
every given entry must be used, so a misspelt collection name is an error, not ignored data.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import VariablesError, format_path
from .._core.frame import current_frame, require_frame
from .._core.module import CALL_CODES, Module, register_calls, running_module

Key = tuple  # a module's path plus the record's name


def _append(records: tuple, value: Any) -> tuple:
    return (*records, value)


def _empty() -> tuple:
    return ()


class Records:
    """What one frame records: the requested collections, given and produced entries.

    Attributes:
        given: ``{collection: {key: value}}``, the entries passed in.
        out: ``{collection: {key: value}}``, what the call recorded (and the given entries
            it used), in the order first recorded.
        used: The ``(collection, key)`` pairs of given entries that were read.
        capture: For `capture_intermediates`: ``(collection, predicate)`` or None.
        blocked: Where recording cannot happen (a raw JAX transform lamina runs, such as an
            RNN's scan over time), for the message; None where it can.
    """

    __slots__ = ("blocked", "calling", "capture", "given", "out", "used")

    def __init__(
        self,
        given: dict[str, dict[Key, Any]],
        capture: tuple[str, Callable[[tuple, Module], bool]] | None = None,
        blocked: str | None = None,
    ):
        self.given = given
        self.out: dict[str, dict[Key, Any]] = {name: {} for name in given}
        self.used: set[tuple[str, Key]] = set()
        self.capture = capture
        self.blocked = blocked
        self.calling: dict[int, int] = {}  # id(module) -> how many of its __call__ run

    def wants(self, collection: str) -> bool:
        return collection in self.out

    def read(self, collection: str, key: Key) -> Any:
        """The entry recorded so far, else the given one (marked used), else `_MISSING`."""
        out = self.out[collection]
        if key in out:
            return out[key]
        given = self.given[collection]
        if key in given:
            self.used.add((collection, key))
            return given[key]
        return _MISSING

    def write(self, collection: str, key: Key, value: Any) -> None:
        if self.blocked is not None:
            raise VariablesError(
                f"cannot record {format_path(key, collection)} inside {self.blocked}: the "
                f"record could not leave that JAX transform. Record outside it, or return the "
                f"value and record it afterwards."
            )
        self.out[collection][key] = value

    def nested(self, given: dict[str, dict[Key, Any]], blocked: str | None = None) -> Records:
        """Records for a frame nested inside a lifted transform, with the same requests."""
        inner = Records({c: given.get(c, {}) for c in self.out}, self.capture, blocked)
        return inner

    def absorb(self, inner: Records, produced: Mapping[str, Mapping[Key, Any]], where: str):
        """Takes in what a nested frame recorded, and which given entries it used.

        `produced` is the nested frame's records as they came out of the transform, with its
        axes.
        """
        self.used |= inner.used
        for collection, entries in produced.items():
            out = self.out[collection]
            for key, value in entries.items():
                if key in out:
                    raise VariablesError(
                        f"{format_path(key, collection)} was recorded both inside {where} and "
                        f"outside it; the records inside carry the transform's axis, so they "
                        f"cannot be combined. Give them different names."
                    )
                out[key] = value

    def unused(self) -> list[tuple[str, Key]]:
        given = self.given.items()
        return [(c, k) for c, entries in given for k in entries if (c, k) not in self.used]


_MISSING: Any = object()


# --- apply's side: requests in, records out --------------------------------------------------


def split_requests(
    variables: Any, declared: frozenset[str]
) -> tuple[Any, dict[str, dict[Key, Any]] | None]:
    """Separates the collections the model does not declare (requests) from `variables`.

    Returns:
        ``(variables without them, {collection: {key: value}})``, or ``(variables, None)``
        when there is none (the common case, one pass over the top-level keys).
    """
    # every apply comes here: `issuperset` is the one pass over the keys, in C
    if not isinstance(variables, Mapping) or declared.issuperset(variables):
        return variables, None
    if declared and not any(c in declared for c in variables):
        return variables, None  # not a variables dict at all (variables["params"]?): bind says
    kept, requests = {}, {}
    for collection, tree in variables.items():
        if collection in declared:
            kept[collection] = tree
        else:
            requests[collection] = _flatten(tree, collection)
    return kept, requests


def _flatten(tree: Any, collection: str) -> dict[Key, Any]:
    """``{key: leaf}`` of a nested dict of records.

    Dicts are followed; anything else is an entry (a tuple of sown values is one entry).
    """
    if not isinstance(tree, Mapping):
        raise VariablesError(
            f"the collection {collection!r} passed to apply is not a dict: the model does "
            f"not declare it, so it is taken as a request to record (lm.sow, lm.perturb), "
            f"which is a dict of records ({{}} to ask for them), got {type(tree).__name__}."
        )
    flat: dict[Key, Any] = {}

    def visit(prefix: Key, node: Mapping) -> None:
        for name, child in node.items():
            if isinstance(child, Mapping):
                visit((*prefix, name), child)
            else:
                flat[(*prefix, name)] = child

    visit((), tree)
    return flat


def finish(records: Records, plan_collections: frozenset[str]) -> dict[str, Any]:
    """The requested collections as nested dicts; raises if a given entry went unused."""
    unused = records.unused()
    if unused:
        shown = ", ".join(format_path(k, c) for c, k in unused[:5])
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        collections = sorted({c for c, _ in unused})
        declared = ", ".join(repr(c) for c in sorted(plan_collections)) or "none"
        raise VariablesError(
            f"apply was given {shown}{more}, but no lm.sow or lm.perturb of this call used "
            f"it. The model declares the collections {declared}; "
            f"{', '.join(repr(c) for c in collections)} is not one of them, so it is read as "
            f"records to reduce into. Check the collection's name and the record's path."
        )
    result: dict[str, Any] = {}
    for collection, entries in records.out.items():
        tree: dict[str, Any] = {}
        for key, value in entries.items():
            node = tree
            for part in key[:-1]:
                child = node.setdefault(str(part), {})
                if not isinstance(child, dict):
                    raise VariablesError(
                        f"{format_path(key, collection)} and the record "
                        f"{format_path(key[: len(key) - 1], collection)} collide: a module "
                        f"path and a record name are the same. Rename the record."
                    )
                node = child
            if isinstance(node.get(str(key[-1])), dict):
                raise VariablesError(
                    f"the record {format_path(key, collection)} has the path of a module that "
                    f"records too. Rename the record."
                )
            node[str(key[-1])] = value
        result[collection] = tree
    return result


# --- the calling module ------------------------------------------------------------------


def _record_key(plan: Any, name: str, what: str) -> Key:
    """The key of record `name` made by the calling module: its path, then the name."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{what}: a record's name is a non-empty str without '/', got {name!r}.")
    return (*_calling_module(plan, name, what)._lamina_path, name)  # type: ignore[misc]


def _calling_module(plan: Any, name: str, what: str) -> Module:
    """The module whose method is running: the innermost on the stack, of `plan`'s modules.

    A method is a function among the attributes of the module's class (or of a class it
    inherits from), known by its code object: those of the class body are registered when the
    class is created (`module.METHOD_CODES`); a frame whose first parameter holds a module of
    the plan and whose code is not registered is looked up in that module's classes as they
    are now (`module.method_of`), so a method assigned to the class later counts too. The
    module is what its first parameter holds. Other functions on the way (a closure, a
    lambda, a helper given a module, JAX's own frames under a transform) are passed over,
    so a closure that a parent hands to a child records under the child, wherever it was
    defined.
    """
    module = running_module(plan.module_paths())
    if module is not None:
        return module
    raise RuntimeError(
        f"{what}({name!r}) ran while no method of a module of the model being applied was "
        f"running (a function given to lm.transform's to_callable, or a method attached to "
        f"one module object rather than to its class?): a record belongs to the module "
        f"whose method calls it. Call {what} inside a method of a Module subclass."
    )


# --- the public functions ------------------------------------------------------------------


def sow(
    name: str,
    value: Any,
    *,
    collection: str = "intermediates",
    reduce_fn: Callable[[Any, Any], Any] = _append,
    init_fn: Callable[[], Any] = _empty,
) -> bool:
    """Records `value` under the calling module's path, if the caller asked for `collection`.

    Call it inside a module's method. The caller asks by passing the collection, empty, among
    the variables: ``apply({**variables, "intermediates": {}}, rngs, x)`` returns the records
    in ``new_variables["intermediates"]``. Without that, `sow` records nothing and adds nothing
    to the traced program. The record is ``reduce_fn(previous, value)``, where `previous` is
    what was recorded under the same name before in this call (or given in the collection),
    else ``init_fn()``: by default a tuple that grows by one value per call, so a module called
    twice records two values. Inside `lm.vmap` and `lm.scan` (and so `lm.Stack`) the records
    come out with the transform's axis in front.

    The record belongs to the innermost module whose method is running when `sow` runs (a
    method: a function among the attributes of a Module subclass, or of a class it inherits
    from, `__call__` or any other, whether defined in the class body or assigned to the
    class later). A function that is not a method records under the module whose method
    called it: a closure that a parent defines and hands to a child
    records under the child, whatever names the closure uses.

    Args:
        name: The record's name under the module's path.
        value: What to record (any pytree).
        collection: The collection to record into.
        reduce_fn: ``(previous, value) -> record``.
        init_fn: ``() -> the first previous``.

    Returns:
        Whether it recorded (the collection was requested).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Mlp(lm.Module):
        ...     def __init__(self):
        ...         self.hidden, self.out = lm.Dense(3, 4), lm.Dense(4, 2)
        ...     def __call__(self, x):
        ...         h = lm.relu(self.hidden(x))
        ...         lm.sow("h", h)
        ...         return self.out(h)
        >>> init, apply = lm.transform(Mlp())
        >>> variables = init(jax.random.key(0))
        >>> _, new = apply({**variables, "intermediates": {}}, None, jnp.ones((2, 3)))
        >>> [h.shape for h in new["intermediates"]["h"]]
        [(2, 4)]
        >>> "intermediates" in apply(variables, None, jnp.ones((2, 3)))[1]
        False
    """
    frame = require_frame("lm.sow")
    records = frame.records
    if records is None or not records.wants(collection):
        return False
    key = _record_key(frame.plan, name, "lm.sow")
    previous = records.read(collection, key)
    previous = init_fn() if previous is _MISSING else previous
    records.write(collection, key, reduce_fn(previous, value))
    return True


def perturb(name: str, x: Any, *, collection: str = "perturbations") -> Any:
    """Returns `x` plus a perturbation of its shape, when the caller asked for `collection`.

    The gradient of a loss with respect to the perturbation is its gradient with respect to
    the intermediate `x`. Pass ``{"perturbations": {}}`` among the variables to create zeros
    (returned in the new variables); pass them back and differentiate with respect to that
    collection. Without the collection, `x` is returned as it is. (`probe` does it all.)
    The perturbation belongs to the module whose method is running, by `sow`'s rule (the
    innermost; a closure called inside a child's method perturbs under the child).

    Args:
        name: The perturbation's name under the calling module's path.
        x: The intermediate value (an array).
        collection: The collection holding the perturbations.

    Returns:
        ``x + perturbation``, or `x`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Model(lm.Module):
        ...     def __init__(self):
        ...         self.dense = lm.Dense(3, 2)
        ...     def __call__(self, x):
        ...         return jnp.sum(lm.perturb("h", self.dense(x)) ** 2)
        >>> init, apply = lm.transform(Model())
        >>> variables = init(jax.random.key(0))
        >>> x = jnp.ones((1, 3))
        >>> _, new = apply({**variables, "perturbations": {}}, None, x)
        >>> zeros = new["perturbations"]
        >>> def loss(p):
        ...     return apply({**variables, "perturbations": p}, None, x)[0]
        >>> dh = jax.grad(loss)(zeros)["h"]  # the model's own path is the root
        >>> dense = variables["params"]["dense"]
        >>> h = x @ dense["kernel"] + dense["bias"][None]
        >>> bool(jnp.allclose(dh, 2 * h))
        True
    """
    frame = require_frame("lm.perturb")
    records = frame.records
    if records is None or not records.wants(collection):
        return x
    key = _record_key(frame.plan, name, "lm.perturb")
    x = jnp.asarray(x)
    noise = records.read(collection, key)
    if noise is _MISSING:
        noise = jnp.zeros_like(x)
    elif jnp.shape(noise) != x.shape:
        raise VariablesError(
            f"the perturbation {format_path(key, collection)} has shape {jnp.shape(noise)}, "
            f"but the value it perturbs has shape {x.shape}. Create the perturbations with "
            f"the same inputs' shapes (apply with {{{collection!r}: {{}}}})."
        )
    records.write(collection, key, noise)
    return x + jnp.asarray(noise, x.dtype)


# --- capturing every module's output ------------------------------------------------------


class _Capture(threading.local):
    request: tuple[str, Callable[[tuple, Module], bool]] | None = None


CAPTURE = _Capture()


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
    records.write(collection, key, (*(() if previous is _MISSING else previous), arg))


# --- all of it in one call ------------------------------------------------------------------


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
    return {format_path(key): value for key, value in _flatten(tree, "").items()}
