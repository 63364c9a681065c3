"""Issue 12's attention options against Flax Linen: dtype inference, `dropout_rng`,
`attention_fn`, `normalize_qk`, recorded attention weights, `dot_product_attention_weights`.

As in `tests/test_nn_attention.py`, Linen runs under `jax.jit` and the inputs are NumPy
arrays, so that compilation, which dominates on a CPU, happens once per program.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close as assert_real_close

B, L, F = 2, 4, 6  # batch, length, features
HEADS, QKV = 2, 8  # head_dim 4


def randn(*shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


X = randn(B, L, F, seed=1)
CAUSAL = np.broadcast_to(np.tril(np.ones((L, L), bool)), (B, 1, L, L))


def assert_close(got, expected, rtol=1e-5, atol=1e-6):
    """`tests.helpers.assert_close`, complex leaves compared as (real, imaginary) pairs."""

    def pairs(x):
        return jnp.stack([jnp.real(x), jnp.imag(x)]) if jnp.iscomplexobj(x) else x

    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert jnp.result_type(a) == jnp.result_type(b), (a.dtype, b.dtype)
    assert_real_close(jax.tree.map(pairs, got), jax.tree.map(pairs, expected), rtol, atol)


def linen_mha(**kwargs):
    kwargs.setdefault("kernel_init", nn.initializers.normal(0.5))
    kwargs.setdefault("bias_init", nn.initializers.normal(0.5))
    return nn.MultiHeadDotProductAttention(HEADS, qkv_features=QKV, **kwargs)


def ours_mha(**kwargs):
    return lm.MultiHeadAttention(HEADS, F, qkv_size=QKV, **kwargs)


@functools.cache
def linen_vars(param_dtype=jnp.float32, normalize_qk=False):
    """Linen's init variables, shared by the tests (scales made non-trivial)."""
    layer = linen_mha(param_dtype=param_dtype, normalize_qk=normalize_qk)
    x = np.zeros((B, L, F), param_dtype)
    with jax.numpy_dtype_promotion("standard"):  # Linen's LayerNorm mixes dtypes
        variables = jax.jit(layer.init)(jax.random.key(0), x)
    params = dict(variables["params"])
    for name in ("query_ln", "key_ln"):
        if name in params:
            scale = randn(QKV // HEADS, seed=len(name)).astype(np.float32) + 1.0
            params[name] = {"scale": jnp.asarray(scale, param_dtype)}
    return {"params": params}


def linen_apply(layer, **static):
    names = ("deterministic", "mutable", "sow_weights")
    return jax.jit(functools.partial(layer.apply, **static), static_argnames=names)


def ours_apply(mha):
    return lm.transform(mha).apply


def key(seed):
    # "rbg" keys compile much faster on CPU than threefry ones for per-element masks
    return jax.random.key(seed, impl="rbg")


# --- dtype inference (dtype=None) and complex values ---------------------------------------


@pytest.mark.parametrize(
    ("param_dtype", "input_dtype", "normalize_qk", "tol"),
    [
        # all bfloat16: computes in bfloat16, the queries' and keys' LayerNorms included
        (jnp.bfloat16, jnp.bfloat16, True, 2e-2),
        # float32 inputs promote bfloat16 parameters (each projection casts its variables)
        (jnp.bfloat16, jnp.float32, False, None),
        (jnp.complex64, jnp.complex64, False, None),  # complex stays complex
    ],
)
def test_dtype_none_equals_linen(param_dtype, input_dtype, normalize_qk, tol):
    variables = linen_vars(param_dtype, normalize_qk)
    x = jnp.asarray(randn(B, L, F, seed=2, dtype=np.dtype(input_dtype)), input_dtype)
    linen = linen_mha(param_dtype=param_dtype, normalize_qk=normalize_qk)
    with jax.numpy_dtype_promotion("standard"):  # Linen relies on implicit promotion
        expected = linen_apply(linen)(variables, x, mask=CAUSAL)
    mha = ours_mha(dtype=None, param_dtype=param_dtype, normalize_qk=normalize_qk)
    got, _ = ours_apply(mha)(variables, None, x, causal=True)
    assert got.dtype == expected.dtype
    assert_close(got, expected, *((tol, tol) if tol else ()))


def test_complex_values_under_a_real_dtype_are_an_error():
    x = randn(B, L, F, seed=3, dtype=np.complex64)
    apply = ours_apply(ours_mha())  # dtype=float32
    with pytest.raises(
        TypeError,
        match=r"^MultiHeadAttention at the root got a complex64 value but computes in "
        r"float32 \(dtype=float32\): the cast would drop the imaginary part",
    ):
        apply(linen_vars(), None, x)
    with pytest.raises(TypeError, match=r"^dot_product_attention got a complex64 value"):
        lm.dot_product_attention(x[..., None, :], x[..., None, :], x[..., None, :], dtype="float32")


def test_dot_product_attention_infers_its_dtype_as_linen():
    q = randn(B, L, HEADS, 4, seed=4, dtype=np.complex64)
    k, v = randn(B, 3, HEADS, 4, seed=5, dtype=np.complex64), randn(B, 3, HEADS, 2, seed=6)
    linen = jax.jit(nn.dot_product_attention)
    for query, value in [(q, v.astype(np.complex64)), (q.real.astype(jnp.bfloat16), v)]:
        keys = k if jnp.iscomplexobj(query) else k.real.astype(jnp.bfloat16)
        with jax.numpy_dtype_promotion("standard"):
            expected = linen(query, keys, value)
        got = lm.dot_product_attention(query, keys, value)
        assert got.dtype == expected.dtype  # complex64; float32 from bfloat16 and float32
        assert_close(got, expected, rtol=1e-2, atol=1e-2)


# --- dot_product_attention_weights --------------------------------------------------------------


def test_dot_product_attention_weights_equal_linen():
    q, k = randn(B, L, HEADS, 4, seed=7), randn(B, 3, HEADS, 4, seed=8)
    mask = np.ones((B, 1, L, 3), bool)
    mask[1, ..., 2:] = False
    bias = randn(1, HEADS, L, 3, seed=9)
    static = ("broadcast_dropout", "deterministic", "dropout_rate")
    linen = jax.jit(nn.dot_product_attention_weights, static_argnames=static)
    got = lm.dot_product_attention_weights(q, k, mask=mask, bias=bias)
    assert got.shape == (B, HEADS, L, 3)
    assert_close(got, linen(q, k, bias=bias, mask=mask))
    assert_close(got.sum(-1), np.ones((B, HEADS, L), np.float32))
    dropout = {"dropout_rng": key(1), "dropout_rate": 0.5, "broadcast_dropout": False}
    got = lm.dot_product_attention_weights(q, k, mask=mask, is_training=True, **dropout)
    assert_close(got, linen(q, k, mask=mask, deterministic=False, **dropout))
    # the weights are what dot_product_attention multiplies the values by
    v = randn(B, 3, HEADS, 2, seed=10)
    expected = lm.dot_product_attention(q, k, v, mask=mask, is_training=True, **dropout)
    assert_close(np.einsum("bhqk,bkhd->bqhd", got, v), expected)


def test_dot_product_attention_weights_errors():
    q = np.ones((B, L, HEADS, 4), np.float32)
    with pytest.raises(
        ValueError, match=r"^dot_product_attention_weights: query and key must have the same"
    ):
        lm.dot_product_attention_weights(q, np.ones((B, L, 3, 4), np.float32))
    with pytest.raises(TypeError, match=r"^dot_product_attention_weights: mask must be a bool"):
        lm.dot_product_attention_weights(q, q, mask=np.ones((L, L), np.float32))


# --- dropout_rng ----------------------------------------------------------------------------


def test_dropout_rng_equals_linens_and_replaces_the_stream():
    variables = linen_vars()
    linen = linen_apply(linen_mha(dropout_rate=0.5))
    apply = ours_apply(ours_mha(dropout_rate=0.5))
    rng = key(2)
    expected = linen(variables, X, deterministic=False, dropout_rng=rng)
    got, _ = apply(variables, None, X, is_training=True, dropout_rng=rng)  # no stream needed
    assert_close(got, expected)
    # the given key wins over the "dropout" stream, as in Linen
    assert_close(
        apply(variables, {"dropout": key(3)}, X, is_training=True, dropout_rng=rng)[0], got
    )
    assert not np.allclose(apply(variables, {"dropout": key(3)}, X, is_training=True)[0], got)
    # not training, the key is not used
    assert_close(
        apply(variables, None, X, dropout_rng=rng)[0], linen(variables, X, deterministic=True)
    )


@pytest.mark.parametrize(
    ("dropout_rng", "got"),
    [
        (3, r"got int"),
        (np.zeros(2, np.float32), r"got an array of dtype float32 and shape \(2,\)"),
        (jax.random.split(jax.random.key(0)), r"got an array of dtype key<fry> and shape \(2,\)"),
    ],
)
def test_dropout_rng_must_be_a_key(dropout_rng, got):
    message = (
        r"dropout_rng must be one PRNG key, jax.random.key\(seed\) \(or "
        r"jax.random.PRNGKey\(seed\)\), " + got + r"\. For a seed, pass jax.random.key\(seed\)"
    )
    apply = ours_apply(ours_mha(dropout_rate=0.5))
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: " + message):
        apply(linen_vars(), None, X, is_training=True, dropout_rng=dropout_rng)
    q = np.ones((B, L, HEADS, 4), np.float32)
    with pytest.raises(TypeError, match=r"^dot_product_attention: " + message):
        lm.dot_product_attention(q, q, q, dropout_rng=dropout_rng)


# --- attention_fn -------------------------------------------------------------------------------


def scaled_linen_style(query, key, value, mask=None, deterministic=True, dropout_rng=None,
                       dropout_rate=0.0, dtype=None, module=None):  # fmt: skip
    """A Linen-style attention function: Linen's, with the queries doubled."""
    return nn.dot_product_attention(
        2.0 * query, key, value, mask=mask, deterministic=deterministic,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, dtype=dtype, module=module,
    )  # fmt: skip


def test_linen_attention_fn_equals_linen():
    # (Linen's own dot_product_attention as attention_fn: test_sown_weights_equal_linens)
    attention_fn = scaled_linen_style
    variables = linen_vars()
    linen = linen_mha(attention_fn=attention_fn, dropout_rate=0.5)
    apply = ours_apply(ours_mha(attention_fn=attention_fn, dropout_rate=0.5))
    rng = key(4)
    expected = linen_apply(linen)(variables, X, mask=CAUSAL, deterministic=False, dropout_rng=rng)
    got, _ = apply(variables, None, X, causal=True, is_training=True, dropout_rng=rng)
    assert_close(got, expected)

    def ours(v, x):
        return jnp.sum(jnp.sin(apply(v, None, x, causal=True)[0]))

    def theirs(v, x):
        return jnp.sum(jnp.sin(linen.apply(v, x, mask=CAUSAL, deterministic=True)))

    grads = jax.grad(ours, argnums=(0, 1))(variables, X)
    assert_close(grads, jax.jit(jax.grad(theirs, argnums=(0, 1)))(variables, X), 1e-5, 1e-5)


def test_attention_fn_gets_the_options_it_names():
    seen = []

    def lamina_style(query, key, value, *, mask=None, is_training=False, dropout_rng=None,
                     dropout_rate=0.0, dtype=None, sow_weights=False, **ignored):  # fmt: skip
        seen.append({"mask": mask is not None, "is_training": is_training, "dtype": dtype,
                     "dropout_rate": dropout_rate, "rng": dropout_rng is not None,
                     "sow_weights": sow_weights, "ignored": ignored})  # fmt: skip
        return lm.dot_product_attention(
            query, key, value, mask=mask, is_training=is_training, dropout_rng=dropout_rng,
            dropout_rate=dropout_rate, dtype=dtype, sow_weights=sow_weights,
        )  # fmt: skip

    variables = linen_vars()
    apply = ours_apply(ours_mha(attention_fn=lamina_style, dropout_rate=0.5))
    reference = ours_apply(ours_mha(dropout_rate=0.5))
    got, _ = apply(variables, None, X, causal=True, is_training=True, dropout_rng=key(5))
    expected, _ = reference(variables, None, X, causal=True, is_training=True, dropout_rng=key(5))
    assert_close(got, expected)
    apply(variables, None, X)
    assert seen == [
        {"mask": True, "is_training": True, "dtype": jnp.float32, "dropout_rate": 0.5,
         "rng": True, "sow_weights": False, "ignored": {}},
        {"mask": False, "is_training": False, "dtype": jnp.float32, "dropout_rate": 0.0,
         "rng": False, "sow_weights": False, "ignored": {}},
    ]  # fmt: skip


def no_mask(query, key, value):
    return lm.dot_product_attention(query, key, value)


def one_head_too_many(query, key, value, mask=None):
    return jnp.concatenate([query, query[..., :1, :]], axis=-2)


ATTENTION_FN_ERRORS = [
    (
        {"attention_fn": no_mask},
        {"causal": True},
        TypeError,
        r"this call has a mask \(mask=, causal=True or decode=True\), but attention_fn=no_mask "
        r"takes no mask argument, so it would be dropped\. Give the function that parameter",
    ),
    (
        {"attention_fn": no_mask, "dropout_rate": 0.5},
        {"is_training": True, "dropout_rng": np.array([0, 1], np.uint32)},
        TypeError,
        r"this call has dropout \(is_training=True and a dropout_rate\), but attention_fn=no_mask "
        r"takes no dropout_rng argument",
    ),
    (
        {"attention_fn": no_mask},
        {"sow_weights": True},
        TypeError,
        r"this call has sow_weights=True, but attention_fn=no_mask takes no sow_weights or module",
    ),
    (
        {"attention_fn": one_head_too_many},
        {},
        ValueError,
        r"attention_fn=one_head_too_many returned shape \(2, 4, 3, 4\), but the output "
        r"projection takes the heads' shape \(batch\.\.\., q_length, num_heads, head_dim\) = "
        r"\(2, 4, 2, 4\)",
    ),
]


@pytest.mark.parametrize(("settings", "kwargs", "error", "match"), ATTENTION_FN_ERRORS)
def test_attention_fn_errors(settings, kwargs, error, match):
    apply = ours_apply(ours_mha(**settings))
    with pytest.raises(error, match=r"^MultiHeadAttention: " + match):
        apply(linen_vars(), None, X, **kwargs)


def test_attention_fn_settings_are_checked():
    with pytest.raises(
        TypeError,
        match=r"^MultiHeadAttention: attention_fn must be a function such as "
        r"lm.dot_product_attention, got 'dot'",
    ):
        ours_mha(attention_fn="dot")
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: attention_fn=max has no signature"):
        ours_mha(attention_fn=max)
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: normalize_qk must be True or False"):
        ours_mha(normalize_qk=1)
    mha = ours_mha()
    assert mha.attention_fn is lm.dot_product_attention
    with pytest.raises(AttributeError, match=r"attention_fn is read-only"):
        mha.attention_fn = no_mask


# --- normalize_qk ---------------------------------------------------------------------------------


def test_normalize_qk_equals_linen_outputs_and_gradients():
    variables = linen_vars(normalize_qk=True)
    linen = linen_mha(normalize_qk=True)
    mha = ours_mha(normalize_qk=True)
    init, apply = lm.transform(mha)
    shapes = jax.eval_shape(init, jax.random.key(0))
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, variables)
    assert shapes["params"]["query_ln"].keys() == {"scale"}  # no bias, as Linen's
    got, _ = apply(variables, None, X, causal=True)
    assert_close(got, linen_apply(linen)(variables, X, mask=CAUSAL))

    def ours(v, x):
        return jnp.sum(jnp.sin(apply(v, None, x, causal=True)[0]))

    def theirs(v, x):
        return jnp.sum(jnp.sin(linen.apply(v, x, mask=CAUSAL)))

    grads = jax.grad(ours, argnums=(0, 1))(variables, X)
    expected = jax.jit(jax.grad(theirs, argnums=(0, 1)))(variables, X)
    assert_close(grads, expected, 1e-5, 1e-5)
    assert float(np.abs(grads[0]["params"]["key_ln"]["scale"]).sum()) > 0


def test_normalize_qk_decoding_caches_the_normalised_keys():
    variables = linen_vars(normalize_qk=True)
    mha = ours_mha(normalize_qk=True, decode_shape=(B, L))
    init, apply = lm.transform(mha)
    variables = {**variables, "cache": init(jax.random.key(0))["cache"]}
    full, _ = apply(variables, None, X, causal=True)
    steps, states = [], [variables]
    for t in range(L):
        y, state = apply(states[-1], None, X[:, t : t + 1], decode=True)
        steps.append(y)
        states.append(state)
    assert_close(jnp.concatenate(steps, axis=1), full)
    # Linen's first decoding step gives the same output and the same (normalised) cache
    linen = linen_mha(normalize_qk=True, decode=True)
    cache = jax.tree.map(np.zeros_like, dict(variables["cache"]))
    y, updated = linen_apply(linen)({**variables, "cache": cache}, X[:, :1], mutable="cache")
    assert_close(steps[0], y)
    assert_close(states[1]["cache"], dict(updated["cache"]))


# --- recorded attention weights (sow_weights) -------------------------------------------------


@pytest.mark.parametrize("attention_fn", [lm.dot_product_attention, nn.dot_product_attention])
def test_sown_weights_equal_linens(attention_fn):
    variables = linen_vars()
    linen = linen_mha(dropout_rate=0.5)
    apply = ours_apply(ours_mha(attention_fn=attention_fn, dropout_rate=0.5))
    rng = key(6)
    expected, state = linen_apply(linen, mutable="intermediates")(
        variables, X, mask=CAUSAL, deterministic=False, dropout_rng=rng, sow_weights=True
    )
    request = {**variables, "intermediates": {}}
    got, new = apply(request, None, X, causal=True, is_training=True, dropout_rng=rng,
                     sow_weights=True)  # fmt: skip
    assert_close(got, expected)
    # the weights before dropout, under the layer's path (here the root), as Linen's
    assert_close(new["intermediates"], dict(state["intermediates"]))
    (weights,) = new["intermediates"]["attention_weights"]
    assert weights.shape == (B, HEADS, L, L)
    np.testing.assert_array_equal(np.triu(np.asarray(weights), 1), 0.0)  # causal


def test_weights_are_recorded_only_on_request():
    variables = linen_vars()
    apply = ours_apply(ours_mha())
    _, new = apply(variables, None, X, sow_weights=True)  # not asked: nothing recorded
    assert new.keys() == {"params"}
    _, new = apply({**variables, "intermediates": {}}, None, X)  # sow_weights=False
    assert new["intermediates"] == {}
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: sow_weights must be a Python bool"):
        apply(variables, None, X, sow_weights=1)

    class TwoLayers(lm.Module):
        def __init__(self):
            self.first, self.second = ours_mha(), ours_mha(out_size=F)

        def __call__(self, x):
            h = self.first(x, sow_weights=True)
            # the function records under the calling module's path too
            lm.dot_product_attention(h[..., None, :], h[..., None, :], h[..., None, :],
                                     sow_weights=True)  # fmt: skip
            return self.second(self.second(h, sow_weights=True), sow_weights=True)

    init, apply = lm.transform(TwoLayers())
    two = init(jax.random.key(0))
    _, new = apply({**two, "intermediates": {}}, None, X)
    records = jax.tree.map(jnp.shape, new["intermediates"])
    assert records == {
        "attention_weights": ((B, 1, L, L),),
        "first": {"attention_weights": ((B, HEADS, L, L),)},
        "second": {"attention_weights": ((B, HEADS, L, L),) * 2},  # called twice
    }
    with pytest.raises(RuntimeError, match=r"lm.sow runs only inside init/apply"):
        lm.dot_product_attention(X[..., None, :], X[..., None, :], X[..., None, :],
                                 sow_weights=True)  # fmt: skip
