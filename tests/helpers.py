"""Helpers shared by the tests of the layers (`tests/test_nn_*.py`, the layer table, LoRA)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm


def normal(rng: np.random.Generator, *shape: int, dtype: Any = jnp.float32) -> jax.Array:
    """Standard normal data from NumPy's `rng`, as a JAX array of `dtype`.

    NumPy, not `jax.random`: a `jax.random` call compiles once per shape, and those
    compilations would dominate the tests' runtime.
    """
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def layout(tree: Any) -> Any:
    """The ``(shape, dtype)`` of every leaf, in the tree's structure (mappings as dicts)."""
    if hasattr(tree, "items"):
        tree = dict(tree)
    return jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.dtype(a.dtype)), tree)


def abstract_init(model: lm.Module, to_callable: Any = None) -> Any:
    """The shapes and dtypes of `model`'s variables, without computing them."""
    init = lm.transform(model, to_callable=to_callable).init
    return jax.eval_shape(init, jax.random.key(0))


def apply_to(layer: lm.Module, *args: Any, rngs: Any = None, **kwargs: Any) -> Any:
    """Transforms `layer`, initialises it (key 0) and applies it: ``(outputs, variables)``."""
    init, apply = lm.transform(layer)
    return apply(init(jax.random.key(0)), rngs, *args, **kwargs)


def assert_close(
    got: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6, check_dtype: bool = True
) -> None:
    """Leaf by leaf: the same structure, shapes (and dtypes), values within tolerance.

    The absolute tolerance is scaled by the largest magnitude of the expected leaf (at least
    1): two float32 computations of the same thing differ by reassociation and fused
    multiply-adds, errors that grow with a sum's terms, not with its result.
    """
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert jnp.shape(a) == jnp.shape(b), (jnp.shape(a), jnp.shape(b))
        if check_dtype:
            assert jnp.result_type(a) == jnp.result_type(b), (a.dtype, b.dtype)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale)


def assert_close_complex(got: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """`assert_close` for trees that may hold complex leaves.

    The same layout (shapes and dtypes, leaf by leaf), then the values within tolerance, a
    complex leaf compared as the pair of its real and imaginary parts.
    """
    assert layout(got) == layout(expected)

    def parts(x: Any) -> Any:
        x = jnp.asarray(x)
        return jnp.stack([x.real, x.imag]) if jnp.iscomplexobj(x) else x

    assert_close(jax.tree.map(parts, got), jax.tree.map(parts, expected), rtol, atol)


def shifted_normal(
    shape: tuple[int, ...], seed: int = 0, dtype: Any = jnp.float32, offset: float = 1.0
) -> jax.Array:
    """Normal data around `offset` (so that the mean matters), from NumPy's generator.

    A complex `dtype` gets an imaginary part too.
    """
    rng = np.random.default_rng(seed)
    x = offset + 2.0 * rng.standard_normal(shape)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = x + 1j * (rng.standard_normal(shape) - 0.5)
    return jnp.asarray(x, dtype)
