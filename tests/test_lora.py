"""LoRA: the adapter against hand-written references, training the adapters alone, merge_lora."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lamina as lm
from lamina._core.errors import SettingTypeError
from tests.helpers import abstract_init, assert_close, layout, normal

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

TOL = {"rtol": 1e-5, "atol": 1e-4}


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def declared_shapes(model):
    return jax.tree.map(jnp.shape, abstract_init(model))


def random_variables(model, rng):
    """Noise for every variable (nonzero adapters and biases; positive variances)."""

    def draw(path, leaf):
        value = 0.3 * rng.standard_normal(leaf.shape)
        if path[-1].key == "var":
            value = np.abs(value) + 0.5
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_init(model))


def leaves_by_path(tree):
    return {
        "/".join(k.key for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def reference_conv(x, w, strides, padding, dilation):
    """Plain `lax` convolution, channels last, one batch axis."""
    spec = {3: ("NWC", "WIO", "NWC"), 4: ("NHWC", "HWIO", "NHWC")}[x.ndim]
    return lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=spec
    )


# name: (base layer, input shape, reference padding for `reference_conv`)
CASES = {
    "dense": (lambda: lm.Dense(5, 4), (3, 5), None),
    "conv2d": (
        lambda: lm.Conv(3, 6, (3, 3), strides=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2)),
        (2, 7, 8, 3),
        [(1, 2), (0, 1)],
    ),
    "conv1d_causal": (
        lambda: lm.Conv(3, 4, 3, padding="CAUSAL", dilation=2),
        (2, 9, 3),
        [(4, 0)],
    ),
}


def add_bias(y, b):
    return y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))


def reference(base, padding, x, w, b, a, bb, scale):
    """The base layer plus ``scale * x @ A @ B`` (a conv into rank channels, then 1x1 for Conv)."""
    if isinstance(base, lm.Conv):
        args = (base.strides, padding, base.dilation)
        hidden = reference_conv(x, a, *args)
        return add_bias(reference_conv(x, w, *args), b) + scale * hidden @ bb
    return add_bias(x @ w, b) + scale * (x @ a @ bb)


@pytest.mark.parametrize("case", CASES)
def test_adapter_is_a_no_op_at_init(rng, case):
    make, shape, _ = CASES[case]
    layer = lm.LoRA(make(), rank=2, alpha=3.0)
    init, apply = lm.transform(layer)
    variables = init(jax.random.key(0))
    params = variables["params"]
    assert jnp.all(params["lora_b"] == 0) and jnp.any(params["lora_a"] != 0)
    x = normal(rng, *shape)
    expected, _ = lm.transform(layer.base).apply({"params": params["base"]}, None, x)
    np.testing.assert_array_equal(apply(variables, None, x)[0], expected)
    if case == "dense":  # inside one compiled program too
        np.testing.assert_array_equal(jax.jit(apply)(variables, None, x)[0], expected)


def test_variables_shapes_and_types():
    dense = lm.LoRA(lm.Dense(5, 4), rank=3)
    conv = lm.LoRA(lm.Conv(3, 6, (3, 2)), rank=2, alpha=8)
    assert declared_shapes(dense) == {
        "params": {"base": {"kernel": (5, 4), "bias": (4,)}, "lora_a": (5, 3), "lora_b": (3, 4)}
    }
    assert declared_shapes(conv) == {
        "params": {
            "base": {"kernel": (3, 2, 3, 6), "bias": (6,)},
            "lora_a": (3, 2, 3, 2),
            "lora_b": (2, 6),
        }
    }
    assert type(dense.lora_a) is lm.LoRAParam and isinstance(dense.lora_b, lm.Parameter)
    assert dense.lora_a.collection == "params"
    assert type(dense.base.kernel) is lm.Parameter
    assert (dense.scale, conv.scale) == (1.0, 4.0)


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_equal_the_reference(rng, case):
    make, shape, padding = CASES[case]
    layer = lm.LoRA(make(), rank=2, alpha=5.0)
    scale = 2.5
    apply = lm.transform(layer).apply
    variables = random_variables(layer, rng)
    x = normal(rng, *shape)

    def ours(v, x):
        return jnp.sum(jnp.sin(apply(v, None, x)[0]))

    def theirs(v, x):
        p = v["params"]
        w, b = p["base"]["kernel"], p["base"]["bias"]
        return jnp.sum(
            jnp.sin(reference(layer.base, padding, x, w, b, p["lora_a"], p["lora_b"], scale))
        )

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(variables, x)
    expected_value, expected_grads = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1)))(
        variables, x
    )
    np.testing.assert_allclose(value, expected_value, **TOL)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, **TOL), grads, expected_grads)
    p = variables["params"]
    expected = reference(
        layer.base,
        padding,
        x,
        p["base"]["kernel"],
        p["base"]["bias"],
        p["lora_a"],
        p["lora_b"],
        scale,
    )
    np.testing.assert_allclose(apply(variables, None, x)[0], expected, **TOL)


def test_grad_of_lora_params_only(rng):
    layer = lm.LoRA(lm.Dense(5, 4), rank=2, alpha=4.0)
    apply = lm.transform(layer).apply
    variables = random_variables(layer, rng)
    x, target = normal(rng, 6, 5), normal(rng, 6, 4)

    def loss(v, x):
        return jnp.mean((apply(v, None, x)[0] - target) ** 2)

    grads = lm.grad(loss, layer, lm.DiffState(0, lm.LoRAParam))(variables, x)
    assert jax.tree.map(jnp.shape, grads) == {"params": {"lora_a": (5, 2), "lora_b": (2, 4)}}

    p = variables["params"]
    w, b = p["base"]["kernel"], p["base"]["bias"]

    def reference_loss(a, bb):
        return jnp.mean((add_bias(x @ w, b) + 2.0 * (x @ a @ bb) - target) ** 2)

    ga, gb = jax.grad(reference_loss, argnums=(0, 1))(p["lora_a"], p["lora_b"])
    np.testing.assert_allclose(grads["params"]["lora_a"], ga, **TOL)
    np.testing.assert_allclose(grads["params"]["lora_b"], gb, **TOL)
    assert float(jnp.abs(ga).max()) > 0 and float(jnp.abs(gb).max()) > 0


class Mixed(lm.Module):
    """Convolutions and dense layers, with and without adapters, in a list and a dict."""

    def __init__(self):
        self.convs = [lm.LoRA(lm.Conv(2, 4, (3, 3)), rank=2), lm.Conv(4, 4, (3, 3))]
        self.head = {
            "hidden": lm.LoRA(lm.Dense(4 * 5 * 5, 8), rank=3, alpha=6),
            "out": lm.Dense(8, 2),
        }

    def __call__(self, x):
        for layer in self.convs:
            x = lm.relu(layer(x))
        x = jnp.reshape(x, (x.shape[0], -1))
        return self.head["out"](lm.relu(self.head["hidden"](x)))


def test_adam_on_the_adapters_leaves_every_base_weight_bit_identical(rng):
    model = lm.Sequential(
        lm.LoRA(lm.Dense(4, 8), rank=2), lm.relu, lm.Dense(8, 8), lm.LoRA(lm.Dense(8, 2), rank=1)
    )
    apply = lm.transform(model).apply
    variables = random_variables(model, rng)
    x, target = normal(rng, 16, 4), normal(rng, 16, 2)
    trainable, frozen = lm.split(model, variables, lm.LoRAParam, ...)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)

    def loss(v, x):
        return jnp.mean((apply(v, None, x)[0] - target) ** 2)

    @jax.jit
    def step(trainable, opt_state):
        full = lm.merge(trainable, frozen)
        value, grads = lm.value_and_grad(loss, model, lm.DiffState(0, lm.LoRAParam))(full, x)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    losses = []
    for _ in range(5):
        trainable, opt_state, value = step(trainable, opt_state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    after = leaves_by_path(lm.merge(trainable, frozen))
    before = leaves_by_path(variables)
    assert after.keys() == before.keys()
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    adapters = {path for path in before if path.endswith(("lora_a", "lora_b"))}
    assert changed == adapters and len(adapters) == 4


@pytest.mark.parametrize("case", CASES)
def test_merge_lora_equals_the_lora_model(rng, case):
    make, shape, _ = CASES[case]
    layer = lm.LoRA(make(), rank=2, alpha=3.0)
    variables = random_variables(layer, rng)
    merged, merged_variables = lm.merge_lora(layer, variables)
    assert type(merged) is type(layer.base) and merged is not layer.base
    assert jax.tree.map(jnp.shape, merged_variables) == {
        "params": {"kernel": layer.base.kernel.shape, "bias": (layer.base.out_size,)}
    }
    x = normal(rng, *shape)
    expected, _ = lm.transform(layer).apply(variables, None, x)
    got, _ = lm.transform(merged).apply(merged_variables, None, x)
    np.testing.assert_allclose(got, expected, **TOL)
    # The folded kernel is the contraction of lora_a's rank axis with lora_b.
    p = variables["params"]
    update = jnp.tensordot(p["lora_a"], p["lora_b"], axes=1)
    np.testing.assert_allclose(
        merged_variables["params"]["kernel"], p["base"]["kernel"] + 1.5 * update, **TOL
    )
    assert merged_variables["params"]["bias"] is p["base"]["bias"]


def test_merge_lora_mixed_model_paths_and_untouched_inputs(rng):
    model = Mixed()
    lora_hidden, conv0 = model.head["hidden"], model.convs[0]
    apply = lm.transform(model).apply
    variables = random_variables(model, rng)
    snapshot = jax.tree.map(np.array, variables)
    merged, merged_variables = lm.merge_lora(model, variables)

    assert [type(m).__name__ for m in merged.convs] == ["Conv", "Conv"]
    assert type(merged.head["hidden"]) is lm.Dense
    old = leaves_by_path(variables)
    new = leaves_by_path(merged_variables)
    assert sorted(new) == sorted(
        path.replace("/base/", "/") for path in old if not path.endswith(("lora_a", "lora_b"))
    )
    assert "params/convs/0/kernel" in new and "params/head/hidden/kernel" in new
    for path in ("params/convs/1/kernel", "params/head/out/bias", "params/convs/0/bias"):
        assert new[path] is old[path.replace("0/bias", "0/base/bias")]
    x = normal(rng, 3, 5, 5, 2)
    np.testing.assert_allclose(
        lm.transform(merged).apply(merged_variables, None, x)[0],
        apply(variables, None, x)[0],
        **TOL,
    )

    # The input model and variables are untouched.
    assert model.head["hidden"] is lora_hidden and model.convs[0] is conv0
    assert isinstance(lora_hidden.base, lm.Dense) and type(model.convs[0]) is lm.LoRA
    assert jax.tree.structure(variables) == jax.tree.structure(snapshot)
    jax.tree.map(np.testing.assert_array_equal, variables, snapshot)
    assert declared_shapes(model) == jax.tree.map(jnp.shape, snapshot)


def test_merge_lora_tied_module(rng):
    class Tied(lm.Module):
        def __init__(self):
            self.first = lm.LoRA(lm.Dense(4, 4), rank=2)
            self.second = self.first
            self.out = lm.Dense(4, 1)

        def __call__(self, x):
            return self.out(self.second(jnp.tanh(self.first(x))))

    model = Tied()
    variables = random_variables(model, rng)
    merged, merged_variables = lm.merge_lora(model, variables)
    assert merged.first is merged.second and type(merged.first) is lm.Dense
    assert sorted(merged_variables["params"]) == ["first", "out"]
    assert sorted(merged_variables["params"]["first"]) == ["bias", "kernel"]
    x = normal(rng, 3, 4)
    np.testing.assert_allclose(
        lm.transform(merged).apply(merged_variables, None, x)[0],
        lm.transform(model).apply(variables, None, x)[0],
        **TOL,
    )


def test_merge_lora_carries_batch_stats(rng):
    class Net(lm.Module):
        def __init__(self):
            self.dense = lm.LoRA(lm.Dense(3, 4), rank=2)
            self.norm = lm.BatchNorm(4)

        def __call__(self, x, is_training):
            return self.norm(self.dense(x), is_training=is_training)

    model = Net()
    init, apply = lm.transform(model)
    x = normal(rng, 8, 3)
    variables = random_variables(model, rng)
    _, variables = apply(variables, None, x, True)  # batch_stats away from their init
    assert jnp.any(variables["batch_stats"]["norm"]["mean"] != 0)
    merged, merged_variables = lm.merge_lora(model, variables)
    assert sorted(merged_variables) == ["batch_stats", "params"]
    for name in ("mean", "var"):
        got = merged_variables["batch_stats"]["norm"][name]
        assert got is variables["batch_stats"]["norm"][name]
    expected, _ = apply(variables, None, x, False)
    np.testing.assert_allclose(
        lm.transform(merged).apply(merged_variables, None, x, False)[0], expected, **TOL
    )

    # {"params": ...} alone gives the merged params alone.
    _, params_only = lm.merge_lora(model, {"params": variables["params"]})
    assert sorted(params_only) == ["params"]
    jax.tree.map(np.testing.assert_array_equal, params_only["params"], merged_variables["params"])


def test_merge_lora_without_adapters_is_a_copy(rng):
    model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
    variables = random_variables(model, rng)
    merged, merged_variables = lm.merge_lora(model, variables)
    assert merged is not model and merged.layers[0] is not model.layers[0]
    assert jax.tree.map(lambda a, b: a is b, merged_variables, variables) == jax.tree.map(
        lambda _: True, variables
    )


def test_summary_counts_trainable_adapters(rng):
    model = lm.Sequential(lm.LoRA(lm.Dense(16, 32), rank=4), lm.relu, lm.Dense(32, 2))
    variables = abstract_init(model)
    summary = lm.summary(model)
    adapters = 16 * 4 + 4 * 32
    base = 16 * 32 + 32 + 32 * 2 + 2
    assert summary.num_params == base + adapters
    rows = {(row.module_path, row.name): row for row in summary.rows}
    assert rows[("layers_0", "lora_a")].module_type == "LoRA"
    assert rows[("layers_0/base", "kernel")].module_type == "Dense"

    def count(tree):
        return sum(leaf.size for leaf in jax.tree.leaves(tree))

    assert count(lm.filter_variables(model, variables, lm.LoRAParam)) == adapters
    trainable, frozen = lm.split(model, variables, lm.LoRAParam, ...)
    assert (count(trainable), count(frozen)) == (adapters, base)
    mask = lm.mask(model, variables, lm.LoRAParam)
    assert mask["params"]["layers_0"] == {
        "base": {"kernel": False, "bias": False},
        "lora_a": True,
        "lora_b": True,
    }


@pytest.mark.parametrize("case", ["dense", "conv2d"])
def test_jit_and_vmap(rng, case):
    make, shape, _ = CASES[case]
    layer = lm.LoRA(make(), rank=2)
    apply = lm.transform(layer).apply
    variables = random_variables(layer, rng)
    x = normal(rng, *shape)
    expected, _ = apply(variables, None, x)
    np.testing.assert_allclose(jax.jit(apply)(variables, None, x)[0], expected, **TOL)
    per_example = jax.vmap(lambda v, e: apply(v, None, e)[0], in_axes=(None, 0))(variables, x)
    np.testing.assert_allclose(per_example, expected, **TOL)


def test_bfloat16_compute_float32_storage(rng):
    base = lm.Dense(5, 4, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    layer = lm.LoRA(base, rank=2, alpha=4.0)
    assert layer.lora_a.dtype == jnp.bfloat16 and layer.lora_a.param_dtype == jnp.float32
    apply = lm.transform(layer).apply
    variables = random_variables(layer, rng)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    x = normal(rng, 3, 5)
    y, _ = apply(variables, None, x)
    assert y.dtype == jnp.bfloat16
    p = variables["params"]
    expected = add_bias(x @ p["base"]["kernel"], p["base"]["bias"]) + 2.0 * (
        x @ p["lora_a"] @ p["lora_b"]
    )
    np.testing.assert_allclose(y.astype(jnp.float32), expected, rtol=5e-2, atol=5e-2)
    grads = lm.grad(
        lambda v: jnp.sum(apply(v, None, x)[0].astype(jnp.float32)),
        layer,
        lm.DiffState(0, lm.LoRAParam),
    )(variables)
    assert grads["params"]["lora_a"].dtype == jnp.float32
    merged, merged_variables = lm.merge_lora(layer, variables)
    assert merged_variables["params"]["kernel"].dtype == jnp.float32
    got, _ = lm.transform(merged).apply(merged_variables, None, x)
    np.testing.assert_allclose(got.astype(jnp.float32), expected, rtol=5e-2, atol=5e-2)


def test_adapter_dtype_differs_from_the_base(rng):
    layer = lm.LoRA(lm.Dense(5, 4), rank=2, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    apply = lm.transform(layer).apply
    variables = random_variables(layer, rng)
    assert variables["params"]["lora_a"].dtype == jnp.bfloat16
    assert variables["params"]["base"]["kernel"].dtype == jnp.float32
    x = normal(rng, 3, 5)
    y, _ = apply(variables, None, x)
    assert y.dtype == jnp.float32  # the base's compute dtype
    p = jax.tree.map(lambda a: a.astype(jnp.float32), variables["params"])
    expected = add_bias(x @ p["base"]["kernel"], p["base"]["bias"]) + x @ p["lora_a"] @ p["lora_b"]
    np.testing.assert_allclose(y, expected, rtol=5e-2, atol=5e-2)
    # Default param_dtype: the base's storage dtype.
    assert lm.LoRA(lm.Dense(5, 4), rank=2, dtype=jnp.bfloat16).lora_a.param_dtype == jnp.float32


def test_rank_bounds():
    lm.LoRA(lm.Dense(5, 4), rank=4)  # min(in_size, out_size) is allowed
    lm.LoRA(lm.Conv(2, 16, (3, 3)), rank=16)  # a conv kernel is a (3*3*2, 16) matrix
    with pytest.raises(
        ValueError, match=r"rank must be at most min\(in_size, out_size\) = min\(5, 4\) = 4"
    ):
        lm.LoRA(lm.Dense(5, 4), rank=5)
    with pytest.raises(
        ValueError,
        match=r"rank must be at most min\(prod\(kernel_size\) \* in_size, out_size\) = "
        r"min\(18, 16\) = 16",
    ):
        lm.LoRA(lm.Conv(2, 16, (3, 3)), rank=17)
    with pytest.raises(
        ValueError,
        match=r"LoRA\(Dense\(in_size=5, out_size=4\), rank=0\): rank must be a positive int, got 0",
    ):
        lm.LoRA(lm.Dense(5, 4), rank=0)
    with pytest.raises(SettingTypeError, match=r"rank must be a positive int, got 2.0"):
        lm.LoRA(lm.Dense(5, 4), rank=2.0)


@pytest.mark.parametrize(
    ("base", "match"),
    [
        (
            lambda: lm.Embed(10, 4),
            r"LoRA adapts a Dense, a Conv \(groups=1\) or an attention.s query.*, got Embed\.",
        ),
        (lambda: lm.ConvTranspose(3, 4, (3, 3)), r"a Conv \(groups=1\) or .*, got ConvTranspose\."),
        (lambda: lm.LoRA(lm.Dense(4, 4), rank=2), r"got LoRA\. It is already a LoRA"),
    ],
)
def test_unsupported_base(base, match):
    with pytest.raises(TypeError, match=match):
        lm.LoRA(base(), rank=1)


def test_setting_errors():
    with pytest.raises(
        ValueError, match=r"the base Conv has groups=2; LoRA supports groups=1 only"
    ):
        lm.LoRA(lm.Conv(4, 4, (3, 3), groups=2), rank=1)
    for alpha in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"alpha must be a positive number"):
            lm.LoRA(lm.Dense(5, 4), rank=2, alpha=alpha)
    with pytest.raises(SettingTypeError, match=r"alpha must be a positive number .* got '2'"):
        lm.LoRA(lm.Dense(5, 4), rank=2, alpha="2")
    with pytest.raises(
        TypeError, match=r"dtype must be a dtype such as jnp.float32, got 'float77'"
    ):
        lm.LoRA(lm.Dense(5, 4), rank=2, dtype="float77")


def test_wrong_input_size_reports_the_base(rng):
    layer = lm.LoRA(lm.Dense(5, 4), rank=2)
    apply = lm.transform(layer).apply
    with pytest.raises(
        ValueError, match=r"Dense\(in_size=5, out_size=4\) got an input of shape \(3, 6\)"
    ):
        apply(random_variables(layer, rng), None, jnp.ones((3, 6)))


def test_merge_lora_errors(rng):
    layer = lm.LoRA(lm.Dense(5, 4), rank=2)
    variables = abstract_init(layer)
    with pytest.raises(TypeError, match=r"merge_lora takes an lm.Module, got dict"):
        lm.merge_lora(variables, layer)
    base_only = {"params": {"base": variables["params"]["base"]}}
    with pytest.raises(
        lm.VariablesError, match=r"variables lack \(2\): params/lora_a, params/lora_b\."
    ):
        lm.merge_lora(layer, base_only)
    extra = {"params": {**variables["params"], "stray": jnp.ones(2)}}
    with pytest.raises(lm.VariablesError, match=r"unexpected \(1\): params/stray"):
        lm.merge_lora(layer, extra)

    class SharedBase(lm.Module):
        def __init__(self):
            self.plain = lm.Dense(4, 4)
            self.adapted = lm.LoRA(self.plain, rank=2)

        def __call__(self, x):
            return self.adapted(self.plain(x))

    model = SharedBase()
    with pytest.raises(
        ValueError,
        match=r"the base kernel of the LoRA at adapted is also used outside that LoRA, at "
        r"plain/kernel",
    ):
        lm.merge_lora(model, abstract_init(model))
    assert type(model.adapted) is lm.LoRA  # the model is untouched

    class TwoAdapters(lm.Module):
        def __init__(self):
            dense = lm.Dense(4, 4)
            self.first, self.second = lm.LoRA(dense, rank=1), lm.LoRA(dense, rank=2)

        def __call__(self, x):
            return self.second(self.first(x))

    model = TwoAdapters()
    with pytest.raises(
        ValueError, match=r"LoRA modules at first and second share their base kernel"
    ):
        lm.merge_lora(model, abstract_init(model))


def test_settings_are_keyword_only_and_read_only():
    with pytest.raises(TypeError, match=r"positional argument"):
        lm.LoRA(lm.Dense(5, 4), 2, 4.0)  # alpha is keyword-only
    layer = lm.LoRA(lm.Dense(5, 4), rank=2)
    for name, value in [("rank", 3), ("base", lm.Dense(6, 4)), ("alpha", 1.0)]:
        with pytest.raises(AttributeError, match=rf"^LoRA\.{name} is read-only.*Build a new layer"):
            setattr(layer, name, value)
    with pytest.raises(TypeError, match=r"a_init must be an initializer"):
        lm.LoRA(lm.Dense(5, 4), rank=2, a_init="he")


def test_lora_dtype_follows_the_base_and_infers_with_it(rng):
    """LoRA's dtype, left out, is its base's: a fixed dtype, or None (inferred per call)."""
    assert lm.LoRA(lm.Dense(5, 4), 2).dtype == jnp.float32
    assert lm.LoRA(lm.Dense(5, 4, dtype=jnp.bfloat16), 2).dtype == jnp.bfloat16
    layer = lm.LoRA(lm.Dense(5, 4, dtype=None, param_dtype=jnp.bfloat16), 2)
    assert layer.dtype is None and layer.param_dtype == jnp.bfloat16
    init, apply = lm.transform(layer)
    variables = init(jax.random.key(0))
    assert {v.dtype for v in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}
    y, _ = apply(variables, None, normal(rng, 3, 5, dtype=jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match=r"param_dtype=complex64 is complex but dtype=float32"):
        lm.LoRA(lm.Dense(5, 4), 2, param_dtype=jnp.complex64)


def test_lora_of_a_masked_conv_is_refused():
    with pytest.raises(ValueError, match=r"the base Conv has a mask; LoRA adapts unmasked Convs"):
        lm.LoRA(lm.Conv(2, 3, 3, mask=np.ones((3, 2, 3))), 2)


def test_lora_of_an_input_dilated_conv_merges_exactly(rng):
    layer = lm.LoRA(lm.Conv(2, 3, 3, input_dilation=2), 2, b_init=lm.initializers.normal(0.5))
    init, apply = lm.transform(layer)
    variables = init(jax.random.key(0))
    x = normal(rng, 2, 5, 2)
    merged, merged_variables = lm.merge_lora(layer, variables)
    expected, _ = lm.transform(merged).apply(merged_variables, None, x)
    assert layout(expected) == layout(apply(variables, None, x)[0])
    assert_close(apply(variables, None, x)[0], expected, rtol=1e-5, atol=1e-5)


def _attention_lora(num_kv_heads=None, sharding=None):
    mha = lm.MultiHeadAttention(
        num_heads=4, in_size=16, num_kv_heads=num_kv_heads, kernel_sharding=sharding
    )
    where = lm.Any(lm.PathContains("query"), lm.PathContains("value"))
    return mha, lm.replace(
        mha, lambda path, m: lm.LoRA(m, 2, b_init=lm.initializers.normal(0.1)), where=where
    )


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_attention_projections(rng, num_kv_heads):
    """LoRA on an attention's query and value: base + x @ a @ b per head; merge folds it."""
    mha, adapted = _attention_lora(num_kv_heads)
    variables = lm.transform(adapted).init(jax.random.key(0))
    heads = 2 if num_kv_heads else 4
    f32 = jnp.dtype(jnp.float32)
    assert layout(variables)["params"]["value"] == {
        "base": {"bias": ((heads, 4), f32), "kernel": ((16, heads, 4), f32)},
        "lora_a": ((16, 2), f32),
        "lora_b": ((2, heads, 4), f32),
    }
    x = normal(rng, 2, 5, 16)
    y, _ = lm.transform(adapted).apply(variables, None, x, causal=True)
    # The reference: the plain attention with kernel + a @ b in place of each kernel.
    params = dict(variables["params"])
    for name in ("query", "value"):
        own = params[name]
        update = jnp.einsum("ir,rhd->ihd", own["lora_a"], own["lora_b"])
        params[name] = {"kernel": own["base"]["kernel"] + update, "bias": own["base"]["bias"]}
    expected, _ = lm.transform(mha).apply({"params": params}, None, x, causal=True)
    assert_close(y, expected, rtol=1e-5, atol=1e-5)
    merged, merged_variables = lm.merge_lora(adapted, variables)
    assert (
        isinstance(merged.query, type(mha.query))
        and "base" not in merged_variables["params"]["query"]
    )
    again, _ = lm.transform(merged).apply(merged_variables, None, x, causal=True)
    assert_close(again, y, rtol=1e-5, atol=1e-5)


def test_attention_projection_gradients_reach_the_adapters_only(rng):
    _, adapted = _attention_lora()
    adapted = lm.freeze(adapted, where=lm.Not(lm.LoRAParam))
    variables = lm.transform(adapted).init(jax.random.key(0))
    x = normal(rng, 2, 5, 16)

    def loss(variables):
        y, _ = lm.transform(adapted).apply(variables, None, x, causal=True)
        return jnp.sum(y**2)

    grads = jax.grad(loss)(variables)
    assert float(jnp.abs(grads["params"]["query"]["lora_a"]).sum()) > 0
    assert float(jnp.abs(grads["params"]["query"]["base"]["kernel"]).sum()) == 0


def test_attention_projection_adapter_shardings():
    _, adapted = _attention_lora(sharding=("embed", "heads", "kv"))
    assert adapted.query.lora_a.sharding == ("embed", None)
    assert adapted.query.lora_b.sharding == (None, "heads", "kv")


def test_attention_output_projection_is_refused():
    mha = lm.MultiHeadAttention(num_heads=4, in_size=16)
    with pytest.raises(ValueError, match=r"contracts 2 axes.*query, key and value"):
        lm.LoRA(mha.out, 2)
