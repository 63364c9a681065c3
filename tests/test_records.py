"""lm.sow, lm.perturb, lm.capture_intermediates and lm.probe."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close


class Mlp(lm.Module):
    """Two layers; sows and perturbs its hidden activation."""

    def __init__(self):
        self.hidden, self.out = lm.Dense(3, 4), lm.Dense(4, 2)

    def __call__(self, x):
        h = jnp.tanh(self.hidden(x))
        h = lm.perturb("h", h)
        lm.sow("h", h)
        return self.out(h)


def reference(params, x, dh=0.0):
    hidden, out = params["hidden"], params["out"]
    h = jnp.tanh(x @ hidden["kernel"] + hidden["bias"][None]) + dh
    return h, h @ out["kernel"] + out["bias"][None]


@pytest.fixture(scope="module")
def mlp():
    init, apply = lm.transform(Mlp())
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    return apply, variables, x


# --- sow ------------------------------------------------------------------------------------


def test_sow_records_only_when_the_collection_is_passed(mlp):
    apply, variables, x = mlp
    y, new = apply(variables, None, x)
    assert set(new) == {"params"}
    y2, new = apply({**variables, "intermediates": {}}, None, x)
    (h,) = new["intermediates"]["h"]
    expected_h, expected_y = reference(variables["params"], x)
    assert_close(h, expected_h)
    assert_close(y2, expected_y)
    assert_close(y, y2)


def test_sow_without_the_collection_leaves_the_program_unchanged():
    class Plain(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(3, 2)

        def __call__(self, x):
            return self.dense(x)

    class Sowing(Plain):
        def __call__(self, x):
            y = self.dense(x)
            lm.sow("y", y)
            return y

    x = jnp.ones((2, 3))
    programs = []
    for model in (Plain(), Sowing()):
        init, apply = lm.transform(model)
        variables = init(jax.random.key(0))
        programs.append(str(jax.make_jaxpr(lambda v, a=apply: a(v, None, x))(variables)))
    assert programs[0] == programs[1]


def test_sow_appends_one_record_per_call_and_works_under_jit():
    class Twice(lm.Module):
        def __init__(self):
            self.layer = Tagged()

        def __call__(self, x):
            return self.layer(self.layer(x))

    class Tagged(lm.Module):
        def __call__(self, x):
            lm.sow("seen", x)
            return x + 1

    init, apply = lm.transform(Twice())
    x = jnp.zeros((2,))
    _, new = jax.jit(apply)({**init(None), "intermediates": {}}, None, x)
    first, second = new["intermediates"]["layer"]["seen"]
    np.testing.assert_array_equal(first, [0.0, 0.0])
    np.testing.assert_array_equal(second, [1.0, 1.0])


def test_sow_reduce_and_init_functions_and_other_collections():
    class Stats(lm.Module):
        def __call__(self, x):
            for _ in range(2):
                lm.sow("total", jnp.sum(x), reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
            lm.sow("weights", x, collection="attention_weights")
            return x

    init, apply = lm.transform(Stats())
    x = jnp.arange(3.0)
    _, new = apply({"intermediates": {}}, None, x)
    assert float(new["intermediates"]["total"]) == 6.0  # 0 + 3 + 3
    assert "attention_weights" not in new
    _, new = apply({"attention_weights": {}}, None, x)
    assert set(new) == {"attention_weights"}
    np.testing.assert_array_equal(new["attention_weights"]["weights"][0], x)


def test_sow_reduces_into_records_given_back():
    apply_, variables = lm.transform(Mlp()).apply, None
    init = lm.transform(Mlp()).init
    variables = init(jax.random.key(0))
    x = jnp.ones((1, 3))
    _, first = apply_({**variables, "intermediates": {}}, None, x)
    _, second = apply_({**variables, "intermediates": first["intermediates"]}, None, x)
    assert len(second["intermediates"]["h"]) == 2


def test_records_of_nested_modules_are_under_their_paths():
    class Outer(lm.Module):
        def __init__(self):
            self.blocks = [Mlp(), Mlp()]

        def __call__(self, x):
            lm.sow("input", x)
            return self.blocks[1](self.blocks[0](x)[:, :2] @ jnp.ones((2, 3)))

    init, apply = lm.transform(Outer())
    _, new = apply({**init(jax.random.key(0)), "intermediates": {}}, None, jnp.ones((1, 3)))
    shapes = jax.tree.map(jnp.shape, new["intermediates"])
    assert shapes == {
        "input": ((1, 3),),
        "blocks": {"0": {"h": ((1, 4),)}, "1": {"h": ((1, 4),)}},
    }


def test_sow_errors():
    with pytest.raises(RuntimeError, match=r"lm\.sow runs only inside init/apply"):
        lm.sow("x", 1.0)

    class BadName(lm.Module):
        def __call__(self, x):
            lm.sow("a/b", x)
            return x

    apply = lm.transform(BadName()).apply
    with pytest.raises(ValueError, match=r"non-empty str without '/', got 'a/b'"):
        apply({"intermediates": {}}, None, jnp.ones(2))


def test_a_misspelt_collection_is_an_error_naming_what_was_unused(mlp):
    apply, variables, x = mlp
    bad = {**variables, "batch_stat": {"norm": {"mean": jnp.zeros(3)}}}
    with pytest.raises(lm.VariablesError, match=r"batch_stat/norm/mean.*'params'"):
        apply(bad, None, x)
    with pytest.raises(lm.VariablesError, match=r"'intermediates' passed to apply is not a dict"):
        apply({**variables, "intermediates": [1]}, None, x)


def test_a_record_colliding_with_a_submodule_path_is_an_error():
    class Clash(lm.Module):
        def __init__(self):
            self.child = Mlp()

        def __call__(self, x):
            lm.sow("child", x)  # the name of a submodule that records too
            return self.child(x)

    apply = lm.transform(Clash()).apply
    variables = lm.transform(Clash()).init(jax.random.key(0))
    with pytest.raises(lm.VariablesError, match=r"intermediates/child.*Rename"):
        apply({**variables, "intermediates": {}}, None, jnp.ones((1, 3)))


# --- perturb --------------------------------------------------------------------------------


def test_perturbation_gradients_are_the_gradients_of_the_intermediates(mlp):
    apply, variables, x = mlp
    _, new = apply({**variables, "perturbations": {}}, None, x)
    zeros = new["perturbations"]
    np.testing.assert_array_equal(zeros["h"], np.zeros((5, 4)))

    def loss(perturbations):
        y, _ = apply({**variables, "perturbations": perturbations}, None, x)
        return jnp.sum(y**2)

    grads = jax.jit(jax.grad(loss))(zeros)
    expected = jax.grad(lambda dh: jnp.sum(reference(variables["params"], x, dh)[1] ** 2))(
        jnp.zeros((5, 4))
    )
    assert_close(grads["h"], expected)
    # A given perturbation is added.
    y, _ = apply({**variables, "perturbations": {"h": jnp.ones((5, 4))}}, None, x)
    assert_close(y, reference(variables["params"], x, 1.0)[1])


def test_perturb_without_the_collection_returns_x_and_a_wrong_shape_is_an_error(mlp):
    apply, variables, x = mlp
    y, new = apply(variables, None, x)
    assert "perturbations" not in new
    assert_close(y, reference(variables["params"], x)[1])
    with pytest.raises(lm.VariablesError, match=r"perturbations/h has shape \(4,\).*\(5, 4\)"):
        apply({**variables, "perturbations": {"h": jnp.zeros(4)}}, None, x)


# --- capture_intermediates ---------------------------------------------------------------


def test_capture_records_every_module_call_or_the_filtered_ones(mlp):
    apply, variables, x = mlp
    _, new = lm.capture_intermediates(apply)(variables, None, x)
    records = new["intermediates"]
    h, y = reference(variables["params"], x)
    assert_close(records["__call__"][0], y)
    assert_close(records["out"]["__call__"][0], y)
    assert_close(jnp.tanh(records["hidden"]["__call__"][0]), h)
    assert_close(records["h"][0], h)  # sow records land in the same collection
    _, new = lm.capture_intermediates(apply, lm.Dense)(variables, None, x)
    assert set(new["intermediates"]) == {"hidden", "out", "h"}  # "h": the model's own sow
    _, new = lm.capture_intermediates(apply, lambda path, m: path == ("out",))(variables, None, x)
    assert set(new["intermediates"]) == {"out", "h"}
    with pytest.raises(
        TypeError,
        match=r"3 \(int\) is not a filter. A module filter is a Module class",
    ):
        lm.capture_intermediates(apply, 3)(variables, None, x)


def test_capture_records_a_subclass_calling_super_once():
    class Base(lm.Module):
        def __call__(self, x):
            return x * 2

    class Child(Base):
        def __call__(self, x):
            return super().__call__(x) + 1

    apply = lm.transform(Child()).apply
    _, new = lm.capture_intermediates(apply)({}, None, jnp.ones(2))
    (out,) = new["intermediates"]["__call__"]
    np.testing.assert_array_equal(out, [3.0, 3.0])


# --- probe ----------------------------------------------------------------------------------


def test_probe_returns_loss_records_and_perturbation_gradients(mlp):
    apply, variables, x = mlp

    def loss(y):
        return jnp.mean(y**2)

    result = lm.probe(apply, variables, None, x, loss=loss, capture=lm.Dense)
    h, y = reference(variables["params"], x)
    assert_close(result.loss, loss(y))
    assert_close(result.outputs, y)
    assert sorted(result.intermediates) == ["h", "hidden/__call__", "out/__call__"]
    assert_close(result.intermediates["h"][0], h)
    expected = jax.grad(lambda dh: loss(reference(variables["params"], x, dh)[1]))(h * 0)
    assert_close(result.gradients["h"], expected)
    with pytest.raises(lm.VariablesError, match="makes the 'intermediates'"):
        lm.probe(apply, {**variables, "intermediates": {}}, None, x, loss=loss)
    with pytest.raises(TypeError, match="loss is a function"):
        lm.probe(apply, variables, None, x, loss=3)


# --- inside lifted transforms -------------------------------------------------------------


class Block(lm.Module):
    def __init__(self):
        self.dense = lm.Dense(4, 4)

    def __call__(self, x):
        h = lm.perturb("h", jnp.tanh(self.dense(x)))
        lm.sow("h", h)
        return h


def stacked_reference(params, x, dhs):
    kernels, biases = (
        params["blocks"]["block"]["dense"]["kernel"],
        params["blocks"]["block"]["dense"]["bias"],
    )
    hs = []
    for i in range(kernels.shape[0]):
        x = jnp.tanh(x @ kernels[i] + biases[i][None]) + dhs[i]
        hs.append(x)
    return jnp.stack(hs), x


def test_records_inside_a_stack_carry_its_depth_axis():
    class Deep(lm.Module):
        def __init__(self):
            self.blocks = lm.Stack(Block(), 3)

        def __call__(self, x):
            return self.blocks(x)

    init, apply = lm.transform(Deep())
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))

    def loss(y):
        return jnp.sum(jnp.sin(y))

    result = lm.probe(apply, variables, None, x, loss=loss)
    zeros = jnp.zeros((3, 2, 4))
    hs, y = stacked_reference(variables["params"], x, zeros)
    assert_close(result.intermediates["blocks/block/h"][0], hs)
    expected = jax.grad(lambda d: loss(stacked_reference(variables["params"], x, d)[1]))(zeros)
    assert_close(result.gradients["blocks/block/h"], expected)
    # Given perturbations go back in per layer.
    dhs = jnp.broadcast_to(jnp.arange(3.0)[:, None, None], (3, 2, 4))
    out, _ = apply({**variables, "perturbations": {"blocks": {"block": {"h": dhs}}}}, None, x)
    assert_close(out, stacked_reference(variables["params"], x, dhs)[1])


def test_records_inside_vmap_carry_the_mapped_axis():
    class Ensemble(lm.Module):
        def __init__(self):
            self.members = lm.Stack(Block(), 2)

        def __call__(self, x):
            return lm.vmap(lambda m, x: m(x), in_axes=(0, None))(self.members.block, x)

    init, apply = lm.transform(Ensemble())
    variables = init(jax.random.key(0))
    x = jnp.ones((2, 4))
    result = lm.probe(apply, variables, None, x, loss=lambda y: jnp.sum(y[1] ** 2))
    h = result.intermediates["members/block/h"][0]
    assert h.shape == (2, 2, 4)
    params = variables["params"]["members"]["block"]["dense"]
    for i in range(2):
        assert_close(h[i], jnp.tanh(x @ params["kernel"][i] + params["bias"][i][None]))
    grads = result.gradients["members/block/h"]
    assert_close(grads[0], jnp.zeros((2, 4)))  # the loss reads member 1 only
    assert_close(grads[1], 2 * h[1])


def test_checkpoint_passes_records_through():
    class Remat(lm.Module):
        def __init__(self):
            self.block = Block()

        def __call__(self, x):
            return lm.checkpoint(lambda m, x: m(x))(self.block, x)

    init, apply = lm.transform(Remat())
    variables = init(jax.random.key(0))
    x = jnp.ones((2, 4))
    result = lm.probe(apply, variables, None, x, loss=jnp.sum)
    params = variables["params"]["block"]["dense"]
    h = jnp.tanh(x @ params["kernel"] + params["bias"][None])
    assert_close(result.intermediates["block/h"][0], h)
    assert_close(result.gradients["block/h"], jnp.ones_like(h))


def test_recording_inside_cond_is_an_error():
    class Branchy(lm.Module):
        def __init__(self):
            self.block = Block()

        def __call__(self, x):
            return lm.cond(True, lambda m, x: m(x), lambda m, x: x, self.block, x)

    init, apply = lm.transform(Branchy())
    variables = init(jax.random.key(0))
    with pytest.raises(lm.VariablesError, match=r"intermediates/block/h inside lm\.cond"):
        apply({**variables, "intermediates": {}}, None, jnp.ones((2, 4)))
    out, new = apply(variables, None, jnp.ones((2, 4)))  # without the request: fine
    assert out.shape == (2, 4)
    # (Records inside an RNN's cell come out with a time axis: tests/test_nn_recurrent.py.)


def test_probe_takes_python_flags_and_reuses_its_program():
    traces = []

    class Flagged(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(3, 3)

        def __call__(self, x, is_training, scale=1.0):
            traces.append(1)
            h = lm.perturb("h", self.dense(x)) * scale
            return lm.dropout(h, 0.5, is_training=is_training)

    init, apply = lm.transform(Flagged())
    variables = init(jax.random.key(0))
    for i in range(3):  # new arrays of the same shapes: one trace
        result = lm.probe(apply, variables, None, jnp.ones((2, 3)) * i, False, loss=jnp.sum)
        assert_close(result.gradients["h"], jnp.ones((2, 3)))
    first = len(traces)
    lm.probe(apply, variables, None, jnp.ones((2, 3)), False, loss=jnp.sum)
    assert len(traces) == first
    result = lm.probe(
        apply, variables, None, jnp.ones((2, 3)), is_training=False, scale=2.0, loss=jnp.sum
    )  # keywords, and a float flag: constants of the program
    assert_close(result.gradients["h"], 2 * jnp.ones((2, 3)))
    assert len(traces) > first


# --- which module records -------------------------------------------------------------------


class Tap(lm.Module):
    """Calls the function its parent hands it on its dense layer's output."""

    def __init__(self):
        self.dense = lm.Dense(4, 4)

    def __call__(self, x, hook):
        return hook(jnp.tanh(self.dense(x)))


class HandsAClosure(lm.Module):
    """Defines a recording closure and hands it to its child; the closure uses `self` or not."""

    def __init__(self, uses_self, child=None):
        self.child = Tap() if child is None else child
        self.uses_self = uses_self
        self.gain = 2.0

    def hook(self):
        if self.uses_self:

            def hook(h):
                lm.sow("h", h * self.gain)
                return lm.perturb("h", h)

        else:

            def hook(h):
                lm.sow("h", h * 2.0)
                return lm.perturb("h", h)

        return hook

    def __call__(self, x):
        return self.child(x, self.hook())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("uses_self", [False, True])
def test_a_closure_called_by_a_child_records_under_the_child(uses_self, jit):
    init, apply = lm.transform(HandsAClosure(uses_self))
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    run = jax.jit(apply) if jit else apply
    dense = variables["params"]["child"]["dense"]
    h = jnp.tanh(x @ dense["kernel"] + dense["bias"][None])
    given = {**variables, "intermediates": {}, "perturbations": {}}
    y, new = run(given, None, x)
    assert jax.tree.map(jnp.shape, new["intermediates"]) == {"child": {"h": ((2, 4),)}}
    assert_close(new["intermediates"]["child"]["h"][0], 2 * h)
    assert_close(y, h)
    # The perturbation goes back in under the child's path and is added there.
    dh = jnp.full((2, 4), 0.5)
    y, _ = run({**variables, "perturbations": {"child": {"h": dh}}}, None, x)
    assert_close(y, h + dh)


def decorated(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return method(*args, **kwargs)

    return wrapper


class Encoder(lm.Module):
    """Records in methods other than __call__: a method, a property, a decorated method."""

    def __init__(self):
        self.dense = lm.Dense(3, 3)

    def encode(this, x):  # the first parameter need not be called `self`
        lm.sow("encoded", this.dense(x))
        return this.dense(x)

    @property
    def scale(self):
        lm.sow("scale", jnp.asarray(3.0))
        return 3.0

    @staticmethod
    def double(x):
        lm.sow("doubled", 2 * x)  # no module here: the caller's module records
        return 2 * x

    @decorated
    def decode(self, x):
        lm.sow("decoded", x + 1)
        return x + 1


class Tapping:
    """A base class that is not a module: its methods are the module's methods."""

    def tap(self, x):
        lm.sow("tapped", x)
        return x


class Autoencoder(lm.Module):
    def __init__(self):
        self.encoder = TappingEncoder()

    def __call__(self, x):
        e = self.encoder.encode(x) * self.encoder.scale
        return self.encoder.tap(self.encoder.decode(self.encoder.double(e)))


class TappingEncoder(Tapping, Encoder):
    pass


@pytest.mark.parametrize("jit", [False, True])
def test_methods_other_than_call_record_under_their_module(jit):
    init, apply = lm.transform(Autoencoder())
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3))
    run = jax.jit(apply) if jit else apply
    y, new = run({**variables, "intermediates": {}}, None, x)
    records = new["intermediates"]
    dense = variables["params"]["encoder"]["dense"]
    e = x @ dense["kernel"] + dense["bias"][None]
    assert sorted(records) == ["doubled", "encoder"]
    assert sorted(records["encoder"]) == ["decoded", "encoded", "scale", "tapped"]
    assert_close(records["encoder"]["encoded"][0], e)
    assert_close(records["encoder"]["scale"][0], 3.0)
    assert_close(records["doubled"][0], 6 * e)
    assert_close(records["encoder"]["decoded"][0], 6 * e + 1)
    assert_close(records["encoder"]["tapped"][0], 6 * e + 1)
    assert_close(y, 6 * e + 1)


def late_methods():
    """A child whose __call__ and `extra` are assigned to its class after it was created."""

    class Child(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(2, 2)

        def __call__(self, x):
            return self.dense(x)

    class Parent(lm.Module):
        def __init__(self):
            self.child = Child()

        def __call__(self, x):
            return self.child.extra(self.child(x))

    def traced_call(module, x):
        y = module.dense(x)
        lm.sow("out", y)
        return 2 * y

    Child.__call__ = traced_call
    Child.extra = lambda module, x: (lm.sow("extra", x + 1), x + 1)[1]
    return Parent()


@pytest.mark.parametrize("jit", [False, True])
def test_methods_assigned_to_the_class_later_record_under_their_module(jit):
    init, apply = lm.transform(late_methods())
    variables = init(jax.random.key(0))
    x = jnp.array([1.0, -2.0])
    run = jax.jit(apply) if jit else apply
    y, new = run({**variables, "intermediates": {}}, None, x)
    dense = variables["params"]["child"]["dense"]
    h = x @ dense["kernel"] + dense["bias"]
    assert jax.tree.map(jnp.shape, new["intermediates"]) == {
        "child": {"out": ((2,),), "extra": ((2,),)}
    }
    assert_close(new["intermediates"]["child"]["out"][0], h)
    assert_close(new["intermediates"]["child"]["extra"][0], 2 * h + 1)
    assert_close(y, 2 * h + 1)


class CallingMixin:
    """A base class that is not a module, giving its module a __call__."""

    def __call__(self, x):
        return self.dense(x) * 3


class MixedIn(CallingMixin, lm.Module):
    def __init__(self):
        self.dense = lm.Dense(2, 2)


class DecoratedCall(lm.Module):
    def __init__(self):
        self.dense = lm.Dense(2, 2)

    @decorated
    def __call__(self, x):
        return self.dense(x) - 1


@pytest.mark.parametrize("jit", [False, True])
def test_capture_records_every_kind_of_module_call(jit):
    """A __call__ assigned later, inherited from a base that is not a module, or decorated."""
    model = lm.Sequential(late_methods(), MixedIn(), DecoratedCall())
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    x = jnp.array([1.0, -2.0])
    run = lm.capture_intermediates(apply, lambda path, m: len(path) == 1)
    y, new = (jax.jit(run) if jit else run)(variables, None, x)
    params = variables["params"]
    outputs = []
    for path, scale, shift in ((("child", "dense"), 2, 1), (("dense",), 3, 0), (("dense",), 1, -1)):
        dense = params[f"layers_{len(outputs)}"]
        for name in path:
            dense = dense[name]
        x = scale * (x @ dense["kernel"] + dense["bias"]) + shift
        outputs.append(x)
    records = new["intermediates"]
    assert sorted(records) == ["layers_0", "layers_1", "layers_2"]
    for index, expected in enumerate(outputs):
        (out,) = records[f"layers_{index}"]["__call__"]
        assert_close(out, expected)
    assert records["layers_0"]["child"]["out"][0].shape == (2,)  # its own sow
    assert_close(y, outputs[-1])


class Ensemble(lm.Module):
    """Runs stacked Taps under lm.vmap or lm.scan, handing them its own recording closure."""

    def __init__(self, lifted):
        self.members = lm.Stack(Tap(), 2)
        self.lifted = lifted

    def __call__(self, x):
        def hook(h):
            lm.sow("h", h * self.lifted.count("a"))  # uses self: still the child's record
            return h

        if self.lifted == "vmap":
            return lm.vmap(lambda m, x: m(x, hook), in_axes=(0, None))(self.members.block, x)
        if self.lifted == "scan":
            step = lm.scan(lambda m, c: m(c, hook), in_axes=(0, lm.Carry), out_axes=lm.Carry)
            return step(self.members.block, x)
        return self.members(x, hook)  # Stack: a scan


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lifted", ["vmap", "scan", "stack"])
def test_a_closure_called_by_a_child_inside_a_lifted_transform_records_under_it(lifted, jit):
    init, apply = lm.transform(Ensemble(lifted))
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    run = jax.jit(apply) if jit else apply
    y, new = run({**variables, "intermediates": {}}, None, x)
    gain = lifted.count("a")
    (hs,) = new["intermediates"]["members"]["block"]["h"]
    assert set(new["intermediates"]) == {"members"}
    params = variables["params"]["members"]["block"]["dense"]
    h, steps = x, []
    for i in range(2):  # vmap: each member on x; scan and Stack: one after the other
        h = jnp.tanh((x if lifted == "vmap" else h) @ params["kernel"][i] + params["bias"][i][None])
        steps.append(h)
    assert_close(hs, gain * jnp.stack(steps))
    assert_close(y, jnp.stack(steps) if lifted == "vmap" else h)


def test_recording_outside_any_method_of_the_model_is_an_error():
    model = lm.Dense(2, 2)
    apply = lm.transform(model, to_callable=lambda m: lambda x: lm.sow("x", m(x))).apply
    variables = lm.transform(model).init(jax.random.key(0))
    with pytest.raises(RuntimeError, match=r"lm\.sow\('x'\) ran while no method of a module"):
        apply({**variables, "intermediates": {}}, None, jnp.ones(2))
    out, _ = apply(variables, None, jnp.ones(2))  # without the request: nothing to record
    assert out is False
