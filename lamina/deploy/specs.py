"""The input specs of an export: `batch_dims` made into symbolic shapes, and examples back.

One idea: what the exported function takes, as ``jax.ShapeDtypeStruct`` pytrees.
`shape_specs` reads ``batch_dims`` into one polymorphic shape per array input (checking each
against its example's rank), `symbolic_specs` makes every symbolic dimension in one
`jax.export.symbolic_shape` scope (weak types kept; one symbol is one size in all the
examples), `spec_of` is one array-like's spec, and `concrete_example` the array a spec's
example stands for (random values for a ``ShapeDtypeStruct`` example), which a format's check
runs on. Errors name the input and say what to pass instead (see inference.py's docstring).

Example:
    >>> import numpy as np
    >>> from lamina.deploy.specs import shape_specs, symbolic_specs
    >>> inputs, names = [np.ones((4, 3), np.float32)], ["x"]
    >>> shapes = shape_specs(inputs, names, "b", where="lm.export")
    >>> shapes
    ['b, ...']
    >>> symbolic_specs(inputs, names, shapes, where="lm.export")
    [ShapeDtypeStruct(shape=(b, 3), dtype=float32)]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ExportError


def shape_specs(inputs: list[Any], names: list[str], batch_dims: Any, where: str) -> list[Any]:
    """One polymorphic shape (a string, or None for static) per input, from `batch_dims`."""
    if batch_dims is None:
        return [None] * len(inputs)
    if not inputs:
        raise ValueError(
            f"{where}: batch_dims={batch_dims!r} asks for symbolic sizes, but no example "
            f"argument is an array: pass the inputs as arrays (np.asarray(...)), or leave "
            f"batch_dims out."
        )
    if isinstance(batch_dims, str):
        entries = [batch_dims] * len(inputs)
    elif isinstance(batch_dims, (tuple, list)):
        if len(batch_dims) != len(inputs):
            raise ValueError(
                f"{where}: batch_dims has {len(batch_dims)} entries, but the example arguments "
                f"hold {len(inputs)} array input(s) ({', '.join(names) or 'none'}): give one "
                f"entry per array input (None for a static one), or one string for all."
            )
        entries = list(batch_dims)
    else:
        raise ValueError(
            f'{where}: batch_dims must be None, a string ("b": axis 0 of every input is the '
            f'symbolic b; "b, t": a polymorphic shape) or a tuple with one per array input, '
            f"got {type(batch_dims).__name__} {batch_dims!r}."
        )
    shapes: list[Any] = []
    for i, (entry, arg) in enumerate(zip(entries, inputs, strict=True)):
        label = f"input {i} ({names[i]})"
        if entry is None:
            shapes.append(None)
            continue
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(
                f"{where}: batch_dims for {label} must be None or a non-empty string, got "
                f"{entry!r}."
            )
        spec = entry if ("," in entry or "..." in entry) else f"{entry.strip()}, ..."
        for leaf in jax.tree_util.tree_leaves(arg):
            _check_fits(spec, entry, tuple(np.shape(leaf)), label, where)
        shapes.append(jax.tree.map(lambda _, spec=spec: spec, arg))
    return shapes


def _check_fits(spec: str, entry: str, shape: tuple, label: str, where: str) -> None:
    """A polymorphic shape fits a leaf's shape: its rank (unless ``...``), no symbolic axes."""
    if not all(isinstance(d, int) for d in shape):
        raise ValueError(
            f"{where}: {label} already has the symbolic shape {shape} (a ShapeDtypeStruct), "
            f"and batch_dims asks for {entry!r} too: give None for it in batch_dims (a tuple "
            f"with one entry per array input), or leave batch_dims out and write every "
            f"input's shape with jax.export.symbolic_shape in one scope."
        )
    if spec.endswith(", ...") and spec.count(",") == 1 and not shape:
        raise ValueError(
            f"{where}: batch_dims asks for a symbolic axis 0 of {label} "
            f"({entry.strip()!r}), but it is a scalar (shape ()): give None for it."
        )
    try:
        dims = jax.export.symbolic_shape(spec, like=shape)
        if "..." not in spec and len(dims) != len(shape):
            raise ValueError(f"{len(dims)} axes for a rank-{len(shape)} array")
    except Exception as error:
        raise ValueError(
            f"{where}: batch_dims for {label} is {entry!r}, which does not fit its "
            f'shape {shape} ({error}). Use a name such as "b" for axis 0, a polymorphic '
            f'shape with one entry per axis such as "b, t, 3", or end it with "..." '
            f'("b, t, ...").'
        ) from None


def symbolic_specs(inputs: list[Any], names: list[str], shapes: list[Any], where: str) -> list[Any]:
    """The specs of the inputs, every symbolic dimension in one scope, weak types kept."""
    plain = [jax.tree.map(spec_of, x) for x in inputs]
    if all(s is None for s in shapes):
        return plain
    try:
        specs = jax.export.symbolic_args_specs(tuple(plain), tuple(shapes))
    except Exception as error:
        raise ValueError(f"{where}: batch_dims {shapes!r} do not fit the inputs: {error}") from None
    typed = jax.tree.map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=p.weak_type),
        list(specs),
        plain,
    )
    _check_one_size(inputs, names, typed, where)
    return typed


def _check_one_size(inputs: list[Any], names: list[str], specs: list[Any], where: str) -> None:
    """Each symbol of `batch_dims` stands for one size in all the example arguments."""
    bound: dict[str, tuple[int, str]] = {}
    for i, (arg, spec) in enumerate(zip(inputs, specs, strict=True)):
        for leaf, leaf_spec in zip(
            jax.tree_util.tree_leaves(arg), jax.tree_util.tree_leaves(spec), strict=True
        ):
            for axis, (size, dim) in enumerate(zip(np.shape(leaf), leaf_spec.shape, strict=True)):
                symbol = str(dim)
                if isinstance(dim, int) or not isinstance(size, int) or not symbol.isidentifier():
                    continue
                here = f"axis {axis} of input {i} ({names[i]})"
                first = bound.setdefault(symbol, (size, here))
                if first[0] != size:
                    raise ValueError(
                        f"{where}: batch_dims makes {here} the symbolic size {symbol}, but it "
                        f"is {size} there and {first[0]} in {first[1]}: one symbol is one size "
                        f"in every example argument. If {here} is not a batch axis, give "
                        f"batch_dims one entry per array input (a tuple, None for a static "
                        f"one), e.g. ('b', None); otherwise make the examples agree."
                    )


def spec_of(x: Any) -> jax.ShapeDtypeStruct:
    """An array-like as a spec; float64/int64 as JAX stores them (float32 under x64 off).

    A weakly typed array (``jnp.asarray(0.1)``) stays weakly typed, as `apply` sees it: a
    bfloat16 result times it stays bfloat16.
    """
    weak = bool(getattr(x, "weak_type", False))
    if isinstance(x, jax.ShapeDtypeStruct):
        dtype = x.dtype
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            dtype = jax.dtypes.canonicalize_dtype(dtype)
        return jax.ShapeDtypeStruct(x.shape, dtype, weak_type=weak)
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(np.shape(x), dtype, weak_type=weak)


def concrete_example(
    x: Any, spec: jax.ShapeDtypeStruct, name: str, where: str, rng: np.random.Generator
) -> Any:
    """The array `spec` describes: `x` itself, or random values for a ``ShapeDtypeStruct``.

    Random, so that a format's check compares something: standard normal floats, integers
    in ``[0, 2)`` (valid indices and token ids of any vocabulary), random booleans; zeros
    only for a weakly typed spec (a random array cannot be weakly typed).
    """
    if isinstance(x, jax.Array) and x.dtype == spec.dtype:
        return x  # as given: a key, a weakly typed scalar
    if isinstance(x, jax.ShapeDtypeStruct):
        if not all(isinstance(d, int) for d in x.shape):
            raise ExportError(
                f"{where}: {name} is a ShapeDtypeStruct of the symbolic shape {x.shape}, so "
                f"there is no concrete example to check the artifact with: give an array (and "
                f"batch_dims for its symbolic axes)."
            )
        zero = jnp.asarray(np.zeros((), spec.dtype).item()) if spec.weak_type else None
        if zero is not None and zero.dtype == spec.dtype:
            return jax.lax.broadcast(zero, x.shape)  # weakly typed, as the spec
        if jnp.issubdtype(spec.dtype, jnp.inexact):
            return jnp.asarray(rng.standard_normal(x.shape), spec.dtype)
        return jnp.asarray(rng.integers(0, 2, x.shape), spec.dtype)
    return jnp.asarray(x, dtype=spec.dtype)
