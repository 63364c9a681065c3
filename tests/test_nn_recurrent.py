"""The recurrent cells, RNN and Bidirectional against Flax Linen, given the same weights.

`LSTMCell`, `OptimizedLSTMCell`, `GRUCell`, `MGUCell`, `SimpleCell`, `ConvLSTMCell`, `RNN` and
`Bidirectional`: outputs, final carries and gradients with respect to the variables, the carry
and the input equal Linen's (Linen's init); the cells' dtypes; RNN's per-call options; where
RNN runs the compiled step of a built-in cell; every error a user can cause.

Shapes are shared across tests (B sequences of T steps, IN -> HID features) so that compiled
programs are reused; Linen's variables are made once per cell kind and seed.
"""

import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import RNN, GRUCell, LSTMCell
from lamina.nn.lstm_cells import lstm_step
from lamina.nn.recurrent import flip_sequences
from tests.helpers import abstract_init, assert_close, layout, normal
from tests.linen_helpers import linen_apply

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

B, T, IN, HID = 3, 6, 3, 4
CELLS = {"lstm": (LSTMCell, nn.LSTMCell), "gru": (GRUCell, nn.GRUCell)}


def ours(kind, **kwargs):
    return CELLS[kind][0](IN, HID, **kwargs)


def linen(kind, **kwargs):
    return CELLS[kind][1](HID, **kwargs)


@functools.cache
def _linen_init(kind):
    zeros = jnp.zeros((B, HID))
    carry = (zeros, zeros) if kind == "lstm" else zeros
    return jax.jit(lambda key: linen(kind).init(key, carry, jnp.zeros((B, IN))))


@functools.cache
def linen_cell_variables(kind, seed=0):
    """Linen's `init` of a cell: {"params": {"ii": ..., ...}}."""
    return _linen_init(kind)(jax.random.key(seed))


def linen_rnn_variables(kind, seed=0):
    """Linen's variables of `nn.RNN(cell)`: the cell's, under "cell"."""
    return {"params": {"cell": linen_cell_variables(kind, seed)["params"]}}


def random_carry(kind, rng, batch=(B,)):
    if kind == "lstm":
        return normal(rng, *batch, HID), normal(rng, *batch, HID)
    return normal(rng, *batch, HID)


def sequences(rng, time_major=False):
    return normal(rng, *((T, B, IN) if time_major else (B, T, IN)))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ----------------------------------------------------------------------------- layout, init


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_init_layout_equals_linen(kind):
    key = jax.random.key(0)
    carry = linen(kind).initialize_carry(key, (B, IN))
    linen_cell = jax.eval_shape(lambda: linen(kind).init(key, carry, jnp.zeros((B, IN))))
    assert layout(jax.eval_shape(lm.transform(ours(kind)).init, key)) == layout(linen_cell)
    # inside RNN the cell's variables live under "cell", as in Linen
    linen_rnn = jax.eval_shape(lambda: nn.RNN(linen(kind)).init(key, jnp.zeros((B, T, IN))))
    got = jax.eval_shape(lm.transform(RNN(ours(kind))).init, key)
    assert layout(got) == layout(linen_rnn)
    assert set(linen_rnn["params"]) == {"cell"}


def test_which_dense_layers_have_biases():
    lstm = jax.eval_shape(lm.transform(LSTMCell(IN, HID)).init, jax.random.key(0))["params"]
    assert {k: sorted(v) for k, v in lstm.items()} == {
        **{f"i{g}": ["kernel"] for g in "ifgo"},
        **{f"h{g}": ["bias", "kernel"] for g in "ifgo"},
    }
    gru = jax.eval_shape(lm.transform(GRUCell(IN, HID)).init, jax.random.key(0))["params"]
    assert {k: sorted(v) for k, v in gru.items()} == {
        "ir": ["bias", "kernel"],
        "iz": ["bias", "kernel"],
        "in": ["bias", "kernel"],
        "hr": ["kernel"],
        "hz": ["kernel"],
        "hn": ["bias", "kernel"],
    }


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_default_initializers_are_linens(kind):
    cell = ours(kind)
    declarations = {name: d for name, d in vars(cell).items() if isinstance(d, lm.Dense)}
    assert len(declarations) == (8 if kind == "lstm" else 6)
    for name, d in declarations.items():
        expected = (
            lm.initializers.orthogonal() if name[0] == "h" else lm.initializers.lecun_normal()
        )
        assert d.kernel.init == expected, name
        if d.bias is not None:
            assert d.bias.init == lm.initializers.zeros(), name
    assert cell.gate_fn is lm.sigmoid and cell.activation_fn is lm.tanh


def test_initializers_dtypes_and_functions_reach_every_gate():
    kernel_init, recurrent_init = lm.initializers.ones(), lm.initializers.constant(2.0)
    bias_init = lm.initializers.constant(3.0)
    for cls, gates in [(LSTMCell, "ifgo"), (GRUCell, "rzn")]:
        cell = cls(
            IN,
            HID,
            gate_fn=jax.nn.hard_sigmoid,
            activation_fn=jax.nn.soft_sign,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_init,
            bias_init=bias_init,
            dtype=jnp.bfloat16,
            param_dtype=jnp.float32,
        )
        assert cell.gate_fn is jax.nn.hard_sigmoid and cell.activation_fn is jax.nn.soft_sign
        for g in gates:
            i, h = getattr(cell, f"i{g}"), getattr(cell, f"h{g}")
            assert i.kernel.init is kernel_init and h.kernel.init is recurrent_init
            assert i.kernel.shape == (IN, HID) and h.kernel.shape == (HID, HID)
            for bias in (i.bias, h.bias):
                assert bias is None or bias.init is bias_init
            for d in (i, h):
                assert d.kernel.dtype == jnp.bfloat16 and d.kernel.param_dtype == jnp.float32


def test_a_new_transform_reuses_the_compiled_step(rng):
    """Transform's snapshot shares the activation functions (a copy of a model shares JAX's
    functions, such as the jitted lm.sigmoid), so the step's compilation cache is hit."""
    x, carry = normal(rng, B, IN), random_carry("lstm", rng)
    variables = linen_cell_variables("lstm")
    first, _ = lm.transform(ours("lstm")).apply(variables, None, carry, x)
    size = lstm_step._cache_size()
    again, _ = lm.transform(ours("lstm")).apply(variables, None, carry, x)
    assert lstm_step._cache_size() == size
    assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_initialize_carry_equals_linens_zeros(rng, kind, batch):
    got = ours(kind).initialize_carry(batch)
    expected = linen(kind).initialize_carry(jax.random.key(0), (*batch, IN))
    assert_close(got, expected, rtol=0, atol=0)
    assert_close(ours(kind).initialize_carry(list(batch)), expected, rtol=0, atol=0)
    mixed = ours(kind, dtype=jnp.bfloat16, param_dtype=jnp.float32).initialize_carry(batch)
    assert {leaf.dtype for leaf in jax.tree.leaves(mixed)} == {jnp.dtype(jnp.float32)}


def test_initialize_carry_takes_an_int():
    c, h = LSTMCell(IN, HID).initialize_carry(5)
    assert c.shape == h.shape == (5, HID)


# ----------------------------------------------------------------------------- one step


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_cell_step_equals_linen(rng, kind, batch):
    x = normal(rng, *batch, IN)
    carry = random_carry(kind, rng, batch)
    variables = linen_cell_variables(kind)
    expected = linen_apply(linen(kind))(variables, carry, x)
    got, _ = lm.transform(ours(kind)).apply(variables, None, carry, x)
    assert_close(got, expected)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_custom_activations_equal_linen(rng, kind):
    fns = {"gate_fn": jax.nn.hard_sigmoid, "activation_fn": jax.nn.soft_sign}
    x = normal(rng, B, IN)
    carry = random_carry(kind, rng)
    variables = linen_cell_variables(kind)
    expected = linen_apply(linen(kind, **fns))(variables, carry, x)
    got, _ = lm.transform(ours(kind, **fns)).apply(variables, None, carry, x)
    assert_close(got, expected)
    default, _ = lm.transform(ours(kind)).apply(variables, None, carry, x)
    assert not np.allclose(default[1], got[1])  # the functions are used


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_gradients_equal_linen(rng, kind):
    x = normal(rng, B, IN)
    carry = random_carry(kind, rng)
    variables = linen_cell_variables(kind)
    _, apply = lm.transform(ours(kind))

    def loss(out):
        new_carry, y = out
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(new_carry)) + jnp.sum(y**2)

    def loss_ours(v, c, x):
        return loss(apply(v, None, c, x)[0])

    def loss_linen(v, c, x):
        return loss(linen(kind).apply(v, c, x))

    g_ours = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2)))(variables, carry, x)
    g_linen = jax.jit(jax.grad(loss_linen, argnums=(0, 1, 2)))(variables, carry, x)
    assert_close(g_ours, g_linen, rtol=1e-5)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_bfloat16_compute_float32_storage_equals_linen(rng, kind):
    """Linen keeps the carry in float32 (param_dtype) and computes the gates in bfloat16; its
    cells rely on standard dtype promotion for that, so Linen runs under it here."""
    mixed = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    x = normal(rng, B, IN)
    carry = random_carry(kind, rng)
    variables = linen_cell_variables(kind)
    with jax.numpy_dtype_promotion("standard"):
        expected = linen_apply(linen(kind, **mixed))(variables, carry, x)
    got, _ = lm.transform(ours(kind, **mixed)).apply(variables, None, carry, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    # the same operations in the same dtypes as Linen's promotions: equal to float32 rounding
    assert_close(got, expected, rtol=1e-5, atol=1e-5)
    full, _ = lm.transform(ours(kind)).apply(variables, None, carry, x)
    assert not np.array_equal(got[1], full[1])  # bfloat16 was used
    np.testing.assert_allclose(got[1], full[1], atol=3e-2)


# ----------------------------------------------------------------------------- RNN


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("lstm", {}),
        ("lstm", {"reverse": True}),
        ("lstm", {"time_major": True, "reverse": True, "keep_order": True, "return_carry": True}),
        ("gru", {"time_major": True, "return_carry": True, "unroll": 3}),
        ("gru", {"reverse": True, "keep_order": True}),
    ],
    ids=lambda o: "-".join(o) if isinstance(o, dict) else o,
)
def test_rnn_equals_linen(rng, kind, options):
    x = sequences(rng, options.get("time_major", False))
    variables = linen_rnn_variables(kind)
    expected = linen_apply(nn.RNN(linen(kind), **options))(variables, x)
    got, _ = lm.transform(RNN(ours(kind), **options)).apply(variables, None, x)
    assert_close(got, expected)


def test_rnn_reverse_and_keep_order_by_hand(rng):
    """Independent of Linen: reverse reads the sequence backwards; keep_order restores order."""
    x = sequences(rng)
    variables = linen_rnn_variables("gru")
    backward, _ = lm.transform(RNN(GRUCell(IN, HID), reverse=True)).apply(variables, None, x)
    kept, _ = lm.transform(RNN(GRUCell(IN, HID), reverse=True, keep_order=True)).apply(
        variables, None, x
    )
    _, step = lm.transform(GRUCell(IN, HID))
    h = jnp.zeros((B, HID))
    for t in range(T):
        h, y = step({"params": variables["params"]["cell"]}, None, h, x[:, T - 1 - t])[0]
        assert_close(backward[:, t], y)
        assert_close(kept[:, T - 1 - t], y)


def test_rnn_unbatched_sequence_equals_linen(rng):
    x = normal(rng, T, IN)
    variables = linen_rnn_variables("lstm")
    expected = linen_apply(nn.RNN(linen("lstm"), return_carry=True))(variables, x)
    got, _ = lm.transform(RNN(ours("lstm"), return_carry=True)).apply(variables, None, x)
    assert_close(got, expected)


def test_rnn_initial_carry_equals_linen(rng):
    x = sequences(rng)
    carry = random_carry("lstm", rng)
    variables = linen_rnn_variables("lstm")
    expected = linen_apply(nn.RNN(linen("lstm"), return_carry=True))(
        variables, x, initial_carry=carry
    )
    _, apply = lm.transform(RNN(ours("lstm"), return_carry=True))
    got, _ = apply(variables, None, x, initial_carry=carry)
    assert_close(got, expected)
    zero, _ = apply(variables, None, x)
    assert not np.allclose(zero[1], got[1])  # the carry is used
    positional, _ = apply(variables, None, x, carry)
    assert_close(positional, got, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("lstm", {}),
        ("lstm", {"reverse": True}),
        ("lstm", {"time_major": True, "reverse": True, "keep_order": True}),
        ("gru", {"reverse": True, "keep_order": True}),
    ],
    ids=lambda o: "-".join(o) or "forward" if isinstance(o, dict) else o,
)
def test_rnn_seq_lengths_equal_linen(rng, kind, options):
    """Outputs (padding steps included) and the carry after each sequence's last step."""
    options = {**options, "return_carry": True}
    x = sequences(rng, options.get("time_major", False))
    lengths = jnp.array([T, 2, 1])
    variables = linen_rnn_variables(kind)
    expected = linen_apply(nn.RNN(linen(kind), **options))(variables, x, seq_lengths=lengths)
    got, _ = lm.transform(RNN(ours(kind), **options)).apply(variables, None, x, seq_lengths=lengths)
    assert_close(got, expected)
    if options.get("keep_order"):  # without return_carry: the same outputs
        options["return_carry"] = False
        outputs, _ = lm.transform(RNN(ours(kind), **options)).apply(
            variables, None, x, seq_lengths=lengths
        )
        assert_close(outputs, expected[1])


def test_rnn_seq_lengths_several_batch_axes_and_zero_length(rng):
    """The carry stops at each sequence's end, for any batch shape; a length of 0 keeps the
    initial carry (Linen's carry selection handles one batch axis and lengths >= 1 only)."""
    x = normal(rng, 2, B, T, IN)
    lengths = jnp.array([[T, 3, 0], [1, 5, 2]])
    initial = random_carry("lstm", rng, (2, B))
    variables = linen_rnn_variables("lstm")
    _, apply = lm.transform(RNN(LSTMCell(IN, HID), return_carry=True))
    (c, h), y = apply(variables, None, x, initial, lengths)[0]
    assert c.shape == h.shape == (2, B, HID) and y.shape == (2, B, T, HID)
    # Linen, on the batch flattened to one axis (its carry selection needs one batch axis)
    flat = jax.tree.map(lambda a: a.reshape(2 * B, *a.shape[2:]), (x, initial, lengths))
    (ce, he), ye = linen_apply(nn.RNN(linen("lstm"), return_carry=True))(
        variables,
        flat[0],
        initial_carry=flat[1],
        seq_lengths=flat[2],
    )
    assert_close(y.reshape(2 * B, T, HID), ye)
    valid = np.asarray(flat[2]) > 0  # Linen's carry for a length of 0 is the last step's
    assert_close(c.reshape(2 * B, HID)[valid], ce[valid])
    assert_close(h.reshape(2 * B, HID)[valid], he[valid])
    # length 0: the initial carry, unchanged
    np.testing.assert_array_equal(c[0, 2], initial[0][0, 2])
    np.testing.assert_array_equal(h[0, 2], initial[1][0, 2])


def test_flip_sequences_equals_linen(rng):
    from flax.linen.recurrent import flip_sequences as linen_flip

    x = normal(rng, B, T, 2)
    lengths = jnp.array([T, 2, 0])
    for time_major, data in [(False, x), (True, jnp.swapaxes(x, 0, 1))]:
        for seq in [None, lengths]:
            np.testing.assert_array_equal(
                flip_sequences(data, seq, 1, time_major),
                jax.jit(linen_flip, static_argnums=(2, 3))(data, seq, 1, time_major),
            )


class Bidirectional(lm.Module):
    def __init__(self, kind):
        super().__init__()
        self.forward_rnn = RNN(ours(kind), return_carry=True)
        self.backward_rnn = RNN(ours(kind), reverse=True, keep_order=True, return_carry=True)

    def __call__(self, x, seq_lengths):
        carry_f, y_f = self.forward_rnn(x, seq_lengths=seq_lengths)
        carry_b, y_b = self.backward_rnn(x, seq_lengths=seq_lengths)
        return (carry_f, carry_b), jnp.concatenate([y_f, y_b], axis=-1)


def test_bidirectional_equals_linen(rng):
    x = sequences(rng)
    lengths = jnp.array([4, T, 1])
    module = nn.Bidirectional(nn.RNN(linen("gru")), nn.RNN(linen("gru")), return_carry=True)
    variables = {
        "params": {
            "forward_rnn": linen_rnn_variables("gru", 0)["params"],
            "backward_rnn": linen_rnn_variables("gru", 1)["params"],
        }
    }
    init, apply = lm.transform(Bidirectional("gru"))
    assert layout(jax.eval_shape(init, jax.random.key(0))) == layout(
        jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    )
    got, _ = apply(variables, None, x, lengths)
    assert_close(got, linen_apply(module)(variables, x, seq_lengths=lengths))


def test_rnn_gradients_equal_linen(rng):
    """With respect to the parameters, the inputs and the initial carry; through reverse,
    keep_order, seq_lengths and the final carry."""
    x = sequences(rng)
    lengths = jnp.array([T, 3, 1])
    carry = random_carry("lstm", rng)
    options = {"return_carry": True, "reverse": True, "keep_order": True}
    variables = linen_rnn_variables("lstm")
    module = nn.RNN(linen("lstm"), **options)
    _, apply = lm.transform(RNN(ours("lstm"), **options))

    def losses(out):  # of the final carry, and of the outputs
        final, y = out
        return jnp.stack([sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(final)), jnp.sum(y**2)])

    def loss_ours(v, x, c):
        return losses(apply(v, None, x, c, lengths)[0])

    def loss_linen(v, x, c):
        return jnp.sum(losses(module.apply(v, x, initial_carry=c, seq_lengths=lengths)))

    # one compiled program for both rows: the gradients of each loss
    rows = jax.jit(jax.jacrev(loss_ours, argnums=(0, 1, 2)))(variables, x, carry)
    g_ours = jax.tree.map(lambda g: g[0] + g[1], rows)
    g_linen = jax.jit(jax.grad(loss_linen, argnums=(0, 1, 2)))(variables, x, carry)
    assert_close(g_ours, g_linen, rtol=1e-5, atol=1e-6)
    assert np.abs(g_ours[0]["params"]["cell"]["hf"]["kernel"]).sum() > 0
    # padding steps do not reach the final carry: only the outputs depend on them
    g_carry_only = rows[1][0]
    for b, length in enumerate(lengths.tolist()):
        np.testing.assert_array_equal(g_carry_only[b, length:], 0.0)
        assert np.all(np.abs(g_carry_only[b, :length]).sum(axis=-1) > 0)


def test_rnn_under_jit_and_new_weights_each_call(rng):
    """Jitted and eager calls give Linen's outputs for each set of weights: nothing traced
    with one call's weights is reused by the next."""
    x = sequences(rng)
    module = nn.RNN(linen("gru"), return_carry=True)
    _, apply = lm.transform(RNN(ours("gru"), return_carry=True))
    jitted, reference = jax.jit(apply), jax.jit(module.apply)
    for seed in (0, 1):
        variables = linen_rnn_variables("gru", seed)
        expected = reference(variables, x)
        assert_close(apply(variables, None, x)[0], expected)
        assert_close(jitted(variables, None, x)[0], expected)
    assert jitted._cache_size() == 1


def test_rnn_under_vmap(rng):
    x = sequences(rng)
    variables = linen_rnn_variables("gru")
    _, apply = lm.transform(RNN(ours("gru")))
    batched, _ = jax.vmap(lambda s: apply(variables, None, s))(x)
    assert_close(batched, apply(variables, None, x)[0])


class SimpleCell(lm.Module):
    """A cell of the user's own, with Linen `SimpleCell`'s variables: RNN scans any cell."""

    def __init__(self):
        super().__init__()
        self.i = lm.Dense(IN, HID)
        self.h = lm.Dense(HID, HID, use_bias=False)

    def initialize_carry(self, batch_shape):
        return jnp.zeros((*batch_shape, HID))

    def __call__(self, carry, x):
        new = jnp.tanh(self.i(x) + self.h(carry))
        return new, new


def test_rnn_of_another_cell_equals_linen(rng):
    x = sequences(rng)
    lengths = jnp.array([T, 2, 4])
    options = {"return_carry": True, "reverse": True, "keep_order": True}
    module = nn.RNN(nn.SimpleCell(HID), **options)
    _, apply = lm.transform(RNN(SimpleCell(), **options))
    linen_init = jax.jit(module.init)
    reference = jax.jit(lambda v, x, lengths: module.apply(v, x, seq_lengths=lengths))
    for seed in (0, 1):  # new weights each call: the scan body is traced anew
        variables = linen_init(jax.random.key(seed), x)
        for seq_lengths in (lengths, None):  # two code paths
            got, _ = apply(variables, None, x, seq_lengths=seq_lengths)
            assert_close(got, reference(variables, x, seq_lengths))


def test_rnn_bfloat16_compute_float32_storage_equals_linen(rng):
    mixed = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    x = sequences(rng)
    variables = linen_rnn_variables("lstm")
    with jax.numpy_dtype_promotion("standard"):
        expected = linen_apply(nn.RNN(linen("lstm", **mixed), return_carry=True))(variables, x)
    got, _ = lm.transform(RNN(ours("lstm", **mixed), return_carry=True)).apply(variables, None, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rnn_bfloat16_throughout(rng):
    """dtype=bfloat16 alone stores bfloat16 too, and the carry stays bfloat16. (Orthogonal
    initialisation has no bfloat16 QR on CPU, in Linen as here, so the weights are cast.)"""
    x = sequences(rng).astype(jnp.bfloat16)
    init, apply = lm.transform(RNN(ours("gru", dtype=jnp.bfloat16), return_carry=True))
    assert {a.dtype for a in jax.tree.leaves(jax.eval_shape(init, jax.random.key(0)))} == {
        jnp.dtype(jnp.bfloat16)
    }
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), linen_rnn_variables("gru"))
    got, _ = apply(variables, None, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
    reference, _ = lm.transform(RNN(ours("gru"), return_carry=True)).apply(
        jax.tree.map(lambda a: a.astype(jnp.float32), variables), None, x.astype(jnp.float32)
    )
    np.testing.assert_allclose(got[1].astype(jnp.float32), reference[1], atol=5e-2)


# ------------------------------------------------- the compiled step only where it is the cell's


def gru_by_hand(params, h, x, hz=None):
    """Linen's GRU step from the variables (`hz` replaces the ``hz`` gate's transform)."""

    def gate(name, v):
        p = params[name]
        return v @ p["kernel"] + (p["bias"][None] if "bias" in p else 0.0)

    r = jax.nn.sigmoid(gate("ir", x) + gate("hr", h))
    z = jax.nn.sigmoid(gate("iz", x) + (gate("hz", h) if hz is None else hz(h)))
    n = jnp.tanh(gate("in", x) + r * gate("hn", h))
    return (1.0 - z) * n + z * h


def loop_over_cell(cell, params, x, h):
    """The cell's own `__call__` at every step, one `apply` per step: outputs (B, T, HID)."""
    _, apply = lm.transform(cell)
    ys = []
    for t in range(x.shape[1]):
        (h, y), _ = apply({"params": params}, None, h, x[:, t])
        ys.append(y)
    return jnp.stack(ys, axis=1)


class HalvedGRUCell(GRUCell):
    """A subclass whose `__call__` changes the output: RNN must run it, not the GRU kernel."""

    def __call__(self, carry, x):
        h, y = super().__call__(carry, x)
        return h * 0.5, y * 0.5


@pytest.mark.parametrize("jit", [False, True])
def test_rnn_runs_a_cell_subclass_own_call(rng, jit):
    x = sequences(rng)
    variables = linen_rnn_variables("gru")
    _, apply = lm.transform(RNN(HalvedGRUCell(IN, HID)))
    got, _ = (jax.jit(apply) if jit else apply)(variables, None, x)
    cell_params = variables["params"]["cell"]
    expected = loop_over_cell(HalvedGRUCell(IN, HID), cell_params, x, jnp.zeros((B, HID)))
    assert_close(got, expected)
    h, ys = jnp.zeros((B, HID)), []
    for t in range(T):
        h = 0.5 * gru_by_hand(cell_params, h, x[:, t])
        ys.append(h)
    assert_close(got, jnp.stack(ys, axis=1))


@pytest.mark.parametrize("jit", [False, True])
def test_rnn_records_what_its_cell_sows_with_a_time_axis(rng, jit):
    class Sowing(GRUCell):
        def __call__(self, carry, x):
            h, y = super().__call__(carry, x)
            lm.sow("h", h)
            return h, y

    x = sequences(rng)
    variables = linen_rnn_variables("gru")
    _, apply = lm.transform(RNN(Sowing(IN, HID)))
    apply = jax.jit(apply) if jit else apply
    ys, new = apply({**variables, "intermediates": {}}, None, x)
    (recorded,) = new["intermediates"]["cell"]["h"]
    assert recorded.shape == (T, B, HID)  # the steps first, in the order they ran
    assert_close(recorded, jnp.moveaxis(ys, 1, 0))
    assert "intermediates" not in apply(variables, None, x)[1]  # not asked: nothing


def test_rnn_capture_intermediates_sees_the_cell_and_its_gates(rng):
    x = sequences(rng)
    variables = linen_rnn_variables("gru")
    _, apply = lm.transform(RNN(ours("gru")))
    ys, new = jax.jit(lm.capture_intermediates(apply))(variables, None, x)
    captured = new["intermediates"]["cell"]
    (call,) = captured["__call__"]
    assert_close(call[1], jnp.moveaxis(ys, 1, 0))  # (h, y) of each step, steps first
    (hz,) = captured["hz"]["__call__"]
    assert hz.shape == (T, B, HID)
    assert_close(ys, apply(variables, None, x)[0])


def lora_and_unbiased_gru():
    cell = GRUCell(IN, HID)
    cell.hz = lm.LoRA(cell.hz, 2, b_init=lm.initializers.normal(1.0))
    cell.ir = lm.Dense(IN, HID, use_bias=False)
    return cell


@pytest.mark.parametrize("jit", [False, True])
def test_cells_with_a_lora_gate_or_an_unbiased_gate_run_their_layers(rng, jit):
    x = sequences(rng)
    cell = lora_and_unbiased_gru()
    init, apply = lm.transform(RNN(cell))
    variables = init(jax.random.key(0))
    params = variables["params"]["cell"]
    assert "bias" not in params["ir"] and set(params["hz"]) == {"base", "lora_a", "lora_b"}
    got, _ = (jax.jit(apply) if jit else apply)(variables, None, x)

    lora = params["hz"]
    by_hand = {**params, "hz": lora["base"]}

    def hz(h):
        return h @ lora["base"]["kernel"] + h @ lora["lora_a"] @ lora["lora_b"] * (2 / 2)

    h, ys = jnp.zeros((B, HID)), []
    for t in range(T):
        h = gru_by_hand(by_hand, h, x[:, t], hz=hz)
        ys.append(h)
    assert_close(got, jnp.stack(ys, axis=1), rtol=1e-5, atol=1e-5)
    assert_close(got, loop_over_cell(lora_and_unbiased_gru(), params, x, jnp.zeros((B, HID))))


def test_compiled_step_only_for_an_exact_built_in_cell_with_untouched_gates():
    assert GRUCell(IN, HID).uses_compiled_step()
    assert LSTMCell(IN, HID).uses_compiled_step()
    assert not HalvedGRUCell(IN, HID).uses_compiled_step()
    assert not lora_and_unbiased_gru().uses_compiled_step()
    changed = {
        "a bias": lm.Dense(HID, HID),
        "a precision": lm.Dense(HID, HID, use_bias=False, precision="highest"),
        "a dtype": lm.Dense(HID, HID, use_bias=False, dtype=jnp.bfloat16, param_dtype="float32"),
        "a subclass": type("MyDense", (lm.Dense,), {})(HID, HID, use_bias=False),
    }
    for what, layer in changed.items():
        cell = GRUCell(IN, HID)
        cell.hr = layer
        assert not cell.uses_compiled_step(), what


ALL_CELLS = [lm.LSTMCell, lm.OptimizedLSTMCell, lm.GRUCell, lm.MGUCell, lm.SimpleCell]
GATE_WITHOUT_BIAS = {
    lm.LSTMCell: "ii",
    lm.OptimizedLSTMCell: "ii",
    lm.GRUCell: "hr",
    lm.MGUCell: "hf",
    lm.SimpleCell: "h",
}
GATE_WITH_BIAS = {
    lm.LSTMCell: "hi",
    lm.OptimizedLSTMCell: "hf",
    lm.GRUCell: "ir",
    lm.MGUCell: "in",
    lm.SimpleCell: "i",
}


def _rnn_outputs(cell, x, jit, **kwargs):
    init, apply = lm.transform(RNN(cell))
    variables = init(jax.random.key(0))
    run = functools.partial(apply, **kwargs)
    return (jax.jit(run) if jit else run)(variables, None, x)[0]


def _subclass(cls):
    return type("My" + cls.__name__, (cls,), {})


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("cls", ALL_CELLS, ids=lambda c: c.__name__)
def test_a_bias_added_to_or_removed_from_a_gate_is_computed(cls, jit):
    """The RNN's compiled step reads the gates' actual `bias`, not their `use_bias` setting."""
    x = jax.random.normal(jax.random.key(1), (2, 5, IN))
    added, removed = GATE_WITHOUT_BIAS[cls], GATE_WITH_BIAS[cls]

    def edited(kind, value):
        cell = kind(IN, HID)
        getattr(cell, added).bias = lm.Parameter((HID,), lm.initializers.constant(value))
        getattr(cell, removed).bias = None
        return cell

    for value in (0.0, 3.0):
        assert not edited(cls, value).uses_compiled_step()
        got = _rnn_outputs(edited(cls, value), x, jit)
        expected = _rnn_outputs(edited(_subclass(cls), value), x, jit)  # the cell's own code
        assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with_zero, with_three = (_rnn_outputs(edited(cls, v), x, jit) for v in (0.0, 3.0))
    assert float(jnp.max(jnp.abs(with_zero - with_three))) > 1e-2


@pytest.mark.parametrize(
    "edit",
    [
        "kernel shape",
        "kernel dtype",
        "kernel kind",
        "bias shape",
    ],
)
def test_compiled_step_not_used_for_a_replaced_gate_array(edit):
    cell = GRUCell(IN, HID)
    replacement = {
        "kernel shape": ("kernel", lm.Parameter((HID, 1), lm.initializers.ones())),
        "kernel dtype": ("kernel", lm.Parameter((HID, HID), lm.initializers.ones(), jnp.bfloat16)),
        "kernel kind": ("kernel", lm.BatchStat((HID, HID), lm.initializers.ones())),
        "bias shape": ("bias", lm.Parameter((1,), lm.initializers.ones())),
    }[edit]
    setattr(cell.hn, *replacement)
    assert not cell.uses_compiled_step()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("cls", ALL_CELLS, ids=lambda c: c.__name__)
def test_compiled_step_computes_each_gate_in_its_dense_dtype(cls, jit):
    """dtype=None, bfloat16 variables, float32 input: the input gates compute in float32 and
    the hidden ones in bfloat16 (the carry's and kernels' dtype), each as its `Dense` does
    (and Linen's: each gate a ``Dense(dtype=None)`` promoting its own input and variables);
    the compiled step is bit for bit the cell's own call."""
    x = jax.random.normal(jax.random.key(1), (2, 5, IN))
    kwargs = {"dtype": None, "param_dtype": jnp.bfloat16}
    got = _rnn_outputs(cls(IN, HID, **kwargs), x, jit, return_carry=True)
    expected = _rnn_outputs(_subclass(cls)(IN, HID, **kwargs), x, jit, return_carry=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("jit", [False, True])
def test_conv_lstm_cell_with_a_lora_convolution_runs_it(jit):
    """ConvLSTMCell calls its convolutions, whatever they are (no read of their kernels)."""
    cell = lm.ConvLSTMCell(IN, HID, kernel_size=(3,))
    cell.ih = lm.LoRA(cell.ih, 2, b_init=lm.initializers.normal(1.0))
    init, apply = lm.transform(RNN(cell))
    variables = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, T, 5, IN))  # (batch, time, width, channels)
    got, _ = (jax.jit(apply) if jit else apply)(variables, None, x)

    params = variables["params"]["cell"]
    lora = params["ih"]
    update = jnp.einsum("kir,ro->kio", lora["lora_a"], lora["lora_b"]) * (2 / 2)
    merged = {**params, "ih": {**lora["base"], "kernel": lora["base"]["kernel"] + update}}
    _, plain = lm.transform(RNN(lm.ConvLSTMCell(IN, HID, kernel_size=(3,))))
    expected, _ = plain({"params": {"cell": merged}}, None, x)
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_wrong_input_size(kind):
    cell = ours(kind)
    _, apply = lm.transform(cell)
    variables = linen_cell_variables(kind)
    name = type(cell).__name__
    with pytest.raises(
        ValueError,
        match=rf"{name}\(in_size=3, hidden_size=4\) got an input of shape \(3, 5\): "
        r"its last axis must be in_size=3, got 5\. Pass an input of shape \(\.\.\., 3\), or "
        r"build the layer with in_size=5",
    ):
        apply(variables, None, cell.initialize_carry((B,)), jnp.ones((B, 5)))
    with pytest.raises(
        ValueError,
        match=r"got an input of shape \(\): its last axis must be in_size=3, but a scalar "
        r"has none",
    ):
        apply(variables, None, cell.initialize_carry(()), jnp.ones(()))


def test_cell_wrong_carry():
    lstm, gru = LSTMCell(IN, HID), GRUCell(IN, HID)
    x = jnp.ones((2, IN))
    lstm_apply = functools.partial(lm.transform(lstm).apply, linen_cell_variables("lstm"), None)
    gru_apply = functools.partial(lm.transform(gru).apply, linen_cell_variables("gru"), None)
    with pytest.raises(
        ValueError,
        match=r"got a carry of shapes \(\(3, 4\), \(3, 4\)\) for an input with batch shape "
        r"\(2,\); the carry must be a tuple \(c, h\) with shapes \(\(2, 4\), \(2, 4\)\).*"
        r"initialize_carry\(\(2,\)\)",
    ):
        lstm_apply(lstm.initialize_carry(3), x)
    with pytest.raises(ValueError, match=r"got a carry of shapes \(2, 4\).*a tuple \(c, h\)"):
        lstm_apply(jnp.zeros((2, HID)), x)
    with pytest.raises(ValueError, match=r"\[\(2, 4\), \(2, 4\)\].*a tuple \(c, h\)"):
        lstm_apply(list(lstm.initialize_carry(2)), x)
    with pytest.raises(ValueError, match=r"the carry must be one array h with shapes \(2, 4\)"):
        gru_apply(lstm.initialize_carry(2), x)
    with pytest.raises(ValueError, match=r"got a carry of shapes \(2, 5\).*\(2, 4\)"):
        gru_apply(jnp.zeros((2, 5)), x)


@pytest.mark.parametrize("time_major", [False, True])
def test_rnn_wrong_input_size(time_major):
    _, apply = lm.transform(RNN(LSTMCell(IN, HID), time_major=time_major))
    with pytest.raises(
        ValueError,
        match=r"RNN\(LSTMCell\(in_size=3\)\) got inputs of shape \(3, 6, 5\): its last axis "
        r"must be in_size=3, got 5\..*in_size=5",
    ):
        apply(linen_rnn_variables("lstm"), None, jnp.ones((B, T, 5)))


@pytest.mark.parametrize("time_major", [False, True])
def test_rnn_inputs_of_too_low_rank(time_major):
    _, apply = lm.transform(RNN(GRUCell(IN, HID), time_major=time_major))
    layout = r"\(time, \*batch, \*features\)" if time_major else r"\(\*batch, time, \*features\)"
    with pytest.raises(
        ValueError,
        match=rf"RNN\(time_major={time_major}\) expects inputs of shape {layout}, with at least 2 "
        r"axes \(time and 1 feature axis\), got shape \(3,\).*x\[\.\.\., None\]",
    ):
        apply(linen_rnn_variables("gru"), None, jnp.ones(IN))


def test_rnn_initial_carry_of_wrong_shape():
    rnn = RNN(LSTMCell(IN, HID), time_major=True)
    _, apply = lm.transform(rnn)
    variables = linen_rnn_variables("lstm")
    x = jnp.ones((T, 2, IN))  # time-major: batch shape (2,)
    batch_major_carry = rnn.cell.initialize_carry((T,))
    with pytest.raises(
        ValueError,
        match=r"RNN got an initial_carry of shapes \(\(6, 4\), \(6, 4\)\), but its cell LSTMCell "
        r"needs a carry of shapes \(\(2, 4\), \(2, 4\)\) for inputs of shape \(6, 2, 3\) \(batch "
        r"shape \(2,\), time_major=True\)\. Create one with rnn\.cell\.initialize_carry\(\(2,\)\)",
    ):
        apply(variables, None, x, batch_major_carry)
    with pytest.raises(ValueError, match=r"initial_carry of shapes \(2, 4\), but"):
        apply(variables, None, x, jnp.zeros((2, HID)))
    init, apply_simple = lm.transform(RNN(SimpleCell()))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape), jax.eval_shape(init, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"initial_carry of shapes \(2, 5\), but its cell "):
        apply_simple(zeros, None, jnp.ones((2, T, IN)), jnp.zeros((2, 5)))


def test_rnn_bad_seq_lengths():
    _, apply = lm.transform(RNN(GRUCell(IN, HID), return_carry=True))
    variables = linen_rnn_variables("gru")
    x = jnp.ones((2, T, IN))
    with pytest.raises(
        ValueError,
        match=r"seq_lengths must have the batch shape \(2,\) of inputs of shape \(2, 6, 3\) "
        r"\(time_major=False\), one length per sequence; got shape \(6,\)",
    ):
        apply(variables, None, x, seq_lengths=jnp.arange(T))
    with pytest.raises(TypeError, match=r"seq_lengths must be integers, got dtype float32"):
        apply(variables, None, x, seq_lengths=jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("bad", [-2, T + 1, 99])
def test_rnn_seq_lengths_out_of_range(bad):
    """Lengths of -2 or 99 were accepted silently; concrete ones are checked."""
    _, apply = lm.transform(RNN(GRUCell(IN, HID), return_carry=True))
    variables = linen_rnn_variables("gru")
    x = jnp.ones((2, T, IN))
    with pytest.raises(
        ValueError,
        match=rf"^RNN's seq_lengths must be in \[0, {T}\] \(the inputs' time axis has {T} steps, "
        rf"shape \(2, {T}, {IN}\), time_major=False\); got {bad}\.",
    ):
        apply(variables, None, x, seq_lengths=jnp.array([3, bad]))
    # the bounds themselves are lengths; under jit the lengths are traced and not checked
    apply(variables, None, x, seq_lengths=jnp.array([0, T]))
    jax.jit(apply)(variables, None, x, seq_lengths=jnp.array([0, T]))


def test_bad_settings():
    with pytest.raises(ValueError, match=r"LSTMCell: in_size must be a positive int, got 0"):
        LSTMCell(0, HID)
    with pytest.raises(TypeError, match=r"GRUCell: hidden_size must be a positive int"):
        GRUCell(IN, "4")
    assert GRUCell(np.int64(IN), HID).in_size == IN
    with pytest.raises(TypeError, match=r"LSTMCell: param_dtype must be a dtype such as"):
        LSTMCell(IN, HID, param_dtype="f32x")
    with pytest.raises(TypeError, match=r"GRUCell: gate_fn must be a function"):
        GRUCell(IN, HID, gate_fn="sigmoid")
    with pytest.raises(TypeError, match=r"RNN's cell must be a cell module.*got Dense"):
        RNN(lm.Dense(IN, HID))
    with pytest.raises(ValueError, match=r"RNN: unroll must be a positive int.*got 0"):
        RNN(GRUCell(IN, HID), unroll=0)
    with pytest.raises(TypeError, match=r"RNN: unroll must be a positive int.*got 2\.0"):
        RNN(GRUCell(IN, HID), unroll=2.0)
    with pytest.raises(TypeError, match=r"^RNN: reverse must be True or False, got str 'yes'"):
        RNN(GRUCell(IN, HID), reverse="yes")
    with pytest.raises(TypeError, match=r"positional argument"):
        RNN(GRUCell(IN, HID), True)  # time_major is keyword-only
    with pytest.raises(TypeError, match=r"positional argument"):
        GRUCell(IN, HID, lm.relu)  # gate_fn is keyword-only
    with pytest.raises(TypeError, match=r"^LSTMCell: dtype must be a floating or complex dtype"):
        LSTMCell(IN, HID, dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"^GRUCell: recurrent_kernel_init must be an initializer"):
        GRUCell(IN, HID, recurrent_kernel_init=None)
    with pytest.raises(TypeError, match=r"LSTMCell.initialize_carry takes the batch shape"):
        LSTMCell(IN, HID).initialize_carry((2, IN, -1))


# --- MGUCell and SimpleCell -------------------------------------------------------------------


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


def test_mgu_and_simple_cell_default_initializers_are_linens():
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


# Batch and length of the tests below: their lengths and expected messages spell out a batch of
# two sequences.
B2, T2 = 2, 5


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


def lstm_inputs(rng, batch=(B2,)):
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

    expected = linen_apply(theirs)(variables, carry, x)
    got, _ = lamina_call(ours)(variables, None, carry, x)
    assert_close(got, expected)
    unfused, _ = lamina_call(lm.LSTMCell(IN, HID))(variables, None, carry, x)
    assert_close(got, unfused)
    assert_grads_equal(lamina_call(ours), linen_apply(theirs), variables, carry, x)

    # Inside RNN, with sequence lengths and the final carry, against Linen's RNN.
    xs, lengths = normal(rng, B2, T2, IN), jnp.array([T2, 3])
    rnn_variables = {"params": {"cell": variables["params"]}}
    got = lamina_call(lm.RNN(ours, return_carry=True))(
        rnn_variables, None, xs, seq_lengths=lengths
    )[0]
    expected = linen_apply(nn.RNN(theirs, return_carry=True))(
        rnn_variables, xs, seq_lengths=lengths
    )
    assert_close(got, expected)


def test_optimized_lstm_cell_fuses_the_gate_products():
    """Two matrix products per step instead of eight: the point of the cell."""
    carry, x = (jnp.zeros((B2, HID)),) * 2, jnp.zeros((B2, IN))

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

    h = complex_normal(B2, HID)
    carry = (complex_normal(B2, HID), h) if lstm else h
    x = complex_normal(B2, IN)
    variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
    assert layout(abstract_init(ours)) == layout(variables)
    got, _ = lamina_call(ours)(variables, None, carry, x)
    expected = linen_apply(theirs)(variables, carry, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.complex64)}

    def parts(tree):
        return jax.tree.map(lambda a: (jnp.real(a), jnp.imag(a)), tree)

    assert_close(parts(got), parts(expected), rtol=1e-4, atol=1e-5)

    # A complex input on a real carry makes the carry complex, as Linen's standard promotion
    # (never a cast that drops the imaginary part);
    # test_complex_inputs_with_the_default_carry_equal_linen compares each cell with Linen.
    real = lm.transform(getattr(lm, kind)(IN, HID, dtype=None))
    real_variables = jax.tree.map(jnp.real, variables)
    real_carry = jax.tree.map(jnp.real, carry)
    got, _ = real.apply(real_variables, None, real_carry, x)
    with jax.numpy_dtype_promotion("standard"):  # Linen promotes complex with float32
        expected = linen_apply(getattr(nn, kind)(HID))(real_variables, real_carry, x)
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
        expected = linen_apply(theirs)(variables, carry, x)
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
    carry = (normal(rng, B2, *spatial, HID), normal(rng, B2, *spatial, HID))
    x = normal(rng, B2, *spatial, IN)
    variables = jax.jit(theirs.init)(jax.random.key(0), carry, x)
    assert layout(abstract_init(ours)) == layout(variables)
    assert ours.num_feature_axes == theirs.num_feature_axes == len(spatial) + 1

    got, _ = lamina_call(ours)(variables, None, carry, x)
    assert_close(got, linen_apply(theirs)(variables, carry, x))
    assert_grads_equal(lamina_call(ours), linen_apply(theirs), variables, carry, x)
    zeros = ours.initialize_carry((B2, *spatial))
    expected_zeros = theirs.initialize_carry(jax.random.key(0), x.shape)
    assert_close(zeros, expected_zeros, rtol=0, atol=0)

    # RNN over (batch, time, *spatial, channels), with the carry after each last valid step.
    xs, lengths = normal(rng, B2, 3, *spatial, IN), jnp.array([3, 2])
    rnn_variables = {"params": {"cell": variables["params"]}}
    ours_rnn = lamina_call(lm.RNN(ours, return_carry=True))
    theirs_rnn = linen_apply(nn.RNN(theirs, return_carry=True))
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
        cell.initialize_carry((B2,))
    apply, variables = lm.transform(cell).apply, zero_variables(cell)
    x = jnp.zeros((B2, *SPATIAL, IN))
    with pytest.raises(
        ValueError, match=where + r" got a carry of shapes .*initialize_carry\(\(2, 4, 5\)\)"
    ):
        apply(variables, None, cell.initialize_carry((B2, 4, 4)), x)
    with pytest.raises(ValueError, match=where + r" got an input of shape \(4, 3\): it needs"):
        apply(variables, None, cell.initialize_carry((4, 4)), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match=where + r" got an input of shape .* in_size=3"):
        apply(variables, None, cell.initialize_carry((B2, *SPATIAL)), jnp.zeros((B2, 4, 5, 2)))


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
    xs = normal(rng, *((T2, B2, IN) if time_major else (B2, T2, IN)))
    lengths = jnp.array([T2, 2])
    variables = jax.jit(theirs.init)(jax.random.key(0), xs, seq_lengths=lengths)
    assert layout(abstract_init(ours)) == layout(variables)
    ours_call, theirs_call = lamina_call(ours), linen_apply(theirs)
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
    xs = normal(rng, B2, T2, IN)
    initial = ((normal(rng, B2, HID), normal(rng, B2, HID)), normal(rng, B2, HID))
    variables = jax.jit(theirs.init)(jax.random.key(0), xs)
    got, _ = lamina_call(ours)(variables, None, xs, initial)
    expected = linen_apply(theirs)(variables, xs, initial_carry=initial)
    assert_close(got, expected)
    assert got[1].shape == (B2, T2, HID)
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
    xs = jnp.zeros((B2, T2, IN))
    with pytest.raises(TypeError, match=r"initial_carry must be a tuple \(forward_carry, back"):
        apply(variables, None, xs, [jnp.zeros((B2, HID))] * 2)
    with pytest.raises(TypeError, match=r"Bidirectional.__call__: time_major must be a Python "):
        apply(variables, None, xs, time_major=jnp.array(True))


def test_rnn_per_call_options_override_the_settings(rng):
    """As Linen's: ``rnn(x, reverse=True, ...)`` overrides the layer's settings for one call."""
    xs = normal(rng, B2, T2, IN)
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
