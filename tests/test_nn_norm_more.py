"""Issue 12's normalisation options and layers against Flax Linen, given the same weights.

Masks, reduction and feature axes, ``group_size``, the two-pass variance, `InstanceNorm`,
complex inputs (and the complex running mean of `BatchNorm`), the dtype contract, and the
`SpectralNorm` and `WeightNorm` wrappers with the substitution they run on: outputs, updated
statistics and gradients (parameters and inputs) equal Linen's; every error a user can cause.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina.nn._substitution import substituted
from tests.helpers import assert_close as assert_real_close
from tests.helpers import layout


def assert_close(got, expected, **tolerances):
    """`tests.helpers.assert_close` that also compares complex leaves (their two parts)."""
    assert layout(got) == layout(expected)

    def parts(x):
        x = jnp.asarray(x)
        return jnp.stack([x.real, x.imag]) if jnp.iscomplexobj(x) else x

    assert_real_close(jax.tree.map(parts, got), jax.tree.map(parts, expected), **tolerances)


def data(shape, seed=0, dtype=jnp.float32, offset=1.0):
    """Inputs away from zero mean (so that the mean matters), from NumPy's generator."""
    rng = np.random.default_rng(seed)
    x = offset + 2.0 * rng.standard_normal(shape)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = x + 1j * (rng.standard_normal(shape) - 0.5)
    return jnp.asarray(x, dtype)


def weighted(y):
    """A scalar loss with a different weight on every output."""
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(jnp.real(y).astype(jnp.float32) * w)


def randomize(variables, seed=1):
    """Linen's variables with non-trivial values: scales near 1, positive variances."""
    rng = np.random.default_rng(seed)

    def value(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        shape = leaf.shape
        if name.endswith("var"):
            x = rng.uniform(0.5, 2.0, shape)
        elif name.endswith("scale"):
            x = 1.0 + 0.5 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape)
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            x = x + 0.5j * rng.standard_normal(shape)
        return jnp.asarray(x, leaf.dtype)

    return jax.tree_util.tree_map_with_path(value, variables)


def linen_init(module, *args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):  # Linen mixes dtypes implicitly
        shapes = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a, **kwargs), *args)
    return randomize(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes)))


def linen_results(module, variables, *args, grads=True, **kwargs):
    """Linen's output, variables after the call and gradients (params, then the inputs)."""

    def loss(params, *args):
        y, new = module.apply({**variables, "params": params}, *args, mutable=True, **kwargs)
        return weighted(y), (y, {c: v for c, v in new.items() if c != "params"})

    with jax.numpy_dtype_promotion("standard"):
        if not grads:
            return (*jax.jit(loss)(variables.get("params", {}), *args)[1], None)
        argnums = tuple(range(1 + len(args)))
        grad = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
        g, (y, new) = grad(variables.get("params", {}), *args)
    return y, new, g


def our_results(layer, variables, *args, grads=True, **kwargs):
    """Our output, variables after the call (no params) and gradients."""
    apply = lm.transform(layer).apply

    def loss(params, *args):
        y, new = apply({**variables, "params": params}, None, *args, **kwargs)
        return weighted(y), (y, {c: v for c, v in new.items() if c != "params"})

    if not grads:
        return (*jax.jit(loss)(variables.get("params", {}), *args)[1], None)
    argnums = tuple(range(1 + len(args)))
    g, (y, new) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(
        variables.get("params", {}), *args
    )
    return y, new, g


def check(linen, ours, x, linen_kwargs=None, our_kwargs=None, grads=True, atol=1e-6):
    """Same variables in both libraries: outputs, new variables and gradients agree."""
    linen_kwargs = linen_kwargs or {}
    our_kwargs = linen_kwargs if our_kwargs is None else our_kwargs
    variables = linen_init(linen, x, **linen_kwargs)
    expected = linen_results(linen, variables, x, grads=grads, **linen_kwargs)
    got = our_results(ours, variables, x, grads=grads, **our_kwargs)
    assert layout(lm.transform(ours).init(jax.random.key(0))) == layout(variables)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, atol=atol)
    return got


# --- masks -------------------------------------------------------------------------------------


def random_mask(shape, seed=3):
    mask = np.random.default_rng(seed).random(shape) < 0.7
    mask[..., 0] = True  # every row keeps an entry
    return jnp.asarray(mask)


@pytest.mark.parametrize(
    ("linen", "ours"),
    [
        (nn.LayerNorm(), lm.LayerNorm(6)),
        (nn.RMSNorm(), lm.RMSNorm(6)),
        (nn.GroupNorm(num_groups=2), lm.GroupNorm(2, 6)),
        (nn.InstanceNorm(), lm.InstanceNorm(6)),
    ],
    ids=["layer", "rms", "group", "instance"],
)
def test_masked_statistics_match_linen(linen, ours):
    x, mask = data((2, 5, 6)), random_mask((2, 5, 6))
    masked = check(linen, ours, x, {"mask": mask})
    # the mask matters: the same call without it differs
    plain, _ = lm.transform(ours).apply(linen_init(linen, x), None, x)
    assert not np.allclose(masked[0], plain, atol=1e-3)


def test_batch_norm_mask_matches_linen_and_leaves_masked_examples_out():
    x = data((6, 4))
    mask = jnp.asarray([True, True, False, True, False, True])[:, None]
    linen, ours = nn.BatchNorm(momentum=0.8), lm.BatchNorm(4, momentum=0.8)
    y, new, _ = check(
        linen,
        ours,
        x,
        {"use_running_average": False, "mask": mask},
        {"is_training": True, "mask": mask},
    )
    kept = x[np.asarray(mask[:, 0])]
    variables = linen_init(linen, x, use_running_average=False)
    _, expected = lm.transform(ours).apply(variables, None, kept, True)
    assert_close(new, {"batch_stats": expected["batch_stats"]})


# --- reduction and feature axes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("linen", "ours", "shape"),
    [
        (
            nn.LayerNorm(reduction_axes=(1, 2), feature_axes=(-2, -1)),
            lm.LayerNorm((4, 3), reduction_axes=(1, 2), feature_axes=(-2, -1)),
            (2, 4, 3),
        ),
        (
            nn.LayerNorm(reduction_axes=1, feature_axes=-1),
            lm.LayerNorm(3, reduction_axes=1),
            (2, 4, 3),
        ),
        (
            nn.RMSNorm(reduction_axes=(-2, -1), feature_axes=1),
            lm.RMSNorm(4, reduction_axes=(-2, -1), feature_axes=1),
            (2, 4, 3),
        ),
        (
            nn.InstanceNorm(feature_axes=(1, -1)),
            lm.InstanceNorm((4, 3), feature_axes=(1, -1)),
            (2, 4, 5, 3),
        ),
        (
            nn.GroupNorm(num_groups=3, reduction_axes=(2, 3)),
            lm.GroupNorm(3, 6, reduction_axes=(2, 3)),
            (2, 4, 6),
        ),
    ],
    ids=["layer_two", "layer_other", "rms", "instance_two", "group_axes"],
)
def test_reduction_and_feature_axes_match_linen(linen, ours, shape):
    if isinstance(linen, nn.GroupNorm):
        shape = (2, 3, *shape[1:])  # reduction axes (2, 3): the last two of a rank-4 input
    check(linen, ours, data(shape))


def test_batch_norm_several_feature_axes_match_linen_in_training_and_evaluation():
    x = data((5, 3, 4))
    linen, ours = (
        nn.BatchNorm(axis=(1, 2), momentum=0.9),
        lm.BatchNorm((3, 4), axis=(1, 2), momentum=0.9),
    )
    _, new, _ = check(linen, ours, x, {"use_running_average": False}, {"is_training": True})
    assert new["batch_stats"]["mean"].shape == (3, 4)
    check(linen, ours, x, {"use_running_average": True}, {"is_training": False})


# --- GroupNorm(group_size=...) -----------------------------------------------------------------


def test_group_size_matches_linen():
    ours = lm.GroupNorm(None, 6, group_size=2)
    assert (ours.num_groups, ours.group_size) == (3, 2)
    check(nn.GroupNorm(num_groups=None, group_size=2), ours, data((2, 3, 6)))


# --- the two-pass variance ---------------------------------------------------------------------


def test_far_from_zero_inputs_need_the_two_pass_variance():
    """Regression: inputs offset by 1e6 lose the variance in E[x^2] - E[x]^2 (|y| ~ 650)."""
    x = data((4, 8), offset=1e6)
    y, _, _ = check(
        nn.LayerNorm(use_fast_variance=False), lm.LayerNorm(8, use_fast_variance=False), x
    )
    variables = linen_init(nn.LayerNorm(), x)
    params = variables["params"]
    exact = (x - x.mean(-1, keepdims=True)) / jnp.std(x - 1e6, -1, keepdims=True)
    assert_close(y, exact * params["scale"][None] + params["bias"][None], atol=1e-3)
    assert float(jnp.abs(y).max()) < 10
    fast, _ = lm.transform(lm.LayerNorm(8)).apply(variables, None, x)
    assert float(jnp.abs(fast).max()) > 100  # what the default (Linen's too) gives


@pytest.mark.parametrize(
    ("linen", "ours", "kwargs"),
    [
        (nn.BatchNorm(use_fast_variance=False), lm.BatchNorm(6, use_fast_variance=False), "train"),
        (
            nn.GroupNorm(num_groups=3, use_fast_variance=False),
            lm.GroupNorm(3, 6, use_fast_variance=False),
            None,
        ),
        (
            nn.InstanceNorm(use_fast_variance=False),
            lm.InstanceNorm(6, use_fast_variance=False),
            None,
        ),
    ],
    ids=["batch", "group", "instance"],
)
def test_two_pass_variance_matches_linen(linen, ours, kwargs):
    x, mask = data((3, 4, 6), offset=1e4), random_mask((3, 4, 6))
    if kwargs == "train":
        mask = mask[..., :1]
        check(
            linen,
            ours,
            x,
            {"use_running_average": False, "mask": mask},
            {"is_training": True, "mask": mask},
            atol=1e-5,
        )
    else:
        check(linen, ours, x, {"mask": mask}, atol=1e-5)


# --- complex inputs and the dtype contract -----------------------------------------------------


@pytest.mark.parametrize(
    ("linen", "ours", "dtype"),
    [
        (nn.LayerNorm, lambda **kw: lm.LayerNorm(6, **kw), None),
        (nn.LayerNorm, lambda **kw: lm.LayerNorm(6, **kw), jnp.complex64),
        (nn.RMSNorm, lambda **kw: lm.RMSNorm(6, **kw), None),
        (
            lambda **kw: nn.GroupNorm(num_groups=3, **kw),
            lambda **kw: lm.GroupNorm(3, 6, **kw),
            jnp.complex64,
        ),
        (nn.InstanceNorm, lambda **kw: lm.InstanceNorm(6, **kw), None),
    ],
    ids=["layer", "layer_complex64", "rms", "group_complex64", "instance"],
)
def test_complex_inputs_match_linen(linen, ours, dtype):
    x = data((2, 4, 6), dtype=jnp.complex64)
    y, _, _ = check(linen(dtype=dtype), ours(dtype=dtype, param_dtype=jnp.float32), x, grads=False)
    assert y.dtype == jnp.complex64


def test_batch_norm_keeps_a_complex_running_mean():
    """Regression: with dtype=complex64 the running mean was float32 and lost its imaginary part."""
    x = data((6, 4), dtype=jnp.complex64)
    linen = nn.BatchNorm(dtype=jnp.complex64, momentum=0.8)
    ours = lm.BatchNorm(4, dtype=jnp.complex64, param_dtype=jnp.float32, momentum=0.8)
    declared = layout(lm.transform(ours).init(jax.random.key(0)))["batch_stats"]
    assert declared == {"mean": ((4,), jnp.complex64), "var": ((4,), jnp.float32)}
    variables = linen_init(linen, x, use_running_average=False)
    variables["batch_stats"]["mean"] = variables["batch_stats"]["mean"].astype(jnp.complex64)
    train = {"use_running_average": False}
    y_linen, new_linen, _ = linen_results(linen, variables, x, grads=False, **train)
    y, new, _ = our_results(ours, variables, x, grads=False, is_training=True)
    assert_close(y, y_linen)
    assert_close(new, new_linen)
    assert float(jnp.abs(new["batch_stats"]["mean"].imag).max()) > 0.01
    # evaluation with the updated averages: the imaginary part of the mean is used
    trained = {**variables, **new_linen}
    y_linen, _, _ = linen_results(linen, trained, x, grads=False, use_running_average=True)
    y, _, _ = our_results(ours, trained, x, grads=False, is_training=False)
    assert_close(y, y_linen)
    # dtype=None stores the running mean in param_dtype's kind
    inferred = lm.BatchNorm(4, dtype=None, param_dtype=jnp.complex64)
    assert layout(lm.transform(inferred).init(jax.random.key(0)))["batch_stats"]["mean"] == (
        (4,),
        jnp.complex64,
    )


@pytest.mark.parametrize(
    ("linen", "ours", "kwargs"),
    [
        (nn.GroupNorm(num_groups=3), lm.GroupNorm(3, 6, dtype=None), {}),
        (nn.BatchNorm(), lm.BatchNorm(6, dtype=None), "train"),
    ],
    ids=["group", "batch"],
)
def test_dtype_none_is_linens_default(linen, ours, kwargs):
    """bfloat16 inputs, float32 parameters: statistics in float32, float32 outputs (Linen's)."""
    x = data((3, 2, 6), dtype=jnp.bfloat16)
    if kwargs == "train":
        y, _, _ = check(linen, ours, x, {"use_running_average": False}, {"is_training": True})
    else:
        y, _, _ = check(linen, ours, x)
    assert y.dtype == jnp.float32


@pytest.mark.parametrize(
    "layer",
    [
        lambda: lm.LayerNorm(6),
        lambda: lm.RMSNorm(6),
        lambda: lm.GroupNorm(3, 6),
        lambda: lm.InstanceNorm(6),
        lambda: lm.BatchNorm(6),
    ],
    ids=["layer", "rms", "group", "instance", "batch"],
)
def test_complex_input_under_a_real_dtype_is_an_error(layer):
    ours = layer()
    init, apply = lm.transform(ours)
    args = (True,) if isinstance(ours, lm.BatchNorm) else ()
    with pytest.raises(
        TypeError, match=r"got a complex64 value but computes in float32.*dtype=None"
    ):
        apply(init(jax.random.key(0)), None, data((2, 3, 6), dtype=jnp.complex64), *args)


def test_batch_norm_complex_input_with_a_real_running_mean_is_an_error():
    init, apply = lm.transform(lm.BatchNorm(6, dtype=None))
    with pytest.raises(
        TypeError, match=r"batch mean is complex.*stores its running mean as float32"
    ):
        apply(init(jax.random.key(0)), None, data((2, 6), dtype=jnp.complex64), True)


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
    x = data(shape)
    module = LinenSpectral(linen, options)
    variables = linen_init(module, x, update_stats=True)
    name = "layer"  # the Linen wrapper module's field
    y_l, new_l, (g_l, gx_l) = linen_results(module, variables, x, update_stats=update_stats)
    wrapper = lm.SpectralNorm(ours(), **options)
    ours_vars = spectral_to_ours(variables, name)
    assert layout(lm.transform(wrapper).init(jax.random.key(0))) == layout(ours_vars)
    y, new, (g, gx) = our_results(wrapper, ours_vars, x, update_stats=update_stats)
    assert_close(y, y_l)
    assert_close(
        new, {"batch_stats": spectral_to_ours({**variables, **new_l}, name)["batch_stats"]}
    )
    assert_close(g, {"layer": g_l[name]}, atol=1e-5)
    assert_close(gx, gx_l)
    if not update_stats:
        assert_close(new, {"batch_stats": ours_vars["batch_stats"]}, rtol=0, atol=0)


def test_spectral_norm_options():
    x = data((3, 5))
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
    assert_close(y, expected)
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
    x = data(shape)
    module = LinenWeightNorm(linen, options)
    variables = linen_init(module, x)
    name = "layer"  # the Linen wrapper module's field
    y_l, _, (g_l, gx_l) = linen_results(module, variables, x)
    ours_options = dict(options)
    if "variable_filter" in options:
        ours_options["variable_filter"] = tuple(options["variable_filter"])
    wrapper = lm.WeightNorm(ours(), **ours_options)
    ours_vars = weight_norm_to_ours(variables, name)
    assert layout(lm.transform(wrapper).init(jax.random.key(0))) == layout(ours_vars)
    y, _, (g, gx) = our_results(wrapper, ours_vars, x)
    assert_close(y, y_l)
    assert_close(g, weight_norm_to_ours({"params": g_l}, name)["params"], atol=1e-5)
    assert_close(gx, gx_l)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("wrapper", ["spectral", "weight"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrapped_half_precision_layer_matches_linen(dtype, wrapper, jit):
    """The wrapper's float32 normalised kernel reaches a half-precision layer as Linen's does.

    The layer computes with the kernel in its own dtype (the wrapper casts explicitly); the
    default ``dtype=float32`` of the wrapper was refused as a narrowing substitution.
    """
    x = data((3, 5))
    layer = nn.Dense(4, dtype=dtype, param_dtype=dtype)
    if wrapper == "spectral":
        module, kwargs = LinenSpectral(layer, {"n_steps": 2}), {"update_stats": True}
        ours = lm.SpectralNorm(lm.Dense(5, 4, dtype=dtype), n_steps=2)
        to_ours = spectral_to_ours
    else:
        module, kwargs = LinenWeightNorm(layer, {}), {}
        ours = lm.WeightNorm(lm.Dense(5, 4, dtype=dtype))
        to_ours = weight_norm_to_ours
    variables = linen_init(module, x, **kwargs)
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
        assert_close(new["batch_stats"], expected)


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
        assert_close(y, plain)
        assert_close(new, variables)
    # gradients of a substituted value reach the original: d/dk sum(x @ (3k)) = 3 x^T 1
    wrapper = lm.WeightNorm(lm.Dense(2, 2), use_scale=False, feature_axes=None)
    init, apply = lm.transform(wrapper)
    v = init(jax.random.key(1))

    def loss(params):
        return jnp.sum(apply({"params": params}, None, x)[0])

    k = v["params"]["layer"]["kernel"]
    expected = jax.grad(lambda k: jnp.sum(x @ (k / jnp.sqrt(jnp.sum(k * k) + 1e-12))))(k)
    assert_close(jax.grad(loss)(v["params"])["layer"]["kernel"], expected)


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
    x = data((2, 3))
    y, new = jax.jit(apply, static_argnames="update_stats")(variables, None, x, update_stats=True)
    single = jax.jit(
        lm.transform(lm.SpectralNorm(lm.Dense(3, 3))).apply, static_argnames="update_stats"
    )
    expected = x
    for i in range(2):
        member = jax.tree.map(lambda a, i=i: a[i], {c: v["block"] for c, v in variables.items()})
        expected, member_new = single(member, None, expected, update_stats=True)
        assert_close(
            jax.tree.map(lambda a, i=i: a[i], new["batch_stats"]["block"]),
            member_new["batch_stats"],
        )
    assert_close(y, expected)


# --- errors of the new options -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: lm.LayerNorm(4, reduction_axes="last"),
            TypeError,
            r"LayerNorm: reduction_axes must be an int or a tuple of ints",
        ),
        (
            lambda: lm.LayerNorm(4, feature_axes=(-1, -1)),
            ValueError,
            r"LayerNorm: feature_axes=\(-1, -1\) names an axis twice",
        ),
        (
            lambda: lm.LayerNorm((3, 4)),
            ValueError,
            r"LayerNorm: size=\(3, 4\) gives 2 sizes but feature_axes=-1 names 1 axes",
        ),
        (
            lambda: lm.LayerNorm(4, feature_axes=(1, 2)),
            ValueError,
            r"LayerNorm: size=4 is one size but feature_axes=\(1, 2\) names 2 axes",
        ),
        (
            lambda: lm.RMSNorm((3, 0), feature_axes=(1, 2)),
            ValueError,
            r"RMSNorm: size must be a positive int",
        ),
        (
            lambda: lm.BatchNorm((3, 4), axis=1),
            ValueError,
            r"BatchNorm: size=\(3, 4\) gives 2 sizes but axis=1 names 1 axes",
        ),
        (
            lambda: lm.InstanceNorm(4, feature_axes=0),
            ValueError,
            r"InstanceNorm: feature_axes=0 includes axis 0, the batch axis",
        ),
        (
            lambda: lm.GroupNorm(2, 6, group_size=3),
            ValueError,
            r"GroupNorm: give exactly one of num_groups and group_size, got num_groups=2 and "
            r"group_size=3",
        ),
        (
            lambda: lm.GroupNorm(None, 6),
            ValueError,
            r"GroupNorm: give exactly one of num_groups and group_size",
        ),
        (
            lambda: lm.GroupNorm(None, 6, group_size=4),
            ValueError,
            r"GroupNorm: group_size=4 does not divide size=6.*divisors of 6: 1, 2, 3, 6",
        ),
        (
            lambda: lm.GroupNorm(None, 6, group_size=0),
            ValueError,
            r"GroupNorm: group_size must be a positive int",
        ),
        (
            lambda: lm.GroupNorm(2, (2, 3)),
            TypeError,
            r"GroupNorm: size must be a positive int.*groups split one channel axis",
        ),
        (
            lambda: lm.LayerNorm(4, use_fast_variance="no"),
            TypeError,
            r"LayerNorm: use_fast_variance must be True or False",
        ),
    ],
)
def test_construction_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    ("layer", "x", "kwargs", "error", "match"),
    [
        (
            lm.LayerNorm((3, 4), reduction_axes=(1, 2), feature_axes=(1, 2)),
            jnp.ones((2, 4, 3)),
            {},
            ValueError,
            r"LayerNorm\(size=\(3, 4\), feature_axes=\(1, 2\)\) got an input of shape \(2, 4, 3\): "
            r"its feature axes \(1, 2\) must have sizes \(3, 4\), got \(4, 3\)",
        ),
        (
            lm.LayerNorm(4, reduction_axes=3),
            jnp.ones((2, 4)),
            {},
            ValueError,
            r"LayerNorm\(size=4\) got an input of shape \(2, 4\), which has no axis 3 "
            r"\(reduction_axes\): its axes are -2 to 1",
        ),
        (
            lm.LayerNorm(4, reduction_axes=(1, -1)),
            jnp.ones((2, 4)),
            {},
            ValueError,
            r"reduction_axes=\(1, -1\) names the same axis twice for 2 axes",
        ),
        (
            lm.LayerNorm(4),
            jnp.ones((2, 4)),
            {"mask": jnp.ones((2, 4))},
            TypeError,
            r"LayerNorm\(size=4\) got a mask of dtype float32: a mask is boolean",
        ),
        (
            lm.LayerNorm(4),
            jnp.ones((2, 4)),
            {"mask": jnp.ones((3, 4), bool)},
            ValueError,
            r"got a mask of shape \(3, 4\) for an input of shape \(2, 4\): the mask must broadcast",
        ),
        (
            lm.InstanceNorm(4, feature_axes=-2),
            jnp.ones((4, 3)),
            {},
            ValueError,
            r"feature_axes=-2 include axis 0, the batch axis",
        ),
        (
            lm.GroupNorm(2, 4, reduction_axes=1),
            jnp.ones((2, 3, 4)),
            {},
            ValueError,
            r"GroupNorm\(num_groups=2, size=4\): reduction_axes=1 must include the last axis",
        ),
        (
            lm.BatchNorm((3, 4), axis=(0, 1)),
            jnp.ones((3, 4)),
            {"is_training": True},
            ValueError,
            r"BatchNorm\(size=\(3, 4\), axis=\(0, 1\)\) at the root got an input of shape "
            r"\(3, 4\) while training: its batch statistics "
            r"reduce over no axis .*Train on batches of at least 2 examples, normalise with the "
            r"running averages \(is_training=False, .*or average the statistics over a mapped "
            r"axis \(axis_name=, ",
        ),
    ],
    ids=[
        "feature_sizes",
        "axis_range",
        "axis_twice",
        "mask_dtype",
        "mask_shape",
        "instance_batch",
        "group_axes",
        "batch_no_axis",
    ],
)
def test_call_errors(layer, x, kwargs, error, match):
    init, apply = lm.transform(layer)
    with pytest.raises(error, match=match):
        apply(init(jax.random.key(0)), None, x, **kwargs)


def test_new_settings_are_read_only():
    layer = lm.LayerNorm(4, reduction_axes=-1)
    assert (layer.reduction_axes, layer.feature_axes, layer.use_fast_variance) == (
        (-1,),
        (-1,),
        True,
    )
    for name, value in [("reduction_axes", 0), ("feature_axes", 0), ("use_fast_variance", False)]:
        with pytest.raises(AttributeError, match=rf"LayerNorm.{name} is read-only"):
            setattr(layer, name, value)
    with pytest.raises(AttributeError, match=r"WeightNorm.variable_filter is read-only"):
        lm.WeightNorm(lm.Dense(2, 2)).variable_filter = ("bias",)


# --- statistics averaged over a mapped axis ------------------------------------------------------


@pytest.mark.parametrize(
    "linen, ours",
    [
        (nn.LayerNorm(axis_name="i"), lm.LayerNorm(5, axis_name="i")),
        (nn.RMSNorm(axis_name="i", use_fast_variance=False), lm.RMSNorm(5, axis_name="i")),
        (
            nn.GroupNorm(num_groups=None, group_size=1, axis_name="i", use_fast_variance=False),
            lm.GroupNorm(None, 5, group_size=1, axis_name="i", use_fast_variance=False),
        ),
        (nn.InstanceNorm(axis_name="i"), lm.InstanceNorm(5, axis_name="i")),
    ],
    ids=["layer", "rms", "group", "instance"],
)
def test_axis_name_averages_the_statistics_over_the_mapped_axis_as_linen(linen, ours):
    x = data((4, 2, 3, 5))  # vmapped over the first axis: 4 replicas of (2, 3, 5)
    variables = randomize(lm.transform(ours).init(jax.random.key(0)))  # Linen's layout
    with jax.numpy_dtype_promotion("standard"):
        expected = jax.vmap(lambda x: linen.apply(variables, x), axis_name="i")(x)
    apply = lm.transform(ours).apply
    got = jax.vmap(lambda x: apply(variables, None, x)[0], axis_name="i")(x)
    assert_close(got, expected, atol=1e-5)
    alone = jax.vmap(
        lambda x: lm.transform(
            type(ours)(5)
            if not isinstance(ours, lm.GroupNorm)
            else lm.GroupNorm(None, 5, group_size=1)
        ).apply(variables, None, x)[0]
    )(x)
    assert not np.allclose(got, alone)  # the mapped axis mattered


def test_axis_name_outside_a_mapped_axis_is_a_clear_error():
    layer = lm.LayerNorm(5, axis_name="batch")
    init, apply = lm.transform(layer)
    with pytest.raises(
        NameError,
        match=r"^LayerNorm\(size=5\) averages its statistics over "
        r"the mapped axis 'batch'.*jax\.vmap\(step, axis_name='batch'\)",
    ):
        apply(init(jax.random.key(0)), None, jnp.ones((2, 5)))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: lm.LayerNorm(5, axis_index_groups=[[0, 1]]), ValueError, "axis_name is None"),
        (
            lambda: lm.BatchNorm(5, axis_name="i", axis_index_groups=[0, 1]),
            TypeError,
            r"axis_index_groups must be a list of lists",
        ),
        (lambda: lm.GroupNorm(1, 5, axis_name=3), TypeError, r"axis_name must be None, the name"),
    ],
)
def test_axis_options_are_checked_when_built(make, error, match):
    with pytest.raises(error, match=match):
        make()


_GROUPS_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, lamina as lm
x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 5)) + 1.0, jnp.float32)
groups = [[0, 1], [2, 3]]
for linen, ours, kw, our_kw in [
    (nn.LayerNorm(axis_name="i", axis_index_groups=groups),
     lm.LayerNorm(5, axis_name="i", axis_index_groups=groups), {}, {}),
    (nn.BatchNorm(axis_name="i", axis_index_groups=groups, use_running_average=False),
     lm.BatchNorm(5, axis_name="i", axis_index_groups=groups), {"mutable": True},
     {"is_training": True}),
]:
    variables = lm.transform(ours).init(jax.random.key(1))
    variables["params"]["scale"] = 1.0 + jnp.arange(5.0) / 10
    expected = jax.pmap(lambda x: linen.apply(variables, x, **kw), axis_name="i")(x)
    apply = lm.transform(ours).apply
    got = jax.pmap(lambda x: apply(variables, None, x, **our_kw), axis_name="i")(x)
    if isinstance(expected, tuple):  # BatchNorm: the running averages too
        np.testing.assert_allclose(
            got[1]["batch_stats"]["mean"], expected[1]["batch_stats"]["mean"], rtol=1e-5
        )
        expected = expected[0]
    np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-5)
    # the two groups' statistics differ: replicas 0 and 2 do not normalise alike
    assert not np.allclose(got[0][0] - got[0][2], 0.0)
print("ok")
"""


def test_axis_index_groups_average_within_each_group_as_linen():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _GROUPS_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
