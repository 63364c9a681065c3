"""Gradients over part of a variables argument: `DiffState`, `grad`, `value_and_grad`.

``lm.grad(loss, model, DiffState(0, LoRAParam))(variables, x)`` differentiates `loss` with
respect to the `LoRAParam`s in `variables` only; everything else in it is a constant. It is
`split` + `jax.grad` + `merge`, written once:

    trainable, frozen = lm.split(model, variables, LoRAParam, ...)
    grads = jax.grad(lambda t: loss(lm.merge(t, frozen), x))(trainable)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.checks import format_list
from .._core.graph import Plan, VariableEntry
from .._core.layout import nest, present_variables
from .._core.module import Module
from .._core.types import Variables
from .._core.variables import Parameter
from .filters import Filter, Predicate, describe, to_predicate
from .partition import matches, merge, nothing_selected


@dataclasses.dataclass(frozen=True)
class DiffState:
    """Differentiate the variables that `filter` matches in positional argument `argnum`.

    The argument is a variables tree of the model given to `grad`/`value_and_grad` (all of
    its variables or a subset); its gradient comes back as a tree holding only the matched
    paths, in the same layout. A filter that selects none of the model's variables, or none
    of those passed, is an error (see `lm.split` for the filters).

    Attributes:
        argnum: Which positional argument holds the variables (negative counts from the end,
            as in `jax.grad`).
        filter: Which of them to differentiate (default: every `Parameter`).

    Example:
        >>> import lamina as lm
        >>> lm.DiffState(0, "params")
        DiffState(argnum=0, filter='params')
    """

    argnum: int
    filter: Filter = Parameter

    def __post_init__(self) -> None:
        if not isinstance(self.argnum, int) or isinstance(self.argnum, bool):
            raise TypeError(
                f"DiffState's argnum is the position of the variables argument (an int), got "
                f"{self.argnum!r}: lm.DiffState(0, filter)."
            )
        try:
            to_predicate(self.filter)
        except TypeError as error:
            raise TypeError(f"DiffState({self.argnum}, ...): {error}") from None


def value_and_grad(
    fn: Callable[..., Any],
    model: Module,
    argnums: int | DiffState | Sequence[int | DiffState] = DiffState(0),
    has_aux: bool = False,
) -> Callable[..., Any]:
    """`jax.value_and_grad`, where arguments may be parts of variables trees.

    Args:
        fn: The function to differentiate; returns a scalar (and aux, if `has_aux`).
        model: The model whose variables the `DiffState` arguments hold; its declarations are
            what the filters see (read once, here).
        argnums: As in `jax.grad`: an int differentiates that whole argument; a `DiffState`
            differentiates the variables its filter matches in that argument. The default,
            ``DiffState(0)``, takes the `Parameter`s of the first argument. The arguments
            they name must be passed positionally.
        has_aux: `fn` returns ``(value, aux)``.

    Returns:
        A function of `fn`'s arguments returning ``(value, grads)`` (``((value, aux),
        grads)`` with `has_aux`); `grads` is one tree, or a tuple when `argnums` is a sequence.

    Raises:
        TypeError: An argnum that is neither an int nor a `DiffState`; when called: an
            argument named by `argnums` that was not passed positionally, or integer
            variables selected for differentiation (the message names their paths).
        ValueError: The same argument listed twice, or a `DiffState` whose filter selects
            none of the model's variables (here) or none of those passed (when called).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Net(lm.Module):
        ...     def __init__(self):
        ...         self.dense, self.norm = lm.Dense(2, 3), lm.BatchNorm(3)
        ...     def __call__(self, x):
        ...         return self.norm(self.dense(x), is_training=True)
        >>> model = Net()
        >>> init, apply = lm.transform(model)
        >>> variables = init(jax.random.key(0))
        >>> def loss(variables, x):
        ...     y, new_variables = apply(variables, None, x)
        ...     return jnp.sum(y**2), new_variables
        >>> step = lm.value_and_grad(loss, model, has_aux=True)
        >>> (value, new_variables), grads = step(variables, jnp.ones((4, 2)))
        >>> sorted(grads), sorted(grads["params"]), sorted(new_variables)
        (['params'], ['dense', 'norm'], ['batch_stats', 'params'])
        >>> lm.value_and_grad(loss, model, lm.DiffState(0, "param"))
        Traceback (most recent call last):
        ...
        ValueError: lm.value_and_grad: the filter 'param' selects no variable of Net.
          Net holds collections batch_stats (2), params (4); ...
          Did you mean 'params'?
    """
    return _value_and_grad(fn, model, argnums, has_aux, "lm.value_and_grad")


def _value_and_grad(
    fn: Callable[..., Any],
    model: Module,
    argnums: int | DiffState | Sequence[int | DiffState],
    has_aux: bool,
    what: str,
) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{what} differentiates a function; got {type(fn).__name__} {fn!r}.")
    specs = _argnum_specs(argnums, what)
    argnum_of = [s.argnum if isinstance(s, DiffState) else s for s in specs]
    plan = Plan(model)
    selections = _resolve_filters(plan, specs, what)
    many = isinstance(argnums, (tuple, list))

    def differentiated(*args: Any, **kwargs: Any) -> Any:
        positions = [_position(argnum, args, kwargs, specs, what) for argnum in argnum_of]
        if len(set(positions)) != len(positions):
            raise ValueError(
                f"{what}: argnums {argnums!r} name the same one of the {len(args)} positional "
                f"arguments twice."
            )
        chosen, frozen = [], {}
        for argnum, position in zip(argnum_of, positions, strict=True):
            if argnum not in selections:
                chosen.append(args[position])
                continue
            part, frozen[position] = _split_argument(plan, args, position, selections[argnum], what)
            chosen.append(part)

        def inner(*parts: Any) -> Any:
            full = list(args)
            for position, part in zip(positions, parts, strict=True):
                full[position] = merge(part, frozen[position]) if position in frozen else part
            return fn(*full, **kwargs)

        value, grads = jax.value_and_grad(inner, tuple(range(len(positions))), has_aux)(*chosen)
        return value, (grads if many else grads[0])

    return differentiated


def _argnum_specs(
    argnums: int | DiffState | Sequence[int | DiffState], what: str
) -> tuple[int | DiffState, ...]:
    """`argnums` as a tuple, checked: ints and `DiffState`s, at least one, no argument twice."""
    given: tuple[Any, ...] = tuple(argnums) if isinstance(argnums, (tuple, list)) else (argnums,)
    for spec in given:
        if not isinstance(spec, (int, DiffState)) or isinstance(spec, bool):
            raise TypeError(
                f"argnums takes ints (a whole argument, as jax.grad) and lm.DiffState(argnum, "
                f"filter) (part of a variables argument); got {spec!r}."
            )
    specs: tuple[int | DiffState, ...] = given
    if not specs:
        raise ValueError(f"{what}: argnums is empty; name at least one argument.")
    argnum_of = [s.argnum if isinstance(s, DiffState) else s for s in specs]
    if len(set(argnum_of)) != len(argnum_of):
        raise ValueError(f"argnums lists argument(s) more than once: {argnums!r}.")
    return specs


def _resolve_filters(
    plan: Plan, specs: tuple[int | DiffState, ...], what: str
) -> dict[int, tuple[DiffState, Predicate]]:
    """Each `DiffState`'s filter resolved against the plan, by argnum.

    A filter that selects none of the model's variables is an error.
    """
    selections: dict[int, tuple[DiffState, Predicate]] = {}
    for spec in specs:
        if isinstance(spec, DiffState):
            predicate = to_predicate(spec.filter, plan)
            if not any(matches(predicate, entry, spec.filter) for entry in plan.variables):
                raise ValueError(nothing_selected(what, [(None, spec.filter, predicate)], plan))
            selections[spec.argnum] = (spec, predicate)
    return selections


def _split_argument(
    plan: Plan,
    args: tuple,
    position: int,
    selection: tuple[DiffState, Predicate],
    what: str,
) -> tuple[Variables, Variables]:
    """The variables argument at `position`, split into the part differentiated and the rest."""
    spec, predicate = selection
    if not isinstance(args[position], Mapping):
        _not_variables(args, position, spec, what)
    present = present_variables(plan, args[position], f"{what} (argument {position})")
    matched: list[tuple[Any, Any]] = []
    rest: list[tuple[Any, Any]] = []
    for entry, leaf in present:
        (matched if matches(predicate, entry, spec.filter) else rest).append((entry, leaf))
    if not matched:
        message = nothing_selected(what, [(None, spec.filter, predicate)], plan, present)
        raise ValueError(message.replace("given", f"given in argument {position}", 1))
    _check_differentiable(matched, spec, what)
    chosen = nest((entry.key, leaf) for entry, leaf in matched)
    return chosen, nest((entry.key, leaf) for entry, leaf in rest)


def _position(
    argnum: int, args: tuple, kwargs: dict, specs: tuple[int | DiffState, ...], what: str
) -> int:
    """`argnum` as an index into `args`; an argument that was not passed is an error."""
    position = argnum + len(args) if argnum < 0 else argnum
    if 0 <= position < len(args):
        return position
    spec = next(s for s in specs if (s.argnum if isinstance(s, DiffState) else s) == argnum)
    shown = (
        f"DiffState({argnum}, {describe(spec.filter)})" if isinstance(spec, DiffState) else argnum
    )
    keywords = f" and keyword arguments {', '.join(kwargs)}" if kwargs else ""
    raise TypeError(
        f"{what}: argnums {shown} names positional argument {argnum}, but the function was "
        f"called with {len(args)} positional argument(s){keywords}. The arguments that "
        f"argnums names (variables included) must be passed positionally: step(variables, x), "
        f"not step(variables=variables, x=x)."
    )


def _not_variables(args: tuple, position: int, spec: DiffState, what: str) -> None:
    got = args[position]
    shape = f" of shape {tuple(got.shape)}" if hasattr(got, "shape") else ""
    dicts = [i for i, arg in enumerate(args) if isinstance(arg, Mapping)]
    hint = (
        f" Argument {dicts[0]} is a dict: lm.DiffState({dicts[0]}, {describe(spec.filter)})?"
        if len(dicts) == 1
        else ""
    )
    raise TypeError(
        f"{what}: DiffState({spec.argnum}, {describe(spec.filter)}) differentiates the variables "
        f"in positional argument {position}, a dict {{collection: {{...}}}} such as init "
        f"returns; got {type(got).__name__}{shape}.{hint}"
    )


def _check_differentiable(
    matched: list[tuple[VariableEntry, Any]], spec: DiffState, what: str
) -> None:
    """Integer (or boolean) variables have no gradient: say which, and how to leave them out."""
    wrong = [(e, jnp.result_type(leaf)) for e, leaf in matched]
    wrong = [(e, dtype) for e, dtype in wrong if not jnp.issubdtype(dtype, jnp.inexact)]
    if not wrong:
        return
    collections = {e.collection for e, _ in wrong}
    kept = {e.collection for e, _ in matched if all(e is not w for w, _ in wrong)}
    if collections & kept:
        excluded = [f"lm.PathContains({'/'.join(map(str, e.path))!r})" for e, _ in wrong]
        exclude = excluded[0] if len(excluded) == 1 else f"({', '.join(excluded)})"
    else:
        names = [repr(c) for c in sorted(collections)]
        exclude = names[0] if len(names) == 1 else f"({', '.join(names)})"
    raise TypeError(
        f"{what}: DiffState({spec.argnum}, {describe(spec.filter)}) selects variables that are "
        f"not floating-point, which have no gradient: "
        + format_list(f"{e.name} ({dtype})" for e, dtype in wrong)
        + f". Leave them out of the filter: lm.DiffState({spec.argnum}, "
        f"lm.All({describe(spec.filter)}, lm.Not({exclude})))."
    )


def grad(
    fn: Callable[..., Any],
    model: Module,
    argnums: int | DiffState | Sequence[int | DiffState] = DiffState(0),
    has_aux: bool = False,
) -> Callable[..., Any]:
    """`jax.grad`, where arguments may be parts of variables trees (see `value_and_grad`).

    Returns:
        A function returning the gradients (and aux, if `has_aux`: ``(grads, aux)``).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Frozen(lm.Parameter):  # a parameter kind that fine-tuning leaves alone
        ...     pass
        >>> class Net(lm.Module):
        ...     def __init__(self):
        ...         self.body = lm.Dense(2, 3)
        ...         self.body.kernel = Frozen((2, 3), lm.initializers.lecun_normal())
        ...         self.head = lm.Dense(3, 1)
        ...     def __call__(self, x):
        ...         return self.head(self.body(x))
        >>> init, apply = lm.transform(Net())
        >>> loss = lambda v, x: jnp.sum(apply(v, None, x)[0])
        >>> trainable = lm.All(lm.Parameter, lm.Not(Frozen))
        >>> grads = lm.grad(loss, Net(), lm.DiffState(0, trainable))(init(jax.random.key(0)),
        ...                                                         jnp.ones((1, 2)))
        >>> sorted(grads["params"]["body"]), sorted(grads["params"]["head"])
        (['bias'], ['bias', 'kernel'])
    """
    value_and_grads = _value_and_grad(fn, model, argnums, has_aux, "lm.grad")

    def differentiated(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grads(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return differentiated
