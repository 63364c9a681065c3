import re

import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Counter(lm.Module):
    def __init__(self):
        super().__init__()
        self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def __call__(self, times):
        for _ in range(times):
            self.count += 1
        return self.count.value


def test_declaration_fields():
    s = lm.State(
        "stats",
        (2, 3),
        lm.initializers.ones(),
        jnp.bfloat16,
        jnp.float32,
        mutable=True,
        tags=("a", "b"),
        sharding=("x", None),
    )
    assert s.collection == "stats"
    assert s.shape == (2, 3) and s.ndim == 2 and s.size == 6
    assert s.dtype == jnp.bfloat16 and s.param_dtype == jnp.float32
    assert s.mutable and s.tags == ("a", "b") and s.sharding == ("x", None)


def test_kinds_collections_and_mutability():
    init = lm.initializers.zeros()
    assert (lm.Parameter(3, init).collection, lm.Parameter(3, init).mutable) == ("params", False)
    assert (lm.BatchStat(3, init).collection, lm.BatchStat(3, init).mutable) == (
        "batch_stats",
        True,
    )
    assert (lm.Cache(3, init).collection, lm.Cache(3, init).mutable) == ("cache", True)
    assert lm.Parameter(3, init).shape == (3,)
    assert lm.Parameter(3, init).param_dtype == jnp.float32


def test_subclass_keeps_its_class(getkey):
    class LoRAParam(lm.Parameter):
        pass

    class M(lm.Module):
        def __init__(self):
            self.a = LoRAParam((2,), lm.initializers.zeros())

        def __call__(self):
            return type(self.a)

    init, apply = lm.transform(M())
    variables = init(getkey())
    assert set(variables) == {"params"}
    assert apply(variables)[0] is LoRAParam


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"collection": ""}, ValueError, "collection must be a non-empty string"),
        ({"collection": "a/b"}, ValueError, "without '/'"),
        ({"shape": (2, -1)}, TypeError, "non-negative ints"),
        ({"shape": "ab"}, TypeError, "non-negative ints"),
        ({"shape": 2.5}, TypeError, "tuple of ints"),
        ({"init": 3}, TypeError, "init must be a function"),
        ({"dtype": "nonsense"}, TypeError, "dtype must be a dtype"),
        ({"tags": (1,)}, TypeError, "tags must be strings"),
        ({"sharding": ("x",)}, ValueError, "one logical axis per dimension"),
    ],
)
def test_bad_declarations(kwargs, error, match):
    args = {"collection": "c", "shape": (2, 3), "init": lm.initializers.zeros()} | kwargs
    with pytest.raises(error, match=match):
        lm.State(**args)


def test_value_outside_call_explains():
    p = lm.Parameter((2,), lm.initializers.zeros())
    with pytest.raises(RuntimeError, match="no value outside init/apply"):
        _ = p.value
    with pytest.raises(lm.UnboundVariableError, match=r"lm\.transform"):
        _ = p + 1


def test_assign_value_before_transform_becomes_initializer(getkey):
    p = lm.Parameter((10, 10), lm.initializers.zeros())
    p.value = jnp.ones((10, 10))
    assert repr(p.init) == "assigned(10, 10)"

    class M(lm.Module):
        def __init__(self):
            self.p = p

    variables = lm.transform(M()).init(getkey())
    np.testing.assert_array_equal(variables["params"]["p"], np.ones((10, 10)))


@pytest.mark.parametrize(
    ("dtype", "number", "error", "match"),
    [
        (jnp.uint32, -1, ValueError, r"its values \(-1 to -1\) do not fit in uint32"),
        (
            jnp.float32,
            2**200,
            ValueError,
            r"1 finite value\(s\) \(the largest 1.6\d*e\+60\) are beyond float32",
        ),
        (jnp.int8, 1.5, TypeError, r"the cast would drop the fraction"),
    ],
)
def test_assign_a_python_number_that_does_not_fit(dtype, number, error, match):
    state = lm.State("counters", (), lm.initializers.zeros(), dtype, mutable=True)
    with pytest.raises(
        error, match=rf"cannot assign {re.escape(repr(number))} to State, stored as \w+: " + match
    ):
        state.value = number


@pytest.mark.parametrize(("dtype", "number"), [(jnp.uint32, 3_000_000_000), (jnp.float32, 2**70)])
def test_assign_a_python_number_beyond_int32_where_it_fits(dtype, number, getkey):
    class Holder(lm.Module):
        def __init__(self):
            self.s = lm.State("counters", (), lm.initializers.zeros(), dtype, mutable=True)
            self.s.value = number

        def __call__(self):
            return self.s.value

    stored = lm.transform(Holder()).init(getkey())["counters"]["s"]
    assert stored.dtype == dtype and float(stored) == float(jnp.asarray(number, dtype))


def test_assign_value_wrong_shape_names_both_shapes():
    p = lm.Parameter((784, 256), lm.initializers.zeros())
    with pytest.raises(ValueError, match=r"shape \(784, 128\).*shape \(784, 256\)"):
        p.value = jnp.zeros((784, 128))
    assert repr(p.init) == "zeros()"  # unchanged


def test_variables_act_like_arrays_inside_call(getkey):
    class M(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((3, 2), lm.initializers.ones())
            self.s = lm.Parameter((2,), lm.initializers.constant(2.0))

        def __call__(self, x):
            return {
                "matmul": x @ self.w,
                "rmul": self.s * 3.0,
                "mul": 3.0 * self.s,
                "sub": 1.0 - self.s,
                "neg": -self.s,
                "getitem": self.w[0],
                "T": self.w.T,
                "method": self.w.sum(axis=0),
                "asarray": jnp.asarray(self.s),
                "both": self.s + self.s,
                "cmp": self.s > 1.0,
            }

    init, apply = lm.transform(M())
    out, _ = apply(init(getkey()), None, jnp.ones((1, 3)))
    np.testing.assert_allclose(out["matmul"], [[3.0, 3.0]])
    np.testing.assert_allclose(out["rmul"], [6.0, 6.0])
    np.testing.assert_allclose(out["mul"], [6.0, 6.0])
    np.testing.assert_allclose(out["sub"], [-1.0, -1.0])
    np.testing.assert_allclose(out["neg"], [-2.0, -2.0])
    assert out["getitem"].shape == (2,) and out["T"].shape == (2, 3)
    np.testing.assert_allclose(out["method"], [3.0, 3.0])
    np.testing.assert_allclose(out["asarray"], [2.0, 2.0])
    np.testing.assert_allclose(out["both"], [4.0, 4.0])
    assert out["cmp"].all()


def test_inplace_update_counts(getkey):
    init, apply = lm.transform(Counter())
    variables = init(getkey())
    out, new = apply(variables, None, 2)
    assert int(out) == 2 and int(new["counters"]["count"]) == 2
    out, new = apply(new, None, 3)
    assert int(new["counters"]["count"]) == 5
    assert int(variables["counters"]["count"]) == 0  # the input is not modified


def test_state_value_update_as_in_seed(getkey):
    class MyLayer(lm.Module):
        def __init__(self, in_size, out_size):
            super().__init__()
            self.state = lm.State("some_states", (out_size,), lm.initializers.zeros(), mutable=True)

        def __call__(self, x):
            self.state.value = self.state.value + jnp.sum(x, axis=0)
            return x + self.state.value[None]

    init, apply = lm.transform(MyLayer(3, 3))
    variables = init(getkey())
    out, new = apply(variables, None, jnp.ones((2, 3)))
    np.testing.assert_allclose(new["some_states"]["state"], [2.0, 2.0, 2.0])
    np.testing.assert_allclose(out, np.full((2, 3), 3.0))


def test_writing_immutable_variable_raises(getkey):
    class M(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((2,), lm.initializers.zeros())
            self.frozen = lm.State("stats", (2,), lm.initializers.zeros())

        def __call__(self, which):
            getattr(self, which).value = jnp.ones(2)

    init, apply = lm.transform(M())
    variables = init(getkey())
    with pytest.raises(lm.ImmutableVariableError, match=r"Parameter at params/w is immutable"):
        apply(variables, None, "w")
    with pytest.raises(lm.ImmutableVariableError, match=r"stats/frozen.*mutable=True"):
        apply(variables, None, "frozen")


def test_write_wrong_shape_inside_call(getkey):
    class M(lm.Module):
        def __init__(self):
            self.s = lm.State("stats", (2,), lm.initializers.zeros(), mutable=True)

        def __call__(self):
            self.s.value = jnp.ones(3)

    init, apply = lm.transform(M())
    with pytest.raises(ValueError, match=r"shape \(3,\) to State at stats/s.*\(2,\)"):
        apply(init(getkey()))


def test_dtype_is_what_value_returns_param_dtype_what_is_stored(getkey):
    class M(lm.Module):
        def __init__(self):
            self.w = lm.Parameter((2,), lm.initializers.ones(), jnp.bfloat16, jnp.float32)
            self.s = lm.State(
                "s", (2,), lm.initializers.ones(), jnp.bfloat16, jnp.float32, mutable=True
            )

        def __call__(self):
            self.s.value = self.s.value * 2  # bfloat16 in, stored as float32
            return self.w.value

    init, apply = lm.transform(M())
    variables = init(getkey())
    assert variables["params"]["w"].dtype == jnp.float32
    out, new = apply(variables)
    assert out.dtype == jnp.bfloat16
    assert new["s"]["s"].dtype == jnp.float32


def test_array_methods_only_inside_call():
    p = lm.Parameter((2,), lm.initializers.zeros())
    with pytest.raises(AttributeError, match="no attribute 'reshape'"):
        p.reshape(1, 2)
