"""`grad_rule`: a gradient written together with its forward, as Flux's ``@grad`` writes it.

Flux writes ``@grad a * b = data(a) * data(b), Δ -> (Δ * b, a * Δ)``: a function returns its
value and a pullback, and the pullback maps the output's cotangent to one cotangent per
argument. `grad_rule` gives a JAX function the same form, built on `jax.custom_vjp`:

- The positional arguments (pytrees of arrays) are differentiated; the pullback returns one
  cotangent per positional argument, each checked against its argument (structure, shape,
  dtype) when the forward pass is traced, so a wrong pullback fails before any backward pass.
- Keyword arguments are not differentiated. Arrays among them cross the `custom_vjp`
  boundary as primal inputs whose cotangent is zero; everything else (numbers, strings,
  functions) is closed over, as Python values.
- The pullback may close over any value of the forward pass. It is traced to a jaxpr once,
  in the forward pass (`jax.make_jaxpr`); the values it captured become the residuals, and
  the jaxpr rides along as static data of the residual pytree (the way `jax.custom_gradient`
  does it), so nothing is recomputed and nothing is kept in a global cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _jax_core  # the current trace, to tell a closed-over tracer
from jax._src.interpreters import ad as _jax_ad
from jax._src.interpreters import partial_eval as _jax_pe
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun, primal_dtype_to_tangent_dtype

P = ParamSpec("P")

Pullback = Callable[[Any], Sequence[Any]]
"""``pullback(g) -> (cotangent of argument 0, cotangent of argument 1, ...)``."""

_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def grad_rule(fn: Callable[P, tuple[Any, Pullback]]) -> Callable[P, Any]:
    """Makes a function that returns ``(y, pullback)`` a function of `y` with that gradient.

    Flux's ``@grad``: the gradient rule is written together with the forward pass.
    ``pullback(g)`` receives the cotangent `g` of `y` (same structure, shapes and dtypes)
    and returns a tuple with one cotangent per positional argument, in order: an array (or a
    pytree of arrays) of the argument's structure, shapes and dtypes, or None for an argument
    (or a leaf) that gets no gradient. Integer and bool arguments take None (JAX's float0
    zeros are accepted too). Keyword arguments are not differentiated: their gradient is zero,
    as if wrapped in `jax.lax.stop_gradient`; use them for settings (a number of levels, a
    mode) and for arrays that are constants to the rule.

    The result works under `jax.jit`, `jax.vmap`, `jax.grad` and `jax.vjp`, and under
    `jax.grad` of `jax.grad` when the pullback is itself differentiable (it is differentiated
    like any JAX code). It is built on `jax.custom_vjp`, so forward mode (`jax.jvp`,
    `jax.jacfwd`, `jax.hessian`) is not available: use `jax.jacrev` of `jax.jacrev`.

    Args:
        fn: ``fn(*args, **kwargs) -> (y, pullback)``. `y` is a pytree of arrays; `fn` must be
            a pure function of its arguments. It runs on the values it is given (concrete
            arrays under an eager `jax.grad`; abstract ones under `jax.jit`, or when the rule
            is differentiated at a higher order, where it is traced to a jaxpr to check its
            closures). `fn` and its pullback may close over values that are not
            differentiated (constants, values traced by an enclosing `jax.jit` or
            `jax.vmap`); closing over a value that a `jax.grad`/`jax.vjp`/`jax.jvp` around
            the call differentiates is a TypeError: pass that value as a positional
            argument. A value traced by a `jax.jit` or a loop body (`jax.lax.scan`) that a
            differentiation outside it reaches is a TypeError too (JAX traces the forward
            pass outside that jit): pass it as a keyword argument.

    Returns:
        A function with `fn`'s signature (and name and docstring) that returns `y`.

    Raises:
        TypeError: `fn` is not callable. When called: a positional argument holding
            something other than arrays and numbers, or `fn` not returning a pair
            ``(y, pullback)`` with a callable pullback. When differentiated: a pullback that
            returns something other than a tuple, or a cotangent of the wrong dtype or of the
            wrong kind (not an array); `fn` or its pullback closing over a differentiated
            value; a pullback that computes with the float0 cotangent of an integer output.
        ValueError: When differentiated: a pullback that returns the wrong number of
            cotangents, or one of the wrong structure or shape. Every message names `fn`.

    Example:
        Rounding has a zero gradient almost everywhere; the straight-through estimator
        passes the gradient through as if rounding were the identity:

        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> @lm.grad_rule
        ... def round_ste(x):
        ...     return jnp.round(x), lambda g: (g,)
        >>> x = jnp.array([0.2, 1.7])
        >>> round_ste(x)
        Array([0., 2.], dtype=float32)
        >>> jax.grad(lambda x: jnp.sum(jnp.round(x)))(x)
        Array([0., 0.], dtype=float32)
        >>> jax.grad(lambda x: jnp.sum(round_ste(x)))(x)
        Array([1., 1.], dtype=float32)

        Several arguments, and a keyword argument that is not differentiated:

        >>> @lm.grad_rule
        ... def scaled_product(a, b, *, scale):
        ...     return scale * a * b, lambda g: (scale * g * b, scale * g * a)
        >>> jax.grad(scaled_product, argnums=(0, 1))(2.0, 3.0, scale=10.0)
        (Array(30., dtype=float32), Array(20., dtype=float32))
    """
    if not callable(fn):
        raise TypeError(
            f"lm.grad_rule decorates a function that returns (y, pullback); got {_kind(fn)}."
        )
    name = getattr(fn, "__qualname__", None) or repr(fn)

    @functools.wraps(fn)
    def rule(*args: P.args, **kwargs: P.kwargs) -> Any:
        for position, arg in enumerate(args):
            _check_argument(name, position, arg)
        keywords = _Keywords(kwargs)
        differentiating = _differentiating()

        def primal(args: tuple[Any, ...], kw_arrays: list[Any]) -> Any:
            return run(args, kw_arrays, False)

        def forward(args: tuple[Any, ...], kw_arrays: list[Any]) -> tuple[Any, _Residuals]:
            y, residuals = run(args, kw_arrays, True)
            return _with_rule(args, y, residuals), residuals

        def run(args: tuple[Any, ...], kw_arrays: list[Any], pullback: bool) -> Any:
            # `fn` runs on the values it is given (concrete ones under an eager jax.grad);
            # only where that cannot tell a closed-over differentiated value is it traced.
            if not (differentiating or pullback):
                return call(args, kw_arrays, pullback)
            if _needs_jaxpr((args, kw_arrays)):
                return _checked(name, lambda a, k: call(a, k, pullback), args, kw_arrays)
            result = call(args, kw_arrays, pullback)
            # No input is differentiated: a differentiated tracer in `y` or among the values
            # the pullback captured can only come from a value `fn` closes over.
            if any(_is_differentiated(leaf) for leaf in jax.tree.leaves(result)):
                raise _closure_error(name, "the rule (its forward pass or its pullback)")
            return result

        def call(args: tuple[Any, ...], kw_arrays: list[Any], pullback: bool) -> Any:
            y, pullback_fn = _call(fn, name, args, keywords.rebuild(kw_arrays), differentiating)
            return (y, _trace_pullback(name, pullback_fn, y, args)) if pullback else y

        def backward(residuals: _Residuals, g: Any) -> tuple[Any, None]:
            return residuals.cotangents(g), None  # the keyword arrays: zero

        primal.__name__ = primal.__qualname__ = getattr(fn, "__name__", "grad_rule")
        differentiable = jax.custom_vjp(primal)
        differentiable.defvjp(forward, backward)
        return differentiable(tuple(args), keywords.arrays)

    return rule


class _Keywords:
    """A call's keyword arguments, split: the arrays, and the values closed over.

    The arrays cross the `custom_vjp` boundary as primal inputs (their cotangent is zero);
    everything else (numbers, strings, functions) stays a Python value.
    """

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.leaves, self.tree = jax.tree.flatten(kwargs)
        self.is_array = [isinstance(leaf, jax.Array) for leaf in self.leaves]
        self.arrays = [
            leaf for leaf, array in zip(self.leaves, self.is_array, strict=True) if array
        ]

    def rebuild(self, arrays: Sequence[Any]) -> dict[str, Any]:
        """The keyword arguments, with `arrays` in the places of the arrays."""
        given = iter(arrays)
        leaves = [
            next(given) if array else leaf
            for leaf, array in zip(self.leaves, self.is_array, strict=True)
        ]
        return jax.tree.unflatten(self.tree, leaves)


@jax.custom_vjp
def _with_rule(args: tuple[Any, ...], y: Any, residuals: _Residuals) -> Any:
    """`y`, whose derivative with respect to `args` is the rule's pullback, at every order.

    The forward pass of a `custom_vjp` is differentiated like any code by an outer
    differentiation (the second `jax.grad` of ``grad(grad(f))``): without this, `y` would get
    the derivative of the code that computed it (zero, for a rounding) rather than the rule's.
    It is the identity on `y`, so calling it costs nothing; it calls itself in its own forward
    pass, as JAX's guide to custom derivatives says a rule must to hold at higher orders.
    """
    return y


def _with_rule_forward(
    args: tuple[Any, ...], y: Any, residuals: _Residuals
) -> tuple[Any, _Residuals]:
    return _with_rule(args, y, residuals), residuals


def _with_rule_backward(residuals: _Residuals, g: Any) -> tuple[Any, None, None]:
    return residuals.cotangents(g), None, None


_with_rule.defvjp(_with_rule_forward, _with_rule_backward)


def _call(
    fn: Callable[..., Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    differentiating: bool,
) -> tuple[Any, Pullback]:
    """``fn(*args, **kwargs)``, checked to be a pair ``(y, pullback)``.

    `differentiating` says whether a differentiation was tracing where the rule was called:
    then a tracer that escapes inside `fn` is a differentiated value it closes over (JAX
    runs the forward pass of a `custom_vjp` below that differentiation's trace).
    """
    try:
        result = fn(*args, **kwargs)
    except jax.errors.UnexpectedTracerError as error:
        if not differentiating:
            raise
        raise _closure_error(name, "its forward pass") from error
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else _kind(result)
        raise TypeError(
            f"grad rule {name} returned {got}; a grad rule returns a pair (y, pullback): "
            f"`return y, lambda g: (g_x, ...)`, with one cotangent per positional argument."
        )
    y, pullback = result
    if not callable(pullback):
        raise TypeError(
            f"grad rule {name} returned (y, {_kind(pullback)}); the second item must be the "
            f"pullback, a function of the cotangent g of y returning one cotangent per "
            f"positional argument: `return y, lambda g: (g_x, ...)`."
        )
    return y, pullback


def _check_argument(name: str, position: int, arg: Any) -> None:
    """A positional argument holds arrays and numbers only (it is differentiated)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
        if not isinstance(leaf, _ARRAY_LEAVES):
            where = jax.tree_util.keystr(path)
            raise TypeError(
                f"grad rule {name}: positional argument {position}{where and ' at ' + where} "
                f"is {_kind(leaf)}; positional arguments are differentiated, so they hold "
                f"arrays and numbers. Pass settings and other values as keyword arguments "
                f"(they are not differentiated)."
            )


class _Residuals:
    """What the backward pass needs: the pullback's jaxpr (static) and the values it captured.

    A pytree whose leaves are the captured values, so `custom_vjp` carries them from the
    forward to the backward pass (through `jit`, `vmap` and outer differentiation) and the
    jaxpr rides in the static part of the tree.
    """

    def __init__(self, layout: _Layout, consts: Sequence[Any]) -> None:
        self.layout = layout
        self.consts = list(consts)

    def cotangents(self, g: Any) -> tuple[Any, ...]:
        """The cotangents of the positional arguments: the pullback's, None where zero."""
        layout = self.layout
        given = jaxpr_as_fun(ClosedJaxpr(layout.jaxpr, self.consts))(*jax.tree.leaves(g))
        leaves: list[Any] = [None] * layout.num_leaves
        for slot, value in zip(layout.slots, given, strict=True):
            leaves[slot] = value
        bounds = zip(layout.starts[:-1], layout.starts[1:], strict=True)
        return tuple(
            jax.tree.unflatten(tree, leaves[start:stop])
            for tree, (start, stop) in zip(layout.arg_trees, bounds, strict=True)
        )

    def tree_flatten(self) -> tuple[list[Any], _Layout]:
        return self.consts, self.layout

    @classmethod
    def tree_unflatten(cls, layout: _Layout, consts: Sequence[Any]) -> _Residuals:
        return cls(layout, consts)


jax.tree_util.register_pytree_node_class(_Residuals)


class _Layout:
    """The static part of `_Residuals`: the pullback's jaxpr, and where its outputs go.

    Compared by identity, as the jaxpr is.
    """

    def __init__(
        self,
        jaxpr: Jaxpr,
        arg_trees: list[Any],
        slots: list[int],
    ) -> None:
        self.jaxpr = jaxpr  # of the pullback: cotangent leaves of y -> nonzero ones of args
        self.arg_trees = arg_trees  # the structure of each positional argument
        self.starts = np.cumsum([0] + [t.num_leaves for t in arg_trees]).tolist()
        self.num_leaves = self.starts[-1]
        self.slots = slots  # the argument leaves the jaxpr's outputs are the cotangents of


def _trace_pullback(name: str, pullback: Pullback, y: Any, args: tuple[Any, ...]) -> _Residuals:
    """Traces ``pullback`` on y's cotangent type, checking what it returns; the residuals."""
    g_example = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(
            np.shape(leaf), primal_dtype_to_tangent_dtype(jax.typeof(leaf).dtype)
        ),
        y,
    )
    slots: list[int] = []
    integer = [
        f"y{jax.tree_util.keystr(path)} ({jax.typeof(leaf).str_short()})"
        for path, leaf in jax.tree_util.tree_flatten_with_path(y)[0]
        if primal_dtype_to_tangent_dtype(jax.typeof(leaf).dtype) == jax.dtypes.float0
    ]

    def checked_pullback(g: Any) -> list[Any]:
        try:
            given = pullback(g)
            cotangents = _check_cotangents(name, given, args)
        except TypeError as error:
            if integer and "float0" in str(error):
                raise _integer_output_error(name, integer) from error
            raise
        slots[:] = [slot for slot, _ in cotangents]
        return [value for _, value in cotangents]

    closed = jax.make_jaxpr(checked_pullback)(g_example)
    arg_trees = [jax.tree.structure(arg) for arg in args]
    layout = _Layout(closed.jaxpr, arg_trees, slots)
    return _Residuals(layout, closed.consts)


def _integer_output_error(name: str, integer: list[str]) -> TypeError:
    outputs = ", ".join(integer)
    return TypeError(
        f"grad rule {name} returns an integer or bool output, {outputs}: such an output has "
        f"no gradient, so the pullback receives its cotangent as JAX's float0 zeros, which "
        f"no arithmetic accepts. If the rule is meant to pass a gradient through that "
        f"output (a straight-through count or rounding), return it as a float "
        f"(`y.astype(jnp.float32)`); if its gradient is zero, return None for the "
        f"cotangents it would feed."
    )


def _check_cotangents(name: str, cotangents: Any, args: tuple[Any, ...]) -> list[tuple[int, Any]]:
    """The pullback's result, checked against the arguments: ``[(leaf index, cotangent)]``.

    Leaves whose cotangent is None (or float0 zeros, for an integer argument) are left out.
    """
    if not isinstance(cotangents, tuple | list):
        raise TypeError(
            f"the pullback of {name} returned {_kind(cotangents)}; it must return a tuple with "
            f"one cotangent per positional argument ({len(args)}): "
            f"`lambda g: ({', '.join(f'g_{i}' for i in range(len(args)))}"
            f"{',' if len(args) == 1 else ''})`."
        )
    if len(cotangents) != len(args):
        raise ValueError(
            f"the pullback of {name} returned {len(cotangents)} cotangent(s) for {len(args)} "
            f"positional argument(s); return one per positional argument, in order (None for "
            f"one that gets no gradient)."
        )
    found: list[tuple[int, Any]] = []
    offset = 0
    for position, (cotangent, arg) in enumerate(zip(cotangents, args, strict=True)):
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        if cotangent is not None:
            for index, value in enumerate(_match_structure(name, position, cotangent, arg)):
                if value is not None:
                    path, primal = leaves[index]
                    where = f"positional argument {position}" + (
                        f" at {jax.tree_util.keystr(path)}" if path else ""
                    )
                    value = _check_leaf(name, where, value, primal)
                    if value is not None:
                        found.append((offset + index, value))
        offset += len(leaves)
    return found


def _match_structure(name: str, position: int, cotangent: Any, arg: Any) -> list[Any]:
    """The cotangent's leaves, one per leaf of `arg`; a None stands for a whole subtree."""
    leaves: list[Any] = []

    def expand(value: Any, subtree: Any) -> None:
        if value is None:
            leaves.extend([None] * len(jax.tree.leaves(subtree)))
        elif jax.tree_util.treedef_is_leaf(jax.tree.structure(subtree)):
            leaves.append(value)
        else:
            raise ValueError("a leaf where the argument has a subtree")

    try:
        jax.tree.map(expand, cotangent, arg, is_leaf=lambda x: x is None)
    except (ValueError, TypeError):
        got = jax.tree.structure(cotangent, is_leaf=lambda x: x is None)
        raise ValueError(
            f"the pullback of {name} returned a cotangent of structure {got} for positional "
            f"argument {position}, which has structure {jax.tree.structure(arg)}; a cotangent "
            f"has its argument's structure (None stands for zeros, for a leaf or a subtree)."
        ) from None
    return leaves


def _check_leaf(name: str, where: str, value: Any, primal: Any) -> Any:
    """One cotangent leaf, checked against its primal leaf; None when it is float0 zeros."""
    if not isinstance(value, _ARRAY_LEAVES):
        raise TypeError(
            f"the pullback of {name} returned {_kind(value)} as the cotangent of {where}; "
            f"a cotangent is an array (or None for zeros)."
        )
    expected = jax.typeof(primal)
    got = jax.typeof(value)
    tangent_dtype = primal_dtype_to_tangent_dtype(expected.dtype)
    if tangent_dtype == jax.dtypes.float0:
        if got.dtype == jax.dtypes.float0 and got.shape == expected.shape:
            return None
        raise TypeError(
            f"the pullback of {name} returned a {got.str_short()} cotangent for {where}, which "
            f"is {expected.str_short()}: integer and bool arguments have no gradient; return "
            f"None for it (or, if it is a setting, pass it as a keyword argument)."
        )
    if got.shape != expected.shape:
        raise ValueError(
            f"the pullback of {name} returned a cotangent of shape {got.shape} for {where}, "
            f"which has shape {expected.shape}; a cotangent has its argument's shape."
        )
    if got.dtype != tangent_dtype:
        if not got.weak_type:
            raise TypeError(
                f"the pullback of {name} returned a {got.dtype} cotangent for {where}, which "
                f"is {tangent_dtype}; a cotangent has its argument's dtype (cast it: "
                f"`g.astype(x.dtype)`)."
            )
        value = jnp.asarray(value, tangent_dtype)  # a Python number: weakly typed
    return value


def _needs_jaxpr(inputs: Any) -> bool:
    """Whether only a jaxpr of the rule can tell the differentiated values it closes over.

    Elsewhere the values `fn` computes show it: a differentiated tracer among them that no
    input holds comes from a closed-over value. Not so where a `jax.jit` (or a scan's body)
    is being traced, which turns a closed-over tracer into one of its own constants, out of
    sight; nor where an input is differentiated (the rule differentiated at a higher order),
    as values of that differentiation then come from the inputs too.
    """
    if any(isinstance(trace, _jax_pe.DynamicJaxprTrace) for trace in _trace_chain()):
        return True
    return any(_is_differentiated(leaf) for leaf in jax.tree.leaves(inputs))


def _checked(name: str, run: Callable[..., Any], *inputs: Any) -> Any:
    """``run(*inputs)``, refusing a differentiated value that it closes over.

    The rule is traced to a jaxpr first, which turns every value it closes over into a
    constant (the forward pass and the pullback: `run` traces the pullback too); the jaxpr
    is then evaluated, so `fn` still runs once (on abstract values, as under `jax.jit`).
    """
    tree: list[Any] = []

    def flat(*inputs: Any) -> list[Any]:
        leaves, treedef = jax.tree.flatten(run(*inputs))
        tree.append(treedef)
        return leaves

    closed = jax.make_jaxpr(flat)(*inputs)
    if any(_is_differentiated(const) for const in closed.consts):
        raise _closure_error(name, "the rule (its forward pass or its pullback)")
    running = {id(trace) for trace in _trace_chain()}
    if any(
        isinstance(const, _jax_pe.DynamicJaxprTracer) and id(const._trace) not in running
        for const in closed.consts
    ):
        raise TypeError(
            f"grad rule {name} closes over a value traced by a jax.jit or a loop body "
            f"(jax.lax.scan, fori_loop...) around the call, and is differentiated from "
            f"outside that jit or loop: JAX traces the rule's forward pass there, where "
            f"that value no longer exists. Pass the value as a keyword argument of the "
            f"rule (`rule(x, scale=scale)`: it is not differentiated), or as a positional "
            f"argument if its gradient is wanted."
        )
    return jax.tree.unflatten(tree[0], jaxpr_as_fun(closed)(*jax.tree.leaves(inputs)))


def _is_differentiated(value: Any) -> bool:
    """Whether `value` is a tracer of a differentiation, or holds one (a vmap's tracer)."""
    for _ in range(1000):
        if not isinstance(value, jax.core.Tracer):
            return False
        if isinstance(value._trace, (_jax_ad.JVPTrace, _jax_ad.LinearizeTrace)):
            return True
        value = getattr(value, "val", None)  # a batching tracer holds its value
    return False


def _differentiating() -> bool:
    """Whether a differentiation (`jax.grad`, `jax.vjp`, `jax.jvp`...) is tracing here."""
    return any(
        isinstance(trace, (_jax_ad.JVPTrace, _jax_ad.LinearizeTrace)) for trace in _trace_chain()
    )


def _trace_chain() -> list[Any]:
    trace = _jax_core.trace_ctx.trace
    chain: list[Any] = []
    while trace is not None and len(chain) < 1000:
        chain.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return chain


def _closure_error(name: str, where: str) -> TypeError:
    return TypeError(
        f"grad rule {name}: {where} uses a value that is being differentiated (by jax.grad, "
        f"jax.vjp, jax.jvp... around the call) but is not one of its positional arguments: "
        f"the rule closes over it. A grad rule gives the gradient with respect to its "
        f"positional arguments only, so pass that value as a positional argument (and "
        f"return its cotangent from the pullback), or wrap it in jax.lax.stop_gradient "
        f"where the rule is called if it is a constant to the rule."
    )


def _kind(value: Any) -> str:
    """How a message names a value: an array by its type, anything else by its type and repr."""
    if isinstance(value, jax.Array | np.ndarray):
        return f"an array {jax.typeof(value).str_short()}"
    if isinstance(value, tuple | list | dict):  # what they hold may be tracers: not shown
        return type(value).__name__
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__
