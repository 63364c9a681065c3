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


class Counter(lm.Module):
    def __init__(self):
        super().__init__()
        self.steps = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def __call__(self, x):
        return x


@pytest.mark.parametrize(
    ("model", "variables", "error", "match"),
    [
        (
            lm.Dense(2, 1, use_bias=False),
            {"params": {"kernel": jnp.full((2, 1), 1 + 5j, jnp.complex64)}},
            TypeError,
            r"complex64 value to Parameter at params/kernel, stored as float32: the cast would "
            r"drop the imaginary part. Convert it explicitly \(jnp.real\(x\)",
        ),
        (
            Counter(),
            {"counters": {"steps": np.float32(2.7)}},
            TypeError,
            r"float32 value to State at counters/steps, stored as int32: the cast would drop "
            r"the fraction",
        ),
        (
            Counter(),
            {"counters": {"steps": np.array(2**40 + 5)}},
            ValueError,
            r"State at counters/steps, stored as int32: its values \(1099511627781 to "
            r"1099511627781\) do not fit in int32 .* a cast would wrap them",
        ),
    ],
)
def test_assign_refuses_a_cast_that_loses_information(model, variables, error, match):
    with pytest.raises(error, match=match):
        lm.assign_variables(model, variables)


def test_assign_casts_within_a_kind(getkey):
    variables = lm.transform(lm.assign_variables(Counter(), {"counters": {"steps": 3}})).init(
        getkey()
    )
    assert variables["counters"]["steps"].dtype == jnp.int32
    assert int(variables["counters"]["steps"]) == 3
    bf16 = lm.Dense(2, 2, param_dtype=jnp.bfloat16)
    kernel = np.full((2, 2), 1.5, np.float32)  # float32 into bfloat16: the same kind
    assigned = lm.assign_variables(bf16, {"params": {"kernel": kernel}}, strict=False)
    assert lm.transform(assigned).init(getkey())["params"]["kernel"].dtype == jnp.bfloat16


def test_value_assignment_before_transform_refuses_lossy_casts():
    dense = lm.Dense(2, 1, use_bias=False)
    with pytest.raises(TypeError, match="complex64 value to Parameter, stored as float32"):
        dense.kernel.value = jnp.ones((2, 1), jnp.complex64)


def test_assign_copies_a_numpy_array(getkey):
    array = np.ones((2, 2), np.float32)
    model = lm.assign_variables(lm.Dense(2, 2), {"params": {"kernel": array}}, strict=False)
    array[:] = 7  # the caller reuses its buffer before transforming
    kernel = lm.transform(model).init(getkey())["params"]["kernel"]
    np.testing.assert_array_equal(kernel, np.ones((2, 2)))


class StackedModel(lm.Module):
    def __init__(self):
        super().__init__()
        self.inp = lm.Dense(3, 2)
        self.blocks = lm.Stack(lm.Dense(2, 2), 4)

    def __call__(self, x):
        return self.blocks(self.inp(x))


def test_assign_to_a_stack_keeps_every_copy(getkey):
    init, apply = lm.transform(StackedModel())
    variables = init(getkey())
    whole = lm.assign_variables(StackedModel(), variables)
    again = lm.transform(whole).init(getkey())
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    partial = lm.assign_variables(
        StackedModel(), {"params": {"blocks": variables["params"]["blocks"]}}, strict=False
    )
    mixed = jax.jit(lm.transform(partial).init)(getkey())
    np.testing.assert_array_equal(
        mixed["params"]["blocks"]["block"]["kernel"],
        variables["params"]["blocks"]["block"]["kernel"],
    )
    inp = variables["params"]["inp"]["kernel"]
    assert not np.array_equal(mixed["params"]["inp"]["kernel"], inp)  # drawn afresh
    x = jnp.ones((1, 3))
    np.testing.assert_array_equal(apply(variables, None, x)[0], apply(again, None, x)[0])


def test_assign_to_a_stack_wants_the_stored_shape():
    one_copy = {"params": {"block": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}}
    expected = r"params/block/bias: expected \(3, 2\), got \(2,\)"
    with pytest.raises(lm.VariablesError, match=expected):
        lm.assign_variables(lm.Stack(lm.Dense(2, 2), 3), one_copy)


def test_assign_refuses_floats_a_narrower_dtype_turns_to_inf():
    kernel = np.full((2, 2), 1e6)
    with pytest.raises(
        ValueError,
        match=r"Parameter at params/kernel, stored as float16: 4 finite value\(s\) \(the largest "
        r"1e\+06\) are beyond float16's range \(largest 65504\)",
    ):
        lm.assign_variables(
            lm.Dense(2, 2, param_dtype=jnp.float16), {"params": {"kernel": kernel}}, strict=False
        )


class Stored(lm.Module):
    def __init__(self, dtype):
        self.s = lm.State("counters", (), lm.initializers.zeros(), dtype, mutable=True)

    def __call__(self):
        return self.s.value


@pytest.mark.parametrize(
    ("dtype", "value", "match"),
    [
        (jnp.int8, np.uint8(200), r"its values \(200 to 200\) do not fit in int8"),
        (jnp.uint8, np.int8(-1), r"its values \(-1 to -1\) do not fit in uint8"),
        (
            jnp.uint32,
            np.int32(-5),
            r"its values \(-5 to -5\) do not fit in uint32 \(0 to 4294967295",
        ),
        (
            jnp.complex64,
            np.float64(1e300),
            r"1 finite value\(s\) \(the largest 1e\+300\) are beyond complex64's range",
        ),
        (
            jnp.complex64,
            np.complex128(1e300j),
            r"1 finite .* beyond complex64's range \(each part at most",
        ),
    ],
)
def test_assign_refuses_values_beyond_the_target_range(dtype, value, match):
    with pytest.raises(
        ValueError,
        match=r"cannot assign a \w+ value to State at counters/s, stored as \w+: " + match,
    ):
        lm.assign_variables(Stored(dtype), {"counters": {"s": value}})


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(jnp.int8, np.uint8(100)), (jnp.uint8, np.int8(5)), (jnp.complex64, np.complex128(1 - 2j))],
)
def test_assign_casts_values_within_the_target_range(dtype, value, getkey):
    model = lm.assign_variables(Stored(dtype), {"counters": {"s": value}})
    stored = lm.transform(model).init(getkey())["counters"]["s"]
    assert stored.dtype == dtype and complex(stored) == complex(value)


def test_assign_flags_must_be_bools():
    with pytest.raises(
        TypeError, match=r"lm.assign_variables: strict must be True or False, got str"
    ):
        lm.assign_variables(Mlp(6, 5, 3), pretrained(), strict="no")


def test_a_dict_passed_as_a_flag_is_shown_short():
    """``assign_variables(model, v, v)``: the message names the type and a cut repr, not
    every array of the dict."""
    variables = pretrained()
    with pytest.raises(
        TypeError, match=r"strict must be True or False, got dict \{'params': .{0,100}\.\.\.\.$"
    ) as error:
        lm.assign_variables(Mlp(6, 5, 3), variables, variables)
    assert len(str(error.value)) < 200 < len(repr(variables))


@pytest.mark.parametrize("array", [np.array(["a", "b"]), np.array([None, 1], dtype=object)])
def test_assign_refuses_an_array_that_is_not_numeric(array):
    with pytest.raises(
        TypeError,
        match=r"cannot assign a \S+ value to Parameter at params/bias, stored as float32: a \S+ "
        r"array is not a numeric array",
    ):
        lm.assign_variables(lm.Dense(2, 2), {"params": {"bias": array}}, strict=False)
