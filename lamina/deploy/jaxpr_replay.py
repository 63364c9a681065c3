"""`replay`: evaluates a closed jaxpr again, inlining ``jit`` calls and rewriting for ONNX.

`export_onnx` never hands lamina's code to ``jax2onnx`` (its patched ``jnp.shape`` returns a
traced array, which lamina's shape checks cannot compare): lamina traces the model itself
(``jax.make_jaxpr``) and gives ``jax2onnx`` a function that replays that jaxpr, equation by
equation. Replaying is also where the jaxpr is put in the form ONNX can run:

- calls (``jit``, ``closed_call``, ``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``) are
  inlined: their bodies are replayed in place (the forward pass is all an exported model runs),
  so that the rewrites below reach lamina's pools, which run inside a ``jit``;
- ``reduce_window_max`` with axes the window does not touch (lamina's channels-last pools: a
  window ``(1, kh, kw, 1)``) becomes the same pool over ``(batch * channels, h, w)``:
  ``jax2onnx`` turns every ``reduce_window_max`` into an ONNX ``MaxPool`` over *all* the
  operand's axes, which ONNX Runtime refuses at run time beyond three of them. A window over
  more than two axes is pooled two axes at a time (a maximum over a box is the maximum of
  maxima over its axes), so 3-D pools export too;
- ``reduce_window_min`` (which ONNX has no operator for) becomes ``-max(-x)`` for floats;
- an integer ``reduce_window_max``/``reduce_window_min`` raises `Unsupported` (ONNX's
  ``MaxPool`` takes floats only), so that the exporter can name the layer;
- ``dynamic_slice``/``dynamic_update_slice`` clamp their start indices first, as XLA does
  (ONNX's ``Slice`` shortens a slice that runs past the end instead: a decoding step past the
  cache's end relies on the clamp);
- ``log1p``/``expm1`` become forms accurate near zero (``jax2onnx`` writes ``Log(1 + x)`` and
  ``Exp(x) - 1``, which lose everything below float32's epsilon: ``softplus(-20)`` would be 0);
- ``round`` away from zero (``lax.round``'s default) is written with ``floor`` (ONNX's
  ``Round`` rounds halves to even).

Control flow (``scan``, ``while``, ``cond``) is bound as it is, its bodies rewritten the same
way when they hold anything rewritten. Every rewrite is a JAX function: the replayed function
computes what the jaxpr computes (`lm.export` writes the jaxpr unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

# Calls whose body is replayed in place, and the parameter that holds it.
INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
# Control flow whose bodies are rewritten (when they pool), and the parameters holding them.
BODIES = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}
POOLS = ("reduce_window_max", "reduce_window_min")
# Primitives the replay writes in another form (see the module's docstring).
REWRITTEN = (
    *POOLS,
    "dynamic_slice",
    "dynamic_update_slice",
    "log1p",
    "expm1",
    "round",
)


class Unsupported(Exception):
    """An operation the replayed function cannot put in a form ONNX runs.

    Attributes:
        primitive: The JAX primitive's name (``reduce_window_max``).
        reason: Why, in a few words.
    """

    def __init__(self, primitive: str, reason: str):
        super().__init__(f"{primitive}: {reason}")
        self.primitive, self.reason = primitive, reason


def replay(closed: core.ClosedJaxpr, *args: Any) -> list[Any]:
    """Evaluates `closed` on `args` (arrays or tracers), calls inlined and pools rewritten.

    Args:
        closed: A closed jaxpr, as ``jax.make_jaxpr`` returns it.
        *args: One value per input of the jaxpr (its flat inputs).

    Returns:
        The jaxpr's flat outputs, a list.

    Raises:
        Unsupported: An integer max/min pool (ONNX pools floats only).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.deploy.jaxpr_replay import replay
        >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
        >>> closed = jax.make_jaxpr(lambda x: lm.min_pool(x, (2, 2), strides=2))(x)
        >>> replay(closed, x)[0][0, :, :, 0]
        Array([[ 0.,  2.],
               [ 8., 10.]], dtype=float32)
        >>> again = jax.make_jaxpr(lambda x: replay(closed, x))(x)
        >>> [e.primitive.name for e in again.jaxpr.eqns]  # (1, 4, 4, 1) pooled as (1, 4, 4)
        ['neg', 'transpose', 'reshape', 'reduce_window_max', 'reshape', 'transpose', 'neg']
    """
    count = len(closed.jaxpr.invars)
    if len(args) != count:
        raise TypeError(f"replay: the jaxpr takes {count} inputs, got {len(args)}")
    return _evaluate(closed.jaxpr, closed.consts, args)


def _evaluate(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outvals = _equation(eqn.primitive, invals, eqn.params)
        for var, value in zip(eqn.outvars, outvals, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _equation(primitive: core.Primitive, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """One equation replayed: a list of its outputs."""
    name = primitive.name
    if name in INLINED and INLINED[name] in params:
        inner = params[INLINED[name]]
        if isinstance(inner, core.ClosedJaxpr):
            return _evaluate(inner.jaxpr, inner.consts, invals)
        return _evaluate(inner, (), invals)
    if name in POOLS:
        return [pool_for_onnx(name, invals[0], **params)]
    if name == "dynamic_slice":
        starts = _clamped(invals[0].shape, params["slice_sizes"], invals[1:])
        return [primitive.bind(invals[0], *starts, **params)]
    if name == "dynamic_update_slice":
        operand, update = invals[:2]
        return [primitive.bind(operand, update, *_clamped(operand.shape, update.shape, invals[2:]))]
    if name == "log1p":
        return [_log1p(invals[0])]
    if name == "expm1":
        return [_expm1(invals[0])]
    if name == "round" and params["rounding_method"] == lax.RoundingMethod.AWAY_FROM_ZERO:
        return [_round_away(invals[0])]
    if name in BODIES and any(_rewrites(params[key]) for key in BODIES[name]):
        params = {**params, **{key: _rewritten(params[key]) for key in BODIES[name]}}
    out = primitive.bind(*invals, **params)
    return list(out) if primitive.multiple_results else [out]


def equations(jaxprs: Any) -> Iterator[Any]:
    """Every equation of a jaxpr (or a tuple of them), those of calls and bodies included.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from lamina.deploy.jaxpr_replay import equations
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> [eqn.primitive.name for eqn in equations(closed)]
        ['jit', 'sin', 'mul']
    """
    if isinstance(jaxprs, (tuple, list)):
        for jaxpr in jaxprs:
            yield from equations(jaxpr)
        return
    jaxpr = jaxprs.jaxpr if isinstance(jaxprs, core.ClosedJaxpr) else jaxprs
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def _rewrites(jaxprs: Any) -> bool:
    """Whether a jaxpr (or a tuple of them) holds a primitive the replay rewrites."""
    return any(eqn.primitive.name in REWRITTEN for eqn in equations(jaxprs))


def _clamped(shape: Sequence[Any], sizes: Sequence[Any], starts: Sequence[Any]) -> list[Any]:
    """Start indices clamped into ``[0, dim - size]``, as XLA's dynamic slices clamp them."""
    clamped = []
    for dim, size, start in zip(shape, sizes, starts, strict=True):
        high = jnp.asarray(dim - size, start.dtype)  # a symbolic dimension too
        clamped.append(lax.clamp(np.zeros((), start.dtype), start, high))
    return clamped


# Only lax here: jax2onnx traces the replay with jax.numpy patched and 64-bit types on.
def _log1p(x: Any) -> Any:
    """``log(1 + x)`` accurate near 0: ``log(u) * x / (u - 1)`` with ``u = 1 + x`` (Goldberg)."""
    one = lax.full_like(x, 1)
    u = lax.add(one, x)
    exact = lax.mul(lax.log(u), lax.div(x, lax.sub(u, one)))
    keep = lax.bitwise_or(lax.eq(u, one), lax.eq(x, lax.full_like(x, np.inf)))
    return lax.select(keep, x, exact)


def _expm1(x: Any) -> Any:
    """``exp(x) - 1`` accurate near 0: ``(u - 1) * x / log(u)`` with ``u = exp(x)`` (Kahan)."""
    one = lax.full_like(x, 1)
    u = lax.exp(x)
    exact = lax.mul(lax.sub(u, one), lax.div(x, lax.log(u)))
    exact = lax.select(lax.eq(u, lax.full_like(x, 0)), lax.neg(one), exact)
    exact = lax.select(lax.eq(u, lax.full_like(x, np.inf)), u, exact)
    return lax.select(lax.eq(u, one), x, exact)


def _round_away(x: Any) -> Any:
    """Rounds halves away from zero: ``sign(x) * (floor(|x|) + (|x| - floor(|x|) >= 0.5))``.

    The fraction is exact in floating point (``floor(|x| + 0.5)`` rounds 0.49999997 up).
    """
    magnitude = lax.abs(x)
    whole = lax.floor(magnitude)
    up = lax.convert_element_type(lax.ge(lax.sub(magnitude, whole), lax.full_like(x, 0.5)), x.dtype)
    return lax.mul(lax.sign(x), lax.add(whole, up))


def _rewritten(jaxprs: Any) -> Any:
    """A body (or a tuple of branches) traced again through `replay`: same inputs, outputs."""
    if isinstance(jaxprs, (tuple, list)):
        return type(jaxprs)(_rewritten(j) for j in jaxprs)
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in jaxprs.jaxpr.invars
    ]
    return jax.make_jaxpr(lambda *xs: replay(jaxprs, *xs))(*avals)


def pool_for_onnx(
    name: str,
    x: Any,
    *,
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    base_dilation: Sequence[int],
    window_dilation: Sequence[int],
) -> Any:
    """A ``reduce_window_max``/``_min`` (its parameters) as max pools of at most three axes.

    The axes the window does not touch (size, stride and dilation 1, no padding) are moved
    before the others and folded into one, so that ONNX's ``MaxPool`` sees ``(n, h, w)``
    rather than ``(batch, h, w, channels)``; windows over more than two axes are pooled two
    axes at a time; a min pool is ``-max(-x)``.

    Args:
        name: ``"reduce_window_max"`` or ``"reduce_window_min"``.
        x: The operand.
        window_dimensions: The primitive's parameters, as its equation holds them.
        window_strides: As above.
        padding: As above, one ``(low, high)`` pair per axis.
        base_dilation: As above.
        window_dilation: As above.

    Returns:
        The pool's result (the primitive's, exactly: maxima are not rounded).

    Raises:
        Unsupported: An integer operand.

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina.deploy.jaxpr_replay import pool_for_onnx
        >>> x = jnp.arange(8.0).reshape(1, 4, 2)
        >>> pool_for_onnx("reduce_window_max", x, window_dimensions=(1, 2, 1),
        ...     window_strides=(1, 2, 1), padding=((0, 0),) * 3, base_dilation=(1, 1, 1),
        ...     window_dilation=(1, 1, 1))[0]
        Array([[2., 3.],
               [6., 7.]], dtype=float32)
    """
    is_max = name == "reduce_window_max"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise Unsupported(
            name, f"a {'max' if is_max else 'min'} pool of {x.dtype} values: ONNX pools floats only"
        )
    if not is_max:
        return lax.neg(
            pool_for_onnx(
                "reduce_window_max",
                lax.neg(x),
                window_dimensions=window_dimensions,
                window_strides=window_strides,
                padding=padding,
                base_dilation=base_dilation,
                window_dilation=window_dilation,
            )
        )
    params = {
        "window_dimensions": tuple(window_dimensions),
        "window_strides": tuple(window_strides),
        "padding": tuple(tuple(p) for p in padding),
        "base_dilation": tuple(base_dilation),
        "window_dilation": tuple(window_dilation),
    }
    per_axis = list(zip(*params.values(), strict=True))
    active = [i for i, axis in enumerate(per_axis) if axis != (1, 1, (0, 0), 1, 1)]
    if any(params["base_dilation"][i] != 1 for i in active) or len(active) == x.ndim <= 3:
        return lax.reduce_window_max_p.bind(x, **params)  # as it is: nothing to fold
    for start in range(0, len(active), 2):
        x = _pool_axes(x, active[start : start + 2], per_axis)
    return x


def _pool_axes(x: Any, axes: list[int], per_axis: list[tuple]) -> Any:
    """The max pool over `axes` alone (the others folded into one leading axis)."""
    others = [i for i in range(x.ndim) if i not in axes]
    order = others + axes
    moved = lax.transpose(x, order) if order != list(range(x.ndim)) else x
    kept = [x.shape[i] for i in others]
    folded = lax.reshape(moved, (math.prod(kept), *(x.shape[i] for i in axes)))
    one = (1, 1, (0, 0), 1, 1)
    window, strides, padding, base, dilation = zip(one, *(per_axis[i] for i in axes), strict=True)
    pooled = lax.reduce_window_max_p.bind(
        folded,
        window_dimensions=window,
        window_strides=strides,
        padding=padding,
        base_dilation=base,
        window_dilation=dilation,
    )
    unfolded = lax.reshape(pooled, (*kept, *pooled.shape[1:]))
    back = [order.index(i) for i in range(x.ndim)]
    return lax.transpose(unfolded, back) if back != list(range(x.ndim)) else unfolded
