"""MGUCell and SimpleCell against Flax Linen, given the same weights (Linen's init)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close, layout

B, T, IN, HID = 3, 5, 3, 4
CASES = {
    "simple": (lambda: lm.SimpleCell(IN, HID), lambda: nn.SimpleCell(HID)),
    "simple_residual": (
        lambda: lm.SimpleCell(IN, HID, residual=True),
        lambda: nn.SimpleCell(HID, residual=True),
    ),
    "mgu": (lambda: lm.MGUCell(IN, HID), lambda: nn.MGUCell(HID)),
    "mgu_no_reset": (
        lambda: lm.MGUCell(IN, HID, reset_gate=False),
        lambda: nn.MGUCell(HID, reset_gate=False),
    ),
}


def inputs():
    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (B, HID))
    return h, jax.random.normal(keys[1], (B, IN)), jax.random.normal(keys[2], (B, T, IN))


@pytest.mark.parametrize("case", sorted(CASES))
def test_cell_rnn_and_gradients_equal_linen(case):
    ours, theirs = CASES[case][0](), CASES[case][1]()
    h, x, xs = inputs()
    variables = jax.jit(theirs.init)(jax.random.key(0), h, x)
    init, apply = lm.transform(ours)
    assert layout(jax.eval_shape(init, jax.random.key(0))) == layout(variables)

    (new_h, y), _ = apply(variables, None, h, x)
    linen_h, linen_y = theirs.apply(variables, h, x)
    assert_close(new_h, linen_h)
    assert_close(y, linen_y)

    def loss_ours(v, h, x):
        return jnp.sum(jnp.sin(apply(v, None, h, x)[0][1]))

    def loss_linen(v, h, x):
        return jnp.sum(jnp.sin(theirs.apply(v, h, x)[1]))

    grads = jax.grad(loss_ours, argnums=(0, 1, 2))(variables, h, x)
    expected = jax.grad(loss_linen, argnums=(0, 1, 2))(dict(variables), h, x)
    jax.tree.map(assert_close, grads, expected)

    rnn_variables = {"params": {"cell": variables["params"]}}
    ys, _ = jax.jit(lm.transform(lm.RNN(ours)).apply)(rnn_variables, None, xs)
    assert_close(ys, nn.RNN(theirs).apply(rnn_variables, xs))


def test_default_initializers_are_linens():
    mgu = jax.jit(lm.transform(lm.MGUCell(IN, HID)).init)(jax.random.key(0))["params"]
    np.testing.assert_array_equal(mgu["if"]["bias"], np.ones(HID))  # the forget gate half open
    np.testing.assert_array_equal(mgu["in"]["bias"], np.zeros(HID))
    np.testing.assert_array_equal(mgu["hn"]["bias"], np.zeros(HID))
    cell = lm.MGUCell(IN, HID, forget_bias_init=lm.initializers.constant(2.0))
    params = lm.transform(cell).init(jax.random.key(0))["params"]
    np.testing.assert_array_equal(params["if"]["bias"], np.full(HID, 2.0))
    simple = lm.SimpleCell(IN, HID)
    assert simple.h.kernel.init == lm.initializers.orthogonal()
    assert simple.i.kernel.init == lm.initializers.lecun_normal()
    assert simple.h.bias is None and simple.activation_fn is lm.tanh


def test_bad_arguments_name_the_cell_and_option():
    with pytest.raises(TypeError, match=r"MGUCell: reset_gate"):
        lm.MGUCell(IN, HID, reset_gate="yes")
    with pytest.raises(TypeError, match=r"SimpleCell: residual"):
        lm.SimpleCell(IN, HID, residual=1)
    with pytest.raises(TypeError, match=r"MGUCell: forget_bias_init must be an initializer"):
        lm.MGUCell(IN, HID, forget_bias_init=3)
    cell = lm.SimpleCell(IN, HID)
    apply = lm.transform(cell).apply
    variables = lm.transform(cell).init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"SimpleCell\(in_size=3, hidden_size=4\) got a carry"):
        apply(variables, None, jnp.zeros((2, HID)), jnp.zeros((3, IN)))


COMPLEX_CASES = {
    "simple": (lm.SimpleCell, nn.SimpleCell),
    "gru": (lm.GRUCell, nn.GRUCell),
    "mgu": (lm.MGUCell, nn.MGUCell),
    "lstm": (lm.LSTMCell, nn.LSTMCell),
}


@pytest.mark.parametrize("case", sorted(COMPLEX_CASES))
def test_complex_inputs_with_the_default_carry_equal_linen(case):
    """dtype=None follows Linen's promotion: a complex input makes the float32 carry complex."""
    ours_cls, theirs_cls = COMPLEX_CASES[case]
    ours, theirs = ours_cls(IN, HID, dtype=None), theirs_cls(HID, dtype=None)
    keys = jax.random.split(jax.random.key(2), 2)
    xs = jax.lax.complex(
        jax.random.normal(keys[0], (B, T, IN)), jax.random.normal(keys[1], (B, T, IN))
    )
    carry = ours.initialize_carry((B,))
    assert {a.dtype for a in jax.tree.leaves(carry)} == {jnp.dtype(jnp.float32)}
    with jax.numpy_dtype_promotion("standard"):  # Linen promotes complex64 with float32
        variables = jax.jit(theirs.init)(jax.random.key(0), carry, xs[:, 0])
        linen_step = jax.jit(theirs.apply)
        expected_carry, expected = carry, []
        for t in range(T):
            expected_carry, y = linen_step(variables, expected_carry, xs[:, t])
            expected.append(y)
    expected = jnp.stack(expected, axis=1)
    assert expected.dtype == jnp.complex64

    def parts(tree):
        return jax.tree.map(lambda a: (jnp.real(a), jnp.imag(a)), tree)

    _, step = lm.transform(ours)
    (new_carry, y), _ = step(variables, None, carry, xs[:, 0])
    assert {a.dtype for a in jax.tree.leaves((new_carry, y))} == {jnp.dtype(jnp.complex64)}
    assert_close(parts(y), parts(expected[:, 0]), rtol=1e-5, atol=1e-5)
    # Over a sequence (Linen's RNN fails here: its scan's carry changes dtype), the carry is
    # complex from the first step.
    _, apply = lm.transform(lm.RNN(ours_cls(IN, HID, dtype=None), return_carry=True))
    for run in (apply, jax.jit(apply)):
        (final, ys), _ = run({"params": {"cell": variables["params"]}}, None, xs)
        assert ys.dtype == jnp.complex64
        assert_close(parts(ys), parts(expected), rtol=1e-5, atol=1e-5)
        assert_close(parts(final), parts(expected_carry), rtol=1e-5, atol=1e-5)
