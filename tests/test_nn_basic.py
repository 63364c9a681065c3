"""Dense, Embed, dropout, pooling and Sequential against Flax Linen, given the same weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import pooling

import lamina as lm
from tests.helpers import assert_close


def linen_and_lamina(linen_module, lamina_module, *inputs, key=0, method=None, call=None):
    """Inits Linen, runs both on Linen's variables; returns (variables, linen_out, our_out)."""
    variables = linen_module.init(jax.random.key(key), *inputs, method=method)
    expected = linen_module.apply(variables, *inputs, method=method)
    _, apply = lm.transform(lamina_module, to_callable=call)
    got, _ = apply(dict(variables), None, *inputs)
    return variables, expected, got


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


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("broadcast_dims", [(), (0,)])
def test_dropout_equals_linen_given_the_key(getkey, rate, broadcast_dims):
    x = jax.random.normal(getkey(), (4, 7))
    key = getkey()
    expected = nn.Dropout(rate, broadcast_dims=broadcast_dims).apply(
        {}, x, deterministic=False, rng=key
    )
    got = lm.dropout(x, rate, True, broadcast_dims=broadcast_dims, rng=key)
    np.testing.assert_allclose(got, expected)


def test_dropout_module_uses_the_dropout_stream(getkey):
    init, apply = lm.transform(lm.Dropout(0.5))
    x = jnp.ones((100,))
    a, _ = apply({}, {"dropout": jax.random.key(1)}, x, True)
    b, _ = apply({}, {"dropout": jax.random.key(1)}, x, True)
    c, _ = apply({}, {"dropout": jax.random.key(2)}, x, True)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a).tolist()) == {0.0, 2.0}
    np.testing.assert_array_equal(apply({}, None, x, False)[0], x)  # no key needed when off


def test_dropout_errors():
    with pytest.raises(ValueError, match=r"^Dropout: rate must be a number in \[0, 1\], got 1.5"):
        lm.Dropout(1.5)
    with pytest.raises(ValueError, match=r"^dropout: rate must be a number in \[0, 1\], got -0.1"):
        lm.dropout(jnp.ones(2), -0.1, True)

    class Net(lm.Module):
        def __call__(self, x, is_training):
            return lm.dropout(x, 0.5, is_training)

    init, apply = lm.transform(Net())
    with pytest.raises(TypeError, match=r"is_training must be a Python bool.*static"):
        jax.jit(apply)({}, jax.random.key(0), jnp.ones(2), True)
    with pytest.raises(lm.RngError, match=r"next_rng_key\('dropout'\) found no key"):
        apply({}, None, jnp.ones(2), True)


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


def test_sequential_layout_equals_linen(getkey):
    x = jax.random.normal(getkey(), (3, 4))
    linen = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    ours = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    variables, expected, got = linen_and_lamina(linen, ours, x)
    assert_close(got, expected)
    assert sorted(variables["params"]) == sorted(lm.transform(ours).init(getkey())["params"])


def test_sequential_unpacks_tuples_and_dicts(getkey):
    seq = lm.Sequential(lambda x: (x, 2 * x), lambda a, b: {"a": a, "b": b}, lambda a, b: a + b)
    init, apply = lm.transform(seq)
    np.testing.assert_allclose(apply(init(), None, jnp.ones(2))[0], [3.0, 3.0])
    assert isinstance(seq.layers, tuple) and len(seq.layers) == 3


def test_sequential_errors():
    with pytest.raises(ValueError, match=r"^Sequential needs at least one layer"):
        lm.Sequential()
    with pytest.raises(TypeError, match="layer 1 is a int, which cannot be called"):
        lm.Sequential(lm.relu, 3)
