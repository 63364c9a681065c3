"""The logits processors of generate against transformers' warpers; drawing tokens; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lamina.models.sampling import process_logits, sample

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def random_logits(seed, ties=False):
    rng = np.random.default_rng(seed)
    logits = (2.0 * rng.standard_normal((4, 128))).astype(np.float32)
    if ties:  # one decimal: many equal logits, at every cut
        logits = np.round(logits, 1).astype(np.float32)
    return logits


def hf_process(logits, temperature, top_k, top_p):
    """transformers' warpers in generate's order (temperature, top-k, top-p)."""
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    return warpers(ids, torch.from_numpy(logits.copy())).numpy()


SETTINGS = [
    (1.0, None, None),
    (0.7, None, None),
    (1.0, 10, None),
    (1.0, 1, None),
    (1.0, 200, None),
    (1.0, None, 0.9),
    (1.0, None, 0.5),
    (1.0, None, 0.0),
    (0.6, 20, 0.8),
    (1.5, 50, 0.95),
    (2.0, 5, 0.3),
]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_removed_tokens_equal_transformers(temperature, top_k, top_p, ties):
    for seed in range(3):
        logits = random_logits(seed, ties)
        expected = hf_process(logits, temperature, top_k, top_p)
        ours = np.asarray(
            process_logits(jnp.asarray(logits), temperature=temperature, top_k=top_k, top_p=top_p)
        )
        assert ours.dtype == np.float32 and ours.shape == logits.shape
        removed, hf_removed = np.isinf(ours), np.isinf(expected)
        if ties and top_p is not None:
            # transformers removes an arbitrary subset of the tokens tied with the smallest
            # kept logit (PyTorch's sort is not stable); lamina keeps them all
            assert not (removed & ~hf_removed).any()
            smallest_kept = np.where(removed, np.inf, ours).min(-1, keepdims=True)
            differ = hf_removed & ~removed
            assert (ours[differ] == np.broadcast_to(smallest_kept, ours.shape)[differ]).all()
        else:
            np.testing.assert_array_equal(removed, hf_removed)
        kept = ~hf_removed
        np.testing.assert_allclose(ours[kept], expected[kept], rtol=1e-6)
        if (top_k and top_k < 128) or (top_p is not None and top_p < 1.0):
            assert removed.any()  # something was removed: the test bites


def test_ties_at_the_top_p_cut_are_kept():
    # probabilities 0.1, 0.2, 0.2, 0.5: top_p=0.65 cuts between the two 0.2s (cumulative 0.1,
    # 0.3, 0.5, 1 against 1 - 0.65 = 0.35): transformers drops one of them, lamina neither
    logits = jnp.log(jnp.array([[0.2, 0.1, 0.5, 0.2]]))
    np.testing.assert_array_equal(
        np.isinf(process_logits(logits, top_p=0.65)), [[False, True, False, False]]
    )
    hf = hf_process(np.asarray(logits), None, None, 0.65)
    assert np.isinf(hf).sum() == 2 and np.isinf(hf[0, 1])
    np.testing.assert_array_equal(
        np.isinf(process_logits(logits, top_p=0.45)), [[True, True, False, True]]
    )


def test_ties_are_kept_by_top_k():
    logits = jnp.array([[1.0, 3.0, 2.0, 3.0, 2.0]])
    np.testing.assert_array_equal(
        np.isinf(process_logits(logits, top_k=1)), [[True, False, True, False, True]]
    )
    np.testing.assert_array_equal(
        np.isinf(process_logits(logits, top_k=3)), [[True, False, False, False, False]]
    )


def test_traced_temperature_and_top_p_match_concrete_ones():
    logits = jnp.asarray(random_logits(5))

    @jax.jit
    def run(logits, temperature, top_p):
        return process_logits(logits, temperature=temperature, top_k=30, top_p=top_p)

    for temperature, top_p in [(0.5, 0.9), (1.3, 0.6), (1.0, 1.0)]:
        expected = process_logits(logits, temperature=temperature, top_k=30, top_p=top_p)
        np.testing.assert_array_equal(run(logits, temperature, top_p), expected)
    # a traced top_p of 1.0 removes nothing more than top-k, as transformers skips the warper
    only_top_k = process_logits(logits, top_k=30)
    np.testing.assert_array_equal(run(logits, 1.0, 1.0), only_top_k)


@pytest.fixture(scope="module")
def batch():
    return jnp.asarray(random_logits(7, ties=True))


def test_sampled_tokens_lie_in_the_kept_set(batch):
    options = {"temperature": 0.8, "top_k": 20, "top_p": 0.7}
    kept = ~np.isinf(np.asarray(process_logits(batch, **options)))
    draw = jax.jit(lambda key: sample(batch, key, **options))
    seen = np.zeros_like(kept)
    for i in range(200):
        tokens = np.asarray(draw(jax.random.key(i)))
        assert tokens.dtype == np.int32 and tokens.shape == (4,)
        assert kept[np.arange(4), tokens].all()
        seen[np.arange(4), tokens] = True
    assert (seen.sum(-1) > 1).all()  # it samples, not always the argmax


def test_same_key_same_tokens_other_key_other_tokens(batch):
    a = sample(batch, jax.random.key(0), temperature=1.0)
    np.testing.assert_array_equal(a, sample(batch, jax.random.key(0), temperature=1.0))
    draws = {tuple(np.asarray(sample(batch, jax.random.key(i)))) for i in range(10)}
    assert len(draws) > 1
    # a row's token does not depend on the batch size
    np.testing.assert_array_equal(sample(batch[:2], jax.random.key(0)), a[:2])
    # fold_in keys of successive steps differ
    step_keys = [jax.random.fold_in(jax.random.key(0), t) for t in range(3)]
    tokens = {tuple(np.asarray(sample(batch, k))) for k in step_keys}
    assert len(tokens) > 1


def test_frequencies_follow_the_softmax():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    tokens = jax.vmap(lambda k: sample(logits, k)[0])(keys)
    freq = np.bincount(np.asarray(tokens), minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    # temperature 0.5 squares the odds
    tokens = jax.vmap(lambda k: sample(logits, k, temperature=0.5)[0])(keys)
    freq = np.bincount(np.asarray(tokens), minlength=3) / 4000
    np.testing.assert_allclose(freq, np.array([25, 9, 4]) / 38, atol=0.03)


def test_temperature_zero_is_argmax_concrete_or_traced(batch):
    greedy = np.asarray(jnp.argmax(batch, -1))
    np.testing.assert_array_equal(sample(batch, jax.random.key(0), temperature=0.0), greedy)
    run = jax.jit(lambda t, key: sample(batch, key, temperature=t, top_p=0.9))
    np.testing.assert_array_equal(run(0.0, jax.random.key(3)), greedy)
    assert (np.asarray(run(5.0, jax.random.key(3))) != greedy).any()


def test_bfloat16_logits_are_processed_in_float32(batch):
    out = process_logits(batch.astype(jnp.bfloat16), top_k=5)
    assert out.dtype == jnp.float32
    assert sample(batch.astype(jnp.bfloat16), jax.random.key(0)).dtype == jnp.int32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, r"process_logits: temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
        ({"top_k": -1}, r"top_k must be None or an int >= 0"),
        ({"top_k": 2.5}, r"top_k must be None or an int >= 0"),
        ({"top_p": 1.5}, r"top_p must be None or a number in \[0, 1\]"),
    ],
)
def test_process_errors(batch, kwargs, match):
    with pytest.raises(ValueError, match=match):
        process_logits(batch, **kwargs)


def test_sample_errors(batch):
    with pytest.raises(ValueError, match=r"temperature=0 is greedy decoding .* ignores top_k=5"):
        sample(batch, jax.random.key(0), temperature=0.0, top_k=5)
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number"):
        sample(batch, jax.random.key(0), temperature=-0.5)
    with pytest.raises(ValueError, match=r"logits must be a \(batch, vocab\) floating array"):
        sample(batch[0], jax.random.key(0))
    with pytest.raises(ValueError, match=r"logits must be a \(batch, vocab\) floating array"):
        process_logits(jnp.ones((2, 3), jnp.int32))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30])
@pytest.mark.parametrize("traced", [False, True])
def test_tiny_temperature_draws_the_maximum_not_the_first_overflow(temperature, traced):
    """logits / 1e-45 overflow to +inf unshifted; the largest then is the first +inf."""
    logits = jnp.array([[100.0, 200.0, -5.0, 150.0], [-1.0, -3.0, 7.0, 7.0]])
    draw = jax.jit(sample) if traced else sample
    tokens = np.stack(
        [np.asarray(draw(logits, jax.random.key(i), temperature=temperature)) for i in range(40)]
    )
    assert (tokens[:, 0] == 1).all()
    if traced and temperature < np.finfo(np.float32).tiny:
        # a traced subnormal temperature may be flushed to 0 on the device: greedy
        assert set(tokens[:, 1].tolist()) <= {2, 3}
    else:  # tied maxima: both drawn (the limit of the softmax is uniform over them)
        assert set(tokens[:, 1].tolist()) == {2, 3}


def test_nan_logits_count_as_minus_inf(batch):
    logits = jnp.array([[1.0, jnp.nan, 2.0], [0.0, jnp.nan, 0.0]])
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), temperature=0.0), [2, 0])
    np.testing.assert_array_equal(
        process_logits(logits, top_k=1), [[-jnp.inf, -jnp.inf, 2.0], [0.0, -jnp.inf, 0.0]]
    )
    run = jax.jit(lambda key: sample(logits, key, top_p=0.99))
    tokens = np.stack([np.asarray(run(jax.random.key(i))) for i in range(40)])
    assert 1 not in tokens and set(tokens[:, 1].tolist()) == {0, 2}


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0.0}, {"top_p": 0.5, "top_k": 2}])
def test_a_row_of_minus_inf_gives_token_0(kwargs):
    logits = jnp.array([[-jnp.inf] * 4, [jnp.nan] * 4, [0.0, -jnp.inf, 9.0, -jnp.inf]])
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), **kwargs), [0, 0, 2])


def test_temperature_none_is_one_and_off_values_pass_with_greedy(batch):
    key = jax.random.key(5)
    np.testing.assert_array_equal(
        sample(batch, key, temperature=None), sample(batch, key, temperature=1.0)
    )
    greedy = np.asarray(jnp.argmax(batch, -1))
    for off in ({"top_p": 1.0}, {"top_k": 0}, {"top_k": 0, "top_p": 1.0}):
        np.testing.assert_array_equal(sample(batch, key, temperature=0.0, **off), greedy)
    with pytest.raises(ValueError, match=r"temperature=0 is greedy .* top_p=0.5"):
        sample(batch, key, temperature=0.0, top_p=0.5)


def test_sample_takes_one_key(batch):
    np.testing.assert_array_equal(  # a legacy uint32 key is one key
        sample(batch, jax.random.PRNGKey(0)).shape, (batch.shape[0],)
    )
    keys = jax.random.split(jax.random.key(0), batch.shape[0])
    with pytest.raises(ValueError, match=r"^sample takes one key, got a batch of keys of shape"):
        sample(batch, keys)
    with pytest.raises(ValueError, match=r"^sample takes one key.*shape \(2, 2\)"):
        sample(batch, jax.random.split(jax.random.PRNGKey(0), 2))
    with pytest.raises(TypeError, match=r"^sample: key must be a PRNG key, jax.random.key"):
        sample(batch, 0)
    with pytest.raises(TypeError, match=r"^sample: key must be a PRNG key"):
        sample(batch, jnp.zeros(2))
