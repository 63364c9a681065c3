"""Gradients over part of a variables argument: `DiffState`, `grad`, `value_and_grad`.

``lm.grad(loss, model, DiffState(0, LoRAParam))(variables, x)`` differentiates `loss` with
respect to the `LoRAParam`s in `variables` only; everything else in it is a constant. It is
`split` + `jax.grad` + `merge`, written once:

    trainable, frozen = lm.split(model, variables, LoRAParam, ...)
    grads = jax.grad(lambda t: loss(lm.merge(t, frozen), x))(trainable)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .filters import Filter, to_predicate
from .graph import Plan
from .layout import nest, present_variables
from .module import Module
from .selection import merge
from .variables import Parameter


@dataclasses.dataclass(frozen=True)
class DiffState:
    """Differentiate the variables that `filter` matches in positional argument `argnum`.

    The argument is a variables tree of the model given to `grad`/`value_and_grad` (all of
    its variables or a subset); its gradient comes back as a tree holding only the matched
    paths, in the same layout.

    Attributes:
        argnum: Which positional argument holds the variables.
        filter: Which of them to differentiate (default: every `Parameter`).
    """

    argnum: int
    filter: Filter = Parameter


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
            ``DiffState(0)``, takes the `Parameter`s of the first argument.
        has_aux: `fn` returns ``(value, aux)``.

    Returns:
        A function of `fn`'s arguments returning ``(value, grads)`` (``((value, aux),
        grads)`` with `has_aux`); `grads` is one tree, or a tuple when `argnums` is a sequence.

    Raises:
        TypeError: An argnum that is neither an int nor a `DiffState`.
        ValueError: The same argument listed twice.

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
    """
    specs = tuple(argnums) if isinstance(argnums, (tuple, list)) else (argnums,)
    for spec in specs:
        if not isinstance(spec, (int, DiffState)) or isinstance(spec, bool):
            raise TypeError(
                f"argnums takes ints (a whole argument, as jax.grad) and lm.DiffState(argnum, "
                f"filter) (part of a variables argument); got {spec!r}."
            )
    positions = [s.argnum if isinstance(s, DiffState) else s for s in specs]
    if len(set(positions)) != len(positions):
        raise ValueError(f"argnums lists argument(s) more than once: {argnums!r}.")
    plan = Plan(model)
    predicates = {s.argnum: to_predicate(s.filter) for s in specs if isinstance(s, DiffState)}
    many = isinstance(argnums, (tuple, list))

    def differentiated(*args: Any, **kwargs: Any) -> Any:
        chosen, frozen = [], {}
        for position in positions:
            if position not in predicates:
                chosen.append(args[position])
                continue
            matched, rest = [], []
            for entry, leaf in present_variables(plan, args[position], "lm.grad"):
                picked = predicates[position](entry.path, entry.state)
                (matched if picked else rest).append((entry.key, leaf))
            chosen.append(nest(matched))
            frozen[position] = nest(rest)

        def inner(*parts: Any) -> Any:
            full = list(args)
            for position, part in zip(positions, parts, strict=True):
                full[position] = merge(part, frozen[position]) if position in frozen else part
            return fn(*full, **kwargs)

        value, grads = jax.value_and_grad(inner, tuple(range(len(positions))), has_aux)(*chosen)
        return value, (grads if many else grads[0])

    return differentiated


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
    value_and_grads = value_and_grad(fn, model, argnums, has_aux)

    def differentiated(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grads(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return differentiated
