"""Sharding: the logical axis names of declarations, mapped onto a device mesh by rules.

A declaration names what each of its dimensions means (``Parameter(..., sharding=("embed",
"mlp"))``, ``Dense(..., kernel_sharding=...)``, a `Stack`'s ``depth_sharding`` for the
stacked axis); *rules* say which mesh axis shards each meaning (``{"mlp": "model"}``).
`shardings` reads both through the `Plan`, as `mask` does, and returns one `NamedSharding`
per variable in the variables' layout, ready for ``jax.jit(init, out_shardings=...)``. The
partitioning itself is JAX's (GSPMD): nothing here moves an array.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._core.graph import Plan, VariableEntry
from .._core.layout import nest
from .._core.module import Module
from .._core.types import Variables
from .explicit import MeshAxes

__all__ = ["Rules", "shardings"]

Rules = Mapping[str, MeshAxes] | Sequence[tuple[str, MeshAxes]]


def shardings(model: Module, mesh: jax.sharding.Mesh, rules: Rules) -> Variables:
    """The `NamedSharding` of each of `model`'s variables on `mesh`, in the variables' layout.

    Each dimension of a variable has a logical name (from the declaration's ``sharding``, and
    a `Stack`'s ``depth_sharding`` for the stacked axis in front) or none. `rules` maps a
    logical name to the mesh axis that shards it, a tuple of mesh axes (sharded over their
    product), or None (replicated). A dimension without a name, or whose name has no rule,
    is replicated: as in Flax's ``logical_to_mesh_axes``, the rules need only name what is
    sharded, and one table of rules can serve several models. Unlike Flax, a name has one
    rule (the first pair for it wins) and there is no fallback to a later rule when a mesh
    axis is taken: two dimensions of one variable on the same mesh axis are an error.

    Use it to create the variables already sharded (each device computes only its part,
    nothing is materialised whole on one device):
    ``jax.jit(init, out_shardings=lm.shardings(model, mesh, rules))(key)``; ``jax.jit`` then
    partitions the steps that take them (GSPMD). Meshes with ``Auto`` axes and with JAX
    0.10's default ``Explicit`` axes both work: on explicit axes the layers give JAX the
    result shardings it asks for (`result_sharding`).

    Args:
        model: The model (its declarations are read through its plan, as `mask` does).
        mesh: A `jax.sharding.Mesh` (or `AbstractMesh`) whose axis names the rules use.
        rules: ``{logical name: mesh axis, tuple of mesh axes, or None}``, or a sequence of
            ``(logical name, mesh axes)`` pairs (Flax Linen's ``logical_axis_rules`` form).

    Returns:
        ``{collection: nested dict}`` with a `NamedSharding` wherever the variables hold an
        array.

    Raises:
        TypeError: `mesh` is not a mesh, `rules` is not a mapping or a sequence of pairs, or
            a rule or a declaration's ``sharding`` holds something other than names.
        ValueError: A variable needs a rule that names a mesh axis `mesh` lacks, puts two of
            its dimensions on one mesh axis, or has a dimension that the product of its mesh
            axes' sizes does not divide; the message names the variable, its shape and the
            rule. Also a logical name without a rule that looks like a misspelt rule.

    Example:
        >>> import jax, lamina as lm
        >>> from jax.sharding import AxisType
        >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        >>> model = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",))
        >>> tree = lm.shardings(model, mesh, {"mlp": "model"})
        >>> tree["params"]["kernel"].spec, tree["params"]["bias"].spec
        (P(None, 'model'), P('model',))
        >>> variables = jax.jit(lm.transform(model).init, out_shardings=tree)(jax.random.key(0))
        >>> variables["params"]["kernel"].sharding == tree["params"]["kernel"]
        True
    """
    _check_mesh(mesh)
    table = _rules(rules)
    plan = Plan(model)
    entries = [(entry, _logical_axes(entry)) for entry in plan.variables]
    _check_misspelt(table, entries)
    return nest(
        (entry.key, NamedSharding(mesh, _spec(entry, names, table, mesh)))
        for entry, names in entries
    )


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            f"shardings: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build "
            f"one with jax.make_mesh((2, 4), ('data', 'model'), axis_types=(jax.sharding."
            f"AxisType.Auto,) * 2), and pass the model first: lm.shardings(model, mesh, rules)."
        )


def _rules(rules: Any) -> dict[str, tuple[str, ...]]:
    """`rules` as ``{logical name: mesh axes}`` (empty: replicated); the first pair wins."""
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, Sequence) and not isinstance(rules, str):
        pairs = list(rules)
    else:
        raise TypeError(
            f"shardings: rules must map logical axis names to mesh axes, e.g. {{'mlp': "
            f"'model', 'batch': 'data'}}, or be a sequence of (name, mesh axes) pairs; got "
            f"{type(rules).__name__} {rules!r:.80}. Pass {{}} to replicate every variable."
        )
    table: dict[str, tuple[str, ...]] = {}
    for position, pair in enumerate(pairs):
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(
                f"shardings: rule {position} is {pair!r}; each rule is a (logical name, mesh "
                f"axes) pair such as ('mlp', 'model')."
            )
        name, axes = pair
        if not isinstance(name, str):
            raise TypeError(
                f"shardings: the rule {pair!r} maps {name!r}; a rule maps a logical axis name "
                f"(a str, as the declarations' sharding names it)."
            )
        table.setdefault(name, _mesh_axes(name, axes))
    return table


def _mesh_axes(name: str, axes: Any) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    if (
        isinstance(axes, Sequence)
        and all(isinstance(a, str) for a in axes)
        and len(set(axes)) == len(axes)
    ):
        return tuple(axes)
    raise TypeError(
        f"shardings: the rule for {name!r} maps it to {axes!r}; a rule's value is a mesh "
        f"axis name, a tuple of distinct mesh axis names, or None (replicated)."
    )


def _logical_axes(entry: VariableEntry) -> tuple[str | None, ...]:
    """The logical name of each dimension of `entry`, checked (the declaration is mutable)."""
    declared = entry.state.sharding
    names = () if isinstance(declared, str) else entry.logical_axes
    if len(names) != len(entry.shape) or not all(n is None or isinstance(n, str) for n in names):
        raise TypeError(
            f"shardings: {entry.name} (shape {entry.state.shape}) has sharding={declared!r}; "
            f"it must be None or a tuple of logical axis names (str, or None for a replicated "
            f"dimension), one per dimension. Mesh axes belong in the rules: name the "
            f"dimension and map the name, e.g. sharding=('embed', 'mlp') with rules "
            f"{{'mlp': 'model'}}."
        )
    return names


def _spec(
    entry: VariableEntry,
    names: tuple[str | None, ...],
    table: dict[str, tuple[str, ...]],
    mesh: Any,
) -> PartitionSpec:
    sizes = dict(mesh.shape)
    owner: dict[str, int] = {}  # mesh axis -> the dimension it shards
    spec: list[MeshAxes] = []

    def rule(dim: int) -> str:
        return f"the rule {names[dim]!r} -> {_show(table.get(names[dim] or '', ()))}"

    what = f"{entry.name} (shape {entry.shape}, logical axes {names})"
    for dim, name in enumerate(names):
        axes = table.get(name, ()) if name is not None else ()
        for axis in axes:
            if axis not in sizes:
                shown = ", ".join(f"{a!r}: {s}" for a, s in sizes.items())
                close = difflib.get_close_matches(axis, list(sizes), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"shardings: {what}: dimension {dim} follows {rule(dim)}, but the mesh has "
                    f"no axis {axis!r}{hint}; its axes are {shown}. Fix the rule, or build the "
                    f"mesh with that axis."
                )
            if axis in owner:
                first = owner[axis]
                raise ValueError(
                    f"shardings: {what}: dimensions {first} and {dim} would both be sharded "
                    f"over the mesh axis {axis!r} ({rule(first)}, {rule(dim)}); a mesh axis "
                    f"can shard one dimension of a variable. Map one of the names to another "
                    f"mesh axis, or to None."
                )
            owner[axis] = dim
        parts = math.prod(sizes[a] for a in axes)
        if entry.shape[dim] % parts:
            raise ValueError(
                f"shardings: {what}: dimension {dim} has size {entry.shape[dim]}, which "
                f"{rule(dim)} cannot split into equal parts over {parts} devices. Make the "
                f"size a multiple of {parts}, or map {name!r} to other mesh axes (or None)."
            )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _show(axes: tuple[str, ...]) -> str:
    return "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes)


def _check_misspelt(
    table: dict[str, tuple[str, ...]],
    entries: list[tuple[VariableEntry, tuple[str | None, ...]]],
) -> None:
    """Refuses a logical name without a rule that is close to a rule no variable uses.

    A name without a rule is replicated, deliberately; but ``"mpl"`` next to an unused rule
    for ``"mlp"`` is a typo that would silently replicate the layer.
    """
    used = {n for _, names in entries for n in names if n is not None}
    unused = [name for name in table if name not in used and table[name]]
    for entry, names in entries:
        for name in names:
            if name is None or name in table:
                continue
            close = difflib.get_close_matches(name, unused, n=1)
            if close:
                raise ValueError(
                    f"shardings: {entry.name} has the logical axis {name!r}, which no rule "
                    f"maps (so it would be replicated), while the rule for {close[0]!r}, "
                    f"which no variable has, looks like it was meant for it. Correct the "
                    f"spelling in the rule or the declaration; to replicate {name!r} on "
                    f"purpose, give it a rule ({name!r}: None)."
                )
