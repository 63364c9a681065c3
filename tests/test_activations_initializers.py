import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

SEED_ACTIVATIONS = [
    "celu",
    "elu",
    "gelu",
    "glu",
    "hard_sigmoid",
    "hard_silu",
    "hard_tanh",
    "identity",
    "leaky_relu",
    "log_sigmoid",
    "log_softmax",
    "mish",
    "one_hot",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "sparse_plus",
    "sparse_sigmoid",
    "squareplus",
    "standardize",
]


@pytest.mark.parametrize("name", SEED_ACTIVATIONS)
def test_activation_equals_jax_nn(name):
    fn = getattr(lm, name)
    x = jax.random.normal(jax.random.key(0), (3, 4))
    if name == "one_hot":
        labels = jnp.array([0, 2])
        np.testing.assert_array_equal(fn(labels, 3), jax.nn.one_hot(labels, 3))
        return
    np.testing.assert_allclose(fn(x), getattr(jax.nn, name)(x), rtol=1e-6)


@pytest.mark.parametrize("name", ["relu", "relu6", "gelu", "softmax"])
def test_jitted_activations_keep_gradients_and_options(name):
    fn, ref = getattr(lm, name), getattr(jax.nn, name)
    x = jnp.array([-1.0, 0.0, 0.5, 7.0])
    np.testing.assert_allclose(
        jax.grad(lambda v: fn(v).sum())(x), jax.grad(lambda v: ref(v).sum())(x), rtol=1e-6
    )
    assert jax.grad(lambda v: fn(v).sum())(jnp.zeros(1))[0] == 0.0 or name != "relu"
    if name == "gelu":
        np.testing.assert_allclose(fn(x, approximate=False), ref(x, approximate=False))
    if name == "softmax":
        y = jnp.ones((2, 3))
        np.testing.assert_allclose(fn(y, axis=0), ref(y, axis=0))


FACTORIES = {
    "zeros": {},
    "ones": {},
    "constant": {"value": 0.5},
    "normal": {"stddev": 0.1},
    "uniform": {"scale": 0.2},
    "truncated_normal": {"stddev": 0.1},
    "variance_scaling": {"scale": 2.0, "mode": "fan_avg", "distribution": "uniform"},
    "lecun_normal": {},
    "lecun_uniform": {},
    "glorot_normal": {},
    "glorot_uniform": {},
    "xavier_normal": {},
    "xavier_uniform": {},
    "he_normal": {},
    "he_uniform": {},
    "kaiming_normal": {},
    "kaiming_uniform": {},
    "orthogonal": {"scale": 1.5},
    "delta_orthogonal": {},
}
JAX_NAMES = {
    "xavier_normal": "glorot_normal",
    "xavier_uniform": "glorot_uniform",
    "kaiming_normal": "he_normal",
    "kaiming_uniform": "he_uniform",
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_initializer_equals_jax(name):
    kwargs = FACTORIES[name]
    ours = getattr(lm.initializers, name)(**kwargs)
    theirs = getattr(jax.nn.initializers, JAX_NAMES.get(name, name))
    if name not in ("zeros", "ones"):
        theirs = theirs(*kwargs.values())
    shape = (3, 3, 4, 4) if name == "delta_orthogonal" else (4, 5)
    key = jax.random.key(0)
    np.testing.assert_array_equal(ours(key, shape, jnp.float32), theirs(key, shape, jnp.float32))
    assert repr(ours).startswith(JAX_NAMES.get(name, name) + "(")


def test_initializer_repr_shows_settings():
    assert repr(lm.initializers.lecun_normal()) == "lecun_normal()"
    assert repr(lm.initializers.lecun_normal(in_axis=0)) == "lecun_normal(in_axis=0)"
    assert repr(lm.initializers.normal(0.02)) == "normal(stddev=0.02)"


def test_plain_jax_initializers_work_in_declarations(getkey):
    class M(lm.Module):
        def __init__(self):
            self.a = lm.Parameter((2, 3), jax.nn.initializers.zeros)
            self.b = lm.Parameter((2, 3), jax.nn.initializers.lecun_normal())

    variables = lm.transform(M()).init(getkey())
    assert variables["params"]["a"].shape == (2, 3) and not variables["params"]["a"].any()
    assert "a=Parameter(shape=(2, 3), dtype=float32, init=zeros" in repr(M())


def test_initializer_wrong_shape_names_the_variable(getkey):
    class M(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((2, 3), lambda key, shape, dtype: jnp.zeros((3,), dtype))

    with pytest.raises(ValueError, match=r"initializer of params/w .* returned shape \(3,\)"):
        lm.transform(M()).init(getkey())


def test_initializer_failure_names_the_variable(getkey):
    class M(lm.Module):
        def __init__(self):
            self.inner = lm.Dense(2, 2)
            self.inner.kernel.init = lm.initializers.orthogonal()
            self.bad = lm.Parameter((3,), lm.initializers.orthogonal())

    with pytest.raises(ValueError) as info:
        lm.transform(M()).init(getkey())
    assert "while lamina initialised params/bad with orthogonal" in "".join(info.value.__notes__)


def test_every_factory_is_documented():
    for name in lm.initializers.__all__:
        assert inspect.getdoc(getattr(lm.initializers, name)), name
