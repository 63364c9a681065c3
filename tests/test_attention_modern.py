"""MultiHeadAttention's Llama-family options against transformers' attention modules.

Grouped-query heads, RoPE, bias on q/k/v only, RMS q/k norms and sliding windows, each
compared with the Hugging Face attention module of a tiny configuration given the same
(randomised) weights, HF's rotary embeddings and HF's own masks; then the decoding cache
(prefill, single steps, left padding), ``implementation="xla"`` against the plain path, and
the errors.
"""

from __future__ import annotations

import functools
import pickle
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

B, T, HIDDEN, HEADS, KV, D = 2, 12, 32, 4, 2, 8
COMMON = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=HEADS,
    num_key_value_heads=KV,
    head_dim=D,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

# name -> (model family, extra config, lamina options beyond the common ones)
VARIANTS = {
    "llama": ("llama", {}, dict(use_bias=False)),
    "llama_bias": ("llama", dict(attention_bias=True), dict(use_bias=True)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1), dict(use_bias=False, num_kv_heads=1)),
    "llama3_rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
        dict(use_bias=False),
    ),
    "qwen2": ("qwen2", {}, dict(use_bias=True, out_use_bias=False)),
    "qwen3": ("qwen3", {}, dict(use_bias=False, qk_norm="rms", qk_norm_eps=1e-5)),
    "mistral": ("mistral", dict(sliding_window=4), dict(use_bias=False, sliding_window=4)),
}
FAMILIES = {
    "llama": ("LlamaConfig", "llama.modeling_llama", "Llama"),
    "qwen2": ("Qwen2Config", "qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("Qwen3Config", "qwen3.modeling_qwen3", "Qwen3"),
    "mistral": ("MistralConfig", "mistral.modeling_mistral", "Mistral"),
}


def t2n(x):
    return x.detach().numpy()


@functools.cache
def hf_variant(name):
    """``(config, attention, rotary)``: HF's attention module with every weight randomised."""
    family, extra, _ = VARIANTS[name]
    config_name, module_path, prefix = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    modeling = __import__(f"transformers.models.{module_path}", fromlist=["x"])
    torch.manual_seed(0)
    attention = getattr(modeling, f"{prefix}Attention")(config, layer_idx=0).eval()
    with torch.no_grad():
        for pname, p in attention.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)  # HF inits norms to 1: would hide a missing scale
            else:
                p.normal_(0.0, 0.3)  # and biases to 0
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    return config, attention, rotary


def lamina_options(name, **more):
    """The MultiHeadAttention options of variant `name` (rope from the HF config's)."""
    config, _, _ = hf_variant(name)
    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" else params
    rope = lm.RotaryEmbedding(D, theta=theta, scaling=scaling)
    options = dict(num_kv_heads=config.num_key_value_heads, head_dim=D, rope=rope)
    return {**options, **VARIANTS[name][2], **more}


def lamina_params(attention, kv=KV):
    """HF's weights in lamina's layout (``(in, heads, head_dim)`` kernels)."""

    def kernel(linear, heads):
        return t2n(linear.weight).T.reshape(HIDDEN, heads, D)

    params = {
        "query": {"kernel": kernel(attention.q_proj, HEADS)},
        "key": {"kernel": kernel(attention.k_proj, kv)},
        "value": {"kernel": kernel(attention.v_proj, kv)},
        "out": {"kernel": t2n(attention.o_proj.weight).T.reshape(HEADS, D, HIDDEN)},
    }
    for key, linear, heads in (
        ("query", attention.q_proj, HEADS),
        ("key", attention.k_proj, kv),
        ("value", attention.v_proj, kv),
    ):
        if linear.bias is not None:
            params[key]["bias"] = t2n(linear.bias).reshape(heads, D)
    if attention.o_proj.bias is not None:
        params["out"]["bias"] = t2n(attention.o_proj.bias)
    if hasattr(attention, "q_norm"):
        params["query_norm"] = {"scale": t2n(attention.q_norm.weight)}
        params["key_norm"] = {"scale": t2n(attention.k_norm.weight)}
    return jax.tree.map(jnp.asarray, params)


def hf_forward(name, x, valid=None, positions=None):
    """HF's attention of `x` (NumPy ``(B, T, HIDDEN)``) with HF's causal (or window) mask."""
    config, attention, rotary = hf_variant(name)
    xt = torch.from_numpy(np.array(x))
    batch, length = x.shape[:2]
    if positions is None:
        positions = np.broadcast_to(np.arange(length), (batch, length))
    position_ids = torch.from_numpy(np.array(positions, np.int64))
    make = (
        masking_utils.create_sliding_window_causal_mask
        if getattr(config, "sliding_window", None)
        else masking_utils.create_causal_mask
    )
    mask = make(
        config=config,
        inputs_embeds=xt,
        attention_mask=None if valid is None else torch.from_numpy(np.array(valid, np.int64)),
        cache=None,
        position_ids=position_ids,
    )
    with torch.no_grad():
        out, _ = attention(xt, position_embeddings=rotary(xt, position_ids), attention_mask=mask)
    return t2n(out)


def normal(seed, shape):
    """Standard normal float32 test data, drawn by NumPy (a `jax.random` draw of each new
    shape compiles a program, about a CPU-second)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def bernoulli(seed, p, shape):
    return np.random.default_rng(seed).random(shape) < p


def inputs(seed=1, batch=B, length=T):
    return normal(seed, (batch, length, HIDDEN))


@functools.cache
def layer(name, **more):
    """``(mha, apply, variables)`` of variant `name`, HF's weights (and a cache for B, T)."""
    config, attention, _ = hf_variant(name)
    mha = lm.MultiHeadAttention(HEADS, HIDDEN, **lamina_options(name, **more))
    init, apply = lm.transform(mha)
    variables = init(jax.random.key(0))
    params = lamina_params(attention, config.num_key_value_heads)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, variables["params"])
    return mha, apply, {**variables, "params": params}


# --- each variant against transformers ---------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(name):
    x = inputs()
    _, apply, variables = layer(name)
    y, _ = apply(variables, None, jnp.asarray(x), causal=True)
    np.testing.assert_allclose(np.asarray(y), hf_forward(name, x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_left_padding_matches_transformers(name):
    """A (B, 1, 1, T) key-validity mask and HF's positions (cumsum - 1) give HF's outputs."""
    x = inputs(2)
    valid = np.ones((B, T), bool)
    valid[0, :3] = False  # row 0 is left-padded by 3
    positions = np.maximum(np.cumsum(valid, axis=-1) - 1, 0)
    _, apply, variables = layer(name)
    mask = jnp.asarray(valid[:, None, None, :])
    y, _ = apply(variables, None, jnp.asarray(x), causal=True, mask=mask, positions=positions)
    expected = hf_forward(name, x, valid=valid, positions=positions)
    np.testing.assert_allclose(np.asarray(y)[valid], expected[valid], atol=2e-5, rtol=1e-4)
    # The real tokens of the padded row equal that row alone (no window: Mistral counts
    # its window in slots, so padding shifts it, as HF's does).
    if name == "llama":
        alone, _ = apply(variables, None, jnp.asarray(x[:1, 3:]), causal=True)
        np.testing.assert_allclose(np.asarray(y)[0, 3:], np.asarray(alone)[0], atol=2e-6)


def test_window_masks_old_keys():
    """The window changes the result (12 > 4), and only from position 4 on."""
    x = jnp.asarray(inputs())
    _, apply, variables = layer("mistral")
    _, apply_full, _ = layer("llama")  # same shapes, no window
    windowed, _ = apply(variables, None, x, causal=True)
    full, _ = apply_full(variables, None, x, causal=True)
    np.testing.assert_allclose(windowed[:, :4], full[:, :4], atol=1e-6)
    assert np.abs(np.asarray(windowed[:, 4:] - full[:, 4:])).min() > 1e-4


# --- decoding ---------------------------------------------------------------------------------


def decode(apply, variables, x, prefill, **kwargs):
    """Prefill `prefill` positions in one call, then one position per call."""
    y, state = apply(variables, None, x[:, :prefill], decode=True, **kwargs)
    outs = [y]
    for t in range(prefill, x.shape[1]):
        y, state = apply(state, None, x[:, t : t + 1], decode=True)
        outs.append(y)
    return jnp.concatenate(outs, axis=1), state


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_decoding_equals_the_full_pass(name, implementation):
    x = jnp.asarray(inputs(3))
    _, apply, variables = layer(name, decode_shape=(B, T), implementation=implementation)
    full, _ = apply(variables, None, x, causal=True)
    stepped, state = decode(apply, variables, x, 7)
    np.testing.assert_allclose(stepped, full, atol=2e-6)
    assert state["cache"]["cached_key"].shape == (B, T, KV, D)  # num_kv_heads, not num_heads
    assert int(state["cache"]["cache_index"]) == T
    np.testing.assert_allclose(full, hf_forward(name, np.asarray(x)), atol=2e-5, rtol=1e-4)


def test_decoding_under_jit_compiles_one_step():
    x = jnp.asarray(inputs(4))
    _, apply, variables = layer("mistral", decode_shape=(B, T))
    traces = []

    @jax.jit
    def step(state, token):
        traces.append(token.shape)
        return apply(state, None, token, decode=True)

    y, state = jax.jit(lambda v, p: apply(v, None, p, decode=True))(variables, x[:, :7])
    outs = [y]
    for t in range(7, T):
        y, state = step(state, x[:, t : t + 1])
        outs.append(y)
    full, _ = apply(variables, None, x, causal=True)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-6)
    assert traces == [(B, 1, HIDDEN)]  # one compiled step served every position


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_left_padded_decoding(name):
    """Prefill of a left-padded prompt, then steps: as HF's full pass over the padded rows."""
    x = inputs(5)
    prompt = 7
    valid = np.ones((B, T), bool)
    valid[0, :3] = False
    positions = np.maximum(np.cumsum(valid, axis=-1) - 1, 0)
    _, apply, variables = layer(name, decode_shape=(B, T))
    mask = jnp.asarray(valid[:, None, None, :])  # the cache slots' validity
    y, state = apply(
        variables,
        None,
        jnp.asarray(x[:, :prompt]),
        decode=True,
        mask=mask,
        positions=positions[:, :prompt],
    )
    outs = [y]
    for t in range(prompt, T):
        step_x = jnp.asarray(x[:, t : t + 1])
        y, state = apply(
            state, None, step_x, decode=True, mask=mask, positions=positions[:, t : t + 1]
        )
        outs.append(y)
    stepped = np.asarray(jnp.concatenate(outs, axis=1))
    expected = hf_forward(name, x, valid=valid, positions=positions)
    np.testing.assert_allclose(stepped[valid], expected[valid], atol=2e-5, rtol=1e-4)


# --- implementation="xla" against the plain path ------------------------------------------------


@pytest.mark.parametrize(
    ("options", "call"),
    [
        (dict(num_kv_heads=2), dict(causal=True)),
        (dict(num_kv_heads=1, sliding_window=3), dict(causal=True)),
        (dict(num_kv_heads=2), dict(mask="heads")),
        (dict(num_kv_heads=4, sliding_window=5), dict(mask="keys", causal=True)),
        (dict(num_kv_heads=2), {}),
    ],
)
def test_xla_equals_plain(options, call):
    x = jnp.asarray(inputs(6))
    mask = {
        "heads": jnp.asarray(bernoulli(1, 0.7, (B, HEADS, T, T))),
        "keys": jnp.asarray(np.arange(T) >= 2)[None, None, None, :],
        None: None,
    }[call.pop("mask", None)]
    outs = []
    for implementation in (None, "xla"):
        mha = lm.MultiHeadAttention(HEADS, HIDDEN, implementation=implementation, **options)
        init, apply = lm.transform(mha)
        variables = init(jax.random.key(0))
        outs.append(apply(variables, None, x, mask=mask, **call)[0])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_xla_with_several_batch_axes_and_none():
    mha = lm.MultiHeadAttention(HEADS, 8, num_kv_heads=2, implementation="xla")
    plain = lm.MultiHeadAttention(HEADS, 8, num_kv_heads=2)
    variables = lm.transform(mha)[0](jax.random.key(0))
    for shape in ((3, 2, 5, 8), (5, 8)):
        x = jnp.asarray(normal(1, shape))
        mask = jnp.ones((*shape[:-2], 1, 5, 5), bool).at[..., 0, 1].set(False)
        a = lm.transform(mha)[1](variables, None, x, mask=mask, causal=True)[0]
        b = lm.transform(plain)[1](variables, None, x, mask=mask, causal=True)[0]
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_xla_in_bfloat16_under_strict_promotion():
    """jax.nn's bfloat16 path promotes implicitly inside; the layer runs it in strict mode."""
    options = dict(num_kv_heads=2, dtype=None, implementation="xla")
    init, apply = lm.transform(lm.MultiHeadAttention(HEADS, HIDDEN, **options))
    variables = init(jax.random.key(0))
    x = jnp.asarray(inputs(11))
    expected, _ = apply(variables, None, x, causal=True)
    half_mha = lm.MultiHeadAttention(HEADS, HIDDEN, param_dtype=jnp.bfloat16, **options)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    y, _ = lm.transform(half_mha)[1](half, None, x.astype(jnp.bfloat16), causal=True)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, atol=0.1, rtol=0.05)


# --- grouped heads elsewhere ------------------------------------------------------------------


def test_grouped_attention_equals_repeated_heads():
    """The grouped branch equals attention over keys and values repeated per group (HF's)."""
    q = jnp.asarray(normal(2, (B, 5, 6, 4)))
    k = jnp.asarray(normal(3, (B, 7, 2, 4)))
    v = jnp.asarray(normal(4, (B, 7, 2, 3)))
    mask = jnp.asarray(bernoulli(5, 0.7, (B, 6, 5, 7)))
    grouped = lm.dot_product_attention(q, k, v, mask=mask)
    repeated = lm.dot_product_attention(
        q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), mask=mask
    )
    np.testing.assert_allclose(grouped, repeated, atol=1e-6)
    weights = lm.dot_product_attention_weights(q, k, mask=mask)
    assert weights.shape == (B, 6, 5, 7)
    np.testing.assert_allclose(
        weights, lm.dot_product_attention_weights(q, jnp.repeat(k, 3, axis=2), mask=mask), atol=1e-7
    )


def test_other_attention_fn_gets_repeated_heads_and_weights_have_num_heads():
    seen = []

    def attention(query, key, value, mask=None):
        seen.append((query.shape, key.shape))
        return lm.dot_product_attention(query, key, value, mask=mask)

    x = jnp.asarray(inputs(7))
    own = lm.MultiHeadAttention(HEADS, HIDDEN, num_kv_heads=1)
    other = lm.MultiHeadAttention(HEADS, HIDDEN, num_kv_heads=1, attention_fn=attention)
    init, apply = lm.transform(own)
    variables = init(jax.random.key(0))
    y, new = apply({**variables, "intermediates": {}}, None, x, causal=True, sow_weights=True)
    z, _ = lm.transform(other)[1](variables, None, x, causal=True)
    np.testing.assert_allclose(z, y, atol=1e-6)
    assert seen == [((B, T, HEADS, HIDDEN // HEADS), (B, T, HEADS, HIDDEN // HEADS))]
    assert [w.shape for w in new["intermediates"]["attention_weights"]] == [(B, HEADS, T, T)]


def test_replaced_key_projection_has_kv_heads():
    """A module put in place of the key projection (a LoRA wrapper) maps to num_kv_heads."""
    mha = lm.MultiHeadAttention(HEADS, HIDDEN, num_kv_heads=2, head_dim=D)
    init, apply = lm.transform(mha)
    variables = init(jax.random.key(0))
    x = jnp.asarray(inputs(8))
    y, _ = apply(variables, None, x, causal=True)
    mha.key = lm.DenseGeneral(HIDDEN, (2, D))
    same, _ = lm.transform(mha)[1](variables, None, x, causal=True)
    np.testing.assert_allclose(same, y, atol=1e-6)
    mha.value = lm.DenseGeneral(HIDDEN, (HEADS, D))  # num_heads heads: refused
    init, apply = lm.transform(mha)
    with pytest.raises(ValueError, match=r"'value' projection.*needs \(2, 12, 2, 8\)"):
        apply(init(jax.random.key(0)), None, x, causal=True)


def test_lora_on_grouped_key_and_value_projections():
    """lm.LoRA wraps the (in, num_kv_heads, head_dim) projections; merging gives the same."""
    mha = lm.MultiHeadAttention(HEADS, HIDDEN, **lamina_options("qwen3", decode_shape=(B, T)))
    where = lm.Any(lm.PathContains("key"), lm.PathContains("value"))
    b_init = lm.initializers.normal(0.5)  # non-zero adapters, so that they count
    lora = lm.replace(mha, lambda p, m: lm.LoRA(m, 2, b_init=b_init), where=where)
    init, apply = lm.transform(lora)
    variables = init(jax.random.key(0))
    assert variables["params"]["key"]["lora_b"].shape == (2, KV, D)
    x = jnp.asarray(inputs(12))
    y, _ = apply(variables, None, x, causal=True)
    stepped, _ = decode(apply, variables, x, 7)
    np.testing.assert_allclose(stepped, y, atol=2e-6)
    merged, merged_variables = lm.merge_lora(lora, variables)
    z, _ = lm.transform(merged)[1](merged_variables, None, x, causal=True)
    np.testing.assert_allclose(z, y, atol=1e-5)
    params = dict(variables["params"])
    params["key"], params["value"] = params["key"]["base"], params["value"]["base"]
    base, _ = lm.transform(mha)[1]({**variables, "params": params}, None, x, causal=True)
    assert np.abs(np.asarray(base - y)).max() > 1e-3  # the adapters changed the result


def test_bfloat16_and_pickle():
    rope = lm.RotaryEmbedding(D)
    mha = lm.MultiHeadAttention(
        HEADS, HIDDEN, num_kv_heads=2, head_dim=D, rope=rope, qk_norm="rms", dtype=None,
        param_dtype=jnp.bfloat16, decode_shape=(B, T),
    )  # fmt: skip
    init, apply = lm.transform(mha)
    variables = init(jax.random.key(0))
    assert variables["cache"]["cached_key"].dtype == jnp.bfloat16
    x = jnp.asarray(inputs(9), jnp.bfloat16)
    y, _ = apply(variables, None, x, causal=True)
    assert y.dtype == jnp.bfloat16
    copy = pickle.loads(pickle.dumps(mha))
    z, _ = lm.transform(copy)[1](variables, None, x, causal=True)
    np.testing.assert_array_equal(np.asarray(z, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("where", [lm.MultiHeadAttention, ...])
def test_policy_adds_no_casts(where):
    """lm.with_policy (bfloat16 compute) only rewrites the dtypes: no boundary on the layer,
    every product in bfloat16, the result of the layer built in bfloat16 by hand."""
    from lamina._core.graph import Plan

    def build(dtype):
        return lm.MultiHeadAttention(
            HEADS, HIDDEN, num_kv_heads=2, head_dim=D, rope=lm.RotaryEmbedding(D),
            qk_norm="rms", use_bias=False, dtype=dtype, param_dtype=dtype, decode_shape=(B, T),
        )  # fmt: skip

    half = lm.with_policy(build(jnp.float32), lm.Policy("float32", "bfloat16"), where=where)
    assert "_lamina_boundary" not in vars(Plan(half).modules[0][1])
    init, apply = lm.transform(half)
    variables = init(jax.random.key(0))
    assert variables["params"]["key"]["kernel"].dtype == jnp.float32
    assert variables["cache"]["cached_key"].dtype == jnp.bfloat16
    x = jnp.asarray(inputs(10))
    y, _ = apply(variables, None, x, decode=True)
    assert y.dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda v, x: apply(v, None, x, decode=True)[0])(variables, x)

    def eqns(jaxpr):
        for e in jaxpr.eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from eqns(sub)

    dots = [tuple(v.aval.dtype.name for v in e.invars) for e in eqns(jaxpr.jaxpr)]
    dots = [
        d for d, e in zip(dots, eqns(jaxpr.jaxpr), strict=True) if e.primitive.name == "dot_general"
    ]
    assert dots and set(dots) == {("bfloat16", "bfloat16")}
    reference = lm.transform(build(jnp.bfloat16))[1]
    half_variables = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, variables
    )
    expected, _ = reference(half_variables, None, x.astype(jnp.bfloat16), decode=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


# --- errors -----------------------------------------------------------------------------------

ERRORS = [
    (dict(num_kv_heads=3), r"num_kv_heads=3 does not divide num_heads=4"),
    (dict(head_dim=8, qkv_size=16), r"qkv_size=16 and head_dim=8 disagree"),
    (dict(qk_norm="l2"), r"qk_norm must be None, 'layer'"),
    (dict(normalize_qk=True, qk_norm="rms"), r"normalize_qk=True asks for the 'layer'"),
    (dict(qk_norm_eps=0.0), r"qk_norm_eps must be > 0"),
    (dict(sliding_window=0), r"sliding_window"),
    (dict(implementation="flash"), r"implementation must be None"),
    (dict(implementation="xla", attention_fn=lambda q, k, v: q), r".*<lambda> is not the default"),
    (
        dict(implementation="xla", precision="highest"),
        r"implementation='xla' calls jax.nn.dot_product_attention.*precision=",
    ),
    (dict(rope=lambda x, p: x), r"rope must be an lm.RotaryEmbedding"),
    (dict(head_dim=8, rope=lm.RotaryEmbedding(4)), r"rope rotates vectors of head_dim=4"),
]


@pytest.mark.parametrize(("options", "match"), ERRORS)
def test_setting_errors(options, match):
    with pytest.raises((ValueError, TypeError), match=r"MultiHeadAttention: " + match):
        lm.MultiHeadAttention(HEADS, HIDDEN, **options)


@functools.cache
def small(**options):
    mha = lm.MultiHeadAttention(HEADS, HIDDEN, **options)
    init, apply = lm.transform(mha)
    return apply, init(jax.random.key(0))


CALL_ERRORS = [
    (dict(rope=lm.RotaryEmbedding(D)), dict(positions=np.arange(T - 1)), r"positions must be"),
    (
        dict(rope=lm.RotaryEmbedding(D)),
        dict(positions=np.zeros((B, T), np.float32)),
        r"positions must be integers .* got float32",
    ),
    ({}, dict(positions=np.arange(T)), r"positions were given, but this layer has no rope"),
    (
        dict(rope=lm.RotaryEmbedding(D)),
        dict(inputs_k=np.ones((B, 5, HIDDEN), np.float32)),
        r"rope rotates the queries and keys by the same positions",
    ),
    (dict(implementation="cudnn"), {}, r"implementation='cudnn' is cuDNN's .*needs an NVIDIA"),
    (dict(implementation="xla"), dict(sow_weights=True), r"sow_weights=True asks for the weights"),
    (
        dict(implementation="xla", dtype=None, param_dtype=jnp.float64),
        {},
        r"compute in float64, and jax.nn.dot_product_attention computes its softmax in float32",
    ),
    (
        dict(implementation="xla", dropout_rate=0.1),
        dict(is_training=True, dropout_rng=jax.random.key(0)),
        r"trains with dropout_rate=0.1, and jax.nn.dot_product_attention has no dropout",
    ),
]


@pytest.mark.parametrize(("options", "call", "match"), CALL_ERRORS)
def test_call_errors(options, call, match):
    if "cudnn" in str(options) and jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    call = dict(call)
    inputs_k = call.pop("inputs_k", None)
    with jax.enable_x64(options.get("param_dtype") == jnp.float64):
        mha = lm.MultiHeadAttention(HEADS, HIDDEN, **options)
        init, apply = lm.transform(mha)
        variables = init(jax.random.key(0))
        x = jnp.asarray(inputs(), mha.param_dtype)
        with pytest.raises(ValueError, match=match):
            apply(variables, None, x, inputs_k, causal=True, **call)


def test_xla_without_blockers_still_trains_without_dropout():
    """implementation with dropout_rate>0 applies when not training (no dropout then)."""
    apply, variables = small(implementation="xla", dropout_rate=0.1)
    plain_apply, _ = small(dropout_rate=0.1)
    x = jnp.asarray(inputs())
    np.testing.assert_allclose(
        apply(variables, None, x, causal=True)[0],
        plain_apply(variables, None, x, causal=True)[0],
        rtol=1e-6,
        atol=1e-6,
    )


# --- sliding windows need the causal mask; positions broadcast ----------------------------------


def test_window_without_causal_or_decode_is_an_error():
    """The window bounds past keys only: an encoder call would see every future key, a
    cross-attention one would mask almost nothing. Both are refused, naming the layer."""
    apply, variables = small(sliding_window=3, decode_shape=(B, T))
    x = jnp.asarray(inputs())
    match = (
        r"MultiHeadAttention at the root: sliding_window=3 bounds the past keys only.*"
        r"Call with causal=True \(or decode=True\); for a two-sided window.*pass a mask"
    )
    with pytest.raises(ValueError, match=match):
        apply(variables, None, x)  # an encoder
    with pytest.raises(ValueError, match=match):
        apply(variables, None, x[:, :2], x)  # cross-attention
    with pytest.raises(ValueError, match=match):
        apply(variables, None, x, mask=jnp.ones((B, 1, 1, T), bool))
    apply(variables, None, x, causal=True)  # allowed
    apply(variables, None, x, decode=True)
    stack = lm.Stack(lm.MultiHeadAttention(HEADS, HIDDEN, sliding_window=2), 2)
    init_s, apply_s = lm.transform(stack)
    with pytest.raises(ValueError, match=r"at block: sliding_window=2 bounds the past keys"):
        apply_s(init_s(jax.random.key(0)), None, x)


def test_positions_broadcast_along_the_batch_axes():
    """HF's default position_ids are (1, q_length) for any batch: they broadcast."""
    apply, variables = small(rope=lm.RotaryEmbedding(D))
    x = jnp.asarray(inputs())
    row = 2 * np.arange(T)[None] + 3  # not a shift of 0, 1, ... (rope is relative)
    y, _ = apply(variables, None, x, causal=True, positions=row)
    each, _ = apply(variables, None, x, causal=True, positions=np.repeat(row, B, axis=0))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(each))
    shifted, _ = apply(variables, None, x, causal=True)  # rope actually uses them
    assert np.abs(np.asarray(y - shifted)).max() > 1e-3
    # several batch axes: (1, 1, T) and (2, 1, T) broadcast to (2, B, T)
    x2 = jnp.stack([x, 2 * x])
    y2, _ = apply(variables, None, x2, causal=True, positions=row[None])
    np.testing.assert_array_equal(np.asarray(y2[0]), np.asarray(y))
    apply(variables, None, x2, causal=True, positions=np.stack([row, row]))


@pytest.mark.parametrize(
    "positions",
    [
        np.zeros((B, 1), np.int32),  # the length axis does not broadcast (one start per row)
        np.zeros((3, T), np.int32),
        np.zeros((1, B, T), np.int32),  # more axes than (batch, q_length)
        np.zeros((1, T), np.float32),
        np.zeros((1, T), bool),
    ],
)
def test_positions_that_do_not_broadcast_are_errors(positions):
    apply, variables = small(rope=lm.RotaryEmbedding(D))
    match = (
        r"MultiHeadAttention at the root: positions must be integers of shape "
        rf"\(batch\.\.\., q_length\) = \({B}, {T}\), or one that broadcasts to it along the "
        rf"batch axes .* got {np.dtype(positions.dtype).name}\d* of shape "
        + re.escape(str(positions.shape))
    )
    with pytest.raises(ValueError, match=match):
        apply(variables, None, jnp.asarray(inputs()), causal=True, positions=positions)


# --- left padding + window + decoding past the window, against HF's own cached decoding --------


def test_left_padded_window_decoding_matches_mistral_cached_decoding():
    """MistralModel (eager, DynamicCache) decodes prompts of 5 and 3 real tokens (left padded)
    for 5 steps past a window of 3; its attention's outputs at every step are lamina's."""
    from transformers import MistralConfig, MistralModel
    from transformers.cache_utils import DynamicCache

    hidden, window, prompt, steps = 16, 3, 5, 5
    config = MistralConfig(
        **{**COMMON, "hidden_size": hidden, "head_dim": 4, "intermediate_size": 32},
        sliding_window=window,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = MistralModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    attention = model.layers[0].self_attn
    seen = []
    attention.register_forward_hook(
        lambda mod, args, kw, out: seen.append((t2n(kw["hidden_states"]), t2n(out[0]))),
        with_kwargs=True,
    )
    real = np.array([[1] * 5, [0, 0, 1, 1, 1]])
    ids = torch.randint(0, COMMON["vocab_size"], (B, prompt + steps))
    cache = DynamicCache(config=config)
    with torch.no_grad():
        full = torch.from_numpy(real)
        model(
            input_ids=ids[:, :prompt],
            attention_mask=full,
            position_ids=(full.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
        )
        for s in range(steps):
            full = torch.cat([full, torch.ones(B, 1, dtype=full.dtype)], -1)
            model(
                input_ids=ids[:, prompt + s : prompt + s + 1],
                attention_mask=full,
                position_ids=full.sum(-1, keepdim=True) - 1,
                cache=cache,
                use_cache=True,
            )
    assert len(seen) == 1 + steps

    def kernel(linear, heads):
        return jnp.asarray(t2n(linear.weight).T.reshape(hidden, heads, 4))

    mha = lm.MultiHeadAttention(
        HEADS,
        hidden,
        num_kv_heads=KV,
        head_dim=4,
        rope=lm.RotaryEmbedding(4, theta=config.rope_parameters["rope_theta"]),
        use_bias=False,
        sliding_window=window,
        decode_shape=(B, prompt + steps),
    )
    init, apply = lm.transform(mha)
    variables = init(jax.random.key(0))
    variables["params"] = {
        "query": {"kernel": kernel(attention.q_proj, HEADS)},
        "key": {"kernel": kernel(attention.k_proj, KV)},
        "value": {"kernel": kernel(attention.v_proj, KV)},
        "out": {"kernel": jnp.asarray(t2n(attention.o_proj.weight).T.reshape(HEADS, 4, hidden))},
    }
    valid = np.zeros((B, prompt + steps), bool)
    valid[:, :prompt] = real
    x, expected = seen[0]
    y, variables = apply(
        variables,
        None,
        jnp.asarray(x),
        decode=True,
        mask=jnp.asarray(valid[:, None, None, :]),
        positions=np.maximum(np.cumsum(real, -1) - 1, 0),
    )
    np.testing.assert_allclose(np.asarray(y)[real == 1], expected[real == 1], atol=2e-5)
    for s in range(steps):
        valid[:, prompt + s] = True
        x, expected = seen[1 + s]
        y, variables = apply(
            variables,
            None,
            jnp.asarray(x),
            decode=True,
            mask=jnp.asarray(valid[:, None, None, :]),
            positions=valid.sum(-1, keepdims=True) - 1,
        )
        np.testing.assert_allclose(np.asarray(y), expected, atol=2e-5, rtol=1e-4)
