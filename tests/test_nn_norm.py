"""The normalisations over statistics against Flax Linen, given the same weights.

`BatchNorm`, `LayerNorm`, `RMSNorm`, `GroupNorm` and `InstanceNorm`: the layout of their
variables, outputs, updated statistics and gradients (parameters and inputs) equal Linen's,
with masks, reduction and feature axes, ``group_size``, the two-pass variance, complex inputs
(and the complex running mean of `BatchNorm`), the dtype contract, statistics averaged over a
mapped axis; every error a user can cause.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import BatchNorm, GroupNorm, LayerNorm, RMSNorm
from tests.helpers import assert_close, assert_close_complex, layout, shifted_normal
from tests.linen_helpers import (
    compare_with_linen,
    linen_init,
    linen_random_variables,
    linen_results,
    linen_shapes,
    our_results,
    randomize,
)

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

FEATURES = 6
GROUPS = 3
SHAPES = {"2d": (5, FEATURES), "4d": (2, 4, 3, FEATURES)}


def make(kind, **options):
    """The Linen layer and the lamina layer of `kind` with the same settings."""
    linen_options = dict(options)
    if "scale_value" in options:  # a constant scale_init, built by each library
        value = linen_options.pop("scale_value")
        linen_options["scale_init"] = jax.nn.initializers.constant(value)
        options["scale_init"] = lm.initializers.constant(options.pop("scale_value"))
    if kind == "batch":
        return nn.BatchNorm(**linen_options), BatchNorm(FEATURES, **options)
    if kind == "layer":
        return nn.LayerNorm(**linen_options), LayerNorm(FEATURES, **options)
    if kind == "rms":
        return nn.RMSNorm(**linen_options), RMSNorm(FEATURES, **options)
    return nn.GroupNorm(num_groups=GROUPS, **linen_options), GroupNorm(GROUPS, FEATURES, **options)


def init_options(kind):
    """The keyword arguments of Linen's init: BatchNorm initialises in training mode."""
    return {"use_running_average": False} if kind == "batch" else {}


def random_variables(kind, module, x):
    """Variables in Linen's layout with non-trivial values."""
    return linen_random_variables(module, x, **init_options(kind))


def linen_run(kind, module, variables, x, is_training=None):
    """Linen's output and its batch_stats afterwards (None for the stateless layers)."""
    with jax.numpy_dtype_promotion("standard"):  # Linen mixes bfloat16 and float32 implicitly
        return linen_program(kind, module, is_training)(variables, x)


@functools.cache
def linen_program(kind, module, is_training):
    """Linen's call as one compiled program (op by op, Linen would compile every primitive)."""

    def run(variables, x):
        if kind != "batch":
            return module.apply(variables, x), None
        y, updates = module.apply(
            variables, x, use_running_average=not is_training, mutable=["batch_stats"]
        )
        return y, updates["batch_stats"]

    return jax.jit(run)


def ours_run(kind, module, variables, x, is_training=None):
    """Our output and the new variables."""
    _, apply = lm.transform(module)
    args = (x, is_training) if kind == "batch" else (x,)
    return apply(variables, None, *args)


def inputs(key, shape, dtype=jnp.float32):
    return (1.0 + 2.0 * jax.random.normal(key, shape)).astype(dtype)


# --- layout and options ------------------------------------------------------------------------

OPTIONS = [
    ("batch", {}),
    ("batch", {"use_scale": False, "momentum": 0.8, "epsilon": 1e-3}),
    ("batch", {"use_bias": False, "param_dtype": jnp.bfloat16}),
    ("layer", {}),
    ("layer", {"use_bias": False, "epsilon": 1e-2}),
    ("layer", {"use_scale": False, "scale_value": 2.0}),
    ("rms", {}),
    ("rms", {"use_scale": False}),
    ("rms", {"scale_value": 2.0, "epsilon": 0.5}),
    ("group", {}),
    ("group", {"use_scale": False, "use_bias": False}),
    ("group", {"scale_value": 2.0, "param_dtype": jnp.bfloat16}),
]


@pytest.mark.parametrize(("kind", "options"), OPTIONS, ids=lambda v: str(v))
def test_init_layout_and_options_match_linen(getkey, kind, options):
    linen, ours = make(kind, **options)
    x = inputs(getkey(), SHAPES["2d"])
    expected = linen_init(linen, x, **init_options(kind))
    init = lm.transform(ours).init(getkey())
    assert layout(init) == layout(expected)
    assert_close(init, expected, rtol=0, atol=0)  # ones, zeros, constants: exactly Linen's
    variables = randomize(expected)
    is_training = True if kind == "batch" else None
    y_linen, stats_linen = linen_run(kind, linen, variables, x, is_training)
    y, new = ours_run(kind, ours, variables, x, is_training)
    assert_close(y, y_linen)
    if kind == "batch":
        assert_close(new["batch_stats"], dict(stats_linen))


def test_batch_norm_variables_are_linen_names_and_kinds():
    bn = BatchNorm(4)
    assert isinstance(bn.scale, lm.Parameter) and isinstance(bn.bias, lm.Parameter)
    assert isinstance(bn.mean, lm.BatchStat) and isinstance(bn.var, lm.BatchStat)
    assert layout(lm.transform(bn).init(jax.random.key(0))) == {
        "params": {"scale": ((4,), jnp.float32), "bias": ((4,), jnp.float32)},
        "batch_stats": {"mean": ((4,), jnp.float32), "var": ((4,), jnp.float32)},
    }


# --- numerical parity: outputs, state, gradients -----------------------------------------------


@pytest.mark.parametrize("is_training", [True, False])
@pytest.mark.parametrize("shape", ["2d", "4d"])
def test_batch_norm_matches_linen(getkey, shape, is_training):
    linen, ours = make("batch", momentum=0.9)
    x = inputs(getkey(), SHAPES[shape])
    variables = random_variables("batch", linen, x)
    y_linen, stats_linen = linen_run("batch", linen, variables, x, is_training)
    y, new = ours_run("batch", ours, variables, x, is_training)
    assert_close(y, y_linen)
    assert_close(new["batch_stats"], dict(stats_linen))
    assert_close(new["params"], variables["params"], rtol=0, atol=0)
    if is_training:  # the stats moved, so the comparison above is not vacuous
        assert not np.allclose(new["batch_stats"]["mean"], variables["batch_stats"]["mean"])

    weights = jax.random.normal(getkey(), x.shape)
    _, apply = lm.transform(ours)

    def loss_ours(params, x):
        y, _ = apply({**variables, "params": params}, None, x, is_training)
        return jnp.sum(y * weights)

    def loss_linen(params, x):
        y, _ = linen_run("batch", linen, {**variables, "params": params}, x, is_training)
        return jnp.sum(y * weights)

    grads = jax.jit(jax.grad(loss_ours, argnums=(0, 1)))(variables["params"], x)
    expected = jax.jit(jax.grad(loss_linen, argnums=(0, 1)))(variables["params"], x)
    assert_close(grads, expected, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(grads[1]).max()) > 1e-3  # a gradient that could be wrong


@pytest.mark.parametrize("shape", ["2d", "4d"])
@pytest.mark.parametrize("kind", ["layer", "rms", "group"])
def test_stateless_norms_match_linen(getkey, kind, shape):
    linen, ours = make(kind)
    x = inputs(getkey(), SHAPES[shape])
    variables = random_variables(kind, linen, x)
    y_linen, _ = linen_run(kind, linen, variables, x)
    y, new = ours_run(kind, ours, variables, x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert_close(y, y_linen)
    assert_close(new, variables, rtol=0, atol=0)

    weights = jax.random.normal(getkey(), x.shape)
    _, apply = lm.transform(ours)

    def loss_ours(variables, x):
        return jnp.sum(apply(variables, None, x)[0] * weights)

    def loss_linen(variables, x):
        return jnp.sum(linen_run(kind, linen, variables, x)[0] * weights)

    grads = jax.jit(jax.grad(loss_ours, argnums=(0, 1)))(variables, x)
    expected = jax.jit(jax.grad(loss_linen, argnums=(0, 1)))(variables, x)
    assert_close(grads, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["batch", "layer"])
def test_variance_is_linens_fast_variance(getkey, kind):
    """``E[x^2] - E[x]^2`` in float32, as Linen: off by ~5e-2 from the exact variance here."""
    x = 300.0 + jax.random.normal(getkey(), (16, 64))
    options = {"use_scale": False, "use_bias": False}
    if kind == "batch":
        linen, ours = nn.BatchNorm(**options), BatchNorm(64, **options)
    else:
        linen, ours = nn.LayerNorm(**options), LayerNorm(64, **options)
    variables = random_variables(kind, linen, x)
    is_training = True if kind == "batch" else None
    y_linen, _ = linen_run(kind, linen, variables, x, is_training)
    y, _ = ours_run(kind, ours, variables, x, is_training)
    axis = 0 if kind == "batch" else -1
    exact = np.asarray(x, np.float64)
    exact = (exact - exact.mean(axis, keepdims=True)) / np.sqrt(exact.var(axis, keepdims=True))
    assert np.abs(np.asarray(y_linen) - exact).max() > 2e-2  # the two variances differ here
    np.testing.assert_allclose(y, y_linen, rtol=0, atol=2e-3)


def test_group_norm_statistics_are_per_group_over_non_batch_axes(getkey):
    """Independent of Linen: each (example, group) has zero mean and unit variance."""
    x = inputs(getkey(), SHAPES["4d"])
    y, _ = ours_run("group", GroupNorm(GROUPS, FEATURES, use_scale=False, use_bias=False), {}, x)
    grouped = y.reshape(2, 4, 3, GROUPS, FEATURES // GROUPS)
    np.testing.assert_allclose(grouped.mean(axis=(1, 2, 4)), 0.0, atol=1e-5)
    np.testing.assert_allclose(grouped.var(axis=(1, 2, 4)), 1.0, rtol=1e-4)


def test_batch_norm_training_steps_match_linen(getkey):
    linen, ours = make("batch", momentum=0.8)
    _, apply = lm.transform(ours)
    step = jax.jit(lambda v, x: apply(v, None, x, True))  # is_training: a literal in the program
    variables = random_variables("batch", linen, inputs(getkey(), (8, FEATURES)))
    theirs = variables
    for i in range(5):
        x = inputs(getkey(), (8, FEATURES)) * (i + 1)
        y, variables = step(variables, x)
        y_linen, stats = linen_run("batch", linen, theirs, x, True)
        theirs = {**theirs, "batch_stats": stats}
        assert_close(y, y_linen)
        assert_close(variables["batch_stats"], dict(stats))
    x = inputs(getkey(), (8, FEATURES))
    assert_close(
        ours_run("batch", ours, variables, x, False)[0],
        linen_run("batch", linen, theirs, x, False)[0],
    )


def test_batch_norm_running_average_formula(getkey):
    x = inputs(getkey(), SHAPES["4d"])
    _, apply = lm.transform(BatchNorm(FEATURES, momentum=0.75))
    variables = randomize(jax.eval_shape(lm.transform(BatchNorm(FEATURES)).init, getkey()))
    _, new = apply(variables, None, x, True)
    old = variables["batch_stats"]
    flat = np.asarray(x, np.float64).reshape(-1, FEATURES)
    np.testing.assert_allclose(
        new["batch_stats"]["mean"], 0.75 * old["mean"] + 0.25 * flat.mean(0), rtol=1e-5
    )
    np.testing.assert_allclose(
        new["batch_stats"]["var"], 0.75 * old["var"] + 0.25 * flat.var(0), rtol=1e-4
    )
    for momentum, expected in [(1.0, old), (0.0, {"mean": flat.mean(0), "var": flat.var(0)})]:
        _, apply = lm.transform(BatchNorm(FEATURES, momentum=momentum))
        _, new = apply(variables, None, x, True)
        assert_close(
            jax.tree.map(np.float64, new["batch_stats"]),
            jax.tree.map(np.float64, dict(expected)),
            rtol=1e-4,
        )


def test_batch_norm_eval_writes_nothing(getkey):
    x = inputs(getkey(), SHAPES["4d"])
    _, apply = lm.transform(BatchNorm(FEATURES))
    variables = randomize(jax.eval_shape(lm.transform(BatchNorm(FEATURES)).init, getkey()))
    for run in (apply, jax.jit(apply, static_argnums=3)):
        y, new = run(variables, None, x, False)
        for name in ("mean", "var"):
            np.testing.assert_array_equal(new["batch_stats"][name], variables["batch_stats"][name])
        stats = variables["batch_stats"]
        shape = (1, 1, 1, FEATURES)
        expected = (x - stats["mean"].reshape(shape)) / jnp.sqrt(stats["var"].reshape(shape) + 1e-5)
        expected = expected * variables["params"]["scale"].reshape(shape)
        expected = expected + variables["params"]["bias"].reshape(shape)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    _, new = apply(variables, None, x, False)
    assert new["batch_stats"]["mean"] is variables["batch_stats"]["mean"]  # not even rewritten
    _, trained = apply(variables, None, x, True)
    assert not np.allclose(trained["batch_stats"]["var"], variables["batch_stats"]["var"])


# --- axis_name: statistics averaged over a mapped axis -----------------------------------------


def test_batch_norm_axis_name_equals_concatenated_batch_and_linen(getkey):
    linen, ours = make("batch", momentum=0.9, axis_name="data")
    xs = inputs(getkey(), (3, 4, 2, FEATURES))  # 3 replicas of a (4, 2, features) batch
    variables = random_variables("batch", linen, xs[0])
    _, apply = lm.transform(ours)
    y, new = jax.vmap(lambda x: apply(variables, None, x, True), axis_name="data")(xs)
    y_linen, stats_linen = jax.vmap(
        lambda x: linen_run("batch", linen, variables, x, True), axis_name="data"
    )(xs)
    assert_close(y, y_linen)
    assert_close(new["batch_stats"], dict(stats_linen))

    _, apply_single = lm.transform(BatchNorm(FEATURES, momentum=0.9))
    y_all, new_all = apply_single(variables, None, xs.reshape(12, 2, FEATURES), True)
    assert_close(y.reshape(12, 2, FEATURES), y_all)
    for name in ("mean", "var"):
        for replica in new["batch_stats"][name]:  # every replica holds the global averages
            np.testing.assert_allclose(replica, new_all["batch_stats"][name], rtol=1e-5)
    # Evaluation needs no mapped axis: it uses the running averages.
    y_eval, _ = apply(variables, None, xs[0], False)
    assert_close(y_eval, apply_single(variables, None, xs[0], False)[0])


# --- dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["batch", "layer", "rms", "group"])
def test_bfloat16_compute_float32_storage_matches_linen(getkey, kind, x_dtype):
    linen, ours = make(kind, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    x = inputs(getkey(), SHAPES["4d"], x_dtype)
    expected_init = linen_shapes(linen, x, **init_options(kind))
    assert layout(jax.eval_shape(lm.transform(ours).init, getkey())) == layout(expected_init)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(expected_init))
    variables = randomize(expected_init)
    is_training = True if kind == "batch" else None
    y_linen, stats_linen = linen_run(kind, linen, variables, x, is_training)
    y, new = ours_run(kind, ours, variables, x, is_training)
    assert y.dtype == jnp.bfloat16 == y_linen.dtype
    # The statistics and arithmetic are float32 in both: at most one bfloat16 rounding apart.
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(y_linen, np.float32), rtol=8e-3, atol=1e-2
    )
    assert float(jnp.mean(y.astype(jnp.float32) == y_linen.astype(jnp.float32))) > 0.98
    if kind == "batch":
        assert_close(new["batch_stats"], dict(stats_linen))
        assert_close(new["params"], variables["params"], rtol=0, atol=0)


def test_bfloat16_statistics_are_float32(getkey):
    """Values whose variance bfloat16 arithmetic would lose: float32 statistics keep it."""
    x = (1000.0 + jax.random.normal(getkey(), (64, FEATURES))).astype(jnp.bfloat16)
    _, apply = lm.transform(LayerNorm(FEATURES, dtype=jnp.bfloat16, param_dtype=jnp.float32))
    variables = lm.transform(LayerNorm(FEATURES)).init(getkey())
    y, _ = apply(variables, None, x.reshape(-1, FEATURES))
    reference = np.asarray(x, np.float64)
    reference = (reference - reference.mean(-1, keepdims=True)) / np.sqrt(
        reference.var(-1, keepdims=True) + 1e-6
    )
    np.testing.assert_allclose(np.asarray(y, np.float32), reference, rtol=2e-2, atol=2e-2)


# --- jit and is_training ------------------------------------------------------------------------


def test_batch_norm_under_jit_with_static_is_training(getkey):
    x = inputs(getkey(), SHAPES["2d"])
    init, apply = lm.transform(BatchNorm(FEATURES))
    variables = randomize(jax.eval_shape(init, getkey()))
    jitted = jax.jit(apply, static_argnums=3)
    for is_training in (True, False):
        assert_close(
            jitted(variables, None, x, is_training), apply(variables, None, x, is_training)
        )
    with pytest.raises(TypeError, match=r"is_training must be a Python bool.*static_argnames"):
        jax.jit(apply)(variables, None, x, True)  # traced
    with pytest.raises(TypeError, match=r"is_training must be a Python bool, got ArrayImpl"):
        apply(variables, None, x, jnp.array(True))
    with pytest.raises(TypeError, match=r"is_training must be a Python bool, got int"):
        apply(variables, None, x, 1)


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer", "call", "settings"),
    [
        (BatchNorm(FEATURES), lambda f, x: f(x, True), r"BatchNorm\(size=6\)"),
        (LayerNorm(FEATURES), lambda f, x: f(x), r"LayerNorm\(size=6\)"),
        (RMSNorm(FEATURES), lambda f, x: f(x), r"RMSNorm\(size=6\)"),
        (
            GroupNorm(GROUPS, FEATURES),
            lambda f, x: f(x),
            r"GroupNorm\(num_groups=3, size=6\)",
        ),
    ],
    ids=["batch", "layer", "rms", "group"],
)
def test_wrong_last_axis_is_a_clear_error(getkey, layer, call, settings):
    init, apply = lm.transform(layer)
    variables = init(getkey())
    with pytest.raises(
        ValueError,
        match=settings + r" got an input of shape \(2, 4, 5\): its last axis must be "
        r"size=6, got 5\..*size=5.*features must be on the last axis",
    ):
        call(lambda *a: apply(variables, None, *a), jnp.ones((2, 4, 5)))
    with pytest.raises(
        ValueError,
        match=settings + r" got an input of shape \(\): its last axis must be size=6, "
        r"but a scalar has none",
    ):
        call(lambda *a: apply(variables, None, *a), jnp.ones(()))


def test_group_norm_groups_must_divide_features():
    with pytest.raises(
        ValueError,
        match=r"GroupNorm: num_groups=4 does not divide size=6.*divisors of 6: 1, 2, 3, 6",
    ):
        GroupNorm(4, 6)
    for bad in (0, -2, 2.0, True):  # None: the groups are given by group_size instead
        with pytest.raises(
            ValueError, match=rf"^GroupNorm: num_groups must be a positive int, got {bad!r}\.$"
        ):
            GroupNorm(bad, 6)


@pytest.mark.parametrize("momentum", [1.5, -0.1, True, "0.9"])
def test_momentum_outside_unit_interval(momentum):
    with pytest.raises(ValueError, match=r"BatchNorm: momentum must be a number in \[0, 1\]"):
        BatchNorm(FEATURES, momentum=momentum)


@pytest.mark.parametrize(
    "layer", [BatchNorm, LayerNorm, RMSNorm, lambda n, **kw: GroupNorm(1, n, **kw)]
)
def test_bad_settings_are_clear_errors(layer):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"Norm: size must be a positive int, the size of"):
            layer(bad)
    for bad in (-1e-5, float("nan"), float("inf"), "1e-5"):
        with pytest.raises(ValueError, match=r"Norm: epsilon must be a finite non-negative number"):
            layer(FEATURES, epsilon=bad)
    for name in ("dtype", "param_dtype"):
        with pytest.raises(TypeError, match=rf"Norm: {name} must be a dtype such as jnp.float32"):
            layer(FEATURES, **{name: "float3"})
        with pytest.raises(TypeError, match=rf"Norm: {name} must be a floating or complex dtype"):
            layer(FEATURES, **{name: jnp.int32})
    for name in ("use_scale", "scale_init"):
        with pytest.raises(TypeError, match=rf"Norm: {name} must be"):
            layer(FEATURES, **{name: "yes"})
    with pytest.raises(TypeError, match=r"positional argument"):
        layer(FEATURES, 1e-3)  # epsilon is keyword-only


def test_batch_norm_axis_name_errors(getkey):
    with pytest.raises(TypeError, match=r"axis_name must be None, the name of a mapped axis"):
        BatchNorm(FEATURES, axis_name=["data"])
    init, apply = lm.transform(BatchNorm(FEATURES, axis_name="data"))
    with pytest.raises(
        NameError,
        match=r"^BatchNorm\(size=6\) averages its statistics over the mapped axis 'data'.*"
        r"jax.vmap\(step, axis_name='data'\)",
    ):
        apply(init(getkey()), None, jnp.ones((2, FEATURES)), True)


class _Holder(lm.Module):
    """A BatchNorm under a path, for the messages."""

    def __init__(self, **options):
        self.bn = BatchNorm(FEATURES, **options)

    def __call__(self, x, is_training):
        return self.bn(x, is_training)


@pytest.mark.parametrize("shape", [(1, FEATURES), (FEATURES,), (1, 1, FEATURES)])
@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_training_over_one_entry_per_feature_is_an_error(getkey, shape, jit):
    """Statistics of one entry make every output the bias: an error, eager and under jit."""
    init, apply = lm.transform(_Holder())
    variables = init(getkey())
    run = jax.jit(apply, static_argnums=3) if jit else apply
    with pytest.raises(
        ValueError,
        match=rf"^BatchNorm\(size=6\) at bn got an input of shape {re_shape(shape)} while "
        r"training: .*1 entry per feature.*every output would be the bias\. Train on batches "
        r"of at least 2 examples, .*is_training=False.*axis_name=",
    ):
        run(variables, None, jnp.ones(shape), True)
    y, _ = run(variables, None, jnp.ones(shape), False)  # the running averages: fine
    assert y.shape == shape
    y, _ = run(variables, None, jnp.arange(2.0 * FEATURES).reshape(2, FEATURES), True)
    assert_close(y, jnp.concatenate([-jnp.ones((1, FEATURES)), jnp.ones((1, FEATURES))]))


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_mask_selecting_fewer_than_two_entries_is_an_error(getkey, jit):
    """A concrete mask counts: one True per feature makes every output the bias, none NaN."""
    init, apply = lm.transform(BatchNorm(FEATURES))
    variables = init(getkey())
    x = inputs(getkey(), (3, FEATURES))

    def run(mask):
        step = lambda v, x: apply(v, None, x, True, mask=mask)  # noqa: E731
        return (jax.jit(step) if jit else step)(variables, x)

    one_row = jnp.array([[True], [False], [False]])
    with pytest.raises(
        ValueError,
        match=r"^BatchNorm\(size=6\) at the root got an input of shape \(3, 6\) while "
        r"training: its mask selects 1 entry for some feature \(over axes \(0,\)\), so the "
        r"batch mean is the input itself and every output would be the bias\. Let the mask "
        r"select at least 2 entries per feature",
    ):
        run(one_row)
    with pytest.raises(ValueError, match=r"mask selects 0 entries .*statistics are NaN"):
        run(jnp.zeros((3, 1), bool))
    y, _ = run(jnp.array([[True], [True], [False]]))  # two rows: their statistics
    kept = x[:2]
    expected = (x - kept.mean(0, keepdims=True)) / jnp.sqrt(kept.var(0, keepdims=True) + 1e-5)
    assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_empty_batch_is_an_error(getkey, jit):
    init, apply = lm.transform(BatchNorm(FEATURES))
    variables = init(getkey())
    step = lambda v, x: apply(v, None, x, True)  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"^BatchNorm\(size=6\) at the root got an input of shape \(0, 6\) while "
        r"training: the batch is empty \(no entry along the reduced axes \(0,\)\), so its "
        r"mean and variance are NaN \(0/0\) .*Skip empty batches",
    ):
        (jax.jit(step) if jit else step)(variables, jnp.ones((0, FEATURES)))


def test_batch_norm_mapped_axis_counts_its_members(getkey):
    """With axis_name the count is the entries per member times the mapped axis' size."""
    init, apply = lm.transform(BatchNorm(FEATURES, axis_name="b"))
    variables = init(getkey())
    x = inputs(getkey(), (3, FEATURES))
    step = jax.vmap(lambda x: apply(variables, None, x, True)[0], axis_name="b")
    with pytest.raises(
        ValueError,
        match=r"shape \(6,\) while training: its batch statistics reduce over no axis .*, "
        r"over 1 member\(s\) of the mapped axis 'b', 1 entry per feature",
    ):
        step(x[:1])
    for run in (step, jax.jit(step)):  # three members of one example each: a batch of three
        expected = (x - x.mean(0, keepdims=True)) / jnp.sqrt(x.var(0, keepdims=True) + 1e-5)
        assert_close(run(x), expected, rtol=1e-5, atol=1e-5)


def re_shape(shape):
    return str(shape).replace("(", r"\(").replace(")", r"\)")


def test_batch_norm_axis_name_over_single_examples_in_lm_vmap(getkey):
    """Inside lm.vmap with axis_name, single examples are a batch over the mapped axis."""

    class Mapped(lm.Module):
        def __init__(self):
            self.bn = BatchNorm(FEATURES, momentum=0.9, axis_name="batch")

        def __call__(self, x):
            return lm.vmap(lambda bn, x: bn(x, True), in_axes=(None, 0), axis_name="batch")(
                self.bn, x
            )

    x = inputs(getkey(), (5, FEATURES))
    init, apply = lm.transform(Mapped())
    variables = init(getkey())
    _, whole = lm.transform(BatchNorm(FEATURES, momentum=0.9))
    inner = {"params": variables["params"]["bn"], "batch_stats": variables["batch_stats"]["bn"]}
    expected, expected_new = whole(inner, None, x, True)
    for run in (apply, jax.jit(apply)):
        y, new = run(variables, None, x)
        assert_close(y, expected)
        assert_close(new["batch_stats"]["bn"], expected_new["batch_stats"])


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
    x, mask = shifted_normal((2, 5, 6)), random_mask((2, 5, 6))
    masked = compare_with_linen(linen, ours, x, {"mask": mask})
    # the mask matters: the same call without it differs
    plain, _ = lm.transform(ours).apply(linen_random_variables(linen, x), None, x)
    assert not np.allclose(masked[0], plain, atol=1e-3)


def test_batch_norm_mask_matches_linen_and_leaves_masked_examples_out():
    x = shifted_normal((6, 4))
    mask = jnp.asarray([True, True, False, True, False, True])[:, None]
    linen, ours = nn.BatchNorm(momentum=0.8), lm.BatchNorm(4, momentum=0.8)
    y, new, _ = compare_with_linen(
        linen,
        ours,
        x,
        {"use_running_average": False, "mask": mask},
        {"is_training": True, "mask": mask},
    )
    kept = x[np.asarray(mask[:, 0])]
    variables = linen_random_variables(linen, x, use_running_average=False)
    _, expected = lm.transform(ours).apply(variables, None, kept, True)
    assert_close_complex(new, {"batch_stats": expected["batch_stats"]})


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
    compare_with_linen(linen, ours, shifted_normal(shape))


def test_batch_norm_several_feature_axes_match_linen_in_training_and_evaluation():
    x = shifted_normal((5, 3, 4))
    linen, ours = (
        nn.BatchNorm(axis=(1, 2), momentum=0.9),
        lm.BatchNorm((3, 4), axis=(1, 2), momentum=0.9),
    )
    _, new, _ = compare_with_linen(
        linen, ours, x, {"use_running_average": False}, {"is_training": True}
    )
    assert new["batch_stats"]["mean"].shape == (3, 4)
    compare_with_linen(linen, ours, x, {"use_running_average": True}, {"is_training": False})


# --- GroupNorm(group_size=...) -----------------------------------------------------------------


def test_group_size_matches_linen():
    ours = lm.GroupNorm(None, 6, group_size=2)
    assert (ours.num_groups, ours.group_size) == (3, 2)
    compare_with_linen(nn.GroupNorm(num_groups=None, group_size=2), ours, shifted_normal((2, 3, 6)))


# --- the two-pass variance ---------------------------------------------------------------------


def test_far_from_zero_inputs_need_the_two_pass_variance():
    """Regression: inputs offset by 1e6 lose the variance in E[x^2] - E[x]^2 (|y| ~ 650)."""
    x = shifted_normal((4, 8), offset=1e6)
    y, _, _ = compare_with_linen(
        nn.LayerNorm(use_fast_variance=False), lm.LayerNorm(8, use_fast_variance=False), x
    )
    variables = linen_random_variables(nn.LayerNorm(), x)
    params = variables["params"]
    exact = (x - x.mean(-1, keepdims=True)) / jnp.std(x - 1e6, -1, keepdims=True)
    assert_close_complex(y, exact * params["scale"][None] + params["bias"][None], atol=1e-3)
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
    x, mask = shifted_normal((3, 4, 6), offset=1e4), random_mask((3, 4, 6))
    if kwargs == "train":
        mask = mask[..., :1]
        compare_with_linen(
            linen,
            ours,
            x,
            {"use_running_average": False, "mask": mask},
            {"is_training": True, "mask": mask},
            atol=1e-5,
        )
    else:
        compare_with_linen(linen, ours, x, {"mask": mask}, atol=1e-5)


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
    x = shifted_normal((2, 4, 6), dtype=jnp.complex64)
    y, _, _ = compare_with_linen(
        linen(dtype=dtype), ours(dtype=dtype, param_dtype=jnp.float32), x, grads=False
    )
    assert y.dtype == jnp.complex64


def test_batch_norm_keeps_a_complex_running_mean():
    """Regression: with dtype=complex64 the running mean was float32 and lost its imaginary part."""
    x = shifted_normal((6, 4), dtype=jnp.complex64)
    linen = nn.BatchNorm(dtype=jnp.complex64, momentum=0.8)
    ours = lm.BatchNorm(4, dtype=jnp.complex64, param_dtype=jnp.float32, momentum=0.8)
    declared = layout(lm.transform(ours).init(jax.random.key(0)))["batch_stats"]
    assert declared == {"mean": ((4,), jnp.complex64), "var": ((4,), jnp.float32)}
    variables = linen_random_variables(linen, x, use_running_average=False)
    variables["batch_stats"]["mean"] = variables["batch_stats"]["mean"].astype(jnp.complex64)
    train = {"use_running_average": False}
    y_linen, new_linen, _ = linen_results(linen, variables, x, grads=False, **train)
    y, new, _ = our_results(ours, variables, x, grads=False, is_training=True)
    assert_close_complex(y, y_linen)
    assert_close_complex(new, new_linen)
    assert float(jnp.abs(new["batch_stats"]["mean"].imag).max()) > 0.01
    # evaluation with the updated averages: the imaginary part of the mean is used
    trained = {**variables, **new_linen}
    y_linen, _, _ = linen_results(linen, trained, x, grads=False, use_running_average=True)
    y, _, _ = our_results(ours, trained, x, grads=False, is_training=False)
    assert_close_complex(y, y_linen)
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
    x = shifted_normal((3, 2, 6), dtype=jnp.bfloat16)
    if kwargs == "train":
        y, _, _ = compare_with_linen(
            linen, ours, x, {"use_running_average": False}, {"is_training": True}
        )
    else:
        y, _, _ = compare_with_linen(linen, ours, x)
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
        apply(init(jax.random.key(0)), None, shifted_normal((2, 3, 6), dtype=jnp.complex64), *args)


def test_batch_norm_complex_input_with_a_real_running_mean_is_an_error():
    init, apply = lm.transform(lm.BatchNorm(6, dtype=None))
    with pytest.raises(
        TypeError, match=r"batch mean is complex.*stores its running mean as float32"
    ):
        apply(init(jax.random.key(0)), None, shifted_normal((2, 6), dtype=jnp.complex64), True)


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
    x = shifted_normal((4, 2, 3, 5))  # vmapped over the first axis: 4 replicas of (2, 3, 5)
    variables = randomize(lm.transform(ours).init(jax.random.key(0)))  # Linen's layout
    with jax.numpy_dtype_promotion("standard"):
        expected = jax.vmap(lambda x: linen.apply(variables, x), axis_name="i")(x)
    apply = lm.transform(ours).apply
    got = jax.vmap(lambda x: apply(variables, None, x)[0], axis_name="i")(x)
    assert_close_complex(got, expected, atol=1e-5)
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


# --- RMSNorm's Hugging Face variants: Llama's order, Gemma's (1 + scale) -----------------------


def hf_rms_norm(kind, weight, x, eps):
    """transformers' LlamaRMSNorm or GemmaRMSNorm with `weight`, applied to `x` (NumPy in/out)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtypes = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}
    module = (LlamaRMSNorm if kind == "llama" else GemmaRMSNorm)(weight.shape[-1], eps=eps)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.array(weight.astype(jnp.float32))))
    module = module.to(dtypes[weight.dtype])
    xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(dtypes[x.dtype])
    with torch.no_grad():
        out = module(xt)
    return out.float().numpy(), {v: k for k, v in dtypes.items()}[out.dtype]


HF_RMS = {
    "llama": {"scale_in_input_dtype": True},
    "gemma": {"scale_offset": 1.0},
}


def hf_rms_inputs(kind, dtype, features=16):
    rng = np.random.default_rng(3)
    x = (3.0 * rng.standard_normal((3, 5, features)) + 0.5).astype(np.float32)
    if kind == "llama":
        weight = rng.uniform(0.5, 1.5, features).astype(np.float32)
    else:  # Gemma stores the offset from 1
        weight = rng.normal(0.0, 0.3, features).astype(np.float32)
    return jnp.asarray(x).astype(dtype), jnp.asarray(weight).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_rms_norm_variants_match_transformers(kind, dtype):
    """Llama's and Gemma's RMSNorms, with the weights and dtypes of a checkpoint."""
    x, weight = hf_rms_inputs(kind, dtype)
    layer = RMSNorm(16, epsilon=1e-5, dtype=None, param_dtype=dtype, **HF_RMS[kind])
    init, apply = lm.transform(layer)
    assert init(jax.random.key(0))["params"]["scale"].dtype == jnp.dtype(dtype)
    ours, _ = apply({"params": {"scale": weight}}, None, x)
    expected, expected_dtype = hf_rms_norm(kind, weight, x, 1e-5)
    assert ours.dtype == expected_dtype == jnp.dtype(dtype)
    if dtype == "bfloat16":  # the same order of operations and casts: bit for bit
        np.testing.assert_array_equal(np.asarray(ours, np.float32), expected)
    else:
        assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    jitted, _ = jax.jit(apply)({"params": {"scale": weight}}, None, x)
    np.testing.assert_array_equal(jitted, ours)


def test_rms_norm_linens_order_differs_from_llamas_in_bfloat16():
    """Why the option exists: Linen's order is not the checkpoint's in bfloat16."""
    x, weight = hf_rms_inputs("llama", "bfloat16", features=64)
    expected, _ = hf_rms_norm("llama", weight, x, 1e-5)
    linen = RMSNorm(64, epsilon=1e-5, dtype=None, param_dtype=jnp.bfloat16)
    ours, _ = lm.transform(linen)[1]({"params": {"scale": weight}}, None, x)
    assert (np.asarray(ours, np.float32) != expected).any()


def test_rms_norm_bfloat16_parity_needs_dtype_none():
    """As RMSNorm's docs say: the default dtype=float32 is not the bfloat16 checkpoint's."""
    x, weight = hf_rms_inputs("llama", "bfloat16", features=64)
    expected, _ = hf_rms_norm("llama", weight, x, 1e-5)
    outs = {}
    for dtype in (None, jnp.bfloat16, jnp.float32):
        layer = RMSNorm(
            64, epsilon=1e-5, dtype=dtype, param_dtype=jnp.bfloat16, scale_in_input_dtype=True
        )
        outs[dtype], _ = lm.transform(layer)[1]({"params": {"scale": weight}}, None, x)
    for dtype in (None, jnp.bfloat16):
        np.testing.assert_array_equal(np.asarray(outs[dtype], np.float32), expected)
    assert outs[jnp.float32].dtype == jnp.float32
    assert (np.asarray(outs[jnp.float32]) != expected).any()


def test_rms_norm_llama_order_with_float32_weights_and_bfloat16_inputs():
    """Weights in float32, inputs in bfloat16: the product in float32, as PyTorch's promotion."""
    x, weight = hf_rms_inputs("llama", "bfloat16")
    weight = weight.astype(jnp.float32)
    layer = RMSNorm(16, epsilon=1e-5, dtype=None, scale_in_input_dtype=True)
    ours, _ = lm.transform(layer)[1]({"params": {"scale": weight}}, None, x)
    expected, expected_dtype = hf_rms_norm("llama", weight, x, 1e-5)
    assert ours.dtype == expected_dtype == jnp.float32
    np.testing.assert_array_equal(ours, expected)


def test_rms_norm_variants_agree_in_float32_and_gemma_starts_at_one(getkey):
    x = jax.random.normal(getkey(), (4, 6))
    gemma = RMSNorm(6, scale_offset=1.0)
    variables = lm.transform(gemma)[0](getkey())
    np.testing.assert_array_equal(variables["params"]["scale"], np.zeros(6, np.float32))
    plain, _ = lm.transform(RMSNorm(6))[1]({"params": {"scale": jnp.ones(6)}}, None, x)
    as_gemma, _ = lm.transform(gemma)[1](variables, None, x)
    llama, _ = lm.transform(RMSNorm(6, scale_in_input_dtype=True))[1](
        {"params": {"scale": jnp.ones(6)}}, None, x
    )
    assert_close(as_gemma, plain, rtol=1e-6, atol=1e-6)
    assert_close(llama, plain, rtol=1e-6, atol=1e-6)
    # another offset: the scale starts at 1 - offset, the effective scale at 1
    half = RMSNorm(6, scale_offset=0.5)
    np.testing.assert_array_equal(
        lm.transform(half)[0](getkey())["params"]["scale"], np.full(6, 0.5)
    )
    # a given scale_init is kept
    custom = RMSNorm(6, scale_offset=1.0, scale_init=lm.initializers.ones())
    np.testing.assert_array_equal(lm.transform(custom)[0](getkey())["params"]["scale"], np.ones(6))
    assert_close(lm.transform(custom)[1]({"params": {"scale": jnp.ones(6)}}, None, x)[0], 2 * plain)


def test_rms_norm_variants_with_mask_and_two_feature_axes(getkey):
    x = jax.random.normal(getkey(), (2, 3, 4))
    scale = jax.random.normal(getkey(), (3, 4))
    mask = jnp.array([True, True, False, True])
    options = {"reduction_axes": (-2, -1), "feature_axes": (-2, -1)}
    gemma = RMSNorm((3, 4), scale_offset=1.0, **options)
    out, _ = lm.transform(gemma)[1]({"params": {"scale": scale}}, None, x, mask=mask)
    ms = jnp.mean(jnp.where(mask[None, None], x * x, 0.0), axis=(-2, -1), keepdims=True) * 4 / 3
    expected = x * jax.lax.rsqrt(ms + 1e-6) * (1 + scale)[None]
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scale_offset": "1"}, TypeError, r"RMSNorm: scale_offset must be a finite number"),
        ({"scale_offset": float("nan")}, ValueError, r"RMSNorm: scale_offset must be a finite"),
        ({"scale_in_input_dtype": 1}, TypeError, r"RMSNorm: scale_in_input_dtype must be True"),
        (
            {"scale_offset": 1.0, "use_scale": False},
            ValueError,
            r"scale_offset=1.0 is added to the scale, but use_scale is False",
        ),
    ],
)
def test_rms_norm_variant_setting_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        RMSNorm(6, **kwargs)


def test_rms_norm_variant_settings_are_read_only():
    layer = RMSNorm(6, scale_offset=1.0)
    with pytest.raises(AttributeError, match="scale_offset"):
        layer.scale_offset = 0.0
