"""Rotary position embeddings against transformers' (frequencies, rotation, layouts, errors)."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

HEAD_DIM = 8
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
VARIANTS = {
    "default": (10_000.0, None),
    "default_llama3_theta": (500_000.0, None),
    "linear": (10_000.0, {"rope_type": "linear", "factor": 2.0}),
    "legacy_linear": (10_000.0, {"type": "linear", "factor": 4.0}),
    "llama3": (500_000.0, LLAMA3),
    "llama3_wide": (10_000.0, {**LLAMA3, "original_max_position_embeddings": 64}),
}


def llama_config(theta, scaling, head_dim=HEAD_DIM, **extra):
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_theta": theta}
        params["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    params.update(extra)
    return transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=128,
        rope_parameters=params,
    )


def hf_frequencies(theta, scaling, **extra):
    config = llama_config(theta, scaling, **extra)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, factor = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            config
        )
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    assert factor == 1.0
    return inv_freq.numpy()


@pytest.mark.parametrize("name", VARIANTS)
def test_frequencies_equal_transformers_bitwise(name):
    theta, scaling = VARIANTS[name]
    ours = lm.rope_frequencies(HEAD_DIM, theta=theta, scaling=scaling)
    assert ours.dtype == np.float32 and ours.shape == (HEAD_DIM // 2,)
    np.testing.assert_array_equal(ours, hf_frequencies(theta, scaling))
    # the module holds the same
    np.testing.assert_array_equal(
        lm.RotaryEmbedding(HEAD_DIM, theta=theta, scaling=scaling).inv_freq, ours
    )


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0, 1_000_000.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_real_head_dims_are_within_one_ulp_of_transformers(head_dim, theta):
    """PyTorch's float32 pow is not always correctly rounded: 1 ulp apart at most."""
    ours = lm.rope_frequencies(head_dim, theta=theta)
    np.testing.assert_array_max_ulp(ours, hf_frequencies(theta, None, head_dim=head_dim), 1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_has_all_three_bands_and_equals_transformers(head_dim):
    theta, scaling = 500_000.0, {**LLAMA3, "original_max_position_embeddings": 8192}
    ours = lm.rope_frequencies(head_dim, theta=theta, scaling=scaling)
    np.testing.assert_array_equal(ours, hf_frequencies(theta, scaling, head_dim=head_dim))
    plain = lm.rope_frequencies(head_dim, theta=theta)
    kept, divided = ours == plain, np.isclose(ours, plain / 8.0, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_llama3_at_head_dim_8_hits_all_three_bands():
    # wavelengths 2pi, 63, 628, 6283 against the bands' edges 64/4 = 16 and 64/1 = 64 (with
    # original_max_position_embeddings=16 the first, 2pi, is already past 16/4: no kept band)
    theta, scaling = VARIANTS["llama3_wide"]
    ours = lm.rope_frequencies(HEAD_DIM, theta=theta, scaling=scaling)
    plain = lm.rope_frequencies(HEAD_DIM, theta=theta)
    kept, divided = ours == plain, np.isclose(ours, plain / 8.0, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


LLAMA3_GRID = [
    (head_dim, theta, factor, low, high, original)
    for head_dim in (32, 128)
    for theta in (10_000.0, 500_000.0)
    for factor in (2.0, 8.0, 32.0)
    for low, high in ((1.0, 4.0), (0.5, 1.0), (2.0, 5.0))
    for original in (1024, 4099, 8192)
]


def test_llama3_frequencies_equal_transformers_bitwise_over_a_grid():
    """Bit for bit wherever the base frequencies are (PyTorch's pow is off by 1 ulp on a few).

    transformers computes ``2 * pi / inv_freq`` and ``old / wavelen`` as the reciprocal times
    the scalar (PyTorch's scalar division), two roundings, not one division.
    """
    checked = 0
    for head_dim, theta, factor, low, high, original in LLAMA3_GRID:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        ours = lm.rope_frequencies(head_dim, theta=theta, scaling=scaling)
        expected = hf_frequencies(theta, scaling, head_dim=head_dim)
        same_base = lm.rope_frequencies(head_dim, theta=theta) == hf_frequencies(
            theta, None, head_dim=head_dim
        )
        assert same_base.mean() > 0.9
        np.testing.assert_array_equal(
            ours[same_base], expected[same_base], err_msg=str(scaling | {"theta": theta})
        )
        checked += int(same_base.sum())
    assert checked > 0.9 * sum(g[0] // 2 for g in LLAMA3_GRID)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_partial_rotary_frequencies_equal_transformers(rope_type):
    scaling = {"default": None, "linear": {"rope_type": "linear", "factor": 2.0}}.get(
        rope_type, LLAMA3
    )
    ours = lm.rope_frequencies(16, theta=10_000.0, scaling=scaling, partial_rotary_factor=0.5)
    assert ours.shape == (4,)
    if rope_type == "default":  # Llama's default ignores the factor; GPT-NeoX's honours it
        config = transformers.GPTNeoXConfig(
            hidden_size=64, num_attention_heads=4, rotary_pct=0.5, rope_theta=10_000.0
        )
        rotary = modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)
        expected = rotary.inv_freq.numpy()
    else:
        expected = hf_frequencies(10_000.0, scaling, head_dim=16, partial_rotary_factor=0.5)
    np.testing.assert_array_equal(ours, expected)


def hf_rotate(x, positions, theta, scaling, head_dim=HEAD_DIM):
    """transformers' Llama rotary module and apply_rotary_pos_emb on x (B, T, H, D)."""
    rotary = modeling_llama.LlamaRotaryEmbedding(llama_config(theta, scaling, head_dim))
    xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch_dtype(x.dtype))
    cos, sin = rotary(xt, torch.from_numpy(np.asarray(positions, np.int64)))
    q, _ = modeling_llama.apply_rotary_pos_emb(xt, xt, cos, sin, unsqueeze_dim=2)
    return to_jax(q)


def torch_dtype(dtype):
    return {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}[
        jnp.dtype(dtype)
    ]


def to_jax(t):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


@pytest.fixture(scope="module")
def qk():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 3, HEAD_DIM)).astype(np.float32)
    positions = rng.integers(0, 2000, (2, 6)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(positions)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "llama3_wide"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotation_equals_transformers(qk, name, dtype):
    x, positions = qk
    x = x.astype(dtype)
    theta, scaling = VARIANTS[name]
    rope = lm.RotaryEmbedding(HEAD_DIM, theta=theta, scaling=scaling)
    ours, _ = lm.transform(rope)[1]({}, None, x, positions)
    assert ours.dtype == x.dtype and ours.shape == x.shape
    expected = hf_rotate(x, positions, theta, scaling)
    if dtype == "bfloat16":  # same float32 angles, same bfloat16 products: bit for bit
        np.testing.assert_array_equal(
            np.asarray(ours, np.float32), np.asarray(expected, np.float32)
        )
    else:
        assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # the function, and under jit
    inv_freq = lm.rope_frequencies(HEAD_DIM, theta=theta, scaling=scaling)
    np.testing.assert_array_equal(lm.apply_rotary(x, positions, inv_freq), ours)
    jitted = jax.jit(lambda x, p: lm.apply_rotary(x, p, inv_freq))(x, positions)
    np.testing.assert_array_equal(jitted, ours)


def test_rotation_preserves_norms_and_relative_angles(qk):
    x, _ = qk
    inv_freq = lm.rope_frequencies(HEAD_DIM)
    a = lm.apply_rotary(x, jnp.arange(6), inv_freq)
    b = lm.apply_rotary(x, jnp.arange(6) + 37, inv_freq)
    assert_close(jnp.linalg.norm(a, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5, atol=1e-5)
    # q.k depends on the distance only: shifting both positions keeps the scores
    scores_a = jnp.einsum("bqhd,bkhd->bhqk", a, a)
    scores_b = jnp.einsum("bqhd,bkhd->bhqk", b, b)
    assert_close(scores_a, scores_b, rtol=1e-4, atol=1e-4)
    assert not np.allclose(a, x)


def test_positions_broadcast_over_the_batch(qk):
    x, _ = qk
    inv_freq = lm.rope_frequencies(HEAD_DIM)
    shared = lm.apply_rotary(x, jnp.arange(6), inv_freq)
    per_row = lm.apply_rotary(x, jnp.tile(jnp.arange(6), (2, 1)), inv_freq)
    np.testing.assert_array_equal(shared, per_row)
    # extra batch axes
    x5 = jnp.stack([x, x])
    np.testing.assert_array_equal(lm.apply_rotary(x5, jnp.arange(6), inv_freq)[1], shared)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interleaved_equals_half_after_permuting_the_features(qk, dtype):
    x, positions = qk
    x = x.astype(dtype)
    inv_freq = lm.rope_frequencies(HEAD_DIM, theta=500_000.0, scaling=LLAMA3)
    # half layout's feature i pairs with i + d/2; interleaved pairs 2i, 2i+1
    perm = np.concatenate([np.arange(0, HEAD_DIM, 2), np.arange(1, HEAD_DIM, 2)])
    interleaved_x = x[..., np.argsort(perm)]  # interleaved_x[..., perm] == x
    half = lm.apply_rotary(x, positions, inv_freq, layout="half")
    inter = lm.apply_rotary(interleaved_x, positions, inv_freq, layout="interleaved")
    np.testing.assert_array_equal(
        np.asarray(inter[..., perm], np.float32), np.asarray(half, np.float32)
    )
    module = lm.RotaryEmbedding(HEAD_DIM, theta=500_000.0, scaling=LLAMA3, layout="interleaved")
    out, _ = lm.transform(module)[1]({}, None, interleaved_x, positions)
    np.testing.assert_array_equal(out, inter)


def test_interleaved_is_the_complex_multiply_of_metas_reference(qk):
    x, positions = qk
    inv_freq = lm.rope_frequencies(HEAD_DIM)
    ours = lm.apply_rotary(x, positions, inv_freq, layout="interleaved")
    # Meta's llama: view pairs as complex numbers, multiply by exp(i * angle)
    pairs = np.asarray(x, np.float64).reshape(*x.shape[:-1], HEAD_DIM // 2, 2)
    z = pairs[..., 0] + 1j * pairs[..., 1]
    angles = np.asarray(positions, np.float64)[..., None, None] * np.asarray(inv_freq, np.float64)
    rotated = z * np.exp(1j * angles)
    expected = np.stack([rotated.real, rotated.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_rotary_equals_gpt_neox(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 4, 16)), jnp.float32).astype(dtype)
    positions = jnp.asarray(rng.integers(0, 500, (2, 5)), jnp.int32)
    rope = lm.RotaryEmbedding(16, partial_rotary_factor=0.25)
    ours, _ = lm.transform(rope)[1]({}, None, x, positions)
    config = transformers.GPTNeoXConfig(
        hidden_size=64, num_attention_heads=4, rotary_pct=0.25, rope_theta=10_000.0
    )
    rotary = modeling_gpt_neox.GPTNeoXRotaryEmbedding(config)
    xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch_dtype(x.dtype))
    cos, sin = rotary(xt, torch.from_numpy(np.asarray(positions, np.int64)))
    expected, _ = modeling_gpt_neox.apply_rotary_pos_emb(xt, xt, cos, sin, unsqueeze_dim=2)
    np.testing.assert_array_equal(np.asarray(ours[..., 4:]), np.asarray(x[..., 4:]))
    if dtype == "bfloat16":
        np.testing.assert_array_equal(
            np.asarray(ours, np.float32), np.asarray(to_jax(expected), np.float32)
        )
    else:
        assert_close(ours, to_jax(expected), rtol=1e-5, atol=1e-5)


def test_attention_factor_scales_cos_and_sin(qk):
    x, positions = qk
    inv_freq = lm.rope_frequencies(HEAD_DIM)
    plain = lm.apply_rotary(x, positions, inv_freq)
    scaled = lm.apply_rotary(x, positions, inv_freq, attention_factor=2.0)
    assert_close(scaled, 2.0 * plain, rtol=1e-6, atol=1e-6)


def test_module_in_a_stack_vmap_and_pickle(qk):
    x, positions = qk
    rope = lm.RotaryEmbedding(HEAD_DIM, theta=500_000.0, scaling=LLAMA3)
    expected, _ = lm.transform(rope)[1]({}, None, x, positions)
    again = pickle.loads(pickle.dumps(rope))
    np.testing.assert_array_equal(again.inv_freq, rope.inv_freq)
    assert again.scaling == rope.scaling == LLAMA3
    out, _ = lm.transform(again)[1]({}, None, x, positions)
    np.testing.assert_array_equal(out, expected)
    # jax.vmap over the batch with per-row positions
    mapped = jax.vmap(lambda a, p: lm.transform(rope)[1]({}, None, a, p)[0])(x, positions)
    assert_close(mapped, expected, rtol=1e-6, atol=1e-6)


def test_settings_are_read_only():
    rope = lm.RotaryEmbedding(HEAD_DIM)
    with pytest.raises(AttributeError, match="theta"):
        rope.theta = 5.0
    with pytest.raises(ValueError, match="read-only"):
        rope.inv_freq[0] = 2.0


@pytest.mark.parametrize("copier", ["pickle", "deepcopy", "copy"])
def test_inv_freq_stays_read_only_in_copies(copier):
    rope = lm.RotaryEmbedding(HEAD_DIM, scaling={"rope_type": "linear", "factor": 2.0})
    copy_ = {
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "deepcopy": copy.deepcopy,
        "copy": copy.copy,
    }[copier]
    again = copy_(rope)
    np.testing.assert_array_equal(again.inv_freq, rope.inv_freq)
    assert again.scaling == rope.scaling
    with pytest.raises(ValueError, match="read-only"):
        again.inv_freq[0] = 2.0
    np.testing.assert_array_equal(again.inv_freq, lm.rope_frequencies(HEAD_DIM) / 2)


def test_repr_shows_every_setting():
    rope = lm.RotaryEmbedding(HEAD_DIM, scaling=LLAMA3, theta=5e5)
    text = repr(rope)
    assert "scaling={'rope_type': 'llama3', 'factor': 8.0," in text
    assert "original_max_position_embeddings': 16}" in text and "theta=500000.0" in text
    assert text.count("scaling=") == 1 and text.endswith(",\n)")
    assert "scaling=None" in repr(lm.RotaryEmbedding(HEAD_DIM))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"scaling": {"rope_type": "dynamic", "factor": 2.0}},
            NotImplementedError,
            r"rope_type 'dynamic' is not supported.*'default', 'linear', 'llama3'",
        ),
        (
            {"scaling": {"rope_type": "yarn", "factor": 2.0}},
            NotImplementedError,
            r"rope_type 'yarn' is not supported",
        ),
        ({"scaling": {"rope_type": "longrope"}}, NotImplementedError, "longrope"),
        (
            {"scaling": {"rope_type": "ntk"}},
            ValueError,
            r"unknown rope_type 'ntk'.*'default', 'linear', 'llama3'",
        ),
        (
            {"scaling": {"rope_type": "linear"}},
            ValueError,
            r"rope_type 'linear' takes the keys \['factor'\].*missing \['factor'\]",
        ),
        (
            {"scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}},
            ValueError,
            r"unexpected \['beta'\]",
        ),
        (
            {"scaling": {"rope_type": "linear", "factor": 0.0}},
            ValueError,
            r"scaling\['factor'\] must be a finite positive number",
        ),
        (
            {"scaling": {**LLAMA3, "high_freq_factor": 1.0}},
            ValueError,
            r"high_freq_factor.*must be greater than",
        ),
        (
            {"scaling": {**LLAMA3, "original_max_position_embeddings": 8.5}},
            TypeError,
            r"original_max_position_embeddings'\] must be a positive int",
        ),
        (
            {"scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}},
            ValueError,
            r"scaling\['rope_theta'\]=5.0 differs from theta=10000.0",
        ),
        ({"scaling": "linear"}, TypeError, "scaling must be None or a dict"),
        ({"theta": -1.0}, ValueError, "theta must be a finite positive number"),
        ({"theta": "1e4"}, TypeError, "theta must be a finite positive number"),
        (
            {"partial_rotary_factor": 1.5},
            ValueError,
            r"partial_rotary_factor must be a number in \[0, 1\]",
        ),
        ({"partial_rotary_factor": 0.1}, ValueError, r"rotate .* = 0 features, which must be even"),
        ({"partial_rotary_factor": 0.375}, ValueError, "= 3 features, which must be even"),
    ],
)
def test_setting_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        lm.RotaryEmbedding(HEAD_DIM, **kwargs)
    if "layout" not in kwargs:
        with pytest.raises(error, match=match.replace("RotaryEmbedding", "rope_frequencies")):
            lm.rope_frequencies(HEAD_DIM, **kwargs)


def test_setting_errors_name_the_caller():
    with pytest.raises(ValueError, match=r"^RotaryEmbedding: head_dim must be a positive int"):
        lm.RotaryEmbedding(0)
    with pytest.raises(ValueError, match=r"^rope_frequencies: head_dim must be a positive int"):
        lm.rope_frequencies(-2)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: layout must be 'half'.*got 'split'"):
        lm.RotaryEmbedding(8, layout="split")


@pytest.mark.parametrize(
    "x_shape, positions, kwargs, error, match",
    [
        ((2, 6, 3, 8), np.arange(6.0), {}, TypeError, "positions must be integers"),
        (
            (2, 6, 3, 8),
            np.arange(5),
            {},
            ValueError,
            r"positions of shape \(5,\) do not fit x of shape \(2, 6, 3, 8\)",
        ),
        ((2, 6, 3, 8), np.zeros((3, 6), np.int32), {}, ValueError, "do not fit"),
        ((6, 8), np.arange(6), {}, ValueError, r"x must have shape \(\*batch, length, heads"),
        ((2, 6, 3, 6), np.arange(6), {}, ValueError, "rotate 8 features, but x has head_dim 6"),
        ((2, 6, 3, 8), np.arange(6), {"layout": "pairs"}, ValueError, "layout must be 'half'"),
        (
            (2, 6, 3, 8),
            np.arange(6),
            {"attention_factor": 0},
            ValueError,
            "attention_factor must be a finite positive number",
        ),
    ],
)
def test_call_errors(x_shape, positions, kwargs, error, match):
    x = jnp.ones(x_shape)
    with pytest.raises(error, match=match):
        lm.apply_rotary(x, positions, lm.rope_frequencies(8), **kwargs)


def test_module_call_errors():
    apply = lm.transform(lm.RotaryEmbedding(8))[1]
    with pytest.raises(
        ValueError,
        match=r"^RotaryEmbedding\(head_dim=8\) got x with 16 features on its last axis \(shape "
        r"\(1, 4, 2, 16\)\); it must be head_dim=8\..*RotaryEmbedding\(16\)",
    ):
        apply({}, None, jnp.ones((1, 4, 2, 16)), jnp.arange(4))
    # fewer features than head_dim: the same message, not apply_rotary's about inv_freq
    with pytest.raises(
        ValueError, match=r"^RotaryEmbedding\(head_dim=8\) got x with 6 features on its last"
    ):
        apply({}, None, jnp.ones((1, 4, 2, 6)), jnp.arange(4))
    with pytest.raises(TypeError, match=r"RotaryEmbedding\(head_dim=8\): x must be a floating"):
        apply({}, None, jnp.ones((1, 4, 2, 8), jnp.int32), jnp.arange(4))
    with pytest.raises(TypeError, match="positions must be integers"):
        apply({}, None, jnp.ones((1, 4, 2, 8)), jnp.arange(4.0))
    with pytest.raises(ValueError, match="inv_freq must be a 1-D floating array"):
        lm.apply_rotary(jnp.ones((1, 4, 2, 8)), jnp.arange(4), np.ones((2, 2), np.float32))
