"""A submodule on its own: its slice of a model's variables, taken out and put back.

`transform(model, to_callable=lambda m: m.decoder)` runs a submodule's method with the *whole*
model's variables. The other half is to transform the submodule alone
(``lm.transform(model.decoder)``) and feed it its slice of the full dict: `take_variables`
takes the slice out (re-rooted at the submodule, tied variables and `Stack` blocks included)
and `put_variables` puts a new slice back. Both match the submodule's variables to the
model's by object, through the two plans, so a variable tied into the submodule from outside
is found under its first path in the model.

The arrays keep the layout the model stores them in: a module inside a `Stack` comes with the
stack's leading axis (every copy at once). ``lm.transform(stack.block)`` plans one copy, so
run copy ``i`` on ``jax.tree.map(lambda a: a[i], sliced)``, or all of them in the model's
own call (``lm.vmap``/``lm.scan`` over the block).
"""

from __future__ import annotations

from .._core.checks import format_list, format_path
from .._core.errors import VariablesError
from .._core.graph import FlatKey, Plan
from .._core.layout import check_variables, flatten_variables, nest
from .._core.module import Module
from .._core.types import Variables


def _pairs(
    model: Module, submodule: Module, what: str
) -> tuple[Plan, list[tuple[FlatKey, FlatKey]], str | None]:
    """The submodule's plan in the model's layout, its keys paired with the model's keys.

    Also the advice for a shape mismatch in `put_variables` (None: the default advice).
    """
    plan = Plan(model)
    if id(submodule) not in plan.module_paths():
        raise ValueError(
            f"{what}: the {type(submodule).__name__} given is not a submodule of "
            f"{type(model).__name__} (pass an object reached from the model, such as "
            f"model.decoder, not a copy)."
        )
    # The submodule's entries in the model's stored layout: a Stack's block keeps its axes.
    outer = plan.stacked_axes(submodule)
    sub = Plan(submodule, outer)
    key_of = {id(entry.state): entry.key for entry in plan.variables}
    pairs = [(entry.key, key_of[id(entry.state)]) for entry in sub.variables]
    hint = None
    if outer:
        sizes = tuple(axis.size for axis in outer)
        hint = (
            f"The {type(submodule).__name__} lies inside the Stack at "
            f"{format_path(outer[-1].path)}, so {type(model).__name__} stores its variables "
            f"with the leading axes {sizes} (every copy at once): give arrays in that layout, "
            f"as take_variables returns them (jnp.stack the copies)."
        )
    return sub, pairs, hint


def take_variables(model: Module, variables: Variables, submodule: Module) -> Variables:
    """The variables of `submodule`, taken from the variables of `model` and re-rooted.

    The result is what ``lm.transform(submodule).init`` would return, with the model's arrays:
    feed it to ``lm.transform(submodule).apply`` to run the submodule on its own. The arrays
    keep the model's stored layout: for a module inside a `Stack` (``stack.block``) each has
    the stack's leading axis, one entry per copy, while ``lm.transform(stack.block)`` runs one
    copy; take copy ``i`` with ``jax.tree.map(lambda a: a[i], sliced)``.

    Args:
        model: The model the variables belong to.
        variables: The model's variables (a subset, such as ``{"params": ...}``, is fine as
            long as it holds the submodule's).
        submodule: A module reached from `model` (``model.decoder``, ``stack.block``).

    Returns:
        ``{collection: nested dict}`` with the submodule's paths, in the model's layout.

    Raises:
        ValueError: `submodule` is not part of `model`.
        VariablesError: `variables` lacks some of the submodule's variables.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class AutoEncoder(lm.Module):
        ...     def __init__(self):
        ...         self.encoder = lm.Dense(4, 2)
        ...         self.decoder = lm.Dense(2, 4)
        ...     def __call__(self, x):
        ...         return self.decoder(self.encoder(x))
        >>> model = AutoEncoder()
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> decoder_variables = lm.take_variables(model, variables, model.decoder)
        >>> _, decode = lm.transform(model.decoder)
        >>> decode(decoder_variables, None, jnp.ones(2))[0].shape
        (4,)
    """
    _, pairs, _ = _pairs(model, submodule, "take_variables")
    flat = flatten_variables(variables, "take_variables")
    missing = ["/".join(key) for _, key in pairs if key not in flat]
    if missing:
        raise VariablesError(
            f"take_variables: the variables lack {len(missing)} of the "
            f"{type(submodule).__name__}'s: {format_list(missing)}."
        )
    return nest((sub_key, flat[key]) for sub_key, key in pairs)


def put_variables(
    model: Module, variables: Variables, submodule: Module, sub_variables: Variables
) -> Variables:
    """The variables of `model` with `submodule`'s slice replaced by `sub_variables`.

    Args:
        model: The model the variables belong to.
        variables: The model's variables (not changed: a new dict is returned).
        submodule: A module reached from `model`.
        sub_variables: Variables of `submodule` alone, in the model's layout (as
            `take_variables` gives them: with a `Stack`'s leading axis for a module inside
            it); a subset is fine.

    Returns:
        A new variables dict for `model`.

    Raises:
        VariablesError: `sub_variables` holds paths the submodule lacks or wrong shapes.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> head = model.layers[1]
        >>> zeros = jax.tree.map(jnp.zeros_like, lm.take_variables(model, variables, head))
        >>> new = lm.put_variables(model, variables, head, zeros)
        >>> float(new["params"]["layers_1"]["kernel"].sum())
        0.0
    """
    sub, pairs, hint = _pairs(model, submodule, "put_variables")
    flat = flatten_variables(variables, "put_variables")
    given = flatten_variables(sub_variables, "put_variables (sub_variables)")
    check_variables(sub, given, "put_variables", allow_missing=True, hint=hint)
    for sub_key, key in pairs:
        if sub_key in given:
            flat[key] = given[sub_key]
    return nest(flat.items())
