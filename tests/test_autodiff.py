"""lm.grad / lm.value_and_grad over DiffState, against split + jax.grad + merge by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lamina as lm


class Frozen(lm.Parameter):
    pass


class Net(lm.Module):
    def __init__(self):
        super().__init__()
        self.body = lm.Dense(3, 4)
        self.body.kernel = Frozen((3, 4), lm.initializers.lecun_normal())
        self.norm = lm.BatchNorm(4)
        self.head = lm.Dense(4, 2)

    def __call__(self, x):
        return self.head(lm.relu(self.norm(self.body(x), is_training=True)))


MODEL = Net()
INIT, APPLY = lm.transform(MODEL)


def loss(variables, x, scale=1.0):
    y, new_variables = APPLY(variables, None, x)
    return scale * jnp.sum(jnp.sin(y) * y), new_variables


def setup(seed=0):
    return INIT(jax.random.key(seed)), jax.random.normal(jax.random.key(seed + 1), (5, 3))


def close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_default_differentiates_the_parameters_of_argument_0():
    variables, x = setup()
    grads, new_variables = lm.grad(loss, MODEL, has_aux=True)(variables, x)
    params, rest = lm.split(MODEL, variables, lm.Parameter, ...)
    by_hand = jax.grad(lambda p: loss(lm.merge(p, rest), x)[0])(params)
    close(grads, by_hand)
    assert sorted(grads) == ["params"] and "kernel" in grads["params"]["body"]
    assert "batch_stats" in new_variables


def test_diffstate_filter_takes_only_its_paths():
    variables, x = setup()
    trainable = lm.All(lm.Parameter, lm.Not(Frozen))
    grads = lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(0, trainable))(variables, x)
    assert sorted(grads["params"]["body"]) == ["bias"]
    chosen, rest = lm.split(MODEL, variables, trainable, ...)
    close(grads, jax.grad(lambda c: loss(lm.merge(c, rest), x)[0])(chosen))


def test_int_argnums_mean_whole_arguments_as_in_jax():
    variables, x = setup()
    f = lambda v, x: loss(v, x)[0]  # noqa: E731
    gx = lm.grad(f, MODEL, argnums=1)(variables, x)
    close(gx, jax.grad(f, argnums=1)(variables, x))
    gv, gx2 = lm.grad(f, MODEL, argnums=(lm.DiffState(0, lm.PathContains("head")), 1))(variables, x)
    assert sorted(gv["params"]) == ["head"]
    close(gx2, gx)


def test_value_and_grad_value_and_kwargs():
    variables, x = setup()
    (value, _), grads = lm.value_and_grad(loss, MODEL, has_aux=True)(variables, x, scale=2.0)
    np.testing.assert_allclose(value, loss(variables, x, scale=2.0)[0], rtol=1e-6)
    single = lm.grad(lambda v, x: loss(v, x)[0], MODEL)(variables, x)
    close(jax.tree.map(lambda g: 2 * g, single), grads)


def test_under_jit_equals_eager():
    variables, x = setup()
    step = lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(0, lm.Not(Frozen)))
    close(jax.jit(step)(variables, x), step(variables, x))


def test_subset_argument():
    variables, x = setup()
    params = {"params": variables["params"]}
    rest = {"batch_stats": variables["batch_stats"]}

    def f(params, rest, x):
        return loss(lm.merge(params, rest), x)[0]

    grads = lm.grad(f, MODEL, lm.DiffState(0, lm.PathContains("head")))(params, rest, x)
    assert sorted(grads["params"]) == ["head"]


def test_errors():
    with pytest.raises(TypeError, match=r"argnums takes ints .* and lm.DiffState"):
        lm.grad(loss, MODEL, argnums="0")
    with pytest.raises(TypeError, match="argnums takes ints"):
        lm.grad(loss, MODEL, argnums=(True,))
    with pytest.raises(ValueError, match="lists argument\\(s\\) more than once"):
        lm.grad(loss, MODEL, argnums=(0, lm.DiffState(0)))
    variables, x = setup()
    with pytest.raises(lm.VariablesError, match="did you pass variables\\['params'\\]"):
        lm.grad(lambda v, x: loss(v, x)[0], MODEL)(variables["params"], x)


def test_freezing_with_diffstate_keeps_frozen_weights_bit_identical():
    variables, x = setup()
    trainable = lm.All(lm.Parameter, lm.Not(Frozen))
    chosen, frozen = lm.split(MODEL, variables, trainable, ...)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = optimizer.init(chosen)
    step_grad = jax.jit(lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(0, trainable)))
    for _ in range(3):
        grads = step_grad(lm.merge(chosen, frozen), x)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = optimizer.update(grads, opt_state, chosen)
        chosen = optax.apply_updates(chosen, updates)
    after = lm.merge(chosen, frozen)
    np.testing.assert_array_equal(
        after["params"]["body"]["kernel"], variables["params"]["body"]["kernel"]
    )
    assert not np.array_equal(after["params"]["body"]["bias"], variables["params"]["body"]["bias"])


def test_adamw_decays_frozen_weights_unless_masked():
    """The trap: zero gradients do not protect a weight from adamw's decay; a mask does."""
    variables, x = setup()
    params = variables["params"]
    frozen_mask = lm.mask(MODEL, {"params": params}, Frozen)["params"]
    trainable_mask = jax.tree.map(lambda frozen: not frozen, frozen_mask)

    def train(optimizer):
        state, p = optimizer.init(params), params
        for _ in range(3):
            grads = jax.grad(lambda p: loss({**variables, "params": p}, x)[0])(p)
            grads = jax.tree.map(
                lambda g, frozen: jnp.zeros_like(g) if frozen else g, grads, frozen_mask
            )
            with jax.numpy_dtype_promotion("standard"):  # optax is not strict-dtype clean
                updates, state = optimizer.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return p

    naive = train(optax.adamw(1e-2, weight_decay=0.1))
    assert not np.array_equal(naive["body"]["kernel"], params["body"]["kernel"])  # decayed
    masked = train(optax.masked(optax.adamw(1e-2, weight_decay=0.1), trainable_mask))
    np.testing.assert_array_equal(masked["body"]["kernel"], params["body"]["kernel"])
    assert not np.array_equal(masked["head"]["kernel"], params["head"]["kernel"])
