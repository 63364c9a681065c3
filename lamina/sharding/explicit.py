"""Explicit mesh axes: the sharding of a layer's result, read from its operands.

On a mesh with ``AxisType.Explicit`` axes (JAX 0.10's default for `jax.make_mesh`), every
array's type carries its sharding, and JAX asks for the result's sharding wherever it is
ambiguous: a contraction over a dimension both operands shard, a gather from a sharded
table, a scan over a sharded axis or whose carry comes out sharded otherwise. The layers
resolve it with one rule (`result_sharding`), at trace time inside their jitted kernels, so
nothing runs per call and arrays without explicit axes take the usual path.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["MeshAxes", "gather_axis", "match_sharding", "result_sharding", "unshard_leading"]

MeshAxes = str | tuple[str, ...] | None
"""What one array dimension is sharded over: a mesh axis, several, or none."""


def _explicit_mesh(array: Any) -> Any:
    """The abstract mesh of `array`'s type if it has explicit axes, else None (trace time)."""
    mesh = jax.typeof(array).sharding.mesh
    return mesh if mesh.explicit_axes else None


def _axes_of(entry: Any, explicit: Sequence[str]) -> tuple[str, ...]:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(n for n in names if n in explicit)


def result_sharding(
    out: Sequence[Hashable], *operands: tuple[Any, Sequence[Hashable]]
) -> NamedSharding | None:
    """The sharding of an einsum-like result on an explicit mesh; None on any other.

    The rule: each dimension of the result (labelled as in an einsum) is sharded as the first
    operand that has its label shards it; a mesh axis already taken by an earlier dimension of
    the result is dropped (that dimension is gathered), and a contracted dimension sharded in
    the operands is summed across its devices. So ``x[batch@data, in] @ kernel[in,
    out@model]`` gives ``[batch@data, out@model]``, and ``h[batch@data, hidden@model] @
    kernel[hidden@model, out]`` gives ``[batch@data, out]`` (a reduction over ``model``).

    Args:
        out: One label per dimension of the result.
        operands: ``(array, labels)`` pairs, one label per dimension of the array.

    Returns:
        A `NamedSharding` on the operands' abstract mesh, for ``out_sharding=``, or None when
        no operand is sharded over explicit mesh axes (then JAX needs no ``out_sharding``).
    """
    mesh = None
    found: dict[Hashable, tuple[str, ...]] = {}
    for array, labels in operands:
        array_mesh = _explicit_mesh(array)
        if array_mesh is None:
            continue
        mesh = mesh or array_mesh
        explicit = array_mesh.explicit_axes
        for label, entry in zip(labels, jax.typeof(array).sharding.spec, strict=False):
            found.setdefault(label, _axes_of(entry, explicit))
    if mesh is None:
        return None
    taken: set[str] = set()
    spec: list[MeshAxes] = []
    for label in out:
        axes = tuple(a for a in found.get(label, ()) if a not in taken)
        taken.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(*spec))


def match_sharding(value: Any, like: Any) -> Any:
    """`value` resharded as `like` on an explicit mesh (a scan's carry keeps its type)."""
    mesh = _explicit_mesh(like) or _explicit_mesh(value)
    if mesh is None:
        return value
    wanted = jax.typeof(like).sharding.spec
    if jax.typeof(value).sharding.spec == wanted:
        return value
    return jax.sharding.reshard(value, NamedSharding(mesh, wanted))


def gather_axis(value: Any, axis: int, groups: int | None = None) -> Any:
    """`value` with its dimension `axis` gathered on an explicit mesh.

    For a convolution's channel axes that JAX or XLA cannot split: the input of one grouped
    per channel (patches), and the input and output channels of one with `groups` > 1 when
    they are split over a number of devices that does not divide `groups` (JAX cannot
    reshape them into groups for the gradient, and XLA's partitioner aborts the process).
    With `groups` given, `value` is kept as it is when that number divides it; without
    explicit axes `value` is returned as it is.
    """
    mesh = _explicit_mesh(value)
    if mesh is None:
        return value
    spec = list(jax.typeof(value).sharding.spec)
    spec += [None] * (value.ndim - len(spec))
    axes = _axes_of(spec[axis], mesh.explicit_axes)
    if not axes or (groups is not None and groups % math.prod(mesh.shape[a] for a in axes) == 0):
        return value
    spec[axis] = None
    return jax.sharding.reshard(value, NamedSharding(mesh, PartitionSpec(*spec)))


def unshard_leading(value: Any) -> Any:
    """`value` with its first dimension gathered on an explicit mesh (`lax.scan` slices it).

    A scan can only slice an axis that is replicated; a `Stack` whose depth is sharded (its
    ``depth_sharding``) keeps its variables sharded at rest and gathers them for the loop,
    as GSPMD does on a mesh of ``Auto`` axes.
    """
    mesh = _explicit_mesh(value)
    spec = jax.typeof(value).sharding.spec
    if mesh is None or not spec or spec[0] is None:
        return value
    return jax.sharding.reshard(value, NamedSharding(mesh, PartitionSpec(None, *spec[1:])))
