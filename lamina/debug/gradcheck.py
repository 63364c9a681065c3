"""`check_gradients`: a model's autodiff gradients against finite differences, per variable.

The method is `jax.test_util.check_grads`': derivatives along a direction, by autodiff and
by finite differences. It is applied to one variable (or input) at a time, so that a
disagreement names the variable whose gradient is wrong. `check_gradients`'s docstring says
where it differs from JAX's, and why.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import format_list
from .._core.layout import flatten_variables, nest
from .._core.module import Module

Selection = str | Sequence[str] | Mapping[str, Any] | None
"""Which variables `check_gradients` checks: collection name(s) or a boolean mask tree."""

# Per working dtype: (eps, atol, rtol). The step is eps times the variable's scale (its rms
# value, at least 1); see `check_gradients` for how these were chosen.
_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "float64": (1e-5, 1e-8, 1e-5),
    "float32": (1e-3, 1e-3, 2e-3),
    "float16": (1e-2, 5e-2, 5e-2),
    "bfloat16": (3e-2, 2e-1, 1e-1),
}
_MODES = ("fwd", "rev")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One checked array: its name in messages and where it sits among the arguments."""

    name: str
    value: jax.Array
    variable: tuple[str, ...] | None  # its flat key in the variables, or None for an input
    position: int  # its index among the leaves of the inputs (inputs only)


def check_gradients(
    apply: Callable[..., Any],
    variables: Mapping[str, Any],
    rngs: Any,
    *args: Any,
    wrt: Selection = "params",
    inputs: bool | Sequence[int] = True,
    loss: Callable[[Any], Any] | None = None,
    order: int = 1,
    modes: str | Sequence[str] = ("rev",),
    eps: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[str, ...]:
    """Checks `apply`'s gradients against finite differences, variable by variable.

    The loss is ``loss(outputs)`` of ``apply(variables, rngs, *args, **kwargs)``: by default a
    fixed random projection of every floating-point output to a scalar, so that every output
    element counts. Each checked array `x` (each selected variable, each float input) is
    checked on its own, the others held fixed, so that a failure names it: its derivative
    along a direction `v`, by autodiff (``<grad, v>``, or a JVP in forward mode) against
    finite differences. That is the method of `jax.test_util.check_grads`, with three
    changes: the finite difference is Richardson's extrapolation ``(4 D(h) - D(2h)) / 3`` of
    central differences ``D(h) = (L(x + h v) - L(x - h v)) / 2h`` (error of order h**4, not
    h**2: in float32 the step cannot shrink far below 1e-3 before rounding takes over); the
    derivative compared is the one along the step actually taken after rounding to `x`'s
    dtype; and there are two directions per array. In reverse mode they are the autodiff
    gradient itself, where a wrong scale or sign shows most, and a random direction
    orthogonal to it, where a part the gradient misses shows; in forward mode, two random
    directions. The step is ``h = eps * max(1, rms(x))`` times a direction of unit rms.

    The model runs exactly as `apply` runs it, in its own dtypes (nothing is cast to float64:
    a model declared in float32 computes in float32 whatever it is given). A derivative
    passes when ``|autodiff - numerical| <= atol * scale + rtol * |numerical|``, where
    `scale` is the size of the loss's rounding error: the sum of the magnitudes of the terms
    the default loss adds (``max(1, |L|)`` for a loss of one's own), since rounding is
    relative to those terms, not to the derivative. `eps`, `atol` and `rtol` default per
    working dtype, the least precise float dtype among the checked arrays and the outputs:

    ========  ======  ======  ======
    dtype     eps     atol    rtol
    ========  ======  ======  ======
    float64   1e-5    1e-8    1e-5
    float32   1e-3    1e-3    2e-3
    float16   1e-2    5e-2    5e-2
    bfloat16  3e-2    2e-1    1e-1
    ========  ======  ======  ======

    In float32 every layer of lamina's layer table passes them with a margin of six or more,
    in reverse and forward mode and at second order, over several seeds. They catch
    a wrong gradient, not one wrong in the fourth digit: for a tight check build the model
    with ``dtype=jnp.float64`` inside ``with jax.enable_x64(True):`` and call
    `check_gradients` there. In 16-bit dtypes only gross errors (a missing term, a wrong
    sign) show. A model that computes in a lower precision than its arrays and outputs show
    needs looser tolerances passed. At a point where the model is not differentiable (a relu
    at 0, a `jnp.where` switch, tied maxima), or within a step of one, finite differences
    mean nothing. When a derivative disagrees, the one-sided differences ``(4 L(x + h v) -
    L(x + 2h v) - 3 L(x)) / 2h`` and its mirror, from the evaluations already made, tell
    which: if they differ by more than autodiff differs from the central difference (and the
    tolerance), or agree with autodiff but not with the central difference (a derivative of
    the model jumps there), the array is reported as at a non-differentiable point, with
    both slopes, not as a wrong derivative: check elsewhere, perturb the inputs, or leave it
    out with `wrt`/`inputs`.

    Skipped: integer, boolean and complex variables and inputs, and Python scalars among the
    inputs (held fixed, as are the keyword arguments). Mutable collections (``batch_stats``)
    are passed in and their new values ignored; `rngs` is the same on every evaluation, so
    dropout masks are fixed. A keyword argument of the model whose name is one of this
    function's own (`loss`, `order`...) must be bound first: ``functools.partial(apply,
    order=2)``.

    Args:
        apply: A transformed model's ``apply(variables, rngs, *args, **kwargs)``.
        variables: The variables to check the gradients at.
        rngs: The random keys of the call (None, a key, a dict or `lm.PRNGKeys`).
        *args: The model's positional inputs (arrays or pytrees of arrays).
        wrt: Which variables to check: a collection name (default ``"params"``), a sequence
            of them, a tree of booleans in the variables' layout (or a prefix of it) such as
            ``lm.mask(model, variables, filter)`` returns, or None for none.
        inputs: Which inputs to check: True (every float array among them), False (none),
            or the positions of the arguments to check.
        loss: ``loss(outputs) -> float scalar``; default, a fixed random projection of
            every float output.
        order: Check derivatives up to this order: 2 checks second derivatives too, as the
            derivatives of ``<grad L, w>`` for a fixed random `w`.
        modes: ``"rev"`` (`jax.grad`; reverse over reverse at order 2), ``"fwd"``
            (`jax.jvp`), or both.
        eps: The relative finite-difference step (default per working dtype, above).
        atol: Absolute tolerance, in units of the loss's rounding scale (default above).
        rtol: Relative tolerance (default above).
        seed: Seeds the random directions and the default projection.
        **kwargs: Keyword arguments of the model's call.

    Returns:
        The names of the arrays checked, variables first (``params/layer1/kernel``), then
        inputs (``inputs[0]``; ``inputs[1]['mask']`` for a leaf of a pytree input).

    Raises:
        AssertionError: A derivative disagrees with finite differences; the message names
            every array that disagrees, with both values, the tolerance and its parts, and
            apart from them every array whose point looks non-differentiable, with its
            one-sided slopes.
        ValueError: A collection that `variables` lacks, a mask naming paths it lacks, an
            input position out of range, nothing to check, outputs without a float array
            (pass `loss`), or a bad `order`, `modes`, `eps`, `atol` or `rtol`.
        TypeError: `apply` is not a function (a module: transform it first), an argument of
            the wrong type, or a loss that does not return a float scalar.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> model = lm.Sequential(lm.Dense(3, 4), lm.tanh, lm.Dense(4, 2))
        >>> init, apply = lm.transform(model)
        >>> variables = init(jax.random.key(0))
        >>> lm.check_gradients(apply, variables, None, jnp.ones((5, 3)))
        ('params/layers_0/bias', 'params/layers_0/kernel', 'params/layers_2/bias',
         'params/layers_2/kernel', 'inputs[0]')

        A derivative rule that is wrong (``3 x`` for the derivative of ``x**2``) is named by
        every array it sees:

        >>> @jax.custom_jvp
        ... def square(x):
        ...     return x * x
        >>> @square.defjvp
        ... def square_jvp(primals, tangents):
        ...     (x,), (t,) = primals, tangents
        ...     return x * x, 3 * x * t
        >>> init, apply = lm.transform(lm.Sequential(lm.Dense(3, 2), square))
        >>> lm.check_gradients(apply, init(jax.random.key(0)), None, jnp.ones((5, 3)))
        Traceback (most recent call last):
        ...
        AssertionError: lm.check_gradients: autodiff disagrees with finite differences for
        params/layers_0/bias, params/layers_0/kernel, inputs[0]:
          params/layers_0/bias: along the autodiff gradient the derivative is ...
    """
    what = "lm.check_gradients"
    if isinstance(apply, Module) or not callable(apply):
        raise TypeError(
            f"{what} checks a transformed model's apply function; got {type(apply).__name__}. "
            f"Pass lm.transform(model).apply."
        )
    flat = flatten_variables(variables, f"{what}'s variables")
    modes = _check_modes(modes)
    order = _check_order(order)
    seed = _check_seed(seed)
    given = {"eps": eps, "atol": atol, "rtol": rtol}
    for name, value in given.items():
        if value is not None:
            _check_tolerance(name, value, positive=name == "eps")
    problem = _Problem(apply, flat, _selected(flat, wrt), args, inputs, kwargs)
    outputs = jax.eval_shape(problem.outputs, problem.xs, problem.rest, rngs)
    problem.loss = _default_loss(outputs, seed) if loss is None else _user_loss(loss)
    tolerance = _Tolerance.of(problem.xs, outputs, given)
    failures: list[_Failure] = []
    for mode in modes:
        rng = np.random.default_rng(seed)
        function: Function = problem.evaluate
        described = ""
        for level in range(1, order + 1):
            check = _Check(problem, function, rngs, mode, described, tolerance)
            failures += check.run(rng)
            if level < order:
                function = _projected_gradient(function, problem.xs, mode, rng)
                described += f" (order {level + 1}: the derivative of <grad, w>)"
    if failures:
        raise AssertionError(_report(failures))
    return tuple(leaf.name for leaf in problem.leaves)


def _report(failures: list[_Failure]) -> str:
    """The message: wrong derivatives first, then the arrays at a non-differentiable point."""
    kinks = dict.fromkeys(f.name for f in failures if f.kink)
    # An array is at a kink if any check of it (any mode, any order) says so.
    wrong = dict.fromkeys(f.name for f in failures if f.name not in kinks)
    parts = []
    if wrong:
        parts.append(
            f"lm.check_gradients: autodiff disagrees with finite differences for "
            f"{', '.join(wrong)}:\n  "
            + "\n  ".join(f.line for f in failures if f.name in wrong)
            + "\nA derivative passes when |autodiff - numerical| <= atol * scale + rtol * "
            "|numerical|, scale being the size of the loss's rounding error; eps, atol and rtol "
            "default per working dtype (the least precise of the checked arrays' and the "
            "outputs'). The one-sided differences agree with each other there, so the model "
            "looks differentiable and its derivative rule wrong; if the rule is right, rounding "
            "may dominate: check in float64 (a model built with dtype=jnp.float64 inside "
            "jax.enable_x64(True)), or try another eps or seed."
        )
    if kinks:
        listed = ", ".join(kinks)
        parts.append(
            f"lm.check_gradients: the model looks non-differentiable at this point for "
            f"{listed} (a relu or abs at 0, a jnp.where switch, tied maxima within a step of "
            f"the point), or its derivative does: the one-sided finite differences disagree "
            f"with each other or with the central one, so finite differences cannot check "
            f"autodiff there:\n  "
            + "\n  ".join(f.line for f in failures if f.kink)
            + "\nCheck at another point (other inputs or variables), perturb the inputs "
            "(e.g. add small noise to exact zeros or ties), or leave these arrays out: wrt= "
            "for variables (lm.mask(model, variables, filter)), inputs= for inputs."
        )
    return "\n".join(parts)


Function = Callable[[list, list, Any], tuple[jax.Array, jax.Array]]
"""``f(xs, rest, rngs) -> (value, scale)``: a scalar of the checked arrays `xs` and its
rounding scale; `rest` holds the arrays held fixed."""


class _Problem:
    """The model's call as a function of the checked arrays, the rest held fixed."""

    def __init__(
        self,
        apply: Callable[..., Any],
        flat: dict[tuple[str, ...], Any],
        chosen: set[tuple[str, ...]],
        args: tuple,
        inputs: bool | Sequence[int],
        kwargs: dict[str, Any],
    ):
        self.apply, self.kwargs = apply, kwargs
        self.keys = sorted(flat)
        arg_leaves, self.arg_def = jax.tree_util.tree_flatten_with_path(args)
        positions = _positions(inputs, len(args))
        self.leaves: list[_Leaf] = []
        for key in self.keys:
            if key in chosen and _is_float_array(flat[key], python_scalars=True):
                self.leaves.append(_Leaf("/".join(key), jnp.asarray(flat[key]), key, -1))
        for j, (path, leaf) in enumerate(arg_leaves):
            position = path[0].idx
            if position in positions and _is_float_array(leaf, python_scalars=False):
                name = f"inputs[{position}]{jax.tree_util.keystr(path[1:])}"
                self.leaves.append(_Leaf(name, jnp.asarray(leaf), None, j))
        if not self.leaves:
            raise ValueError(_nothing_to_check(flat, chosen, args, positions))
        checked_vars = {leaf.variable for leaf in self.leaves}
        checked_args = {leaf.position for leaf in self.leaves if leaf.variable is None}
        self.fixed_keys = [key for key in self.keys if key not in checked_vars]
        self.arg_values = [leaf for _, leaf in arg_leaves]
        # Arrays held fixed travel as arguments (not as constants baked into the program);
        # other leaves of the inputs (Python numbers, strings) stay as they are.
        self.rest_args = [
            j
            for j, leaf in enumerate(self.arg_values)
            if j not in checked_args and isinstance(leaf, _ARRAYS)
        ]
        self.xs = [leaf.value for leaf in self.leaves]
        self.rest = [flat[key] for key in self.fixed_keys] + [
            self.arg_values[j] for j in self.rest_args
        ]
        self.loss: Callable[[Any], tuple[jax.Array, jax.Array]] | None = None

    def outputs(self, xs: list, rest: list, rngs: Any) -> Any:
        """The model's outputs, given the checked arrays `xs` and the fixed ones `rest`."""
        values = dict(zip(self.fixed_keys, rest[: len(self.fixed_keys)], strict=True))
        arg_values = list(self.arg_values)
        for j, x in zip(self.rest_args, rest[len(self.fixed_keys) :], strict=True):
            arg_values[j] = x
        for leaf, x in zip(self.leaves, xs, strict=True):
            if leaf.variable is None:
                arg_values[leaf.position] = x
            else:
                values[leaf.variable] = x
        call_args = jax.tree.unflatten(self.arg_def, arg_values)
        outputs, _ = self.apply(nest(values.items()), rngs, *call_args, **self.kwargs)
        return outputs

    def evaluate(self, xs: list, rest: list, rngs: Any) -> tuple[jax.Array, jax.Array]:
        """The loss and its rounding scale."""
        assert self.loss is not None
        return self.loss(self.outputs(xs, rest, rngs))


_ARRAYS = (jax.Array, np.ndarray, np.generic)


def _is_float_array(leaf: Any, python_scalars: bool) -> bool:
    if isinstance(leaf, _ARRAYS):
        return bool(jnp.issubdtype(leaf.dtype, jnp.floating))
    return python_scalars and isinstance(leaf, float)


class _Check:
    """One order of derivatives of `function`, in one mode, for each checked array.

    One compiled program serves the finite differences and the derivatives: for small models
    compiling dominates, and the derivative it computes on the side costs little.
    """

    def __init__(
        self,
        problem: _Problem,
        function: Function,
        rngs: Any,
        mode: str,
        described: str,
        tolerance: _Tolerance,
    ):
        self.problem, self.rngs, self.mode, self.described = problem, rngs, mode, described
        self.tolerance = tolerance
        if mode == "rev":
            self.program = jax.jit(jax.value_and_grad(function, has_aux=True))
        else:
            self.program = jax.jit(
                lambda xs, ts, rest, rngs: jax.jvp(
                    lambda xs: function(xs, rest, rngs), (xs,), (ts,)
                )
            )
            self.zeros = [jnp.zeros_like(x) for x in problem.xs]

    def evaluate(self, xs: list, tangents: list | None = None) -> tuple[float, float, Any]:
        """``(value, scale, derivative)``: the gradient (rev), or along `tangents` (fwd)."""
        rest, rngs = self.problem.rest, self.rngs
        if self.mode == "rev":
            (value, scale), grads = self.program(xs, rest, rngs)
            return float(value), float(scale), grads
        (value, scale), (derivative, _) = self.program(
            xs, self.zeros if tangents is None else tangents, rest, rngs
        )
        return float(value), float(scale), derivative

    def run(self, rng: np.random.Generator) -> list[_Failure]:
        """The failures: one for each array whose derivative disagrees.

        An array is reported as not differentiable here when along any direction its
        one-sided slopes disagree (`_compare`): finite differences then mean nothing there,
        along the other direction too.
        """
        xs = self.problem.xs
        self.value: float | None = None  # the loss at xs: the one-sided differences' centre
        if self.mode == "rev":
            self.value, _, grads = self.evaluate(xs)
            grads = [np.asarray(g, np.float64) for g in grads]
        failures = []
        for i, leaf in enumerate(self.problem.leaves):
            x = np.asarray(xs[i])
            gradient = grads[i] if self.mode == "rev" else None
            worst: tuple[bool, float, str] | None = None
            for direction, along in _directions(rng, x.shape, gradient):
                result = self._compare(i, x, direction, gradient)
                if result is not None:
                    found = (result[0], result[1], f"along {along} {result[2]}")
                    if worst is None or found[:2] > worst[:2]:
                        worst = found
            if worst is not None:
                line = f"{leaf.name}{self.described}: {worst[2]}"
                failures.append(_Failure(leaf.name, line, kink=worst[0]))
        return failures

    def _compare(
        self, i: int, x: np.ndarray, direction: np.ndarray, gradient: np.ndarray | None
    ) -> tuple[bool, float, str] | None:
        """None if the derivatives along `direction` agree, else (kink, how far off, message).

        `gradient` is the autodiff gradient of array `i` (rev); fwd computes a JVP instead.
        When they disagree, the one-sided slopes tell a point where the loss is not
        differentiable along `direction` (`kink`: they differ) from a wrong derivative at a
        smooth point (they agree with each other and with the central difference); they reuse
        the evaluations made, so a passing check costs nothing more.
        """
        xs = self.problem.xs
        rms = math.sqrt(float(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0
        allowed = self.tolerance
        step = allowed.eps * max(1.0, rms)
        # Richardson extrapolation: (4 D(h) - D(2h)) / 3 cancels the h**2 error of D(h)
        narrow = self._central_difference(i, x, direction, step)
        wide = self._central_difference(i, x, direction, 2 * step)
        numerical = (4 * narrow.slope - wide.slope) / 3
        taken = (4 * narrow.taken - wide.taken) / 3
        scale = max(narrow.scale, wide.scale)
        if gradient is not None:
            autodiff = float(np.sum(gradient * taken))
        else:
            tangent = jnp.asarray(taken, x.dtype)
            self.value, _, derivative = self.evaluate(xs, _replace(self.zeros, i, tangent))
            autodiff = float(derivative)
        tolerance = allowed.atol * scale + allowed.rtol * abs(numerical)
        difference = abs(autodiff - numerical)
        if difference <= tolerance:
            return None
        off = (
            math.inf if tolerance == 0 or not math.isfinite(difference) else difference / tolerance
        )
        assert self.value is not None
        # One-sided differences from L(x), Richardson-extrapolated: (4 L(x + h v) - L(x + 2h v)
        # - 3 L(x)) / 2h and its mirror. Both are f' + O(h**2) with the same h**2 term, so at a
        # smooth point they differ by O(h**3) and rounding; across a kink they differ by its
        # jump. A wrong derivative at a smooth point leaves them together, |above - below|
        # below the disagreement |autodiff - numerical|; a kink that autodiff resolves to one
        # side puts them twice that apart, and a jump (a switch) further still.
        centre = self.value
        above = (4 * narrow.upper - wide.upper - 3 * centre) / (2 * step)
        below = (3 * centre - 4 * narrow.lower + wide.lower) / (2 * step)
        gap = abs(above - below)
        # The gap's own rounding error: the six evaluations' weights add up to 8 / h.
        rounding = 8 * float(jnp.finfo(allowed.dtype).eps) * scale / step
        limit = max(tolerance, difference, rounding)
        slopes = (
            f"the slope is {above:.6g} from above (x + h v) and {below:.6g} from below "
            f"(x - h v) by one-sided finite differences"
        )
        steps = f"(step h {step:.3g}, eps {allowed.eps:g})"
        if not gap <= limit:  # NaN included: nothing is smooth there
            apart = gap / limit if math.isfinite(gap) else math.inf
            message = (
                f"{slopes}; they differ by {gap:.3g}, more than autodiff ({self.mode}: "
                f"{autodiff:.6g}) differs from the central difference ({numerical:.6g}) {steps}"
            )
            return True, apart, message
        # The slopes agree, and autodiff with them, but not the central difference: its error
        # is of order h (not h**4), a derivative of the model jumps within 2h of the point.
        mean = (above + below) / 2
        if abs(numerical - mean) > max(abs(autodiff - mean), rounding / 2):
            message = (
                f"{slopes}, as by autodiff ({self.mode}: {autodiff:.6g}), but {numerical:.6g} "
                f"by central differences: the model's derivative looks non-differentiable "
                f"here {steps}"
            )
            return True, off, message
        message = (
            f"the derivative is {autodiff:.6g} by autodiff ({self.mode}) and {numerical:.6g} by "
            f"finite differences; difference {difference:.3g} > tolerance {tolerance:.3g} "
            f"({allowed.dtype}: atol {allowed.atol:g} x scale {scale:.3g} + rtol "
            f"{allowed.rtol:g} x |numerical|; eps {allowed.eps:g})"
        )
        return False, off, message

    def _central_difference(
        self, i: int, x: np.ndarray, direction: np.ndarray, step: float
    ) -> _Difference:
        """The central difference with step `step`, and what went into it.

        The step taken is ``x + h v`` minus ``x - h v`` after rounding to x's dtype: the
        derivative is compared along it, not along the `v` asked for.
        """
        xs = self.problem.xs
        plus = np.asarray(x + step * direction, x.dtype)
        minus = np.asarray(x - step * direction, x.dtype)
        taken = (plus.astype(np.float64) - minus.astype(np.float64)) / (2 * step)
        upper, upper_scale, _ = self.evaluate(_replace(xs, i, jnp.asarray(plus)))
        lower, lower_scale, _ = self.evaluate(_replace(xs, i, jnp.asarray(minus)))
        slope = (upper - lower) / (2 * step)
        return _Difference(slope, taken, max(upper_scale, lower_scale), upper, lower)


class _Difference(NamedTuple):
    """A central difference ``(L(x + h v) - L(x - h v)) / 2h`` and its parts."""

    slope: float
    taken: np.ndarray  # the step taken (after rounding to x's dtype) over 2h
    scale: float  # the loss's rounding scale, the larger of the two evaluations'
    upper: float  # L(x + h v)
    lower: float  # L(x - h v)


class _Failure(NamedTuple):
    """An array whose derivative disagrees, and the line that says how."""

    name: str
    line: str
    kink: bool  # its one-sided slopes disagree: it looks non-differentiable here


def _directions(
    rng: np.random.Generator, shape: tuple[int, ...], gradient: np.ndarray | None
) -> list[tuple[np.ndarray, str]]:
    """Two directions to differentiate along, with how messages describe them.

    With the autodiff gradient `g` at hand (rev): `g` itself (scaled to a random vector's
    norm), where a wrong scale or sign of `g` shows most, and a random direction orthogonal
    to `g`, where a part `g` misses shows. Otherwise two random directions.
    """
    random = rng.standard_normal(shape)
    other = rng.standard_normal(shape)
    norm = float(np.linalg.norm(gradient)) if gradient is not None else 0.0
    if gradient is None or norm == 0 or not math.isfinite(norm):
        return [(random, "a random direction"), (other, "another random direction")]
    unit = gradient / norm
    directions = [(unit * float(np.linalg.norm(random)), "the autodiff gradient")]
    orthogonal = random - np.sum(random * unit) * unit
    if np.linalg.norm(orthogonal) > 1e-6 * np.linalg.norm(random):
        directions.append((orthogonal, "a random direction orthogonal to it"))
    return directions


def _projected_gradient(
    function: Function, xs: list, mode: str, rng: np.random.Generator
) -> Function:
    """``<grad function, w>`` for a fixed random `w`: its derivatives are second derivatives."""
    ws = [
        jnp.asarray(rng.standard_normal(np.shape(x)) / math.sqrt(max(1, np.size(x))), x.dtype)
        for x in xs
    ]

    def projected(xs: list, rest: list, rngs: Any) -> tuple[jax.Array, jax.Array]:
        if mode == "rev":
            grads, scale = jax.grad(lambda xs: function(xs, rest, rngs), has_aux=True)(xs)
            total = _total(g * w for g, w in zip(grads, ws, strict=True))
        else:
            (_, scale), (total, _) = jax.jvp(lambda xs: function(xs, rest, rngs), (xs,), (ws,))
        return total, jax.lax.stop_gradient(jnp.maximum(scale, jnp.abs(total)))

    return projected


def _total(arrays: Iterable[jax.Array]) -> jax.Array:
    """The sum of every element of every array."""
    return jnp.sum(jnp.stack([jnp.sum(a) for a in arrays]))


def _replace(xs: list, i: int, x: Any) -> list:
    return [*xs[:i], x, *xs[i + 1 :]]


def _default_loss(outputs: Any, seed: int) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    """``sum(w * y)`` over the float outputs `y` (fixed normal `w`), and its scale ``sum|w y|``."""
    shapes = jax.tree.leaves(outputs)
    floats = [i for i, s in enumerate(shapes) if jnp.issubdtype(s.dtype, jnp.floating)]
    if not floats:
        described = ", ".join(f"{s.dtype}{list(s.shape)}" for s in shapes) or "no arrays"
        raise ValueError(
            f"lm.check_gradients: the model's outputs hold no floating-point array "
            f"({described}), so the default loss (a random projection of the float outputs) "
            f"has nothing to project. Pass loss=, a function of the outputs returning a float "
            f"scalar."
        )
    rng = np.random.default_rng(seed)
    size = sum(int(np.prod(shapes[i].shape)) for i in floats)
    weights = {i: rng.standard_normal(shapes[i].shape) / math.sqrt(max(1, size)) for i in floats}

    def loss(outputs: Any) -> tuple[jax.Array, jax.Array]:
        terms = []
        for i, y in enumerate(jax.tree.leaves(outputs)):
            if i in weights:
                if jnp.finfo(y.dtype).bits < 32:  # sum 16-bit outputs in float32
                    y = y.astype(jnp.float32)
                terms.append(y * jnp.asarray(weights[i], y.dtype))
        return _total(terms), jax.lax.stop_gradient(_total(jnp.abs(t) for t in terms))

    return loss


def _user_loss(loss: Callable[[Any], Any]) -> Callable[[Any], tuple[jax.Array, jax.Array]]:
    if not callable(loss):
        raise TypeError(
            f"lm.check_gradients: loss must be a function of the model's outputs returning a "
            f"float scalar; got {type(loss).__name__} {loss!r:.60}."
        )

    def scalar_loss(outputs: Any) -> tuple[jax.Array, jax.Array]:
        value = loss(outputs)
        shape, dtype = jnp.shape(value), jnp.result_type(value)
        if shape != () or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"lm.check_gradients: loss must return a float scalar; it returned "
                f"{type(value).__name__} of shape {shape} and dtype {dtype}. Reduce it, e.g. "
                f"jnp.sum(...), and cast integer results to float."
            )
        value = jnp.asarray(value)
        return value, jax.lax.stop_gradient(jnp.maximum(1.0, jnp.abs(value)))

    return scalar_loss


class _Tolerance(NamedTuple):
    """The step and tolerances, and the working dtype they were chosen for."""

    dtype: str
    eps: float
    atol: float
    rtol: float

    @classmethod
    def of(cls, xs: list, outputs: Any, given: dict[str, float | None]) -> _Tolerance:
        """The working dtype's defaults, where `given` (eps, atol, rtol) holds None."""
        dtype = _working_dtype(xs, outputs)
        defaults = dict(zip(("eps", "atol", "rtol"), _DEFAULTS[dtype], strict=True))
        chosen = {k: defaults[k] if (v := given[k]) is None else float(v) for k in defaults}
        return cls(dtype, **chosen)


def _working_dtype(xs: list, outputs: Any) -> str:
    """The least precise float dtype among the checked arrays and the float outputs."""
    dtypes = [jnp.dtype(x.dtype) for x in xs]
    dtypes += [
        jnp.dtype(o.dtype)
        for o in jax.tree.leaves(outputs)
        if jnp.issubdtype(o.dtype, jnp.floating)
    ]
    worst = max(dtypes, key=lambda d: float(jnp.finfo(d).eps))
    if worst.name in _DEFAULTS:
        return worst.name
    return "bfloat16" if jnp.finfo(worst).eps > jnp.finfo(jnp.float16).eps else "float16"


def _selected(flat: dict[tuple[str, ...], Any], wrt: Selection) -> set[tuple[str, ...]]:
    """The keys of the variables `wrt` selects (float or not)."""
    if wrt is None:
        return set()
    if isinstance(wrt, Mapping):
        return _masked(flat, wrt)
    names = [wrt] if isinstance(wrt, str) else wrt
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"lm.check_gradients: wrt is a collection name ('params'), a sequence of them, a "
            f"tree of booleans (lm.mask(model, variables, filter)) or None; got {wrt!r:.80}."
        )
    collections = sorted({key[0] for key in flat})
    missing = [name for name in names if name not in collections]
    if missing and flat:
        close = [c for name in missing for c in difflib.get_close_matches(name, collections, n=1)]
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"lm.check_gradients: wrt names {format_list(map(repr, missing))}, which the "
            f"variables do not hold; they hold {', '.join(map(repr, collections))}.{hint}"
        )
    return {key for key in flat if key[0] in names}


def _masked(flat: dict[tuple[str, ...], Any], mask: Mapping[str, Any]) -> set[tuple[str, ...]]:
    """The keys a boolean mask selects; a mask leaf may stand for a whole group."""
    flags = flatten_variables(mask, "lm.check_gradients's wrt mask")
    chosen = set()
    for prefix, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)) and not (
            isinstance(flag, _ARRAYS) and flag.shape == () and flag.dtype == bool
        ):
            raise TypeError(
                f"lm.check_gradients: the wrt mask holds {type(flag).__name__} {flag!r:.40} at "
                f"{'/'.join(prefix)}; a mask holds booleans (lm.mask(model, variables, filter))."
            )
        below = [key for key in flat if key[: len(prefix)] == prefix]
        if not below:
            raise ValueError(
                f"lm.check_gradients: the wrt mask names {'/'.join(prefix)}, which the "
                f"variables do not hold. Build the mask from the same variables: "
                f"lm.mask(model, variables, filter)."
            )
        if flag:
            chosen.update(below)
    return chosen


def _positions(inputs: bool | Sequence[int], count: int) -> set[int]:
    """The positions of the arguments whose float arrays are checked."""
    if isinstance(inputs, bool):
        return set(range(count)) if inputs else set()
    if not isinstance(inputs, Sequence) or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in inputs
    ):
        raise TypeError(
            f"lm.check_gradients: inputs is True (every float input), False (none) or the "
            f"positions of the inputs to check, such as (0,); got {inputs!r:.60}."
        )
    wrong = [int(i) for i in inputs if not -count <= i < count]
    if wrong:
        raise ValueError(
            f"lm.check_gradients: inputs names position(s) {format_list(map(str, wrong))}, but "
            f"the model was given {count} positional input(s)."
        )
    return {int(i) % count for i in inputs}


def _nothing_to_check(
    flat: dict[tuple[str, ...], Any],
    chosen: set[tuple[str, ...]],
    args: tuple,
    positions: set[int],
) -> str:
    chosen_floats = [k for k in chosen if _is_float_array(flat[k], python_scalars=True)]
    described = (
        "no variables"
        if not flat
        else f"{len(chosen)} selected variable(s), none of them float"
        if chosen and not chosen_floats
        else "no variable selected by wrt"
    )
    given = (
        "no inputs" if not args else f"{len(args)} input(s), {len(positions)} selected by inputs"
    )
    return (
        f"lm.check_gradients: nothing to check: {described}, and no float array among the "
        f"inputs checked ({given}; integer inputs such as token ids are never checked). Select "
        f"float variables with wrt= (collections: "
        f"{', '.join(sorted({k[0] for k in flat})) or 'none'}) or float inputs with inputs=."
    )


def _check_modes(modes: str | Sequence[str]) -> tuple[str, ...]:
    given = (modes,) if isinstance(modes, str) else modes
    if (
        not isinstance(given, Sequence)
        or not given
        or not all(isinstance(m, str) and m in _MODES for m in given)
    ):
        raise ValueError(
            f"lm.check_gradients: modes is 'rev' (jax.grad), 'fwd' (jax.jvp) or both, "
            f"('fwd', 'rev'); got {modes!r}."
        )
    return tuple(dict.fromkeys(given))


def _check_order(order: int) -> int:
    if not isinstance(order, numbers.Integral) or isinstance(order, bool) or order < 1:
        raise ValueError(
            f"lm.check_gradients: order is the highest order of derivatives to check, an int "
            f">= 1 (1: gradients, 2: second derivatives too); got {order!r}."
        )
    return int(order)


def _check_seed(seed: int) -> int:
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise TypeError(f"lm.check_gradients: seed is an int >= 0; got {seed!r}.")
    return int(seed)


def _check_tolerance(name: str, value: float, positive: bool) -> None:
    bound = "> 0" if positive else ">= 0"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"lm.check_gradients: {name} is a number {bound}; got {value!r:.40}.")
    if not (value > 0 if positive else value >= 0) or not math.isfinite(value):
        raise ValueError(
            f"lm.check_gradients: {name} must be a finite number {bound}; got {value!r}."
        )
