"""lm.DynamicLossScale, lm.all_finite: jmp's rule; float16 underflow rescued, overflow skipped."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lamina as lm

jmp = pytest.importorskip("jmp")


def jmp_sequence(start, flags, **settings):
    """jmp 0.0.4's (loss_scale, counter) after each flag (jmp is not strict-promotion clean)."""
    scale = jmp.DynamicLossScale(jnp.float32(start), **settings)
    seen = []
    with jax.numpy_dtype_promotion("standard"):
        for flag in flags:
            scale = scale.adjust(jnp.asarray(flag))
            seen.append((float(scale.loss_scale), int(scale.counter)))
    return seen


def lamina_sequence(start, flags, adjust=None, **settings):
    scale = lm.DynamicLossScale(start, **settings)
    adjust = adjust or (lambda s, f: s.adjust(f))
    seen = []
    for flag in flags:
        scale = adjust(scale, jnp.asarray(flag))
        seen.append((float(scale.loss_scale), int(scale.counter)))
    return seen


FLAGS = [True] * 7 + [False, True, False, False] + [True] * 9 + [False] * 6 + [True] * 4


@pytest.mark.parametrize(
    "start, settings",
    [
        (2.0**15, {"period": 3}),
        (2.0**3, {"period": 2, "factor": 4, "min_loss_scale": np.float32(2.0)}),
        (2.0**126, {"period": 1}),  # growth would overflow float32: the scale stays
        (1.0, {"period": 5}),  # already at the minimum: halving keeps it
    ],
)
def test_the_scale_follows_jmps_rule(start, settings):
    expected = jmp_sequence(start, FLAGS, **settings)
    assert lamina_sequence(start, FLAGS, **settings) == expected
    jitted = jax.jit(lambda s, f: s.adjust(f))
    assert lamina_sequence(start, FLAGS, jitted, **settings) == expected
    assert max(s for s, _ in expected) < np.finfo(np.float32).max


def test_pytree_keeps_every_setting_through_jit():
    scale = lm.DynamicLossScale(8.0, period=3, factor=4, min_loss_scale=2.0)
    leaves, treedef = jax.tree.flatten(scale)
    assert len(leaves) == 2 and leaves[0].dtype == jnp.float32 and leaves[1].dtype == jnp.int32
    back = jax.jit(lambda s: s)(scale)
    assert (back.period, back.factor, back.min_loss_scale) == (3, 4, 2.0)
    # jmp's tree_unflatten drops min_loss_scale (back to 1); this one keeps it
    down = jax.jit(lambda s: s.adjust(jnp.asarray(False)).adjust(jnp.asarray(False)))(back)
    assert float(down.loss_scale) == 2.0
    assert repr(down) == (
        "DynamicLossScale(loss_scale=2.0, counter=0, period=3, factor=4, min_loss_scale=2.0)"
    )
    restored = pickle.loads(pickle.dumps(down))
    assert float(restored.loss_scale) == 2.0 and restored.period == 3
    # it rides through lax.scan as a carry
    flags = jnp.asarray([True, True, True, False])
    final, _ = jax.lax.scan(lambda s, f: (s.adjust(f), None), scale, flags)
    assert (float(final.loss_scale), int(final.counter)) == (8.0, 0)
    traced = []
    jax.jit(lambda s: traced.append(repr(s)) or s)(scale)
    assert traced == [
        "DynamicLossScale(loss_scale=<float32[]>, counter=<int32[]>, period=3, factor=4, "
        "min_loss_scale=2.0)"
    ]


def test_scale_and_unscale_compute_in_float32_at_least():
    scale = lm.DynamicLossScale(2.0**16)
    tree = {
        "half": jnp.asarray([1e-3, 0.5], jnp.float16),
        "brain": jnp.asarray([3.0], jnp.bfloat16),
        "single": jnp.float32(3.0),
        "complex": jnp.asarray([1 + 2j], jnp.complex64),
        "int": jnp.int32(7),
        "python": 2,
        "none": None,
    }
    scaled = scale.scale(tree)
    # narrower floats come back float32 (as jmp's, by promotion); the rest keep their type
    expected_types = {
        "half": jnp.float32,
        "brain": jnp.float32,
        "single": jnp.float32,
        "complex": jnp.complex64,
        "int": jnp.int32,
        "python": int,
        "none": None,
    }
    for result in (scaled, scale.unscale(tree)):
        assert jax.tree.map(lambda x: getattr(x, "dtype", type(x)), result) == expected_types
    # 0.5 * 2 ** 16 overflows float16 (max 65504): float32 keeps it
    expected = np.asarray([1e-3, 0.5], np.float16).astype(np.float32) * 65536
    np.testing.assert_array_equal(scaled["half"], expected)
    assert float(scaled["brain"][0]) == 3.0 * 65536
    assert float(scaled["single"]) == 3.0 * 65536
    assert complex(scaled["complex"][0]) == (1 + 2j) * 65536
    assert scaled["int"] == 7 and scaled["python"] == 2 and scaled["none"] is None
    back = scale.unscale(scaled)
    np.testing.assert_array_equal(back["half"], np.asarray([1e-3, 0.5], np.float16))
    assert float(back["single"]) == 3.0 and complex(back["complex"][0]) == 1 + 2j


def test_a_float16_loss_is_scaled_in_float32_as_jmp():
    # 3 * 2 ** 15 = 98304 is past float16's largest finite value (65504)
    loss = jnp.float16(3.0)
    ours = lm.DynamicLossScale(2.0**15).scale(loss)
    with jax.numpy_dtype_promotion("standard"):
        theirs = jmp.DynamicLossScale(jnp.float32(2.0**15)).scale(loss)
    assert ours.dtype == theirs.dtype == jnp.float32
    assert float(ours) == float(theirs) == 98304.0


def test_unscaling_float16_gradients_does_not_underflow_them_again():
    # float16 parameters: their gradients are float16, scaled up to be representable; divided
    # in float16 they would round to zero again (about 1e-9 each)
    model = lm.with_policy(lm.Dense(8, 1), lm.Policy("float16", "float16"))
    init, run = lm.transform(model)
    variables = init(jax.random.key(0))
    x, t = data()
    x = x.astype(jnp.float16)

    def loss(variables, scale):
        y, _ = run(variables, None, x)
        return scale.scale(1e-9 * jnp.mean((y.astype(jnp.float32) - t) ** 2))

    ours = lm.DynamicLossScale(2.0**15)
    scaled = lm.grad(loss, model)(variables, ours)
    assert scaled["params"]["kernel"].dtype == jnp.float16
    grads = ours.unscale(scaled)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**15))
    with jax.numpy_dtype_promotion("standard"):
        expected = theirs.unscale(lm.grad(loss, model)(variables, theirs))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)
    kernel = np.asarray(grads["params"]["kernel"])
    assert np.all(kernel != 0) and np.abs(kernel).max() < 1e-7
    # the same division in float16 loses them: what unscale used to do
    lost = scaled["params"]["kernel"] * jnp.float16(2.0**-15)
    assert not np.any(np.asarray(lost))


def test_all_finite():
    assert bool(lm.all_finite({"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.float16)]}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {"a": jnp.ones(3), "b": jnp.asarray([0.0, bad], jnp.float16)}
        assert not bool(lm.all_finite(tree))
        assert not bool(jax.jit(lm.all_finite)(tree))
    assert not bool(lm.all_finite({"z": jnp.asarray([complex(0, np.inf)], jnp.complex64)}))
    assert not bool(lm.all_finite([float("nan")]))
    assert bool(lm.all_finite({})) and bool(lm.all_finite({"step": jnp.int32(3), "n": 4}))
    assert lm.all_finite({}).shape == () and lm.all_finite({}).dtype == jnp.bool_


def test_setting_errors():
    with pytest.raises(ValueError, match=r"period must be a positive int .* got 0"):
        lm.DynamicLossScale(period=0)
    with pytest.raises(TypeError, match=r"period must be a positive int .* got 2.0"):
        lm.DynamicLossScale(period=2.0)
    with pytest.raises(ValueError, match=r"factor must be a finite number > 1"):
        lm.DynamicLossScale(factor=1)
    with pytest.raises(TypeError, match=r"factor must be a finite number > 1"):
        lm.DynamicLossScale(factor="2")
    with pytest.raises(ValueError, match=r"min_loss_scale must be a positive finite number"):
        lm.DynamicLossScale(min_loss_scale=0.0)
    with pytest.raises(ValueError, match=r"loss_scale must be finite and at least min_loss_scale"):
        lm.DynamicLossScale(float("inf"))
    with pytest.raises(ValueError, match=r"loss_scale must be finite and at least min_loss_scale"):
        lm.DynamicLossScale(0.5)
    with pytest.raises(TypeError, match=r"loss_scale must be a real number or a scalar array"):
        lm.DynamicLossScale(jnp.ones(2))
    with pytest.raises(TypeError, match=r"loss_scale must be a real number or a scalar array"):
        lm.DynamicLossScale("32768")
    with pytest.raises(TypeError, match=r"counter must be an int"):
        lm.DynamicLossScale(counter=1.5)
    with pytest.raises(ValueError, match=r"counter must be in \[0, period=4\)"):
        lm.DynamicLossScale(counter=4, period=4)
    scale = lm.DynamicLossScale()
    with pytest.raises(TypeError, match=r"one bool for the whole step.*got bool\[3\]"):
        scale.adjust(jnp.asarray([True, False, True]))
    with pytest.raises(TypeError, match=r"one bool for the whole step.*got float32\[\]"):
        scale.adjust(jnp.float32(1.0))
    assert float(scale.adjust(True).loss_scale) == 2.0**15  # a Python bool is fine


# --- float16 training: underflow without scaling, training with it, overflow skipped ------


def mlp(dtype):
    """Computes in `dtype`, stores float32 (how lamina layers compute in float16 today)."""
    return lm.Sequential(
        lm.Dense(8, 8, dtype=dtype, param_dtype=jnp.float32),
        lm.tanh,
        lm.Dense(8, 1, dtype=dtype, param_dtype=jnp.float32),
    )


MODEL = mlp(jnp.float16)
APPLY = lm.transform(MODEL).apply
OPTIMIZER = optax.adam(1e-2)


def data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((32, 1)), jnp.float32)
    return x, t


def small_loss(apply):
    """A loss so small that its float16 cotangents round to zero (1e-7 / 32 per output)."""

    def loss(variables, x, t):
        y, _ = apply(variables, None, x)
        return 1e-7 * jnp.mean((y.astype(jnp.float32) - t) ** 2)

    return loss


@jax.jit
def step(variables, opt_state, scale, x, t):
    """One step of the documented recipe; `scale` is lamina's or jmp's DynamicLossScale."""
    loss, grads = lm.value_and_grad(lambda v: scale.scale(small_loss(APPLY)(v, x, t)), MODEL)(
        variables
    )
    grads = scale.unscale(grads)
    finite = lm.all_finite(grads)
    updates, new_state = OPTIMIZER.update(grads, opt_state, variables)
    new = optax.apply_updates(variables, updates)

    def keep(new, old):
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

    return keep(new, variables), keep(new_state, opt_state), scale.adjust(finite), loss, finite


def train(scale, steps):
    x, t = data()
    variables = lm.transform(MODEL).init(jax.random.key(0))
    opt_state = OPTIMIZER.init(variables)
    history = []
    with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-clean
        for _ in range(steps):
            before = variables
            variables, opt_state, scale, _, finite = step(variables, opt_state, scale, x, t)
            history.append((bool(finite), before, variables, float(scale.loss_scale)))
    return variables, history


def loss_of(variables):
    x, t = data()
    return float(small_loss(APPLY)(variables, x, t))


def test_float16_gradients_underflow_to_zero_without_scaling():
    x, t = data()
    variables = lm.transform(MODEL).init(jax.random.key(0))
    grads = lm.grad(small_loss(APPLY), MODEL)(variables, x, t)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
    # the same loss in float32 has gradients of about 1e-8: the float16 ones are lost
    reference = lm.grad(small_loss(lm.transform(mlp(jnp.float32)).apply), MODEL)(variables, x, t)
    assert all(np.abs(g).max() > 1e-9 for g in jax.tree.leaves(reference))
    # 100 Adam steps with a no-op scale move nothing: the loss is bitwise the same
    trained, _ = train(lm.DynamicLossScale(1.0, period=10**6), 100)
    assert loss_of(trained) == loss_of(variables)
    jax.tree.map(np.testing.assert_array_equal, trained, variables)


def test_float16_with_a_dynamic_loss_scale_trains():
    x, t = data()
    variables = lm.transform(MODEL).init(jax.random.key(0))
    scale = lm.DynamicLossScale(2.0**15)
    grads = scale.unscale(
        lm.grad(lambda v: scale.scale(small_loss(APPLY)(v, x, t)), MODEL)(variables)
    )
    reference = lm.grad(small_loss(lm.transform(mlp(jnp.float32)).apply), MODEL)(variables, x, t)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        assert got.dtype == jnp.float32 and np.all(got != 0)
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=1e-2 * np.abs(want).max())
    trained, history = train(scale, 100)
    assert all(finite for finite, *_ in history)
    assert loss_of(trained) < 0.5 * loss_of(variables)


def test_overflowing_steps_are_skipped_and_the_scale_matches_jmps():
    ours = lm.DynamicLossScale(2.0**50, period=5)
    trained, history = train(ours, 20)
    flags = [finite for finite, *_ in history]
    # 2 ** 50 times a cotangent of about 1e-8 overflows float16 (max 65504): skipped steps
    first = flags.index(True)
    assert first >= 5 and not any(flags[:first]) and all(flags[first : first + 5])
    for finite, before, after, _ in history:
        if not finite:  # variables (and optimizer state) bitwise unchanged
            jax.tree.map(np.testing.assert_array_equal, after, before)
    scales = [s for *_, s in history]
    assert scales[:first] == [2.0 ** (49 - i) for i in range(first)]
    # then it stays, and doubles after 5 finite steps in a row
    assert scales[first : first + 4] == [scales[first - 1]] * 4
    assert scales[first + 4] == 2 * scales[first - 1]
    # jmp's DynamicLossScale in the same loop takes the same steps and scales
    _, jmp_history = train(jmp.DynamicLossScale(jnp.float32(2.0**50), period=5), 20)
    assert [s for *_, s in jmp_history] == scales
    assert [f for f, *_ in jmp_history] == flags
    jax.tree.map(np.testing.assert_array_equal, trained, jmp_history[-1][2])
