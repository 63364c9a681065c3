"""Autodiff against finite differences: one order of derivatives, one mode, every checked array.

`DerivativeCheck` differentiates each checked array along two directions, by autodiff and by
Richardson-extrapolated central differences, and tells a wrong derivative from a point where
the model is not differentiable by its one-sided slopes. `Tolerance` holds the step and the
tolerances, defaulting per working dtype; `projected_gradient` turns a function into one
whose derivatives are its second derivatives.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.types import Shape
from .gradcheck_problem import Function, Problem, total

# Per working dtype: (eps, atol, rtol). The step is eps times the variable's scale (its rms
# value, at least 1); see `check_gradients` for how these were chosen.
DEFAULTS: dict[str, tuple[float, float, float]] = {
    "float64": (1e-5, 1e-8, 1e-5),
    "float32": (1e-3, 1e-3, 2e-3),
    "float16": (1e-2, 5e-2, 5e-2),
    "bfloat16": (3e-2, 2e-1, 1e-1),
}


class Tolerance(NamedTuple):
    """The step and tolerances, and the working dtype they were chosen for."""

    dtype: str
    eps: float
    atol: float
    rtol: float

    @classmethod
    def of(cls, xs: list, outputs: Any, given: dict[str, float | None]) -> Tolerance:
        """The working dtype's defaults, where `given` (eps, atol, rtol) holds None."""
        dtype = _working_dtype(xs, outputs)
        defaults = dict(zip(("eps", "atol", "rtol"), DEFAULTS[dtype], strict=True))
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
    if worst.name in DEFAULTS:
        return worst.name
    return "bfloat16" if jnp.finfo(worst).eps > jnp.finfo(jnp.float16).eps else "float16"


class DerivativeCheck:
    """One order of derivatives of `function`, in one mode, for each checked array.

    One compiled program serves the finite differences and the derivatives: for small models
    compiling dominates, and the derivative it computes on the side costs little.
    """

    def __init__(
        self,
        problem: Problem,
        function: Function,
        rngs: Any,
        mode: str,
        described: str,
        tolerance: Tolerance,
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

    def run(self, rng: np.random.Generator) -> list[Failure]:
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
                failures.append(Failure(leaf.name, line, kink=worst[0]))
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
        estimate = self._estimate(i, x, direction, gradient)
        if estimate.difference <= estimate.tolerance:
            return None
        return self._diagnose(estimate)

    def _estimate(
        self, i: int, x: np.ndarray, direction: np.ndarray, gradient: np.ndarray | None
    ) -> _Estimate:
        """The derivative of array `i` along `direction`, by finite differences and autodiff."""
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
        return _Estimate(autodiff, numerical, narrow, wide, step, scale, tolerance, difference)

    def _diagnose(self, estimate: _Estimate) -> tuple[bool, float, str]:
        """``(kink, how far off, message)`` for derivatives that disagree.

        The one-sided slopes tell a point where the model is not differentiable (they differ
        from each other, or agree with autodiff but not with the central difference) from a
        wrong derivative at a smooth point.
        """
        autodiff, numerical, narrow, wide, step, scale, tolerance, difference = estimate
        allowed = self.tolerance
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


class _Estimate(NamedTuple):
    """A derivative along one direction, by autodiff and by finite differences."""

    autodiff: float
    numerical: float  # Richardson's extrapolation (4 D(h) - D(2h)) / 3
    narrow: _Difference  # D(h)
    wide: _Difference  # D(2h)
    step: float  # h
    scale: float  # the loss's rounding scale, the larger of the evaluations'
    tolerance: float  # atol * scale + rtol * |numerical|
    difference: float  # |autodiff - numerical|


class Failure(NamedTuple):
    """An array whose derivative disagrees, and the line that says how."""

    name: str
    line: str
    kink: bool  # its one-sided slopes disagree: it looks non-differentiable here


def _directions(
    rng: np.random.Generator, shape: Shape, gradient: np.ndarray | None
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


def projected_gradient(
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
            projection = total(g * w for g, w in zip(grads, ws, strict=True))
        else:
            (_, scale), (projection, _) = jax.jvp(lambda xs: function(xs, rest, rngs), (xs,), (ws,))
        return projection, jax.lax.stop_gradient(jnp.maximum(scale, jnp.abs(projection)))

    return projected


def _replace(xs: list, i: int, x: Any) -> list:
    """`xs` with item `i` replaced by `x`."""
    return [*xs[:i], x, *xs[i + 1 :]]
