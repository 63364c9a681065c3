"""`lm.generate` against transformers' ``generate`` on the tiny random checkpoints.

Greedy decoding must give transformers' tokens for every architecture, batched ragged
prompts (left padded, with an attention mask) and stop tokens (one taken from transformers'
own output, so decoding stops early); sampling must draw from the kept tokens, repeat with
the same key, and compile once for every temperature and top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina.models import CausalLM, ModelConfig, generation, init_cache

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.fast_compile  # tests/conftest.py

NEW = 8
# The RoPE variants and the sharded file decode with the code "llama" does; their logits are
# checked against transformers in tests/test_models.py.
F32_CASES = ["llama", "mistral", "qwen2", "qwen3", "gemma"]


def prompts(vocab, seed=0):
    """Two prompts of different lengths (7 and 4 tokens), ids clear of bos/eos/pad."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, 7), rng.integers(3, vocab, 4)]


def left_padded(rows, pad):
    """`rows` left padded with `pad`: ``(ids, mask)``, NumPy int64 and bool."""
    length = max(len(r) for r in rows)
    ids = np.full((len(rows), length), pad, np.int64)
    mask = np.zeros((len(rows), length), bool)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, True
    return ids, mask


def torch_generate(torch_model, rows, eos, pad=None, **options):
    """transformers' greedy ``generate`` on left-padded `rows`, with the attention mask.

    The padding (of the prompts, and after a row stops) is `pad`, else transformers' own
    default: its generation config's ``pad_token_id``, else ``eos[0]``."""
    if pad is None:
        pad = torch_model.generation_config.pad_token_id
        pad = eos[0] if pad is None else pad
    ids, mask = left_padded(rows, pad)
    mask = mask.astype(np.int64)
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=NEW,
            top_k=None,
            top_p=None,
            eos_token_id=list(eos),
            pad_token_id=pad,
            **options,
        )
    return out.numpy()


@pytest.mark.parametrize("name", F32_CASES)
def test_greedy_equals_transformers(hf_model, name):
    model, variables, torch_model = hf_model(name)
    rows = prompts(model.config.vocab_size)
    eos = model.config.eos_token_id  # (2,): transformers' default stop token
    expected = torch_generate(torch_model, rows, eos)
    got = lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=eos)
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert got.dtype == jnp.int32

    # Stop tokens from transformers' own output (two ids: each row's 3rd new token), so
    # both rows stop early and the loop exits before max_new_tokens.
    stops = (int(expected[0, 7 + 2]), int(expected[1, 7 + 2]))
    expected = torch_generate(torch_model, rows, stops)
    got = lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=stops)
    assert expected.shape[1] <= 7 + 3 < 7 + NEW
    np.testing.assert_array_equal(np.asarray(got), expected)


def stopping_rows(model, variables):
    """Two prompts and stop ids (each row's 3rd new greedy token) that stop both early."""
    rows = prompts(model.config.vocab_size)
    free = np.asarray(lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=()))
    assert free.shape[1] == 7 + NEW  # eos_id=(): never stops early
    return rows, (int(free[0, 7 + 2]), int(free[1, 7 + 2]))


def test_finished_rows_and_ragged_prompts_are_padded_with_pad_token_id(hf_model):
    """transformers writes ``pad_token_id`` (here 0, not the eos 2) in the left padding of
    ragged prompts and after a row stops; without one (None) it writes ``eos[0]``."""
    model, variables, torch_model = hf_model("llama")
    assert model.config.pad_token_id == 0 != model.config.eos_token_id[0]
    rows, stops = stopping_rows(model, variables)
    expected = torch_generate(torch_model, rows, stops)  # transformers' own pad_token_id
    got = np.asarray(lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=stops))
    np.testing.assert_array_equal(got, expected)
    assert (got[1, :3] == 0).all() and (got == 0).sum() > 3  # the padding: 0, not stops[0]
    # A config without pad_token_id: the first stop id, as transformers.
    unpadded = CausalLM(dataclasses.replace(model.config, pad_token_id=None))
    expected = torch_generate(torch_model, rows, stops, pad=stops[0])
    got = lm.generate(unpadded, variables, rows, max_new_tokens=NEW, eos_id=stops)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_eos_id_none_stops_at_the_config_eos_and_empty_never_stops(hf_model):
    """As transformers' ``generate``: the stop ids default to the config's ``eos_token_id``."""
    model, variables, torch_model = hf_model("llama")
    rows, stops = stopping_rows(model, variables)
    stopping = CausalLM(dataclasses.replace(model.config, eos_token_id=stops))
    default = lm.generate(stopping, variables, rows, max_new_tokens=NEW)
    given = lm.generate(stopping, variables, rows, max_new_tokens=NEW, eos_id=stops)
    assert default.shape[1] < 7 + NEW
    np.testing.assert_array_equal(default, given)
    never = lm.generate(stopping, variables, rows, max_new_tokens=NEW, eos_id=[])
    assert never.shape == (2, 7 + NEW)
    np.testing.assert_array_equal(never[:, : default.shape[1] - 1], default[:, :-1])


def test_greedy_bf16_picks_transformers_argmax_up_to_a_rounding(hf_model):
    """bfloat16: each greedy token is transformers' argmax, or within one bfloat16 step of it.

    In bfloat16 two logits a rounding step apart (1/128 near 1) are a tie that the libraries'
    different rounding orders may break differently (lamina scales the queries before the
    product, transformers after it): these prompts hit one (1.3516 vs 1.3438 at the first
    step; float32 says lamina's pick). So the tokens are checked against transformers'
    bfloat16 logits of lamina's own sequence, and must be its argmax up to that step.
    """
    model, variables, torch_model = hf_model("llama_bf16")
    rows = prompts(model.config.vocab_size)
    got = np.asarray(lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=2))
    mask = np.stack([np.ones(got.shape[1], np.int64), np.arange(got.shape[1]) >= 3])
    with torch.no_grad():
        positions = torch.tensor(np.where(mask, np.cumsum(mask, -1) - 1, 0))
        logits = (
            torch_model(
                torch.tensor(got, dtype=torch.long),
                attention_mask=torch.tensor(mask),
                position_ids=positions,
            )
            .logits.float()
            .numpy()[:, 6:-1]
        )
    chosen = np.take_along_axis(logits, got[:, 7:, None].astype(np.int64), -1)[..., 0]
    best = logits.max(-1)
    assert (best - chosen <= 2.0**-7 * np.maximum(np.abs(best), 1.0)).all()
    exact = (best == chosen).mean()
    assert exact > 0.8  # mostly exact: a tie is the exception


def test_one_prompt_in_one_out(hf_model):
    model, variables, torch_model = hf_model("llama")
    row = prompts(model.config.vocab_size, 5)[0]
    expected = torch_generate(torch_model, [row], (2,))[0]
    got = lm.generate(model, variables, jnp.asarray(row), max_new_tokens=NEW, eos_id=2)
    assert got.ndim == 1
    np.testing.assert_array_equal(np.asarray(got), expected)
    # A 2-D batch of equal lengths: no padding, the same tokens per row.
    batch = lm.generate(model, variables, np.stack([row, row]), max_new_tokens=NEW, eos_id=2)
    np.testing.assert_array_equal(np.asarray(batch), np.stack([expected, expected]))


def test_a_padded_batch_with_its_mask_equals_transformers(hf_model):
    """A batch padded by the caller (a tokenizer's ``padding_side="left"``) with its mask:
    transformers' ``generate(attention_mask=...)`` tokens; the padding ids are kept as given
    and never read (other padding ids, the same new tokens)."""
    model, variables, torch_model = hf_model("llama")
    rows = prompts(model.config.vocab_size)
    ids, mask = left_padded(rows, 5)
    expected = torch_generate(torch_model, rows, (2,), pad=5)
    got = lm.generate(model, variables, ids, mask=mask, max_new_tokens=NEW, eos_id=2)
    np.testing.assert_array_equal(np.asarray(got), expected)
    other = np.where(mask, ids, 9)
    again = lm.generate(
        model, variables, jnp.asarray(other), mask=mask, max_new_tokens=NEW, eos_id=2
    )
    np.testing.assert_array_equal(np.asarray(again)[:, 7:], expected[:, 7:])
    np.testing.assert_array_equal(np.asarray(again)[:, :7], other)


def lora_variables(lora, params, seed=0):
    """`lora`'s variables: the loaded `params` as the bases, random adapters (both, so that
    the adapters change the result)."""
    shapes = jax.eval_shape(lm.transform(lora).init, jax.random.key(0))["params"]
    rng = np.random.default_rng(seed)
    attention = dict(params["layers"]["block"]["attention"])
    for name in ("query", "value"):
        adapters = shapes["layers"]["block"]["attention"][name]
        attention[name] = {
            "base": attention[name],
            **{
                k: jnp.asarray(rng.standard_normal(adapters[k].shape) * 0.5, jnp.float32)
                for k in ("lora_a", "lora_b")
            },
        }
    block = {**params["layers"]["block"], "attention": attention}
    return {"params": {**params, "layers": {"block": block}}}


def test_a_lora_model_being_fine_tuned_generates_as_its_merged_model(hf_model):
    """LoRA on the attention's query and value projections, every other weight frozen (as
    when fine-tuning): no merge needed to generate, and the tokens are the merged model's."""
    model, variables, torch_model = hf_model("llama")
    where = lm.Any(lm.PathContains("query"), lm.PathContains("value"))
    lora = lm.replace(model, lambda path, m: lm.LoRA(m, rank=2), where=where)
    lora = lm.freeze(lora, where=lm.Not(lm.LoRAParam))
    lora_vars = lora_variables(lora, variables["params"])
    rows = prompts(model.config.vocab_size)
    got = lm.generate(lora, lora_vars, rows, max_new_tokens=NEW, eos_id=2)
    merged, merged_vars = lm.merge_lora(lora, lora_vars)
    expected = lm.generate(merged, merged_vars, rows, max_new_tokens=NEW, eos_id=2)
    np.testing.assert_array_equal(got, expected)
    base = lm.generate(model, variables, rows, max_new_tokens=NEW, eos_id=2)
    assert not np.array_equal(got, base)  # the adapters are used
    cache = init_cache(lora.with_cache(2, 15))["cache"]["layers"]["block"]["attention"]
    assert cache["cached_key"].shape == (2, 2, 15, 2, 8)
    assert type(lora.layers.block.attention.query).__name__ == "LoRA"  # lora unchanged
    assert lora.decode_shape is None and lora.layers.block.attention.decode_shape is None


def test_a_bfloat16_policy_generates_as_the_bfloat16_checkpoint(hf_model):
    """`lm.with_policy` (float32 storage, bfloat16 compute): the cache is bfloat16 and the
    tokens are those of the same weights stored in bfloat16 (casting float32 to bfloat16 where
    they are used rounds as storing them so)."""
    model, variables, _ = hf_model("llama")
    half = lm.with_policy(model, lm.Policy("float32", "bfloat16"))
    cache = init_cache(half.with_cache(2, 15))["cache"]["layers"]["block"]["attention"]
    assert cache["cached_key"].dtype == jnp.bfloat16
    assert cache["cached_value"].dtype == jnp.bfloat16
    rows = prompts(model.config.vocab_size)
    got = lm.generate(half, variables, rows, max_new_tokens=NEW, eos_id=2)
    bf16, bf16_variables, _ = hf_model("llama_bf16")
    expected = lm.generate(bf16, bf16_variables, rows, max_new_tokens=NEW, eos_id=2)
    np.testing.assert_array_equal(got, expected)


# --- sampling ----------------------------------------------------------------------------
# One program serves these tests: batch 2, prompt 7, NEW tokens, top_k=3, top-p on (traced).
SAMPLING = dict(max_new_tokens=NEW, top_k=3)


@pytest.fixture(scope="module")
def sampler(hf_model):
    return hf_model("qwen3")


def torch_last_logits(torch_model, out, length, padding):
    """transformers' logits for each new token of `out` given its prefix (positions as
    ``generate``'s: `padding` left pads in each row)."""
    mask = (np.arange(out.shape[1])[None] >= np.asarray(padding)[:, None]).astype(np.int64)
    with torch.no_grad():
        logits = torch_model(
            torch.tensor(np.asarray(out), dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.where(mask, np.cumsum(mask, -1) - 1, 0)),
        ).logits.numpy()
    return logits[:, length - 1 : -1]


def kept(logits, tokens, top_k):
    """For each token: is it among the `top_k` largest of its logits?"""
    kth = np.sort(logits, axis=-1)[..., -top_k]
    return np.take_along_axis(logits, np.asarray(tokens)[..., None], -1)[..., 0] >= kth


def test_sampling_draws_from_the_kept_tokens(sampler):
    model, variables, torch_model = sampler
    rows = prompts(model.config.vocab_size, 1)

    def draw(seed, temperature=1.5, top_p=1.0):
        key = jax.random.key(seed)
        return lm.generate(
            model, variables, rows, temperature=temperature, top_p=top_p, rng=key, **SAMPLING
        )

    out = draw(0)
    logits = torch_last_logits(torch_model, out, 7, [0, 3])
    assert kept(logits, out[:, 7:], 3).all()
    assert not kept(logits, out[:, 7:], 1).all()  # not greedy: it samples
    np.testing.assert_array_equal(out, draw(0))  # the same key, the same tokens
    assert not np.array_equal(out, draw(1))
    # top_p tiny keeps only the most likely token: sampling is then greedy.
    greedy = lm.generate(model, variables, rows, max_new_tokens=NEW)
    np.testing.assert_array_equal(draw(3, temperature=1.0, top_p=1e-6), greedy)


def test_temperature_and_top_p_do_not_recompile(sampler, monkeypatch):
    model, variables, _ = sampler
    traces = []
    real = generation.sample
    monkeypatch.setattr(generation, "sample", lambda *a, **k: traces.append(1) or real(*a, **k))
    row = prompts(model.config.vocab_size, 3)[0]
    for temperature, top_p in [(0.7, 0.9), (1.3, 0.5), (2.0, 0.99)]:
        key = jax.random.key(0)
        # max_new_tokens=NEW - 1: a program no other test compiles, so the first call traces.
        options = dict(SAMPLING, max_new_tokens=NEW - 1)
        lm.generate(model, variables, row, temperature=temperature, top_p=top_p, rng=key, **options)
    assert len(traces) == 2  # one trace: the prefill's choice and the loop's


def test_keys_are_folded_per_step_and_row(sampler):
    """A row's tokens depend on its key, step and row, not on the batch it is in; and the
    steps draw with different keys (a reused key would repeat the same Gumbel noise)."""
    model, variables, torch_model = sampler
    row = prompts(model.config.vocab_size, 2)[0]
    options = dict(SAMPLING, temperature=1.0, top_p=1.0, rng=jax.random.key(7))
    alone = lm.generate(model, variables, row, **dict(options, max_new_tokens=NEW - 1))
    batch = lm.generate(model, variables, [row, row], **options)
    np.testing.assert_array_equal(batch[0, : len(alone)], alone)
    assert not np.array_equal(batch[0], batch[1])  # row 1 folds another key in
    # The token of step t is sample(logits_t, fold_in(rng, t)): check two steps by hand.
    logits = jnp.asarray(torch_last_logits(torch_model, alone[None], len(row), [0]))
    for t in range(2):
        key = jax.random.fold_in(jax.random.key(7), t)
        token = lm.models.sampling.sample(logits[:, t], key, temperature=1.0, top_k=3)
        assert int(token[0]) == int(alone[len(row) + t])


# --- errors ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    """A tiny model (12 positions) and variables (NumPy values: nothing to compile)."""
    config = ModelConfig(
        "llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=12,
    )
    model = CausalLM(config)
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    return model, variables


@pytest.mark.parametrize(
    ("prompt", "options", "error", "match"),
    [
        ([1, 2], dict(top_k=3), ValueError, r"top_k=3 and top_p=None act only when sampling"),
        ([1, 2], dict(top_p=0.9), ValueError, r"temperature=0 decodes greedily"),
        ([1, 2], dict(temperature=1.0), ValueError, r"needs a key: pass rng=jax.random.key"),
        (
            [1, 2],
            dict(temperature=-1.0),
            ValueError,
            r"temperature must be 0 \(greedy\) or positive",
        ),
        ([1, 2], dict(temperature="hot"), TypeError, r"temperature must be a number"),
        (
            [1, 2],
            dict(temperature=float("inf"), rng=jax.random.key(0)),
            ValueError,
            r"temperature must be a finite number, got inf",
        ),
        (
            [1, 2],
            dict(temperature=float("nan"), rng=jax.random.key(0)),
            ValueError,
            r"temperature must be a finite number, got nan",
        ),
        (
            [[1, 2], [3, 4]],
            dict(mask=np.array([[True, False], [True, True]])),
            ValueError,
            r"mask row 0 has padding after a real token.*padding_side='left'",
        ),
        (
            [[1, 2], [3, 4]],
            dict(mask=np.array([[True, True], [False, False]])),
            ValueError,
            r"mask row 1 has no real token",
        ),
        ([[1, 2]], dict(mask=np.ones((1, 2), np.int64)), TypeError, r"mask.astype\(bool\)"),
        ([[1, 2]], dict(mask=np.ones((1, 3), bool)), ValueError, r"prompt_ids' shape \(1, 2\)"),
        (
            [[1, 2], [3]],
            dict(mask=[True]),
            ValueError,
            r"prompts of different lengths is padded here",
        ),
        ([1, 2], dict(mask=np.ones(2, bool), eos_id=16), ValueError, r"eos_id 16"),
        ([1, 2], dict(temperature=1.0, rng=3), TypeError, r"rng must be one key"),
        (
            [1, 2],
            dict(temperature=1.0, rng=jax.random.split(jax.random.key(0))),
            TypeError,
            r"rng must be one key",
        ),
        (
            [1, 2],
            dict(temperature=1.0, top_k=-1, rng=jax.random.key(0)),
            ValueError,
            r"top_k must be None, 0",
        ),
        (
            [1, 2],
            dict(temperature=1.0, top_p=1.5, rng=jax.random.key(0)),
            ValueError,
            r"top_p must be in \(0, 1\]",
        ),
        ([1, 2], dict(eos_id=16), ValueError, r"eos_id 16 is not a token id.*vocab_size=16"),
        ([1, 2], dict(eos_id="2"), TypeError, r"eos_id must be an int"),
        ([1, 2], dict(eos_id=[2.0]), TypeError, r"eos_id must be an int, a sequence of ints"),
        ([1, 2], dict(max_new_tokens=0), ValueError, r"max_new_tokens must be at least 1"),
        ([1, 2], dict(max_new_tokens=2.0), TypeError, r"max_new_tokens must be an int"),
        (
            [1, 2],
            dict(max_new_tokens=11),
            ValueError,
            r"reaches position 12, past the model's max_position_embeddings=12",
        ),
        ([], {}, ValueError, r"every prompt needs at least one token"),
        ([[1, 2], []], {}, ValueError, r"every prompt needs at least one token"),
        ([1.0, 2.0], {}, TypeError, r"prompt ids must be integers, got dtype float64"),
        ([1, 16], {}, ValueError, r"prompt id 16 is not a token id"),
        ([[[1]]], {}, ValueError, r"prompt_ids must be \(length,\), \(batch, length\)"),
    ],
)
def test_errors(small, prompt, options, error, match):
    model, variables = small
    options = {"max_new_tokens": 2, **options}
    with pytest.raises(error, match=match):
        lm.generate(model, variables, prompt, **options)


def test_wrong_model_or_variables(small):
    model, variables = small
    with pytest.raises(TypeError, match=r"takes a lamina.models.CausalLM.*got Dense"):
        lm.generate(lm.Dense(2, 2), variables, [1], max_new_tokens=1)
    with pytest.raises(TypeError, match=r"variables must be the model's variables dict"):
        lm.generate(model, [variables], [1], max_new_tokens=1)
    with pytest.raises(
        TypeError,
        match=r"without 'params', with keys \['embed', .*pass \{'params': variables\}",
    ):
        lm.generate(model, variables["params"], [1], max_new_tokens=1)


def test_a_config_eos_outside_the_vocabulary_is_refused_by_default(small):
    model, variables = small
    model = CausalLM(dataclasses.replace(model.config, eos_token_id=(99,)))
    with pytest.raises(ValueError, match=r"config's eos_token_id 99 \(the default stop id\)"):
        lm.generate(model, variables, [1, 2], max_new_tokens=2)
    assert lm.generate(model, variables, [1, 2], max_new_tokens=2, eos_id=()).shape == (4,)


def test_0d_arrays_as_temperature_and_top_p(small):
    model, variables = small
    options = dict(max_new_tokens=2, rng=jax.random.key(0), top_k=4)
    expected = lm.generate(model, variables, [1, 2], temperature=0.5, top_p=0.75, **options)
    for t, p in [(jnp.float32(0.5), jnp.float32(0.75)), (np.float32(0.5), np.array(0.75))]:
        got = lm.generate(model, variables, [1, 2], temperature=t, top_p=p, **options)
        np.testing.assert_array_equal(got, expected)
    greedy = lm.generate(model, variables, [1, 2], max_new_tokens=2, temperature=jnp.zeros(()))
    np.testing.assert_array_equal(greedy, lm.generate(model, variables, [1, 2], max_new_tokens=2))
    with pytest.raises(TypeError, match=r"temperature must be a number"):
        lm.generate(model, variables, [1, 2], max_new_tokens=2, temperature=jnp.ones(1))


def test_generate_under_jit_or_vmap_says_to_call_it_outside(small):
    model, variables = small
    match = r"lm.generate compiles itself; call it outside jax.jit/vmap"
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda ids: lm.generate(model, variables, ids, max_new_tokens=2))(jnp.ones(2, int))
    with pytest.raises(TypeError, match=match):
        jax.vmap(lambda t: lm.generate(model, variables, [1], max_new_tokens=2, temperature=t))(
            jnp.ones(2)
        )
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda v: lm.generate(model, v, [1], max_new_tokens=2))(variables)


def test_decoding_copies_are_dropped_with_their_programs(small, monkeypatch):
    """Only the copies that the kept programs use stay (one per (batch, length) shape)."""
    import copy

    model, variables = small
    model = copy.deepcopy(model)
    monkeypatch.setattr(generation, "_KEEP", 2)
    for length in (1, 2, 3):  # three programs: the first is dropped, with its copy
        lm.generate(model, variables, list(range(1, 1 + length)), max_new_tokens=2)
    kept = generation._KEPT[id(model)][1]
    assert len(kept.programs) == 2
    assert set(kept.decoders) == {(1, 4), (1, 5)}


def test_a_prompt_that_fills_the_positions_exactly_works(small):
    model, variables = small
    out = lm.generate(model, variables, [1, 2], max_new_tokens=10)
    assert out.shape == (12,)
    # Padding counts no position: a mask lets a longer padded prompt fill them exactly.
    padded = lm.generate(model, variables, [7, 7, 1, 2], mask=np.arange(4) >= 2, max_new_tokens=10)
    np.testing.assert_array_equal(padded[2:], out)
    np.testing.assert_array_equal(padded[:2], [7, 7])
    with pytest.raises(ValueError, match=r"prompt id 16 is not a token id"):
        lm.generate(model, variables, [16, 2], mask=np.ones(2, bool), max_new_tokens=1)


def test_the_decoding_copy_is_kept_with_the_model(small, monkeypatch):
    """A second call builds nothing; a model changed in place gets a new decoding copy; the
    kept copy goes with the model."""
    import copy
    import gc

    model, variables = small
    model = copy.deepcopy(model)
    built = []
    real = CausalLM.with_cache
    monkeypatch.setattr(CausalLM, "with_cache", lambda m, *a: built.append(a) or real(m, *a))
    first = lm.generate(model, variables, [1, 2, 3], max_new_tokens=2)
    assert lm.generate(model, variables, [1, 2, 3], max_new_tokens=2).tolist() == first.tolist()
    assert built == [(1, 5)]
    model.final_norm = lm.RMSNorm(8, epsilon=0.5, scale_in_input_dtype=True)  # in place
    changed = lm.generate(model, variables, [1, 2, 3], max_new_tokens=2)
    assert built == [(1, 5), (1, 5)]
    key = id(model)
    assert key in generation._KEPT
    del model
    gc.collect()
    assert key not in generation._KEPT
    assert changed.shape == first.shape


# --- what the compiled loop leaves out ---------------------------------------------------


def test_the_prefill_computes_the_last_logits_alone_and_no_overflow_check(small, monkeypatch):
    """The prefill asks for the last position's logits (``logits_to_keep=1``), and no layer
    traces its run-time overflow check: the cache is sized so that no step overflows."""
    import copy

    import lamina.nn.attention_decoding as decoding

    model, variables = small
    model = copy.deepcopy(model)  # a program of its own: traced by this call
    calls = []
    real_transform = generation.transform

    def transform(module):
        transformed = real_transform(module)

        def apply(*args, **kwargs):
            logits, state = transformed.apply(*args, **kwargs)
            calls.append((args[2].shape, kwargs.get("logits_to_keep"), logits.shape))
            return logits, state

        return transformed._replace(apply=apply)

    checks = []
    real_check = decoding.check_at_run_time
    monkeypatch.setattr(generation, "transform", transform)
    monkeypatch.setattr(
        decoding, "check_at_run_time", lambda *a: checks.append(a) or real_check(*a)
    )
    greedy = lm.generate(model, variables, [[1, 2, 3, 4], [5, 6, 7, 8]], max_new_tokens=3)
    assert calls == [((2, 4), 1, (2, 1, 16)), ((2, 1), None, (2, 1, 16))]  # prefill, loop body
    assert checks == []
    # Outside generate, a traced decoding step keeps its check.
    decoder = model.with_cache(2, 7)
    jax.jit(real_transform(decoder).apply, static_argnames="decode").lower(
        {**variables, **init_cache(decoder)}, None, jnp.ones((2, 1), jnp.int32), decode=True
    )
    assert len(checks) == 1
    assert greedy.shape == (2, 7)


def test_without_run_time_checks_still_leaves_an_overflowing_cache_unchanged(small):
    """The run-time error goes, not the guard: a step past max_length writes nothing and
    gives NaN."""
    from lamina._core.checks import without_run_time_checks

    model, variables = small
    decoder = model.with_cache(1, 3)
    apply = lm.transform(decoder).apply

    @jax.jit
    def step(state, ids):
        with without_run_time_checks():
            return apply(state, None, ids, decode=True)

    logits, state = jax.jit(apply, static_argnames="decode")(
        {**variables, **init_cache(decoder)}, None, jnp.ones((1, 3), jnp.int32), decode=True
    )
    assert not np.isnan(logits).any()
    full = state["cache"]["layers"]["block"]["attention"]
    logits, after = step(state, jnp.ones((1, 1), jnp.int32))  # past max_length: no error
    assert np.isnan(logits).all()
    attention = after["cache"]["layers"]["block"]["attention"]
    np.testing.assert_array_equal(attention["cached_key"], full["cached_key"])
    np.testing.assert_array_equal(attention["cached_value"], full["cached_value"])
