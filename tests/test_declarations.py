"""Inside a call a declaration behaves as its value, for Python and for JAX; outside, it errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Holder(lm.Module):
    """Runs `probe(self)` inside apply, with a (3, 2) kernel, an int counter and a bool flag."""

    def __init__(self, probe):
        self.kernel = lm.Parameter((3, 2), lm.initializers.constant(jnp.arange(6.0).reshape(3, 2)))
        self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)
        self.flag = lm.State("flags", (), lm.initializers.zeros(), jnp.bool_)
        self.probe = probe

    def __call__(self):
        return self.probe(self)


def run(probe, jit=False):
    init, apply = lm.transform(Holder(probe))
    variables = init(jax.random.key(0))
    return (jax.jit(apply) if jit else apply)(variables, None)


KERNEL = np.arange(6.0, dtype=np.float32).reshape(3, 2)

ARRAY_USES = {
    "relu": (lambda m: lm.relu(m.kernel - 2.0), np.maximum(KERNEL - 2, 0)),
    "jnp.sum": (lambda m: jnp.sum(m.kernel), KERNEL.sum()),
    "jnp.dot": (lambda m: jnp.dot(jnp.ones(3), m.kernel), KERNEL.sum(0)),
    "stop_gradient": (lambda m: jax.lax.stop_gradient(m.kernel), KERNEL),
    "returned": (lambda m: m.kernel, KERNEL),
    "jitted return": (lambda m: jax.jit(lambda: m.kernel)(), KERNEL),
    "vmap over rows": (lambda m: jax.vmap(lambda r: r * 2)(m.kernel), KERNEL * 2),
    "iterate": (lambda m: jnp.stack([row for row in m.kernel]), KERNEL),
    "unpack": (lambda m: (lambda a, b, c: c)(*m.kernel), KERNEL[2]),
    "numpy scalar": (lambda m: np.float32(2) * m.kernel, KERNEL * 2),
    "numpy array": (lambda m: np.ones((3, 2), np.float32) + m.kernel, KERNEL + 1),
    "eq": (lambda m: jnp.where(m.count == 0, 1, 2), 1),
    "ne": (lambda m: jnp.where(m.count != 0, 1, 2), 2),
    "setitem": (lambda m: m.count.__setitem__((), 5) or m.count.value, 5),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(ARRAY_USES))
def test_declaration_is_its_value(name, jit):
    probe, expected = ARRAY_USES[name]
    out, _ = run(probe, jit)
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_python_protocols_eagerly():
    def probe(m):
        return (
            len(m.kernel),
            int(m.count),
            float(m.kernel[0, 1]),
            bool(m.flag),
            1 if m.flag else 0,
            [1, 2, 3][m.count],
            f"{m.count}",
            divmod(m.count + 7, 2),
            2.0 in m.kernel[:, 0],
        )

    out, _ = run(probe)
    assert out[:7] == (3, 0, 1.0, False, 0, 1, "0")
    assert tuple(int(v) for v in out[7]) == (3, 1)
    assert bool(out[8])


def test_bool_of_traced_declaration_is_jax_error_not_a_silent_branch():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        run(lambda m: 1 if m.flag else 0, jit=True)


def test_hash_stays_identity_for_the_plan():
    w = lm.Parameter((2,), lm.initializers.zeros())
    assert hash(w) == object.__hash__(w)
    assert len({w, lm.Parameter((2,), lm.initializers.zeros())}) == 2


@pytest.mark.parametrize(
    "use",
    [
        lambda w: w == 0,
        lambda w: w + 1,
        lambda w: bool(w),
        lambda w: len(w),
        lambda w: list(w),
        lambda w: jnp.sum(w),
        lambda w: w[0],
        lambda w: w.sum(),
    ],
)
def test_outside_a_call_every_use_is_a_clear_error(use):
    w = lm.Parameter((2,), lm.initializers.zeros())
    with pytest.raises((lm.UnboundVariableError, AttributeError), match="outside init/apply"):
        use(w)


def test_iterating_a_declaration_outside_a_call_does_not_hang():
    w = lm.Parameter((2,), lm.initializers.zeros())
    with pytest.raises(lm.UnboundVariableError):
        for _ in w:
            pass
    with pytest.raises(lm.UnboundVariableError):
        _ = 1.0 in w
