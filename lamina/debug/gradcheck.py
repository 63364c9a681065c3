"""`check_gradients`: a model's autodiff gradients against finite differences, per variable.

The method is `jax.test_util.check_grads`': derivatives along a direction, by autodiff and
by finite differences. It is applied to one variable (or input) at a time, so that a
disagreement names the variable whose gradient is wrong. `check_gradients`'s docstring says
where it differs from JAX's, and why.

The arrays checked and the loss are built in `gradcheck_problem.py`; the directions, steps,
tolerances and the comparison in `finite_differences.py`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._core.layout import flatten_variables
from .._core.module import Module
from .._core.types import Variables
from .finite_differences import DerivativeCheck, Failure, Tolerance, projected_gradient
from .gradcheck_problem import Function, Problem, Selection, default_loss, selected_keys, user_loss

_MODES = ("fwd", "rev")


def check_gradients(
    apply: Callable[..., Any],
    variables: Variables,
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
    problem = Problem(apply, flat, selected_keys(flat, wrt), args, inputs, kwargs)
    outputs = jax.eval_shape(problem.outputs, problem.xs, problem.rest, rngs)
    problem.loss = default_loss(outputs, seed) if loss is None else user_loss(loss)
    tolerance = Tolerance.of(problem.xs, outputs, given)
    failures = _check_every_order(problem, rngs, modes, order, seed, tolerance)
    if failures:
        raise AssertionError(_report(failures))
    return tuple(leaf.name for leaf in problem.leaves)


def _check_every_order(
    problem: Problem,
    rngs: Any,
    modes: tuple[str, ...],
    order: int,
    seed: int,
    tolerance: Tolerance,
) -> list[Failure]:
    """The failures of every mode, at every order up to `order`, in that order."""
    failures: list[Failure] = []
    for mode in modes:
        rng = np.random.default_rng(seed)
        function: Function = problem.evaluate
        described = ""
        for level in range(1, order + 1):
            check = DerivativeCheck(problem, function, rngs, mode, described, tolerance)
            failures += check.run(rng)
            if level < order:
                function = projected_gradient(function, problem.xs, mode, rng)
                described += f" (order {level + 1}: the derivative of <grad, w>)"
    return failures


def _report(failures: list[Failure]) -> str:
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


def _check_modes(modes: str | Sequence[str]) -> tuple[str, ...]:
    """`modes` as a tuple without repeats; anything but 'rev' and 'fwd' is an error."""
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
    """`order`, checked to be an int >= 1."""
    if not isinstance(order, numbers.Integral) or isinstance(order, bool) or order < 1:
        raise ValueError(
            f"lm.check_gradients: order is the highest order of derivatives to check, an int "
            f">= 1 (1: gradients, 2: second derivatives too); got {order!r}."
        )
    return int(order)


def _check_seed(seed: int) -> int:
    """`seed`, checked to be an int >= 0."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise TypeError(f"lm.check_gradients: seed is an int >= 0; got {seed!r}.")
    return int(seed)


def _check_tolerance(name: str, value: float, positive: bool) -> None:
    """`eps` (> 0), `atol` or `rtol` (>= 0) is a finite number."""
    bound = "> 0" if positive else ">= 0"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"lm.check_gradients: {name} is a number {bound}; got {value!r:.40}.")
    if not (value > 0 if positive else value >= 0) or not math.isfinite(value):
        raise ValueError(
            f"lm.check_gradients: {name} must be a finite number {bound}; got {value!r}."
        )
