"""FLOPs in `lm.summary`: XLA's counts against hand counts, and the module calls they rest on.

Hand counts: a matrix product of (m, k) by (k, n) is ``2 * m * k * n`` FLOPs (a multiply and
an add per term), a bias or residual addition one per element. XLA's cost analysis counts
what the lowered program computes; where that differs from a textbook count (a convolution's
padding, a loop's body counted once) the tests say so.
"""

import jax
import jax.numpy as jnp
import pytest

import lamina as lm
from lamina.records.capture import CallFailed, calls


def matmul(m, k, n):
    return 2 * m * k * n


def flops_of(model, *args, **kwargs):
    return lm.summary(model, *args, **kwargs).flops


def row(summary, path):
    (found,) = [r for r in summary.calls if r.module_path == path]
    return found


KEY = jax.random.key(0)


def program_flops(model, *args):
    """XLA's count of the whole model as one program (array arguments only)."""
    init, apply = lm.transform(model)
    variables = jax.eval_shape(init, KEY)
    lowered = jax.jit(lambda v, *a: apply(v, KEY, *a)).lower(variables, *args)
    return round(lowered.cost_analysis()["flops"])


def program_grad_flops(model, x, *others):
    """XLA's count of the model's output and its vjp (params and x), as one program.

    `others` are further array inputs, not differentiated.
    """
    init, apply = lm.transform(model)
    variables = jax.eval_shape(init, KEY)

    def step(v, x, others, cotangent):
        run = lambda params, x: apply({**v, "params": params}, KEY, x, *others)[0]  # noqa: E731
        out, pullback = jax.vjp(run, v["params"], x)
        return out, pullback(cotangent)

    cotangent = jax.eval_shape(lambda v, x: apply(v, KEY, x, *others)[0], variables, x)
    lowered = jax.jit(step).lower(variables, x, others, cotangent)
    return round(lowered.cost_analysis()["flops"])


class Block(lm.Module):
    """A transformer-like block: norm, up, gelu, down, residual."""

    def __init__(self, d=8):
        self.norm, self.up, self.down = lm.LayerNorm(d), lm.Dense(d, 2 * d), lm.Dense(2 * d, d)

    def __call__(self, x):
        return x + self.down(lm.gelu(self.up(self.norm(x))))


# ---- hand-counted layers ---------------------------------------------------------------------


def test_dense_is_a_matmul_and_a_bias():
    assert flops_of(lm.Dense(64, 32), jnp.ones((8, 64))) == matmul(8, 64, 32) + 8 * 32 == 33_024
    assert flops_of(lm.Dense(64, 32, use_bias=False), jnp.ones((8, 64))) == matmul(8, 64, 32)


def test_shapes_alone_give_the_same_count():
    # Nothing is computed: jax.ShapeDtypeStruct stands for an input as well as an array.
    assert flops_of(lm.Dense(64, 32), jax.ShapeDtypeStruct((8, 64), jnp.float32)) == 33_024


def test_conv_valid_padding_counts_every_tap():
    b, h, w, cin, cout, k = 2, 8, 8, 3, 16, 3
    ho, wo = h - k + 1, w - k + 1
    conv = lm.Conv(cin, cout, (k, k), padding="VALID")
    expected = 2 * b * ho * wo * cout * k * k * cin + b * ho * wo * cout
    assert flops_of(conv, jnp.ones((b, h, w, cin))) == expected == 63_360


def test_conv_same_padding_counts_only_taps_inside_the_image():
    # XLA does not count products with the zero padding: along each axis the 3-tap window
    # sees 2 pixels at either edge and 3 elsewhere, 2 + 6 * 3 + 2 = 22 per axis.
    b, cin, cout = 2, 3, 16
    conv = lm.Conv(cin, cout, (3, 3), padding="SAME")
    taps = 22 * 22  # (output position, tap) pairs inside the 8x8 image
    expected = 2 * b * taps * cin * cout + b * 8 * 8 * cout
    assert flops_of(conv, jnp.ones((b, 8, 8, cin))) == expected == 94_976
    assert expected < 2 * b * 8 * 8 * 9 * cin * cout + b * 8 * 8 * cout  # the textbook count


def test_attention_within_its_hand_count():
    b, t, d, heads = 2, 10, 32, 4
    projections = 4 * (matmul(b * t, d, d) + b * t * d)  # q, k, v and out, with biases
    scores_and_mix = 2 * matmul(b * heads * t, d // heads, t)  # q k^T, then weights v
    low = projections + scores_and_mix
    softmax_and_scale = 8 * b * heads * t * t + b * t * d
    count = flops_of(lm.MultiHeadAttention(heads, d), jnp.ones((b, t, d)))
    assert low == 192_000
    assert low <= count <= low + softmax_and_scale


def test_dense_gradient_is_three_matmuls():
    # forward x @ w, backward dx = g @ w.T and dw = x.T @ g; the bias adds and reduces.
    s = lm.summary(lm.Dense(64, 32), jnp.ones((8, 64)), backward=True)
    mm = matmul(8, 64, 32)
    assert s.flops == 33_024
    assert 3 * mm <= s.grad_flops <= 3 * mm + 3 * 8 * 32
    assert row(s, "<root>").grad_flops == s.grad_flops


# ---- loops: XLA counts a body once; lamina counts it per layer or step --------------------------


DENSE_64 = matmul(8, 64, 64) + 8 * 64


@pytest.mark.parametrize("unroll", [1, 2, 3, True])
def test_stack_counts_its_block_once_per_layer(unroll):
    s = lm.summary(lm.Stack(lm.Dense(64, 64), 4, unroll=unroll), jnp.ones((8, 64)))
    block = row(s, "block")
    assert (block.calls, block.flops) == (4, 4 * DENSE_64)
    # The rest is the loop's counter (an add and a compare); unrolled, there is no loop.
    own = s.flops - block.flops
    assert own == (0 if unroll is True else 2)


def test_a_stack_holding_assigned_values_counts_as_the_initialised_one():
    # A value assigned to a Stack's block holds every copy; its block, lowered alone, must
    # still count (it once showed "?" and the total the loop body once).
    class Block(lm.Module):
        def __init__(self):
            self.d = lm.Dense(4, 4)

        def __call__(self, x):
            return x + self.d(x)

    stack = lm.Stack(Block(), 3)
    pretrained = lm.assign_variables(stack, lm.transform(stack).init(jax.random.key(0)))
    x = jnp.ones((2, 4))
    plain, assigned = lm.summary(stack, x, backward=True), lm.summary(pretrained, x, backward=True)
    assert assigned.calls == plain.calls
    assert (assigned.flops, assigned.grad_flops) == (plain.flops, plain.grad_flops)
    assert all(row.flops is not None and not row.note for row in assigned.calls)


def test_stack_with_a_remainder_and_an_unroll_beyond_its_depth():
    # unroll 2 over 5 layers: XLA sees two bodies in the loop and one after it.
    for n, unroll in [(5, 2), (4, 6)]:
        s = lm.summary(lm.Stack(lm.Dense(64, 64), n, unroll=unroll), jnp.ones((8, 64)))
        assert row(s, "block").flops == n * DENSE_64
        assert s.flops - n * DENSE_64 in (0, 2)


def test_stack_gradient_counts_each_layer():
    dense = lm.summary(lm.Dense(64, 64), jnp.ones((8, 64)), backward=True).grad_flops
    for unroll in (1, True):
        stack = lm.Stack(lm.Dense(64, 64), 4, unroll=unroll)
        s = lm.summary(stack, jnp.ones((8, 64)), backward=True)
        assert row(s, "block").grad_flops == 4 * dense
        assert 0 <= s.grad_flops - 4 * dense <= 8  # the two loops' counters


def test_nested_stacks_multiply():
    model = lm.Stack(lm.Stack(lm.Dense(4, 4), 3), 2)
    s = lm.summary(model, jnp.ones((2, 4)))
    inner = row(s, "block/block")
    assert inner.calls == 6 and inner.flops == 6 * (matmul(2, 4, 4) + 2 * 4)


def test_rnn_counts_its_cell_once_per_step():
    x = jnp.ones((2, 7, 3))
    cell_alone = lm.summary(lm.LSTMCell(3, 8), lm.LSTMCell(3, 8).initialize_carry((2,)), x[:, 0])
    for rnn in (lm.RNN(lm.LSTMCell(3, 8)), lm.RNN(lm.LSTMCell(3, 8), unroll=3)):
        s = lm.summary(rnn, x)
        cell = row(s, "cell")
        assert cell.calls == 7 and cell.flops == 7 * cell_alone.flops
        assert row(s, "cell/ii").calls == 7  # the gates run at every step too
        assert 0 <= s.flops - cell.flops <= 2
    time_major = lm.summary(lm.RNN(lm.LSTMCell(3, 8), time_major=True), jnp.ones((5, 2, 3)))
    assert row(time_major, "cell").calls == 5


@pytest.mark.parametrize("remat", [False, True])
def test_stack_gradient_does_not_depend_on_unroll(remat):
    # With remat=True the loop runs each block's forward pass again in the backward pass;
    # the block is lowered under jax.checkpoint as the Stack runs it, so each layer counts
    # its recomputation, whatever unroll is. Fully unrolled, XLA's count of the whole
    # program is the reference (no loop: every layer is in it).
    x = jnp.ones((4, 8))
    counts = {
        unroll: lm.summary(lm.Stack(Block(), 5, remat=remat, unroll=unroll), x, backward=True)
        for unroll in (1, 2, True)
    }
    reference = program_grad_flops(lm.Stack(Block(), 5, remat=remat, unroll=True), x)
    assert counts[True].grad_flops == reference
    for s in counts.values():
        assert 0 <= s.grad_flops - reference <= 8  # the loops' counters
        assert row(s, "block").grad_flops == counts[True].calls[1].grad_flops
    plain = program_grad_flops(lm.Stack(Block(), 5, unroll=True), x)
    assert (reference > plain) == remat  # the recomputed forward passes


def test_rnn_gradient_sums_the_cells_parameter_gradients_at_every_step():
    # The cell's parameters are the same at every step: the backward pass adds each step's
    # gradient to their sum, one addition per parameter and step.
    x = jnp.ones((2, 7, 3))
    reference = program_grad_flops(lm.RNN(lm.LSTMCell(3, 8), unroll=True), x)
    for unroll in (1, 3, True):
        s = lm.summary(lm.RNN(lm.LSTMCell(3, 8), unroll=unroll), x, backward=True)
        assert 0 <= s.grad_flops - reference <= 8
    cell = lm.LSTMCell(3, 8)
    alone = lm.summary(cell, cell.initialize_carry((2,)), x[:, 0], backward=True)
    parameters = alone.num_params
    assert row(s, "cell").grad_flops == 7 * (alone.grad_flops + parameters)


def test_a_loop_in_a_rematerialised_loop_is_flagged_unless_unrolled():
    # Inside a rematerialised block, JAX runs part of an inner loop's forward pass again at
    # each step; XLA counts that once per copy of the inner body, so only a fully unrolled
    # inner loop is counted exactly. The others say so.
    x = jnp.ones((4, 8))

    def model(inner_unroll, outer_unroll=1):
        return lm.Stack(
            lm.Stack(Block(), 3, unroll=inner_unroll), 2, remat=True, unroll=outer_unroll
        )

    exact = lm.summary(model(True), x, backward=True)
    assert all(r.note == "" for r in exact.calls)
    assert 0 <= exact.grad_flops - program_grad_flops(model(True, True), x) <= 8
    looped = lm.summary(model(1), x, backward=True)
    assert row(looped, "block").note.startswith("a loop in a rematerialised loop")
    assert looped.grad_flops < exact.grad_flops
    assert lm.summary(model(1), x).calls[1].note == ""  # the forward count is exact


def test_a_module_called_twice_and_a_shared_one_count_every_call():
    class Twice(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(4, 4)
            self.tied = self.dense

        def __call__(self, x):
            return self.tied(self.dense(x))

    s = lm.summary(Twice(), jnp.ones((2, 4)))
    dense = row(s, "dense")
    assert dense.calls == 2 and dense.flops == 2 * (matmul(2, 4, 4) + 8) == s.flops
    assert [r.module_path for r in s.calls] == ["<root>", "dense"]


def test_user_loops_are_flagged_and_vmap_members_noted():
    class Looped(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(4, 4)

        def __call__(self, x):
            step = lm.scan(lambda m, c, _: (m(c), None), in_axes=(None, lm.Carry, 0))
            return step(self.dense, x, jnp.zeros(3))[0]

    s = lm.summary(Looped(), jnp.ones((2, 4)))
    assert row(s, "dense").note == "in lm.scan: XLA counts the loop's body once"
    assert "note: dense: in lm.scan" in str(s)

    class Ensemble(lm.Module):
        def __init__(self):
            self.members = lm.Stack(lm.Dense(3, 2), 4)

        def __call__(self, x):
            return lm.vmap(lambda m, x: m(x), in_axes=(0, None))(self.members.block, x)

    s = lm.summary(Ensemble(), jnp.ones((1, 3)))
    members = row(s, "members/block")
    assert members.note.startswith("in lm.vmap: one member")
    assert members.flops == matmul(1, 3, 2) + 2
    assert s.flops >= 4 * members.flops  # the batch is counted in the parent


class Switch(lm.Module):
    def __init__(self):
        self.a, self.b, self.c = lm.Dense(64, 64), lm.Dense(64, 64), lm.Dense(64, 64)

    def __call__(self, x, i):
        return lm.switch(
            i, [lambda m, x: m.a(x), lambda m, x: m.b(x), lambda m, x: m.c(x)], self, x
        )


def test_a_switch_counts_its_costliest_branch():
    x, i = jnp.ones((2, 64)), jnp.array(1)
    s = lm.summary(Switch(), x, i)
    dense = matmul(2, 64, 64) + 2 * 64
    assert s.flops == program_flops(Switch(), x, i) == dense + 1  # + clamping the index
    for path in "abc":  # each branch as if it runs
        assert (row(s, path).calls, row(s, path).flops) == (1, dense)
        assert row(s, path).note.startswith("a branch of lm.switch: counted as if it runs")


def test_branches_of_separate_and_nested_conditionals():
    class Branches(lm.Module):
        def __init__(self):
            self.a, self.b, self.c = lm.Dense(16, 16), lm.Dense(16, 16), lm.Dense(16, 16)
            self.stack = lm.Stack(lm.Dense(16, 16), 4, unroll=True)

        def __call__(self, x, i):
            x = lm.switch(i, [lambda m, x: m.a(x), lambda m, x: m.b(m.a(x))], self, x)

            def inner(m, x):
                return lm.cond(i > 1, lambda m, x: m.stack(x), lambda m, x: x, m, x)

            return lm.cond(i > 0, lambda m, x: m.c(x), inner, self, x)

    x, i = jnp.ones((2, 16)), jnp.array(1)
    s = lm.summary(Branches(), x, i)
    dense = matmul(2, 16, 16) + 2 * 16
    # max(a, b after a) + max(c, max(four layers, nothing)), plus the conditions
    assert s.flops == program_flops(Branches(), x, i)
    assert 2 * dense + 4 * dense <= s.flops <= 2 * dense + 4 * dense + 8
    assert (row(s, "a").calls, row(s, "stack/block").calls) == (2, 4)
    grad = lm.summary(Branches(), x, i, backward=True).grad_flops
    assert 0 <= grad - program_grad_flops(Branches(), x, i) <= 8
    # a looped Stack in a branch: counted per layer, the costliest branch still chosen
    looped = Branches()
    looped.stack = lm.Stack(lm.Dense(16, 16), 4)
    assert 0 <= lm.summary(looped, x, i).flops - s.flops <= 2


def test_dead_code_still_counts():
    # Each call is lowered alone: an output its parent drops, and the backward pass of what
    # it stops gradients through, are counted, though the whole program would drop them.
    class Both(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(16, 16)

        def __call__(self, x):
            return self.dense(x), self.dense(x).sum()

    class UsesOne(lm.Module):
        def __init__(self):
            self.both = Both()

        def __call__(self, x):
            return self.both(x)[1]

    x = jnp.ones((2, 16))
    dense = matmul(2, 16, 16) + 2 * 16
    s = lm.summary(UsesOne(), x)
    assert row(s, "both/dense").flops == 2 * dense
    assert s.flops == 2 * dense + 31 > program_flops(UsesOne(), x) == dense + 31  # the sum

    class Distill(lm.Module):
        def __init__(self):
            self.student, self.teacher = lm.Dense(16, 16), lm.Dense(16, 16)

        def __call__(self, x):
            return ((self.student(x) - jax.lax.stop_gradient(self.teacher(x))) ** 2).sum()

    s = lm.summary(Distill(), x, backward=True)
    assert row(s, "teacher").grad_flops == row(s, "student").grad_flops
    assert s.grad_flops > program_grad_flops(Distill(), x)


def test_where_other_methods_and_raw_transforms_count():
    # A submodule's other methods (Embed.attend) are not calls: they count in the caller's
    # row. A module under a raw jax.vmap counts one member; the batch is in its parent's.
    class Tied(lm.Module):
        def __init__(self):
            self.embed = lm.Embed(50, 16)

        def __call__(self, ids):
            return self.embed.attend(self.embed(ids))

    s = lm.summary(Tied(), jnp.zeros((2, 5), jnp.int32))
    assert [r.module_path for r in s.calls] == ["<root>", "embed"]
    assert s.flops - row(s, "embed").flops == matmul(10, 16, 50)

    class Mapped(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(8, 8)

        def __call__(self, x):
            return jax.vmap(self.dense)(x)

    s = lm.summary(Mapped(), jnp.ones((4, 3, 8)))
    one = matmul(3, 8, 8) + 3 * 8
    assert row(s, "dense").flops == one and row(s, "dense").output_shapes == ((3, 8),)
    assert s.flops == 4 * one and row(s, "dense").note == ""


def test_flags_are_passed_as_they_are():
    dropout = lm.Dropout(0.5)
    x = jnp.ones((4, 8))
    assert flops_of(dropout, x, is_training=False) == 0
    assert flops_of(dropout, x, is_training=True) > 0  # the random bits, as XLA counts them
    norm = lm.BatchNorm(8)
    training = flops_of(norm, x, is_training=True)
    assert training > flops_of(norm, x, is_training=False) > 0


def test_a_shape_is_seen_per_call():
    model = lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 2))
    s = lm.summary(model, jnp.ones((5, 3)))
    assert [(r.module_path, r.module_type, r.output_shapes) for r in s.calls] == [
        ("<root>", "Sequential", ((5, 2),)),
        ("layers_0", "Dense", ((5, 4),)),
        ("layers_2", "Dense", ((5, 2),)),
    ]
    relu = 5 * 4  # the function between the layers is the Sequential's own
    assert s.flops == row(s, "layers_0").flops + row(s, "layers_2").flops + relu


def test_keys_and_other_inputs_without_gradients():
    class Noisy(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(3, 3)

        def __call__(self, x, key):
            return self.dense(x + jax.random.normal(key, x.shape))

    s = lm.summary(Noisy(), jnp.ones((2, 3)), jax.random.key(1), backward=True)
    assert all(r.note == "" for r in s.calls)
    assert s.grad_flops > s.flops > row(s, "dense").flops == matmul(2, 3, 3) + 6


def test_a_call_that_cannot_be_lowered_alone_stays_in_its_parent():
    class Helper(lm.Module):
        def __call__(self, x, other):
            return other(x) * 2  # another module's variables: bound only inside the model

    class Uses(lm.Module):
        def __init__(self):
            self.dense, self.helper = lm.Dense(2, 2), Helper()

        def __call__(self, x):
            return self.helper(x, self.dense)

    s = lm.summary(Uses(), jnp.ones((1, 2)))
    helper = row(s, "helper")
    assert helper.flops is None and helper.note.startswith("not counted alone")
    assert s.flops == matmul(1, 2, 2) + 2 + 2  # the dense layer and the doubling, in the root
    assert str(s).splitlines()[-5].split()[-1] == "?"  # the helper's row


# ---- errors ----------------------------------------------------------------------------------


def test_inputs_of_the_wrong_shape_name_the_module():
    model = lm.Sequential(lm.Dense(3, 4), lm.Sequential(lm.Dense(5, 2)))
    with pytest.raises(ValueError, match=r"failed in the call of Dense at layers_1/layers_0: "):
        lm.summary(model, jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"in the call of Sequential at <root>: Dense.__call"):
        lm.summary(model, jnp.ones((2, 3)), jnp.ones(2))  # one input too many
    with pytest.raises(TypeError, match=r"failed in calling BatchNorm with the example inputs"):
        lm.summary(lm.BatchNorm(3), jnp.ones((2, 3)))  # is_training missing


def test_backward_needs_something_to_differentiate():
    class Doubles(lm.Module):
        def __call__(self, x):
            return 2 * x

    with pytest.raises(ValueError, match="no floating-point parameters"):
        lm.summary(Doubles(), jnp.ones(3, jnp.int32), backward=True)
    # A float input is enough; a layer whose inputs are ints has its parameters.
    assert lm.summary(Doubles(), jnp.ones(3), backward=True).grad_flops >= 3
    assert lm.summary(lm.Embed(10, 4), jnp.zeros(3, jnp.int32), backward=True).grad_flops > 0
    with pytest.raises(ValueError, match=r"backward=True\) counts the FLOPs of a call on"):
        lm.summary(lm.Dense(2, 2), backward=True)
    with pytest.raises(TypeError, match="backward is True or False"):
        lm.summary(lm.Dense(2, 2), jnp.ones(2), backward="yes")


def test_a_model_whose_gradient_jax_cannot_lower_is_an_error():
    class Loop(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(8, 8)

        def __call__(self, x):
            step = lambda c: (c[0] + 1, self.dense(c[1]))  # noqa: E731
            return lm.while_loop(lambda c: c[0] < 3, step, (0, x))[1]

    x = jnp.ones((2, 8))
    assert lm.summary(Loop(), x).flops > 0  # the forward pass counts
    with pytest.raises(
        ValueError,
        match=r"lm.summary: JAX cannot lower the backward pass of Loop on the example inputs, "
        r"so its FLOPs cannot be counted. JAX said: Reverse-mode differentiation does not work "
        r"for lax.while_loop.*backward=False",
    ):
        lm.summary(Loop(), x, backward=True)

    class Callback(lm.Module):
        def __call__(self, x):
            shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return jax.pure_callback(lambda a: a * 2, shape, x)

    with pytest.raises(ValueError, match=r"backward pass of Callback.*Pure callbacks do not"):
        lm.summary(Callback(), x, backward=True)

    class Stopped(lm.Module):  # the callback's gradient is never asked for in the model
        def __init__(self):
            self.callback, self.dense = Callback(), lm.Dense(8, 8)

        def __call__(self, x):
            return self.dense(self.callback(jax.lax.stop_gradient(x)))

    s = lm.summary(Stopped(), x, backward=True)
    assert row(s, "callback").grad_flops is None
    assert row(s, "callback").note.startswith(
        "not counted alone (ValueError: Pure callbacks do not support JVP."
    )
    # the callback runs on the host (XLA counts nothing); the dense layer counts its input's
    # gradient, which the whole program does not compute (dead code, as documented)
    assert s.grad_flops == row(s, "dense").grad_flops > program_grad_flops(Stopped(), x)


# ---- the calls the counts rest on -------------------------------------------------------------


def test_calls_lists_each_module_call_once_with_its_parent():
    class Base(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(2, 2)

        def __call__(self, x):
            return self.dense(x)

    class Child(Base):
        def __call__(self, x):
            return super().__call__(x) * 2  # one call, not two

    model = lm.Sequential(Child(), lm.Stack(lm.Dense(2, 2), 3))
    init, apply = lm.transform(model)
    recorded = calls(apply)(jax.eval_shape(init, jax.random.key(0)), None, jnp.ones((1, 2)))
    assert [(c.path, c.parent, c.transform) for c in recorded] == [
        ((), None, None),
        (("layers_0",), 0, None),
        (("layers_0", "dense"), 1, None),
        (("layers_1",), 0, None),
        (("layers_1", "block"), 3, "lm.scan"),
    ]
    assert all(c.output.shape == (1, 2) for c in recorded)
    assert recorded[1].args[0].shape == (1, 2)
    # The traced model is not changed by the watching: capture works as before.
    _, new = lm.capture_intermediates(apply)({**init(jax.random.key(0))}, None, jnp.ones((1, 2)))
    assert set(new["intermediates"]) == {"__call__", "layers_0", "layers_1"}


def test_calls_names_the_failing_module_and_restores_the_profiler():
    import sys

    init, apply = lm.transform(lm.Sequential(lm.Dense(3, 4), lm.Dense(5, 2)))
    seen = []

    def profiler(frame, event, arg):
        seen.append(event)

    sys.setprofile(profiler)
    try:
        with pytest.raises(CallFailed) as failed:
            calls(apply)(jax.eval_shape(init, jax.random.key(0)), None, jnp.ones((1, 3)))
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert failed.value.path == ("layers_1",) and isinstance(failed.value.error, ValueError)
