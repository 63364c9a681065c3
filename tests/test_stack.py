"""`Stack`: the stacked layout is the plan's; the block the user gave stays as it was."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina._core.graph import Plan
from tests.helpers import assert_close

pytestmark = pytest.mark.fast_compile  # tests/conftest.py


def affine(x, kernel, bias):
    return x @ kernel + bias[None, :]


def run_dense_copies(x, params):
    """What a Stack of Dense layers computes: the copies in sequence, by hand."""
    for kernel, bias in zip(params["kernel"], params["bias"], strict=True):
        x = affine(x, kernel, bias)
    return x


def maybe_jit(apply, jit):
    return jax.jit(apply) if jit else apply


@pytest.mark.parametrize("jit", [False, True])
def test_a_discarded_stack_leaves_its_block_as_declared(jit):
    block = lm.Dense(4, 4)
    lm.Stack(block, 4)
    assert block.kernel.shape == (4, 4)
    init, apply = lm.transform(block)
    variables = init(jax.random.key(0))
    assert variables["params"]["kernel"].shape == (4, 4)
    x = jnp.arange(8.0).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    params = variables["params"]
    assert_close(y, affine(x, params["kernel"], params["bias"]))


@pytest.mark.parametrize("jit", [False, True])
def test_a_block_planned_alone_has_its_declared_shapes(jit):
    stack = lm.Stack(lm.Sequential(lm.Dense(4, 4), lm.tanh), 3)
    variables = lm.transform(stack).init(jax.random.key(0))
    assert variables["params"]["block"]["layers_0"]["kernel"].shape == (3, 4, 4)
    init, apply = lm.transform(stack.block)
    alone = init(jax.random.key(1))
    assert alone["params"]["layers_0"]["kernel"].shape == (4, 4)
    x = jnp.ones((2, 4))
    y, _ = maybe_jit(apply, jit)(alone, None, x)
    params = alone["params"]["layers_0"]
    assert_close(y, jnp.tanh(affine(x, params["kernel"], params["bias"])))


def test_the_stacked_layout_lives_in_the_plan():
    inner = lm.Dense(4, 4)
    stack = lm.Stack(inner, 3, depth_sharding="layers")
    assert "_lamina_axes" not in vars(inner.kernel)
    assert "_lamina_axis_names" not in vars(inner.kernel)
    entry = {e.name: e for e in Plan(stack).variables}["params/block/kernel"]
    assert entry.axes == (3,)
    assert entry.axis_names == ("layers",)
    assert entry.shape == (3, 4, 4)
    assert Plan(inner).variables[0].axes == ()


class TwoStacks(lm.Module):
    def __init__(self):
        block = lm.Dense(4, 4)
        self.first = lm.Stack(block, 2)
        self.second = lm.Stack(block, 3)

    def __call__(self, x):
        return self.second(self.first(x))


def test_one_block_in_two_stacks_is_an_error_naming_both_paths():
    expected = (
        r"Dense at first/block \(inside the Stack at first\) is also reached at second/block "
        r"\(inside the Stack at second\).*copy.deepcopy"
    )
    with pytest.raises(ValueError, match=expected):
        lm.transform(TwoStacks())


class StackedAndDirect(lm.Module):
    def __init__(self, direct_first):
        block = lm.Dense(4, 4)
        if direct_first:
            self.direct = block
            self.stack = lm.Stack(block, 2)
        else:
            self.stack = lm.Stack(block, 2)
            self.direct = block

    def __call__(self, x):
        return self.direct(self.stack(x))


def test_a_block_used_inside_and_outside_its_stack_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"at stack/block \(inside the Stack at stack\) is also "
        r"reached at direct \(outside any Stack\)",
    ):
        lm.transform(StackedAndDirect(direct_first=False))
    with pytest.raises(
        ValueError,
        match=r"at direct \(outside any Stack\) is also reached at "
        r"stack/block \(inside the Stack at stack\)",
    ):
        lm.transform(StackedAndDirect(direct_first=True))


class TiedIntoAStack(lm.Module):
    def __init__(self):
        self.embed = lm.Dense(4, 4)
        self.stack = lm.Stack(lm.Dense(4, 4), 2)
        self.stack.block.kernel = self.embed.kernel  # one variable, two layouts

    def __call__(self, x):
        return self.stack(self.embed(x))


def test_a_variable_tied_into_a_stack_from_outside_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"Parameter at embed/kernel \(outside any Stack\) is "
        r"also reached at stack/block/kernel \(inside the Stack at stack\)",
    ):
        lm.transform(TiedIntoAStack())


class SharedStack(lm.Module):
    def __init__(self):
        self.encoder = lm.Stack(lm.Dense(4, 4), 3)
        self.again = self.encoder  # the whole Stack shared: tied, as any module

    def __call__(self, x):
        return self.again(self.encoder(x))


@pytest.mark.parametrize("jit", [False, True])
def test_a_whole_stack_may_be_shared(jit):
    init, apply = lm.transform(SharedStack())
    variables = init(jax.random.key(0))
    assert list(variables["params"]) == ["encoder"]
    params = variables["params"]["encoder"]["block"]
    x = jnp.ones((2, 4))
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    assert_close(y, run_dense_copies(run_dense_copies(x, params), params), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_nested_stacks_compose_their_axes_outer_first(jit):
    inner = lm.Stack(lm.Dense(4, 4), 3, depth_sharding="inner")
    outer = lm.Stack(inner, 2, depth_sharding="outer")
    entries = {e.name: e for e in Plan(outer).variables}
    kernel = entries["params/block/block/kernel"]
    assert kernel.axes == (2, 3)
    assert kernel.axis_names == ("outer", "inner")
    assert Plan(inner).variables[1].axes == (3,)  # the inner Stack alone: its own axis only
    init, apply = lm.transform(outer)
    variables = init(jax.random.key(0))
    params = variables["params"]["block"]["block"]
    assert params["kernel"].shape == (2, 3, 4, 4)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    expected = x
    for i in range(2):
        expected = run_dense_copies(expected, jax.tree.map(lambda a, i=i: a[i], params))
    assert_close(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_a_copy_of_a_block_runs_alone_on_its_slice(jit):
    stack = lm.Stack(lm.Dense(4, 4), 3)
    init, apply = lm.transform(stack)
    variables = init(jax.random.key(0))
    sliced = lm.take_variables(stack, variables, stack.block)
    assert sliced["params"]["kernel"].shape == (3, 4, 4)  # the model's layout: every copy
    _, apply_block = lm.transform(stack.block)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    for i in range(3):
        copy_i = jax.tree.map(lambda a, i=i: a[i], sliced)
        y, _ = maybe_jit(apply_block, jit)(copy_i, None, x)
        assert_close(y, affine(x, sliced["params"]["kernel"][i], sliced["params"]["bias"][i]))


def test_the_stacked_slice_given_to_the_block_alone_says_to_take_a_copy():
    stack = lm.Stack(lm.Dense(4, 4), 3)
    variables = lm.transform(stack).init(jax.random.key(0))
    sliced = lm.take_variables(stack, variables, stack.block)
    _, apply_block = lm.transform(stack.block)
    expected = (
        r"params/kernel: expected \(4, 4\), got \(3, 4, 4\)(.|\n)*leading axes \(3,\)(.|\n)*"
        r"jax.tree.map\(lambda a: a\[i\], variables\)"
    )
    with pytest.raises(lm.VariablesError, match=expected):
        apply_block(sliced, None, jnp.ones((2, 4)))


def test_put_variables_into_a_block_wants_the_stacked_layout():
    stack = lm.Stack(lm.Dense(4, 4), 3)
    variables = lm.transform(stack).init(jax.random.key(0))
    sliced = lm.take_variables(stack, variables, stack.block)
    doubled = jax.tree.map(lambda a: 2 * a, sliced)
    new = lm.put_variables(stack, variables, stack.block, doubled)
    assert_close(new["params"]["block"]["kernel"], 2 * variables["params"]["block"]["kernel"])
    one_copy = jax.tree.map(lambda a: a[0], sliced)
    with pytest.raises(
        lm.VariablesError, match=r"inside the Stack at <root>(.|\n)*leading axes \(3,\)"
    ):
        lm.put_variables(stack, variables, stack.block, one_copy)


@pytest.mark.parametrize("jit", [False, True])
def test_a_layer_replaced_inside_a_stacked_block(jit):
    stack = lm.Stack(lm.Sequential(lm.Dense(4, 4), lm.tanh), 3)
    stack.block.layers_0 = lm.Dense(4, 4, use_bias=False)
    init, apply = lm.transform(stack)
    variables = init(jax.random.key(0))
    kernels = variables["params"]["block"]["layers_0"]["kernel"]
    assert kernels.shape == (3, 4, 4)
    assert not np.allclose(kernels[0], kernels[1])  # one draw per copy
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    expected = x
    for kernel in kernels:
        expected = jnp.tanh(expected @ kernel)
    assert_close(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_lora_added_inside_a_stacked_block_and_merged(jit):
    stack = lm.Stack(lm.Sequential(lm.Dense(4, 4), lm.tanh), 3)
    stack.block.layers_0 = lm.LoRA(stack.block.layers_0, rank=2, b_init=lm.initializers.normal())
    init, apply = lm.transform(stack)
    variables = init(jax.random.key(0))
    params = variables["params"]["block"]["layers_0"]
    assert params["lora_a"].shape == (3, 4, 2)
    assert params["lora_b"].shape == (3, 2, 4)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    scale, base = stack.block.layers_0.scale, params["base"]
    expected = x
    for i in range(3):
        update = scale * expected @ params["lora_a"][i] @ params["lora_b"][i]
        expected = jnp.tanh(affine(expected, base["kernel"][i], base["bias"][i]) + update)
    assert_close(y, expected, rtol=1e-5, atol=1e-5)
    merged, merged_variables = lm.merge_lora(stack, variables)
    assert merged_variables["params"]["block"]["layers_0"]["kernel"].shape == (3, 4, 4)
    y_merged, _ = maybe_jit(lm.transform(merged).apply, jit)(merged_variables, None, x)
    assert_close(y_merged, y, rtol=1e-5, atol=1e-5)


def test_a_value_assigned_to_a_block_declaration_is_every_copys():
    stack = lm.Stack(lm.Dense(2, 2), 3)
    stack.block.kernel.value = np.array([[1.0, 2.0], [3.0, 4.0]])
    kernels = lm.transform(stack).init(jax.random.key(0))["params"]["block"]["kernel"]
    assert kernels.shape == (3, 2, 2)
    np.testing.assert_array_equal(kernels, np.broadcast_to([[1.0, 2.0], [3.0, 4.0]], (3, 2, 2)))
    with pytest.raises(ValueError, match=r"declared with shape \(2, 2\)(.|\n)*lm.assign_variables"):
        stack.block.kernel.value = np.ones((3, 2, 2))


def test_stacked_values_assigned_to_a_model_do_not_fit_its_block_alone():
    stack = lm.Stack(lm.Dense(2, 2), 3)
    variables = lm.transform(stack).init(jax.random.key(0))
    assigned = lm.assign_variables(stack, variables)
    again = lm.transform(assigned).init(jax.random.key(1))
    np.testing.assert_array_equal(
        again["params"]["block"]["kernel"], variables["params"]["block"]["kernel"]
    )
    with pytest.raises(
        ValueError,
        match=r"params/bias holds an assigned value of shape \(3, 2\)(.|\n)*one copy's value",
    ):
        lm.transform(assigned.block).init(jax.random.key(0))


def test_a_deep_copy_of_the_block_may_be_stacked_beside_it():
    block = lm.Dense(4, 4)

    class Both(lm.Module):
        def __init__(self):
            self.stack = lm.Stack(copy.deepcopy(block), 2)
            self.direct = block

        def __call__(self, x):
            return self.direct(self.stack(x))

    variables = lm.transform(Both()).init(jax.random.key(0))
    assert variables["params"]["stack"]["block"]["kernel"].shape == (2, 4, 4)
    assert variables["params"]["direct"]["kernel"].shape == (4, 4)


class Scale(lm.Module):
    def __init__(self, init=None):
        super().__init__()
        self.g = lm.Parameter((4,), init or lm.initializers.normal(1.0))

    def __call__(self, x):
        return x * self.g[None, :]


class Encoder(lm.Stack):
    """A Stack subclass with a layer of its own after the copies."""

    def __init__(self, block, n):
        super().__init__(block, n)
        self.gain = Scale()

    def __call__(self, x):
        return self.gain(super().__call__(x))


@pytest.mark.parametrize("jit", [False, True])
def test_a_stack_subclass_stacks_only_its_block(jit):
    init, apply = lm.transform(Encoder(lm.Dense(4, 4), 3))
    variables = init(jax.random.key(0))
    params = variables["params"]
    assert params["gain"]["g"].shape == (4,)
    assert params["block"]["kernel"].shape == (3, 4, 4)
    x = jnp.arange(8.0).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    assert y.shape == (2, 4)
    assert_close(y, run_dense_copies(x, params["block"]) * params["gain"]["g"][None, :])
    plan = Plan(Encoder(lm.Dense(4, 4), 3))
    assert {e.name: e.axes for e in plan.variables} == {
        "params/block/bias": (3,),
        "params/block/kernel": (3,),
        "params/gain/g": (),
    }


class CallsTheBlock(lm.Module):
    """Calls a Stack's block directly: every copy's variables at once."""

    def __init__(self):
        super().__init__()
        self.s = lm.Stack(Scale(), 2)

    def __call__(self, x):
        return self.s.block(x)


@pytest.mark.parametrize("jit", [False, True])
def test_a_stacked_block_called_outside_its_stack_is_an_error(jit):
    init, apply = lm.transform(CallsTheBlock())
    variables = init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"Parameter at params/s/block/g is stored as \(2, 4\) \(stacked axes \(2,\) "
        r"in front of its declared shape \(4,\)\).*the Stack at 's'.*call it through the "
        r"Stack.*lm\.vmap or lm\.scan over the block with axis 0",
    ):
        maybe_jit(apply, jit)(variables, None, jnp.ones((2, 4)))


class Penalised(lm.Module):
    """Reads its Stack's variables from its own method: every copy, as one array."""

    def __init__(self):
        super().__init__()
        self.stack = lm.Stack(lm.Dense(4, 4), 3)
        self.head = lm.Dense(4, 2)

    def __call__(self, x):
        return self.head(self.stack(x))

    def penalty(self):
        return jnp.sum(self.stack.block.kernel.value**2)

    def loss(self, x):
        return jnp.sum(self(x)) + 0.1 * self.penalty()


@pytest.mark.parametrize("jit", [False, True])
def test_a_parent_reads_its_stacks_variables_as_every_copy(jit):
    net = Penalised()
    variables = lm.transform(net).init(jax.random.key(0))
    kernel = variables["params"]["stack"]["block"]["kernel"]
    assert kernel.shape == (3, 4, 4)
    apply = lm.transform(net, to_callable=lambda m: m.penalty).apply
    penalty, _ = maybe_jit(apply, jit)(variables, None)
    assert_close(penalty, jnp.sum(kernel**2))

    loss = lm.transform(net, to_callable=lambda m: m.loss).apply
    x = jnp.arange(8.0).reshape(2, 4)
    grads = maybe_jit(jax.grad(lambda v: loss(v, None, x)[0]), jit)(variables)
    head = variables["params"]["head"]["kernel"]
    head_bias = variables["params"]["head"]["bias"]
    bias = variables["params"]["stack"]["block"]["bias"]

    def by_hand(kernel):
        h = x
        for i in range(3):
            h = h @ kernel[i] + bias[i][None]
        return jnp.sum(h @ head + head_bias[None]) + 0.1 * jnp.sum(kernel**2)

    assert_close(grads["params"]["stack"]["block"]["kernel"], jax.grad(by_hand)(kernel))


def test_a_parent_calling_the_stacks_block_code_is_still_an_error():
    class ReadsInBlock(lm.Module):
        def __init__(self):
            super().__init__()
            self.s = lm.Stack(lm.Dense(4, 4), 3)

        def __call__(self, x):
            return self.s.block(x)

    init, apply = lm.transform(ReadsInBlock())
    variables = init(jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"params/s/block/kernel is stored as \(3, 4, 4\).*the Stack at 's'"
    ):
        apply(variables, None, jnp.ones((2, 4)))


@pytest.mark.parametrize("jit", [False, True])
def test_an_inner_stacks_block_called_inside_the_outer_stack_is_an_error(jit):
    class Outer(lm.Module):
        def __init__(self):
            super().__init__()
            self.s = lm.Stack(lm.Stack(Scale(), 3), 2)

        def __call__(self, x):
            return lm.scan(
                lambda inner, x: inner.block(x), in_axes=(0, lm.Carry), out_axes=lm.Carry
            )(self.s.block, x)

    init, apply = lm.transform(Outer())
    variables = init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"params/s/block/block/g is stored as \(2, 3, 4\).*still holds 1 of those "
        r"axes, shape \(3, 4\).*the Stack at 's/block'",
    ):
        maybe_jit(apply, jit)(variables, None, jnp.ones((2, 4)))


@pytest.mark.parametrize("jit", [False, True])
def test_a_stacked_block_mapped_over_its_copies_reads_one_copy(jit):
    class Ensemble(lm.Module):
        def __init__(self):
            super().__init__()
            self.s = lm.Stack(Scale(), 3)

        def __call__(self, x):
            return lm.vmap(lambda m, x: m(x), in_axes=(0, None))(self.s.block, x)

    init, apply = lm.transform(Ensemble())
    variables = init(jax.random.key(0))
    x = jnp.arange(8.0).reshape(2, 4)
    y, _ = maybe_jit(apply, jit)(variables, None, x)
    g = variables["params"]["s"]["block"]["g"]
    assert_close(y, x[None] * g[:, None, :])


@pytest.mark.parametrize("jit", [False, True])
def test_a_stack_of_decoding_attention_blocks_writes_its_stacked_cache(jit):
    """Each copy's cache gets the leading axis; decoding in steps gives the full pass, and
    layer i's cached keys are what its block alone writes from layer i - 1's outputs."""
    block = lm.MultiHeadAttention(
        4, 8, num_kv_heads=2, rope=lm.RotaryEmbedding(2), sliding_window=3, decode_shape=(2, 6)
    )
    stack = lm.Stack(block, 3)
    init, apply = lm.transform(stack)
    apply = jax.jit(apply, static_argnames=("causal", "decode")) if jit else apply
    variables = init(jax.random.key(0))
    cache = variables["cache"]["block"]
    assert cache["cached_key"].shape == cache["cached_value"].shape == (3, 2, 6, 2, 2)
    assert cache["cache_index"].shape == (3,)
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    full, _ = apply(variables, None, x, causal=True)
    y, state = apply(variables, None, x[:, :4], decode=True)  # prefill 4, then 2 steps
    outs = [y]
    for t in (4, 5):
        y, state = apply(state, None, x[:, t : t + 1], decode=True)
        outs.append(y)
    assert_close(jnp.concatenate(outs, axis=1), full, atol=1e-5)
    written = state["cache"]["block"]
    np.testing.assert_array_equal(written["cache_index"], [6, 6, 6])
    # By hand: each copy alone on its slice, decoding the whole sequence in one step.
    _, apply_block = lm.transform(stack.block)
    sliced = lm.take_variables(stack, variables, stack.block)
    h = x
    for i in range(3):
        copy_i = jax.tree.map(lambda a, i=i: a[i], sliced)
        h, alone = apply_block(copy_i, None, h, decode=True)
        assert_close(alone["cache"]["cached_key"], written["cached_key"][i], atol=1e-5)
    assert_close(h, full, atol=1e-5)
