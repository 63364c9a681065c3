"""Pooling against Flax Linen: `max_pool`, `min_pool`, `avg_pool` and the generic `pool`.

Values and gradients equal Linen's `pooling` module's, `count_include_pad` in every padding mode,
int windows and strides, complex inputs; every error a user can cause. Linen's pooling is not
clean under strict dtype promotion (``y / np.prod(window)``), so its side runs under standard
promotion.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import pooling
from jax import lax

import lamina as lm
from tests.helpers import assert_close, normal

POOLS = [
    ((2, 2), (2, 2), "VALID"),
    ((3, 3), (1, 1), "SAME"),
    ((3,), (2,), "SAME"),
    ((2, 2, 2), None, "VALID"),
    ((3, 2), (2, 1), ((1, 1), (0, 1))),
]


@pytest.mark.parametrize(("window", "strides", "padding"), POOLS)
@pytest.mark.parametrize("kind", ["max", "min", "avg"])
def test_pools_equal_linen(getkey, kind, window, strides, padding):
    x = jax.random.normal(getkey(), (2, *([6] * len(window)), 3))
    ours = getattr(lm, f"{kind}_pool")(x, window, strides, padding)
    g_ours = jax.grad(lambda v: getattr(lm, f"{kind}_pool")(v, window, strides, padding).sum())(x)
    with jax.numpy_dtype_promotion("standard"):  # Linen's pooling is not strict-dtype clean
        theirs = getattr(pooling, f"{kind}_pool")(x, window, strides, padding)
        g_theirs = jax.grad(
            lambda v: getattr(pooling, f"{kind}_pool")(v, window, strides, padding).sum()
        )(x)
    assert_close(ours, theirs)
    assert_close(g_ours, g_theirs)


def test_avg_pool_without_padding_counts(getkey):
    x = jax.random.normal(getkey(), (1, 5, 5, 2))
    assert_close(
        lm.avg_pool(x, (3, 3), padding="SAME", count_include_pad=False),
        nn.avg_pool(x, (3, 3), padding="SAME", count_include_pad=False),
    )


def test_pool_unbatched_and_integer_input():
    x = jnp.arange(16).reshape(4, 4, 1)
    np.testing.assert_array_equal(lm.max_pool(x, (2, 2), (2, 2))[..., 0], [[5, 7], [13, 15]])
    np.testing.assert_array_equal(lm.min_pool(x, (2, 2), (2, 2))[..., 0], [[0, 2], [8, 10]])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kernel_size": ()}, r"kernel_size \(\) has 0 entries; it must have at least 1"),
        ({"kernel_size": (2, 2, 2, 2)}, r"needs input of shape \(batch\.\.\., 4 spatial axes"),
        ({"kernel_size": (2, 2), "strides": (1,)}, "has 1 entries but kernel_size has 2"),
        ({"kernel_size": (2, 2), "padding": "FULL"}, r"unknown padding 'FULL'; use one of 'SAME'"),
        ({"kernel_size": (2, 2), "padding": ((1, 1),)}, r"has 1 \(low, high\) pairs but"),
    ],
)
def test_pool_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lm.max_pool(jnp.ones((1, 4, 4, 1)), **kwargs)


# --- the generic pool, count_include_pad, int windows, complex inputs -----------------------------


PADDINGS = ["VALID", "SAME", ((1, 0), (0, 2))]


def linen(fn, *args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
        return fn(*args, **kwargs)


@pytest.fixture
def x():
    return normal(np.random.default_rng(0), 2, 5, 6, 3)


@pytest.mark.parametrize("padding", PADDINGS, ids=["valid", "same", "pairs"])
def test_pool_equals_linens_for_any_reduction(x, padding):
    for init, reduce_fn in ((0.0, lax.add), (-jnp.inf, lax.max), (1.0, lax.mul)):
        got = lm.pool(x, init, reduce_fn, (2, 3), 2, padding)  # int strides: every axis
        expected = linen(pooling.pool, x, init, reduce_fn, (2, 3), (2, 2), padding)
        assert_close(got, expected)
    # add and max know their derivative (their identity is the init), as in Linen
    for init, reduce_fn in ((0.0, lax.add), (-jnp.inf, lax.max)):

        def ours(v, init=init, reduce_fn=reduce_fn):
            return jnp.sum(jnp.sin(lm.pool(v, init, reduce_fn, (2, 3), 1, padding)))

        def theirs(v, init=init, reduce_fn=reduce_fn):
            y = linen(pooling.pool, v, init, reduce_fn, (2, 3), None, padding)
            return jnp.sum(jnp.sin(y))

        assert_close(jax.grad(ours)(x), jax.grad(theirs)(x))


@pytest.mark.parametrize(
    ("batch", "padding"),
    [((2,), "VALID"), ((2,), "SAME"), ((2,), PADDINGS[2]), ((), PADDINGS[2]), ((2, 1), "SAME")],
    ids=["valid", "same", "pairs", "unbatched_pairs", "two_batch_axes_same"],
)
def test_avg_pool_count_include_pad_equals_linen_in_every_padding_mode(batch, padding):
    x = normal(np.random.default_rng(1), *batch, 5, 6, 3)

    def linen_avg(v, strides, include):
        # Linen pads one batch axis only (explicit pairs fail with two): flatten them for it.
        flat = jnp.reshape(v, (-1, *v.shape[-3:])) if len(batch) > 1 else v
        y = linen(nn.avg_pool, flat, (3, 2), strides, padding, count_include_pad=include)
        return jnp.reshape(y, (*batch, *y.shape[-3:]))

    for include in (True, False):
        got = lm.avg_pool(x, (3, 2), (2, 1), padding, count_include_pad=include)
        assert_close(got, linen_avg(x, (2, 1), include))

        def ours(v, include=include):
            return jnp.sum(jnp.sin(lm.avg_pool(v, (3, 2), 2, padding, include)))

        def theirs(v, include=include):
            return jnp.sum(jnp.sin(linen_avg(v, (2, 2), include)))

        assert_close(jax.grad(ours)(x), jax.grad(theirs)(x))


def test_int_window_and_strides_in_every_pool():
    """An int is the same for one spatial axis (Metoryx's ``strides: int``; Linen takes tuples)."""
    x = normal(np.random.default_rng(2), 2, 7, 3)
    for name in ("max_pool", "min_pool", "avg_pool"):
        fn = getattr(lm, name)
        assert_close(fn(x, 3, 2, "SAME"), fn(x, (3,), (2,), "SAME"))
        assert_close(fn(x, 3, 2, 1), linen(getattr(pooling, name), x, (3,), (2,), ((1, 1),)))
    assert_close(lm.pool(x, 0.0, lax.add, 3, 2), lm.pool(x, 0.0, lax.add, (3,), (2,)))


def test_avg_pool_of_complex_input_equals_linen():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 4, 4, 2)) + 1j * rng.standard_normal((2, 4, 4, 2)))
    x = x.astype(jnp.complex64)
    for include in (True, False):
        got = lm.avg_pool(x, (2, 2), padding="SAME", count_include_pad=include)
        expected = linen(nn.avg_pool, x, (2, 2), padding="SAME", count_include_pad=include)
        assert got.dtype == jnp.complex64
        assert_close((got.real, got.imag), (expected.real, expected.imag))


def test_generic_pool_errors():
    x = jnp.ones((1, 4, 4, 1))
    with pytest.raises(TypeError, match=r"^pool: init must be a scalar known when tracing"):
        jax.jit(lambda v, i: lm.pool(v, i, lax.add, (2, 2)))(x, 0.0)
    with pytest.raises(TypeError, match=r"^pool: init must be a scalar .* got \[0.0, 0.0\]"):
        lm.pool(x, [0.0, 0.0], lax.add, (2, 2))
    with pytest.raises(TypeError, match=r"^pool: reduce_fn must be a function of two arrays"):
        lm.pool(x, 0.0, "add", (2, 2))
    with pytest.raises(ValueError, match=r"^pool: strides=\(1, 1, 1\) has 3 entries but"):
        lm.pool(x, 0.0, lax.add, (2, 2), (1, 1, 1))
    with pytest.raises(ValueError, match=r"^pool got an input of shape \(1, 4, 4, 1\): spatial"):
        lm.pool(x, 0.0, lax.add, (5, 5))
    with pytest.raises(TypeError, match=r"^pool: kernel_size=2 is a window over one spatial"):
        lm.pool(x, 0.0, lax.add, 2)
    with pytest.raises(TypeError, match=r"^min_pool needs an integer or floating input, got "):
        lm.min_pool(x.astype(jnp.complex64), (2, 2))
