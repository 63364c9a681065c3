"""The weight normalisations against Flax Linen, given the same weights.

`SpectralNorm` and `WeightNorm`: outputs, updated statistics and gradients (parameters and
inputs) equal Linen's, once Linen's layout is renamed to lamina's; the substitution of the
normalised weights they run on; wrappers inside lifted transforms; every error a user can cause.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina.nn._substitution import substituted
from tests.helpers import assert_close_complex, layout, shifted_normal
from tests.linen_helpers import linen_random_variables, linen_results, our_results

# --- SpectralNorm ------------------------------------------------------------------------------


class LinenSpectral(nn.Module):
    layer: nn.Module
    options: dict

    @nn.compact
    def __call__(self, x, update_stats):
        return nn.SpectralNorm(self.layer, **self.options)(x, update_stats=update_stats)


def spectral_to_ours(variables, name, collection="batch_stats"):
    """Linen's layout (``SpectralNorm_0/{"Dense_0/kernel/u": ...}``) in ours."""
    stats = variables[collection]["SpectralNorm_0"]
    ours = {"params": {"layer": variables["params"][name]}, collection: {"u": {}, "sigma": {}}}
    for key, value in stats.items():
        _, *path, leaf = key.split("/")
        node = ours[collection][leaf]
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return ours


@pytest.mark.parametrize(
    ("linen", "ours", "shape", "options", "update_stats"),
    [
        (nn.Dense(4), lambda: lm.Dense(5, 4), (3, 5), {}, True),
        (nn.Dense(4), lambda: lm.Dense(5, 4), (3, 5), {}, False),
        (nn.Dense(4), lambda: lm.Dense(5, 4), (3, 5), {"n_steps": 3, "epsilon": 1e-4}, True),
        (nn.Conv(3, (2, 2)), lambda: lm.Conv(2, 3, (2, 2)), (1, 4, 4, 2), {"n_steps": 2}, True),
    ],
    ids=["dense", "dense_no_update", "dense_3_steps", "conv"],
)
def test_spectral_norm_matches_linen(linen, ours, shape, options, update_stats):
    x = shifted_normal(shape)
    module = LinenSpectral(linen, options)
    variables = linen_random_variables(module, x, update_stats=True)
    name = "layer"  # the Linen wrapper module's field
    y_l, new_l, (g_l, gx_l) = linen_results(module, variables, x, update_stats=update_stats)
    wrapper = lm.SpectralNorm(ours(), **options)
    ours_vars = spectral_to_ours(variables, name)
    assert layout(lm.transform(wrapper).init(jax.random.key(0))) == layout(ours_vars)
    y, new, (g, gx) = our_results(wrapper, ours_vars, x, update_stats=update_stats)
    assert_close_complex(y, y_l)
    assert_close_complex(
        new, {"batch_stats": spectral_to_ours({**variables, **new_l}, name)["batch_stats"]}
    )
    assert_close_complex(g, {"layer": g_l[name]}, atol=1e-5)
    assert_close_complex(gx, gx_l)
    if not update_stats:
        assert_close_complex(new, {"batch_stats": ours_vars["batch_stats"]}, rtol=0, atol=0)


def test_spectral_norm_options():
    x = shifted_normal((3, 5))
    # another collection, and no power iteration: the layer as it is
    wrapper = lm.SpectralNorm(lm.Dense(5, 4), collection_name="spectral")
    assert set(lm.transform(wrapper).init(jax.random.key(0))) == {"params", "spectral"}
    plain = lm.SpectralNorm(lm.Dense(5, 4), n_steps=0)
    variables = lm.transform(plain).init(jax.random.key(0))
    assert set(variables) == {"params"}
    y, _ = lm.transform(plain).apply(variables, None, x, update_stats=True)
    expected, _ = lm.transform(lm.Dense(5, 4)).apply(
        {"params": variables["params"]["layer"]}, None, x
    )
    assert_close_complex(y, expected)
    # nested layers: every kernel has its own state, under its path in the layer
    block = lm.Sequential(lm.Dense(5, 4), lm.relu, lm.Dense(4, 2))
    shapes = layout(lm.transform(lm.SpectralNorm(block)).init(jax.random.key(0)))["batch_stats"]
    assert shapes["u"] == {
        "layers_0": {"kernel": ((1, 4), jnp.float32)},
        "layers_2": {"kernel": ((1, 2), jnp.float32)},
    }


def test_spectral_norm_errors():
    with pytest.raises(
        ValueError,
        match=r"SpectralNorm: the layer's parameter kernel has shape \(3, 3, 2, 4\)"
        r".*error_on_non_matrix=False",
    ):
        lm.SpectralNorm(lm.Conv(2, 4, (3, 3)), error_on_non_matrix=True)
    lm.SpectralNorm(lm.Dense(2, 4), error_on_non_matrix=True)  # a matrix is fine
    with pytest.raises(
        ValueError,
        match=r"SpectralNorm: the layer LayerNorm\(size=4\) has no parameter of two or more "
        r"dimensions.*scale \(4,\)",
    ):
        lm.SpectralNorm(lm.LayerNorm(4))
    with pytest.raises(TypeError, match=r"SpectralNorm wraps a layer \(a callable lm.Module"):
        lm.SpectralNorm(jnp.tanh)
    with pytest.raises(ValueError, match=r"SpectralNorm: n_steps must be a non-negative int"):
        lm.SpectralNorm(lm.Dense(2, 4), n_steps=-1)
    with pytest.raises(
        TypeError, match=r"SpectralNorm: collection_name must be a non-empty string without '/'"
    ):
        lm.SpectralNorm(lm.Dense(2, 4), collection_name="a/b")
    with pytest.raises(TypeError, match=r"SpectralNorm: error_on_non_matrix must be True or False"):
        lm.SpectralNorm(lm.Dense(2, 4), error_on_non_matrix="yes")
    init, apply = lm.transform(lm.SpectralNorm(lm.Dense(2, 4)))
    variables = init(jax.random.key(0))
    with pytest.raises(TypeError, match=r"SpectralNorm: update_stats must be a Python bool"):
        apply(variables, None, jnp.ones((1, 2)), update_stats=jnp.array(True))
    with pytest.raises(TypeError, match=r"update_stats"):
        apply(variables, None, jnp.ones((1, 2)))  # keyword-only and required, as in Linen


# --- WeightNorm --------------------------------------------------------------------------------


class LinenWeightNorm(nn.Module):
    layer: nn.Module
    options: dict

    @nn.compact
    def __call__(self, x):
        return nn.WeightNorm(self.layer, **self.options)(x)


def weight_norm_to_ours(variables, name):
    scales = variables["params"].get("WeightNorm_0", {})
    ours = {"params": {"layer": variables["params"][name]}}
    if scales:
        ours["params"]["scale"] = {}
    for key, value in scales.items():
        _, *path, _ = key.split("/")
        node = ours["params"]["scale"]
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return ours


@pytest.mark.parametrize(
    ("linen", "ours", "shape", "options"),
    [
        (nn.Dense(4), lambda: lm.Dense(5, 4), (3, 5), {}),
        (
            nn.Dense(4),
            lambda: lm.Dense(5, 4),
            (3, 5),
            {"variable_filter": {"kernel", "bias"}, "epsilon": 1e-3},
        ),
        (nn.Dense(4), lambda: lm.Dense(5, 4), (3, 5), {"use_scale": False, "feature_axes": None}),
        (nn.Conv(4, (3, 3)), lambda: lm.Conv(3, 4, (3, 3)), (2, 5, 5, 3), {}),
        (
            nn.Conv(4, (3, 3)),
            lambda: lm.Conv(3, 4, (3, 3)),
            (2, 5, 5, 3),
            {"feature_axes": (-2, -1)},
        ),
    ],
    ids=["dense", "dense_bias", "dense_whole_no_scale", "conv", "conv_two_axes"],
)
def test_weight_norm_matches_linen(linen, ours, shape, options):
    x = shifted_normal(shape)
    module = LinenWeightNorm(linen, options)
    variables = linen_random_variables(module, x)
    name = "layer"  # the Linen wrapper module's field
    y_l, _, (g_l, gx_l) = linen_results(module, variables, x)
    ours_options = dict(options)
    if "variable_filter" in options:
        ours_options["variable_filter"] = tuple(options["variable_filter"])
    wrapper = lm.WeightNorm(ours(), **ours_options)
    ours_vars = weight_norm_to_ours(variables, name)
    assert layout(lm.transform(wrapper).init(jax.random.key(0))) == layout(ours_vars)
    y, _, (g, gx) = our_results(wrapper, ours_vars, x)
    assert_close_complex(y, y_l)
    assert_close_complex(g, weight_norm_to_ours({"params": g_l}, name)["params"], atol=1e-5)
    assert_close_complex(gx, gx_l)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("wrapper", ["spectral", "weight"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrapped_half_precision_layer_matches_linen(dtype, wrapper, jit):
    """The wrapper's float32 normalised kernel reaches a half-precision layer as Linen's does.

    The layer computes with the kernel in its own dtype (the wrapper casts explicitly); the
    default ``dtype=float32`` of the wrapper was refused as a narrowing substitution.
    """
    x = shifted_normal((3, 5))
    layer = nn.Dense(4, dtype=dtype, param_dtype=dtype)
    if wrapper == "spectral":
        module, kwargs = LinenSpectral(layer, {"n_steps": 2}), {"update_stats": True}
        ours = lm.SpectralNorm(lm.Dense(5, 4, dtype=dtype), n_steps=2)
        to_ours = spectral_to_ours
    else:
        module, kwargs = LinenWeightNorm(layer, {}), {}
        ours = lm.WeightNorm(lm.Dense(5, 4, dtype=dtype))
        to_ours = weight_norm_to_ours
    variables = linen_random_variables(module, x, **kwargs)
    # the layer's parameters in its dtype (Linen's init stores the wrapper's float32 kernel)
    variables["params"]["layer"] = jax.tree.map(
        lambda a: a.astype(dtype), variables["params"]["layer"]
    )
    with jax.numpy_dtype_promotion("standard"):
        y_l, new_l = module.apply(variables, x, mutable=True, **kwargs)
    ours_vars = to_ours(variables, "layer")
    assert layout(lm.transform(ours).init(jax.random.key(0))) == layout(ours_vars)
    apply = lm.transform(ours).apply
    y, new = (jax.jit(apply, static_argnames="update_stats") if jit else apply)(
        ours_vars, None, x, **kwargs
    )
    assert y.dtype == y_l.dtype == dtype
    # within a rounding of the layer's dtype (XLA may keep bfloat16 intermediates wider)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(y_l, np.float32), rtol=2 * eps, atol=2 * eps
    )
    if wrapper == "spectral":  # the power iteration's state, float32 in both
        expected = to_ours({**variables, **new_l}, "layer")["batch_stats"]
        assert_close_complex(new["batch_stats"], expected)


def test_weight_norm_errors():
    with pytest.raises(
        ValueError,
        match=r"WeightNorm: no parameter of the layer Dense\(in_size=2, out_size=4\) matches "
        r"variable_filter=\('gamma',\).*kernel \(2, 4\), bias \(4,\)",
    ):
        lm.WeightNorm(lm.Dense(2, 4), variable_filter=("gamma",))
    with pytest.raises(
        TypeError, match=r"WeightNorm: variable_filter must be a collection of strings"
    ):
        lm.WeightNorm(lm.Dense(2, 4), variable_filter="kernel")
    with pytest.raises(
        ValueError,
        match=r"WeightNorm: feature_axes=2 is out of range for the layer's parameter kernel of "
        r"shape \(2, 4\)",
    ):
        lm.WeightNorm(lm.Dense(2, 4), feature_axes=2)
    with pytest.raises(
        ValueError, match=r"WeightNorm: feature_axes=\(0, -2\) names the same axis twice"
    ):
        lm.WeightNorm(lm.Dense(2, 4), feature_axes=(0, -2))
    with pytest.raises(TypeError, match=r"WeightNorm: use_scale must be True or False"):
        lm.WeightNorm(lm.Dense(2, 4), use_scale=1)


def test_a_layer_changed_after_wrapping_is_a_clear_error():
    wrapper = lm.WeightNorm(lm.Dense(2, 4))
    wrapper.layer = lm.Sequential(lm.Dense(2, 4))
    init, apply = lm.transform(wrapper)
    with pytest.raises(
        ValueError, match=r"the layer has no parameter at kernel any more.*Wrap the new layer"
    ):
        apply(init(jax.random.key(0)), None, jnp.ones((1, 2)))


# --- the substitution --------------------------------------------------------------------------


class Failing(lm.Module):
    def __init__(self):
        super().__init__()
        self.layer = lm.Dense(2, 2)
        self.count = lm.BatchStat((), lm.initializers.zeros())

    def __call__(self, x, fail):
        kernel = self.layer.kernel
        try:
            with substituted({kernel: 3.0 * kernel.value}, where="Failing"):
                if fail:
                    raise KeyError("inside")
        except KeyError:
            pass
        return self.layer(x)


def test_the_substitution_never_outlives_its_block_and_carries_gradients():
    init, apply = lm.transform(Failing())
    variables = init(jax.random.key(0))
    x = jnp.ones((1, 2))
    plain, _ = lm.transform(lm.Dense(2, 2)).apply({"params": variables["params"]["layer"]}, None, x)
    for fail in (False, True):  # after the block, even one left by an exception: the bound value
        y, new = jax.jit(apply, static_argnums=3)(variables, None, x, fail)
        assert_close_complex(y, plain)
        assert_close_complex(new, variables)
    # gradients of a substituted value reach the original: d/dk sum(x @ (3k)) = 3 x^T 1
    wrapper = lm.WeightNorm(lm.Dense(2, 2), use_scale=False, feature_axes=None)
    init, apply = lm.transform(wrapper)
    v = init(jax.random.key(1))

    def loss(params):
        return jnp.sum(apply({"params": params}, None, x)[0])

    k = v["params"]["layer"]["kernel"]
    expected = jax.grad(lambda k: jnp.sum(x @ (k / jnp.sqrt(jnp.sum(k * k) + 1e-12))))(k)
    assert_close_complex(jax.grad(loss)(v["params"])["layer"]["kernel"], expected)


class Substituting(lm.Module):
    def __init__(self, replace):
        super().__init__()
        self.layer = lm.Dense(2, 2)
        self.count = lm.BatchStat((), lm.initializers.zeros())
        self.replace = replace

    def __call__(self, x):
        with substituted(self.replace(self), where="Substituting"):
            return self.layer(x)


@pytest.mark.parametrize(
    ("replace", "error", "match"),
    [
        (
            lambda m: {m.count: jnp.ones(())},
            TypeError,
            r"BatchStat at batch_stats/count is mutable and cannot be substituted",
        ),
        (
            lambda m: {m.layer.kernel: jnp.ones((3, 2))},
            ValueError,
            r"the value substituted for Parameter at params/layer/kernel has shape \(3, 2\), "
            r"but the variable holds shape \(2, 2\)",
        ),
        (
            lambda m: {m.layer.kernel: jnp.ones((2, 2), jnp.complex64)},
            TypeError,
            r"the value substituted for Parameter at params/layer/kernel is complex64, but the "
            r"variable is read as float32",
        ),
        (
            lambda m: {m.layer.kernel: jnp.full((2, 2), 1e5, jnp.float32)},
            TypeError,
            r"the value substituted for Parameter at params/layer/kernel is float32, but the "
            r"variable is read as float16 and stored as float16: float32 is wider than float16"
            r".*x\.astype\(jnp\.float16\)",
        ),
    ],
    ids=["mutable", "shape", "complex", "narrowing"],
)
def test_substitution_errors(replace, error, match):
    model = Substituting(replace)
    if "float16" in match:  # user code's substitutions stay widening-only
        model.layer = lm.Dense(2, 2, dtype=jnp.float16)
    init, apply = lm.transform(model)
    with pytest.raises(error, match=r"Substituting: " + match):
        apply(init(jax.random.key(0)), None, jnp.ones((1, 2)))


def test_wrappers_inside_lifted_transforms():
    """Inside lm.scan (a Stack of wrapped layers): each member with its own slice."""
    model = lm.Stack(lm.SpectralNorm(lm.Dense(3, 3)), 2)
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    x = shifted_normal((2, 3))
    y, new = jax.jit(apply, static_argnames="update_stats")(variables, None, x, update_stats=True)
    single = jax.jit(
        lm.transform(lm.SpectralNorm(lm.Dense(3, 3))).apply, static_argnames="update_stats"
    )
    expected = x
    for i in range(2):
        member = jax.tree.map(lambda a, i=i: a[i], {c: v["block"] for c, v in variables.items()})
        expected, member_new = single(member, None, expected, update_stats=True)
        assert_close_complex(
            jax.tree.map(lambda a, i=i: a[i], new["batch_stats"]["block"]),
            member_new["batch_stats"],
        )
    assert_close_complex(y, expected)
