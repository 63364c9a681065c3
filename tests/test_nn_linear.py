"""Dense, Embed, DenseGeneral and Einsum against Flax Linen, given the same weights.

Outputs and gradients equal Linen's; the layout and initialisation of the kernels, the dtype
contract of the projections (inference with dtype=None, complex values); every error a user can
cause.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina.nn._projections import dense_general
from tests.helpers import assert_close
from tests.linen_helpers import check_against_linen, linen_and_lamina

# --- Dense and Embed ------------------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 5), (5,)])
def test_dense_equals_linen(getkey, use_bias, shape):
    x = jax.random.normal(getkey(), shape)
    variables, expected, got = linen_and_lamina(
        nn.Dense(4, use_bias=use_bias), lm.Dense(5, 4, use_bias=use_bias), x
    )
    assert_close(got, expected)
    assert jax.tree.map(jnp.shape, dict(variables)) == jax.tree.map(
        jnp.shape, lm.transform(lm.Dense(5, 4, use_bias=use_bias)).init(getkey())
    )
    _, apply = lm.transform(lm.Dense(5, 4, use_bias=use_bias))

    def ours(v, x):
        return jnp.sum(apply(v, None, x)[0] ** 2)

    def theirs(v, x):
        return jnp.sum(nn.Dense(4, use_bias=use_bias).apply(v, x) ** 2)

    g_ours = jax.grad(ours, argnums=(0, 1))(dict(variables), x)
    g_theirs = jax.grad(theirs, argnums=(0, 1))(variables, x)
    assert_close(g_ours, (dict(g_theirs[0]), g_theirs[1]))


def test_dense_bfloat16_compute_float32_storage(getkey):
    x = jax.random.normal(getkey(), (3, 5))
    linen = nn.Dense(4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    ours = lm.Dense(5, 4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    variables, expected, got = linen_and_lamina(linen, ours, x)
    assert variables["params"]["kernel"].dtype == jnp.float32
    assert got.dtype == jnp.bfloat16 == expected.dtype
    np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-2)


def test_dense_wrong_input_size():
    _, apply = lm.transform(lm.Dense(5, 4))
    variables = lm.transform(lm.Dense(5, 4)).init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"Dense\(in_size=5, out_size=4\) got an input of shape "
        r"\(3, 6\): its last axis must be in_size=5, got 6\.",
    ):
        apply(variables, None, jnp.ones((3, 6)))


def test_embed_and_attend_equal_linen(getkey):
    ids = jnp.array([[0, 3, 9], [2, 2, 1]])
    linen, ours = nn.Embed(10, 6), lm.Embed(10, 6)
    variables, expected, got = linen_and_lamina(linen, ours, ids)
    np.testing.assert_allclose(got, expected)
    q = jax.random.normal(getkey(), (4, 6))
    expected = linen.apply(variables, q, method=linen.attend)
    _, attend = lm.transform(ours, to_callable=lambda m: m.attend)
    assert_close(attend(dict(variables), None, q)[0], expected)
    # Linen's default initializer: the same distribution and key derivation are not promised,
    # but the shape and scale are.
    table = lm.transform(ours).init(getkey())["params"]["embedding"]
    assert table.shape == (10, 6) and 0.5 < float(jnp.std(table)) * 6**0.5 < 2.0


def test_embed_errors():
    init, apply = lm.transform(lm.Embed(10, 6))
    variables = init(jax.random.key(0))
    where = r"Embed\(num_embeddings=10, size=6\)"
    with pytest.raises(TypeError, match=where + r" takes integer ids, got dtype float32"):
        apply(variables, None, jnp.ones(3))
    _, attend = lm.transform(lm.Embed(10, 6), to_callable=lambda m: m.attend)
    with pytest.raises(
        ValueError,
        match=where + r"\.attend got a query of shape \(2, 5\): its last axis must be size=6, "
        r"got 5\.",
    ):
        attend(variables, None, jnp.ones((2, 5)))


# --- DenseGeneral and Einsum ---------------------------------------------------------------------


@pytest.fixture
def normal():
    rng = np.random.default_rng(0)
    return lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)


def complex_normal(normal, shape):
    return jax.lax.complex(normal(shape), normal(shape))


def assert_complex_close(got, expected):
    assert got.dtype == expected.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def complex_variables(layer):
    """Its variables (complex64) with imaginary parts."""
    variables = lm.transform(layer).init(jax.random.key(0))
    return jax.tree.map(lambda v: v * (1 + 0.5j) + 0.25j, variables)


def flat_init(key, shape, dtype=jnp.float32):
    """An initializer whose values show the shape it was called with (keys ignored)."""
    return jnp.reshape(jnp.arange(math.prod(shape), dtype=dtype), shape) / (7.0 * shape[0])


# (id, input shape, lamina's DenseGeneral(in_size, out_size, **options), Linen's options)
DENSE_GENERAL_CASES = [
    ("last-axis", (2, 3, 4), (4, 5, {}), dict(features=5)),
    ("two-axes-tuple-out", (2, 3, 6, 4), ((3, 4), (5, 2), dict(axis=(1, -1))), {}),
    ("mixed-signs-sorted", (2, 3, 6, 4), ((3, 4), 5, dict(axis=(-1, 1))), {}),
    ("batch-nobias", (2, 3, 4), (4, (2, 3), dict(batch_shape=(2,), use_bias=False)), {}),
    ("two-batch-axes", (2, 3, 5, 4), ((5, 4), 3, dict(axis=(-2, -1), batch_shape=(2, 3))), {}),
]


def _linen_dense_general(in_size, out_size, options):
    linen = {"features": out_size, "use_bias": options.get("use_bias", True)}
    if "axis" in options:
        linen["axis"] = options["axis"]
    if "batch_shape" in options:
        linen["batch_dims"] = tuple(range(len(options["batch_shape"])))
    return nn.DenseGeneral(**linen)


@pytest.mark.parametrize(
    "shape, setup", [c[1:3] for c in DENSE_GENERAL_CASES], ids=[c[0] for c in DENSE_GENERAL_CASES]
)
def test_dense_general_matches_linen(shape, setup, normal):
    in_size, out_size, options = setup
    x = normal(shape)
    linen = _linen_dense_general(in_size, out_size, options)
    check_against_linen(linen, lm.DenseGeneral(in_size, out_size, **options), x, normal)


def test_dense_general_initialises_the_flattened_matrix_as_linen():
    """Linen calls the initializers with (prod(batch + in), prod(out)) and the flat bias."""
    x = jnp.ones((2, 3, 6, 4))
    linen = nn.DenseGeneral((5, 2), axis=(1, -1), batch_dims=(0,), kernel_init=flat_init)
    linen = linen.copy(bias_init=flat_init)
    expected = linen.init(jax.random.key(0), x)
    ours = lm.DenseGeneral(
        (3, 4), (5, 2), axis=(1, -1), batch_shape=(2,), kernel_init=flat_init, bias_init=flat_init
    )
    got = lm.transform(ours).init(jax.random.key(1))
    assert_close(got, dict(expected))


def test_dense_general_dtype_none_and_complex_match_linen(normal):
    x = normal((2, 3)).astype(jnp.bfloat16)
    layer = lm.DenseGeneral(3, (2, 2), dtype=None, param_dtype=jnp.bfloat16)
    variables = lm.transform(layer).init(jax.random.key(0))
    y, _ = lm.transform(layer).apply(variables, None, x)
    assert y.dtype == jnp.bfloat16
    expected = nn.DenseGeneral((2, 2), param_dtype=jnp.bfloat16).apply(variables, x)
    assert_close(y, expected)
    # complex inputs and weights compute in complex, as Linen's promote_dtype does
    z = complex_normal(normal, (2, 3))
    layer = lm.DenseGeneral(3, 2, dtype=None, param_dtype=jnp.complex64)
    variables = complex_variables(layer)
    y, _ = lm.transform(layer).apply(variables, None, z)
    expected = nn.DenseGeneral(2, param_dtype=jnp.complex64).apply(variables, z)
    assert_complex_close(y, expected)
    with pytest.raises(
        TypeError, match=r"DenseGeneral\(in_size=3, out_size=2\) at the root got a "
    ):
        real = lm.DenseGeneral(3, 2)
        lm.transform(real).apply(lm.transform(real).init(jax.random.key(0)), None, z)


def test_dense_general_kernel_casts_every_operand():
    """The projections' kernel (MultiHeadAttention's) casts kernel and bias too."""
    x = jnp.ones((2, 3), jnp.float32)
    kernel, bias = jnp.ones((3, 2, 4), jnp.bfloat16), jnp.ones((2, 4), jnp.bfloat16)
    y = dense_general(x, kernel, bias, 1, jnp.float32)
    assert y.dtype == jnp.float32 and y.shape == (2, 2, 4)
    assert_close(y, jnp.full((2, 2, 4), 4.0))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: lm.DenseGeneral(0, 2), r"^DenseGeneral\(in_size=0, out_size=2\): every entry"),
        (lambda: lm.DenseGeneral(2.0, 2), r"in_size must be a positive int or a non-empty tuple"),
        (lambda: lm.DenseGeneral((), 2), r"in_size must be a positive int or a non-empty tuple"),
        (lambda: lm.DenseGeneral(3, (2, "a")), r"out_size must be a positive int"),
        (lambda: lm.DenseGeneral(3, 2, axis=(1, -1)), r"axis=\(1, -1\) contracts 2 input axes"),
        (lambda: lm.DenseGeneral((3, 3), 2, axis=(1, 1)), r"names an axis twice"),
        (lambda: lm.DenseGeneral(3, 2, axis="last"), r"axis must be an int or a non-empty tuple"),
        (
            lambda: lm.DenseGeneral(3, 2, batch_shape=(2.0,)),
            r"batch_shape must be a positive int or",
        ),
        (lambda: lm.DenseGeneral(3, 2, batch_shape=(0,)), r"every entry of batch_shape"),
        (lambda: lm.DenseGeneral(3, 2, use_bias=1), r"use_bias must be True or False"),
        (lambda: lm.DenseGeneral(3, 2, kernel_sharding=("a",)), r"kernel_sharding names one"),
    ],
)
def test_dense_general_settings_errors(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


@pytest.mark.parametrize(
    "layer, shape, match",
    [
        (lm.DenseGeneral(4, 2), (3, 5), r"its axes \(1,\) \(axis=-1\) must have sizes in_size="),
        (lm.DenseGeneral(4, 2, axis=3), (3, 4), r"axis=\(3,\) must name 1 distinct axes of it"),
        (
            lm.DenseGeneral(4, 2, axis=0, batch_shape=(3,)),
            (3, 4),
            r"after its 1 leading batch axes",
        ),
        (
            lm.DenseGeneral((4, 4), 2, axis=(1, -1)),
            (3, 4),
            r"must name 2 distinct axes",
        ),
        (
            lm.DenseGeneral(4, 2, batch_shape=(2,)),
            (3, 4),
            r"and its leading axes batch_shape=\(2,\), got \(4,\) and batch axes \(3,\)",
        ),
    ],
)
def test_dense_general_input_errors(layer, shape, match):
    init, apply = lm.transform(layer)
    with pytest.raises(ValueError, match=match):
        apply(init(jax.random.key(0)), None, jnp.ones(shape))


# (id, kernel shape, equation, input shape, options)
EINSUM_CASES = [
    ("linen-example", (5, 6, 7), "abc,cde->abde", (3, 4, 5), {}),
    ("ellipsis", (4, 3), "...d,dh->...h", (2, 3, 4), {}),
    ("reordered-bias", (4, 3, 2), "bd, dhk -> khb", (2, 4), {}),
    ("summed-ellipsis-nobias", (4, 3), "...d,dh->h", (2, 5, 4), dict(use_bias=False)),
    ("preferred-type", (4, 3), "bd,dh->bh", (2, 4), dict(preferred_element_type=jnp.float32)),
    ("kernel-ellipsis", (3, 4, 6), "...d,...dh->...h", (2, 3, 4), {}),
    ("kernel-ellipsis-broadcast", (1, 4, 6), "...d,...dh->...h", (2, 3, 4), {}),
    ("kernel-ellipsis-only", (3, 4, 6), "bd,...dh->...h", (3, 4), {}),
    ("kernel-ellipsis-in-front", (4, 5, 2), "bd,d...->b...", (3, 4), {}),
    ("kernel-ellipsis-summed", (3, 4, 6), "...d,...dh->h", (2, 3, 4), {}),
]


@pytest.mark.parametrize(
    "kernel, equation, shape, options",
    [c[1:] for c in EINSUM_CASES],
    ids=[c[0] for c in EINSUM_CASES],
)
def test_einsum_matches_linen(kernel, equation, shape, options, normal):
    linen = nn.Einsum(kernel, equation, **options)
    check_against_linen(linen, lm.Einsum(kernel, equation, **options), normal(shape), normal)


def test_einsum_dtype_none_and_complex_match_linen(normal):
    layer = lm.Einsum((3, 2), "bd,dh->bh", dtype=None, param_dtype=jnp.complex64)
    variables = complex_variables(layer)
    z = complex_normal(normal, (2, 3))
    y, _ = lm.transform(layer).apply(variables, None, z)
    expected = nn.Einsum((3, 2), "bd,dh->bh", param_dtype=jnp.complex64).apply(variables, z)
    assert_complex_close(y, expected)
    bf16 = lm.Einsum((3, 2), "bd,dh->bh", dtype=None)
    real = lm.transform(bf16).init(jax.random.key(0))
    y, _ = lm.transform(bf16).apply(real, None, z.real.astype(jnp.bfloat16))
    assert y.dtype == jnp.float32  # float32 weights promote bfloat16 inputs, as in Linen


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: lm.Einsum((3, 2), "bd,dh"),
            ValueError,
            r"must be explicit, with exactly one '->'",
        ),
        (lambda: lm.Einsum((3, 2), "bd,dh,h->bh"), ValueError, r"exactly two operands.*has 2"),
        (lambda: lm.Einsum((3, 2), "bd,dk...h->b..."), ValueError, r"has shape with 2 axes"),
        (lambda: lm.Einsum((3, 2), "bd,dh->b..."), ValueError, r"or the kernel's have it"),
        (lambda: lm.Einsum((3, 2)), ValueError, r"einsum_str here, or build the layer with use"),
        (lambda: lm.Einsum((3, 2), "bd,dhk->bh"), ValueError, r"has shape with 2 axes"),
        (lambda: lm.Einsum((3, 2), "bd,dd->bd"), ValueError, r"one distinct letter per axis"),
        (lambda: lm.Einsum((3, 2), "bd,dh->bx"), ValueError, r"output's label 'x' is neither"),
        (lambda: lm.Einsum((3, 2), "bd,dh->bhh"), ValueError, r"must name each label once"),
        (lambda: lm.Einsum((3, 2), "b1,1h->bh"), ValueError, r"may only hold letters"),
        (lambda: lm.Einsum((3, 2), 5), TypeError, r"einsum_str must be a string"),
        (lambda: lm.Einsum(3, "d,dh->h"), TypeError, r"shape must be a non-empty tuple"),
        (lambda: lm.Einsum((3, 0), "bd,dh->bh"), ValueError, r"every entry of shape must be a"),
        (
            lambda: lm.Einsum((3, 2), "bd,dh->bh", preferred_element_type=jnp.int32),
            TypeError,
            r"preferred_element_type must be a floating or complex dtype",
        ),
    ],
)
def test_einsum_settings_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "equation, shape, match",
    [
        ("bd,dh->bh", (2, 3, 3), r"its subscripts 'bd' need 2 axes"),
        ("...bd,dh->...h", (3,), r"need at least 2 axes"),
        ("bd,dh->bh", (2, 4), r"its axis 'd' has size 4 but the kernel has 3"),
        ("dd,dh->h", (3, 2), r"its axis 'd' has size 2 but the kernel has 3"),
        ("bb,dh->bdh", (2, 3), r"its axis 'b' has size 3 but another axis of the input has 2"),
    ],
)
def test_einsum_input_errors(equation, shape, match):
    init, apply = lm.transform(lm.Einsum((3, 2), equation))
    with pytest.raises(ValueError, match=r"^Einsum\(shape=\(3, 2\), einsum_str=.*" + match):
        apply(init(jax.random.key(0)), None, jnp.ones(shape))


def test_einsum_equation_at_call_time_matches_linen(normal):
    x = normal((2, 3, 4))
    linen = nn.Einsum((3, 4, 6), use_bias=False)
    variables = linen.init(jax.random.key(0), x, "...d,...dh->...h")
    layer = lm.Einsum((3, 4, 6), use_bias=False)
    apply = lm.transform(layer).apply
    for equation in ["...d,...dh->...h", "abd,bdh->ah"]:
        expected = linen.apply(variables, x, equation)
        y, _ = apply(variables, None, x, equation)
        assert_close(y, expected, rtol=1e-5, atol=1e-5)
        jitted = jax.jit(lambda v, x, eq=equation: apply(v, None, x, eq)[0])
        assert_close(jitted(variables, x), expected, rtol=1e-5, atol=1e-5)


def test_einsum_equation_given_twice_or_never():
    built = lm.Einsum((3, 2), "bd,dh->bh")
    bare = lm.Einsum((3, 2), use_bias=False)
    with pytest.raises(ValueError, match=r"given both einsum_str when built and at call time"):
        lm.transform(built).apply(
            lm.transform(built).init(jax.random.key(0)), None, jnp.ones((2, 3)), "bd,dh->bh"
        )
    with pytest.raises(ValueError, match=r"given neither einsum_str when built and at call"):
        lm.transform(bare).apply(lm.transform(bare).init(jax.random.key(0)), None, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"its axis 'd' has size 4 but the kernel has 3"):
        lm.transform(bare).apply(
            lm.transform(bare).init(jax.random.key(0)), None, jnp.ones((2, 4)), "bd,dh->bh"
        )
