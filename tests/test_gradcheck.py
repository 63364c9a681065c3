"""lm.check_gradients: right gradients pass, wrong ones are named, every layer passes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.layer_table import BY_NAME, IDS, LAYERS, cast_inputs

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

# ---------------------------------------------------------------------------------------------
# Models with deliberately wrong gradient rules


def _affine_forward(x, kernel, bias):
    return x @ kernel + bias[None, :], (x, kernel)


def _affine_backward(factors, residuals, g):
    x, kernel = residuals
    fx, fk, fb = factors
    return fx * (g @ kernel.T), fk * (x.T @ g), fb * jnp.sum(g, axis=0)


def make_affine(fx=1.0, fk=1.0, fb=1.0):
    """``x @ kernel + bias`` with a custom VJP whose cotangents are scaled by the factors."""

    @jax.custom_vjp
    def affine(x, kernel, bias):
        return x @ kernel + bias[None, :]

    affine.defvjp(_affine_forward, lambda res, g: _affine_backward((fx, fk, fb), res, g))
    return affine


class Affine(lm.Module):
    def __init__(self, n_in, n_out, rule):
        super().__init__()
        self.kernel = lm.Parameter((n_in, n_out), lm.initializers.lecun_normal())
        self.bias = lm.Parameter((n_out,), lm.initializers.normal(1.0))
        self.rule = rule

    def __call__(self, x):
        return self.rule(x, self.kernel.value, self.bias.value)


class Net(lm.Module):
    """layer1 (an `Affine` with the given rule), tanh, layer2 (a `Dense`)."""

    def __init__(self, rule=None):
        super().__init__()
        self.layer1 = Affine(3, 4, rule or make_affine())
        self.layer2 = lm.Dense(4, 2)

    def __call__(self, x):
        return self.layer2(jnp.tanh(self.layer1(x)))


def net(rule=None, seed=0):
    init, apply = lm.transform(Net(rule))
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((5, 3)), jnp.float32)
    return apply, init(jax.random.key(seed)), x


NET_NAMES = (
    "params/layer1/bias",
    "params/layer1/kernel",
    "params/layer2/bias",
    "params/layer2/kernel",
    "inputs[0]",
)


def failure(call):
    """The message of the AssertionError that `call()` raises."""
    with pytest.raises(AssertionError) as info:
        call()
    return str(info.value)


def blamed(message):
    """The names in the message's first line: ``... for a, b:``."""
    return message.splitlines()[0].split(" finite differences for ")[1].rstrip(":").split(", ")


# ---------------------------------------------------------------------------------------------
# The helper


def test_right_gradients_pass_and_the_checked_arrays_are_returned():
    apply, variables, x = net()
    assert lm.check_gradients(apply, variables, None, x) == NET_NAMES


@pytest.mark.parametrize(
    ("factors", "wrong"),
    [
        ((1.0, 1.0, 0.5), "params/layer1/bias"),
        ((1.0, -1.0, 1.0), "params/layer1/kernel"),
        ((1.1, 1.0, 1.0), "inputs[0]"),
    ],
)
def test_a_wrong_rule_is_blamed_on_its_array_alone(factors, wrong):
    apply, variables, x = net(make_affine(*factors))
    message = failure(lambda: lm.check_gradients(apply, variables, None, x))
    assert blamed(message) == [wrong]
    assert re.search(
        re.escape(wrong) + r": along (the autodiff gradient|a random direction[\w ]*) the "
        r"derivative is \S+ by autodiff \(rev\) and \S+ by finite differences; difference \S+ > "
        r"tolerance \S+ \(float32: atol 0.001 x scale \S+ \+ rtol 0.002 x \|numerical\|; "
        r"eps 0.001\)",
        message,
    )
    with pytest.raises(AssertionError, match=re.escape(f"finite differences for {wrong}:")):
        lm.check_gradients(apply, variables, None, x)


def test_a_gradient_missing_one_element_is_caught_off_the_gradient_direction():
    """Along the (wrong) gradient itself the two agree; a direction orthogonal to it differs."""
    one_missing = np.ones((3, 4), np.float32)
    one_missing[1, 2] = 0.0
    apply, variables, x = net(make_affine(fk=jnp.asarray(one_missing)))
    message = failure(lambda: lm.check_gradients(apply, variables, None, x))
    assert blamed(message) == ["params/layer1/kernel"]
    assert "along a random direction orthogonal to it" in message


def test_every_wrong_array_is_named_at_once():
    apply, variables, x = net(make_affine(0.0, 1.0, 2.0))
    message = failure(lambda: lm.check_gradients(apply, variables, None, x))
    assert blamed(message) == ["params/layer1/bias", "inputs[0]"]
    assert message.count("(float32: atol 0.001 x scale") == 2


def test_a_wrong_input_rule_passes_when_inputs_are_not_checked():
    apply, variables, x = net(make_affine(fx=0.0))
    assert lm.check_gradients(apply, variables, None, x, inputs=False) == NET_NAMES[:4]


class TwoInputs(lm.Module):
    """Takes a dict of two arrays and an array; the rule for ``pair["b"]`` is wrong."""

    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 2)

    def __call__(self, pair, z):
        return self.dense(pair["a"] * wrong_square(pair["b"]) + z)


@jax.custom_jvp
def wrong_square(x):
    return x * x


wrong_square.defjvp(lambda primals, tangents: (primals[0] ** 2, primals[0] * tangents[0]))


def test_inputs_may_be_pytrees_and_are_named_by_their_position_and_keys():
    init, apply = lm.transform(TwoInputs())
    variables = init(jax.random.key(0))
    rng = np.random.default_rng(0)
    pair = {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal((4, 3))}
    pair = {k: jnp.asarray(v, jnp.float32) for k, v in pair.items()}
    z = jnp.ones((4, 3))
    message = failure(lambda: lm.check_gradients(apply, variables, None, pair, z))
    assert blamed(message) == ["inputs[0]['b']"]
    # only the input at position 1: nothing wrong there
    names = lm.check_gradients(apply, variables, None, pair, z, wrt=None, inputs=(1,))
    assert names == ("inputs[1]",)
    names = lm.check_gradients(apply, variables, None, pair, z, inputs=[-1])
    assert names == ("params/dense/bias", "params/dense/kernel", "inputs[1]")


@jax.custom_jvp
def sin_with_flat_derivative(x):
    return jnp.sin(x)


# the first derivative is right; its own derivative is not (stop_gradient makes it constant)
sin_with_flat_derivative.defjvp(
    lambda p, t: (jnp.sin(p[0]), jax.lax.stop_gradient(jnp.cos(p[0])) * t[0])
)


class Wave(lm.Module):
    def __init__(self, rule):
        super().__init__()
        self.frequency = lm.Parameter((3,), lm.initializers.normal(1.0))
        self.dense = lm.Dense(3, 2)
        self.rule = rule

    def __call__(self, x):
        return self.dense(self.rule(x * self.frequency.value[None, :]))


@pytest.mark.parametrize("modes", [("rev",), ("fwd",), ("fwd", "rev")])
def test_second_order(modes):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    init, apply = lm.transform(Wave(jnp.sin))
    variables = init(jax.random.key(0))
    lm.check_gradients(apply, variables, None, x, order=2, modes=modes)
    init, apply = lm.transform(Wave(sin_with_flat_derivative))
    assert len(lm.check_gradients(apply, variables, None, x, modes=modes)) == 4
    message = failure(lambda: lm.check_gradients(apply, variables, None, x, order=2, modes=modes))
    assert "(order 2: the derivative of <grad, w>)" in message
    assert "params/frequency" in blamed(message)
    assert "params/dense/bias" not in blamed(message)  # linear in the bias: nothing to get wrong
    for mode in modes:
        assert f"by autodiff ({mode})" in message


def test_forward_mode_checks_jvp_rules():
    x = jnp.ones((4, 3))
    init, apply = lm.transform(TwoInputs())
    variables = init(jax.random.key(0))
    pair = {"a": x, "b": 0.5 * x}
    message = failure(lambda: lm.check_gradients(apply, variables, None, pair, x, modes="fwd"))
    assert blamed(message) == ["inputs[0]['b']"] and "by autodiff (fwd)" in message


class Counting(lm.Module):
    """Batch statistics, dropout and an integer counter, all in one call."""

    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 4)
        self.norm = lm.BatchNorm(4)
        self.drop = lm.Dropout(0.5)
        self.steps = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def __call__(self, x, *, is_training):
        self.steps.value = self.steps + 1
        return self.drop(self.norm(self.dense(x), is_training=is_training), is_training=is_training)


def test_mutable_collections_dropout_and_integer_variables():
    init, apply = lm.transform(Counting())
    variables = init(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 3)), jnp.float32)
    key = jax.random.key(1)
    everything = ("batch_stats", "counters", "params")
    # the same key on every evaluation: one dropout mask; the new statistics are ignored
    names = lm.check_gradients(apply, variables, key, x, wrt=everything, is_training=True)
    assert "params/dense/kernel" in names and "inputs[0]" in names
    assert "counters/steps" not in names  # an integer: skipped
    # in evaluation the running statistics are inputs of the output: their gradients count
    names = lm.check_gradients(apply, variables, key, x, wrt="batch_stats", is_training=False)
    assert names == ("batch_stats/norm/mean", "batch_stats/norm/var", "inputs[0]")


def test_integer_inputs_are_skipped():
    model = lm.Sequential(lm.Embed(10, 4), lm.Dense(4, 2))
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    ids = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    names = lm.check_gradients(apply, variables, None, ids)
    assert names == ("params/layers_0/embedding", "params/layers_1/bias", "params/layers_1/kernel")


def test_a_mask_selects_variables():
    apply, variables, x = net()
    model = Net()
    only = lm.mask(model, variables, lm.PathContains("layer2"))
    names = lm.check_gradients(apply, variables, None, x, wrt=only, inputs=False)
    assert names == ("params/layer2/bias", "params/layer2/kernel")
    prefix = {"params": {"layer1": {"kernel": True}, "layer2": False}}
    names = lm.check_gradients(apply, variables, None, x, wrt=prefix, inputs=False)
    assert names == ("params/layer1/kernel",)


def test_a_loss_of_ones_own():
    apply, variables, x = net(make_affine(fb=0.5))
    squares = lambda y: jnp.sum(y**2)  # noqa: E731
    lm.check_gradients(
        apply,
        variables,
        None,
        x,
        loss=squares,
        wrt=lm.mask(Net(), variables, lm.PathContains("layer2")),
    )
    with pytest.raises(AssertionError, match=re.escape("for params/layer1/bias:")):
        lm.check_gradients(apply, variables, None, x, loss=squares)


def test_float64_catches_what_float32_cannot():
    """A rule wrong by 1e-3: within float32's tolerance, far outside float64's."""
    apply, variables, x = net(make_affine(fk=1.001))
    lm.check_gradients(apply, variables, None, x)
    with jax.enable_x64(True):
        model = Net(make_affine(fk=1.001))
        model.layer1.kernel = lm.Parameter((3, 4), lm.initializers.lecun_normal(), jnp.float64)
        model.layer1.bias = lm.Parameter((4,), lm.initializers.normal(1.0), jnp.float64)
        model.layer2 = lm.Dense(4, 2, dtype=jnp.float64)
        init, apply = lm.transform(model)
        variables = init(jax.random.key(0))
        x64 = jnp.asarray(x, jnp.float64)
        message = failure(lambda: lm.check_gradients(apply, variables, None, x64))
        assert blamed(message) == ["params/layer1/kernel"] and "(float64: atol 1e-08" in message


def test_16_bit_models_get_16_bit_tolerances():
    model = lm.Sequential(lm.Dense(3, 4, dtype=jnp.bfloat16), jnp.tanh, lm.Dense(4, 2))
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)), jnp.float32)
    lm.check_gradients(apply, variables, None, x)
    message = failure(lambda: lm.check_gradients(apply, variables, None, x, atol=0.0, rtol=0.0))
    assert "(bfloat16: atol 0 x scale" in message and "eps 0.03)" in message


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"wrt": "param"}, ValueError, r"wrt names 'param', which .* Did you mean 'params'\?"),
        ({"wrt": 3}, TypeError, r"wrt is a collection name"),
        ({"wrt": {"params": {"layer3": True}}}, ValueError, r"mask names params/layer3"),
        ({"wrt": {"params": {"layer1": 1}}}, TypeError, r"mask holds int 1 at params/layer1"),
        ({"inputs": (1,)}, ValueError, r"position\(s\) 1, but .* given 1 positional input"),
        ({"inputs": "x"}, TypeError, r"inputs is True"),
        ({"wrt": None, "inputs": False}, ValueError, r"nothing to check: no variable selected"),
        ({"order": 0}, ValueError, r"order is the highest order .* got 0"),
        ({"modes": ("backward",)}, ValueError, r"modes is 'rev' .* got \('backward',\)"),
        ({"modes": ()}, ValueError, r"modes is 'rev'"),
        ({"eps": 0.0}, ValueError, r"eps must be a finite number > 0; got 0.0"),
        ({"atol": -1.0}, ValueError, r"atol must be a finite number >= 0; got -1.0"),
        ({"rtol": "x"}, TypeError, r"rtol is a number >= 0; got 'x'"),
        ({"seed": -1}, TypeError, r"seed is an int >= 0"),
        ({"loss": 3}, TypeError, r"loss must be a function"),
        ({"loss": lambda y: y}, TypeError, r"loss must return a float scalar; .* shape \(5, 2\)"),
    ],
)
def test_argument_errors(options, error, match):
    apply, variables, x = net()
    with pytest.raises(error, match=match):
        lm.check_gradients(apply, variables, None, x, **options)


def test_errors_about_the_model():
    apply, variables, x = net()
    with pytest.raises(TypeError, match=r"checks a transformed model's apply function; got Net"):
        lm.check_gradients(Net(), variables, None, x)
    init, apply_ids = lm.transform(lm.Embed(10, 4), to_callable=lambda m: lambda i: i + 1)
    ids = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match=r"outputs hold no floating-point array \(int32\[2\]\)"):
        lm.check_gradients(apply_ids, init(jax.random.key(0)), None, ids)
    init, apply_embed = lm.transform(lm.Embed(10, 4))
    with pytest.raises(ValueError, match=r"nothing to check: .* never checked"):
        lm.check_gradients(apply_embed, init(jax.random.key(0)), None, ids, wrt=None)


# ---------------------------------------------------------------------------------------------
# Every layer of the table, in float32 (float64 is `test_layers_common`'s finite-difference test)

# Which variables are checked, where not just "params", and why.
WRT = {
    "batch_norm_eval": (
        ("params", "batch_stats"),
        "in evaluation the running mean and variance are inputs of the output",
    ),
}

# Layers whose check needs something said. None needs other tolerances or is left out: at
# float32's step (1e-3 of the array's scale) no step of the table's inputs crosses a kink.
NOTES = {
    "embed": "its input is integer ids: skipped, the embedding table is checked",
    "max_pool": "piecewise linear; standard normal inputs have no ties a step would cross",
    "min_pool_int_window": "as max_pool",
    "dropout": "the same key on every evaluation: one mask, so a piecewise-linear function",
    "attention_self": "the key bias has a zero gradient (softmax ignores a shift): the absolute "
    "tolerance, relative to the loss's scale, takes the rounding noise",
}


def draw_variables(init, rng):
    """Variables of `init`'s shapes, drawn with NumPy rather than by `init`.

    The table's initializers compile once per shape (half a minute for the table); gradients
    are checked at any point, and a random one (no zero biases, no zero LoRA factor) shows
    more. Batch norm's running variance is drawn positive.
    """

    def draw(path, shape):
        if not jnp.issubdtype(shape.dtype, jnp.floating):
            return jnp.zeros(shape.shape, shape.dtype)
        if path[-1].key == "var":
            return jnp.asarray(rng.uniform(0.5, 1.5, shape.shape), shape.dtype)
        return jnp.asarray(0.5 * rng.standard_normal(shape.shape), shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(init, jax.random.key(0)))


def test_the_notes_are_about_table_entries():
    assert set(NOTES) | set(WRT) <= set(BY_NAME)


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_every_layer_passes(case):
    init, apply = lm.transform(case.make(jnp.float32, None), to_callable=case.to_callable)
    variables = draw_variables(init, np.random.default_rng(0))
    inputs = cast_inputs(case.inputs(np.random.default_rng(0), np.float32), jnp.float32)
    rngs = jax.random.key(1) if case.needs_rng else None
    wrt, _ = WRT.get(case.name, ("params", "the parameters alone"))
    names = lm.check_gradients(apply, variables, rngs, *inputs, wrt=wrt, **case.kwargs)
    collections = (wrt,) if isinstance(wrt, str) else wrt
    expected_variables = [
        "/".join(str(k.key) for k in path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]
        if path[0].key in collections and jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    float_inputs = [
        leaf for leaf in jax.tree.leaves(inputs) if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    assert names[: len(expected_variables)] == tuple(expected_variables)
    assert len(names) == len(expected_variables) + len(float_inputs)
    assert bool(float_inputs) == case.differentiable_inputs


# Second derivatives and forward mode on a few smooth layers of each family (all the table's
# layers pass both; every one of them would double the time of this file).
HIGHER = ["conv1d", "layer_norm", "gru_cell", "sequential", "dot_product_attention"]


@pytest.mark.parametrize("name", HIGHER)
def test_second_order_and_forward_mode_on_smooth_layers(name):
    case = BY_NAME[name]
    init, apply = lm.transform(case.make(jnp.float32, None), to_callable=case.to_callable)
    variables = draw_variables(init, np.random.default_rng(0))
    inputs = cast_inputs(case.inputs(np.random.default_rng(0), np.float32), jnp.float32)
    lm.check_gradients(apply, variables, None, *inputs, order=2, modes=("fwd", "rev"))


# ---------------------------------------------------------------------------------------------
# Non-differentiable points: told apart from wrong derivatives by the one-sided differences


def kinked(*layers, n_in=3):
    """``Dense(n_in, 4)`` (zero bias) then `layers`, at zero inputs: the Dense outputs exact 0."""
    init, apply = lm.transform(lm.Sequential(lm.Dense(n_in, 4), *layers))
    return apply, init(jax.random.key(0)), jnp.zeros((5, n_in), jnp.float32)


NOT_DIFFERENTIABLE = r"the model looks non-differentiable at this point for "


def _switch(y):
    return jnp.where(y > 0, 1.0 + y, y)  # a jump at 0


def _tied_max(y):
    return jnp.where(y[:, :2] >= y[:, 2:], y[:, :2], y[:, 2:])  # max of equal values, by a switch


@pytest.mark.parametrize("modes", [("rev",), ("fwd",)])
@pytest.mark.parametrize("layer", [lm.relu, _switch, _tied_max], ids=["relu", "where", "max"])
def test_a_non_differentiable_point_is_not_blamed_on_autodiff(layer, modes):
    apply, variables, x = kinked(layer, lm.Dense(2 if layer is _tied_max else 4, 2))
    for function in (apply, jax.jit(apply)):
        with pytest.raises(AssertionError, match=NOT_DIFFERENTIABLE) as info:
            lm.check_gradients(function, variables, None, x, modes=modes)
        message = str(info.value)
        assert "autodiff disagrees" not in message
        names = message.splitlines()[0].split(" for ")[1].split(" (")[0].split(", ")
        assert "params/layers_0/bias" in names and "inputs[0]" in names
        slopes = re.search(
            r"params/layers_0/bias: along [\w ]+ the slope is (\S+) from above \(x \+ h v\) and "
            r"(\S+) from below \(x - h v\) by one-sided finite differences; they differ by "
            rf"\S+, more than autodiff \({modes[0]}: \S+\) differs from the central difference",
            message,
        )
        assert slopes is not None
        assert abs(float(slopes[1]) - float(slopes[2])) > 0.01
        assert "Check at another point" in message and "wrt=" in message and "inputs=" in message
    # The same model at a generic point (no tie within a step: seed 0 has one) passes.
    generic = jnp.asarray(np.random.default_rng(1).standard_normal((5, 3)), jnp.float32)
    assert lm.check_gradients(apply, variables, None, generic, modes=modes)[-1] == "inputs[0]"


def test_the_one_sided_slopes_of_a_relu_at_zero_are_its_two_sides():
    """relu(x) at x = 0 along v: slope v from one side, 0 from the other; autodiff says 0."""
    init, apply = lm.transform(lm.Sequential(lm.relu))
    with pytest.raises(AssertionError, match=NOT_DIFFERENTIABLE + r"inputs\[0\]") as info:
        lm.check_gradients(apply, {}, None, jnp.zeros((1,)), loss=lambda y: jnp.sum(y))
    found = re.search(
        r"the slope is (\S+) from above .* and (\S+) from below .*autodiff \(rev: (\S+)\) differs "
        r"from the central difference \((\S+)\)",
        str(info.value),
    )
    above, below, autodiff, central = map(float, found.groups())
    assert min(above, below) == 0.0 == autodiff and max(above, below) > 0.01
    assert central == pytest.approx(max(above, below) / 2, rel=1e-3)  # the mean of the two


def test_a_kink_within_a_step_of_the_point_is_found_too():
    """Just above relu's kink the steps below cross it (the direction is 0.126 x, h = 1e-3)."""
    init, apply = lm.transform(lm.Sequential(lm.relu))
    x = jnp.full((1,), 1e-4, jnp.float32)
    with pytest.raises(AssertionError, match=NOT_DIFFERENTIABLE + r"inputs\[0\]"):
        lm.check_gradients(apply, {}, None, x, loss=lambda y: jnp.sum(y))
    lm.check_gradients(apply, {}, None, x + 1e-2, loss=lambda y: jnp.sum(y))


def test_a_wrong_rule_at_a_smooth_point_is_still_blamed_on_autodiff_beside_a_kink():
    """A relu at 0 feeding an affine map whose bias rule is wrong: two messages, each its own."""
    apply, variables, x = kinked(lm.relu, Affine(4, 2, make_affine(fb=0.5)))
    for function in (apply, jax.jit(apply)):
        message = failure(lambda f=function: lm.check_gradients(f, variables, None, x))
        first, *_ = message.splitlines()
        assert first == (
            "lm.check_gradients: autodiff disagrees with finite differences for "
            "params/layers_2/bias:"
        )
        assert re.search(
            NOT_DIFFERENTIABLE + r"params/layers_0/bias, inputs\[0\] \(a relu or abs at 0", message
        )
        assert "params/layers_2/kernel" not in message  # its input is relu(0) = 0: nothing to see
    # wrt= leaves the non-differentiable arrays out; the wrong rule is still caught.
    mask = {"params": {"layers_0": False, "layers_2": True}}
    message = failure(lambda: lm.check_gradients(apply, variables, None, x, wrt=mask, inputs=False))
    assert blamed(message) == ["params/layers_2/bias"] and "non-differentiable" not in message


def test_a_wrong_rule_is_not_mistaken_for_a_kink():
    """Wrong rules (a scale, a sign, a missing term) at smooth points are blamed on autodiff."""
    for factors in ((1.0, 1.0, 0.5), (1.0, -1.0, 1.0), (1.1, 1.0, 1.0), (0.0, 1.0, 2.0)):
        apply, variables, x = net(make_affine(*factors))
        message = failure(lambda a=apply, v=variables, x=x: lm.check_gradients(a, v, None, x))
        assert "non-differentiable" not in message, message


def test_a_kink_of_the_derivative_spoils_central_differences_and_is_said_so():
    """y * relu(y) at y = 0: autodiff and both one-sided slopes say 0; the central does not."""
    apply, variables, x = kinked(lambda y: y * lm.relu(y), lm.Dense(4, 2))
    for order in (1, 2):
        with pytest.raises(AssertionError, match=NOT_DIFFERENTIABLE) as info:
            lm.check_gradients(apply, variables, None, x, order=order)
        assert re.search(
            r"params/layers_0/bias: along [\w ]+ the slope is 0 from above \(x \+ h v\) and 0 "
            r"from below \(x - h v\) by one-sided finite differences, as by autodiff \(rev: 0\), "
            r"but \S+ by central differences: the model's derivative looks non-differentiable",
            str(info.value),
        )
        assert "autodiff disagrees" not in str(info.value)
    generic = jnp.asarray(np.random.default_rng(1).standard_normal((5, 3)), jnp.float32)
    lm.check_gradients(apply, variables, None, generic, order=2)
