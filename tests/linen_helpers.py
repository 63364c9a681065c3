"""Helpers of the tests that compare lamina's layers with Flax Linen's, given the same weights.

Linen runs under `jax.jit` (one compiled program instead of one per primitive) and, where
only the layout of its variables matters, under `jax.eval_shape` (no initializer runs).
Linen mixes dtypes implicitly, so its calls run under JAX's "standard" dtype promotion (the
test configuration makes it strict).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm
from tests.helpers import assert_close, assert_close_complex, layout

# keyword arguments of Linen's `apply` that must be static under `jax.jit`
STATIC_APPLY_ARGUMENTS = ("deterministic", "mutable", "sow_weights")


def randomize(variables: Any, seed: int = 1) -> Any:
    """The same tree with non-trivial values, from NumPy's generator.

    Leaves named ``...var`` get positive values, ``...scale`` values near one, the others
    standard normal values (complex leaves get an imaginary part too). Only the leaves' shapes
    and dtypes are read: `jax.ShapeDtypeStruct` leaves work.
    """
    rng = np.random.default_rng(seed)

    def value(path: tuple, leaf: Any) -> jax.Array:
        name = str(getattr(path[-1], "key", path[-1]))
        shape = leaf.shape
        if name.endswith("var"):
            x = rng.uniform(0.5, 2.0, shape)
        elif name.endswith("scale"):
            x = 1.0 + 0.5 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape)
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            x = x + 0.5j * rng.standard_normal(shape)
        return jnp.asarray(x, leaf.dtype)

    return jax.tree_util.tree_map_with_path(value, variables)


def linen_shapes(module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The shapes and dtypes of Linen's init variables (key 0), without computing them."""
    with jax.numpy_dtype_promotion("standard"):
        shapes = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a, **kwargs), *args)
    return dict(shapes)


def linen_init(module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Linen's init variables (key 0, computed under jit), as a plain dict at the top."""
    with jax.numpy_dtype_promotion("standard"):
        variables = jax.jit(lambda *a: module.init(jax.random.key(0), *a, **kwargs))(*args)
    return dict(variables)


def linen_random_variables(
    module: nn.Module, *args: Any, seed: int = 1, **kwargs: Any
) -> dict[str, Any]:
    """Variables in the layout of Linen's init, with the non-trivial values of `randomize`."""
    return randomize(linen_shapes(module, *args, **kwargs), seed)


def linen_apply(module: nn.Module, **static: Any) -> Callable[..., Any]:
    """Linen's `apply` of `module` under jit, with the keyword arguments `static` fixed."""
    return jax.jit(
        functools.partial(module.apply, **static), static_argnames=STATIC_APPLY_ARGUMENTS
    )


def linen_variables(linen: nn.Module, x: Any, normal: Callable[..., Any]) -> dict[str, Any]:
    """Variables with Linen's layout (its `init`'s paths, shapes and dtypes), random values.

    `normal(shape, dtype)` draws the values. Random biases (Linen's are zeros) make the bias
    part of the comparison; `jax.eval_shape` spares the compilation of Linen's initializers
    for every shape.
    """
    shapes = jax.eval_shape(linen.init, jax.random.key(0), x)
    return jax.tree.map(lambda s: normal(s.shape, s.dtype), dict(shapes))


def outputs_and_gradients(fn: Callable[..., Any], variables: Any, x: Any, cotangent: Any) -> Any:
    """``fn(variables, x)`` and the gradients of ``cotangent . fn`` w.r.t. both arguments."""
    out, vjp = jax.vjp(fn, variables, x)
    return out, vjp(cotangent)


def check_against_linen(
    linen: nn.Module,
    ours: lm.Module,
    x: Any,
    normal: Callable[..., Any],
    tol: float = 1e-5,
) -> Any:
    """Linen's variables in lamina's apply: equal outputs, and gradients w.r.t. both inputs."""
    variables = linen_variables(linen, x, normal)
    init, apply = lm.transform(ours)
    # lamina's init lays its variables out as Linen's does (paths, shapes, storage dtypes)
    assert layout(jax.eval_shape(init, jax.random.key(0))) == layout(variables)

    out_shape = jax.eval_shape(linen.apply, variables, x)
    cotangent = normal(out_shape.shape, out_shape.dtype)
    expected = jax.jit(outputs_and_gradients, static_argnums=0)(
        linen.apply, variables, x, cotangent
    )
    got = outputs_and_gradients(lambda v, x: apply(v, None, x)[0], variables, x, cotangent)
    assert float(jnp.max(jnp.abs(expected[0].astype(jnp.float32)))) > 0.1  # a real signal
    assert_close(got, expected, rtol=tol, atol=tol)
    return got[0]


def weighted(y: jax.Array) -> jax.Array:
    """A scalar loss with a different weight on every output."""
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(jnp.real(y).astype(jnp.float32) * w)


def linen_results(module, variables, *args, grads=True, **kwargs):
    """Linen's output, variables after the call and gradients (params, then the inputs)."""

    def loss(params, *args):
        y, new = module.apply({**variables, "params": params}, *args, mutable=True, **kwargs)
        return weighted(y), (y, {c: v for c, v in new.items() if c != "params"})

    with jax.numpy_dtype_promotion("standard"):
        if not grads:
            return (*jax.jit(loss)(variables.get("params", {}), *args)[1], None)
        argnums = tuple(range(1 + len(args)))
        grad = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
        g, (y, new) = grad(variables.get("params", {}), *args)
    return y, new, g


def our_results(layer, variables, *args, grads=True, **kwargs):
    """Our output, variables after the call (no params) and gradients."""
    apply = lm.transform(layer).apply

    def loss(params, *args):
        y, new = apply({**variables, "params": params}, None, *args, **kwargs)
        return weighted(y), (y, {c: v for c, v in new.items() if c != "params"})

    if not grads:
        return (*jax.jit(loss)(variables.get("params", {}), *args)[1], None)
    argnums = tuple(range(1 + len(args)))
    g, (y, new) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(
        variables.get("params", {}), *args
    )
    return y, new, g


def compare_with_linen(linen, ours, x, linen_kwargs=None, our_kwargs=None, grads=True, atol=1e-6):
    """Same variables in both libraries: outputs, new variables and gradients agree."""
    linen_kwargs = linen_kwargs or {}
    our_kwargs = linen_kwargs if our_kwargs is None else our_kwargs
    variables = linen_random_variables(linen, x, **linen_kwargs)
    expected = linen_results(linen, variables, x, grads=grads, **linen_kwargs)
    got = our_results(ours, variables, x, grads=grads, **our_kwargs)
    assert layout(lm.transform(ours).init(jax.random.key(0))) == layout(variables)
    for a, b in zip(got, expected, strict=True):
        assert_close_complex(a, b, atol=atol)
    return got


def linen_and_lamina(
    linen_module: nn.Module,
    lamina_module: lm.Module,
    *inputs: Any,
    key: int = 0,
    method: Any = None,
    call: Any = None,
) -> tuple[Any, Any, Any]:
    """Inits Linen, runs both on Linen's variables; returns (variables, linen_out, our_out)."""
    variables = linen_module.init(jax.random.key(key), *inputs, method=method)
    expected = linen_module.apply(variables, *inputs, method=method)
    _, apply = lm.transform(lamina_module, to_callable=call)
    got, _ = apply(dict(variables), None, *inputs)
    return variables, expected, got
