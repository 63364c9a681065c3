"""Dropout and Sequential against Flax Linen, given the same weights and keys."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close
from tests.linen_helpers import linen_and_lamina


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
