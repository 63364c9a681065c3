import inspect
import pickle

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


@pytest.mark.parametrize(
    "init",
    [
        lm.initializers.zeros(),
        lm.initializers.ones(jnp.int32),
        lm.initializers.constant(0.5),
        lm.initializers.normal(0.3),
        lm.initializers.uniform(2.0, jnp.bfloat16),
        lm.initializers.truncated_normal(1.0, lower=-1.0),
        lm.initializers.variance_scaling(2.0, "fan_avg", "uniform", in_axis=0, out_axis=1),
        lm.initializers.lecun_normal(batch_axis=(0,)),
        lm.initializers.he_uniform(),
        lm.initializers.orthogonal(2.0),
        lm.initializers.delta_orthogonal(),
    ],
    ids=repr,
)
def test_initializers_pickle_and_compare_by_value(init):
    copy = pickle.loads(pickle.dumps(init))
    assert copy == init and hash(copy) == hash(init) and repr(copy) == repr(init)
    key, shape = jax.random.key(3), (3, 3, 4, 4)
    np.testing.assert_array_equal(copy(key, shape), init(key, shape))


JAX_INITIALIZERS = [
    ("constant(0.5)", lambda: jax.nn.initializers.constant(0.5)),
    ("constant(array)", lambda: jax.nn.initializers.constant(jnp.arange(4.0))),
    ("uniform()", lambda: jax.nn.initializers.uniform()),
    ("uniform(2, bf16)", lambda: jax.nn.initializers.uniform(2.0, jnp.bfloat16)),
    ("normal()", lambda: jax.nn.initializers.normal()),
    ("normal(0.3)", lambda: jax.nn.initializers.normal(0.3)),
    ("truncated_normal()", lambda: jax.nn.initializers.truncated_normal()),
    ("truncated_normal(bounds)", lambda: jax.nn.initializers.truncated_normal(1.5, lower=-1.0)),
    (
        "variance_scaling(axes)",
        lambda: jax.nn.initializers.variance_scaling(
            0.7, "fan_geo_avg", "uniform", in_axis=0, out_axis=(1, 2), batch_axis=3
        ),
    ),
    (
        "variance_scaling(f16)",
        lambda: jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal", dtype=jnp.float16),
    ),
    ("lecun_normal()", lambda: jax.nn.initializers.lecun_normal()),
    ("lecun_uniform(in_axis)", lambda: jax.nn.initializers.lecun_uniform(in_axis=0)),
    ("glorot_normal()", lambda: jax.nn.initializers.glorot_normal()),
    ("glorot_uniform()", lambda: jax.nn.initializers.glorot_uniform()),
    ("xavier_uniform()", lambda: jax.nn.initializers.xavier_uniform()),
    ("he_normal()", lambda: jax.nn.initializers.he_normal()),
    ("he_uniform(batch)", lambda: jax.nn.initializers.he_uniform(batch_axis=(0,))),
    ("kaiming_normal()", lambda: jax.nn.initializers.kaiming_normal()),
    ("orthogonal()", lambda: jax.nn.initializers.orthogonal()),
    ("orthogonal(2, 0)", lambda: jax.nn.initializers.orthogonal(2.0, column_axis=0)),
    ("delta_orthogonal()", lambda: jax.nn.initializers.delta_orthogonal()),
    ("delta_orthogonal(0.5)", lambda: jax.nn.initializers.delta_orthogonal(0.5)),
]


@pytest.mark.parametrize(
    "make", [m for _, m in JAX_INITIALIZERS], ids=[n for n, _ in JAX_INITIALIZERS]
)
def test_jax_initializer_closures_become_picklable_with_the_same_values(make):
    """`jax.nn.initializers` factories return local functions, which pickle cannot name."""
    raw = make()
    with pytest.raises(AttributeError, match=r"Can't pickle local object"):
        pickle.dumps(raw)
    init = lm.initializers.from_jax(raw)
    assert isinstance(init, lm.initializers.Initializer) and init.fn is raw
    copy = pickle.loads(pickle.dumps(init))
    assert repr(copy) == repr(init)
    if not any(isinstance(v, jax.Array) for v in init.config.values()):  # arrays: by identity
        assert copy == init and init == lm.initializers.from_jax(make())
    assert repr(init).startswith("jax.nn.initializers.")
    key, shape = jax.random.key(3), (3, 4, 4, 4)
    orthogonal = "orthogonal" in repr(init)  # JAX's QR has no half precision on the CPU
    for dtype in (None, jnp.float32) if orthogonal else (None, jnp.float32, jnp.bfloat16):
        expected = raw(key, shape) if dtype is None else raw(key, shape, dtype)
        for got in (init, copy):
            value = got(key, shape, dtype)
            assert value.dtype == expected.dtype
            np.testing.assert_array_equal(
                np.asarray(value, np.float32), np.asarray(expected, np.float32)
            )


def test_jax_initializers_given_to_layers_pickle_and_initialise_alike():
    dense = lm.Dense(4, 4, kernel_init=jax.nn.initializers.he_normal())
    param = lm.Parameter((3, 4, 4), jax.nn.initializers.orthogonal(), dtype=jnp.bfloat16)
    for model in (dense, lm.MultiHeadAttention(2, 8, kernel_init=jax.nn.initializers.normal(0.1))):
        copy = pickle.loads(pickle.dumps(model))
        key = jax.random.key(0)
        jax.tree.map(
            np.testing.assert_array_equal,
            lm.transform(copy).init(key),
            lm.transform(model).init(key),
        )
    assert pickle.loads(pickle.dumps(param)).init == param.init
    # the values are those of the closure itself
    kernel = lm.transform(dense).init(jax.random.key(0))["params"]["kernel"]
    assert float(kernel.std()) == pytest.approx(np.sqrt(2 / 4) * 0.88, rel=0.5)
    # a plain function is kept as it is
    assert lm.initializers.from_jax(jax.nn.initializers.zeros) is jax.nn.initializers.zeros
    assert lm.Dense(2, 2, bias_init=jax.nn.initializers.ones).bias.init is jax.nn.initializers.ones
