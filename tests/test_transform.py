import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Mlp(lm.Module):
    def __init__(self, in_size=4, hidden=8, out_size=3):
        super().__init__()
        self.layer1 = lm.Dense(in_size, hidden)
        self.layer2 = lm.Dense(hidden, out_size)

    def __call__(self, x):
        return self.layer2(lm.relu(self.layer1(x)))

    def features(self, x):
        return lm.relu(self.layer1(x))


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_transformed_is_named_tuple():
    t = lm.transform(Mlp())
    assert isinstance(t, lm.Transformed)
    init, apply = t
    assert t.init is init and t.apply is apply


def test_init_layout_is_linen(getkey):
    variables = lm.transform(Mlp()).init(getkey())
    assert shapes(variables) == {
        "params": {
            "layer1": {"kernel": (4, 8), "bias": (8,)},
            "layer2": {"kernel": (8, 3), "bias": (3,)},
        }
    }


def test_init_matches_linen_layout():
    flax_nn = pytest.importorskip("flax.linen")

    class LinenMlp(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            x = flax_nn.relu(flax_nn.Dense(8, name="layer1")(x))
            return flax_nn.Dense(3, name="layer2")(x)

    key = jax.random.key(0)
    linen_vars = LinenMlp().init(key, jnp.ones((1, 4)))
    ours = lm.transform(Mlp()).init(key)
    assert shapes(dict(linen_vars)) == shapes(ours)
    # Linen's variables run in lamina's apply, and give Linen's outputs.
    x = jax.random.normal(jax.random.key(1), (5, 4))
    out, _ = lm.transform(Mlp()).apply(linen_vars, None, x)
    np.testing.assert_allclose(out, LinenMlp().apply(linen_vars, x), rtol=1e-5, atol=1e-6)


def test_transform_is_a_snapshot(getkey):
    model = Mlp()
    init, apply = lm.transform(model)
    model.layer2 = lm.Dense(8, 20)
    model.layer1.kernel.value = jnp.zeros((4, 8))
    variables = init(getkey())
    assert variables["params"]["layer2"]["kernel"].shape == (8, 3)
    assert np.abs(variables["params"]["layer1"]["kernel"]).sum() > 0


def test_init_keys_derive_from_path(getkey):
    key = getkey()
    model = Mlp()
    before = lm.transform(model).init(key)
    model.layer2 = lm.Dense(8, 20)  # surgery on one layer
    after = lm.transform(model).init(key)
    assert_trees_equal(before["params"]["layer1"], after["params"]["layer1"])
    # different paths get different keys even with the same shape and initializer
    twins = lm.transform(Mlp(8, 8, 8)).init(key)["params"]
    assert not np.allclose(twins["layer1"]["kernel"], twins["layer2"]["kernel"])
    # and a different rng gives different values
    other = lm.transform(model).init(getkey())
    assert not np.allclose(other["params"]["layer1"]["kernel"], after["params"]["layer1"]["kernel"])


def test_init_under_jit_equals_eager(getkey):
    init, _ = lm.transform(Mlp())
    key = getkey()
    assert_trees_equal(jax.jit(init)(key), init(key))


def test_init_accepts_raw_and_typed_keys_and_params_stream():
    init, _ = lm.transform(Mlp())
    raw = init(jax.random.PRNGKey(0))
    assert shapes(raw) == shapes(init(jax.random.key(0)))
    via_params = init({"params": jax.random.key(3)})
    via_default = init(lm.PRNGKeys(jax.random.key(3)))
    assert_trees_equal(via_params, via_default)


def test_init_without_key_is_a_clear_error():
    init, _ = lm.transform(Mlp())
    with pytest.raises(lm.RngError, match=r"init needs a PRNG key.*jax.random.key\(0\)"):
        init(None)


def test_model_without_variables(getkey):
    class Plain(lm.Module):
        def __call__(self, x):
            return 2 * x

    init, apply = lm.transform(Plain())
    assert init() == {}
    out, new = apply({}, None, jnp.ones(2))
    np.testing.assert_allclose(out, [2.0, 2.0])
    assert new == {}


def test_apply_is_pure(getkey):
    model = Mlp()
    init, apply = lm.transform(model)
    variables = init(getkey())
    x = jax.random.normal(getkey(), (2, 4))
    copy = jax.tree.map(lambda a: a, variables)
    out1, new1 = apply(variables, None, x)
    out2, new2 = apply(variables, None, x)
    np.testing.assert_array_equal(out1, out2)
    assert_trees_equal(new1, new2)
    assert_trees_equal(variables, copy)
    assert new1 is not variables and new1["params"] is not variables["params"]
    new1.pop("params")  # the seed's pattern: mutating the result leaves the input intact
    assert "params" in variables


def test_to_callable_picks_method(getkey):
    init, apply = lm.transform(Mlp(), to_callable=lambda m: m.features)
    out, _ = apply(init(getkey()), None, jnp.ones((1, 4)))
    assert out.shape == (1, 8)


def test_to_callable_must_return_callable():
    with pytest.raises(TypeError, match="to_callable must return the function"):
        lm.transform(Mlp(), to_callable=lambda m: m.layer1.kernel.shape)


def test_to_callable_using_the_original_model_is_explained(getkey):
    model = Mlp()
    init, apply = lm.transform(model, to_callable=lambda m: model.features)
    with pytest.raises(lm.UnboundVariableError, match=r"not part of the model being applied"):
        apply(init(getkey()), None, jnp.ones((1, 4)))


def test_module_without_call(getkey):
    class NoCall(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((1,), lm.initializers.zeros())

    init, apply = lm.transform(NoCall())
    with pytest.raises(TypeError, match=r"has no __call__ method.*to_callable"):
        apply(init(getkey()))


def test_transform_rejects_non_module():
    with pytest.raises(TypeError, match=r"expects an lm\.Module, got function"):
        lm.transform(lambda x: x)


def test_apply_rejects_bad_variables_before_computing(getkey):
    calls = []

    class Spy(Mlp):
        def __call__(self, x):
            calls.append(1)
            return super().__call__(x)

    init, apply = lm.transform(Spy())
    variables = init(getkey())
    x = jnp.ones((1, 4))
    missing = {"params": {"layer1": variables["params"]["layer1"]}}
    with pytest.raises(
        lm.VariablesError,
        match=r"missing \(2\): params/layer2/bias, "
        r"params/layer2/kernel",
    ):
        apply(missing, None, x)
    extra = {"params": {**variables["params"], "layer3": {"kernel": jnp.ones(2)}}}
    with pytest.raises(lm.VariablesError, match=r"unexpected \(1\): params/layer3/kernel"):
        apply(extra, None, x)
    wrong = jax.tree.map(lambda a: a, variables)
    wrong["params"]["layer1"]["kernel"] = jnp.ones((4, 7))
    with pytest.raises(
        lm.VariablesError, match=r"params/layer1/kernel: expected \(4, 8\), got \(4, 7\)"
    ):
        apply(wrong, None, x)
    with pytest.raises(lm.VariablesError, match=r"did you pass variables\['params'\]"):
        apply(variables["params"], None, x)
    with pytest.raises(lm.VariablesError, match="must be a dict"):
        apply([1, 2], None, x)
    none_leaf = {"params": {**variables["params"], "layer2": None}}
    with pytest.raises(lm.VariablesError, match="NoneType at params/layer2"):
        apply(none_leaf, None, x)
    assert calls == []


def test_apply_accepts_other_mappings_and_numpy(getkey):
    flax_core = pytest.importorskip("flax.core")
    init, apply = lm.transform(Mlp())
    variables = init(getkey())
    x = jnp.ones((1, 4))
    expected, _ = apply(variables, None, x)
    frozen = flax_core.freeze(variables)
    np.testing.assert_allclose(apply(frozen, None, x)[0], expected)
    as_numpy = jax.tree.map(np.asarray, variables)
    np.testing.assert_allclose(apply(as_numpy, None, x)[0], expected)


def test_python_scalar_leaves_are_converted(getkey):
    class Scalar(lm.Module):
        def __init__(self):
            self.s = lm.Parameter((), lm.initializers.ones())

        def __call__(self):
            return self.s * 2.0

    init, apply = lm.transform(Scalar())
    out, _ = apply({"params": {"s": 3.0}})
    assert float(out) == 6.0


class Tied(lm.Module):
    def __init__(self):
        super().__init__()
        self.encoder = lm.Dense(3, 3, use_bias=False)
        self.decoder = self.encoder  # the same module, a second path
        self.shared = lm.Parameter((3,), lm.initializers.ones())
        self.scales = [self.shared, self.shared]

    def __call__(self, x):
        y = self.decoder(self.encoder(x))
        return y * (self.scales[0] * self.scales[1])[None]


def test_weight_tying_one_variable_first_path(getkey):
    variables = lm.transform(Tied()).init(getkey())
    assert shapes(variables) == {"params": {"encoder": {"kernel": (3, 3)}, "shared": (3,)}}


def test_weight_tying_gradient_sums_over_uses(getkey):
    init, apply = lm.transform(Tied())
    variables = init(getkey())
    x = jax.random.normal(getkey(), (2, 3))

    def loss(params):
        out, _ = apply({"params": params}, None, x)
        return jnp.sum(out**2)

    grads = jax.grad(loss)(variables["params"])

    def by_hand(kernel, shared):
        return jnp.sum(((x @ kernel) @ kernel * (shared * shared)[None]) ** 2)

    gk, gs = jax.grad(by_hand, argnums=(0, 1))(
        variables["params"]["encoder"]["kernel"], variables["params"]["shared"]
    )
    np.testing.assert_allclose(grads["encoder"]["kernel"], gk, rtol=1e-5)
    np.testing.assert_allclose(grads["shared"], gs, rtol=1e-5)


def test_colliding_keys_are_an_error():
    class Collide(lm.Module):
        def __init__(self):
            self.table = {
                1: lm.Parameter((1,), lm.initializers.zeros()),
                "1": lm.Parameter((1,), lm.initializers.zeros()),
            }

    with pytest.raises(ValueError, match=r"same place in the variables dict, params/table/1"):
        lm.transform(Collide())


class Noisy(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(4, 4)
        self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def __call__(self, x):
        self.count += 1
        noise = jax.random.normal(lm.next_rng_key("noise"), x.shape)
        return self.dense(x + noise)


@pytest.mark.parametrize("wrap", ["jit", "checkpoint"])
def test_apply_under_jit_and_checkpoint_equals_eager(getkey, wrap):
    init, apply = lm.transform(Noisy())
    variables = init(getkey())
    x, rng = jax.random.normal(getkey(), (2, 4)), getkey()
    expected = apply(variables, rng, x)
    wrapped = {"jit": jax.jit, "checkpoint": jax.checkpoint}[wrap](apply)
    got = wrapped(variables, rng, x)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert_trees_equal(got[1], expected[1])


def test_apply_under_grad_equals_manual(getkey):
    init, apply = lm.transform(Mlp())
    variables = init(getkey())
    x = jax.random.normal(getkey(), (5, 4))

    def loss(params, x):
        return jnp.sum(apply({"params": params}, None, x)[0] ** 2)

    def manual(p, x):
        h = jax.nn.relu(x @ p["layer1"]["kernel"] + p["layer1"]["bias"][None])
        return jnp.sum((h @ p["layer2"]["kernel"] + p["layer2"]["bias"][None]) ** 2)

    g = jax.grad(loss)(variables["params"], x)
    g_manual = jax.grad(manual)(variables["params"], x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), g, g_manual)
    g_jit = jax.jit(jax.grad(loss))(variables["params"], x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), g, g_jit)


def test_apply_under_vmap_over_inputs(getkey):
    init, apply = lm.transform(Mlp())
    variables = init(getkey())
    xs = jax.random.normal(getkey(), (6, 4))
    batched, _ = jax.vmap(lambda x: apply(variables, None, x))(xs)
    np.testing.assert_allclose(batched, apply(variables, None, xs)[0], rtol=1e-5, atol=1e-6)


def test_ensemble_vmap_over_init_and_apply(getkey):
    init, apply = lm.transform(Mlp())
    keys = jax.random.split(getkey(), 5)
    stacked = jax.vmap(init)(keys)
    assert stacked["params"]["layer1"]["kernel"].shape == (5, 4, 8)
    x = jax.random.normal(getkey(), (2, 4))
    outs, _ = jax.vmap(apply, in_axes=(0, None, None))(stacked, None, x)
    assert outs.shape == (5, 2, 3)
    for i in range(5):
        member = jax.tree.map(lambda a, i=i: a[i], stacked)
        np.testing.assert_allclose(
            member["params"]["layer1"]["kernel"],
            init(keys[i])["params"]["layer1"]["kernel"],
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(outs[i], apply(member, None, x)[0], rtol=1e-5)


def test_nested_transformed_models(getkey):
    teacher = lm.transform(Mlp())
    teacher_vars = teacher.init(getkey())

    class Student(lm.Module):
        def __init__(self):
            self.head = lm.Dense(3, 3)

        def __call__(self, x):
            target, _ = teacher.apply(teacher_vars, None, x)
            return self.head(target)

    init, apply = lm.transform(Student())
    out, _ = apply(init(getkey()), None, jnp.ones((1, 4)))
    assert out.shape == (1, 3)


def test_apply_positional_only_frees_keyword_names(getkey):
    class Kw(lm.Module):
        def __call__(self, *, variables, rngs):
            return variables + rngs

    init, apply = lm.transform(Kw())
    out, _ = apply({}, None, variables=1, rngs=2)
    assert out == 3


def test_grouped_init_equals_one_by_one(getkey):
    """Identical layers are initialised by one vectorised call; values must not change."""

    class Stackish(lm.Module):
        def __init__(self, n):
            self.layers = [lm.Dense(3, 3) for _ in range(n)]
            self.odd = lm.Dense(3, 3, kernel_init=lambda k, s, d: jax.random.normal(k, s, d))

    key = getkey()
    init, _ = lm.transform(Stackish(6))
    grouped = init(key)
    plan = lm._core.graph.Plan(Stackish(6))
    for entry in plan.variables:
        salt = plan.init_salt(entry)
        one = entry.state.init(jax.random.fold_in(key, salt), entry.state.shape, jnp.float32)
        got = grouped
        for part in entry.key:
            got = got[part]
        np.testing.assert_array_equal(got, one, err_msg=entry.name)
    jitted = jax.jit(init)(key)
    jax.tree.map(np.testing.assert_array_equal, jitted, grouped)
    ensemble = jax.vmap(init)(jax.random.split(key, 2))
    assert ensemble["params"]["layers"]["5"]["kernel"].shape == (2, 3, 3)


def test_copies_share_jax_arrays_and_functions(getkey):
    """A snapshot shares immutable JAX objects, and copies everything else."""
    pretrained = jnp.ones((4, 8))

    class Holder(lm.Module):
        def __init__(self):
            self.layer = lm.Dense(4, 8)
            self.layer.kernel.value = pretrained
            self.activation = lm.relu  # a jitted function
            self.table = {"fns": [jax.nn.relu], "config": [1, 2]}
            self.array = np.zeros(3)  # mutable: copied

    model = Holder()
    import copy

    copied = copy.deepcopy(model)
    assert copied.layer is not model.layer and copied.layer.kernel is not model.layer.kernel
    assert copied.layer.kernel.init.array is pretrained
    assert copied.activation is lm.relu and copied.table["fns"][0] is jax.nn.relu
    assert copied.table is not model.table and copied.table["config"] == [1, 2]
    assert copied.array is not model.array
    model.array[0] = 5.0
    assert copied.array[0] == 0.0
    init, _ = lm.transform(model)
    np.testing.assert_array_equal(init(getkey())["params"]["layer"]["kernel"], pretrained)


# --- purity, initializer identity, lossy writes, bad inputs ------------------------------


class History(lm.Module):
    def __init__(self):
        self.seen = []
        self.cache = {}
        self.table = np.zeros(3, np.float32)
        self.scale = lm.Parameter((), lm.initializers.ones())

    def __call__(self, x, mutate):
        mutate(self, x)
        return x * self.scale


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m, x: m.seen.append(x),
        lambda m, x: m.seen.extend([x]),
        lambda m, x: m.seen.__setitem__(slice(None), [x]),
        lambda m, x: m.cache.__setitem__("x", x),
        lambda m, x: m.cache.update(x=x),
        lambda m, x: m.cache.setdefault("x", x),
    ],
)
def test_apply_refuses_to_change_the_models_containers(mutate, getkey):
    init, apply = lm.transform(History())
    variables = init(getkey())
    with pytest.raises(TypeError, match=r"cannot change the (list|dict) at (seen|cache): a "):
        apply(variables, None, jnp.ones(2), mutate)


def test_apply_refuses_to_write_numpy_attributes(getkey):
    init, apply = lm.transform(History())
    with pytest.raises(ValueError, match="read-only"):
        apply(init(getkey()), None, jnp.ones(3), lambda m, x: m.table.__setitem__(0, 1.0))


def test_frozen_containers_still_read_like_lists_and_dicts(getkey):
    def read(m, x):
        assert isinstance(m.seen, list) and isinstance(m.cache, dict)
        assert jax.tree.leaves(m.seen) == [] and m.seen + [1] == [1]  # noqa: RUF005 - list concatenation itself is tested

    init, apply = lm.transform(History())
    apply(init(getkey()), None, jnp.ones(2), read)


def test_the_users_model_stays_mutable():
    model = History()
    lm.transform(model)
    model.seen.append(1)
    assert model.seen == [1]


def test_initializers_that_differ_never_share_a_group():
    class Embeds(lm.Module):
        def __init__(self):
            self.a = lm.Embed(1000, 16)
            self.b = lm.Embed(1000, 16)

    class Scaled(lm.Module):
        def __init__(self):
            init = lm.initializers.variance_scaling(1.0, "fan_in", "normal")
            self.a = lm.Parameter((1000, 16), init)
            self.b = lm.Parameter((1000, 16), init)

    lm.transform(Embeds()).init(jax.random.key(0))  # compiles a group function first
    params = lm.transform(Scaled()).init(jax.random.key(0))["params"]
    # fan_in is the size of in_axis=-2, 1000 (the Embed's initializer would give about 0.25)
    assert abs(float(params["a"].std()) - 1000**-0.5) < 0.003


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            lm.initializers.variance_scaling(1.0, "fan_in", "normal"),
            lm.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=0),
        ),
        (lm.initializers.lecun_normal(), lm.initializers.lecun_normal(batch_axis=0)),
        (lm.initializers.normal(1), lm.initializers.normal(1.0)),
        (lm.initializers.constant(np.ones(2)), lm.initializers.constant(np.ones(2))),
        (
            lm.initializers.Initializer("mine", jax.nn.initializers.zeros),
            lm.initializers.Initializer("mine", jax.nn.initializers.ones),
        ),
    ],
)
def test_initializer_equality_is_total(a, b):
    assert a != b


def test_equal_initializers_are_grouped(getkey):
    assert lm.initializers.normal(0.5) == lm.initializers.normal(0.5)
    assert lm.initializers.lecun_normal() == lm.initializers.lecun_normal()


class Writer(lm.Module):
    def __init__(self, dtype):
        self.s = lm.State("s", (), lm.initializers.zeros(), dtype, mutable=True)

    def __call__(self, value):
        self.s.value = value
        return self.s.value


@pytest.mark.parametrize(
    ("dtype", "value", "match"),
    [
        (
            jnp.int32,
            jnp.float32(1.9),
            r"cannot write a float32 value to State at s/s, stored as int32",
        ),
        (jnp.float32, jnp.complex64(1 + 2j), r"complex64 value to State at s/s, stored as float32"),
        (jnp.int32, "1", r"cannot write str '1' to State at s/s"),
    ],
)
def test_lossy_writes_are_errors(dtype, value, match, getkey):
    init, apply = lm.transform(Writer(dtype))
    with pytest.raises(TypeError, match=match):
        apply(init(getkey()), None, value)


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [(jnp.float32, jnp.int32(3), 3.0), (jnp.int32, jnp.int8(3), 3), (jnp.float32, 0.5, 0.5)],
)
def test_widening_writes_are_cast(dtype, value, expected, getkey):
    init, apply = lm.transform(Writer(dtype))
    out, new = apply(init(getkey()), None, value)
    assert new["s"]["s"].dtype == dtype and float(out) == expected


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("dtype", "value", "match"),
    [
        (jnp.int8, jnp.int32(300), r"int32 is wider than int8, and the cast would wrap"),
        (jnp.float16, jnp.float32(1e5), r"float32 is wider than float16, .* into inf"),
        (jnp.bfloat16, jnp.float32(1.001), r"float32 is wider than bfloat16, and the cast would"),
        (jnp.float16, jnp.bfloat16(1e5), r"bfloat16 is wider than float16"),
        (jnp.int8, jnp.uint8(200), r"uint8 is wider than int8"),
        (jnp.uint8, jnp.int8(-1), r"int8 is wider than uint8"),
        (jnp.float16, jnp.int32(100_000), r"int32 is wider than float16, .* large values into inf"),
    ],
)
def test_narrowing_writes_are_errors(dtype, value, match, jit, getkey):
    init, apply = lm.transform(Writer(dtype))
    apply = jax.jit(apply) if jit else apply
    name = jnp.dtype(dtype).name
    with pytest.raises(
        TypeError,
        match=rf"cannot write a \w+ value to State at s/s, stored as {name}: {match}.*"
        rf"cast explicitly if the loss is meant \(x.astype\(jnp.{name}\)\)",
    ):
        apply(init(getkey()), None, value)


class Constant(lm.Module):
    """Writes a Python number from its own code: concrete under jit too."""

    def __init__(self, dtype, number):
        self.s = lm.State("s", (), lm.initializers.zeros(), dtype, mutable=True)
        self.number = number

    def __call__(self):
        self.s.value = self.number
        return self.s.value


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("dtype", "number"),
    [
        (jnp.int8, 100),
        (jnp.uint8, 255),
        (jnp.bfloat16, 0.1),
        (jnp.float16, 3),
        (jnp.uint32, 3_000_000_000),  # beyond int32, JAX's default for a Python int
        (jnp.float32, 2**40),
        (jnp.complex64, 1 + 2j),
    ],
)
def test_python_numbers_take_the_variable_dtype(dtype, number, jit, getkey):
    init, apply = lm.transform(Constant(dtype, number))
    out, new = (jax.jit(apply) if jit else apply)(init(getkey()), None)
    assert new["s"]["s"].dtype == dtype and out.dtype == dtype
    assert complex(new["s"]["s"]) == complex(jnp.asarray(number, dtype))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("dtype", "number", "match"),
    [
        (jnp.int8, 300, r"its values \(300 to 300\) do not fit in int8 \(-128 to 127\)"),
        (jnp.uint8, -1, r"its values \(-1 to -1\) do not fit in uint8"),
        (jnp.float16, 1e6, r"1 finite value\(s\) \(the largest 1e\+06\) are beyond float16"),
        (jnp.float16, 100_000, r"1 finite value\(s\) .* beyond float16.s range"),
        (jnp.uint32, -1, r"its values \(-1 to -1\) do not fit in uint32 \(0 to 4294967295\)"),
        (jnp.float32, 1e300, r"1 finite value\(s\) \(the largest 1e\+300\) are beyond float32"),
        (jnp.float32, 2**200, r"1 finite value\(s\) \(the largest 1.6\d*e\+60\) are beyond"),
        (jnp.complex64, 1e300j, r"1 finite .* beyond complex64.s range \(each part at most 3.4"),
    ],
)
def test_python_numbers_that_do_not_fit_are_errors(dtype, number, match, jit, getkey):
    init, apply = lm.transform(Constant(dtype, number))
    with pytest.raises(ValueError, match=r"to State at s/s, stored as \w+: " + match):
        (jax.jit(apply) if jit else apply)(init(getkey()), None)


def test_a_state_computed_wider_than_stored_stores_its_compute_dtype(getkey):
    """A declaration with dtype wider than param_dtype says that storage rounds."""

    class Halved(lm.Module):
        def __init__(self):
            self.s = lm.State("s", (2,), lm.initializers.ones(), jnp.float32, jnp.bfloat16, True)

        def __call__(self):
            self.s.value = self.s.value / 3
            return self.s.value

    init, apply = lm.transform(Halved())
    out, new = jax.jit(apply)(init(getkey()), None)
    assert out.dtype == jnp.float32 and new["s"]["s"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(new["s"]["s"], jnp.full(2, 1 / 3, jnp.bfloat16))


@pytest.mark.parametrize(
    ("dtype", "number", "source"),
    [(jnp.int8, 300, "int32"), (jnp.int8, 3, "int32"), (jnp.uint8, -1, "int32")],
)
def test_a_traced_python_number_is_cast_as_jax_promotes_it(dtype, number, source, getkey):
    """Passed to a jitted function, a Python number's value is unknown: cast as JAX casts it."""
    init, apply = lm.transform(Writer(dtype))
    variables = init(getkey())
    out, new = jax.jit(lambda x: apply(variables, None, x))(number)
    promoted = jax.jit(lambda x: jnp.zeros((), dtype) + x)(number)  # JAX's weak-type rule
    assert new["s"]["s"].dtype == dtype and out.dtype == dtype == promoted.dtype
    assert int(out) == int(promoted) == int(np.asarray(number).astype(dtype))
    if number != 3:  # eagerly its value is known, and must fit
        name = jnp.dtype(dtype).name
        with pytest.raises(ValueError, match=rf"a {source} value .* do not fit in {name}"):
            apply(variables, None, jnp.asarray(number))


def test_a_traced_python_number_in_a_dtype_that_holds_it_is_written(getkey):
    init, apply = lm.transform(Writer(jnp.float32))
    variables = init(getkey())
    out, new = jax.jit(lambda x: apply(variables, None, x))(3)
    assert new["s"]["s"].dtype == jnp.float32 and float(out) == 3.0


def test_a_traced_64_bit_python_int_into_int32_wraps_as_jax_does(getkey):
    with jax.enable_x64(True):
        init, apply = lm.transform(Writer(jnp.int32))
        variables = init(getkey())
        out, new = jax.jit(lambda x: apply(variables, None, x))(2**40 + 5)
        assert new["s"]["s"].dtype == jnp.int32 and int(out) == 5  # as jnp.int32(0) + x
        with pytest.raises(ValueError, match=r"cannot write 1099511627781 .* do not fit in int32"):
            apply(variables, None, 2**40 + 5)


@pytest.mark.parametrize(
    ("dtype", "value", "match"),
    [
        (jnp.int8, jnp.asarray(300), r"its values \(300 to 300\) do not fit in int8"),
        (jnp.uint32, jnp.asarray(-1), r"its values \(-1 to -1\) do not fit in uint32"),
    ],
)
def test_a_concrete_weak_array_is_judged_by_value(dtype, value, match, getkey):
    init, apply = lm.transform(Writer(dtype))
    with pytest.raises(ValueError, match=r"cannot write a int32 value to State at s/s, .*" + match):
        apply(init(getkey()), None, value)
    out, _ = apply(init(getkey()), None, jnp.asarray(7))
    assert out.dtype == dtype and int(out) == 7


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.float64(1e300), r"a float64 value .* 1 finite value\(s\) \(the largest 1e\+300\)"),
        (np.complex128(1e300j), r"a complex128 value .* \(the largest 1e\+300\)"),
        (np.complex128(3 - 1e39j), r"a complex128 value .* \(the largest 1e\+39\)"),
    ],
)
def test_writes_into_a_complex_state_check_both_parts(value, match, getkey):
    init, apply = lm.transform(Writer(jnp.complex64))
    match = r"cannot write " + match + r" are beyond complex64's range \(each part at most 3.4"
    with pytest.raises(ValueError, match=match):
        apply(init(getkey()), None, value)
    out, new = apply(init(getkey()), None, np.complex128(1 - 2j))
    assert new["s"]["s"].dtype == jnp.complex64 and complex(out) == 1 - 2j


class Rounded(lm.Module):
    """Computed in float32, stored in float16: a write in float32 rounds into storage."""

    def __init__(self):
        self.s = lm.State("s", (), lm.initializers.zeros(), jnp.float32, jnp.float16, True)

    def __call__(self, value):
        self.s.value = value
        return self.s.value


def test_a_compute_dtype_write_must_fit_its_storage(getkey):
    init, apply = lm.transform(Rounded())
    with pytest.raises(
        ValueError,
        match=r"cannot write a float32 value to State at s/s, stored as float16: 1 finite "
        r"value\(s\) \(the largest 100000\) are beyond float16's range \(largest 65504\)",
    ):
        apply(init(getkey()), None, jnp.float32(1e5))
    out, new = apply(init(getkey()), None, jnp.float32(1 / 3))
    assert new["s"]["s"].dtype == jnp.float16 and float(out) == float(jnp.float16(1 / 3))
    out, new = jax.jit(apply)(init(getkey()), None, jnp.float32(1 / 3))  # declared rounding
    assert new["s"]["s"].dtype == jnp.float16 and float(out) == float(jnp.float16(1 / 3))


class Initialised(lm.Module):
    def __init__(self, dtype, init, shape=(2,)):
        self.s = lm.State("s", shape, init, dtype, mutable=True)

    def __call__(self):
        return self.s.value


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("dtype", "init", "match"),
    [
        (
            jnp.float32,
            lambda k, s, d: jnp.full(s, 1 + 2j, jnp.complex64),
            r"returned a complex64 value, .* stored as float32 .*drop the imaginary part",
        ),
        (
            jnp.int8,
            lambda k, s, d: jnp.full(s, 1.7, jnp.float32),
            r"returned a float32 value, .* stored as int8 .*drop the fraction",
        ),
        (
            jnp.bool_,
            lambda k, s, d: jnp.full(s, 2, jnp.int32),
            r"returned a int32 value, .* stored as bool .*every nonzero value into True",
        ),
    ],
)
def test_an_initializer_that_changes_the_kind_is_an_error(dtype, init, match, jit, getkey):
    make = lm.transform(Initialised(dtype, init)).init
    with pytest.raises(TypeError, match=r"the initializer .* of s/s " + match):
        (jax.jit(make) if jit else make)(getkey())


@pytest.mark.parametrize(
    ("dtype", "init", "match", "traced"),
    [
        (
            jnp.int8,
            lambda k, s, d: jnp.full(s, 300, jnp.int32),
            r"returned a int32 value, .* its values \(300 to 300\) do not fit in int8",
            44,
        ),
        (
            jnp.float16,
            lambda k, s, d: jnp.full(s, 1e5, jnp.float32),
            r"returned a float32 value, .* \(the largest 100000\) are beyond float16",
            np.inf,
        ),
        (
            jnp.int8,
            lambda k, s, d: jnp.full(s, 300),
            r"returned a weak-typed int32 value, .* its values \(300 to 300\) do not fit",
            44,
        ),
    ],
)
def test_an_initializer_narrowing_within_its_kind_is_checked_by_value(
    dtype, init, match, traced, getkey
):
    """Concrete initial values must fit; traced ones (jax.jit of init) are cast."""
    make = lm.transform(Initialised(dtype, init)).init
    with pytest.raises(ValueError, match=r"the initializer .* of s/s " + match):
        make(getkey())
    value = jax.jit(make)(getkey())["s"]["s"]
    assert value.dtype == dtype and value.tolist() == [traced, traced]


def _normal(k, s, d):
    return jax.random.normal(k, s) * 0.02


def _truncated(k, s, d):
    return jax.random.truncated_normal(k, -2.0, 2.0, s)


def _ones(k, s, d):
    return np.ones(s)


@pytest.mark.parametrize("how", ["eager", "jit", "stack"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("draw", [_normal, _truncated, _ones])
def test_an_initializer_may_return_float32_for_a_narrower_float_variable(draw, dtype, how):
    dense = lm.Dense(4, 4, kernel_init=draw, dtype=dtype)
    model = lm.Stack(dense, 3) if how == "stack" else dense
    make = lm.transform(model).init
    params = (jax.jit(make) if how == "jit" else make)(jax.random.key(1))["params"]
    kernel = params["block"]["kernel"] if how == "stack" else params["kernel"]
    assert kernel.dtype == dtype
    wide = lm.Dense(4, 4, kernel_init=draw)  # the same draws in float32, then cast
    wide = lm.Stack(wide, 3) if how == "stack" else wide
    wanted = lm.transform(wide).init(jax.random.key(1))["params"]
    wanted = wanted["block"]["kernel"] if how == "stack" else wanted["kernel"]
    np.testing.assert_array_equal(kernel, wanted.astype(dtype))


class Flags(lm.Module):
    """Writes a weak-typed value computed from its input: JAX's rule gives it the state's dtype."""

    def __init__(self, dtype, make):
        self.s = lm.State("s", (3,), lm.initializers.zeros(), dtype, mutable=True)
        self.make = make

    def __call__(self, x):
        self.s.value = self.make(x)
        return self.s.value


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("dtype", "make", "wanted"),
    [
        (jnp.bfloat16, lambda x: jnp.where(x > 0, 1.0, 0.0), [1.0, 0.0, 1.0]),
        (jnp.bfloat16, lambda x: jnp.full((3,), 0.0), [0.0, 0.0, 0.0]),
        (jnp.int8, lambda x: jnp.where(x > 0, 1, 0), [1, 0, 1]),
        (jnp.int8, lambda x: jnp.where(x > 0, 200, 0), [-56, 0, -56]),  # as int8 + where(...)
    ],
)
def test_a_weak_typed_traced_write_takes_the_state_dtype(dtype, make, wanted, jit, getkey):
    init, apply = lm.transform(Flags(dtype, make))
    x = jnp.array([1.0, -2.0, 3.0])
    if min(wanted) < 0 and not jit:  # eagerly the values are known: they must fit
        with pytest.raises(ValueError, match=r"State at s/s, stored as int8: its values"):
            apply(init(getkey()), None, x)
        return
    out, new = (jax.jit(apply) if jit else apply)(init(getkey()), None, x)
    assert new["s"]["s"].dtype == dtype and new["s"]["s"].tolist() == wanted
    assert (jnp.zeros(3, dtype) + jax.jit(make)(x)).tolist() == wanted


@pytest.mark.parametrize(
    ("dtype", "given"),
    [
        (jnp.bfloat16, 0.25),
        (jnp.bfloat16, lambda: jnp.asarray(0.25)),
        (jnp.int8, 7),
        (jnp.int8, lambda: jnp.asarray(7)),
    ],
)
def test_jitted_apply_takes_a_weak_value_for_a_narrower_variable(dtype, given, getkey):
    given = given() if callable(given) else given
    init, apply = lm.transform(Reader(dtype))
    out, _ = jax.jit(apply)({"s": {"s": given}}, None)
    assert out.dtype == dtype and float(out) == float(given)


def test_a_float_narrowing_refusal_names_both_fixes(getkey):
    init, apply = lm.transform(Writer(jnp.bfloat16))
    with pytest.raises(
        TypeError,
        match=r"cannot write a float32 value to State at s/s, stored as bfloat16: .*"
        r"x.astype\(jnp.bfloat16\).*dtype=float32, param_dtype=bfloat16.*param_dtype=float32",
    ):
        jax.jit(apply)(init(getkey()), None, jnp.float32(0.5))


@pytest.mark.parametrize("jit", [False, True])
def test_an_int32_initializer_may_draw_an_int8_variable(jit, getkey):
    def draw(k, s, d):
        return jax.random.randint(k, s, -127, 128)

    make = lm.transform(Initialised(jnp.int8, draw, (16,))).init
    key = getkey()
    value = (jax.jit(make) if jit else make)(key)["s"]["s"]
    wanted = lm.transform(Initialised(jnp.int32, draw, (16,))).init(key)["s"]["s"]
    assert value.dtype == jnp.int8 and value.tolist() == wanted.tolist()


@pytest.mark.parametrize("jit", [False, True])
def test_an_initializer_returning_a_weak_value_is_judged_as_a_write(jit, getkey):
    make = lm.transform(Initialised(jnp.int8, lambda k, s, d: jnp.full(s, 7))).init
    value = (jax.jit(make) if jit else make)(getkey())["s"]["s"]
    assert value.dtype == jnp.int8 and value.tolist() == [7, 7]
    with pytest.raises(ValueError, match=r"returned a weak-typed int32 value, .* do not fit"):
        lm.transform(Initialised(jnp.int8, lambda k, s, d: jnp.full(s, 300))).init(getkey())
    with pytest.raises(ValueError, match=r"returned the Python number 300, .* do not fit in int8"):
        lm.transform(Initialised(jnp.int8, lambda k, s, d: 300, ())).init(getkey())
    fits = lm.transform(Initialised(jnp.int8, lambda k, s, d: 3, ())).init(getkey())["s"]["s"]
    assert fits.dtype == jnp.int8 and int(fits) == 3


def test_an_initializer_in_a_stack_is_checked_under_its_vmap(getkey):
    block = Initialised(jnp.int8, lambda k, s, d: jnp.full(s, 1.5, jnp.float32))
    with pytest.raises(TypeError, match=r"of s/block/s returned a float32 value.*fraction"):
        lm.transform(lm.Stack(block, 2)).init(getkey())
    block = Initialised(jnp.int8, lambda k, s, d: jnp.full(s, 300, jnp.int32))  # by value
    with pytest.raises(ValueError, match=r"of s/block/s returned a int32 .* do not fit in int8"):
        lm.transform(lm.Stack(block, 2)).init(getkey())
    value = jax.jit(lm.transform(lm.Stack(block, 2)).init)(getkey())["s"]["block"]["s"]
    assert value.dtype == jnp.int8 and value.tolist() == [[44, 44], [44, 44]]


def test_an_initializer_may_return_a_wider_or_the_compute_dtype(getkey):
    widened = lm.transform(Initialised(jnp.float32, lambda k, s, d: jnp.full(s, 3, jnp.int8)))
    assert widened.init(getkey())["s"]["s"].tolist() == [3.0, 3.0]
    # float32 compute, bfloat16 storage: a float32 initializer rounds into storage (declared)
    dense = lm.Dense(2, 2, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    dense.kernel.init = lambda k, s, d: jnp.full(s, 1 / 3, jnp.float32)
    kernel = jax.jit(lm.transform(dense).init)(getkey())["params"]["kernel"]
    assert kernel.dtype == jnp.bfloat16 and float(kernel[0, 0]) == float(jnp.bfloat16(1 / 3))
    bf16 = lm.transform(lm.Dense(2, 2, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16))
    assert jax.jit(bf16.init)(getkey())["params"]["kernel"].dtype == jnp.bfloat16


class Reader(lm.Module):
    def __init__(self, dtype):
        self.s = lm.State("s", (), lm.initializers.zeros(), dtype)

    def __call__(self):
        return self.s.value


@pytest.mark.parametrize("jit", [False, True])
def test_apply_refuses_a_variable_given_in_a_wider_dtype(jit, getkey):
    init, apply = lm.transform(Reader(jnp.int8))
    apply = jax.jit(apply) if jit else apply
    with pytest.raises(
        TypeError,
        match=r"State at s/s got a int32 value, but it is read as int8: int32 is wider than "
        r"int8, and the cast would wrap the values that do not fit.* \(x.astype\(jnp.int8\)\)",
    ):
        apply({"s": {"s": jnp.int32(300)}}, None)
    out, _ = apply({"s": {"s": jnp.int8(44)}}, None)
    assert out.dtype == jnp.int8 and int(out) == 44
    out, _ = apply({"s": {"s": jnp.bool_(True)}}, None)  # bool widens to any number
    assert out.dtype == jnp.int8 and int(out) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_a_weak_float32_kernel_for_a_float16_layer_is_judged_as_jax_promotes_it(jit, getkey):
    """``jnp.full(shape, 1e5)`` is weakly typed: by value eagerly, cast as JAX does under jit."""
    init, apply = lm.transform(lm.Dense(2, 2, dtype=jnp.float16))
    variables = {"params": {"kernel": jnp.full((2, 2), 1e5), "bias": jnp.zeros(2, jnp.float16)}}
    x = jnp.ones((1, 2), jnp.float16)
    if not jit:
        with pytest.raises(
            ValueError, match=r"Parameter at params/kernel got a float32 value, .* finite value"
        ):
            apply(variables, None, x)
    else:
        out, _ = jax.jit(apply)(variables, None, x)  # 1e5 overflows, as in float16 + 1e5
        assert out.dtype == jnp.float16 and np.isinf(np.asarray(out)).all()
    variables["params"]["kernel"] = jnp.full((2, 2), 0.5)
    out, _ = (jax.jit(apply) if jit else apply)(variables, None, x)
    assert out.dtype == jnp.float16 and out.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("jit", [False, True])
def test_apply_refuses_a_float32_kernel_for_a_float16_layer(jit, getkey):
    init, apply = lm.transform(lm.Dense(2, 2, dtype=jnp.float16))
    variables = jax.tree.map(lambda v: jnp.full(v.shape, 1e5, jnp.float32), init(getkey()))
    with pytest.raises(
        TypeError,
        match=r"Parameter at params/\w+ got a float32 value, but it is read as float16: "
        r"float32 is wider than float16",
    ):
        (jax.jit(apply) if jit else apply)(variables, None, jnp.ones((1, 2), jnp.float16))


def test_apply_reads_a_python_number_in_the_variable_dtype_if_it_fits(getkey):
    init, apply = lm.transform(Reader(jnp.int8))
    out, _ = apply({"s": {"s": 100}}, None)
    assert out.dtype == jnp.int8 and int(out) == 100
    with pytest.raises(ValueError, match=r"got a int32 value, .* \(300 to 300\) do not fit"):
        apply({"s": {"s": 300}}, None)


def test_mixed_precision_reads_are_not_narrowing(getkey):
    """float32 storage read in bfloat16 is the layer's compute dtype, not a narrowed value."""
    init, apply = lm.transform(lm.Dense(2, 2, dtype=jnp.bfloat16, param_dtype=jnp.float32))
    variables = init(getkey())
    out, _ = jax.jit(apply)(variables, None, jnp.ones((1, 2), jnp.bfloat16))
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    expected = jnp.ones((1, 2)) @ kernel.astype(jnp.bfloat16).astype(jnp.float32) + bias[None]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2)


@pytest.mark.parametrize("leaf", [np.array(["a", "b"]), np.array([object(), 1], dtype=object)])
def test_a_variable_that_is_not_numeric_is_named(leaf, getkey):
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(getkey())
    variables["params"]["bias"] = leaf
    with pytest.raises(
        TypeError, match=r"Parameter at params/bias got a \S+ value, .* is not a numeric array"
    ):
        apply(variables, None, jnp.ones((1, 2)))


@pytest.mark.parametrize(
    ("rngs", "match"),
    [
        (jnp.zeros(3, jnp.uint32), r"uint32 and shape \(3,\)"),
        (jax.random.split(jax.random.key(0), 2), r"shape \(2,\)"),
    ],
)
def test_arrays_that_are_not_one_key_are_rejected(rngs, match, getkey):
    init, apply = lm.transform(lm.Dense(2, 2))
    with pytest.raises(TypeError, match=match):
        apply(init(getkey()), rngs, jnp.ones(2))


def test_raw_uint32_keys_still_work(getkey):
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(jax.random.PRNGKey(0))
    apply(variables, jax.random.PRNGKey(1), jnp.ones(2))


def test_eval_shape_output_is_not_accepted_as_variables(getkey):
    init, apply = lm.transform(lm.Dense(2, 2))
    shapes = jax.eval_shape(init, getkey())
    with pytest.raises(lm.VariablesError, match=r"ShapeDtypeStruct .* at params/bias"):
        apply(shapes, None, jnp.ones(2))


def test_string_leaf_is_named(getkey):
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(getkey())
    variables["params"]["bias"] = "zeros"
    with pytest.raises(lm.VariablesError, match=r"params/bias: expected \(2,\), got str 'zeros'"):
        apply(variables, None, jnp.ones(2))


def test_metoryx_init_and_apply(getkey):
    dense = lm.Dense(3, 2)
    variables = lm.init(dense)(getkey())
    out, _ = lm.apply(dense)(variables, None, jnp.ones((1, 3)))
    expected, _ = lm.transform(dense).apply(variables, None, jnp.ones((1, 3)))
    np.testing.assert_array_equal(out, expected)
    first, _ = lm.apply(dense, lambda m: m.__call__)(variables, None, jnp.ones((1, 3)))
    np.testing.assert_array_equal(first, expected)


@pytest.mark.parametrize("dtype", [jnp.float32, None])
def test_apply_refuses_a_variable_that_would_lose_its_imaginary_part(getkey, dtype):
    init, apply = lm.transform(lm.Dense(2, 1, dtype=dtype))
    variables = init(getkey())
    kernel = variables["params"]["kernel"]
    variables["params"]["kernel"] = jax.lax.complex(kernel, jnp.full_like(kernel, 5.0))
    with pytest.raises(
        TypeError,
        match=r"Parameter at params/kernel got a complex64 value, but it is read as float32: "
        r"the cast would drop the imaginary part",
    ):
        apply(variables, None, jnp.ones((1, 2)))


def test_apply_casts_a_variable_within_its_kind(getkey):
    init, apply = lm.transform(lm.Dense(2, 1))
    variables = init(getkey())
    low = jax.tree.map(lambda v: v.astype(jnp.bfloat16), variables)
    out, _ = apply(low, None, jnp.ones((1, 2)))
    expected, _ = apply(jax.tree.map(lambda v: v.astype(jnp.float32), low), None, jnp.ones((1, 2)))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, expected)


def test_a_thousand_nested_modules_transform_and_run(getkey):
    model = lm.Dense(2, 2, kernel_init=lm.initializers.constant(2.0))
    for _ in range(1000):
        model = lm.Sequential(model)
    init, apply = lm.transform(model)
    variables = init(getkey())
    x = jnp.ones((1, 2))
    expected = jnp.full((1, 2), 4.0)
    np.testing.assert_array_equal(apply(variables, None, x)[0], expected)
    np.testing.assert_array_equal(jax.jit(apply)(variables, None, x)[0], expected)
    grads = jax.grad(lambda v: apply(v, None, x)[0].sum())(variables)
    assert jax.tree.structure(grads) == jax.tree.structure(variables)
    again = lm.transform(lm.assign_variables(model, variables)).init(getkey())
    jax.tree.map(np.testing.assert_array_equal, again, variables)


def test_64_bit_numpy_values_become_32_bit_if_they_fit(getkey):
    """Without x64, int64 and float64 NumPy values are 32-bit, as everywhere in JAX."""
    init, apply = lm.transform(Writer(jnp.int32))
    variables = init(getkey())
    out, new = apply(variables, None, np.int64(5))
    assert new["s"]["s"].dtype == jnp.int32 and int(out) == 5
    with pytest.raises(ValueError, match=r"its values \(1099511627776 to .* do not fit in int32"):
        apply(variables, None, np.int64(2**40))
    init, apply = lm.transform(Writer(jnp.int8))
    with pytest.raises(TypeError, match=r"int32 is wider than int8"):  # int64 is int32 here
        apply(init(getkey()), None, np.int64(5))
