"""What the plan accepts: names, where submodules may live, depth, reachability, layouts."""

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina._core.graph import Plan


class Holder(lm.Module):
    def __init__(self, **attributes):
        for name, value in attributes.items():
            setattr(self, name, value)


@pytest.mark.parametrize("key", ["a/b", ""])
def test_dict_keys_that_would_collide_in_flat_names_are_rejected(key):
    model = Holder(blocks={key: lm.Dense(2, 2), "a": {"b": lm.Dense(2, 2)}})
    with pytest.raises(ValueError, match=rf"under the key {key!r}: keys name variables"):
        lm.transform(model)


def test_init_keys_differ_for_every_path(getkey):
    model = Holder(blocks={"ab": lm.Dense(2, 2), "a": {"b": lm.Dense(2, 2)}})
    params = lm.transform(model).init(getkey())["params"]["blocks"]
    assert not np.allclose(params["ab"]["kernel"], params["a"]["b"]["kernel"])


def test_class_attribute_submodule_is_an_error():
    class Model(lm.Module):
        dense = lm.Dense(2, 2)

        def __call__(self, x):
            return self.dense(x)

    with pytest.raises(TypeError, match=r"Model.dense is a Dense defined in the class body"):
        lm.transform(Model())


@pytest.mark.parametrize(
    "container",
    [
        lambda d: {d},
        lambda d: frozenset([d]),
        lambda d: collections.deque([d]),
        lambda d: collections.ChainMap({"d": d}),
    ],
    ids=["set", "frozenset", "deque", "ChainMap"],
)
def test_submodules_hidden_in_other_containers_are_errors(container):
    with pytest.raises(TypeError, match=r"where lamina cannot see it: lamina finds submodules"):
        lm.transform(Holder(hidden=container(lm.Dense(2, 2))))


def test_submodule_in_a_helper_object_is_an_error():
    @dataclasses.dataclass
    class Helper:
        dense: lm.Dense

    with pytest.raises(TypeError, match=r"helper is a Helper that holds a Dense"):
        lm.transform(Holder(helper=Helper(lm.Dense(2, 2))))


def test_a_400_deep_model_transforms_and_runs(getkey):
    class Block(lm.Module):
        def __init__(self, inner):
            self.inner = inner
            self.scale = lm.Parameter((), lm.initializers.ones())

        def __call__(self, x):
            x = x * self.scale
            return x if self.inner is None else self.inner(x)

    model = None
    for _ in range(400):
        model = Block(model)
    init, apply = lm.transform(model)
    variables = init(getkey())
    out, _ = apply(variables, None, jnp.ones(2))
    np.testing.assert_array_equal(out, np.ones(2))
    assert len(lm.summary(model).rows) == 400


def test_slots_of_follows_reachability_not_paths():
    shared = lm.Dense(2, 2)
    model = Holder(first=shared, second=Holder(tied=shared, own=lm.Dense(2, 2)))
    plan = Plan(model)
    second = [plan.variables[i].name for i in plan.slots_of(model.second)]
    assert set(second) == {
        "params/first/kernel",
        "params/first/bias",
        "params/second/own/kernel",
        "params/second/own/bias",
    }
    assert plan.slots_of(model) == tuple(range(len(plan.variables)))


def test_stored_axes_in_front_of_the_declared_shape(getkey):
    model = lm.Stack(lm.Dense(3, 3), 4)  # the plan stores the block's kernel once per copy
    init, apply = lm.transform(model)
    variables = init(getkey())
    kernels = variables["params"]["block"]["kernel"]
    assert kernels.shape == (4, 3, 3)
    assert not np.allclose(kernels[0], kernels[1])  # one draw per copy
    one_copy = {"params": {"block": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones((4, 3))}}}
    with pytest.raises(lm.VariablesError, match=r"params/block/kernel: expected \(4, 3, 3\)"):
        apply(one_copy, None, jnp.ones(3))
    assert lm.summary(model).rows[0].shape == (4, 3, 3)  # what is stored
    assert model.block.kernel.shape == (3, 3)  # the declaration is left as declared


def test_summary_counts_bytes_of_the_stored_dtype():
    # float64 is stored as float32 unless x64 is on, as JAX stores it
    dense = lm.Dense(3, 2, param_dtype=jnp.float64)
    assert dense.kernel.param_dtype == jnp.float32
    assert lm.summary(dense).totals["params"] == (8, 32)


def test_dtype_none_reads_the_stored_dtype():
    p = lm.Parameter((2,), lm.initializers.zeros(), dtype=None, param_dtype=jnp.bfloat16)
    assert p.dtype == p.param_dtype == jnp.bfloat16
    assert lm.Parameter((2,), lm.initializers.zeros(), dtype=None).dtype == jnp.float32
    with pytest.raises(TypeError, match=r"param_dtype=complex64 is complex but dtype=float32"):
        lm.Parameter((2,), lm.initializers.zeros(), param_dtype=jnp.complex64)
    with pytest.raises(TypeError, match=r"^Parameter: param_dtype must be a dtype .* got 'x'"):
        lm.Parameter((2,), lm.initializers.zeros(), dtype=None, param_dtype="x")
