"""lm.grad_rule: gradients against hand-written references and finite differences, under every
transform, and every error a wrong rule can make."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import lamina as lm

# --- rules used by several tests --------------------------------------------------------


@lm.grad_rule
def round_ste(x):
    """Rounding with the straight-through gradient."""
    return jnp.round(x), lambda g: (g,)


@lm.grad_rule
def sin(x):
    return jnp.sin(x), lambda g: (g * jnp.cos(x),)


@lm.grad_rule
def product(a, b, c):
    """``a * b + sin(c)`` with its gradient by hand (a, b, c broadcast elementwise)."""

    def pullback(g):
        return g * b, g * a, g * jnp.cos(c)

    return a * b + jnp.sin(c), pullback


def product_reference(a, b, c):
    return a * b + jnp.sin(c)


X = jnp.array([-1.6, -0.4, 0.2, 0.9, 1.7])


# --- values and gradients ---------------------------------------------------------------


def test_straight_through_rounding():
    np.testing.assert_array_equal(round_ste(X), jnp.round(X))
    assert np.all(jax.grad(lambda x: jnp.sum(jnp.round(x)))(X) == 0)  # why a rule is needed
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(round_ste(x)))(X), jnp.ones(5))
    # the rule's gradient meets the rest of the chain: d/dx sum(round(x) * x) = x + round(x)
    grad = jax.grad(lambda x: jnp.sum(round_ste(x) * x))(X)
    np.testing.assert_allclose(grad, X + jnp.round(X), rtol=1e-6)


def test_a_rule_is_its_function_to_the_reader():
    assert round_ste.__name__ == "round_ste" and round_ste.__qualname__ == "round_ste"
    assert round_ste.__doc__ == "Rounding with the straight-through gradient."
    assert callable(round_ste.__wrapped__)


def test_several_arguments_against_autodiff_and_finite_differences(getkey):
    a, b, c = (jax.random.normal(getkey(), (4,)) for _ in range(3))
    np.testing.assert_allclose(product(a, b, c), product_reference(a, b, c), rtol=1e-6)
    for argnums in (0, 1, 2, (0, 2)):
        grads = jax.grad(lambda *xs: jnp.sum(product(*xs) ** 2), argnums=argnums)(a, b, c)
        reference = jax.grad(lambda *xs: jnp.sum(product_reference(*xs) ** 2), argnums=argnums)
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), grads, reference(a, b, c)
        )
    check_grads(product, (a, b, c), order=1, modes=["rev"])


def test_wrong_hand_gradients_would_be_caught_by_the_numerical_check():
    # the finite-difference check used above can fail: a rule with a wrong pullback fails it
    @lm.grad_rule
    def wrong(x):
        return jnp.sin(x), lambda g: (g * jnp.sin(x),)

    with pytest.raises(AssertionError):
        check_grads(wrong, (X,), order=1, modes=["rev"])


def test_vjp_gives_every_cotangent():
    a, b, c = jnp.array([2.0]), jnp.array([3.0]), jnp.array([0.5])
    y, vjp = jax.vjp(product, a, b, c)
    np.testing.assert_allclose(y, 6.0 + np.sin(0.5), rtol=1e-6)
    ga, gb, gc = vjp(jnp.array([10.0]))
    np.testing.assert_allclose([ga[0], gb[0], gc[0]], [30.0, 20.0, 10 * np.cos(0.5)], rtol=1e-6)


@lm.grad_rule
def affine(params, x):
    """A pytree in (params, x) and a pytree out: {"out": w * x + b, "total": (sum(x),)}."""
    w, b = params["w"][None, :], params["b"][None, :]  # (features,) over (batch, features)

    def pullback(g):
        out, (total,) = g["out"], g["total"]
        params_ct = {"w": jnp.sum(out * x, axis=0), "b": jnp.sum(out, axis=0)}
        return params_ct, out * w + total

    return {"out": x * w + b, "total": (jnp.sum(x),)}, pullback


def affine_reference(params, x):
    return {"out": x * params["w"][None, :] + params["b"][None, :], "total": (jnp.sum(x),)}


def test_pytree_arguments_and_outputs(getkey):
    params = {"w": jax.random.normal(getkey(), (3,)), "b": jax.random.normal(getkey(), (3,))}
    x = jax.random.normal(getkey(), (2, 3))

    def loss(rule):
        def fn(params, x):
            y = rule(params, x)
            return jnp.sum(jnp.tanh(y["out"])) + 3.0 * y["total"][0] ** 2

        return fn

    grads = jax.grad(loss(affine), argnums=(0, 1))(params, x)
    reference = jax.grad(loss(affine_reference), argnums=(0, 1))(params, x)
    assert jax.tree.structure(grads) == jax.tree.structure(reference)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), grads, reference)
    check_grads(affine, (params, x), order=1, modes=["rev"])


def test_none_is_zero_for_an_argument_a_leaf_or_a_subtree():
    @lm.grad_rule
    def first_only(tree, x):
        return tree["a"] * x, lambda g: ({"a": jnp.sum(g * x), "b": None, "c": None}, None)

    tree = {"a": jnp.float32(2.0), "b": jnp.float32(1.0), "c": {"d": jnp.ones(2)}}
    x = jnp.arange(3.0)
    grads = jax.grad(lambda t, x: jnp.sum(first_only(t, x)), argnums=(0, 1))(tree, x)
    assert grads[0]["a"] == 3.0  # sum(x)
    assert grads[0]["b"] == 0 and np.all(grads[0]["c"]["d"] == 0) and np.all(grads[1] == 0)
    assert grads[0]["c"]["d"].shape == (2,) and grads[1].shape == (3,)


def test_integer_and_bool_arguments_take_none_and_get_float0():
    @lm.grad_rule
    def pick(x, i, keep):
        def pullback(g):
            return jnp.zeros_like(x).at[i].set(jnp.where(keep, g, 0.0)), None, None

        return jnp.where(keep, x[i], 0.0), pullback

    x = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(jax.grad(pick)(x, 1, True), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(jax.grad(pick)(x, 1, jnp.bool_(False)), [0.0, 0.0, 0.0])
    _, gi, gkeep = jax.grad(pick, argnums=(0, 1, 2), allow_int=True)(x, jnp.int32(2), True)
    assert gi.dtype == jax.dtypes.float0 and gkeep.dtype == jax.dtypes.float0

    @lm.grad_rule
    def pick_float0(x, i):  # JAX's own zeros for an integer are accepted too
        zeros = np.zeros((), jax.dtypes.float0)
        return x[i], lambda g: (jnp.zeros_like(x).at[i].set(g), zeros)

    np.testing.assert_array_equal(jax.grad(pick_float0)(x, 0), [1.0, 0.0, 0.0])


@lm.grad_rule
def quantize(x, *, levels, low=0.0, mode="nearest", transform=None, offset=None):
    """Rounds x to `levels` levels in [low, low + 1]; straight through inside, zero outside."""
    step = 1.0 / (levels - 1)
    if transform is not None:
        x = transform(x)
    if offset is not None:
        x = x + offset
    scaled = (jnp.clip(x, low, low + 1.0) - low) / step
    rounded = jnp.round(scaled) if mode == "nearest" else jnp.floor(scaled)
    inside = (x >= low) & (x <= low + 1.0)

    def pullback(g):
        return (jnp.where(inside, g, jnp.zeros_like(g)),)

    return low + rounded * step, pullback


def test_keyword_arguments_are_not_differentiated():
    x = jnp.array([-0.5, 0.1, 0.4, 0.6, 0.95, 1.5])
    np.testing.assert_allclose(quantize(x, levels=3), [0.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(quantize(x, levels=3, mode="floor"), [0, 0, 0, 0.5, 0.5, 1.0])
    np.testing.assert_allclose(quantize(x, levels=2, low=-1.0), [-1, 0, 0, 0, 0, 0])
    doubled = quantize(x, levels=3, transform=lambda v: 2 * v)  # a function: closed over
    np.testing.assert_allclose(doubled, [0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    grad = jax.grad(lambda x: jnp.sum(quantize(x, levels=3)))(x)
    np.testing.assert_array_equal(grad, [0.0, 1.0, 1.0, 1.0, 1.0, 0.0])

    # an array keyword argument crosses the boundary as an input whose gradient is zero
    offset = jnp.full((6,), 0.25)
    np.testing.assert_allclose(quantize(x, levels=3, offset=offset), quantize(x + 0.25, levels=3))
    g_x, g_offset = jax.grad(
        lambda x, offset: jnp.sum(quantize(x, levels=3, offset=offset)), argnums=(0, 1)
    )(x, offset)
    np.testing.assert_array_equal(g_x, [0.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # inside [0, 1]: x+0.25
    np.testing.assert_array_equal(g_offset, jnp.zeros(6))


def test_keyword_arrays_may_be_traced_by_jit_and_vmap():
    x = jnp.array([0.1, 0.4, 0.6])  # inside [0, 1] with either offset

    @jax.jit
    def grad_at(x, offset):
        return jax.grad(lambda x: jnp.sum(quantize(x, levels=3, offset=offset) ** 2))(x)

    offsets = jnp.array([0.0, 0.3])
    per_offset = jax.vmap(grad_at, in_axes=(None, 0))(x, offsets)
    for row, offset in zip(per_offset, offsets, strict=True):
        # d/dx sum(q(x + o)^2) = 2 q(x + o) on [0, 1]
        expected = 2 * quantize(x + offset, levels=3)
        np.testing.assert_allclose(row, expected, rtol=1e-6)
        np.testing.assert_allclose(grad_at(x, offset), expected, rtol=1e-6)


# --- transforms -------------------------------------------------------------------------


def test_jit_inside_and_outside():
    expected = jnp.cos(X)
    np.testing.assert_allclose(jax.jit(sin)(X), jnp.sin(X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: jnp.sum(sin(x))))(X), expected)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(jax.jit(sin)(x)))(X), expected)


def test_vmap_of_grad_and_grad_of_vmap(getkey):
    a, b, c = (jax.random.normal(getkey(), (5, 3)) for _ in range(3))

    def scalar_loss(rule):
        return lambda a, b, c: jnp.sum(rule(a, b, c) ** 2)

    per_example = jax.vmap(jax.grad(scalar_loss(product), argnums=(0, 2)))(a, b, c)
    reference = jax.vmap(jax.grad(scalar_loss(product_reference), argnums=(0, 2)))(a, b, c)
    for got, want in zip(per_example, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    batched = jax.grad(lambda a: jnp.sum(jax.vmap(product)(a, b, c)))(a)
    np.testing.assert_allclose(batched, b, rtol=1e-6)  # d/da sum(a * b + sin c) = b
    # a vmapped argument beside an unmapped one
    g = jax.vmap(jax.grad(lambda a, b: jnp.sum(product(a, b, c[0]))), in_axes=(0, None))(a, b[0])
    np.testing.assert_allclose(g, jnp.broadcast_to(b[0], (5, 3)), rtol=1e-6)


def test_grad_of_grad_differentiates_the_pullback():
    x = 0.7
    assert jax.grad(sin)(x) == pytest.approx(np.cos(x), rel=1e-6)
    assert jax.grad(jax.grad(sin))(x) == pytest.approx(-np.sin(x), rel=1e-6)
    assert jax.grad(jax.grad(jax.grad(sin)))(x) == pytest.approx(-np.cos(x), rel=1e-6)
    assert jax.jit(jax.grad(jax.grad(sin)))(x) == pytest.approx(-np.sin(x), rel=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(jax.grad(sin)))(X), -jnp.sin(X), rtol=1e-6)
    hessian = jax.jacrev(jax.jacrev(lambda x: jnp.sum(sin(x) ** 2)))(X[:3])
    np.testing.assert_allclose(hessian, jnp.diag(2 * jnp.cos(2 * X[:3])), atol=1e-6)
    check_grads(sin, (X,), order=2, modes=["rev"])


def test_second_order_sees_what_the_pullback_does():
    # the straight-through pullback is constant in x: no second derivative, unlike x**2's
    @lm.grad_rule
    def square(x):
        return x * x, lambda g: (2 * g * x,)

    assert jax.grad(jax.grad(square))(3.0) == 2.0
    assert jax.grad(jax.grad(lambda x: round_ste(x) * x))(1.2) == 2.0  # (g * x + round x)'
    assert jax.grad(jax.grad(round_ste))(1.2) == 0.0


def test_inside_scan_and_checkpoint():
    def body(carry, x):
        return carry + sin(x), None

    grad = jax.grad(lambda xs: jax.lax.scan(body, 0.0, xs)[0])(X)
    np.testing.assert_allclose(grad, jnp.cos(X), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(jax.checkpoint(sin)(x)))(X)
    np.testing.assert_allclose(grad, jnp.cos(X), rtol=1e-6)


def test_forward_mode_is_not_available():
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\).*custom_vjp"):
        jax.jvp(sin, (X,), (jnp.ones(5),))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.hessian(lambda x: jnp.sum(sin(x)))(X)


def test_the_forward_runs_once_and_the_pullback_is_not_recomputed():
    calls = {"forward": 0, "pullback": 0}

    @lm.grad_rule
    def counted(x):
        calls["forward"] += 1

        def pullback(g):
            calls["pullback"] += 1
            return (g * 2.0,)

        return 2.0 * x, pullback

    assert jax.grad(lambda x: jnp.sum(counted(x)))(X).tolist() == [2.0] * 5
    assert calls == {"forward": 1, "pullback": 1}  # traced once, in the forward pass
    step = jax.jit(jax.grad(lambda x: jnp.sum(counted(x))))
    step(X), step(X + 1)
    assert calls == {"forward": 2, "pullback": 2}  # compiled once


def test_closed_over_values_are_constants_and_positional_arguments_are_differentiated():
    def loss_closed(w, x):
        scaled = lm.grad_rule(lambda x: (x * w, lambda g: (g * w,)))
        return jnp.sum(scaled(x))

    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.grad(loss_closed, argnums=1)(2.0, x), [2.0, 2.0, 2.0])

    @lm.grad_rule
    def scaled(w, x):
        return x * w, lambda g: (jnp.sum(g * x), g * w)

    np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(scaled(w, x)))(2.0), 3.0)


# --- inside a lamina model --------------------------------------------------------------


@lm.grad_rule
def scale_rounded(h, scale):
    """``round(h) * scale``: straight through for h; exact for scale (a feature vector)."""
    rounded, row = jnp.round(h), scale[None, :]

    def pullback(g):
        return g * row, jnp.sum(g * rounded, axis=0)

    return rounded * row, pullback


class QuantisedDense(lm.Module):
    def __init__(self, rule=True):
        super().__init__()
        self.dense = lm.Dense(3, 4)
        self.scale = lm.Parameter((4,), lm.initializers.ones())
        self.rule = rule

    def __call__(self, x):
        h = self.dense(x)
        if self.rule:
            return scale_rounded(h, self.scale)  # a declaration is passed as its array
        straight_through = h + jax.lax.stop_gradient(jnp.round(h) - h)  # the usual trick
        return straight_through * self.scale.value[None, :]


def test_in_a_model_under_transform_and_grad(getkey):
    init, apply = lm.transform(QuantisedDense())
    _, apply_reference = lm.transform(QuantisedDense(rule=False))
    variables = init(getkey())
    variables["params"]["scale"] = jnp.array([0.5, 1.0, 2.0, -1.0])
    x = 3 * jax.random.normal(getkey(), (8, 3))

    def loss(apply):
        def fn(params, x):
            y, _ = apply({"params": params}, None, x)
            return jnp.sum(jnp.sin(y))

        return fn

    params = variables["params"]
    h = x @ params["dense"]["kernel"] + params["dense"]["bias"][None, :]
    y, _ = apply(variables, None, x)
    np.testing.assert_allclose(y, jnp.round(h) * params["scale"][None, :], rtol=1e-6)
    np.testing.assert_allclose(y, apply_reference(variables, None, x)[0], rtol=1e-6)
    grads = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(variables["params"], x)
    reference = jax.grad(loss(apply_reference), argnums=(0, 1))(variables["params"], x)
    assert jax.tree.structure(grads) == jax.tree.structure(reference)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), grads, reference)
    assert np.abs(grads[0]["dense"]["kernel"]).sum() > 0  # the gradient went through round


def test_dtypes_are_kept():
    x = jnp.array([0.3, 1.6], jnp.bfloat16)
    assert round_ste(x).dtype == jnp.bfloat16
    assert jax.grad(lambda x: jnp.sum(round_ste(x)))(x).dtype == jnp.bfloat16

    @lm.grad_rule
    def constant_slope(x):  # a Python number as the cotangent: cast to the argument's dtype
        return 3 * x, lambda g: (3.0,)

    assert jax.grad(constant_slope)(jnp.bfloat16(1.0)).dtype == jnp.bfloat16
    assert jax.grad(constant_slope)(jnp.float32(1.0)) == 3.0


# --- errors -----------------------------------------------------------------------------


def make_rule(pullback_result, name):
    def rule(x, levels):
        return x * levels, lambda g: pullback_result(g, x, levels)

    rule.__qualname__ = name
    return lm.grad_rule(rule)


def loss_of(rule):
    return lambda x, levels: jnp.sum(rule(x, levels))


X3, L3 = jnp.ones(3), jnp.full((3,), 2.0)

PULLBACK_ERRORS = [
    (
        lambda g, x, levels: (g * levels,),
        ValueError,
        r"pullback of quantize returned 1 cotangent\(s\) for 2 positional argument\(s\); "
        r"return one per positional argument",
    ),
    (
        lambda g, x, levels: (g, g, g),
        ValueError,
        r"pullback of quantize returned 3 cotangent\(s\) for 2 positional argument\(s\)",
    ),
    (
        lambda g, x, levels: g * levels,
        TypeError,
        r"pullback of quantize returned an array float32\[3\]; it must return a tuple with one "
        r"cotangent per positional argument \(2\): `lambda g: \(g_0, g_1\)`",
    ),
    (
        lambda g, x, levels: (g * levels, (g * x,)),
        ValueError,
        r"pullback of quantize returned a cotangent of structure PyTreeDef\(\(\*,\)\) for "
        r"positional argument 1, which has structure PyTreeDef\(\*\)",
    ),
    (
        lambda g, x, levels: (jnp.sum(g), g * x),
        ValueError,
        r"pullback of quantize returned a cotangent of shape \(\) for positional argument 0, "
        r"which has shape \(3,\); a cotangent has its argument's shape",
    ),
    (
        lambda g, x, levels: (g.astype(jnp.bfloat16), g * x),
        TypeError,
        r"pullback of quantize returned a bfloat16 cotangent for positional argument 0, which "
        r"is float32; .*g.astype\(x.dtype\)",
    ),
    (
        lambda g, x, levels: (g, "zero"),
        TypeError,
        r"pullback of quantize returned str 'zero' as the cotangent of positional argument 1; "
        r"a cotangent is an array \(or None for zeros\)",
    ),
]


@pytest.mark.parametrize("transform", ["eager", "jit", "vmap"])
@pytest.mark.parametrize(("pullback", "error", "message"), PULLBACK_ERRORS)
def test_a_wrong_pullback_is_an_error_naming_the_rule(pullback, error, message, transform):
    grad = jax.grad(loss_of(make_rule(pullback, "quantize")))
    if transform == "jit":
        grad = jax.jit(grad)
    elif transform == "vmap":  # the checks see one example's shapes
        grad = jax.vmap(grad)
        x, levels = jnp.ones((2, 3)), jnp.full((2, 3), 2.0)
    if transform != "vmap":
        x, levels = X3, L3
    with pytest.raises(error, match=message):
        grad(x, levels)


def test_a_wrong_pullback_fails_in_the_forward_pass():
    rule = make_rule(lambda g, x, levels: (g,), "quantize")
    with pytest.raises(ValueError, match="pullback of quantize returned 1 cotangent"):
        jax.vjp(rule, X3, L3)  # before any cotangent is pulled back
    np.testing.assert_array_equal(rule(X3, L3), X3 * L3)  # not differentiated: never called


def test_a_wrong_cotangent_inside_a_pytree_names_its_path():
    @lm.grad_rule
    def tree_rule(params):
        return params["w"] * 2.0, lambda g: ({"w": 2.0 * g, "b": jnp.zeros(4)},)

    params = {"w": jnp.ones(3), "b": jnp.ones(3)}
    with pytest.raises(
        ValueError,
        match=r"pullback of test_a_wrong_cotangent_inside_a_pytree_names_its_path.<locals>."
        r"tree_rule returned a cotangent of shape \(4,\) for positional argument 0 at "
        r"\['b'\], which has shape \(3,\)",
    ):
        jax.grad(lambda p: jnp.sum(tree_rule(p)))(params)

    @lm.grad_rule
    def missing_b(params):
        return params["w"] * 2.0, lambda g: ({"w": 2.0 * g},)

    with pytest.raises(ValueError, match=r"structure PyTreeDef\(\{'w': \*\}\) for positional"):
        jax.grad(lambda p: jnp.sum(missing_b(p)))(params)


def test_a_float_cotangent_for_an_integer_argument_is_an_error():
    @lm.grad_rule
    def shift(x, n):
        return x + jnp.asarray(n, x.dtype), lambda g: (g, jnp.sum(g))

    with pytest.raises(
        TypeError,
        match=r"pullback of test_a_float_cotangent_for_an_integer_argument_is_an_error.<locals>"
        r".shift returned a float32\[\] cotangent for positional argument 1, which is "
        r"int32\[\]: integer and bool arguments have no gradient; return None for it",
    ):
        jax.grad(lambda x: jnp.sum(shift(x, jnp.int32(2))))(X)


RESULT_ERRORS = [
    (lambda x: jnp.round(x), r"grad rule bad returned an array float32\[5\]; a grad rule "),
    (lambda x: (x, lambda g: (g,), 1), r"grad rule bad returned a tuple of 3; "),
    (lambda x: (x, (x,)), r"grad rule bad returned \(y, tuple\); the second item must be the "),
    (lambda x: (x, None), r"grad rule bad returned \(y, NoneType None\); the second item"),
]


@pytest.mark.parametrize(("fn", "message"), RESULT_ERRORS)
@pytest.mark.parametrize("differentiated", [False, True])
def test_a_rule_must_return_y_and_a_pullback(fn, message, differentiated):
    fn.__qualname__ = "bad"
    rule = lm.grad_rule(fn)
    call = jax.grad(lambda x: jnp.sum(rule(x))) if differentiated else rule
    with pytest.raises(TypeError, match=message + r".*`return y, lambda g: \(g_x, ...\)`"):
        call(X)


def test_only_functions_are_decorated():
    with pytest.raises(TypeError, match=r"lm.grad_rule decorates a function .*; got int 3"):
        lm.grad_rule(3)


def test_positional_arguments_must_be_arrays():
    with pytest.raises(
        TypeError,
        match=r"grad rule quantize: positional argument 1 is str 'floor'; positional arguments "
        r"are differentiated, so they hold arrays and numbers. Pass settings and other values "
        r"as keyword arguments",
    ):
        quantize(X, "floor", levels=3)
    with pytest.raises(TypeError, match=r"positional argument 0 at \['f'\] is \w+"):
        affine({"f": jnp.sin}, X)


# --- closing over differentiated values ---------------------------------------------------


def closing(w, where):
    """A rule scaling by `w`, which it closes over in its forward pass, pullback or both."""
    forward_w = w if where in ("forward", "both") else 2.0
    pullback_w = w if where in ("pullback", "both") else 2.0
    return lm.grad_rule(lambda x: (x * forward_w, lambda g: (g * pullback_w,)))


CLOSURES = [
    ("forward", lambda f: jax.grad(f)),
    ("both", lambda f: jax.grad(f)),
    ("both", lambda f: jax.jit(jax.grad(f))),
    ("both", lambda f: lambda w: jax.jvp(f, (w,), (1.0,))),
    ("pullback", lambda f: jax.grad(lambda w: f(w, scale_input=True))),
    ("pullback", lambda f: jax.jit(jax.grad(lambda w: f(w, scale_input=True)))),
    ("forward", lambda f: jax.grad(lambda w: jnp.sum(jax.vmap(lambda v: f(w, v))(X[:2])))),
]


@pytest.mark.parametrize(("where", "transform"), CLOSURES)
def test_a_rule_closing_over_a_differentiated_value_is_an_error(where, transform):
    def loss(w, offset=0.0, scale_input=False):
        x = X * w if scale_input else X + offset
        return jnp.sum(closing(w, where)(x))

    with pytest.raises(TypeError, match=r"being differentiated .* closes over it.*positional"):
        transform(loss)(2.0)


def test_a_rule_closing_over_an_outer_differentiated_value_inside_an_inner_one_is_an_error():
    # Without the check, the outer derivative of the forward's value was silently zero.
    def inner(w):
        return jax.value_and_grad(lambda x: jnp.sum(closing(w, "both")(x)))(X)[0]

    for transform in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(TypeError, match=r"grad rule closing.<locals>.<lambda>: the rule"):
            transform(inner)(2.0)


def test_closing_over_values_that_are_not_differentiated_is_fine():
    x = X[:3]

    def rule_grad(w):
        return jax.grad(lambda x: jnp.sum(closing(w, "both")(x) ** 2))(x)

    expected = 2 * x * 3.0 * 3.0  # d/dx sum((3x)^2), with the rule's pullback g * 3
    np.testing.assert_allclose(jax.jit(rule_grad)(3.0), expected, rtol=1e-6)
    batched = jax.vmap(rule_grad)(jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(batched[1], expected, rtol=1e-6)
    np.testing.assert_allclose(batched[0], 2 * x, rtol=1e-6)
    stopped = jax.grad(lambda w: jnp.sum(closing(jax.lax.stop_gradient(w), "both")(x * w)))
    np.testing.assert_allclose(stopped(3.0), 3.0 * jnp.sum(x), rtol=1e-6)


@pytest.mark.parametrize("transform", [jax.grad, lambda f: jax.jit(jax.grad(f))])
def test_an_integer_output_is_an_error_saying_it_has_no_gradient(transform):
    @lm.grad_rule
    def count(x):
        return jnp.sum(x > 0).astype(jnp.int32), lambda g: (jnp.ones_like(x) * g,)

    with pytest.raises(
        TypeError,
        match=r"grad rule .*count returns an integer or bool output, y \(int32\[\]\): such an "
        r"output has no gradient.*return it as a float \(`y.astype\(jnp.float32\)`\)",
    ):
        transform(lambda x: count(x) * 1.0)(X)


@pytest.mark.parametrize("jit", [False, True])
def test_a_rule_may_close_over_a_batched_value_that_is_not_differentiated(jit):
    def per_example(x, s):
        @lm.grad_rule
        def scaled(x):
            return x * s, lambda g: (g * s**2,)  # a pullback that is not the true gradient

        return scaled(x).sum()

    xs, ss = jnp.ones((3, 2)), jnp.array([0.0, 1.0, 2.0])
    grad = jax.grad(lambda xs: jax.vmap(per_example)(xs, ss).sum())
    expected = jnp.broadcast_to((ss**2)[:, None], (3, 2))
    np.testing.assert_allclose((jax.jit(grad) if jit else grad)(xs), expected)


def test_the_forward_pass_sees_concrete_values_under_an_eager_grad():
    stored = []

    @lm.grad_rule
    def clip_ste(x):
        hi = float(jnp.max(jnp.abs(x)))  # Python control on the values
        stored.append(x * 2)
        return jnp.clip(x, -hi / 2, hi / 2), lambda g: (3 * g,)

    x = jnp.array([0.5, 2.0])
    np.testing.assert_allclose(jax.grad(lambda x: clip_ste(x).sum())(x), [3.0, 3.0])
    assert not isinstance(stored[-1], jax.core.Tracer)
    np.testing.assert_allclose(stored[-1], [1.0, 4.0])
    value, vjp = jax.vjp(clip_ste, x)
    np.testing.assert_allclose(value, [0.5, 1.0])
    np.testing.assert_allclose(vjp(jnp.ones(2))[0], [3.0, 3.0])


def closing_in(kind, keyword):
    """A loss whose rule scales by a value traced by a jit or a scan body around the call."""

    def rule(x, s):
        if keyword:
            return lm.grad_rule(lambda x, *, s: (x * s, lambda g: (g * s,)))(x, s=s)
        return lm.grad_rule(lambda x: (x * s, lambda g: (g * s,)))(x)

    if kind == "jit":
        return jax.jit(lambda x, s: rule(x, s).sum())

    def loss(x, s):
        step = lambda c, si: (rule(c, si * s), None)  # noqa: E731
        return jax.lax.scan(step, x, jnp.array([1.0, 2.0]))[0].sum()

    return loss


@pytest.mark.parametrize("kind", ["jit", "scan"])
def test_a_rule_closing_over_a_value_of_a_jit_or_loop_differentiated_outside_it(kind):
    x = X[:2]
    with pytest.raises(
        TypeError, match=r"closes over a value traced by a jax.jit or a loop body.*keyword"
    ):
        jax.grad(closing_in(kind, keyword=False))(x, 3.0)
    # The way the message gives: the value as a keyword argument.
    expected = 3.0 if kind == "jit" else 3.0 * 6.0  # scan: scales by 3 then by 6
    np.testing.assert_allclose(jax.grad(closing_in(kind, keyword=True))(x, 3.0), [expected] * 2)
