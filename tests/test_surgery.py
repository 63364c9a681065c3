"""lm.replace (submodules by a module filter) and lm.freeze (parameters by a variable filter)."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lamina as lm
from tests.helpers import normal


@pytest.fixture
def rng():
    return np.random.default_rng(0)


class Block(lm.Module):
    def __init__(self, size=4):
        self.dense = lm.Dense(size, size)
        self.norm = lm.LayerNorm(size)

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class EncoderDecoder(lm.Module):
    def __init__(self):
        self.encoder = lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 4))
        self.decoder = lm.Dense(4, 2)

    def __call__(self, x):
        return self.decoder(self.encoder(x))


class Tied(lm.Module):
    """One Dense reached by two paths."""

    def __init__(self):
        self.encoder = lm.Dense(4, 4)
        self.decoder = self.encoder

    def __call__(self, x):
        return self.decoder(jnp.tanh(self.encoder(x)))


class Wrap(lm.Module):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class Activation(lm.Module):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def lora(path, module):
    return lm.LoRA(module, rank=2)


def apply(model, variables, *args, **kwargs):
    return lm.transform(model).apply(variables, None, *args, **kwargs)[0]


def random_like(model, rng, scale=0.3):
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    return jax.tree.map(
        lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype), shapes
    )


# --- replace ----------------------------------------------------------------------------


def test_replace_wraps_dense_under_encoder_in_lora_and_leaves_the_rest(rng):
    model = EncoderDecoder()
    before = repr(model)
    calls = []

    def wrap(path, module):
        calls.append((path, type(module).__name__))
        return lm.LoRA(module, rank=2)

    where = lm.All(lm.Dense, lm.PathContains("encoder"))
    result = lm.replace(model, wrap, where=where)
    assert calls == [(("encoder", "layers_0"), "Dense"), (("encoder", "layers_2"), "Dense")]
    layers = result.encoder.layers
    assert [type(layers[0]), layers[1], type(layers[2])] == [lm.LoRA, lm.relu, lm.LoRA]
    assert type(result.decoder) is lm.Dense
    # the original is untouched, and the copy shares none of its modules or declarations
    assert repr(model) == before and type(model.encoder.layers_0) is lm.Dense
    assert result.decoder is not model.decoder
    assert result.encoder.layers_0.base is not model.encoder.layers_0
    variables = lm.transform(result).init(jax.random.key(0))
    assert shapes(variables["params"]["encoder"]["layers_0"]) == {
        "base": {"bias": (4,), "kernel": (3, 4)},
        "lora_a": (3, 2),
        "lora_b": (2, 4),
    }
    # with the adapters at zero (their init), the LoRA model computes the original one
    x = normal(rng, 5, 3)
    plain = {"params": copy.deepcopy(variables["params"])}
    for name in ("layers_0", "layers_2"):
        layer = plain["params"]["encoder"][name]
        plain["params"]["encoder"][name] = layer["base"]
    np.testing.assert_array_equal(apply(result, variables, x), apply(model, plain, x))


def test_replace_tied_module_is_replaced_once_and_stays_shared(rng):
    calls = []

    def wrap(path, module):
        calls.append(path)
        return lm.LoRA(module, rank=2)

    result = lm.replace(Tied(), wrap, where=lm.Dense)
    assert calls == [("encoder",)]
    assert result.encoder is result.decoder and type(result.encoder) is lm.LoRA
    variables = lm.transform(result).init(jax.random.key(0))
    assert sorted(variables["params"]) == ["encoder"]  # one set of variables, as before
    assert apply(result, variables, normal(rng, 2, 4)).shape == (2, 4)


def test_replace_tied_inside_a_list_and_a_dict():
    class Holder(lm.Module):
        def __init__(self):
            shared = lm.Dense(2, 2)
            self.items = [shared, lm.Dense(2, 2)]
            self.named = {"a": shared, "pair": (shared, 3)}

    result = lm.replace(Holder(), lora, where=lm.PathContains("items/0"))
    assert type(result.items[0]) is lm.LoRA and type(result.items[1]) is lm.Dense
    assert result.named["a"] is result.items[0] and result.named["pair"][0] is result.items[0]
    assert result.named["pair"][1] == 3


def test_replace_outermost_match_wins_and_fn_results_are_not_searched():
    model = lm.Sequential(Block(), Block())
    seen = []

    def rebuild(path, module):
        seen.append((path, type(module).__name__))
        return Wrap(module)  # holds the Block and its Dense: neither is searched again

    result = lm.replace(model, rebuild, where=(Block, lm.Dense))
    assert seen == [(("layers_0",), "Block"), (("layers_1",), "Block")]
    assert type(result.layers_0) is Wrap and type(result.layers_0.inner.dense) is lm.Dense


def test_replace_outermost_by_reachability_not_by_path():
    # the Dense comes first in walk order (its first path is "a"), but the Wrap holds it too
    class Model(lm.Module):
        def __init__(self):
            self.a = lm.Dense(2, 2)
            self.b = Wrap(self.a)

    seen = []
    result = lm.replace(Model(), lambda p, m: seen.append(p) or m, where=(Wrap, lm.Dense))
    assert seen == [("b",)]
    assert result.b.inner is result.a


def test_replace_modules_that_hold_each_other_take_the_first():
    model = Wrap(lm.Dense(2, 2))
    model.inner.back = model  # a cycle: each holds the other
    seen = []
    lm.replace(model, lambda p, m: seen.append(p) or m, where=(Wrap, lm.Dense))
    assert seen == [()]


def test_replace_the_root():
    model = lm.Dense(3, 2)
    result = lm.replace(model, lora, where=...)
    assert type(result) is lm.LoRA and result.base is not model
    assert type(model) is lm.Dense


def test_replace_fn_returning_the_module_keeps_it_in_a_copy():
    model = EncoderDecoder()
    result = lm.replace(model, lambda path, m: m, where=lm.Dense)
    assert repr(result) == repr(model) and result.decoder is not model.decoder


def test_replace_swaps_an_activation_and_inserts_dropout(rng):
    model = lm.Sequential(lm.Dense(3, 4), Activation(lm.relu), lm.Dense(4, 2))
    gelu = lm.replace(model, lambda p, m: Activation(lm.gelu), where=Activation)
    assert gelu.layers_1.fn is lm.gelu and model.layers_1.fn is lm.relu
    variables = lm.transform(model).init(jax.random.key(0))
    x = normal(rng, 2, 3)
    hidden = apply(model.layers_0, {"params": variables["params"]["layers_0"]}, x)
    expected = apply(model.layers_2, {"params": variables["params"]["layers_2"]}, lm.gelu(hidden))
    np.testing.assert_array_equal(apply(gelu, variables, x), expected)

    class DropoutAfter(lm.Module):
        def __init__(self, layer, rate):
            self.layer, self.rate = layer, rate

        def __call__(self, x, is_training=False):
            return lm.dropout(self.layer(x), self.rate, is_training)

    model = Wrap(lm.Dense(3, 4))
    dropped = lm.replace(model, lambda p, m: DropoutAfter(m, 0.5), where=lm.Dense)
    init, run = lm.transform(dropped)
    variables = init(jax.random.key(0))
    assert shapes(variables) == {"params": {"inner": {"layer": {"bias": (4,), "kernel": (3, 4)}}}}
    x = normal(rng, 8, 3)
    plain = {"params": {"inner": variables["params"]["inner"]["layer"]}}
    np.testing.assert_array_equal(run(variables, None, x)[0], apply(model, plain, x))
    y = run(variables, jax.random.key(1), x, is_training=True)[0]
    dense = apply(model, plain, x)
    assert np.all((y == 0) | np.isclose(y, 2 * dense)) and np.any(y == 0)


def test_replace_inside_a_stack_gives_stacked_adapters(rng):
    stack = lm.Stack(Block(4), 3)
    result = lm.replace(stack, lora, where=lm.Dense)
    assert type(result.block.dense) is lm.LoRA and type(stack.block.dense) is lm.Dense
    variables = lm.transform(result).init(jax.random.key(0))
    dense = variables["params"]["block"]["dense"]
    assert shapes(dense) == {
        "base": {"bias": (3, 4), "kernel": (3, 4, 4)},
        "lora_a": (3, 4, 2),
        "lora_b": (3, 2, 4),
    }
    x = normal(rng, 2, 4)
    original = {
        "params": {
            "block": {
                "dense": dense["base"],
                "norm": variables["params"]["block"]["norm"],
            }
        }
    }
    np.testing.assert_array_equal(apply(result, variables, x), apply(stack, original, x))
    # the adapters train: a nonzero lora_b changes the output
    dense["lora_b"] = jnp.ones_like(dense["lora_b"])
    assert not np.array_equal(apply(result, variables, x), apply(stack, original, x))


def test_replace_plain_attention_by_a_cached_one_decodes_with_the_old_params(rng):
    model = Wrap(lm.MultiHeadAttention(num_heads=2, in_size=8))
    batch, length = 2, 4

    def cached(path, mha):
        return lm.MultiHeadAttention(mha.num_heads, mha.in_size, decode_shape=(batch, length))

    decoder = lm.replace(model, cached, where=lm.MultiHeadAttention)
    params = random_like(model, rng)
    x = normal(rng, batch, length, 8)
    full = apply(model, params, x, causal=True)
    _, run = lm.transform(decoder)
    variables = {**params, "cache": lm.transform(decoder).init(jax.random.key(0))["cache"]}
    steps = []
    for t in range(length):
        y, variables = run(variables, None, x[:, t : t + 1], decode=True)
        steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-6)


def test_replace_composes_with_assign_merge_take_save_and_load(rng, tmp_path):
    model = EncoderDecoder()
    pretrained = random_like(model, rng)
    where = lm.All(lm.Dense, lm.PathContains("encoder"))
    result = lm.replace(lm.assign_variables(model, pretrained), lora, where=where)
    # assign_variables' values survive the surgery: init gives the pretrained base weights
    variables = lm.transform(result).init(jax.random.key(0))
    assert type(result.encoder.layers_2.base.kernel.init).__name__ == "Assigned"
    jax.tree.map(
        np.testing.assert_array_equal,
        variables["params"]["decoder"],
        pretrained["params"]["decoder"],
    )
    for name in ("layers_0", "layers_2"):
        jax.tree.map(
            np.testing.assert_array_equal,
            variables["params"]["encoder"][name]["base"],
            pretrained["params"]["encoder"][name],
        )
    # train the adapters a little (nonzero), then merge back to the original paths
    variables["params"]["encoder"]["layers_0"]["lora_b"] = 0.1 * jnp.ones((2, 4))
    merged_model, merged = lm.merge_lora(result, variables)
    assert shapes(merged) == shapes(pretrained)
    x = normal(rng, 3, 3)
    np.testing.assert_allclose(
        apply(merged_model, merged, x), apply(result, variables, x), rtol=1e-5, atol=1e-6
    )
    # take_variables of a replaced submodule
    taken = lm.take_variables(result, variables, result.encoder.layers_0)
    assert shapes(taken["params"]) == {
        "base": {"bias": (4,), "kernel": (3, 4)},
        "lora_a": (3, 2),
        "lora_b": (2, 4),
    }
    # a checkpoint of the replaced model loads into it (and into a fresh replace of it)
    lm.save(tmp_path / "lora.safetensors", variables)
    again = lm.replace(EncoderDecoder(), lora, where=where)
    loaded = lm.load(tmp_path / "lora.safetensors", again)
    jax.tree.map(np.testing.assert_array_equal, loaded, variables)


def test_replace_result_pickles_and_jits(rng):
    result = lm.replace(EncoderDecoder(), lora, where=lm.Dense)
    restored = pickle.loads(pickle.dumps(result))
    assert repr(restored) == repr(result)
    variables = lm.transform(restored).init(jax.random.key(0))
    x = normal(rng, 2, 3)
    jitted = jax.jit(lm.transform(restored).apply)(variables, None, x)[0]
    np.testing.assert_allclose(jitted, apply(result, variables, x), rtol=1e-6)


def test_replace_nothing_matched_says_what_the_model_holds():
    model = EncoderDecoder()
    with pytest.raises(
        ValueError,
        match=r"(?s)matches no module of EncoderDecoder.*"
        r"module types EncoderDecoder, Sequential, Dense.*"
        r"Did you mean lm.PathContains\('encoder'\)",
    ):
        lm.replace(model, lora, where=lm.PathContains("encodr"))
    with pytest.raises(ValueError, match=r"Did you mean lm.Dense\?"):
        lm.replace(model, lora, where=lm.DenseGeneral)
    with pytest.raises(ValueError, match=r"lm.PathContains\('decoder'\) \('kernel' names a var"):
        lm.replace(model, lora, where=lm.PathContains("decoder/kernel"))
    with pytest.raises(ValueError, match=r"(?s)matches no module.*Choose a filter that matches"):
        lm.replace(model, lora, where=lambda path, m: False)


def test_replace_argument_errors():
    model = EncoderDecoder()
    with pytest.raises(TypeError, match="selects variables, not modules"):
        lm.replace(model, lora, where="params")
    with pytest.raises(TypeError, match="selects variables, not modules"):
        lm.replace(model, lora, where=lm.Parameter)
    with pytest.raises(TypeError, match="positional argument"):
        lm.replace(model, lora, lm.Dense)  # where is keyword-only
    with pytest.raises(TypeError, match=r"lm.replace: 3 \(int\) is not a filter"):
        lm.replace(model, lora, where=3)
    with pytest.raises(TypeError, match=r"second argument, got int"):
        lm.replace(model, 3, where=lm.Dense)
    with pytest.raises(TypeError, match=r"takes an lm.Module .* got dict"):
        lm.replace({"params": {}}, lora, where=lm.Dense)
    with pytest.raises(TypeError, match=r"fn returned int 3 for the Dense at encoder/layers_0"):
        lm.replace(model, lambda path, m: 3, where=lm.Dense)


def test_replace_error_inside_fn_names_the_module():
    def bad(path, module):
        return lm.LoRA(module, rank=99)

    with pytest.raises(ValueError, match="rank must be at most") as info:
        lm.replace(EncoderDecoder(), bad, where=lm.Dense)
    assert "lm.replace's fn, called as fn(path, module), on the Dense at encoder/layers_0" in str(
        info.value.__notes__
    )


def test_replace_error_inside_a_where_function_names_the_module():
    with pytest.raises(AttributeError, match="kernel") as info:
        lm.replace(EncoderDecoder(), lora, where=lambda path, m: m.kernel.shape[0] == 3)
    assert "on the EncoderDecoder at <root>" in str(info.value.__notes__)


def test_replace_refuses_a_module_held_in_a_read_only_setting():
    model = lm.replace(EncoderDecoder(), lora, where=lm.PathContains("decoder"))
    with pytest.raises(ValueError, match=r"read-only setting LoRA.base of the LoRA at decoder"):
        lm.replace(model, lora, where=lm.Dense)
    # the suggested filter works
    where = lm.All(lm.Dense, lm.Not(lm.PathContains("base")))
    result = lm.replace(model, lora, where=where)
    assert type(result.encoder.layers_0) is lm.LoRA and type(result.decoder.base) is lm.Dense


def test_replace_that_breaks_a_stack_is_an_error_naming_replace():
    model = lm.Sequential(lm.Stack(Block(4), 2), lm.Dense(4, 4))
    kept = []

    def tie(path, module):  # puts the Stack's Dense outside the Stack too
        kept.append(module)
        return kept[0]

    with pytest.raises(ValueError, match="also reached") as info:
        lm.replace(model, tie, where=lm.Dense)
    assert "lm.replace built" in str(info.value.__notes__)


def test_replace_refuses_objects_of_the_model_given():
    model = EncoderDecoder()
    with pytest.raises(
        ValueError,
        match=r"for the Dense at encoder/layers_0 is the Dense at "
        r"decoder of the model given",
    ):
        lm.replace(model, lambda path, m: model.decoder, where=lm.PathContains("layers_0"))
    with pytest.raises(ValueError, match=r"holds, at base, the Dense at decoder of the model"):
        lm.replace(model, lambda path, m: lm.LoRA(model.decoder, rank=1), where=lm.Dense)
    # a new module shared by every replacement is fine: they are tied to it
    dropout = lm.Dropout(0.5)
    result = lm.replace(model, lambda path, m: lm.Sequential(m, dropout), where=lm.Dense)
    assert result.decoder.layers_1 is result.encoder.layers_0.layers_1 is dropout


# --- freeze -----------------------------------------------------------------------------


def loss_of(model):
    _, run = lm.transform(model)

    def loss(variables, x):
        return jnp.sum(run(variables, None, x)[0] ** 2)

    return loss


def test_freeze_keeps_every_attribute_and_the_original():
    model = lm.Dense(3, 2, kernel_sharding=("embed", "mlp"), param_dtype=jnp.bfloat16)
    model.kernel.tags = ("mine",)
    frozen = lm.freeze(model, where=lm.PathContains("kernel"))
    kernel = frozen.kernel
    assert type(kernel) is lm.FrozenParam and not isinstance(kernel, lm.Parameter)
    assert type(model.kernel) is lm.Parameter and model.kernel.tags == ("mine",)
    assert (kernel.collection, kernel.shape, kernel.dtype, kernel.param_dtype) == (
        "params",
        (3, 2),
        jnp.float32,
        jnp.bfloat16,
    )
    assert kernel.sharding == ("embed", "mlp") and kernel.tags == ("mine", "frozen")
    assert kernel.init is model.kernel.init and not kernel.mutable
    assert type(frozen.bias) is lm.Parameter
    # the same variables fit both models
    variables = lm.transform(model).init(jax.random.key(0))
    frozen_variables = lm.transform(frozen).init(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, frozen_variables, variables)
    assert lm.split(frozen, variables, "frozen", ...)[0]["params"].keys() == {"kernel"}


def test_freeze_grad_leaves_frozen_parameters_out(rng):
    model = EncoderDecoder()
    frozen = lm.freeze(model, where=lm.PathContains("encoder"))
    variables = random_like(model, rng)
    x = normal(rng, 2, 3)
    grads = lm.grad(loss_of(frozen), frozen)(variables, x)
    assert sorted(grads["params"]) == ["decoder"]
    expected = lm.grad(loss_of(model), model, lm.DiffState(0, lm.PathContains("decoder")))(
        variables, x
    )
    jax.tree.map(np.testing.assert_array_equal, grads, expected)
    assert lm.mask(frozen, variables, lm.Parameter)["params"]["encoder"]["layers_0"] == {
        "bias": False,
        "kernel": False,
    }


def test_freeze_adamw_leaves_frozen_arrays_bit_identical(rng):
    model = EncoderDecoder()
    frozen = lm.freeze(model, where=lm.PathContains("layers_0"))
    variables = random_like(model, rng)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    trainable, rest = lm.split(frozen, variables, lm.Parameter, ...)
    state = optimizer.init(trainable)
    grad = lm.grad(loss_of(frozen), frozen)

    @jax.jit
    def step(variables, state, x):
        grads = grad(variables, x)
        trainable, rest = lm.split(frozen, variables, lm.Parameter, ...)
        updates, state = optimizer.update(grads, state, trainable)
        return lm.merge(optax.apply_updates(trainable, updates), rest), state

    new = variables
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw is not strict-clean
        for _ in range(3):
            new, state = step(new, state, normal(rng, 4, 3))
    before, after = variables["params"]["encoder"], new["params"]["encoder"]
    jax.tree.map(np.testing.assert_array_equal, after["layers_0"], before["layers_0"])
    assert not np.array_equal(after["layers_2"]["kernel"], before["layers_2"]["kernel"])
    assert not np.array_equal(
        new["params"]["decoder"]["bias"], variables["params"]["decoder"]["bias"]
    )
    assert shapes(rest["params"]) == {"encoder": {"layers_0": {"bias": (4,), "kernel": (3, 4)}}}


def test_freeze_everything_but_the_adapters_matches_differentiating_the_adapters(rng):
    model = lm.replace(EncoderDecoder(), lora, where=lm.Dense)
    frozen = lm.freeze(model, where=lm.Not(lm.LoRAParam))
    variables = random_like(model, rng)
    x = normal(rng, 2, 3)
    grads = lm.grad(loss_of(frozen), frozen)(variables, x)
    expected = lm.grad(loss_of(model), model, lm.DiffState(0, lm.LoRAParam))(variables, x)
    assert shapes(grads) == shapes(expected)
    jax.tree.map(np.testing.assert_array_equal, grads, expected)
    # frozen adapters are FrozenParams too: no longer LoRAParams
    all_frozen = lm.freeze(model, where="params")
    assert type(all_frozen.decoder.lora_a) is lm.FrozenParam
    with pytest.raises(ValueError, match="selects no variable"):
        lm.split(all_frozen, variables, lm.LoRAParam, ...)
    # merge_lora still folds frozen adapters (it finds them by the LoRA, not by their type)
    merged_model, merged = lm.merge_lora(all_frozen, variables)
    np.testing.assert_allclose(
        apply(merged_model, merged, x), apply(model, variables, x), rtol=1e-5, atol=1e-6
    )


def test_freeze_tied_variable_once(rng):
    model = Tied()
    frozen = lm.freeze(model, where=lm.PathContains("kernel"))
    assert frozen.encoder.kernel is frozen.decoder.kernel
    assert type(frozen.decoder.kernel) is lm.FrozenParam
    assert frozen.encoder.kernel.tags == ("frozen",)
    grads = lm.grad(loss_of(frozen), frozen)(random_like(model, rng), normal(rng, 2, 4))
    assert shapes(grads) == {"params": {"encoder": {"bias": (4,)}}}


def test_freeze_pickles_and_refreezing_is_a_no_op():
    frozen = lm.freeze(EncoderDecoder(), where=lm.Dense)
    restored = pickle.loads(pickle.dumps(frozen))
    assert type(restored.decoder.kernel) is lm.FrozenParam
    assert restored.decoder.kernel.tags == ("frozen",)
    again = lm.freeze(restored, where="params")
    assert again.decoder.kernel.tags == ("frozen",) and repr(again) == repr(restored)


def test_freeze_in_a_stack_and_under_scan(rng):
    stack = lm.Stack(Block(4), 3)
    frozen = lm.freeze(stack, where=lm.Dense)
    variables = random_like(stack, rng)
    x = normal(rng, 2, 4)
    np.testing.assert_array_equal(apply(frozen, variables, x), apply(stack, variables, x))
    grads = lm.grad(loss_of(frozen), frozen)(variables, x)
    assert shapes(grads) == {"params": {"block": {"norm": {"bias": (3, 4), "scale": (3, 4)}}}}


@pytest.mark.parametrize(
    "make, args, kwargs",
    [
        (lambda: lm.RNN(lm.LSTMCell(3, 4)), ((2, 5, 3),), {}),
        (lambda: lm.MultiHeadAttention(num_heads=2, in_size=8), ((2, 3, 8),), {}),
        (
            lambda: lm.Sequential(lm.BatchNorm(3), lm.Conv(3, 2, (3,))),
            ((2, 5, 3),),
            {"is_training": False},
        ),
    ],
    ids=["lstm", "attention", "batchnorm-conv"],
)
def test_freeze_computes_what_the_unfrozen_layer_computes(rng, make, args, kwargs):
    model = make()
    frozen = lm.freeze(model, where=...)
    variables = random_like(model, rng)
    if "batch_stats" in variables:
        variables["batch_stats"] = jax.tree.map(
            lambda v: jnp.abs(v) + 0.5, variables["batch_stats"]
        )
    inputs = [normal(rng, *shape) for shape in args]
    np.testing.assert_array_equal(
        apply(frozen, variables, *inputs, **kwargs), apply(model, variables, *inputs, **kwargs)
    )


def test_freeze_then_load_a_checkpoint(rng, tmp_path):
    model = EncoderDecoder()
    variables = random_like(model, rng)
    lm.save(tmp_path / "plain.safetensors", variables)
    frozen = lm.freeze(model, where=lm.PathContains("encoder"))
    loaded = lm.load(tmp_path / "plain.safetensors", frozen)
    jax.tree.map(np.testing.assert_array_equal, loaded, variables)


def test_freeze_errors():
    model = EncoderDecoder()
    with pytest.raises(
        ValueError, match=r"(?s)selects no variable of EncoderDecoder.*Did you mean 'params'"
    ):
        lm.freeze(model, where="param")
    with pytest.raises(ValueError, match=r"(?s)selects no variable.*lm.PathContains\('encoder'\)"):
        lm.freeze(model, where=lm.PathContains("encodr"))
    with pytest.raises(
        ValueError, match=r"selects no parameter, only batch_stats/mean \(BatchStat\)"
    ):
        lm.freeze(lm.BatchNorm(3), where="batch_stats")
    with pytest.raises(TypeError, match="is not a filter"):
        lm.freeze(model, where=3.5)
    with pytest.raises(TypeError, match="positional argument"):
        lm.freeze(model, lm.Dense)  # keyword-only
    with pytest.raises(TypeError, match="where"):
        lm.freeze(model)  # required
    with pytest.raises(TypeError, match=r"lm.freeze takes an lm.Module .* got dict"):
        lm.freeze({"params": {}}, where="params")


def test_freeze_refuses_a_parameter_class_with_slots():
    class Slotted(lm.Parameter):
        __slots__ = ("extra",)

    model = lm.Dense(2, 3)
    model.kernel = Slotted((2, 3), lm.initializers.zeros())
    with pytest.raises(TypeError, match=r"cannot freeze the Slotted at params/kernel: .*__slots__"):
        lm.freeze(model, where=...)
    assert type(model.kernel) is Slotted


# --- frozen parameters under plain jax.grad, weight decay, filters that are not kinds -----


def frozen_mlp():
    model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    return lm.freeze(model, where=lm.PathContains("layers_0"))


def test_getting_started_loop_with_plain_jax_grad_leaves_frozen_arrays_bitwise(rng):
    # docs/getting-started.md's step: jax.value_and_grad over the whole variables dict + adam
    model = frozen_mlp()
    init, run = lm.transform(model)
    variables = init(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    x, y = normal(rng, 16, 4), jnp.arange(16) % 2

    def loss_fn(variables, x, y):
        logits, _ = run(variables, None, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(variables, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(variables, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, grads

    new, opt_state = variables, optimizer.init(variables)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-clean
        for _ in range(3):
            new, opt_state, grads = train_step(new, opt_state, x, y)
    frozen, trained = variables["params"]["layers_0"], variables["params"]["layers_2"]
    jax.tree.map(lambda g: np.testing.assert_array_equal(g, 0), grads["params"]["layers_0"])
    jax.tree.map(np.testing.assert_array_equal, new["params"]["layers_0"], frozen)
    assert not np.array_equal(new["params"]["layers_2"]["kernel"], trained["kernel"])


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: lm.RNN(lm.LSTMCell(3, 4)), (2, 5, 3)),
        (lambda: lm.MultiHeadAttention(num_heads=2, in_size=8), (2, 3, 8)),
    ],
    ids=["lstm", "attention"],
)
def test_fused_paths_give_zero_gradients_for_frozen_parameters(rng, make, shape):
    model = make()
    variables = random_like(model, rng)
    x = normal(rng, *shape)

    def gradient(model):
        _, run = lm.transform(model)
        return jax.grad(lambda v: jnp.sum(jnp.sin(run(v, None, x)[0])))(variables)

    frozen = lm.freeze(model, where=...)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(gradient(frozen)))
    assert all(np.any(np.asarray(g)) for g in jax.tree.leaves(gradient(model)))


def test_weight_decay_needs_the_trainable_parameters_or_a_mask(rng):
    model = frozen_mlp()
    variables = random_like(model, rng)
    x = normal(rng, 4, 4)
    loss = loss_of(model)

    grads = jax.grad(loss)(variables, x)  # plain jax.grad: zeros for the frozen arrays

    def train(optimizer):  # one step
        with jax.numpy_dtype_promotion("standard"):
            updates, _ = optimizer.update(grads, optimizer.init(variables), variables)
            return optax.apply_updates(variables, updates)["params"]

    before = variables["params"]
    # weight decay over the whole tree shrinks frozen arrays: it needs no gradient
    decayed = train(optax.adamw(1e-2, weight_decay=0.1))
    assert np.all(np.abs(decayed["layers_0"]["kernel"]) < np.abs(before["layers_0"]["kernel"]))
    # the documented mask keeps them bitwise; the rest trains
    mask = lm.mask(model, variables, lm.Parameter)
    masked = train(optax.adamw(1e-2, weight_decay=0.1, mask=mask))
    jax.tree.map(np.testing.assert_array_equal, masked["layers_0"], before["layers_0"])
    assert not np.array_equal(masked["layers_2"]["kernel"], before["layers_2"]["kernel"])


def test_filters_that_are_not_kinds_include_frozen_parameters(rng):
    model = frozen_mlp()
    variables = random_like(model, rng)
    x = normal(rng, 2, 4)
    loss = loss_of(model)
    by_class = lm.grad(loss, model, lm.DiffState(0, lm.Dense))(variables, x)
    assert sorted(by_class["params"]) == ["layers_0", "layers_2"]
    jax.tree.map(lambda g: np.testing.assert_array_equal(g, 0), by_class["params"]["layers_0"])
    # the documented idiom: lm.All(..., lm.Parameter) means the trainable ones
    trainable = lm.grad(loss, model, lm.DiffState(0, lm.All(lm.Dense, lm.Parameter)))(variables, x)
    jax.tree.map(np.testing.assert_array_equal, trainable, lm.grad(loss, model)(variables, x))
    assert sorted(trainable["params"]) == ["layers_2"]


def test_state_axes_by_kind_send_frozen_parameters_to_the_rest(rng):
    class Member(lm.Module):
        def __init__(self):
            self.dense = lm.Dense(4, 4)

        def __call__(self, x):
            return self.dense(x)

    class Shared(lm.Module):
        def __init__(self, axes):
            self.members = lm.Stack(Member(), 3)
            self.axes = axes

        def __call__(self, x):
            run = lm.vmap(lambda member, x: member(x), in_axes=(self.axes, None))
            return run(self.members.block, x)

    x = normal(rng, 2, 4)
    plain = Shared(lm.StateAxes({"params": 0, ...: None}))
    variables = random_like(plain, rng)
    frozen = lm.freeze(plain, where=lm.PathContains("kernel"))
    np.testing.assert_array_equal(apply(frozen, variables, x), apply(plain, variables, x))
    by_kind = lm.freeze(Shared(lm.StateAxes({lm.Parameter: 0, ...: None})), where=...)
    with pytest.raises(ValueError, match=r"is stored as \(3, 4.*but with axis None"):
        apply(by_kind, variables, x)


def test_merged_frozen_lora_says_where_trainable_parameters_come_from(rng):
    model = lm.Sequential(lm.Dense(4, 4), lm.relu, lm.Dense(4, 2))
    adapted = lm.freeze(lm.replace(model, lora, where=lm.Dense), where=lm.Not(lm.LoRAParam))
    variables = random_like(adapted, rng)
    merged_model, merged = lm.merge_lora(adapted, variables)
    assert type(merged_model.layers_0.kernel) is lm.FrozenParam
    x = normal(rng, 2, 4)
    with pytest.raises(
        ValueError,
        match=r"(?s)the filter Parameter selects no variable of Sequential.*"
        r"The parameters params/layers_0/kernel, .* are lm.FrozenParam \(made by lm.freeze, "
        r"kept by lm.merge_lora\).*lm.assign_variables\(unfrozen_model, variables\)",
    ) as info:
        lm.grad(loss_of(merged_model), merged_model)(merged, x)
    assert "Choose a filter that selects something" not in str(info.value)
    dense = lm.freeze(lm.Dense(2, 2, use_bias=False), where=...)
    with pytest.raises(ValueError, match=r"The parameter params/kernel is an lm.FrozenParam"):
        lm.mask(dense, lm.transform(dense).init(jax.random.key(0)), lm.Parameter)
    # the recipe: the merged values in the model before lm.replace train again
    trainable = lm.assign_variables(model, merged)
    grads = lm.grad(loss_of(trainable), trainable)(merged, x)
    assert shapes(grads) == shapes(merged)
    np.testing.assert_allclose(
        apply(trainable, merged, x), apply(adapted, variables, x), rtol=1e-5, atol=1e-6
    )


# --- argument checks: fn's arity, tied modules, Not matching the root ---------------------


def test_replace_checks_fn_is_called_with_path_and_module():
    model = EncoderDecoder()
    with pytest.raises(
        TypeError,
        match=r"fn is called as fn\(path, module\), so the Module class lm.LoRA would be built "
        r"as LoRA\(path, module\).*lambda path, m: lm.LoRA\(m, rank=4\)",
    ):
        lm.replace(model, lm.LoRA, where=lm.Dense)
    with pytest.raises(
        TypeError,
        match=r"fn is called as fn\(path, module\) .* but the fn given takes \(m\)\. For "
        r"example lm.replace\(model, lambda path, m: lm.LoRA\(m, rank=4\)",
    ):
        lm.replace(model, lambda m: lm.LoRA(m, rank=2), where=lm.Dense)
    # any signature that takes two arguments is fine
    result = lm.replace(model, lambda *args: lm.LoRA(args[1], rank=2), where=lm.Dense)
    assert type(result.decoder) is lm.LoRA


def test_a_tied_module_is_matched_at_its_first_path_and_the_error_says_so():
    tied = Tied()
    with pytest.raises(
        ValueError,
        match=r"(?s)matches no module of Tied.*'decoder' is the same object as 'encoder' "
        r"\(tied\): a module reached by several paths is matched at its first path only "
        r"\(encoder, not decoder\)\. Match it there: lm.PathContains\('encoder'\)",
    ):
        lm.replace(tied, lora, where=lm.PathContains("decoder"))
    with pytest.raises(ValueError, match=r"'decoder' is the same object as 'encoder'"):
        lm.replace(tied, lora, where=lambda path, m: path == ("decoder",))
    with pytest.raises(
        ValueError,
        match=r"(?s)selects no variable of Tied.*'decoder' is the same object as 'encoder' "
        r"\(tied\): a variable reached .* \(encoder/kernel, not decoder/kernel\)",
    ):
        lm.freeze(tied, where=lm.PathContains("decoder"))
    # one tied variable, not a tied module
    model = lm.Sequential(lm.Dense(2, 2), lm.Dense(2, 2))
    model.layers_1.kernel = model.layers_0.kernel
    with pytest.raises(ValueError, match=r"'layers_1/kernel' is the same object as 'layers_0/k"):
        lm.freeze(model, where=lm.All(lm.PathContains("layers_1"), lm.PathContains("kernel")))
    # an untied miss gets no such line
    with pytest.raises(ValueError) as info:
        lm.replace(tied, lora, where=lm.PathContains("head"))
    assert "same object" not in str(info.value)


def test_replace_where_not_matches_the_root():
    model = EncoderDecoder()
    seen = []
    result = lm.replace(model, lambda p, m: seen.append(p) or m, where=lm.Not(lm.Dense))
    assert seen == [()] and type(result) is EncoderDecoder
