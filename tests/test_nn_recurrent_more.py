"""OptimizedLSTMCell, ConvLSTMCell, Bidirectional, the cells' dtypes and RNN's per-call options.

Each against Flax Linen given the same weights (Linen's init): outputs, final carries and
gradients with respect to the variables, the carry and the input. Small shapes, one compiled
Linen program per test.
"""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import abstract_init, assert_close, layout, normal

B, T, IN, HID = 2, 5, 3, 4


def linen_call(module, method=None):
    """Linen's `apply` of `module`, compiled once."""
    return jax.jit(lambda v, *a, **k: module.apply(v, *a, method=method, **k))


def lamina_call(module):
    return jax.jit(lm.transform(module).apply)


def loss(outputs):
    return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(outputs))


def assert_grads_equal(ours, theirs, variables, *inputs):
    """Gradients of the same loss through both, w.r.t. the variables and every input."""
    argnums = tuple(range(1 + len(inputs)))
    got = jax.grad(lambda v, *a: loss(ours(v, None, *a)[0]), argnums)(variables, *inputs)
    expected = jax.grad(lambda v, *a: loss(theirs(v, *a)), argnums)(variables, *inputs)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def zero_variables(module):
    """Zeros in the layout of `module`'s variables: for calls that fail before computing."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_init(module))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def lstm_inputs(rng, batch=(B,)):
    carry = (normal(rng, *batch, HID), normal(rng, *batch, HID))
    return carry, normal(rng, *batch, IN)


# ------------------------------------------------------------------------- OptimizedLSTMCell


def test_optimized_lstm_cell_equals_linens_and_lstm_cell(rng):
    carry, x = lstm_inputs(rng)
    theirs = nn.OptimizedLSTMCell(HID)
    variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
    # Linen's two LSTM cells have the same variables, and the same values from the same key:
    # the "conversion" between them is the identity, in Linen and here.
    linen_lstm = jax.jit(nn.LSTMCell(HID).init)(jax.random.key(0), carry, x)
    assert_close(linen_lstm, variables, rtol=0, atol=0)
    ours = lm.OptimizedLSTMCell(IN, HID)
    assert layout(abstract_init(ours)) == layout(variables)
    assert layout(abstract_init(lm.LSTMCell(IN, HID))) == layout(variables)

    expected = linen_call(theirs)(variables, carry, x)
    got, _ = lamina_call(ours)(variables, None, carry, x)
    assert_close(got, expected)
    unfused, _ = lamina_call(lm.LSTMCell(IN, HID))(variables, None, carry, x)
    assert_close(got, unfused)
    assert_grads_equal(lamina_call(ours), linen_call(theirs), variables, carry, x)

    # Inside RNN, with sequence lengths and the final carry, against Linen's RNN.
    xs, lengths = normal(rng, B, T, IN), jnp.array([T, 3])
    rnn_variables = {"params": {"cell": variables["params"]}}
    got = lamina_call(lm.RNN(ours, return_carry=True))(
        rnn_variables, None, xs, seq_lengths=lengths
    )[0]
    expected = linen_call(nn.RNN(theirs, return_carry=True))(rnn_variables, xs, seq_lengths=lengths)
    assert_close(got, expected)


def test_optimized_lstm_cell_fuses_the_gate_products():
    """Two matrix products per step instead of eight: the point of the cell."""
    carry, x = (jnp.zeros((B, HID)),) * 2, jnp.zeros((B, IN))

    def count(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name == "dot_general"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                total += count(sub)
        return total

    def products(cell):
        init, apply = lm.transform(cell)
        return count(jax.make_jaxpr(apply)(init(jax.random.key(0)), None, carry, x).jaxpr)

    assert products(lm.OptimizedLSTMCell(IN, HID)) == 2
    assert products(lm.LSTMCell(IN, HID)) == 8


# ------------------------------------------------------------------------------ cell dtypes


# The cells share the mechanism (`step_dtype`): one with a carry pair, one with one array.
@pytest.mark.parametrize("kind", ["OptimizedLSTMCell", "GRUCell"])
def test_cells_infer_the_dtype_as_linen_and_compute_complex(rng, kind):
    """``dtype=None``: Linen's promotion (here complex64, from complex variables and input)."""
    lstm = "LSTM" in kind
    theirs = getattr(nn, kind)(HID, param_dtype=jnp.complex64)
    ours = getattr(lm, kind)(IN, HID, dtype=None, param_dtype=jnp.complex64)

    def complex_normal(*shape):
        return jnp.asarray(
            rng.standard_normal(shape) + 1j * rng.standard_normal(shape), "complex64"
        )

    h = complex_normal(B, HID)
    carry = (complex_normal(B, HID), h) if lstm else h
    x = complex_normal(B, IN)
    variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
    assert layout(abstract_init(ours)) == layout(variables)
    got, _ = lamina_call(ours)(variables, None, carry, x)
    expected = linen_call(theirs)(variables, carry, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.complex64)}

    def parts(tree):
        return jax.tree.map(lambda a: (jnp.real(a), jnp.imag(a)), tree)

    assert_close(parts(got), parts(expected), rtol=1e-4, atol=1e-5)

    # A complex input on a real carry makes the carry complex, as Linen's standard promotion
    # (never a cast that drops the imaginary part): tests/test_nn_cells_more.py compares each
    # cell with Linen.
    real = lm.transform(getattr(lm, kind)(IN, HID, dtype=None))
    real_variables = jax.tree.map(jnp.real, variables)
    real_carry = jax.tree.map(jnp.real, carry)
    got, _ = real.apply(real_variables, None, real_carry, x)
    with jax.numpy_dtype_promotion("standard"):  # Linen promotes complex with float32
        expected = linen_call(getattr(nn, kind)(HID))(real_variables, real_carry, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.complex64)}
    assert_close(parts(got), parts(expected), rtol=1e-4, atol=1e-5)
    # ... and under a real dtype, the complex input itself is the error.
    explicit = lm.transform(getattr(lm, kind)(IN, HID))
    with pytest.raises(TypeError, match=r"got a complex64 value but computes in float32"):
        explicit.apply(real_variables, None, real_carry, x)


def test_bfloat16_gates_keep_a_float32_carry_as_linen(rng):
    carry, x = lstm_inputs(rng)
    theirs = nn.OptimizedLSTMCell(HID, dtype=jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):  # Linen mixes bfloat16 gates, float32 carry
        variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
        expected = linen_call(theirs)(variables, carry, x)
    # float32 parameters (Linen's default param_dtype) computed in bfloat16
    cell = lm.OptimizedLSTMCell(IN, HID, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    got, _ = lamina_call(cell)(variables, None, carry, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_close(got, expected, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- ConvLSTMCell

SPATIAL = (4, 5)


@pytest.mark.parametrize(
    ("options", "spatial"),
    [
        ({"kernel_size": (3, 3)}, SPATIAL),
        ({"kernel_size": (2,), "padding": ((1, 0),), "use_bias": False}, (6,)),
    ],
    ids=["2d_same", "1d_pairs_nobias"],
)
def test_conv_lstm_cell_and_rnn_equal_linen(rng, options, spatial):
    theirs = nn.ConvLSTMCell(HID, **options)
    ours = lm.ConvLSTMCell(IN, HID, **options)
    carry = (normal(rng, B, *spatial, HID), normal(rng, B, *spatial, HID))
    x = normal(rng, B, *spatial, IN)
    variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
    assert layout(abstract_init(ours)) == layout(variables)
    assert ours.num_feature_axes == theirs.num_feature_axes == len(spatial) + 1

    got, _ = lamina_call(ours)(variables, None, carry, x)
    assert_close(got, linen_call(theirs)(variables, carry, x))
    assert_grads_equal(lamina_call(ours), linen_call(theirs), variables, carry, x)
    zeros = ours.initialize_carry((B, *spatial))
    expected_zeros = theirs.initialize_carry(jax.random.key(0), x.shape)
    assert_close(zeros, expected_zeros, rtol=0, atol=0)

    # RNN over (batch, time, *spatial, channels), with the carry after each last valid step.
    xs, lengths = normal(rng, B, 3, *spatial, IN), jnp.array([3, 2])
    rnn_variables = {"params": {"cell": variables["params"]}}
    ours_rnn = lamina_call(lm.RNN(ours, return_carry=True))
    theirs_rnn = linen_call(nn.RNN(theirs, return_carry=True))
    got = ours_rnn(rnn_variables, None, xs, seq_lengths=lengths)[0]
    assert_close(got, theirs_rnn(rnn_variables, xs, seq_lengths=lengths))


def test_conv_lstm_cell_errors():
    where = r"ConvLSTMCell\(in_size=3, hidden_size=4, kernel_size=\(3, 3\)\)"
    with pytest.raises(ValueError, match=where + r": strides=2 would shrink the spatial axes"):
        lm.ConvLSTMCell(IN, HID, (3, 3), strides=2)
    with pytest.raises(ValueError, match=where + r": padding='VALID' changes the spatial shape"):
        lm.ConvLSTMCell(IN, HID, (3, 3), padding="VALID")
    with pytest.raises(ValueError, match=where + r": padding=\(\(1, 0\), 1\) changes"):
        lm.ConvLSTMCell(IN, HID, (3, 3), padding=((1, 0), 1))
    assert lm.ConvLSTMCell(IN, HID, (1, 1), padding="VALID").padding == "VALID"
    with pytest.raises(ValueError, match=r"^ConvLSTMCell: unknown padding 'FULL'"):
        lm.ConvLSTMCell(IN, HID, (3, 3), padding="FULL")
    with pytest.raises(ValueError, match=r"^ConvLSTMCell: hidden_size must be a positive int"):
        lm.ConvLSTMCell(IN, 0, (3, 3))
    with pytest.raises(TypeError, match=r"positional argument"):
        lm.ConvLSTMCell(IN, HID, (3, 3), 1)  # strides is keyword-only
    cell = lm.ConvLSTMCell(IN, HID, (3, 3))
    with pytest.raises(ValueError, match=where + r"\.initialize_carry takes the input's shape"):
        cell.initialize_carry((B,))
    apply, variables = lm.transform(cell).apply, zero_variables(cell)
    x = jnp.zeros((B, *SPATIAL, IN))
    with pytest.raises(
        ValueError, match=where + r" got a carry of shapes .*initialize_carry\(\(2, 4, 5\)\)"
    ):
        apply(variables, None, cell.initialize_carry((B, 4, 4)), x)
    with pytest.raises(ValueError, match=where + r" got an input of shape \(4, 3\): it needs"):
        apply(variables, None, cell.initialize_carry((4, 4)), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match=where + r" got an input of shape .* in_size=3"):
        apply(variables, None, cell.initialize_carry((B, *SPATIAL)), jnp.zeros((B, 4, 5, 2)))


# ---------------------------------------------------------------------------- Bidirectional


def bidirectional_pair(time_major=False, merge_fn=None):
    extra = {} if merge_fn is None else {"merge_fn": merge_fn}
    theirs = nn.Bidirectional(
        nn.RNN(nn.LSTMCell(HID)),
        nn.RNN(nn.GRUCell(HID)),
        time_major=time_major,
        return_carry=True,
        **extra,
    )
    ours = lm.Bidirectional(
        lm.RNN(lm.LSTMCell(IN, HID)),
        lm.RNN(lm.GRUCell(IN, HID)),
        time_major=time_major,
        return_carry=True,
        **extra,
    )
    return ours, theirs


@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
def test_bidirectional_equals_linen_with_sequence_lengths(rng, time_major):
    ours, theirs = bidirectional_pair(time_major)
    xs = normal(rng, *((T, B, IN) if time_major else (B, T, IN)))
    lengths = jnp.array([T, 2])
    variables = jax.jit(theirs.init)(jax.random.key(0), xs, seq_lengths=lengths)
    assert layout(abstract_init(ours)) == layout(variables)
    ours_call, theirs_call = lamina_call(ours), linen_call(theirs)
    (carries, ys), _ = ours_call(variables, None, xs, seq_lengths=lengths)
    expected = theirs_call(variables, xs, seq_lengths=lengths)
    assert_close((carries, ys), expected)
    assert ys.shape[-1] == 2 * HID

    # The backward direction reversed only the valid part: its outputs over the valid steps
    # are those of the backward RNN run on the valid part alone.
    backward = lamina_call(lm.RNN(lm.GRUCell(IN, HID), reverse=True, keep_order=True))
    short = xs[:2, 1] if time_major else xs[1, :2]
    alone, _ = backward({"params": variables["params"]["backward_rnn"]}, None, short)
    assert_close(ys[:2, 1, HID:] if time_major else ys[1, :2, HID:], alone)

    def ours_loss(v, xs):
        return ours_call(v, None, xs, seq_lengths=lengths)

    def theirs_loss(v, xs):
        return theirs_call(v, xs, seq_lengths=lengths)

    if not time_major:  # the same arithmetic either way; one gradient check suffices
        assert_grads_equal(ours_loss_apply(ours_loss), theirs_loss, variables, xs)


def ours_loss_apply(fn):
    """`fn(v, *a)` as an apply function ``(v, rngs, *a) -> (outputs, v)``."""
    return lambda v, rngs, *a: fn(v, *a)


def test_bidirectional_merge_and_initial_carry(rng):
    ours, theirs = bidirectional_pair(merge_fn=jnp.add)
    xs = normal(rng, B, T, IN)
    initial = ((normal(rng, B, HID), normal(rng, B, HID)), normal(rng, B, HID))
    variables = jax.jit(theirs.init)(jax.random.key(0), xs)
    got, _ = lamina_call(ours)(variables, None, xs, initial)
    expected = linen_call(theirs)(variables, xs, initial_carry=initial)
    assert_close(got, expected)
    assert got[1].shape == (B, T, HID)
    # return_carry overridden per call, as in Linen: the outputs alone
    apply = lm.transform(ours).apply
    ys, _ = jax.eval_shape(lambda v: apply(v, None, xs, initial, return_carry=False), variables)
    assert ys.shape == expected[1].shape


def test_bidirectional_errors():
    rnn = lm.RNN(lm.GRUCell(IN, HID))
    with pytest.raises(
        TypeError,
        match=r"Bidirectional's backward_rnn must be a recurrent "
        r"layer over sequences, got the cell GRUCell.*lm.RNN\(GRUCell",
    ):
        lm.Bidirectional(rnn, lm.GRUCell(IN, HID))
    with pytest.raises(TypeError, match=r"Bidirectional's forward_rnn must be a recurrent layer"):
        lm.Bidirectional(lambda x: x, rnn)
    with pytest.raises(TypeError, match=r"^Bidirectional: merge_fn must be a function"):
        lm.Bidirectional(rnn, rnn, merge_fn="concat")
    with pytest.raises(TypeError, match=r"^Bidirectional: time_major must be True or False"):
        lm.Bidirectional(rnn, rnn, time_major=1)
    with pytest.raises(TypeError, match=r"positional argument"):
        lm.Bidirectional(rnn, rnn, jnp.add)  # merge_fn is keyword-only
    layer = lm.Bidirectional(rnn, lm.RNN(lm.GRUCell(IN, HID)))
    apply, variables = lm.transform(layer).apply, zero_variables(layer)
    xs = jnp.zeros((B, T, IN))
    with pytest.raises(TypeError, match=r"initial_carry must be a tuple \(forward_carry, back"):
        apply(variables, None, xs, [jnp.zeros((B, HID))] * 2)
    with pytest.raises(TypeError, match=r"Bidirectional.__call__: time_major must be a Python "):
        apply(variables, None, xs, time_major=jnp.array(True))


def test_rnn_per_call_options_override_the_settings(rng):
    """As Linen's: ``rnn(x, reverse=True, ...)`` overrides the layer's settings for one call."""
    xs = normal(rng, B, T, IN)
    init, apply = lm.transform(lm.RNN(lm.SimpleCell(IN, HID)))
    variables = init(jax.random.key(0))
    built = lm.transform(lm.RNN(lm.SimpleCell(IN, HID), reverse=True, return_carry=True)).apply
    expected, _ = built(variables, None, jnp.swapaxes(xs, 0, 1), time_major=True)
    got, _ = apply(
        variables, None, jnp.swapaxes(xs, 0, 1), reverse=True, return_carry=True, time_major=True
    )
    assert_close(got, expected)
    theirs = nn.RNN(nn.SimpleCell(HID))
    linen = theirs.apply(
        variables, jnp.swapaxes(xs, 0, 1), reverse=True, keep_order=True, time_major=True
    )
    ours, _ = apply(
        variables, None, jnp.swapaxes(xs, 0, 1), reverse=True, keep_order=True, time_major=True
    )
    assert_close(ours, linen)
    with pytest.raises(TypeError, match=r"^RNN.__call__: reverse must be a Python bool"):
        apply(variables, None, xs, reverse=1)
