"""Metoryx's own test suite, rewritten for lamina (``import lamina as mx``).

Metoryx (the library of the seed `../shared/seeds/004_a6172f56ed72f6a5.txt`) tests its layers
against Flax Linen and its initializers by their shapes and values:
``metoryx/_src/linear_test.py``, ``normalization_test.py``, ``pool_test.py`` and
``initializers_test.py``. Every behaviour those files check is checked here, and so is the
behaviour of ``metoryx/_src/base.py`` (which has no test file of its own):
variables, transforms, random keys, `assign_variables`.

Where lamina differs from Metoryx's released code on purpose (it follows the seed article
and Linen), the test checks lamina's behaviour and that Metoryx's spelling fails with a clear
error instead of building a different model; each such test says what Metoryx does. The
section "Where lamina differs from Metoryx" of docs/coming-from.md lists every such difference.
"""

from __future__ import annotations

import collections

import flax.linen as linen
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from flax.core import unfreeze
from jax import lax

import lamina as mx
from tests.helpers import assert_close, layout, normal

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

RNG = np.random.default_rng(0)


def weights_for(model: mx.Module, theirs: linen.Module, *inputs) -> dict:
    """Random variables for `model`, after checking that they are `theirs` (Linen's) too.

    Names, shapes and dtypes of both libraries' variables are compared without computing them;
    the values are NumPy's (Linen's own `init` would compile its random initializers once per
    shape, most of these tests' time), and stand for "the same weights" in both libraries.
    """
    ours = jax.eval_shape(mx.init(model), jr.key(0))
    assert layout(ours) == layout(unfreeze(jax.eval_shape(theirs.init, jr.key(0), *inputs)))
    return jax.tree.map(lambda a: normal(RNG, *a.shape), ours)


# --------------------------------------------------------------------------------------
# linear_test.py: Conv, Dense, Embed against Linen, with Linen's variables
# --------------------------------------------------------------------------------------

# (name, Linen's Conv, lamina's Conv, input shape): Metoryx's seven cases, sizes consistent.
CONV_CASES = [
    ("default", dict(features=8, kernel_size=(2, 2)), mx.Conv(3, 8, (2, 2)), (4, 4, 4, 3)),
    (
        "nobias",
        dict(features=8, kernel_size=(3, 3), use_bias=False),
        mx.Conv(3, 8, (3, 3), use_bias=False),
        (4, 4, 4, 3),
    ),
    (
        "same_padding",
        dict(features=8, kernel_size=(3, 3), padding="SAME"),
        mx.Conv(3, 8, (3, 3), padding="SAME"),
        (2, 6, 6, 3),
    ),
    (
        "sequence_padding",
        dict(features=5, kernel_size=(3, 3), padding=((1, 2), (2, 1))),
        mx.Conv(4, 5, (3, 3), padding=((1, 2), (2, 1))),
        (2, 8, 8, 4),
    ),
    (
        "strides",
        dict(features=6, kernel_size=(3, 3), strides=(2, 2)),
        mx.Conv(3, 6, (3, 3), strides=(2, 2)),
        (2, 8, 8, 3),
    ),
    (
        "dilation",  # Linen's kernel_dilation is Metoryx's and lamina's `dilation`
        dict(features=7, kernel_size=(3, 3), kernel_dilation=(2, 2)),
        mx.Conv(3, 7, (3, 3), dilation=(2, 2)),
        (2, 10, 10, 3),
    ),
    (
        "groups",  # Linen's feature_group_count is Metoryx's and lamina's `groups`
        dict(features=12, kernel_size=(3, 3), feature_group_count=3),
        mx.Conv(6, 12, (3, 3), groups=3),
        (2, 5, 5, 6),
    ),
]


@pytest.mark.parametrize(
    "theirs, ours, shape", [c[1:] for c in CONV_CASES], ids=[c[0] for c in CONV_CASES]
)
def test_conv_matches_linen(theirs, ours, shape):
    x = normal(RNG, *shape)
    theirs = linen.Conv(**theirs)
    variables = weights_for(ours, theirs, x)
    got, new_variables = mx.apply(ours)(variables, None, x)
    assert_close(got, theirs.apply(variables, x))
    assert_close(new_variables, variables)


def test_conv_rejects_variables_of_another_shape():
    # Metoryx's own test_apply builds Conv(in_size=4, out_size=8, kernel_size=(3, 3)) but feeds
    # it the variables of Linen's Conv(features=3, kernel_size=(2, 2)) on 3 channels: Metoryx
    # never compares shapes, so the 2x2 kernel silently runs. lamina names every mismatch.
    x = normal(RNG, 4, 4, 4, 3)
    variables = jax.eval_shape(linen.Conv(features=3, kernel_size=(2, 2)).init, jr.key(2), x)
    apply = mx.apply(mx.Conv(in_size=4, out_size=8, kernel_size=(3, 3)))
    with pytest.raises(mx.VariablesError, match=r"params/kernel: expected \(3, 3, 4, 8\)"):
        apply(variables, None, x)


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_matches_linen(use_bias):
    x = normal(RNG, 4, 2)
    theirs = linen.Dense(features=3, use_bias=use_bias)
    layer = mx.Dense(in_size=2, out_size=3, use_bias=use_bias)  # Metoryx's keywords
    variables = weights_for(layer, theirs, x)
    got, _ = mx.apply(layer)(variables, None, x)
    assert_close(got, theirs.apply(variables, x))


def test_dense_compute_dtype_is_linens():
    # Metoryx casts only the kernel to `dtype` and lets `x @ kernel` promote (float32 input,
    # bfloat16 layer: float32 output); lamina casts every operand, as Linen does. (Storage
    # defaults to `dtype` in Metoryx and lamina, to float32 in Linen: given here.)
    x = normal(RNG, 4, 2)
    theirs = linen.Dense(3, dtype=jnp.bfloat16)
    ours = mx.Dense(2, 3, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    variables = weights_for(ours, theirs, x)
    expected = theirs.apply(variables, x)
    got, _ = mx.apply(ours)(variables, None, x)
    assert got.dtype == expected.dtype == jnp.bfloat16
    assert_close(got, expected)


def test_embed_declares_linens_table():
    # Metoryx: Embed(size=5, num_embeddings=10). With keywords the same call builds the same
    # table in lamina; lamina's positional order is Linen's and PyTorch's, (num_embeddings, size).
    assert mx.Embed(size=5, num_embeddings=10).embedding.shape == (10, 5)
    assert mx.Embed(10, 5).embedding.shape == (10, 5)


def test_embed_matches_linen():
    ids = jnp.asarray(RNG.integers(0, 10, size=(4,)), jnp.int32)
    theirs, ours = linen.Embed(num_embeddings=10, features=5), mx.Embed(size=5, num_embeddings=10)
    variables = weights_for(ours, theirs, ids)
    got, _ = mx.apply(ours)(variables, None, ids)
    assert_close(got, theirs.apply(variables, ids))


def test_embed_attend_matches_linen():
    # Metoryx's direction: lamina's init, Linen's attend, and apply with a method picker.
    embed = mx.Embed(size=5, num_embeddings=10)
    variables = mx.init(embed)(jr.key(2))
    query = normal(RNG, 4, 5)
    query = query / jnp.sum(query, axis=-1, keepdims=True)
    expected = linen.apply(lambda m, q: m.attend(q), linen.Embed(10, 5))(variables, query)
    got, _ = mx.apply(embed, lambda m: m.attend)(variables, None, query)
    assert_close(got, expected)


def test_embed_in_metoryx_positional_order_fails_clearly():
    # Metoryx's Embed(5, 10) is size=5, num_embeddings=10; lamina's is a table of 5 rows of
    # size 10. That model does not run silently: its variables, ids and outputs do not fit.
    class Model(mx.Module):
        def __init__(self, size, vocab):
            super().__init__()
            self.embed = mx.Embed(size, vocab)  # Metoryx's order
            self.out = mx.Dense(size, 2)

        def __call__(self, ids):
            return self.out(self.embed(ids))

    init, apply = mx.transform(Model(5, 10))
    ids = jnp.array([1, 2])
    with pytest.raises(ValueError, match=r"Dense\(in_size=5, out_size=2\).*10"):
        apply(init(jr.key(0)), None, ids)
    with pytest.raises(ValueError, match=r"Dense\(in_size=5, out_size=2\).*10"):
        jax.jit(apply)(init(jr.key(0)), None, ids)  # shapes are checked under jit too
    with pytest.raises(ValueError, match=r"got id 7: ids must be in \[0, 5\)"):
        mx.apply(mx.Embed(5, 10))(mx.init(mx.Embed(5, 10))(jr.key(0)), None, jnp.array([7]))
    metoryx_table = {"params": {"embedding": jnp.ones((10, 5))}}  # Metoryx's Embed(5, 10)
    with pytest.raises(mx.VariablesError, match=r"expected \(5, 10\), got \(10, 5\)"):
        mx.apply(mx.Embed(5, 10))(metoryx_table, None, ids)


# Metoryx's options are positional-or-keyword; lamina's are keyword-only after the sizes, so a
# positional option is a TypeError rather than, say, a Dense without a bias.
@pytest.mark.parametrize(
    "build",
    [
        lambda: mx.Dense(2, 3, False),  # Metoryx: use_bias=False
        lambda: mx.Conv(3, 8, (3, 3), "VALID"),  # Metoryx: padding="VALID"
        lambda: mx.Embed(10, 5, mx.initializers.zeros()),  # Metoryx: embedding_init
        lambda: mx.BatchNorm(8, 0.9),  # Metoryx: momentum=0.9
        lambda: mx.LayerNorm(8, 1e-5),  # Metoryx: epsilon=1e-5
        lambda: mx.RMSNorm(8, 1e-5),  # Metoryx: epsilon=1e-5
    ],
    ids=["Dense", "Conv", "Embed", "BatchNorm", "LayerNorm", "RMSNorm"],
)
def test_positional_options_are_type_errors(build):
    with pytest.raises(TypeError, match="positional argument"):
        build()


# --------------------------------------------------------------------------------------
# normalization_test.py: BatchNorm, LayerNorm, RMSNorm against Linen
# --------------------------------------------------------------------------------------

NORM_OPTIONS = [{}, {"use_scale": False}, {"use_bias": False}]
NORM_IDS = ["default", "noscale", "nobias"]


@pytest.mark.parametrize("options", NORM_OPTIONS, ids=NORM_IDS)
def test_batch_norm_training_matches_linen(options):
    x = normal(RNG, 4, 8)
    theirs = linen.BatchNorm(use_running_average=False, **options)
    variables = unfreeze(theirs.init(jr.key(2), x))
    expected, expected_updates = theirs.apply(variables, x, mutable=True)
    # Metoryx's call: apply(bn)(variables, None, x, is_training=True)
    got, updates = mx.apply(mx.BatchNorm(size=8, **options))(variables, None, x, is_training=True)
    assert_close(got, expected)
    assert_close(updates, unfreeze(expected_updates))  # every collection, stats updated


def test_batch_norm_evaluation_matches_linen():
    x = normal(RNG, 4, 8)
    theirs = linen.BatchNorm()
    variables = theirs.init(jr.key(2), x, use_running_average=False)
    _, variables = theirs.apply(variables, x, use_running_average=False, mutable=True)
    variables = unfreeze(variables)
    expected = theirs.apply(variables, x, use_running_average=True)
    got, unchanged = mx.apply(mx.BatchNorm(size=8))(variables, None, x, is_training=False)
    assert_close(got, expected)
    assert_close(unchanged, variables)  # evaluation writes nothing


def test_batch_norm_vmapped_with_axis_name_matches_linen():
    x = normal(RNG, 4, 4, 8)
    theirs = linen.BatchNorm(axis_name="batch", use_running_average=False)
    variables = unfreeze(jax.vmap(theirs.init)(jr.split(jr.key(2), 4), x))
    linen_apply = linen.apply(lambda m, v: m(v), theirs, mutable=True)
    expected, expected_updates = jax.vmap(linen_apply, axis_name="batch")(variables, x)
    apply = mx.apply(mx.BatchNorm(size=8, axis_name="batch"))
    got, updates = jax.vmap(
        lambda v, inputs: apply(v, None, inputs, is_training=True), axis_name="batch"
    )(variables, x)
    assert_close(got, expected)
    assert_close(updates, unfreeze(expected_updates))


def test_batch_norm_has_no_default_mode():
    # Metoryx's `bn(x)` means `bn(x, is_training=False)`; lamina asks for the mode, since
    # forgetting it while training would silently normalise with the running averages.
    variables = mx.init(mx.BatchNorm(8))(jr.key(0))
    with pytest.raises(TypeError, match="is_training"):
        mx.apply(mx.BatchNorm(8))(variables, None, jnp.ones((4, 8)))


@pytest.mark.parametrize("options", NORM_OPTIONS, ids=NORM_IDS)
def test_layer_norm_matches_linen(options):
    x = normal(RNG, 4, 8)
    theirs = linen.LayerNorm(**options)
    variables = unfreeze(theirs.init(jr.key(2), x))
    got, _ = mx.apply(mx.LayerNorm(size=8, **options))(variables, None, x)
    assert_close(got, theirs.apply(variables, x))


@pytest.mark.parametrize("options", NORM_OPTIONS[:2], ids=NORM_IDS[:2])
def test_rms_norm_matches_linen(options):
    x = normal(RNG, 4, 8)
    theirs = linen.RMSNorm(**options)
    variables = unfreeze(theirs.init(jr.key(2), x))
    got, _ = mx.apply(mx.RMSNorm(size=8, **options))(variables, None, x)
    assert_close(got, theirs.apply(variables, x))


# --------------------------------------------------------------------------------------
# pool_test.py: max_pool and avg_pool against Linen; min_pool
# --------------------------------------------------------------------------------------

# (name, input shape, window, strides, padding); strides=2 is Metoryx's "single stride" case.
POOL_CASES = [
    ("basic", (2, 8, 8, 3), (2, 2), (2, 2), "VALID"),
    ("same_padding", (2, 7, 7, 3), (3, 3), (2, 2), "SAME"),
    ("non_square_kernel", (2, 8, 6, 3), (3, 2), (2, 1), "VALID"),
    ("single_stride", (2, 8, 8, 3), (2, 2), 2, "VALID"),
    ("large_kernel", (2, 8, 8, 3), (4, 4), (4, 4), "VALID"),
    ("overlapping_windows", (2, 8, 8, 3), (3, 3), (1, 1), "VALID"),
]


@pytest.mark.parametrize("kind", ["max_pool", "avg_pool"])
@pytest.mark.parametrize(
    "shape, window, strides, padding", [c[1:] for c in POOL_CASES], ids=[c[0] for c in POOL_CASES]
)
def test_pool_matches_linen(kind, shape, window, strides, padding):
    x = normal(RNG, *shape)
    linen_strides = (strides,) * len(window) if isinstance(strides, int) else strides
    with jax.numpy_dtype_promotion("standard"):  # Linen's avg_pool divides by an int32
        expected = getattr(linen, kind)(x, window, strides=linen_strides, padding=padding)
    got = getattr(mx, kind)(x, kernel_size=window, strides=strides, padding=padding)
    assert_close(got, expected)


def test_min_pool_takes_each_windows_minimum():
    x = normal(RNG, 2, 4, 4, 3)
    got = mx.min_pool(x, kernel_size=(2, 2), strides=(2, 2))
    assert got.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(got[0, 0, 0, 0], x[0, 0:2, 0:2, 0].min())
    windows = x.reshape(2, 2, 2, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(2, 2, 2, 4, 3)
    np.testing.assert_array_equal(got, windows.min(axis=3))
    # Linen has no min_pool; its generic pool with lax.min is the reference.
    assert_close(got, linen.pool(x, jnp.inf, lax.min, (2, 2), (2, 2), "VALID"))


@pytest.mark.parametrize(
    "shape, window, strides, padding, out_shape",
    [
        ((2, 3, 3, 2), (2, 2), (2, 2), "SAME", (2, 2, 2, 2)),
        ((2, 4, 6, 3), (2, 3), (2, 3), "VALID", (2, 2, 2, 3)),
    ],
    ids=["same_padding", "non_square_kernel"],
)
def test_min_pool_shapes(shape, window, strides, padding, out_shape):
    x = normal(RNG, *shape)
    got = mx.min_pool(x, kernel_size=window, strides=strides, padding=padding)
    assert got.shape == out_shape
    assert_close(got, linen.pool(x, jnp.inf, lax.min, window, strides, padding))


def test_generic_pool_matches_linen():
    # Metoryx's pool(input, init, computation, kernel_size, strides, padding) is Linen's
    # pool(inputs, init, reduce_fn, window_shape, strides, padding) and lamina's, positionally.
    x = normal(RNG, 2, 6, 6, 3)
    got = mx.pool(x, 0.0, lax.add, (3, 3), (1, 1), ((1, 1), (0, 2)))
    assert_close(got, linen.pool(x, 0.0, lax.add, (3, 3), (1, 1), ((1, 1), (0, 2))))
    with pytest.raises(TypeError, match="computation"):  # Metoryx's keyword is reduce_fn here
        mx.pool(x, 0.0, computation=lax.add, kernel_size=(3, 3))


def test_pool_strides_default_to_one():
    # Metoryx's max/avg/min_pool require strides; lamina's default to 1, as Linen's.
    x = normal(RNG, 1, 5, 5, 2)
    assert_close(mx.max_pool(x, (2, 2)), mx.max_pool(x, (2, 2), strides=1))
    assert mx.avg_pool(x, (2, 2)).shape == (1, 4, 4, 2)


# --------------------------------------------------------------------------------------
# initializers_test.py: every factory, its settings, and its values
# --------------------------------------------------------------------------------------

KEY = jr.PRNGKey(0)

# fmt: off
SCALING_INITIALIZERS = (
    "glorot_normal", "glorot_uniform", "he_normal", "he_uniform", "kaiming_normal",
    "kaiming_uniform", "lecun_normal", "lecun_uniform", "xavier_normal", "xavier_uniform",
)
# fmt: on

# (factory, its arguments, the shape it is tested on): Metoryx's cases, dtype aside.
INIT_CASES = [
    ("constant", dict(value=5.0), (3, 4)),
    ("normal", dict(), (10, 20)),
    ("normal", dict(stddev=0.05), (10, 20)),
    ("uniform", dict(), (10, 20)),
    ("uniform", dict(scale=0.1), (10, 20)),
    ("truncated_normal", dict(), (100, 100)),
    ("truncated_normal", dict(stddev=0.05, lower=-1.0, upper=1.0), (100, 100)),
    ("orthogonal", dict(), (20, 20)),
    ("orthogonal", dict(scale=2.0, column_axis=-1), (20, 20)),
    ("delta_orthogonal", dict(), (8, 8, 3, 3)),
    ("delta_orthogonal", dict(scale=2.0, column_axis=-1), (8, 8, 3, 3)),
    ("variance_scaling", dict(scale=2.0, mode="fan_out", distribution="normal"), (10, 20)),
    (
        "variance_scaling",
        dict(scale=1.0, mode="fan_avg", distribution="uniform", in_axis=-2, out_axis=-1),
        (10, 20),
    ),
    *(
        (name, options, (10, 20))
        for name in SCALING_INITIALIZERS
        for options in (dict(), dict(in_axis=-2, out_axis=-1, batch_axis=()))
    ),
]


@pytest.mark.parametrize(
    "name, options, shape",
    INIT_CASES,
    ids=[f"{n}-{'-'.join(o) or 'defaults'}" for n, o, _ in INIT_CASES],
)
def test_initializer_is_jaxs(name, options, shape):
    init = getattr(mx.initializers, name)(**options)
    params = init(KEY, shape)
    assert params.shape == shape and params.dtype == jnp.float32
    # Metoryx's initializers are jax.nn.initializers'; lamina's make the same arrays.
    np.testing.assert_array_equal(params, getattr(jax.nn.initializers, name)(**options)(KEY, shape))


@pytest.mark.parametrize("name, value", [("zeros", 0.0), ("ones", 1.0)])
def test_zeros_and_ones(name, value):
    init = getattr(mx.initializers, name)()
    params = init(KEY, (3, 4))
    assert params.shape == (3, 4) and params.dtype == jnp.float32
    np.testing.assert_array_equal(params, value)
    # The dtype is the call's (as a variable's declaration passes it), ints included.
    params = init(KEY, (3, 4), jnp.int32)
    assert params.dtype == jnp.int32
    np.testing.assert_array_equal(params, int(value))


def test_initializer_values():
    np.testing.assert_array_equal(mx.initializers.constant(5.0)(KEY, (3, 4)), 5.0)
    assert abs(float(jnp.std(mx.initializers.normal(stddev=0.05)(KEY, (10, 20)))) - 0.05) < 0.01
    for scale in (0.01, 0.1):
        params = mx.initializers.uniform(scale=scale)(KEY, (10, 20))
        assert float(params.min()) >= -scale and float(params.max()) <= scale
    params = mx.initializers.truncated_normal(stddev=0.05, lower=-1.0, upper=1.0)(KEY, (100, 100))
    assert float(params.min()) >= -1.0 and float(params.max()) <= 1.0
    q = mx.initializers.orthogonal(scale=2.0)(KEY, (20, 20))
    assert_close(q.T @ q, 4.0 * jnp.eye(20), atol=1e-5)


# Metoryx's factories take the dtype of the arrays they make: zeros(dtype=jnp.int32), the
# dtype of a call that names none (a variable's declaration always names its own).
@pytest.mark.parametrize(
    "name, args, dtype",
    [
        ("constant", (2.5,), jnp.float32),
        ("zeros", (), jnp.int32),
        ("ones", (), jnp.int32),
        ("normal", (0.05,), jnp.float32),
        ("uniform", (0.1,), jnp.float32),
        ("glorot_normal", (), jnp.float32),
        ("xavier_normal", (), jnp.float32),
        ("xavier_uniform", (), jnp.float32),
    ],
)
def test_initializer_factory_dtype(name, args, dtype):
    params = getattr(mx.initializers, name)(*args, dtype=dtype)(KEY, (10, 20))
    assert params.dtype == dtype


def test_variance_scaling_defaults():
    init = mx.initializers.variance_scaling(scale=2.0)
    expected = jax.nn.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")
    np.testing.assert_array_equal(init(KEY, (10, 20)), expected(KEY, (10, 20)))


def test_truncated_normal_takes_the_dtype_second():
    # jax.nn.initializers' order and Metoryx's: (stddev, dtype, lower, upper)
    init = mx.initializers.truncated_normal(0.05, jnp.bfloat16)
    expected = jax.nn.initializers.truncated_normal(0.05, jnp.bfloat16)(KEY, (10, 20))
    np.testing.assert_array_equal(init(KEY, (10, 20)), expected)
    with pytest.raises(TypeError, match=r"^truncated_normal: dtype must be a dtype .* got -3\.0"):
        mx.initializers.truncated_normal(0.05, -3.0)  # an old positional `lower`
    with pytest.raises(TypeError, match=r"^normal: stddev must be a real number"):
        mx.initializers.normal(jnp.float32)


# --------------------------------------------------------------------------------------
# base.py: variables, transforms, random keys, assign_variables
# --------------------------------------------------------------------------------------


def test_parameter_and_state_declarations():
    # The article's order, State(collection, shape, init) and Parameter(shape, init).
    p = mx.Parameter((3, 4), mx.initializers.lecun_normal())
    assert (p.collection, p.shape, p.mutable, p.ndim) == ("params", (3, 4), False, 2)
    s = mx.State("some_states", (4,), mx.initializers.zeros(), mutable=True)
    assert (s.collection, s.shape, s.mutable) == ("some_states", (4,), True)
    assert s.dtype == s.param_dtype == jnp.float32


@pytest.mark.parametrize(
    "build",
    [
        lambda: mx.Parameter(mx.initializers.zeros(), (3,)),
        lambda: mx.Parameter(jax.nn.initializers.zeros, (3,)),
        lambda: mx.State("some_states", mx.initializers.zeros(), (3,), mutable=True),
    ],
    ids=["Parameter", "Parameter-jax-init", "State"],
)
def test_metoryx_argument_order_is_a_clear_error(build):
    # Metoryx's released code: Parameter(init, shape), State(collection, init, shape).
    with pytest.raises(TypeError, match="shape must be a tuple of ints, got"):
        build()


def test_metoryx_argument_order_by_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="multiple values for argument 'shape'"):
        mx.Parameter(mx.initializers.zeros(), shape=(3,))


class Stateful(mx.Module):
    """A parameter stored in float32 and read in bfloat16, and a mutable counter."""

    def __init__(self):
        super().__init__()
        self.w = mx.Parameter((2, 2), mx.initializers.constant(2.0), jnp.bfloat16, jnp.float32)
        self.count = mx.State("counters", (2, 2), mx.initializers.ones(), mutable=True)

    def __call__(self, x):
        w = self.w.value
        assert w.dtype == jnp.bfloat16  # read in `dtype`
        self.count += x  # the in-place operators write a mutable state
        self.count *= 2.0
        self.count -= 1.0
        self.count /= 2.0
        return self.count @ x


def test_state_values_in_init_and_apply():
    init, apply = mx.transform(Stateful())
    variables = init(jr.PRNGKey(0))
    assert layout(variables) == {
        "counters": {"count": ((2, 2), jnp.float32)},
        "params": {"w": ((2, 2), jnp.float32)},  # stored in `param_dtype`
    }
    x = jnp.full((2, 2), 3.0)
    out, new = apply(variables, None, x)
    np.testing.assert_allclose(new["counters"]["count"], 3.5)  # ((1 + 3) * 2 - 1) / 2
    np.testing.assert_allclose(out, 21.0)
    assert_close(new["params"], variables["params"])  # parameters come back unchanged


def test_state_operators_act_on_the_value():
    class Ops(mx.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.Parameter((2, 2), mx.initializers.constant(2.0))

        def __call__(self, x):
            w = self.w  # the declaration itself, not its .value
            results = [w + x, x + w, w - x, x - w, w * x, x * w, w / x, x / w]
            results += [w // x, x // w, w**x, x**w, w @ x, x @ w, w.T, jnp.asarray(w)]
            return jnp.stack(results)

    out, _ = mx.transform(Ops()).apply(mx.init(Ops())(KEY), None, jnp.full((2, 2), 3.0))
    w, x = np.full((2, 2), 2.0), np.full((2, 2), 3.0)
    expected = [w + x, x + w, w - x, x - w, w * x, x * w, w / x, x / w]
    expected += [w // x, x // w, w**x, x**w, w @ x, x @ w, w.T, w]
    np.testing.assert_allclose(out, np.stack(expected), rtol=1e-6)


def test_value_outside_a_call():
    p = mx.Parameter((10, 10), mx.initializers.zeros())
    with pytest.raises(RuntimeError, match="no value outside init/apply"):  # as Metoryx
        p.value  # noqa: B018
    p.value = jnp.ones((10, 10))  # replaces the initializer
    np.testing.assert_array_equal(p.init(None, (10, 10), jnp.float32), 1.0)
    with pytest.raises(ValueError, match=r"shape \(10, 9\).*\(10, 10\)"):
        p.value = jnp.ones((10, 9))


class Writes(mx.Module):
    def __init__(self):
        super().__init__()
        self.w = mx.Parameter((2,), mx.initializers.zeros())
        self.frozen = mx.State("some_states", (2,), mx.initializers.zeros(), mutable=False)
        self.live = mx.State("some_states", (2,), mx.initializers.zeros(), mutable=True)

    def __call__(self, name, value):
        getattr(self, name).value = value


@pytest.mark.parametrize("name, path", [("w", "params/w"), ("frozen", "some_states/frozen")])
def test_writing_an_immutable_variable_fails(name, path):
    # Metoryx raises RuntimeError("Cannot set value of an immutable variable."); lamina's
    # ImmutableVariableError is an AttributeError (the attribute is read-only in a call).
    init, apply = mx.transform(Writes())
    with pytest.raises(mx.ImmutableVariableError, match=f"{path} is immutable"):
        apply(init(KEY), None, name, jnp.ones(2))


def test_writing_a_mutable_state():
    init, apply = mx.transform(Writes())
    _, new = apply(init(KEY), None, "live", jnp.ones(2))
    np.testing.assert_array_equal(new["some_states"]["live"], 1.0)
    # Metoryx stores any array; lamina checks its shape against the declaration.
    with pytest.raises(ValueError, match=r"shape \(3,\) to State at some_states/live"):
        apply(init(KEY), None, "live", jnp.ones(3))


def test_apply_needs_every_variable():
    # Metoryx: ValueError "Array for State with id ... is not found" when the state is read.
    init, apply = mx.transform(mx.Dense(2, 3))
    variables = init(KEY)
    del variables["params"]["bias"]
    with pytest.raises(mx.VariablesError, match=r"missing.*params/bias"):
        apply(variables, None, jnp.ones((1, 2)))
    assert issubclass(mx.VariablesError, ValueError)


def test_variable_paths_follow_the_module_tree():
    # Metoryx's get_states: attributes by name, list and tuple items by index, dict entries
    # by str(key); attributes that hold no variables (None) are absent.
    class Tree(mx.Module):
        def __init__(self):
            super().__init__()
            self.layers = [mx.Dense(1, 2), mx.Dense(2, 3)]
            self.pair = (mx.Parameter((1,), mx.initializers.zeros()),)
            self.table = {"a": mx.Dense(1, 4), 3: mx.Dense(1, 5)}
            self.nothing = None

    assert jax.tree.map(jnp.shape, mx.init(Tree())(KEY)) == {
        "params": {
            "layers": {
                "0": {"bias": (2,), "kernel": (1, 2)},
                "1": {"bias": (3,), "kernel": (2, 3)},
            },
            "pair": {"0": (1,)},
            "table": {"3": {"bias": (5,), "kernel": (1, 5)}, "a": {"bias": (4,), "kernel": (1, 4)}},
        }
    }


def test_a_deque_of_layers_is_a_clear_error():
    # Metoryx's get_states also walks collections.deque; lamina asks for a list or dict.
    class Queue(mx.Module):
        def __init__(self):
            super().__init__()
            self.q = collections.deque([mx.Dense(1, 3)])

    with pytest.raises(TypeError, match="q is a deque that holds a Dense"):
        mx.init(Queue())(KEY)


def test_a_module_without_super_init():
    # Metoryx's Module is a bare class (its Embed never calls super().__init__()).
    class NoSuper(mx.Module):
        def __init__(self):
            self.dense = mx.Dense(2, 2)

        def __call__(self, x):
            return self.dense(x)

    init, apply = mx.transform(NoSuper())
    assert apply(init(KEY), None, jnp.ones((1, 2)))[0].shape == (1, 2)


def test_assign_variables_copies_the_model():
    model = mx.Dense(2, 3)
    pretrained = {"params": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
    assigned = mx.assign_variables(model, pretrained)
    np.testing.assert_array_equal(mx.init(assigned)(KEY)["params"]["bias"], 1.0)
    np.testing.assert_array_equal(mx.init(model)(KEY)["params"]["bias"], 0.0)  # untouched
    # Metoryx's tree.map needs the same structure; lamina names what differs.
    with pytest.raises(mx.VariablesError, match=r"missing.*params/bias"):
        mx.assign_variables(model, {"params": {"kernel": jnp.ones((2, 3))}})
    with pytest.raises(mx.VariablesError, match=r"params/kernel: expected \(2, 3\), got \(3, 2\)"):
        mx.assign_variables(model, {"params": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(3)}})


def test_init_apply_and_transform_snapshot_the_model():
    model = mx.Dense(2, 3)
    init, apply = mx.init(model), mx.apply(model)
    transformed = mx.transform(model)
    assert isinstance(transformed, mx.Transformed) and transformed._fields == ("init", "apply")
    model.kernel.value = jnp.zeros((2, 3))  # after the transforms: no effect on them
    for make in (init, transformed.init):
        assert float(jnp.abs(make(KEY)["params"]["kernel"]).sum()) > 0
    variables = init(KEY)
    got, new = apply(variables, None, jnp.ones((1, 2)))
    assert_close(got, transformed.apply(variables, None, jnp.ones((1, 2)))[0])
    assert jax.tree.structure(new) == jax.tree.structure(variables)  # every collection


def test_transform_picks_the_method():
    # Metoryx: transform(module, fn) and apply(module, fn); the article: to_callable=.
    embed = mx.Embed(10, 5)
    variables = mx.init(embed)(KEY)
    query = jnp.ones((2, 5))
    for apply in (
        mx.transform(embed, lambda m: m.attend).apply,
        mx.transform(embed, to_callable=lambda m: m.attend).apply,
        mx.apply(embed, lambda m: m.attend),
        mx.apply(embed, fn=lambda m: m.attend),
    ):
        assert apply(variables, None, query)[0].shape == (2, 10)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fn'"):
        mx.transform(embed, fn=lambda m: m.attend)


def test_a_module_without_call_needs_a_method():
    class Holder(mx.Module):
        def __init__(self):
            super().__init__()
            self.dense = mx.Dense(2, 2)

    variables = mx.init(Holder())(KEY)  # init never runs the model
    # Metoryx: ValueError("Module is not callable.") when apply is made; lamina: at the call.
    with pytest.raises(TypeError, match=r"Holder has no __call__ method.*to_callable"):
        mx.apply(Holder())(variables, None, jnp.ones(2))
    assert mx.apply(Holder(), lambda m: m.dense)(variables, None, jnp.ones(2))[0].shape == (2,)


def test_attribute_writes_during_a_call_are_errors():
    # Metoryx deep-copies the model on every call, so `self.calls += 1` is silently lost;
    # lamina freezes the model during a call and says how to keep state.
    class Counter(mx.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return x

    with pytest.raises(mx.FrozenModuleError, match=r"cannot set attribute 'calls'.*mutable=True"):
        mx.transform(Counter()).apply({}, None, 1.0)


class Draws(mx.Module):
    def __call__(self, *requests):
        return [mx.next_rng_key(*r[:2], strict=r[2] if len(r) > 2 else False) for r in requests]


DRAW = mx.transform(Draws()).apply


def test_next_rng_key_streams():
    # rngs: a key, a dict of named keys, or PRNGKeys(default, **named); names fall back to
    # the default key unless strict.
    (default,), _ = DRAW({}, jr.PRNGKey(1), (None,))
    (named,), _ = DRAW({}, {"noise": jr.PRNGKey(1)}, ("noise",))
    np.testing.assert_array_equal(default, named)
    keys = mx.PRNGKeys(jr.PRNGKey(1), noise=jr.PRNGKey(2))
    (a, b, c), _ = DRAW({}, keys, (None,), ("noise",), ("foo",))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)  # every draw is fresh
    np.testing.assert_array_equal(DRAW({}, {"noise": jr.PRNGKey(2)}, ("noise",))[0][0], b)
    (split,), _ = DRAW({}, jr.PRNGKey(1), (None, 3))
    assert split.shape == (3, 2)
    (split,), _ = DRAW({}, jr.PRNGKey(1), (None, (2, 3)))
    assert split.shape == (2, 3, 2)


@pytest.mark.parametrize(
    "rngs, request_, match",
    [
        (None, (None,), r"next_rng_key\(\) found no key"),
        ({"x": jr.PRNGKey(0)}, ("y",), r"next_rng_key\('y'\) found no key"),
        ({"x": jr.PRNGKey(0)}, ("y", None, True), r"strict=True\): this call has no 'y'"),
    ],
    ids=["no-keys", "no-default", "strict"],
)
def test_next_rng_key_without_a_key(rngs, request_, match):
    with pytest.raises(mx.RngError, match=match):  # a ValueError, as Metoryx's
        DRAW({}, rngs, request_)
    assert issubclass(mx.RngError, ValueError)


def test_next_rng_key_outside_a_call():
    with pytest.raises(RuntimeError, match="outside init/apply"):  # as Metoryx
        mx.next_rng_key()


def test_default_is_not_a_reserved_stream_name():
    # Metoryx keeps the default key under "__default__" and refuses that name; lamina's
    # default stream has no user-visible name, so "__default__" is an ordinary stream.
    keys = mx.PRNGKeys(jr.PRNGKey(0), __default__=jr.PRNGKey(1))
    (named,), _ = DRAW({}, keys, ("__default__",))
    (other,), _ = DRAW({}, {"__default__": jr.PRNGKey(1)}, ("__default__",))
    np.testing.assert_array_equal(named, other)


def test_metoryx_top_level_names_exist():
    # fmt: off
    metoryx_all = [
        "initializers", "utils", "init", "apply", "transform", "checkpoint", "Module", "State",
        "Parameter", "PRNGKeys", "next_rng_key", "assign_variables", "Dense", "Conv", "Embed",
        "BatchNorm", "LayerNorm", "RMSNorm", "avg_pool", "max_pool", "min_pool", "dropout",
        "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_tanh", "identity",
        "leaky_relu", "log_sigmoid", "log_softmax", "mish", "one_hot", "relu", "relu6", "selu",
        "sigmoid", "silu", "soft_sign", "softmax", "softplus", "sparse_plus", "sparse_sigmoid",
        "squareplus", "standardize",
    ]
    # fmt: on
    assert [name for name in metoryx_all if not hasattr(mx, name)] == []
    # fmt: off
    initializers = [
        "Initializer", "constant", "delta_orthogonal", "glorot_normal", "glorot_uniform",
        "he_normal", "he_uniform", "kaiming_normal", "kaiming_uniform", "lecun_normal",
        "lecun_uniform", "normal", "ones", "orthogonal", "truncated_normal", "uniform",
        "variance_scaling", "xavier_normal", "xavier_uniform", "zeros",
    ]
    # fmt: on
    assert [name for name in initializers if not hasattr(mx.initializers, name)] == []
    assert hasattr(mx.utils, "AverageMeter")


def test_metoryx_nn_namespace():
    names = ["Module", "Conv", "Dense", "Embed", "BatchNorm", "avg_pool", "max_pool"]
    names += ["min_pool", "relu", "gelu", "softmax", "initializers"]
    assert [name for name in names if not hasattr(mx.nn, name)] == []


def test_metoryx_attribute_names_point_to_lamina_names():
    state = mx.State("some_states", (3,), mx.initializers.zeros(), mutable=True)
    with pytest.raises(AttributeError, match=r"no attribute 'col' \(Metoryx's \.col is "):
        _ = state.col
    with pytest.raises(AttributeError, match=r"no attribute 'reshape' outside init/apply"):
        _ = state.reshape


def test_metoryx_apply_takes_to_callable_or_fn():
    class Twice(mx.Module):
        def __init__(self):
            super().__init__()
            self.dense = mx.Dense(3, 2)

        def __call__(self, x):
            return self.dense(x)

        def forward(self, x):
            return 2 * self.dense(x)

    model, x = Twice(), jnp.ones((1, 3))
    variables = mx.init(model)(jax.random.key(0))
    plain, _ = mx.apply(model)(variables, None, x)
    by_name, _ = mx.apply(model, to_callable=lambda m: m.forward)(variables, None, x)
    by_fn, _ = mx.apply(model, fn=lambda m: m.forward)(variables, None, x)
    np.testing.assert_allclose(by_name, 2 * plain, rtol=1e-6)
    np.testing.assert_array_equal(by_fn, by_name)
    with pytest.raises(TypeError, match="got both fn and to_callable"):
        mx.apply(model, lambda m: m.forward, to_callable=lambda m: m.forward)


def test_a_method_picker_that_is_not_callable_is_an_error_when_built():
    model = mx.Dense(3, 2)
    with pytest.raises(TypeError, match=r"lm.apply: to_callable must be a function .* got int 3"):
        mx.apply(model, to_callable=3)
    with pytest.raises(TypeError, match=r"lm.apply: fn must be a function .* got str 'forward'"):
        mx.apply(model, "forward")
    with pytest.raises(TypeError, match=r"lm.transform: to_callable must be a function .* int 3"):
        mx.transform(model, 3)
