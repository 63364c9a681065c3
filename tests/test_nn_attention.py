"""MultiHeadAttention and the attention functions against Flax Linen, given the same weights.

Projections, masks, decoding with a cache, dropout (and `dropout_rng`), the dtype contract
(inference with dtype=None, complex values), `attention_fn`, `normalize_qk`, the recorded
attention weights, `dot_product_attention_weights`; every error a user can cause.

Compilation dominates the runtime on a CPU, so the inputs are NumPy arrays (no compiled op
per slice or shape), Linen runs under `jax.jit` (one program instead of one per primitive),
and most tests share one Linen initialisation (`std_params`, `small_linen_variables`).
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import (
    MultiHeadAttention,
    combine_masks,
    dot_product_attention,
    make_attention_mask,
    make_causal_mask,
)
from tests.helpers import assert_close, assert_close_complex, layout
from tests.linen_helpers import linen_apply, linen_init

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

B, L, F = 2, 5, 6  # batch, length, features of the queries' input
STD = {"num_heads": 3, "qkv_features": 12, "out_features": 4}  # head_dim 4


def randn(*shape, seed=0, dtype=np.float32):
    """Standard normal NumPy data of `dtype` (a complex one gets an imaginary part)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def close(a, b, tol=None):
    """Equal within float32 rounding (or within `tol`, for lower precisions)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if tol is None:
        assert_close(a, b)
    else:
        assert_close(a, b, rtol=tol, atol=tol)


def linen_mha(**kwargs):
    """Linen's layer; normal initializers by default (nonzero biases, quick to compile)."""
    kwargs.setdefault("kernel_init", nn.initializers.normal(0.5))
    kwargs.setdefault("bias_init", nn.initializers.normal(0.5))
    return nn.MultiHeadDotProductAttention(**kwargs)


LAMINA_NAMES = {"qkv_features": "qkv_size", "out_features": "out_size"}


def ours_mha(**kwargs):
    """Our layer for queries of F features, from settings under Linen's names."""
    kwargs = {LAMINA_NAMES.get(k, k): v for k, v in kwargs.items()}
    return MultiHeadAttention(in_size=F, **kwargs)


def linen_like(linen, *inputs, seed=0):
    """Variables of the structure Linen's init gives (found without compiling): random
    parameters, zero caches."""
    shapes = dict(jax.eval_shape(linen.init, jax.random.key(0), *inputs))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda s: (0.5 * rng.standard_normal(s.shape)).astype(s.dtype), shapes.pop("params")
    )
    return {"params": params, **jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)}


def zero_variables(mha, params=None):
    """(apply, variables): zeros of the declared shapes (no initializer runs), `params` put in."""
    init, apply = lm.transform(mha)
    shapes = jax.eval_shape(init, jax.random.key(0))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    if params is not None:
        variables["params"] = params
    return apply, variables


def dropout_key(seed):
    """A key for dropout tests. "rbg" keys compile much faster on CPU than threefry ones for
    per-element masks (seconds per shape); the code under test is the same for both."""
    return jax.random.key(seed, impl="rbg")


def decode_in_steps(apply, variables, inputs, steps, **kwargs):
    """Runs `apply(..., decode=True)` on consecutive chunks of `inputs` of the given lengths."""
    outputs, start = [], 0
    for n in steps:
        y, variables = apply(variables, None, inputs[:, start : start + n], decode=True, **kwargs)
        outputs.append(np.asarray(y, np.float32))
        start += n
    return np.concatenate(outputs, axis=1), variables


def causal_mask(batch, length):
    return np.broadcast_to(np.tril(np.ones((length, length), bool)), (*batch, 1, length, length))


X = randn(B, L, F, seed=42)


@pytest.fixture(scope="module")
def std_params():
    """Linen's init params of the STD layer (they do not depend on lengths or batch)."""
    return linen_init(linen_mha(**STD), X)["params"]


@pytest.mark.parametrize("config", [STD, {"num_heads": 2, "use_bias": False}])
def test_self_attention_equals_linen_and_init_layout(config):
    linen = linen_mha(**config)
    variables = linen_like(linen, X)
    apply, ours = zero_variables(ours_mha(**config))
    assert layout(ours) == layout(variables)
    got, new_variables = apply(variables, None, X)
    expected = linen_apply(linen)(variables, X)
    assert got.shape == expected.shape == (B, L, config.get("out_features", F))
    close(got, expected)
    assert new_variables.keys() == {"params"}  # no cache without decode_shape


def test_init_layout_and_linens_initializer_shapes(getkey):
    calls = []

    def recording_init(key, shape, dtype=jnp.float32):
        calls.append(tuple(shape))
        return np.full(shape, len(calls), dtype)

    mha = MultiHeadAttention(
        num_heads=2, in_size=32, out_size=8, kernel_init=recording_init,
        bias_init=recording_init,
    )  # fmt: skip
    variables = lm.transform(mha).init(getkey())
    assert jax.tree.map(jnp.shape, variables) == {
        "params": {
            "query": {"kernel": (32, 2, 16), "bias": (2, 16)},
            "key": {"kernel": (32, 2, 16), "bias": (2, 16)},
            "value": {"kernel": (32, 2, 16), "bias": (2, 16)},
            "out": {"kernel": (2, 16, 8), "bias": (8,)},
        }
    }
    # Linen's DenseGeneral calls the initializers with the kernel as a (fan_in, fan_out)
    # matrix and the bias as a vector, then reshapes: lecun_normal's fan-in is then 32
    # (for the query kernel, not 32 * 2; for the output kernel, 2 * 16, not 16).
    assert sorted(calls) == sorted([(32, 32)] * 3 + [(32,)] * 3 + [(32, 8), (8,)])
    values = {float(a.flat[0]) for a in jax.tree.leaves(variables)}
    assert values == set(range(1, 9))  # each variable its own call


def test_unbatched_and_extra_batch_axes_equal_linen(std_params):
    linen = linen_apply(linen_mha(**STD))
    apply, _ = zero_variables(ours_mha(**STD))
    variables = {"params": std_params}
    for shape in [(L, F), (2, 3, L, F)]:
        inputs = randn(*shape, seed=1)
        got, _ = apply(variables, None, inputs, causal=True)
        close(got, linen(variables, inputs, mask=causal_mask(shape[:-2], L)))


def test_cross_attention_equals_linen():
    k_in, v_in = randn(B, 7, 3, seed=2), randn(B, 7, 4, seed=3)
    linen = linen_mha(num_heads=2, qkv_features=8)
    variables = linen_like(linen, X, k_in, v_in)
    mha = MultiHeadAttention(2, F, qkv_size=8, key_size=3, value_size=4)
    apply, ours = zero_variables(mha)
    assert layout(ours) == layout(variables)
    got, _ = apply(variables, None, X, k_in, v_in)
    assert got.shape == (B, L, F)
    close(got, linen_apply(linen)(variables, X, k_in, v_in))

    # inputs_v defaults to inputs_k, and value_size to key_size
    variables = linen_like(linen, X, k_in)
    apply, ours = zero_variables(MultiHeadAttention(2, F, qkv_size=8, key_size=3))
    assert layout(ours) == layout(variables)
    close(apply(variables, None, X, k_in)[0], linen_apply(linen)(variables, X, k_in))


def test_padding_mask_equals_linen(std_params):
    kv = randn(B, 7, F, seed=4)
    q_valid = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    kv_valid = np.array([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    mask = make_attention_mask(q_valid, kv_valid)  # bool (Linen's is float32 by default)
    assert mask.shape == (B, 1, L, 7)
    linen = linen_apply(linen_mha(**STD))
    variables = {"params": std_params}
    apply, _ = zero_variables(ours_mha(**STD))
    close(apply(variables, None, X, kv, mask=mask)[0], linen(variables, X, kv, mask=mask))
    # a boolean mask of lower rank (here: per key only) works too; masked keys do not matter
    key_mask = np.array([True] * 4 + [False] * 3)
    expected = linen(variables, X, kv, mask=np.broadcast_to(key_mask, (B, 1, L, 7)))
    close(apply(variables, None, X, kv, mask=key_mask)[0], expected)
    changed = kv.copy()
    changed[:, 4:] = 100.0
    close(apply(variables, None, X, changed, mask=key_mask)[0], expected)


def test_causal_equals_linen(std_params):
    linen = linen_apply(linen_mha(**STD))
    variables = {"params": std_params}
    apply, _ = zero_variables(ours_mha(**STD))
    causal = causal_mask((B,), L)
    got, _ = apply(variables, None, X, causal=True)
    close(got, linen(variables, X, mask=causal))
    assert not np.allclose(got, apply(variables, None, X)[0])
    # later positions do not change earlier outputs
    changed = X.copy()
    changed[:, -1] = 100.0
    close(apply(variables, None, changed, causal=True)[0][:, :-1], got[:, :-1])
    # causal and a padding mask together, as Linen's combine_masks
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    padding = valid[:, None, :, None] & valid[:, None, None, :]
    expected = linen(variables, X, mask=np.logical_and(padding, causal))
    close(apply(variables, None, X, mask=padding, causal=True)[0], expected)


def test_gradients_equal_linen(std_params):
    kv = randn(B, 7, F, seed=5)
    linen = linen_mha(**STD)
    variables = {"params": std_params}
    mask = np.ones((B, 1, L, 7), bool)
    mask[1, ..., 5:] = False
    apply, _ = zero_variables(ours_mha(**STD))

    def ours(v, q, kv):
        return jnp.sum(jnp.sin(apply(v, None, q, kv, mask=mask)[0]))

    def theirs(v, q, kv):
        return jnp.sum(jnp.sin(linen.apply(v, q, kv, mask=mask)))

    got = jax.grad(ours, argnums=(0, 1, 2))(variables, X, kv)
    expected = jax.jit(jax.grad(theirs, argnums=(0, 1, 2)))(variables, X, kv)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    jax.tree.map(lambda a, b: close(a, b, 1e-5), got, expected)
    assert float(np.abs(got[0]["params"]["key"]["kernel"]).sum()) > 0
    np.testing.assert_array_equal(got[2][1, 5:], 0.0)  # masked keys get no gradient
    assert np.abs(got[2][0, 5:]).sum() > 0


def test_dropout_equals_linen_given_the_key(std_params):
    # broadcast_dropout=False: the flag reaches the kernel (both values: the functional test)
    kwargs = {**STD, "dropout_rate": 0.5, "broadcast_dropout": False}
    linen = linen_apply(linen_mha(**kwargs))
    variables = {"params": std_params}
    apply, _ = zero_variables(ours_mha(**kwargs))
    key = dropout_key(1)
    got, _ = apply(variables, {"dropout": key}, X, is_training=True)
    # lamina's "dropout" stream hands out fold_in(key, 0) first
    dropout_rng = jax.random.fold_in(key, 0)
    close(got, linen(variables, X, deterministic=False, dropout_rng=dropout_rng))
    # deterministic given the key, different for another key
    np.testing.assert_array_equal(apply(variables, {"dropout": key}, X, is_training=True)[0], got)
    other, _ = apply(variables, {"dropout": dropout_key(2)}, X, is_training=True)
    assert not np.allclose(other, got)
    # inactive when not training, key or no key
    no_dropout = linen(variables, X, deterministic=True)
    close(apply(variables, {"dropout": key}, X)[0], no_dropout)
    close(apply(variables, None, X, is_training=False)[0], no_dropout)
    assert not np.allclose(got, no_dropout)


def test_dropout_needs_a_key_only_when_active(std_params):
    apply, variables = zero_variables(ours_mha(**STD, dropout_rate=0.1))
    with pytest.raises(lm.RngError, match=r"next_rng_key\('dropout'\) found no key"):
        apply(variables, None, X, is_training=True)
    apply, variables = zero_variables(ours_mha(**STD), std_params)
    got, _ = apply(variables, None, X, is_training=True)  # dropout_rate=0: no key needed
    close(got, apply(variables, None, X)[0])


def test_decode_equals_full_causal_pass_and_linens_decode(getkey):
    linen = linen_mha(**STD, decode=True)
    linen_vars = linen_like(linen, X)  # Linen sizes its cache from this input
    mha = ours_mha(**STD, kernel_init=lm.initializers.normal(), decode_shape=(B, L))
    init, apply = lm.transform(mha)
    ours = init(getkey())
    assert layout(ours) == layout(linen_vars)
    assert int(ours["cache"]["cache_index"]) == 0
    np.testing.assert_array_equal(ours["cache"]["cached_key"], 0.0)
    variables = {"params": linen_vars["params"], "cache": ours["cache"]}
    full, unchanged = apply(variables, None, X, causal=True)  # decode=False: cache untouched
    jax.tree.map(np.testing.assert_array_equal, unchanged, variables)

    outputs, after = decode_in_steps(apply, variables, X, [1] * L)
    close(outputs, full)
    assert int(after["cache"]["cache_index"]) == L
    # Linen's decoding path, step by step, gives the same outputs and the same cache
    step = linen_apply(linen)
    state, linen_outputs = linen_vars, []
    for t in range(L):
        y, updated = step(state, X[:, t : t + 1], mutable="cache")
        state = {"params": linen_vars["params"], "cache": updated["cache"]}
        linen_outputs.append(y)
    close(outputs, np.concatenate(linen_outputs, axis=1))
    jax.tree.map(close, after["cache"], dict(state["cache"]))
    # the cached keys are the key projection of the inputs
    key_params = variables["params"]["key"]
    expected_keys = np.einsum("blf,fhd->blhd", X, key_params["kernel"]) + key_params["bias"]
    close(after["cache"]["cached_key"], expected_keys, 1e-5)

    # several positions per step (a prompt, then single tokens) give the same outputs
    outputs, after = decode_in_steps(apply, variables, X, [3, 1, 1])
    close(outputs, full)
    assert int(after["cache"]["cache_index"]) == L


def test_decode_with_padding_mask_and_short_sequence(std_params):
    max_length = 8
    mha = ours_mha(**STD, decode_shape=(B, max_length))
    apply, variables = zero_variables(mha, std_params)
    # batch element 1 ignores position 1 (a pad token, say); only L of 8 positions are used
    valid = np.array([[True] * max_length, [True, False] + [True] * (max_length - 2)])
    decode_mask = valid[:, None, None, :]  # (batch, 1, 1, max_length)
    outputs, after = decode_in_steps(apply, variables, X, [2, 1, 1, 1], mask=decode_mask)
    full, _ = apply(variables, None, X, mask=decode_mask[..., :L], causal=True)
    close(outputs, full)
    assert not np.allclose(outputs, apply(variables, None, X, causal=True)[0])
    assert int(after["cache"]["cache_index"]) == L
    np.testing.assert_array_equal(after["cache"]["cached_value"][:, L:], 0.0)  # unwritten


def test_decode_under_jit_and_past_max_length(std_params):
    mha = ours_mha(**STD, decode_shape=(B, 3))
    apply, variables = zero_variables(mha, std_params)
    step = jax.jit(lambda v, x: apply(v, None, x, decode=True))
    eager_out, eager_vars = decode_in_steps(apply, variables, X, [1, 1, 1])
    jit_out, jit_vars = [], variables
    for t in range(3):
        y, jit_vars = step(jit_vars, X[:, t : t + 1])
        jit_out.append(y)
    close(np.concatenate(jit_out, axis=1), eager_out)
    jax.tree.map(close, jit_vars, eager_vars)
    # eagerly, a step past max_length is an error
    with pytest.raises(
        ValueError,
        match=r"decoding past max_length: cache_index is 3 and this step writes 1 "
        r"position\(s\), but the cache holds max_length=3",
    ):
        apply(eager_vars, None, X[:, 3:4], decode=True)
    with pytest.raises(ValueError, match=r"cache_index is 2 and this step writes 2 position"):
        decode_in_steps(apply, variables, X, [2, 2])
    # under jit the index is traced: the program checks it when it runs, and fails
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"MultiHeadAttention at the root: decoding past max_length: cache_index is 3 "
        r"and this step writes 1 position\(s\), but the cache holds max_length=3",
    ):
        jax.block_until_ready(step(jit_vars, X[:, 3:4]))
    two = jax.jit(lambda v, x: apply(v, None, x, decode=True))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"cache_index is 2 and this step"):
        jax.block_until_ready(two(step(variables, X[:, :2])[1], X[:, 2:4]))
    # ... a step that fits still runs (the check is in the program, not a stale trace)
    y, _ = step(variables, X[:, :1])
    close(y, eager_out[:, :1])


def test_decode_past_max_length_under_vmap_and_scan_is_an_error(std_params):
    mha = ours_mha(**STD, decode_shape=(B, 2))
    apply, variables = zero_variables(mha, std_params)

    def decode(v, xs):  # xs: (time, batch, 1, features), one step per time
        def body(v, x):
            y, v = apply(v, None, x, decode=True)
            return v, y

        return jax.lax.scan(body, v, xs)

    xs = jnp.moveaxis(X[:, :3, None], 1, 0)  # three steps into a cache of two
    fitting, ys = jax.jit(decode)(variables, xs[:2])
    assert int(fitting["cache"]["cache_index"]) == 2 and not np.isnan(np.asarray(ys)).any()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"decoding past max_length"):
        jax.block_until_ready(jax.jit(decode)(variables, xs))
    # vmapped over caches at different positions: one member overflowing fails the call
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), variables, fitting)
    vstep = jax.jit(jax.vmap(lambda v, x: apply(v, None, x, decode=True)))
    x = jnp.stack([X[:, :1], X[:, :1]])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"cache_index is 2 and this step"):
        jax.block_until_ready(vstep(stacked, x))
    ok = jax.tree.map(lambda a: jnp.stack([a, a]), variables)
    y, _ = vstep(ok, x)
    assert not np.isnan(np.asarray(y)).any()


@pytest.mark.parametrize("jit", [False, True])
def test_decode_with_a_negative_or_huge_cache_index_is_an_error(jit):
    """A negative index is refused (never clamped to 0); ``index + steps`` never wraps."""
    apply, variables = _small_decoder()
    run = jax.jit(apply, static_argnames="decode") if jit else apply
    error = jax.errors.JaxRuntimeError if jit else ValueError
    x = jnp.ones((1, 1, 4))
    for index, match in [
        (
            -1,
            r"MultiHeadAttention at the root: cache_index is -1, but it counts the positions "
            r"written so far \(0 to max_length=3\).*fresh 'cache' variables",
        ),
        (
            2**31 - 1,
            r"decoding past max_length: cache_index is 2147483647 and this step writes "
            r"1 position\(s\)",
        ),
    ]:
        edited = {**variables, "cache": {**variables["cache"], "cache_index": jnp.int32(index)}}
        with pytest.raises(error, match=match):
            jax.block_until_ready(run(edited, None, x, decode=True))
    y, new = run(variables, None, x, decode=True)  # index 0 still runs
    assert int(new["cache"]["cache_index"]) == 1 and not np.isnan(np.asarray(y)).any()


def _small_decoder(**options):
    init, apply = lm.transform(MultiHeadAttention(2, 4, decode_shape=(1, 3), **options))
    return apply, init(jax.random.key(0))


@pytest.mark.parametrize("jit", [False, True])
def test_decode_refuses_complex_keys_into_a_real_cache(jit):
    """dtype=None on complex inputs: the float32 cache cannot hold them (no dropped part)."""
    apply, variables = _small_decoder(dtype=None)
    run = jax.jit(apply, static_argnames="decode") if jit else apply
    x = jnp.full((1, 1, 4), 1 + 1j, jnp.complex64)
    with pytest.raises(
        TypeError,
        match=r"MultiHeadAttention at the root cannot write this step's complex64 keys to its "
        r"decoding cache, stored as float32 .*Build the layer with dtype=complex64 \(or "
        r"param_dtype=complex64 with dtype=None\).*imaginary part",
    ):
        run(variables, None, x, decode=True)
    apply, variables = _small_decoder(dtype=None, param_dtype=jnp.complex64)
    y, new = (jax.jit(apply, static_argnames="decode") if jit else apply)(
        variables, None, x, decode=True
    )
    assert new["cache"]["cached_key"].dtype == jnp.complex64
    assert float(jnp.max(jnp.abs(new["cache"]["cached_key"][0, 0].imag))) > 0
    # float32 keys into a bfloat16 cache (dtype=None, bfloat16 variables) are rounded, as declared
    apply, variables = _small_decoder(dtype=None, param_dtype=jnp.bfloat16)
    _, new = apply(variables, None, jnp.ones((1, 1, 4)), decode=True)
    assert new["cache"]["cached_key"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "projection, what, declaration, got",
    [
        (
            "query",
            "kernel",
            lm.Parameter((4, 2, 1), lm.initializers.ones()),
            "a Parameter of shape \\(4, 2, 1\\)",
        ),
        (
            "key",
            "kernel",
            lm.BatchStat((4, 2, 2), lm.initializers.ones()),
            "a BatchStat of shape \\(4, 2, 2\\)",
        ),
        (
            "out",
            "bias",
            lm.Parameter((1,), lm.initializers.ones()),
            "a Parameter of shape \\(1,\\)",
        ),
    ],
)
def test_a_replaced_projection_array_of_another_shape_is_an_error(
    projection, what, declaration, got
):
    """The projections' arrays are read, not called: a changed shape is refused, never used."""
    mha = MultiHeadAttention(2, 4)
    setattr(getattr(mha, projection), what, declaration)
    init, apply = lm.transform(mha)
    expected = {"query": (4, 2, 2), "key": (4, 2, 2), "out": (4,)}[projection]
    with pytest.raises(
        ValueError,
        match=rf"MultiHeadAttention at the root: its '{projection}' projection's {what} is {got}, "
        rf"but the layer reads it as a Parameter of shape {re.escape(str(expected))}\. Put back",
    ):
        apply(init(jax.random.key(0)), None, jnp.ones((1, 3, 4)))


def test_jit_equals_eager(getkey, std_params):
    mha = ours_mha(**STD, dropout_rate=0.3)
    apply, variables = zero_variables(mha, std_params)
    rngs = {"dropout": getkey()}  # a default (threefry) key
    eager, _ = apply(variables, rngs, X, causal=True, is_training=True)
    jitted = jax.jit(lambda v, r, x: apply(v, r, x, causal=True, is_training=True)[0])
    close(jitted(variables, rngs, X), eager)


def test_bfloat16_compute_float32_storage(getkey, std_params):
    kwargs = {**STD, "dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    mha = ours_mha(**kwargs, kernel_init=lm.initializers.normal(), decode_shape=(B, L))
    init, apply = lm.transform(mha)
    ours = init(getkey())
    assert {a.dtype for a in jax.tree.leaves(ours["params"])} == {jnp.dtype(jnp.float32)}
    # the cache is in the compute dtype, as Linen's (which caches key.dtype)
    assert ours["cache"]["cached_key"].dtype == ours["cache"]["cached_value"].dtype == jnp.bfloat16
    variables = {"params": std_params, "cache": ours["cache"]}
    got, _ = apply(variables, None, X)
    expected = linen_apply(linen_mha(**kwargs))({"params": std_params}, X)
    assert got.dtype == expected.dtype == jnp.bfloat16
    close(got, expected, 1e-2)
    # decoding in bfloat16 follows the full pass
    outputs, after = decode_in_steps(apply, variables, X, [1] * L)
    assert after["cache"]["cached_key"].dtype == jnp.bfloat16
    full, _ = apply(variables, None, X, causal=True)
    close(outputs, full, 5e-2)


def test_force_fp32_for_softmax_equals_linen(std_params):
    # float32 parameters computed in bfloat16 (Linen's default param_dtype)
    kwargs = {**STD, "dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    kwargs["force_fp32_for_softmax"] = True
    variables = {"params": std_params}
    with jax.numpy_dtype_promotion("standard"):  # Linen mixes float32 and bfloat16 here
        expected = linen_apply(linen_mha(**kwargs))(variables, X)
    apply, _ = zero_variables(ours_mha(**kwargs))
    got, _ = apply(variables, None, X)
    assert got.dtype == expected.dtype == jnp.bfloat16
    close(got, expected, 1e-2)


def test_dot_product_attention_equals_linen():
    q, k, v = randn(B, L, 3, 4, seed=6), randn(B, 7, 3, 4, seed=7), randn(B, 7, 3, 2, seed=8)
    mask = np.ones((B, 1, L, 7), bool)
    mask[1, ..., 4:] = False
    bias = randn(1, 3, L, 7, seed=9)
    key = dropout_key(3)
    static = ("broadcast_dropout", "deterministic", "dropout_rate")
    linen = jax.jit(nn.dot_product_attention, static_argnames=static)
    plain = dot_product_attention(q, k, v, mask=mask, bias=bias)
    assert plain.shape == (B, L, 3, 2)
    close(plain, linen(q, k, v, bias=bias, mask=mask))
    for broadcast in (True, False):
        dropout = {"dropout_rng": key, "dropout_rate": 0.4, "broadcast_dropout": broadcast}
        got = dot_product_attention(q, k, v, mask=mask, is_training=True, **dropout)
        close(got, linen(q, k, v, mask=mask, deterministic=False, **dropout))
    # not training: no dropout, no key needed
    no_dropout = dot_product_attention(q, k, v, mask=mask, bias=bias, dropout_rate=0.4)
    close(no_dropout, plain)
    assert not np.allclose(no_dropout, got)


def test_dot_product_attention_draws_dropout_keys_inside_a_call():
    q = randn(B, L, 3, 4, seed=10)

    class Net(lm.Module):
        def __call__(self, q):
            return dot_product_attention(q, q, q, is_training=True, dropout_rate=0.4)

    _, apply = lm.transform(Net())
    key = dropout_key(4)
    got, _ = apply({}, {"dropout": key}, q)
    expected = dot_product_attention(
        q, q, q, is_training=True, dropout_rate=0.4, dropout_rng=jax.random.fold_in(key, 0)
    )
    close(got, expected)
    with pytest.raises(RuntimeError, match=r"next_rng_key\(\) was called outside init/apply"):
        dot_product_attention(q, q, q, is_training=True, dropout_rate=0.4)


def test_mask_helpers_equal_linen():
    a = np.array([[1, 0, 2], [3, 3, 0]], np.int32)
    b = np.array([[0, 1, 1, 2], [1, 3, 0, 0]], np.int32)
    for kwargs in [{}, {"extra_batch_dims": 2, "pairwise_fn": jnp.greater_equal}]:
        expected = nn.make_attention_mask(a, b, **kwargs)
        got = make_attention_mask(a, b, **kwargs)  # bool by default; Linen's is float32
        assert got.shape == expected.shape and got.dtype == jnp.bool_
        np.testing.assert_array_equal(got, expected != 0)
        got = make_attention_mask(a, b, **kwargs, dtype=jnp.float32)
        assert got.dtype == expected.dtype == jnp.float32
        np.testing.assert_array_equal(got, expected)
    got = make_attention_mask(a > 0, b > 0, dtype=jnp.bool_)
    assert got.dtype == jnp.bool_ and got.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(got, (a > 0)[:, None, :, None] & (b > 0)[:, None, None, :])
    for shape, extra in [((2, 3), 0), ((3,), 1)]:
        got = make_causal_mask(np.ones(shape), extra_batch_dims=extra)
        expected = nn.make_causal_mask(np.ones(shape), extra_batch_dims=extra)
        assert got.shape == expected.shape and got.dtype == jnp.bool_
        np.testing.assert_array_equal(got, expected != 0)
    padding = make_attention_mask(a > 0, a > 0)
    causal = make_causal_mask(a)
    combined = combine_masks(padding, None, causal)
    assert combined.dtype == jnp.bool_
    np.testing.assert_array_equal(combined, nn.combine_masks(padding, None, causal) != 0)
    assert combine_masks(None, None) is None
    assert combine_masks(padding, dtype=jnp.float32).dtype == jnp.float32


# --- errors a user can cause ------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """A self-attention layer (3 heads, 6 features) and a decoding one, with variables."""
    return zero_variables(MultiHeadAttention(3, F)), zero_variables(
        MultiHeadAttention(3, F, decode_shape=(B, 4))
    )


def ones(shape):
    return np.ones(shape, np.float32)


def trues(shape):
    return np.ones(shape, bool)


FEATURE_ERRORS = [
    (
        (ones((B, L, 7)),),
        r"inputs_q of shape \(2, 5, 7\): its last axis must be in_size=6, got 7\. Pass "
        r"inputs_q of shape \(\.\.\., 6\), or build the layer with in_size=7",
    ),
    (
        (ones((B, L, F)), ones((B, 7, 4))),
        r"inputs_k of shape \(2, 7, 4\): its last axis must be key_size=6, got 4",
    ),
    (
        (ones((B, L, F)), ones((B, 7, F)), ones((B, 7, 3))),
        r"inputs_v of shape \(2, 7, 3\): its last axis must be value_size=6, got 3",
    ),
]


@pytest.mark.parametrize(("args", "match"), FEATURE_ERRORS)
def test_inputs_of_the_wrong_feature_size(built, args, match):
    (apply, variables), _ = built
    with pytest.raises(ValueError, match=r"MultiHeadAttention got " + match):
        apply(variables, None, *args)


CALL_ERRORS = [
    ((ones(F),), {}, r"inputs_q must have shape \(batch..., length, features\), got shape \(6,\)"),
    ((ones((B, L, F)), None, ones((B, L, F))), {}, r"inputs_v was given without inputs_k"),
    (
        (ones((B, L, F)), ones((3, L, F))),
        {},
        r"inputs_q, inputs_k and inputs_v must have the same batch shape",
    ),
    (
        (ones((B, L, F)), ones((B, 7, F)), ones((B, 6, F))),
        {},
        r"inputs_k and inputs_v must have the same length",
    ),
    (
        (ones((B, L, F)),),
        {"mask": trues((B, 1, L, 7))},
        r"mask of shape \(2, 1, 5, 7\) does not broadcast to the attention weights' shape "
        r"\(batch..., num_heads, q_length, kv_length\) = \(2, 3, 5, 5\)",
    ),
    (
        (ones((B, L, F)),),
        {"mask": trues((1, B, 1, L, L))},
        r"mask of shape \(1, 2, 1, 5, 5\) does not broadcast",
    ),
    ((ones((B, L, F)),), {"is_training": np.bool_(True)}, r"is_training must be a Python bool"),
    ((ones((B, L, F)),), {"causal": 1}, r"causal must be a Python bool, got int"),
    (
        (ones((B, 1, F)),),
        {"decode": True},
        r"decode=True needs a decoding cache, and this layer has none. Build it with "
        r"decode_shape=\(\*batch, max_length\)",
    ),
]


@pytest.mark.parametrize(("args", "kwargs", "match"), CALL_ERRORS)
def test_call_errors(built, args, kwargs, match):
    (apply, variables), _ = built
    error = TypeError if "Python bool" in match else ValueError
    with pytest.raises(error, match=r"MultiHeadAttention: " + match):
        apply(variables, None, *args, **kwargs)


DECODE_ERRORS = [
    (
        (ones((3, 1, F)),),
        {},
        r"decode=True with inputs of batch shape \(3,\), but the cache was sized for batch "
        r"shape \(2,\) \(decode_shape=\(2, 4\)\)",
    ),
    (
        (ones((B, 1, F)), ones((B, 2, F))),
        {},
        r"with decode=True the keys and values are cached at the queries' positions, so "
        r"inputs_k must have the queries' length 1; got shape \(2, 2, 6\)",
    ),
    (
        (ones((B, 1, F)),),
        {"mask": trues((B, 1, 1, 2))},
        r"mask of shape \(2, 1, 1, 2\) does not broadcast to the attention weights' shape "
        r"\(batch..., num_heads, q_length, kv_length\) = \(2, 3, 1, 4\)",
    ),
    ((ones((B, 5, F)),), {}, r"decoding past max_length: cache_index is 0 and this step writes 5"),
]


@pytest.mark.parametrize(("args", "kwargs", "match"), DECODE_ERRORS)
def test_decode_errors(built, args, kwargs, match):
    _, (apply, variables) = built
    with pytest.raises(ValueError, match=r"MultiHeadAttention(?: at the root)?: " + match):
        apply(variables, None, *args, decode=True, **kwargs)


CONSTRUCTOR_ERRORS = [
    (
        {"num_heads": 4, "in_size": 6},
        r"qkv_size=6 is not divisible by num_heads=4; each head gets qkv_size // "
        r"num_heads features",
    ),
    ({"num_heads": 2, "in_size": 6, "qkv_size": 9}, r"qkv_size=9 is not divisible"),
    ({"num_heads": 0, "in_size": 6}, r"num_heads must be a positive int, got 0"),
    ({"num_heads": 2, "in_size": 6.0}, r"in_size must be a positive int, got 6.0"),
    ({"num_heads": 2, "in_size": 6, "key_size": -1}, r"key_size must be a positive"),
    ({"num_heads": 2, "in_size": 6, "dropout_rate": 1.0}, r"dropout_rate must be a number "),
    (
        {"num_heads": 2, "in_size": 6, "decode_shape": (2, 0)},
        r"decode_shape must be a non-empty tuple of positive ints, \(\*batch, max_length\); "
        r"got \(2, 0\)",
    ),
    ({"num_heads": 2, "in_size": 6, "decode_shape": 16}, r"decode_shape must be a non-empty"),
]


@pytest.mark.parametrize(("kwargs", "match"), CONSTRUCTOR_ERRORS)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=r"MultiHeadAttention: " + match):
        MultiHeadAttention(**kwargs)


q4 = ones((B, L, 3, 4))
FUNCTION_ERRORS = [
    ((q4, ones((B, 7, 3, 4)), ones((B, 7, 3, 2))), {"mask": trues((B, 1, L, 6))}, r"mask of shape"),
    (
        (q4, ones((B, 7, 3, 4)), ones((B, 7, 3, 2))),
        {"bias": ones((B, 2, L, 7))},
        r"bias of shape \(2, 2, 5, 7\) does not broadcast .* = \(2, 3, 5, 7\)",
    ),
    ((q4, ones((L, 3, 4)), q4), {}, r"query, key and value must have the same rank, at least 3"),
    ((ones((L, 4)),) * 3, {}, r"query, key and value must have the same rank, at least 3"),
    ((q4, ones((3, L, 3, 4)), q4), {}, r"query, key and value must have the same batch axes"),
    ((q4, ones((B, L, 2, 4)), q4), {}, r"key and value must have the same number of heads"),
    (
        (q4, ones((B, L, 2, 4)), ones((B, L, 2, 4))),
        {},
        r"the query's number of heads \(3\) must be a multiple of the key's \(2\)",
    ),
    ((q4, ones((B, L, 3, 5)), q4), {}, r"query and key must have the same depth"),
    ((q4, q4, ones((B, 6, 3, 4))), {}, r"key and value must have the same length"),
    ((q4, q4, q4), {"dropout_rate": -0.1}, r"dropout_rate must be a number in \[0, 1\)"),
]


@pytest.mark.parametrize(("args", "kwargs", "match"), FUNCTION_ERRORS)
def test_dot_product_attention_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=r"dot_product_attention: " + match):
        dot_product_attention(*args, **kwargs)


def test_dot_product_attention_is_training_must_be_a_bool():
    with pytest.raises(TypeError, match=r"is_training must be a Python bool, got int"):
        dot_product_attention(q4, q4, q4, is_training=1)


def test_dot_product_attention_dtype_must_be_inexact():
    with pytest.raises(
        TypeError,
        match=r"^dot_product_attention: dtype must be a floating or complex dtype such as "
        r"jnp.float32, jnp.bfloat16 or jnp.complex64, got int32",
    ):
        dot_product_attention(q4, q4, q4, dtype=np.int32)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (
            np.where(np.tril(np.ones((L, L))) > 0, 0.0, -np.inf).astype(np.float32),
            r"mask must be a boolean array \(True keeps a query-key pair\), got dtype float32\. "
            r"If it is an additive mask \(0 keeps, -inf or a large negative number drops\), "
            r"pass it as bias=",
        ),
        (
            np.ones((L, L), np.int32),
            r"mask must be a boolean array .*, got dtype int32\. If it is a "
            r"0/1 mask, convert it",
        ),
    ],
)
def test_masks_must_be_boolean(built, mask, match):
    """A float additive mask was silently cast to bool and inverted: now it is an error."""
    (apply, variables), _ = built
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: " + match):
        apply(variables, None, ones((B, L, F)), mask=mask)
    with pytest.raises(TypeError, match=r"^dot_product_attention: " + match):
        dot_product_attention(q4, q4, q4, mask=mask)


def test_additive_mask_as_bias_equals_the_boolean_mask():
    causal = np.tril(np.ones((L, L), bool))
    additive = np.where(causal, 0.0, -1e9).astype(np.float32)
    q = randn(B, L, 3, 4, seed=11)
    close(
        dot_product_attention(q, q, q, bias=additive), dot_product_attention(q, q, q, mask=causal)
    )


def test_mask_helper_settings_are_checked():
    with pytest.raises(ValueError, match=r"^make_attention_mask: extra_batch_dims must be a non"):
        make_attention_mask(ones((1, 2)), ones((1, 2)), extra_batch_dims=-1)
    with pytest.raises(TypeError, match=r"^make_attention_mask: pairwise_fn must be a function"):
        make_attention_mask(ones((1, 2)), ones((1, 2)), pairwise_fn="multiply")
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 3 were given"):
        make_attention_mask(ones((1, 2)), ones((1, 2)), jnp.greater)  # options are keywords
    with pytest.raises(ValueError, match=r"^make_causal_mask: x must have a length axis"):
        make_causal_mask(np.float32(1.0))
    with pytest.raises(TypeError, match=r"^make_causal_mask: extra_batch_dims must be"):
        make_causal_mask(ones((1, 2)), extra_batch_dims=True)


def test_combine_masks_of_different_ranks():
    with pytest.raises(
        ValueError, match=r"the masks must have the same rank, got shapes \(1, 1, 2, 2\), \(2, 2\)"
    ):
        combine_masks(ones((1, 1, 2, 2)), ones((2, 2)))


class _Doubled(lm.DenseGeneral):
    def __call__(self, x):
        return 2.0 * super().__call__(x)


@pytest.mark.parametrize("jit", [False, True])
def test_replaced_projections_are_called_as_modules(std_params, jit):
    """A module put in place of a projection runs its own call, never read for a kernel."""
    heads = (STD["num_heads"], STD["qkv_features"] // STD["num_heads"])
    _, plain = lm.transform(ours_mha(**STD))
    expected, _ = plain({"params": std_params}, None, X, causal=True)

    mha = ours_mha(**STD)
    mha.query = lm.DenseGeneral(F, heads)  # Linen's layout: the same variables
    mha.out = lm.DenseGeneral(heads, STD["out_features"], axis=(-2, -1))
    _, apply = lm.transform(mha)
    apply = jax.jit(apply, static_argnames="causal") if jit else apply
    got, _ = apply({"params": std_params}, None, X, causal=True)
    close(got, expected)

    # A subclass whose call differs: its output is used (the value projection doubled).
    mha = ours_mha(**STD)
    mha.value = _Doubled(F, heads)
    _, apply = lm.transform(mha)
    got, _ = (jax.jit(apply) if jit else apply)({"params": std_params}, None, X)
    doubled = {
        **std_params,
        "value": {
            "kernel": 2 * std_params["value"]["kernel"],
            "bias": 2 * std_params["value"]["bias"],
        },
    }
    close(got, plain({"params": doubled}, None, X)[0])


def test_a_replaced_projection_of_the_wrong_shape_is_an_error(std_params):
    class Holder(lm.Module):
        def __init__(self):
            self.attention = ours_mha(**STD)
            self.attention.key = lm.DenseGeneral(F, (STD["num_heads"], 2))

        def __call__(self, x):
            return self.attention(x)

    init, apply = lm.transform(Holder())
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention at attention: its 'key' projection, a DenseGeneral put in "
        r"place of the layer's own, maps an input of shape \(2, 5, 6\) to \(2, 5, 3, 2\), "
        r"but the attention needs \(2, 5, 3, 4\)",
    ):
        apply(init(jax.random.key(0)), None, X)


# --- a smaller layer on shorter sequences: dtypes, dropout_rng, attention_fn, normalize_qk ------

# The tests below run a layer of HEADS heads of size QKV // HEADS on sequences of SHORT steps.
HEADS, QKV, SHORT = 2, 8, 4
SHORT_X = randn(B, SHORT, F, seed=1)
SHORT_CAUSAL = np.broadcast_to(np.tril(np.ones((SHORT, SHORT), bool)), (B, 1, SHORT, SHORT))


def small_linen_mha(**kwargs):
    """Linen's small layer (HEADS heads of size QKV // HEADS)."""
    kwargs.setdefault("kernel_init", nn.initializers.normal(0.5))
    kwargs.setdefault("bias_init", nn.initializers.normal(0.5))
    return nn.MultiHeadDotProductAttention(HEADS, qkv_features=QKV, **kwargs)


def small_ours_mha(**kwargs):
    """Our small layer, for queries of F features."""
    return lm.MultiHeadAttention(HEADS, F, qkv_size=QKV, **kwargs)


@functools.cache
def small_linen_variables(param_dtype=jnp.float32, normalize_qk=False):
    """Linen's init variables, shared by the tests (scales made non-trivial)."""
    layer = small_linen_mha(param_dtype=param_dtype, normalize_qk=normalize_qk)
    x = np.zeros((B, SHORT, F), param_dtype)
    with jax.numpy_dtype_promotion("standard"):  # Linen's LayerNorm mixes dtypes
        variables = jax.jit(layer.init)(jax.random.key(0), x)
    params = dict(variables["params"])
    for name in ("query_ln", "key_ln"):
        if name in params:
            scale = randn(QKV // HEADS, seed=len(name)).astype(np.float32) + 1.0
            params[name] = {"scale": jnp.asarray(scale, param_dtype)}
    return {"params": params}


def ours_apply(mha):
    return lm.transform(mha).apply


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
    variables = small_linen_variables(param_dtype, normalize_qk)
    x = jnp.asarray(randn(B, SHORT, F, seed=2, dtype=np.dtype(input_dtype)), input_dtype)
    linen = small_linen_mha(param_dtype=param_dtype, normalize_qk=normalize_qk)
    with jax.numpy_dtype_promotion("standard"):  # Linen relies on implicit promotion
        expected = linen_apply(linen)(variables, x, mask=SHORT_CAUSAL)
    mha = small_ours_mha(dtype=None, param_dtype=param_dtype, normalize_qk=normalize_qk)
    got, _ = ours_apply(mha)(variables, None, x, causal=True)
    assert got.dtype == expected.dtype
    assert_close_complex(got, expected, *((tol, tol) if tol else ()))


def test_complex_values_under_a_real_dtype_are_an_error():
    x = randn(B, SHORT, F, seed=3, dtype=np.complex64)
    apply = ours_apply(small_ours_mha())  # dtype=float32
    with pytest.raises(
        TypeError,
        match=r"^MultiHeadAttention at the root got a complex64 value but computes in "
        r"float32 \(dtype=float32\): the cast would drop the imaginary part",
    ):
        apply(small_linen_variables(), None, x)
    with pytest.raises(TypeError, match=r"^dot_product_attention got a complex64 value"):
        lm.dot_product_attention(x[..., None, :], x[..., None, :], x[..., None, :], dtype="float32")


def test_dot_product_attention_infers_its_dtype_as_linen():
    q = randn(B, SHORT, HEADS, 4, seed=4, dtype=np.complex64)
    k, v = randn(B, 3, HEADS, 4, seed=5, dtype=np.complex64), randn(B, 3, HEADS, 2, seed=6)
    linen = jax.jit(nn.dot_product_attention)
    for query, value in [(q, v.astype(np.complex64)), (q.real.astype(jnp.bfloat16), v)]:
        keys = k if jnp.iscomplexobj(query) else k.real.astype(jnp.bfloat16)
        with jax.numpy_dtype_promotion("standard"):
            expected = linen(query, keys, value)
        got = lm.dot_product_attention(query, keys, value)
        assert got.dtype == expected.dtype  # complex64; float32 from bfloat16 and float32
        assert_close_complex(got, expected, rtol=1e-2, atol=1e-2)


# --- dot_product_attention_weights --------------------------------------------------------------


def test_dot_product_attention_weights_equal_linen():
    q, k = randn(B, SHORT, HEADS, 4, seed=7), randn(B, 3, HEADS, 4, seed=8)
    mask = np.ones((B, 1, SHORT, 3), bool)
    mask[1, ..., 2:] = False
    bias = randn(1, HEADS, SHORT, 3, seed=9)
    static = ("broadcast_dropout", "deterministic", "dropout_rate")
    linen = jax.jit(nn.dot_product_attention_weights, static_argnames=static)
    got = lm.dot_product_attention_weights(q, k, mask=mask, bias=bias)
    assert got.shape == (B, HEADS, SHORT, 3)
    assert_close_complex(got, linen(q, k, bias=bias, mask=mask))
    assert_close_complex(got.sum(-1), np.ones((B, HEADS, SHORT), np.float32))
    dropout = {"dropout_rng": dropout_key(1), "dropout_rate": 0.5, "broadcast_dropout": False}
    got = lm.dot_product_attention_weights(q, k, mask=mask, is_training=True, **dropout)
    assert_close_complex(got, linen(q, k, mask=mask, deterministic=False, **dropout))
    # the weights are what dot_product_attention multiplies the values by
    v = randn(B, 3, HEADS, 2, seed=10)
    expected = lm.dot_product_attention(q, k, v, mask=mask, is_training=True, **dropout)
    assert_close_complex(np.einsum("bhqk,bkhd->bqhd", got, v), expected)


def test_dot_product_attention_weights_errors():
    q = np.ones((B, SHORT, HEADS, 4), np.float32)
    with pytest.raises(
        ValueError, match=r"^dot_product_attention_weights: the query's number of heads \(2\)"
    ):
        lm.dot_product_attention_weights(q, np.ones((B, SHORT, 3, 4), np.float32))
    with pytest.raises(TypeError, match=r"^dot_product_attention_weights: mask must be a bool"):
        lm.dot_product_attention_weights(q, q, mask=np.ones((SHORT, SHORT), np.float32))


# --- dropout_rng ----------------------------------------------------------------------------


def test_dropout_rng_equals_linens_and_replaces_the_stream():
    variables = small_linen_variables()
    linen = linen_apply(small_linen_mha(dropout_rate=0.5))
    apply = ours_apply(small_ours_mha(dropout_rate=0.5))
    rng = dropout_key(2)
    expected = linen(variables, SHORT_X, deterministic=False, dropout_rng=rng)
    got, _ = apply(variables, None, SHORT_X, is_training=True, dropout_rng=rng)  # no stream needed
    assert_close_complex(got, expected)
    # the given key wins over the "dropout" stream, as in Linen
    assert_close_complex(
        apply(variables, {"dropout": dropout_key(3)}, SHORT_X, is_training=True, dropout_rng=rng)[
            0
        ],
        got,
    )
    assert not np.allclose(
        apply(variables, {"dropout": dropout_key(3)}, SHORT_X, is_training=True)[0], got
    )
    # not training, the key is not used
    assert_close_complex(
        apply(variables, None, SHORT_X, dropout_rng=rng)[0],
        linen(variables, SHORT_X, deterministic=True),
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
    apply = ours_apply(small_ours_mha(dropout_rate=0.5))
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: " + message):
        apply(small_linen_variables(), None, SHORT_X, is_training=True, dropout_rng=dropout_rng)
    q = np.ones((B, SHORT, HEADS, 4), np.float32)
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
    variables = small_linen_variables()
    linen = small_linen_mha(attention_fn=attention_fn, dropout_rate=0.5)
    apply = ours_apply(small_ours_mha(attention_fn=attention_fn, dropout_rate=0.5))
    rng = dropout_key(4)
    expected = linen_apply(linen)(
        variables, SHORT_X, mask=SHORT_CAUSAL, deterministic=False, dropout_rng=rng
    )
    got, _ = apply(variables, None, SHORT_X, causal=True, is_training=True, dropout_rng=rng)
    assert_close_complex(got, expected)

    def ours(v, x):
        return jnp.sum(jnp.sin(apply(v, None, x, causal=True)[0]))

    def theirs(v, x):
        return jnp.sum(jnp.sin(linen.apply(v, x, mask=SHORT_CAUSAL, deterministic=True)))

    grads = jax.grad(ours, argnums=(0, 1))(variables, SHORT_X)
    assert_close_complex(
        grads, jax.jit(jax.grad(theirs, argnums=(0, 1)))(variables, SHORT_X), 1e-5, 1e-5
    )


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

    variables = small_linen_variables()
    apply = ours_apply(small_ours_mha(attention_fn=lamina_style, dropout_rate=0.5))
    reference = ours_apply(small_ours_mha(dropout_rate=0.5))
    got, _ = apply(
        variables, None, SHORT_X, causal=True, is_training=True, dropout_rng=dropout_key(5)
    )
    expected, _ = reference(
        variables, None, SHORT_X, causal=True, is_training=True, dropout_rng=dropout_key(5)
    )
    assert_close_complex(got, expected)
    apply(variables, None, SHORT_X)
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
    apply = ours_apply(small_ours_mha(**settings))
    with pytest.raises(error, match=r"^MultiHeadAttention: " + match):
        apply(small_linen_variables(), None, SHORT_X, **kwargs)


def test_attention_fn_settings_are_checked():
    with pytest.raises(
        TypeError,
        match=r"^MultiHeadAttention: attention_fn must be a function such as "
        r"lm.dot_product_attention, got 'dot'",
    ):
        small_ours_mha(attention_fn="dot")
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: attention_fn=max has no signature"):
        small_ours_mha(attention_fn=max)
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: normalize_qk must be True or False"):
        small_ours_mha(normalize_qk=1)
    mha = small_ours_mha()
    assert mha.attention_fn is lm.dot_product_attention
    with pytest.raises(AttributeError, match=r"attention_fn is read-only"):
        mha.attention_fn = no_mask


# --- normalize_qk ---------------------------------------------------------------------------------


def test_normalize_qk_equals_linen_outputs_and_gradients():
    variables = small_linen_variables(normalize_qk=True)
    linen = small_linen_mha(normalize_qk=True)
    mha = small_ours_mha(normalize_qk=True)
    init, apply = lm.transform(mha)
    shapes = jax.eval_shape(init, jax.random.key(0))
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, variables)
    assert shapes["params"]["query_ln"].keys() == {"scale"}  # no bias, as Linen's
    got, _ = apply(variables, None, SHORT_X, causal=True)
    assert_close_complex(got, linen_apply(linen)(variables, SHORT_X, mask=SHORT_CAUSAL))

    def ours(v, x):
        return jnp.sum(jnp.sin(apply(v, None, x, causal=True)[0]))

    def theirs(v, x):
        return jnp.sum(jnp.sin(linen.apply(v, x, mask=SHORT_CAUSAL)))

    grads = jax.grad(ours, argnums=(0, 1))(variables, SHORT_X)
    expected = jax.jit(jax.grad(theirs, argnums=(0, 1)))(variables, SHORT_X)
    assert_close_complex(grads, expected, 1e-5, 1e-5)
    assert float(np.abs(grads[0]["params"]["key_ln"]["scale"]).sum()) > 0


def test_normalize_qk_decoding_caches_the_normalised_keys():
    variables = small_linen_variables(normalize_qk=True)
    mha = small_ours_mha(normalize_qk=True, decode_shape=(B, SHORT))
    init, apply = lm.transform(mha)
    variables = {**variables, "cache": init(jax.random.key(0))["cache"]}
    full, _ = apply(variables, None, SHORT_X, causal=True)
    steps, states = [], [variables]
    for t in range(SHORT):
        y, state = apply(states[-1], None, SHORT_X[:, t : t + 1], decode=True)
        steps.append(y)
        states.append(state)
    assert_close_complex(jnp.concatenate(steps, axis=1), full)
    # Linen's first decoding step gives the same output and the same (normalised) cache
    linen = small_linen_mha(normalize_qk=True, decode=True)
    cache = jax.tree.map(np.zeros_like, dict(variables["cache"]))
    y, updated = linen_apply(linen)({**variables, "cache": cache}, SHORT_X[:, :1], mutable="cache")
    assert_close_complex(steps[0], y)
    assert_close_complex(states[1]["cache"], dict(updated["cache"]))


# --- recorded attention weights (sow_weights) -------------------------------------------------


@pytest.mark.parametrize("attention_fn", [lm.dot_product_attention, nn.dot_product_attention])
def test_sown_weights_equal_linens(attention_fn):
    variables = small_linen_variables()
    linen = small_linen_mha(dropout_rate=0.5)
    apply = ours_apply(small_ours_mha(attention_fn=attention_fn, dropout_rate=0.5))
    rng = dropout_key(6)
    expected, state = linen_apply(linen, mutable="intermediates")(
        variables,
        SHORT_X,
        mask=SHORT_CAUSAL,
        deterministic=False,
        dropout_rng=rng,
        sow_weights=True,
    )
    request = {**variables, "intermediates": {}}
    got, new = apply(request, None, SHORT_X, causal=True, is_training=True, dropout_rng=rng,
                     sow_weights=True)  # fmt: skip
    assert_close_complex(got, expected)
    # the weights before dropout, under the layer's path (here the root), as Linen's
    assert_close_complex(new["intermediates"], dict(state["intermediates"]))
    (weights,) = new["intermediates"]["attention_weights"]
    assert weights.shape == (B, HEADS, SHORT, SHORT)
    np.testing.assert_array_equal(np.triu(np.asarray(weights), 1), 0.0)  # causal


def test_weights_are_recorded_only_on_request():
    variables = small_linen_variables()
    apply = ours_apply(small_ours_mha())
    _, new = apply(variables, None, SHORT_X, sow_weights=True)  # not asked: nothing recorded
    assert new.keys() == {"params"}
    _, new = apply({**variables, "intermediates": {}}, None, SHORT_X)  # sow_weights=False
    assert new["intermediates"] == {}
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: sow_weights must be a Python bool"):
        apply(variables, None, SHORT_X, sow_weights=1)

    class TwoLayers(lm.Module):
        def __init__(self):
            self.first, self.second = small_ours_mha(), small_ours_mha(out_size=F)

        def __call__(self, x):
            h = self.first(x, sow_weights=True)
            # the function records under the calling module's path too
            lm.dot_product_attention(h[..., None, :], h[..., None, :], h[..., None, :],
                                     sow_weights=True)  # fmt: skip
            return self.second(self.second(h, sow_weights=True), sow_weights=True)

    init, apply = lm.transform(TwoLayers())
    two = init(jax.random.key(0))
    _, new = apply({**two, "intermediates": {}}, None, SHORT_X)
    records = jax.tree.map(jnp.shape, new["intermediates"])
    assert records == {
        "attention_weights": ((B, 1, SHORT, SHORT),),
        "first": {"attention_weights": ((B, HEADS, SHORT, SHORT),)},
        "second": {"attention_weights": ((B, HEADS, SHORT, SHORT),) * 2},  # called twice
    }
    with pytest.raises(RuntimeError, match=r"lm.sow runs only inside init/apply"):
        x = SHORT_X[..., None, :]
        lm.dot_product_attention(x, x, x, sow_weights=True)
