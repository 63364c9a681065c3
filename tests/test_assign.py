import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Mlp(lm.Module):
    def __init__(self, in_size, hidden_size, out_size):
        super().__init__()
        self.layer1 = lm.Dense(in_size, hidden_size)
        self.layer2 = lm.Dense(hidden_size, out_size)

    def __call__(self, x):
        return self.layer2(lm.relu(self.layer1(x)))


def pretrained(value=1.0):
    return {
        "params": {
            "layer1": {"kernel": jnp.full((6, 5), value), "bias": jnp.full((5,), value)},
            "layer2": {"kernel": jnp.full((5, 3), value), "bias": jnp.full((3,), value)},
        }
    }


def test_assign_then_replace_head(getkey):
    model = Mlp(6, 5, 3)
    new = lm.assign_variables(model, pretrained())
    new.layer2 = lm.Dense(5, 2)
    variables = lm.transform(new).init(getkey())
    np.testing.assert_array_equal(variables["params"]["layer1"]["kernel"], np.ones((6, 5)))
    assert variables["params"]["layer2"]["kernel"].shape == (5, 2)
    # the original keeps its initializers
    original = lm.transform(model).init(getkey())
    assert not np.allclose(original["params"]["layer1"]["kernel"], 1.0)
    assert repr(model.layer1.kernel.init) == "lecun_normal()"


def test_strict_reports_missing_and_unexpected():
    partial = {
        "params": {"layer1": pretrained()["params"]["layer1"], "head": {"kernel": jnp.ones((5, 2))}}
    }
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)missing \(2\): params/layer2/bias.*unexpected \(1\): "
        r"params/head/kernel",
    ):
        lm.assign_variables(Mlp(6, 5, 3), partial)


def test_non_strict_assigns_what_matches(getkey):
    partial = {
        "params": {
            "layer1": pretrained(2.0)["params"]["layer1"],
            "head": {"kernel": jnp.ones((5, 2))},
        }
    }
    model = lm.assign_variables(Mlp(6, 5, 3), partial, strict=False, allow_unexpected=True)
    variables = lm.transform(model).init(getkey())
    np.testing.assert_array_equal(variables["params"]["layer1"]["bias"], np.full(5, 2.0))
    assert not np.allclose(variables["params"]["layer2"]["kernel"], 2.0)


@pytest.mark.parametrize("strict", [True, False])
def test_shape_mismatch_is_error_and_changes_nothing(strict):
    model = Mlp(6, 5, 2)
    with pytest.raises(
        lm.VariablesError, match=r"params/layer2/kernel: expected \(5, 2\), got \(5, 3\)"
    ):
        lm.assign_variables(model, pretrained(), strict=strict)
    assert repr(model.layer1.kernel.init) == "lecun_normal()"


def test_assign_keeps_tied_weights(getkey):
    class Tied(lm.Module):
        def __init__(self):
            self.a = lm.Dense(2, 2)
            self.b = self.a

    model = lm.assign_variables(
        Tied(), {"params": {"a": {"kernel": jnp.eye(2), "bias": jnp.zeros(2)}}}
    )
    assert model.a is model.b
    np.testing.assert_array_equal(
        lm.transform(model).init(getkey())["params"]["a"]["kernel"], np.eye(2)
    )


def test_assigned_values_survive_jit_init(getkey):
    model = lm.assign_variables(Mlp(6, 5, 3), pretrained(3.0))
    init, _ = lm.transform(model)
    variables = jax.jit(init)(getkey())
    np.testing.assert_array_equal(variables["params"]["layer2"]["bias"], np.full(3, 3.0))


def test_non_strict_still_refuses_a_misspelt_path():
    typo = {"params": {"layer_1": pretrained()["params"]["layer1"]}}
    with pytest.raises(lm.VariablesError, match=r"unexpected \(2\): params/layer_1/"):
        lm.assign_variables(Mlp(6, 5, 3), typo, strict=False)


def test_assigning_nothing_is_an_error():
    with pytest.raises(lm.VariablesError, match=r"found none of Mlp's variables"):
        lm.assign_variables(Mlp(6, 5, 3), {}, strict=False)


def test_report_lists_assigned_missing_and_unexpected():
    partial = {
        "params": {"layer1": pretrained()["params"]["layer1"], "head": {"kernel": jnp.ones(2)}}
    }
    _, report = lm.assign_variables(
        Mlp(6, 5, 3), partial, strict=False, allow_unexpected=True, return_report=True
    )
    assert report == lm.AssignReport(
        assigned=("params/layer1/bias", "params/layer1/kernel"),
        missing=("params/layer2/bias", "params/layer2/kernel"),
        unexpected=("params/head/kernel",),
    )


@pytest.mark.parametrize("bad", ["ones", None, jax.ShapeDtypeStruct((6, 5), jnp.float32)])
def test_assigning_a_non_array_is_an_error(bad):
    variables = pretrained()
    variables["params"]["layer1"]["kernel"] = bad
    if bad is None:
        with pytest.raises(lm.VariablesError, match=r"hold NoneType at params/layer1/kernel"):
            lm.assign_variables(Mlp(6, 5, 3), variables)
        return
    with pytest.raises((TypeError, lm.VariablesError), match=r"params/layer1/kernel"):
        lm.assign_variables(Mlp(6, 5, 3), variables)
