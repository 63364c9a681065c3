"""`transform`: a model object becomes a pair of pure functions, `init` and `apply`.

`transform` copies the model and plans the copy once (`graph.Plan`). `init` and `apply` are
two phases of the same machinery: each opens a `Frame` over the plan, `init` with values made
by the initializers, `apply` with the caller's variables, and returns what the frame holds.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .casting import install_boundaries
from .checks import check_cast, check_number, flags, format_list, format_path, is_number
from .copying import freeze
from .errors import RngError, VariablesError
from .frame import Frame, PendingValues
from .graph import Plan, VariableEntry, deep_recursion
from .layout import bind_variables, check_variables, flatten_variables
from .module import Module
from .recording import CAPTURE, Records, finish, split_requests
from .rng import RngStreams, check_rngs
from .types import Dtype, Shape, Variables
from .variables import Assigned


class Transformed(NamedTuple):
    """The pure functions of a transformed model.

    Attributes:
        init: ``init(rngs) -> variables``.
        apply: ``apply(variables, rngs, *args, **kwargs) -> (outputs, new_variables)``.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> transformed = lm.transform(lm.Dense(2, 3))
        >>> variables = transformed.init(jax.random.key(0))
        >>> transformed.apply(variables, None, jnp.ones((1, 2)))[0].shape
        (1, 3)
    """

    init: Callable[..., Variables]
    apply: Callable[..., tuple[Any, Variables]]


def transform(
    model: Module, to_callable: Callable[[Module], Callable[..., Any]] | None = None
) -> Transformed:
    """Turns a model into its pure functions `init` and `apply`.

    The model is copied first: editing `model` afterwards changes neither function.

    A model nested more than a hundred modules deep gets `init` and `apply` that raise
    Python's recursion limit while they run, and `transform` raises the process's limit
    (never lowers it) to twice the depth plus 1000, so that JAX's own flattening of the
    variables (``jax.jit(apply)``, ``jax.tree.map``) reaches the bottom: a thousand nested
    modules work.

    Args:
        model: The model definition.
        to_callable: Picks the method `apply` runs, given the (copied) model; default
            ``model.__call__``. For example ``lambda m: m.encode``.

    Returns:
        ``Transformed(init, apply)``, where

        - ``init(rngs) -> variables`` makes the initial variables,
          ``{collection: nested dict mirroring the module tree}``. Each variable's key is
          derived from `rngs` and its path, so replacing one layer leaves the initial values
          of the others unchanged. `rngs` is a key, or a dict/`PRNGKeys` whose ``"params"``
          stream (else default) is used for initializers.
        - ``apply(variables, rngs, *args, **kwargs) -> (outputs, new_variables)`` runs the
          model; `new_variables` has the same structure, with mutable states updated.
          `rngs` is None, a key, a dict ``{name: key}`` or `PRNGKeys`.

        Both are pure, and compose with `jax.jit`, `jax.grad`, `jax.vmap` and friends.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dense(3, 2))
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (2,), 'kernel': (3, 2)}}
        >>> y, new_variables = apply(variables, None, jnp.ones((1, 3)))
        >>> y.shape
        (1, 2)
    """
    if not isinstance(model, Module):
        raise TypeError(
            f"lm.transform expects an lm.Module, got {type(model).__name__}. Define models by "
            f"subclassing lm.Module."
        )
    snapshot = _copy(model, "lm.transform")
    plan = Plan(snapshot)
    plan.bind()
    for path, module in plan.modules:
        freeze(module, format_path(path))
    install_boundaries(plan.modules)  # the casts lm.with_policy decided (none: nothing changes)
    fn = _resolve_callable(snapshot, to_callable)
    init, apply = _make_init(plan), _make_apply(plan, fn)
    depth = _depth(plan)
    if depth > DEEP:
        init, apply = _deep(init), _deep(apply)
        # JAX flattens the variables dict recursively (C++, under Python's limit) before
        # lamina runs, in `jax.jit(apply)` or `jax.tree.map`: the limit must fit its depth.
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 2 * depth + 1000))
    return Transformed(init, apply)


# Module nesting beyond which init and apply raise Python's recursion limit while they run: a
# call descends a few frames per module, and JAX flattens the variables dict recursively.
DEEP = 100


def _depth(plan: Plan) -> int:
    return max((len(path) for path, _ in plan.modules), default=0)


def _deep(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` run with Python's recursion limit raised (`graph.deep_recursion`).

    Only models nested more than `DEEP` modules deep pay for it; ordinary ones get the
    function itself.
    """

    @functools.wraps(function)
    def deep(*args: Any, **kwargs: Any) -> Any:
        with deep_recursion():
            return function(*args, **kwargs)

    return deep


def _make_init(plan: Plan) -> Callable[..., Variables]:
    groups = _init_groups(plan)

    def init(rngs: Any = None, /) -> Variables:
        check_rngs("init", rngs)
        streams = RngStreams(rngs)
        values: list[Any] = [None] * len(plan.variables)
        if plan.variables:
            try:
                _, base = streams.base("params")
            except RngError:
                raise RngError(
                    f"init needs a PRNG key to initialise the variables of "
                    f"{type(plan.root).__name__}: init(jax.random.key(0))."
                ) from None
            with Frame(plan, PendingValues(), streams, "init"):
                for group in groups:
                    group.run(plan, base, values)
        return plan.treedef.unflatten(values)

    init.__doc__ = f"Initial variables of {type(plan.root).__name__}: init(rngs) -> variables."
    return init


class _InitGroup:
    """Variables made by one initializer call: the same batchable initializer, shape and dtype.

    A model of a thousand identical layers initialises its kernels with one vectorised call
    (`jax.vmap` over their keys) instead of a thousand: eagerly that is a thousand dispatches
    fewer, and under `jax.jit` a program a thousand times smaller to compile. Each variable's
    key is still ``fold_in(base, hash(path))``, so the values do not depend on the grouping.
    """

    def __init__(self, slots: list[int], salts: list[int]):
        self.slots = slots
        self.salts = salts

    def run(self, plan: Plan, base: Any, values: list[Any]) -> None:
        entries = [plan.variables[slot] for slot in self.slots]
        if len(entries) == 1:
            values[self.slots[0]] = _initial_value(
                entries[0], jax.random.fold_in(base, self.salts[0])
            )
            return
        salts = np.asarray(self.salts, dtype=np.uint32)
        state = entries[0].state
        try:
            stacked = _init_stacked(state.init, state.shape, state.param_dtype, base, salts)
        except Exception as error:
            error.add_note(
                f"(while lamina initialised {entries[0].name} and {len(entries) - 1} "
                f"more with {state.init!r})"
            )
            raise
        _check_initial(entries[0], stacked.shape[1:])
        stacked = _as_stored(entries[0], stacked)
        for slot, value in zip(self.slots, _unstack(stacked), strict=True):
            values[slot] = value


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _init_stacked(init: Any, shape: Shape, dtype: Dtype, base: Any, salts: Any) -> Any:
    """``init`` for each salt's key, stacked: one compiled program per group signature."""
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, salts)
    return jax.vmap(lambda key: init(key, shape, dtype))(keys)


def _init_groups(plan: Plan) -> list[_InitGroup]:
    """Groups the plan's variables by initializer signature.

    Only initializers that declare themselves batchable (``lamina_batchable``) *and* define
    value equality are grouped: equality is what proves two of them make the same arrays
    (`lm.initializers` compare by every argument). Anything else is initialised on its own.
    """
    by_signature: dict[Any, _InitGroup] = {}
    groups = []
    for slot, entry in enumerate(plan.variables):
        state, salt = entry.state, plan.init_salt(entry)
        init = state.init
        if (
            getattr(init, "lamina_batchable", False)
            and type(init).__eq__ is not object.__eq__
            and not entry.axes
        ):
            signature = (init, state.shape, state.param_dtype)
            group = by_signature.get(signature)
            if group is not None:
                group.slots.append(slot)
                group.salts.append(salt)
                continue
            group = by_signature[signature] = _InitGroup([slot], [salt])
        else:
            group = _InitGroup([slot], [salt])
        groups.append(group)
    return groups


def _unstack(stacked: Any) -> list[Any]:
    if isinstance(stacked, jax.core.Tracer):
        return [stacked[i] for i in range(stacked.shape[0])]  # static slices in the program
    # Eagerly, one small compiled gather per variable; a split into n outputs would compile
    # for minutes when n is in the thousands.
    return [_take(stacked, i) for i in range(stacked.shape[0])]


_take = jax.jit(lambda stacked, i: stacked[i])


def _make_apply(plan: Plan, fn: Callable[..., Any] | None) -> Callable[..., Any]:
    treedef = plan.treedef
    declared = frozenset(entry.collection for entry in plan.variables)

    def apply(variables: Variables, rngs: Any = None, /, *args: Any, **kwargs: Any) -> Any:
        variables, requests = split_requests(variables, declared)
        values = bind_variables(plan, variables, "apply")
        if rngs is not None:
            check_rngs("apply", rngs)
        if fn is None:
            raise TypeError(
                f"{type(plan.root).__name__} has no __call__ method, so apply does not know "
                f"what to run: pass lm.transform(model, to_callable=lambda m: m.method)."
            )
        records = None if requests is None else Records(requests, CAPTURE.request)
        with Frame(plan, values, RngStreams(rngs), "apply", records=records):
            outputs = fn(*args, **kwargs)
            if not isinstance(outputs, jax.Array):
                outputs = _materialize(outputs)
        new_variables = treedef.unflatten(values)
        if records is not None:
            new_variables.update(finish(records, declared))
        return outputs, new_variables

    apply.__doc__ = (
        f"Runs {type(plan.root).__name__}: apply(variables, rngs, *args, **kwargs) -> "
        f"(outputs, new_variables)."
    )
    return apply


def _materialize(outputs: Any) -> Any:
    """Outputs with every declaration replaced by its value, while the frame is still open."""
    leaves, structure = jax.tree_util.tree_flatten(outputs)
    return jax.tree_util.tree_unflatten(structure, leaves)


def _initial_value(entry: VariableEntry, key: Any) -> Any:
    """The initial value of `entry`; with stored `axes`, one independent draw per copy.

    A value assigned in the stored layout (`lm.assign_variables`) already holds every copy;
    one of the declared shape (``.value =`` on the declaration) is every copy's.
    """
    state = entry.state
    if isinstance(state.init, Assigned):
        return _assigned_value(entry)
    try:
        if entry.axes:
            copies = int(np.prod(entry.axes))
            keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(copies))
            value = jax.vmap(lambda k: state.init(k, state.shape, state.param_dtype))(keys)
            value = value.reshape(entry.shape)
        else:
            value = state.init(key, state.shape, state.param_dtype)
    except Exception as error:
        error.add_note(f"(while lamina initialised {entry.name} with {state.init!r})")
        raise
    _check_initial(entry, tuple(np.shape(value))[len(entry.axes) :])
    return _as_stored(entry, value)


def _as_stored(entry: VariableEntry, value: Any) -> Any:
    """An initializer's `value` in the storage dtype, by the rule of a write (`check_cast`).

    An initializer gets the dtype to return (lamina's honour it); one that returns another
    may widen, or narrow within its kind, as `assign_variables` may: producing initial values
    is surgery on values (``jax.random.normal(k, s) * 0.02`` for a bfloat16 kernel, int32
    ``jax.random.randint`` for an int8 one). Concrete values must fit (an int32 300 for an
    int8 variable would wrap: `ValueError`); traced ones (`jax.jit` of init, a Stack's copies
    made under `jax.vmap`) are cast. A change of kind (1+2j for a float32 variable, 0.5 for
    an int one, numbers for a bool one) is a `TypeError`.
    """
    state = entry.state
    target = state.param_dtype

    def what() -> str:
        return (
            f"the initializer {_name_of(state.init)} of {entry.name} returned "
            f"{_kind_of(value)}, but "
            f"the variable is stored as {target} (an initializer is called as init(key, "
            f"shape, dtype) and should return an array of that dtype)"
        )

    if is_number(value):
        check_number(value, target, what)
        return jnp.asarray(value, dtype=target)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        value = jnp.asarray(value)
    if value.dtype == target:
        return value
    check_cast(value, target, what, state.dtype, by_value=True)
    return value.astype(target)


def _name_of(init: Any) -> str:
    name = getattr(init, "__qualname__", None)  # functions; initializer objects print themselves
    return name if name is not None else repr(init)


def _kind_of(value: Any) -> str:
    if is_number(value):
        return f"the Python number {value!r}"
    weak = "weak-typed " if getattr(value, "weak_type", False) else ""
    return f"a {weak}{value.dtype} value"


def _assigned_value(entry: VariableEntry) -> Any:
    """An assigned initial value, in the stored shape (one declared-shape value: every copy's)."""
    state = entry.state
    value = state.init(None, state.shape, state.param_dtype)
    got = tuple(value.shape)
    if got == entry.shape:
        return value
    if got == state.shape:
        return jnp.broadcast_to(value, entry.shape)  # every copy of a Stack starts from it
    stacked = f" (leading axes {entry.axes}: the Stacks it lies in)" if entry.axes else ""
    raise ValueError(
        f"{entry.name} holds an assigned value of shape {got}, but it is declared with shape "
        f"{state.shape} and stored here with shape {entry.shape}{stacked}. A value assigned "
        f"for a model holding a Stack has the Stack's axes, which a block planned alone lacks: "
        f"assign one copy's value (shape {state.shape}), or the stored shape with "
        f"lm.assign_variables on this model."
    )


def _check_initial(entry: VariableEntry, shape: tuple[int, ...]) -> None:
    if tuple(shape) != entry.state.shape:
        raise ValueError(
            f"the initializer of {entry.name} ({entry.state.init!r}) returned shape "
            f"{tuple(shape)}, but the variable is declared with shape {entry.state.shape}."
        )


def _resolve_callable(
    snapshot: Module, to_callable: Callable[[Module], Callable[..., Any]] | None
) -> Callable[..., Any] | None:
    if to_callable is None:
        return snapshot.__call__ if callable(snapshot) else None
    if not callable(to_callable):
        raise TypeError(
            f"lm.transform: to_callable must be a function of the model that returns the "
            f"method to run (e.g. to_callable=lambda m: m.forward), got "
            f"{type(to_callable).__name__} {to_callable!r}."
        )
    fn = to_callable(snapshot)
    if not callable(fn):
        raise TypeError(
            f"to_callable must return the function apply runs (e.g. lambda m: m.forward), "
            f"got {type(fn).__name__}."
        )
    return fn


def _copy(model: Module, where: str) -> Module:
    try:
        with deep_recursion():
            return copy.deepcopy(model)
    except RecursionError:
        raise
    except Exception as error:
        error.add_note(
            f"({where} copies the model so that later edits do not leak into it; an attribute "
            f"of the model could not be copied.)"
        )
        raise


class AssignReport(NamedTuple):
    """What `assign_variables` did, as PyTorch's ``load_state_dict`` reports it.

    Attributes:
        assigned: The paths that received an array (``params/layer1/kernel``).
        missing: The model's paths that `variables` lacked (they keep their initializers).
        unexpected: The paths of `variables` that the model lacks (ignored).

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> model = lm.Dense(2, 3)
        >>> _, report = lm.assign_variables(
        ...     model, {"params": {"kernel": jnp.ones((2, 3))}}, strict=False, return_report=True
        ... )
        >>> report.assigned, report.missing
        (('params/kernel',), ('params/bias',))
    """

    assigned: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def assign_variables(
    model: Module,
    variables: Variables,
    strict: bool = True,
    *,
    allow_unexpected: bool = False,
    return_report: bool = False,
) -> Any:
    """Returns a copy of `model` whose initial values are the given arrays.

    The original model is untouched. Use it for transfer learning: load pretrained
    variables, then replace the layers that change.

    Args:
        model: The model to copy.
        variables: ``{collection: nested dict}``, as `init` returns.
        strict: If True, `variables` must hold every variable of the model; if False, the
            ones present are assigned and the rest keep their initializers.
        allow_unexpected: Whether `variables` may hold paths the model lacks (they are
            ignored). Off by default even when not `strict`: a misspelt path would otherwise
            load nothing and say nothing.
        return_report: Also return an `AssignReport` of the assigned, missing and
            unexpected paths.

    Returns:
        The copy, with each assigned variable's initializer replaced by its array; with
        `return_report`, ``(copy, report)``.

    Raises:
        VariablesError: Missing paths (when `strict`), unexpected paths (unless
            `allow_unexpected`), a wrong shape, or nothing to assign at all. The original model
            is unchanged.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> pretrained = {"params": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
        >>> model = lm.assign_variables(lm.Dense(3, 2), pretrained)
        >>> init, apply = lm.transform(model)
        >>> float(init(jax.random.key(0))["params"]["kernel"].sum())
        6.0
        >>> _, report = lm.assign_variables(
        ...     lm.Dense(3, 2), {"params": {"kernel": jnp.ones((3, 2))}}, strict=False,
        ...     return_report=True)
        >>> report.missing
        ('params/bias',)
    """
    flags(
        "lm.assign_variables",
        strict=strict,
        allow_unexpected=allow_unexpected,
        return_report=return_report,
    )
    flat = flatten_variables(variables, "assign_variables")
    result = _copy(model, "lm.assign_variables")
    plan = Plan(result)
    check_variables(
        plan, flat, "assign_variables", allow_missing=not strict, allow_unexpected=allow_unexpected
    )
    assigned = [entry for entry in plan.variables if entry.key in flat]
    if plan.variables and not assigned:
        raise VariablesError(
            f"assign_variables found none of {type(model).__name__}'s variables in the given "
            f"dict (its paths look like {plan.variables[0].name}; the dict has "
            f"{format_list(sorted('/'.join(k) for k in flat)) or 'nothing'}), so it would "
            f"assign nothing."
        )
    for entry in assigned:
        entry.state._assign_initial(flat[entry.key], entry.name, entry.shape)
    if not return_report:
        return result
    return result, AssignReport(
        assigned=tuple(entry.name for entry in assigned),
        missing=tuple(entry.name for entry in plan.variables if entry.key not in flat),
        unexpected=tuple("/".join(key) for key in flat if key not in plan.index),
    )


def init(module: Module) -> Callable[..., Variables]:
    """Metoryx's spelling of ``lm.transform(module).init``: the model's init function.

    Args:
        module: The model definition (copied).

    Returns:
        ``init(rngs) -> variables``.

    Example:
        >>> import jax, lamina as lm
        >>> variables = lm.init(lm.Dense(3, 2))(jax.random.key(0))
        >>> sorted(variables["params"])
        ['bias', 'kernel']
    """
    return transform(module).init


def apply(
    module: Module,
    fn: Callable[[Module], Callable[..., Any]] | None = None,
    *,
    to_callable: Callable[[Module], Callable[..., Any]] | None = None,
) -> Callable[..., tuple[Any, Variables]]:
    """Metoryx's spelling of ``lm.transform(module, to_callable).apply``: the apply function.

    Metoryx has named the method picker both ``fn`` (positional or keyword) and
    ``to_callable`` (keyword); both are accepted.

    Args:
        module: The model definition (copied).
        fn: Picks the method to run, as `transform`'s ``to_callable``.
        to_callable: The same, by `transform`'s name.

    Returns:
        ``apply(variables, rngs, *args, **kwargs) -> (outputs, new_variables)``.

    Raises:
        TypeError: Both `fn` and `to_callable` are given, or the one given is not callable.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> dense = lm.Dense(3, 2)
        >>> variables = lm.init(dense)(jax.random.key(0))
        >>> lm.apply(dense)(variables, None, jnp.ones((1, 3)))[0].shape
        (1, 2)
    """
    if fn is not None and to_callable is not None:
        raise TypeError(
            "lm.apply: got both fn and to_callable, which name the same thing (the method "
            "apply runs); pass one: lm.apply(module, to_callable=lambda m: m.method)."
        )
    name, picker = ("to_callable", to_callable) if fn is None else ("fn", fn)
    if picker is not None and not callable(picker):
        raise TypeError(
            f"lm.apply: {name} must be a function of the model that returns the method to "
            f"run (e.g. {name}=lambda m: m.forward), got {type(picker).__name__} {picker!r}."
        )
    return transform(module, picker).apply
