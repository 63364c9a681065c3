"""BatchNorm, LayerNorm, RMSNorm and GroupNorm against Flax Linen, given the same weights."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import BatchNorm, GroupNorm, LayerNorm, RMSNorm
from tests.helpers import assert_close, layout

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


def linen_init(kind, module, x, shapes_only=False):
    """Linen's init variables (or, with `shapes_only`, their shapes and dtypes)."""
    options = {"use_running_average": False} if kind == "batch" else {}

    def init(x):
        return module.init(jax.random.key(0), x, **options)

    with jax.numpy_dtype_promotion("standard"):  # Linen mixes bfloat16 and float32 implicitly
        return dict(jax.eval_shape(init, x) if shapes_only else jax.jit(init)(x))


def random_variables(kind, module, x, key):
    """Variables in Linen's layout with non-trivial values."""
    return randomize(linen_init(kind, module, x, shapes_only=True), key)


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


def randomize(variables, key):
    """Non-trivial values in the same layout: scale near 1, positive variances."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
    new = []
    for i, (path, leaf) in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        name = path[-1].key
        if name == "var":
            value = jax.random.uniform(k, leaf.shape, minval=0.5, maxval=2.0)
        elif name == "scale":
            value = 1.0 + 0.5 * jax.random.normal(k, leaf.shape)
        else:
            value = jax.random.normal(k, leaf.shape)
        new.append(value.astype(leaf.dtype))
    return treedef.unflatten(new)


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
    expected = linen_init(kind, linen, x)
    init = lm.transform(ours).init(getkey())
    assert layout(init) == layout(expected)
    assert_close(init, expected, rtol=0, atol=0)  # ones, zeros, constants: exactly Linen's
    variables = randomize(expected, getkey())
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
    variables = random_variables("batch", linen, x, getkey())
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
    variables = random_variables(kind, linen, x, getkey())
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
    variables = random_variables(kind, linen, x, getkey())
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
    variables = random_variables("batch", linen, inputs(getkey(), (8, FEATURES)), getkey())
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
    variables = randomize(
        jax.eval_shape(lm.transform(BatchNorm(FEATURES)).init, getkey()), getkey()
    )
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
    variables = randomize(
        jax.eval_shape(lm.transform(BatchNorm(FEATURES)).init, getkey()), getkey()
    )
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
    variables = random_variables("batch", linen, xs[0], getkey())
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
    expected_init = linen_init(kind, linen, x, shapes_only=True)
    assert layout(jax.eval_shape(lm.transform(ours).init, getkey())) == layout(expected_init)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(expected_init))
    variables = randomize(expected_init, getkey())
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
    variables = randomize(jax.eval_shape(init, getkey()), getkey())
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
