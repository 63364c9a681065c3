"""`lamina.models.CausalLM` against transformers' PyTorch models given the same weights.

Every tiny random checkpoint of `tests/hf_models.py` (Llama with three RoPE variants, Mistral
with a window of 4, Qwen2's biases, Qwen3's q/k norms, Gemma, a sharded and a bfloat16 file)
is read with `lamina.models.from_pretrained` and must give transformers' logits: the full
forward, a left-padded batch, and the decoding cache (prefill, then one token per call),
eagerly and under `jax.jit`, with both attention implementations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lamina as lm
from lamina.models import CausalLM, ModelConfig
from lamina.models.llama import DecoderBlock, init_cache
from tests.hf_models import CASES, reference

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.fast_compile  # tests/conftest.py

F32_CASES = [name for name in CASES if name != "llama_bf16"]

# bfloat16 keeps 8 significant bits (a relative step of 2**-8 = 0.4%): the two libraries
# round the same operations in different places (lamina scales the queries before the
# product, transformers the product; the fused q/k/v projections round once per output),
# and a rounding flip in a layer moves a logit by about one bfloat16 step of its magnitude
# (|logits| < 2 here, a step of 2**-7). Two layers of such flips stay within 0.05.
BF16_ATOL = 0.05

_APPLY: dict[tuple, object] = {}


def jitted_apply(model):
    """One `jax.jit(apply)` per model build (config, dtypes, cache, implementation)."""
    key = (repr(model.config), model.dtype, model.param_dtype, model.decode_shape)
    key += (model.implementation,)
    if key not in _APPLY:
        _APPLY[key] = jax.jit(lm.transform(model).apply, static_argnames=("decode",))
    return _APPLY[key]


def ids_for(model, shape, seed=0):
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, shape)


def torch_logits(torch_model, ids, mask=None, positions=None):
    with torch.no_grad():
        out = torch_model(
            torch.tensor(np.asarray(ids)),
            attention_mask=None if mask is None else torch.tensor(np.asarray(mask, np.int64)),
            position_ids=None if positions is None else torch.tensor(np.asarray(positions)),
        )
    return out.logits.float().numpy()


def assert_logits(got, expected, bf16=False):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    if bf16:
        np.testing.assert_allclose(got, expected, atol=BF16_ATOL, rtol=0)
    else:
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


# --- full forward ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(hf_model, name):
    model, variables, torch_model = hf_model(name)
    ids = ids_for(model, (2, 12))  # 12 > Mistral's window of 4
    everything = jnp.ones((2, 12), bool)  # a mask: the program the padded tests reuse
    logits, _ = jitted_apply(model)(variables, None, jnp.asarray(ids), mask=everything)
    bf16 = name == "llama_bf16"
    assert logits.dtype == (jnp.bfloat16 if bf16 else jnp.float32)
    assert_logits(logits, torch_logits(torch_model, ids), bf16)


def test_bf16_error_is_transformers_own_rounding(hf_model, hf_checkpoint):
    """The bf16 tolerance, justified: lamina's bf16 logits are as far from the float32
    logits of the same weights as transformers' bf16 logits are (both are rounding), and
    in float32 the two libraries agree to float32 tolerance."""
    model, variables, torch_bf16 = hf_model("llama_bf16")
    folder, _ = hf_checkpoint("llama_bf16")
    ids = ids_for(model, (2, 12))
    exact = torch_logits(reference(folder, "float32"), ids)
    wide = CausalLM(model.config, param_dtype=jnp.float32)
    wide_variables = jax.tree.map(lambda a: a.astype(jnp.float32), variables)
    assert_logits(jitted_apply(wide)(wide_variables, None, jnp.asarray(ids))[0], exact)
    narrow, _ = jitted_apply(model)(variables, None, jnp.asarray(ids))
    ours = np.abs(np.asarray(narrow, np.float32) - exact).max()
    theirs = np.abs(torch_logits(torch_bf16, ids) - exact).max()
    assert 0 < ours < 2 * theirs < BF16_ATOL


def test_left_padded_rows_equal_each_row_alone(hf_model):
    model, variables, torch_model = hf_model("mistral")  # window: slot coordinates
    apply = jitted_apply(model)
    long, short = ids_for(model, (12,), 1), ids_for(model, (7,), 2)
    ids = np.stack([long, np.concatenate([np.zeros(5, np.int64), short])])
    mask = np.stack([np.ones(12, bool), np.arange(12) >= 5])
    logits, _ = apply(variables, None, jnp.asarray(ids), mask=jnp.asarray(mask))
    alone_long, _ = apply(variables, None, jnp.asarray(long[None]))
    alone_short, _ = jitted_apply(model)(variables, None, jnp.asarray(short[None]))
    np.testing.assert_allclose(logits[0], alone_long[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(logits[1, 5:], alone_short[0], atol=2e-5, rtol=1e-4)
    # transformers' generate gives the padded batch these positions and this mask.
    positions = np.where(mask, np.cumsum(mask, -1) - 1, 0)
    expected = torch_logits(torch_model, ids, mask, positions)
    assert_logits(logits[0], expected[0])
    assert_logits(logits[1, 5:], expected[1, 5:])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_stack_holds_every_layer(hf_model, name):
    model, variables, _ = hf_model(name)
    layers = variables["params"]["layers"]["block"]
    n = model.config.num_layers
    assert layers["attention"]["query"]["kernel"].shape == (n, 32, 4, 8)
    assert layers["attention"]["key"]["kernel"].shape == (n, 32, 2, 8)
    assert layers["mlp"]["gate"]["kernel"].shape == (n, 32, 64)
    assert ("query_norm" in layers["attention"]) == (name == "qwen3")


# --- the decoding cache ------------------------------------------------------------------


def decode_in_steps(model, variables, ids, mask, prefill, apply=None):
    """Logits of a prefill of `prefill` tokens, then one token per call."""
    decoder = model.with_cache(ids.shape[0], ids.shape[1] + 3)
    apply = apply or jitted_apply(decoder)
    state = {**variables, **init_cache(decoder)}
    first, state = apply(
        state, None, jnp.asarray(ids[:, :prefill]), mask=jnp.asarray(mask[:, :prefill]), decode=True
    )
    steps = [first]
    for t in range(prefill, ids.shape[1]):
        logits, state = apply(state, None, jnp.asarray(ids[:, t : t + 1]), decode=True)
        steps.append(logits)
    assert int(state["cache"]["cache_index"]) == ids.shape[1]
    return jnp.concatenate(steps, axis=1), state


def padded_batch(model):
    ids = ids_for(model, (2, 12), 3)
    ids[1, :3] = 0
    mask = np.stack([np.ones(12, bool), np.arange(12) >= 3])
    return ids, mask


# The cases whose cache differs: a window (slot coordinates), bfloat16. The others run the
# same cache code as "llama" (their full forward is checked above), and every float32
# architecture decodes with the cache in tests/test_generate.py, to transformers' tokens.
CACHE_CASES = ["llama", "mistral", "llama_bf16"]


@pytest.mark.parametrize("name", CACHE_CASES)
def test_cache_prefill_then_steps_equal_the_full_forward(hf_model, name):
    model, variables, torch_model = hf_model(name)
    ids, mask = padded_batch(model)
    full, _ = jitted_apply(model)(variables, None, jnp.asarray(ids), mask=jnp.asarray(mask))
    stepped, state = decode_in_steps(model, variables, ids, mask, prefill=7)
    real = np.broadcast_to(mask[:, :, None], full.shape)
    bf16 = name == "llama_bf16"
    tolerance = dict(atol=BF16_ATOL, rtol=0) if bf16 else dict(atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(
        np.where(real, np.asarray(stepped, np.float32), 0),
        np.where(real, np.asarray(full, np.float32), 0),
        **tolerance,
    )
    np.testing.assert_array_equal(state["cache"]["token_counts"], mask.sum(-1))
    np.testing.assert_array_equal(state["cache"]["key_valid"][:, :12], mask)


def test_cache_steps_eagerly(small):
    """Without jit (the cache index is concrete: the bounds check runs before anything)."""
    model, variables = small
    ids = ids_for(model, (2, 6), 3)
    mask = np.stack([np.ones(6, bool), np.arange(6) >= 2])
    full, _ = lm.transform(model).apply(variables, None, jnp.asarray(ids), mask=jnp.asarray(mask))
    decoder = model.with_cache(2, 9)
    stepped, _ = decode_in_steps(model, variables, ids, mask, 5, lm.transform(decoder).apply)
    np.testing.assert_allclose(stepped[0], full[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(stepped[1, 2:], full[1, 2:], atol=2e-5, rtol=1e-4)


def test_xla_attention_equals_the_plain_path(hf_model):
    """jax.nn.dot_product_attention's path, on Mistral: grouped heads, a window, padding."""
    model, variables, _ = hf_model("mistral")
    fused = CausalLM(model.config, param_dtype=model.param_dtype, implementation="xla")
    ids, mask = padded_batch(model)
    plain, _ = jitted_apply(model)(variables, None, jnp.asarray(ids), mask=jnp.asarray(mask))
    got, _ = jitted_apply(fused)(variables, None, jnp.asarray(ids), mask=jnp.asarray(mask))
    np.testing.assert_allclose(got[0], plain[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got[1, 3:], plain[1, 3:], atol=2e-5, rtol=1e-4)
    stepped, _ = decode_in_steps(fused, variables, ids, mask, prefill=7)
    np.testing.assert_allclose(stepped[0], plain[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(stepped[1, 3:], plain[1, 3:], atol=2e-5, rtol=1e-4)


def test_cache_layout_and_init_cache(hf_model):
    model, variables, _ = hf_model("llama")
    decoder = model.with_cache(3, 10)
    cache = init_cache(decoder)["cache"]
    assert cache["key_valid"].shape == (3, 10) and cache["key_valid"].dtype == jnp.bool_
    assert cache["token_counts"].shape == (3,) and cache["cache_index"].shape == ()
    attention = cache["layers"]["block"]["attention"]
    assert attention["cached_key"].shape == (2, 3, 10, 2, 8)  # (layers, batch, len, kv, dim)
    assert attention["cached_key"].dtype == jnp.float32
    abstract = jax.eval_shape(lm.transform(decoder).init, jax.random.key(0))["cache"]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == jax.tree.map(
        lambda a: (a.shape, a.dtype), abstract
    )
    bf16, _, _ = hf_model("llama_bf16")
    bf16_cache = init_cache(bf16.with_cache(1, 4))["cache"]["layers"]["block"]["attention"]
    assert bf16_cache["cached_value"].dtype == jnp.bfloat16


# --- errors ------------------------------------------------------------------------------


def tiny(**changes):
    config = ModelConfig(
        "llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    return dataclasses.replace(config, **changes)


@pytest.fixture(scope="module")
def small():
    """A tiny model and variables (NumPy values: nothing to compile)."""
    model = CausalLM(tiny())
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.3).astype(s.dtype), shapes)
    return model, variables


def test_decode_without_a_cache_is_an_error(small):
    model, variables = small
    with pytest.raises(ValueError, match=r"decode=True needs a decoding cache.*with_cache"):
        lm.transform(model).apply(variables, None, jnp.ones((1, 2), jnp.int32), decode=True)


def test_decode_with_another_batch_is_an_error(small):
    model, variables = small
    decoder = model.with_cache(2, 4)
    state = {**variables, **init_cache(decoder)}
    with pytest.raises(ValueError, match=r"batch of 3 sequences, but the cache holds 2"):
        lm.transform(decoder).apply(state, None, jnp.ones((3, 2), jnp.int32), decode=True)


def test_decoding_past_max_length_is_an_error(small):
    model, variables = small
    decoder = model.with_cache(1, 4)
    apply = jax.jit(lm.transform(decoder).apply, static_argnames=("decode",))
    prompt = jnp.ones((1, 3), jnp.int32)
    _, state = apply({**variables, **init_cache(decoder)}, None, prompt, decode=True)
    eager = lm.transform(decoder).apply  # the index is concrete: refused before anything runs
    with pytest.raises(
        ValueError, match=r"past max_length: 3 tokens are cached and this call adds 2"
    ):
        eager(state, None, jnp.ones((1, 2), jnp.int32), decode=True)
    # The refused step changed nothing: one more token fits, and then none.
    _, state = apply(state, None, jnp.ones((1, 1), jnp.int32), decode=True)
    assert int(state["cache"]["cache_index"]) == 4
    with pytest.raises(Exception, match=r"decoding past max_length"):  # traced: at run time
        jax.block_until_ready(apply(state, None, jnp.ones((1, 1), jnp.int32), decode=True))


@pytest.mark.parametrize(
    ("ids", "mask", "error", "match"),
    [
        (np.ones((1, 3), np.float32), None, TypeError, r"integer token ids, got dtype float32"),
        (np.ones((3,), np.int32), None, ValueError, r"shape \(batch, length\).*ids\[None\]"),
        (np.ones((1, 0), np.int32), None, ValueError, r"length >= 1"),
        (np.ones((1, 3), np.int32), np.ones((1, 3), np.int32), TypeError, r"mask must be bool"),
        (np.ones((1, 3), np.int32), np.ones((1, 2), bool), ValueError, r"ids' shape \(1, 3\)"),
        (np.full((1, 3), 16), None, ValueError, r"got id 16"),
    ],
)
def test_bad_inputs_are_errors(small, ids, mask, error, match):
    model, variables = small
    with pytest.raises(error, match=match):
        lm.transform(model).apply(variables, None, ids, mask=mask)


def test_bad_settings_are_errors():
    with pytest.raises(TypeError, match=r"config must be a lamina.models.ModelConfig"):
        CausalLM({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"decode_shape must be \(batch, max_length\)"):
        CausalLM(tiny(), decode_shape=(2,))
    with pytest.raises(ValueError, match=r"batch"):
        CausalLM(tiny()).with_cache(0, 4)


def test_with_cache_copies_the_model_as_it_is():
    """Changes made after the model was built are kept (a policy, a replaced layer); each
    attention's cache follows its compute dtype; a cache it had is replaced; the model
    itself is not changed."""
    model = CausalLM(tiny())
    policy = lm.Policy(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
    half = lm.with_policy(model, policy).with_cache(1, 4)
    attention = init_cache(half)["cache"]["layers"]["block"]["attention"]
    assert attention["cached_key"].dtype == jnp.bfloat16
    assert half.layers.block.attention.dtype == jnp.bfloat16
    model.final_norm = lm.LayerNorm(8)
    decoder = model.with_cache(2, 6)
    assert type(decoder.final_norm).__name__ == "LayerNorm"
    again = decoder.with_cache(3, 5)
    shapes = jax.tree.map(jnp.shape, init_cache(again))["cache"]
    assert shapes["key_valid"] == (3, 5)
    assert shapes["layers"]["block"]["attention"]["cached_value"] == (1, 3, 5, 1, 4)
    assert decoder.decode_shape == (2, 6) and decoder.layers.block.attention.decode_shape == (2, 6)
    assert model.decode_shape is None and model.layers.block.attention.decode_shape is None
    params = jax.eval_shape(lm.transform(model).init, jax.random.key(0))["params"]
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(
        jnp.shape, jax.eval_shape(lm.transform(again).init, jax.random.key(0))["params"]
    )


def test_init_cache_of_a_model_without_one_is_an_error():
    with pytest.raises(ValueError, match=r"declares no decoding cache.*with_cache"):
        init_cache(CausalLM(tiny()))
    with pytest.raises(TypeError, match=r"init_cache takes an lm.Module"):
        init_cache("model")


def test_pickled_model_and_the_block_alone(small):
    import pickle

    model, variables = small
    again = pickle.loads(pickle.dumps(model.with_cache(2, 6)))
    assert again.decode_shape == (2, 6) and again.config == model.config
    assert jax.tree.map(jnp.shape, init_cache(again)) == jax.tree.map(
        jnp.shape, init_cache(model.with_cache(2, 6))
    )
    block = DecoderBlock(tiny(sliding_window=2, qkv_bias=True, qk_norm=True))
    shapes = jax.eval_shape(lm.transform(block).init, jax.random.key(0))["params"]["attention"]
    assert shapes["query"]["bias"].shape == (2, 4) and shapes["key"]["bias"].shape == (1, 4)
    assert shapes["query_norm"]["scale"].shape == (4,)


def test_logical_axis_names_for_shardings():
    model = CausalLM(tiny(vocab_size=16, num_heads=2, num_kv_heads=2, qkv_bias=True))
    mesh = jax.sharding.AbstractMesh((2,), ("model",))
    rules = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    specs = lm.shardings(model, mesh, rules)["params"]
    block = specs["layers"]["block"]
    assert block["attention"]["query"]["kernel"].spec == P(None, None, "model", None)
    assert block["attention"]["key"]["kernel"].spec == P(None, None, "model", None)
    assert block["attention"]["key"]["bias"].spec == P(None, "model", None)
    assert block["attention"]["out"]["kernel"].spec == P(None, "model", None, None)
    assert block["mlp"]["gate"]["kernel"].spec == P(None, None, "model")
    assert block["mlp"]["down"]["kernel"].spec == P(None, "model", None)
    assert specs["embed"]["embedding"].spec == P("model", None)
    assert specs["lm_head"]["kernel"].spec == P(None, "model")


# --- logits_to_keep ----------------------------------------------------------------------


def test_logits_to_keep_equals_the_last_positions_of_the_full_logits(hf_model):
    """transformers' int ``logits_to_keep``: the full logits' last positions (None, 0 or
    more than the length: all), padded rows included; and transformers' own figures."""
    model, variables, torch_model = hf_model("llama")
    ids, mask = padded_batch(model)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    plain = ids_for(model, (2, 12), 5)
    keeps = [(1, 1), (5, 5), (12, 12), (40, 12), (0, 12), (None, 12)]
    apply = lm.transform(model).apply

    @jax.jit
    def every_keep(variables, ids, mask, plain):
        """One program for every value: under jit each call traces its own (Python int)
        logits_to_keep, as a static argument does, and the shared forward is compiled once."""
        kept = [apply(variables, None, ids, mask=mask, logits_to_keep=k)[0] for k, _ in keeps]
        return kept, apply(variables, None, plain, logits_to_keep=3)[0]

    full, _ = jitted_apply(model)(variables, None, ids, mask=mask)
    every, got = every_keep(variables, ids, mask, jnp.asarray(plain))
    for (keep, kept), got_kept in zip(keeps, every, strict=True):
        assert got_kept.shape == (2, kept, model.config.vocab_size), keep
        np.testing.assert_allclose(got_kept, full[:, 12 - kept :], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        expected = torch_model(torch.tensor(plain), logits_to_keep=3).logits.numpy()
    assert expected.shape == got.shape
    assert_logits(got, expected)


def test_logits_to_keep_in_a_prefill_keeps_the_same_cache(small):
    model, variables = small
    decoder = model.with_cache(2, 8)
    apply = lm.transform(decoder).apply
    ids = jnp.asarray(ids_for(model, (2, 5), 4))
    mask = jnp.asarray(np.stack([np.ones(5, bool), np.arange(5) >= 2]))
    fresh = {**variables, **init_cache(decoder)}
    full, state = apply(fresh, None, ids, mask=mask, decode=True)
    last, kept_state = apply(fresh, None, ids, mask=mask, decode=True, logits_to_keep=1)
    assert last.shape == (2, 1, 16)
    np.testing.assert_allclose(last, full[:, -1:], atol=1e-6, rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, kept_state["cache"], state["cache"])
    # A step after it: one position, whatever logits_to_keep says (1 or more)
    step, _ = apply(kept_state, None, ids[:, :1], decode=True, logits_to_keep=4)
    assert step.shape == (2, 1, 16)


@pytest.mark.parametrize(
    ("keep", "error", "match"),
    [
        (-1, ValueError, r"logits_to_keep must be >= 0 .*got -1"),
        (1.0, TypeError, r"logits_to_keep must be a Python int .*got float 1.0"),
        (True, TypeError, r"logits_to_keep must be a Python int .*got bool True"),
        (np.ones(1, np.int32), TypeError, r"logits_to_keep must be a Python int .*ndarray"),
    ],
)
def test_bad_logits_to_keep_is_an_error(small, keep, error, match):
    model, variables = small
    with pytest.raises(error, match=match):
        lm.transform(model).apply(variables, None, jnp.ones((1, 3), jnp.int32), logits_to_keep=keep)


def test_a_traced_logits_to_keep_says_to_make_it_static(small):
    model, variables = small
    apply = jax.jit(lm.transform(model).apply)
    with pytest.raises(TypeError, match=r"static_argnames=\('logits_to_keep',\)"):
        apply(variables, None, jnp.ones((1, 3), jnp.int32), logits_to_keep=1)
