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
    """Equal up to float32 reassociation and fused multiply-add (jit against eager)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


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
    np.testing.assert_allclose(value, loss(variables, x, scale=2.0)[0], rtol=1e-5, atol=1e-6)
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


# ---- filters that select nothing, arguments that are not there, integer variables ---------


def test_a_filter_that_selects_nothing_is_an_error_when_grad_is_made():
    """DiffState(0, "param") (the collection is "params") selects nothing: an error, not an
    empty gradient that leaves a fine-tuning loop training nothing."""
    with pytest.raises(
        ValueError,
        match=r"(?s)lm.grad: the filter 'param' selects no variable of Net\..*"
        r"Net holds collections batch_stats \(2\), params \(6\).*Did you mean 'params'\?",
    ):
        lm.grad(loss, MODEL, lm.DiffState(0, "param"))
    with pytest.raises(ValueError, match=r"lm.value_and_grad: the filter LayerNorm selects no"):
        lm.value_and_grad(loss, MODEL, lm.DiffState(0, lm.LayerNorm))
    variables, x = setup()
    grads = lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(0, "params"))(variables, x)
    assert sorted(grads["params"]) == ["body", "head", "norm"]


def test_a_filter_that_selects_none_of_the_variables_passed():
    variables, x = setup()
    stats = {"batch_stats": variables["batch_stats"]}

    def f(stats, params, x):
        return loss(lm.merge(stats, params), x)[0]

    with pytest.raises(
        ValueError,
        match=r"the filter Parameter selects none of the variables given in argument 0 "
        r"\(collections given: batch_stats\)\.\n  In Net it selects params/body/bias",
    ):
        lm.grad(f, MODEL)(stats, {"params": variables["params"]}, x)


def test_a_module_class_selects_its_modules_variables():
    variables, x = setup()
    grads = lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(0, lm.Dense))(variables, x)
    assert sorted(grads) == ["params"] and sorted(grads["params"]) == ["body", "head"]
    assert sorted(grads["params"]["body"]) == ["bias", "kernel"]  # Frozen, but in a Dense


@pytest.mark.parametrize("argnum", [2, -3])
def test_an_argnum_past_the_arguments(argnum):
    variables, x = setup()
    step = lm.grad(lambda v, x: loss(v, x)[0], MODEL, lm.DiffState(argnum))
    with pytest.raises(
        TypeError,
        match=rf"lm.grad: argnums DiffState\({argnum}, Parameter\) names positional argument "
        rf"{argnum}, but the function was called with 2 positional argument\(s\)\. .* must be "
        r"passed positionally",
    ):
        step(variables, x)
    with pytest.raises(TypeError, match=r"argnums 5 names positional argument 5, but"):
        lm.grad(lambda v, x: loss(v, x)[0], MODEL, 5)(variables, x)


def test_variables_passed_by_keyword():
    variables, x = setup()
    step = lm.value_and_grad(lambda v, x: loss(v, x)[0], MODEL)
    with pytest.raises(
        TypeError,
        match=r"called with 0 positional argument\(s\) and keyword arguments v, x\. The "
        r"arguments that argnums names \(variables included\) must be passed positionally",
    ):
        step(v=variables, x=x)
    step(variables, x=x)  # the others may be keywords


def test_a_negative_argnum_counts_from_the_end_as_in_jax():
    variables, x = setup()
    f = lambda x, v: loss(v, x)[0]  # noqa: E731
    close(
        lm.grad(f, MODEL, lm.DiffState(-1))(x, variables),
        lm.grad(lambda v, x: f(x, v), MODEL)(variables, x),
    )
    with pytest.raises(ValueError, match=r"name the same one of the 2 positional arguments twice"):
        lm.grad(f, MODEL, (lm.DiffState(-1), 1))(x, variables)


class Counting(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(2, 2)
        self.steps = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def __call__(self, x):
        self.steps.value = self.steps + 1
        return self.dense(x)


def test_integer_variables_selected_for_differentiation_are_named():
    model = Counting()
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    x = jnp.ones((1, 2))
    f = lambda v, x: jnp.sum(apply(v, None, x)[0])  # noqa: E731
    with pytest.raises(
        TypeError,
        match=r"lm.grad: DiffState\(0, \.\.\.\) selects variables that are not floating-point, "
        r"which have no gradient: counters/steps \(int32\)\. Leave them out of the filter: "
        r"lm.DiffState\(0, lm.All\(\.\.\., lm.Not\('counters'\)\)\)",
    ):
        lm.grad(f, model, lm.DiffState(0, ...))(variables, x)
    with pytest.raises(TypeError, match=r"counters/steps \(int32\)"):
        jax.jit(lm.grad(f, model, lm.DiffState(0, ...)))(variables, x)  # at trace time too
    suggested = lm.grad(f, model, lm.DiffState(0, lm.All(..., lm.Not("counters"))))(variables, x)
    assert sorted(suggested) == ["params"]


def test_integer_variables_beside_float_ones_of_their_collection_are_named_by_path():
    model = Counting()
    model.dense.bias = lm.Parameter((2,), lm.initializers.zeros(), jnp.int32)
    init, apply = lm.transform(model)
    variables = {"params": init(jax.random.key(0))["params"]}
    with pytest.raises(
        TypeError,
        match=r"params/dense/bias \(int32\)\. Leave them out of the filter: lm.DiffState\(0, "
        r"lm.All\(Parameter, lm.Not\(lm.PathContains\('dense/bias'\)\)\)\)",
    ):
        lm.grad(lambda v: 0.0, model)(variables)


def test_diffstate_checks_its_arguments():
    with pytest.raises(TypeError, match=r"DiffState's argnum is the position .* got '0'"):
        lm.DiffState("0")
    with pytest.raises(TypeError, match=r"got True"):
        lm.DiffState(True)
    with pytest.raises(
        TypeError, match=r"DiffState\(0, ...\): the filter function <lambda> .* takes \(v\)"
    ):
        lm.DiffState(0, lambda v: True)
    with pytest.raises(TypeError, match=r"lm.grad differentiates a function; got int 3"):
        lm.grad(3, MODEL)
    with pytest.raises(ValueError, match="argnums is empty"):
        lm.grad(loss, MODEL, ())


def test_an_argument_that_is_not_variables():
    variables, x = setup()
    f = lambda v, x: loss(v, x)[0]  # noqa: E731
    with pytest.raises(
        TypeError,
        match=r"DiffState\(0, Parameter\) differentiates the variables in positional argument 0, "
        r"a dict \{collection: \{...\}\} such as init returns; got ArrayImpl of shape \(5, 3\)\. "
        r"Argument 1 is a dict: lm.DiffState\(1, Parameter\)\?",
    ):
        lm.grad(f, MODEL)(x, variables)
