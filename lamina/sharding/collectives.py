"""Collectives over whole pytrees: one buffer, and so one collective, per dtype.

`jax.lax.pmean` over a pytree (the gradients of a data-parallel step, say) binds one
all-reduce with an operand per leaf. Runtimes that synchronise the devices once per operand
pay that per leaf: XLA:CPU's in-process all-reduce (jaxlib 0.10) meets the other devices in
a rendezvous for every buffer, about 0.1 ms each, so the 40-odd gradients of a small
transformer spent 5 ms of a 33 ms step there (``benchmarks/char_transformer_profile.py``).
`pmean` concatenates the leaves of each dtype into one vector, averages that, and cuts it
back: two copies of the tree's bytes for one synchronisation instead of one per leaf.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["pmean"]

T = TypeVar("T")


def pmean(tree: T, axis_name: Any) -> T:
    """`jax.lax.pmean` of every leaf of `tree`, as one collective per dtype.

    The same values and dtypes as ``jax.lax.pmean(tree, axis_name)`` (each element is the
    mean of that element over the axis; integer and boolean leaves come back as
    ``lax.pmean`` gives them, floating; Python numbers come back as weakly typed arrays),
    with the leaves of each dtype concatenated into one buffer first: one all-reduce instead
    of one per leaf. Leaves sharded along an explicit mesh axis (``jax.typeof(x).sharding``)
    are averaged one by one, as ``lax.pmean`` does.

    Use it where a data-parallel step averages its gradients inside ``jax.shard_map`` (or
    ``jax.pmap``, or ``jax.vmap`` with an ``axis_name``). Inside ``shard_map``, mark the
    replicated weights as each device's own first, ``jax.lax.pcast(params, axis_name,
    to="varying")``, then take the gradient: otherwise JAX has already summed the gradients
    of the replicated weights over the axis, and their mean is that sum (the number of
    devices times too large). Under ``jax.jit`` with sharded inputs alone, XLA averages
    across devices without it. ``lax.pmean``'s ``axis_index_groups`` is not supported.

    Args:
        tree: A pytree of arrays (or Python numbers), e.g. the gradients.
        axis_name: The mapped axis (or a tuple of axes) to average over, as for
            ``lax.pmean``.

    Returns:
        A pytree of `tree`'s structure, each leaf of its shape, with the dtype
        ``lax.pmean`` gives it.

    Raises:
        NameError: `axis_name` is not an axis of an enclosing ``shard_map``/``pmap``/``vmap``
            (for a tree with leaves; an empty tree is returned as it is).
        TypeError: A leaf is not an array or a number (its path is named).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> grads = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1.0, 3.0])}
        >>> mean = jax.vmap(lambda g: lm.pmean(g, "devices"), axis_name="devices")(grads)
        >>> mean["b"].tolist()  # both members get the mean of [1.0, 3.0]
        [2.0, 2.0]
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [_as_array(path, leaf) for path, leaf in with_paths]
    groups: dict[Any, list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault(_group(index, leaf), []).append(index)
    averaged: list[Any] = list(leaves)
    try:
        for indices in groups.values():
            if len(indices) == 1:
                averaged[indices[0]] = lax.pmean(leaves[indices[0]], axis_name)
                continue
            flat = lax.pmean(jnp.concatenate([leaves[i].ravel() for i in indices]), axis_name)
            ends = np.cumsum([leaves[i].size for i in indices])
            for i, start, end in zip(indices, [0, *ends[:-1]], ends, strict=True):
                averaged[i] = flat[start:end].reshape(leaves[i].shape)
    except NameError as error:
        raise NameError(
            f"lm.pmean: no mapped axis {axis_name!r} here ({error}). Call it inside "
            f"jax.shard_map (or jax.pmap, or jax.vmap) with axis_name={axis_name!r}; under "
            "jax.jit with sharded inputs, XLA averages across devices without it."
        ) from None
    return jax.tree_util.tree_unflatten(treedef, averaged)


def _group(index: int, leaf: jax.Array) -> tuple:
    """The buffer a leaf can share: its dtype and weak type's, unless it is sharded.

    A leaf sharded along an explicit mesh axis keeps a collective of its own (its `index`).
    """
    aval = jax.typeof(leaf)
    sharded = any(axes is not None for axes in aval.sharding.spec)
    return (leaf.dtype, aval.weak_type, index if sharded else None)


def _as_array(path: Any, leaf: Any) -> jax.Array:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
        return jnp.asarray(leaf)
    raise TypeError(
        f"lm.pmean: the leaf at {jax.tree_util.keystr(path) or 'the root'} is a "
        f"{type(leaf).__name__}, not an array or a number; average arrays only (leave other "
        "values out of the tree, or make them arrays)."
    )
