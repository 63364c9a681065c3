"""Hugging Face checkpoints: `ModelConfig.from_hf`/`to_hf`, `from_pretrained`, `save_pretrained`.

The folders are tiny random models that `transformers` builds and saves itself
(tests/hf_models.py, through the ``hf_checkpoint`` fixture). Loading with shardings runs in a
subprocess with eight fake CPU devices: this file run as a script (`main` at the end).
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

pytest.importorskip("transformers")
import lamina.models as lamina_models
from lamina.models import (
    ModelConfig,
    checkpoints,
    from_pretrained,
    load_tokenizer,
    save_pretrained,
    saving,
)
from lamina.models.checkpoint_names import expected_variables

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

ROOT = pathlib.Path(__file__).parents[1]
CASE_NAMES = [
    "llama",
    "llama3_rope",
    "llama_linear",
    "llama_sharded",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "llama_bf16",
]
BASE = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def leaf(tree, key):
    for part in key:
        tree = tree[part]
    return tree


def state_dict(torch_model) -> dict[str, np.ndarray]:
    import torch

    return {
        name: (t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).numpy()
        for name, t in torch_model.state_dict().items()
    }


def assert_matches_state_dict(config, variables, reference, *, exact=True):
    """Every variable equals the HF tensors it maps, layer by layer, under the name map."""
    seen = set()
    for v in expected_variables(config):
        array = leaf(variables, v.key)
        assert array.shape == v.shape
        for i, name in enumerate(v.hf_names()):
            got = np.asarray(array if v.layers is None else array[i]).astype(np.float32)
            want = reference[name]
            want = (want.T if v.name.transpose else want).reshape(v.relayout.shape)
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=name)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=name)
            seen.add(name)
    # every tensor of the HF model is accounted for (the tied head is the embedding)
    assert set(reference) - seen <= {"lm_head.weight"}
    if config.tie_embeddings and "lm_head.weight" in reference:
        np.testing.assert_array_equal(
            reference["lm_head.weight"], reference["model.embed_tokens.weight"]
        )


@pytest.fixture(scope="module")
def loaded(hf_checkpoint, hf_model):
    """``name -> (folder, torch model, lamina model, variables)``, loaded once per process
    (lamina's reading shared with the other files through ``hf_model``; the torch model is
    the one that wrote the folder, the bfloat16 case's cast with ``.to``)."""

    def get(name):
        folder, torch_model = hf_checkpoint(name)
        model, variables, _ = hf_model(name)
        return folder, torch_model, model, variables

    return get


def copy_case(hf_checkpoint, name, tmp_path) -> pathlib.Path:
    folder, _ = hf_checkpoint(name)
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def rewrite_weights(folder: pathlib.Path, change) -> None:
    """Rewrites a single-file checkpoint's tensors through ``change(dict) -> dict``."""
    import safetensors.numpy

    path = folder / "model.safetensors"
    tensors = change(dict(safetensors.numpy.load_file(path)))
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def edit_config(folder: pathlib.Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# --- config.json ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASE_NAMES)
def test_config_round_trips_through_transformers(hf_checkpoint, tmp_path, name):
    import transformers

    folder, torch_model = hf_checkpoint(name)
    original = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(original)
    assert ModelConfig.from_hf(config.to_hf()) == config
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    ours = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs = torch_model.config
    assert type(ours) is type(theirs)
    assert ours.architectures == theirs.architectures
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "hidden_act",
        "rope_parameters",
        "tie_word_embeddings",
        "sliding_window",
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "layer_types",
    ]:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert ModelConfig.from_hf(ours.to_dict()) == config


def test_config_reads_each_architecture(hf_checkpoint):
    def read(name):
        folder, _ = hf_checkpoint(name)
        return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))

    qwen2, qwen3, gemma, mistral = read("qwen2"), read("qwen3"), read("gemma"), read("mistral")
    assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.sliding_window) == (True, False, None)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert (gemma.activation, gemma.embed_scale, gemma.norm_offset) == ("gelu_tanh", True, 1.0)
    assert gemma.tie_embeddings and mistral.sliding_window == 4
    llama3 = read("llama3_rope")
    params = dict(hf_checkpoint("llama3_rope")[1].config.rope_parameters)
    assert params["rope_type"] == "llama3"
    assert llama3.rope_theta == params.pop("rope_theta") and llama3.rope_scaling == params
    assert read("llama_linear").rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert read("llama_bf16").dtype == "bfloat16"
    sharded = read("llama_sharded")
    assert sharded.qkv_bias and sharded.out_bias and sharded.mlp_bias


def test_config_legacy_keys():
    # Llama 2 era: rope_theta and rope_scaling {"type": ...} at the top, no kv heads, torch_dtype
    old = ModelConfig.from_hf(
        {
            **BASE,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "torch_dtype": "bfloat16",
        }
    )
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert old.num_kv_heads == 4 and old.head_dim == 8 and old.dtype == "bfloat16"
    # Llama 3.1's legacy rope_scaling; original_max_position_embeddings defaults to the max
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    llama3 = ModelConfig.from_hf({**BASE, "rope_scaling": scaling, "max_position_embeddings": 64})
    assert llama3.rope_scaling["original_max_position_embeddings"] == 64
    assert llama3.rope_theta == 10_000.0
    # rope_scaling: null and rope_parameters "default" are no scaling
    assert ModelConfig.from_hf({**BASE, "rope_scaling": None}).rope_scaling is None
    v5 = ModelConfig.from_hf(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}
    )
    assert (v5.rope_scaling, v5.rope_theta) == (None, 3.0)
    # head_dim null, eos lists, pad null
    config = ModelConfig.from_hf(
        {**BASE, "head_dim": None, "eos_token_id": [7, 9], "pad_token_id": None}
    )
    assert config.head_dim == 8 and config.eos_token_id == (7, 9) and config.pad_token_id is None
    assert config.to_hf()["eos_token_id"] == [7, 9]
    assert ModelConfig.from_hf({**BASE, "eos_token_id": None}).eos_token_id == ()


def test_config_class_defaults_as_transformers():
    # absent keys take transformers' class defaults, which differ per architecture
    gemma = ModelConfig.from_hf({**BASE, "model_type": "gemma", "num_key_value_heads": 4})
    assert gemma.head_dim == 256 and gemma.tie_embeddings
    assert gemma.activation == "gelu_tanh"  # the class default hidden_act
    legacy = ModelConfig.from_hf(
        {
            **BASE,
            "model_type": "gemma",
            "hidden_act": "gelu",
            "head_dim": 8,
            "num_key_value_heads": 4,
        }
    )
    assert legacy.activation == "gelu_tanh"  # transformers rewrites Gemma's legacy "gelu"
    assert ModelConfig.from_hf({**BASE, "hidden_act": "gelu"}).activation == "gelu"  # not Llama's
    qwen3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "num_key_value_heads": 2})
    assert qwen3.head_dim == 128
    with pytest.raises(ValueError, match="num_kv_heads=32 must divide num_heads=4"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2"})  # Qwen2's class default is 32


def test_config_sliding_windows():
    qwen = {**BASE, "model_type": "qwen2", "num_key_value_heads": 2}
    # shipped Qwen2.5 configs: a window that is off
    off = ModelConfig.from_hf({**qwen, "sliding_window": 32768, "use_sliding_window": False})
    assert off.sliding_window is None
    every = ModelConfig.from_hf(
        {**qwen, "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0}
    )
    assert every.sliding_window == 16
    assert every.to_hf()["layer_types"] == ["sliding_attention"] * 2
    # max_window_layers beyond the depth: every layer is full attention
    above = ModelConfig.from_hf({**qwen, "sliding_window": 16, "use_sliding_window": True})
    assert above.sliding_window is None
    with pytest.raises(ValueError, match=r"layers \[1\] use a sliding window of 16.*mixed"):
        ModelConfig.from_hf(
            {**qwen, "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1}
        )
    with pytest.raises(ValueError, match=r"layers \[0\] use a sliding window"):
        ModelConfig.from_hf(
            {
                **qwen,
                "sliding_window": 16,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        )
    mistral = {**BASE, "model_type": "mistral", "num_key_value_heads": 2}
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf(mistral).sliding_window == 4096  # the class default
    # transformers' Mistral ignores layer_types: its window slides every layer
    for kinds in (["full_attention"] * 2, ["sliding_attention", "full_attention"]):
        config = ModelConfig.from_hf({**mistral, "sliding_window": 8, "layer_types": kinds})
        assert config.sliding_window == 8


def test_config_token_and_rope_defaults_as_transformers():
    import transformers

    # a config.json without special tokens takes its class's (eos stops generation)
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        given = {**BASE, "model_type": model_type, "num_key_value_heads": 2, "head_dim": 8}
        ours = ModelConfig.from_hf(given)
        theirs = transformers.AutoConfig.for_model(**given)
        assert ours.bos_token_id == theirs.bos_token_id, model_type
        assert ours.eos_token_id == (() if theirs.eos_token_id is None else (theirs.eos_token_id,))
        assert ours.pad_token_id == theirs.pad_token_id, model_type
    gemma = ModelConfig.from_hf({**BASE, "model_type": "gemma", "num_key_value_heads": 2})
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, (1,), 0)
    llama = ModelConfig.from_hf(BASE)
    assert (llama.bos_token_id, llama.eos_token_id, llama.pad_token_id) == (1, (2,), None)
    # a "default" RoPE ignores a factor, as transformers does (it only warns)
    default = {"rope_type": "default", "rope_theta": 5e5, "factor": 8.0}
    config = ModelConfig.from_hf({**BASE, "rope_parameters": default})
    assert (config.rope_scaling, config.rope_theta) == (None, 5e5)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"model_type": "gemma2"},
            r"model_type='gemma2' \(gemma2 needs alternating.*"
            r"Supported: llama, mistral, qwen2, qwen3, gemma",
        ),
        ({"model_type": "mixtral"}, r"mixture-of-experts.*Not yet: .*qwen2_moe"),
        ({"model_type": "gpt2"}, r"does not support model_type='gpt2'.*Supported: llama"),
        ({"model_type": None}, r"model_type=None"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rope_type 'yarn' is not supported yet",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            r"'dynamic' is not supported yet",
        ),
        ({"rope_scaling": {"type": "linear"}}, r"rope_type 'linear' needs factor"),
        ({"rope_scaling": {"rope_type": "nonsense"}}, r"unknown rope_type 'nonsense'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, r"not beta"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"per layer type"),
        ({"hidden_size": None}, r"lacks hidden_size"),
        ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
        ({"dtype": "int8"}, r"dtype 'int8' is not one of"),
        ({"num_key_value_heads": 3}, r"num_kv_heads=3 must divide num_heads=4"),
        ({"model_type": "gemma", "use_bidirectional_attention": True}, r"encoder"),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 4}},
            r"quantization_config \(quant_method 'awq'\): quantised checkpoints are not "
            r"supported",
        ),
    ],
)
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**BASE, **changes})


def test_config_checks_and_to_hf_refusals():
    fields = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=r"num_kv_heads=0.*positive ints"):
        ModelConfig("llama", **fields, num_kv_heads=0, head_dim=4)
    with pytest.raises(ValueError, match="activation='relu'"):
        ModelConfig("llama", **fields, num_kv_heads=1, head_dim=4, activation="relu")
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig(
            "llama", **fields, num_kv_heads=1, head_dim=4, rope_scaling={"rope_type": "yarn"}
        )
    with pytest.raises(TypeError, match="takes a dict"):
        ModelConfig.from_hf("config.json")
    norms = ModelConfig("llama", **fields, num_kv_heads=1, head_dim=4, qk_norm=True)
    with pytest.raises(ValueError, match=r"not a llama model: q/k norms"):
        norms.to_hf()
    with pytest.raises(ValueError, match=r"qwen2 has q/k/v biases"):
        ModelConfig("qwen2", **fields, num_kv_heads=1, head_dim=4).to_hf()
    # hashable (a static argument of compiled functions), and the scaling dict is copied
    scaling = {"rope_type": "linear", "factor": 2.0}
    config = ModelConfig("llama", **fields, num_kv_heads=1, head_dim=4, rope_scaling=scaling)
    scaling["factor"] = 3.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert hash(config) == hash(ModelConfig.from_hf(config.to_hf()))
    assert pickle.loads(pickle.dumps(config)) == config


# --- from_pretrained --------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_variable_equals_the_state_dict(loaded, name):
    _, torch_model, model, variables = loaded(name)
    assert set(variables) == {"params"}
    assert_matches_state_dict(model.config, variables, state_dict(torch_model))
    # the model's own declaration agrees (without running an initializer)
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), variables
    )


def test_dtypes_kept_or_cast(loaded, hf_checkpoint):
    folder, torch_model, model, variables = loaded("llama_bf16")
    assert {a.dtype for a in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}
    assert model.param_dtype == jnp.bfloat16
    reference = state_dict(torch_model)  # bf16 -> f32 is exact: the values are bitwise equal
    assert_matches_state_dict(model.config, variables, reference)
    model32, cast = from_pretrained(folder, dtype=jnp.float32)
    assert {a.dtype for a in jax.tree.leaves(cast)} == {jnp.dtype(jnp.float32)}
    assert model32.param_dtype == jnp.float32
    assert_matches_state_dict(model32.config, cast, reference)
    folder, torch_model = hf_checkpoint("llama")
    _, half = from_pretrained(folder, dtype="bfloat16")
    assert {a.dtype for a in jax.tree.leaves(half)} == {jnp.dtype(jnp.bfloat16)}
    assert_matches_state_dict(model.config, half, state_dict(torch_model), exact=False)
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        from_pretrained(folder, dtype=jnp.int32)
    # a float64 request is the request's problem, not the (float32) file's
    for dtype in (jnp.float64, "float", "f8"):
        with pytest.raises(TypeError, match=rf"dtype={dtype!r} asks for float64.*jnp\.float32"):
            from_pretrained(folder, dtype=dtype)


def test_mixed_dtypes_follow_the_config(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "llama_bf16", tmp_path)
    rewrite_weights(
        folder, lambda t: {**t, "model.norm.weight": t["model.norm.weight"].astype(np.float32)}
    )
    _, variables = from_pretrained(folder)
    assert {a.dtype for a in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}


def test_float64_files_need_x64_or_a_cast(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "llama", tmp_path)
    rewrite_weights(folder, lambda t: {k: a.astype(np.float64) for k, a in t.items()})
    with pytest.raises(TypeError, match="float64, which JAX keeps only with jax_enable_x64"):
        from_pretrained(folder)
    _, variables = from_pretrained(folder, dtype=jnp.float32)
    assert {a.dtype for a in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}


def test_tolerated_extras(hf_checkpoint, tmp_path):
    # a tied model's file that holds the head anyway, and RoPE's buffer of old files
    folder = copy_case(hf_checkpoint, "qwen2", tmp_path)
    rewrite_weights(
        folder,
        lambda t: {
            **t,
            "lm_head.weight": t["model.embed_tokens.weight"],
            "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
        },
    )
    _, variables = from_pretrained(folder)
    assert "lm_head" not in variables["params"]


def test_a_tied_config_reads_the_head_its_file_holds(hf_checkpoint, tmp_path):
    import torch
    import transformers

    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    folder = copy_case(hf_checkpoint, "qwen2", tmp_path)
    head = np.random.default_rng(1).normal(0, 0.1, (128, 32)).astype(np.float32)
    rewrite_weights(folder, lambda t: {**t, "lm_head.weight": head})
    # a head that differs from the embedding: untied (as transformers), with a warning
    with pytest.warns(
        UserWarning, match=r"lm_head\.weight differs from model\.embed_tokens.*untied"
    ):
        model, variables = from_pretrained(folder)
    assert not model.config.tie_embeddings
    np.testing.assert_array_equal(variables["params"]["lm_head"]["kernel"], head.T)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        want = theirs(torch.tensor(ids)).logits.numpy()
    logits, _ = lm.transform(model).apply(variables, None, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=2e-5)
    # saved untied, it loads untied without a warning
    save_pretrained(model, variables, tmp_path / "untied")
    assert not from_pretrained(tmp_path / "untied")[0].config.tie_embeddings
    # the head alone (no embed_tokens): it is the embedding, as transformers reads it
    original, _ = hf_checkpoint("qwen2")
    _, tied = from_pretrained(original)
    embedding = np.asarray(tied["params"]["embed"]["embedding"])
    rewrite_weights(
        folder,
        lambda t: {
            **{k: a for k, a in t.items() if k != "model.embed_tokens.weight"},
            "lm_head.weight": embedding,
        },
    )
    model, variables = from_pretrained(folder)
    assert model.config.tie_embeddings and "lm_head" not in variables["params"]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), variables, tied))


def test_a_single_file_wins_over_an_index(hf_checkpoint, tmp_path):
    import safetensors.numpy

    # as in transformers: model.safetensors first, the index only without it
    folder = copy_case(hf_checkpoint, "llama_sharded", tmp_path)
    _, sharded = from_pretrained(folder)
    tensors = {}
    for shard in folder.glob("model-*.safetensors"):
        tensors.update(safetensors.numpy.load_file(shard))
    halved = {k: a * np.float32(0.5) for k, a in tensors.items()}
    safetensors.numpy.save_file(halved, folder / "model.safetensors", metadata={"format": "pt"})
    _, single = from_pretrained(folder)
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool((a == b * np.float32(0.5)).all()), single, sharded)
    )


def test_errors_name_tensors_variables_and_shapes(hf_checkpoint, tmp_path, monkeypatch):
    folder = copy_case(hf_checkpoint, "llama", tmp_path)

    def change(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
        return t

    rewrite_weights(folder, change)
    # the headers are checked before any data is read
    monkeypatch.setattr(checkpoints, "read_stacked", lambda *a, **k: pytest.fail("data was read"))
    with pytest.raises(lm.CheckpointError) as info:
        from_pretrained(folder)
    message = str(info.value)
    assert "a llama model, 2 layers, hidden 32, 4 heads of 8, 2 key/value heads" in message
    assert (
        "missing (1): model.layers.1.mlp.up_proj.weight (-> params/layers/block/mlp/up/kernel, "
        "(64, 32))" in message
    )
    assert "unexpected (1): model.layers.0.extra.weight (3,)" in message
    assert (
        "wrong shape (1): model.layers.0.self_attn.k_proj.weight (-> "
        "params/layers/block/attention/key/kernel): expected (16, 32), found (24, 32)" in message
    )


def test_errors_of_the_folder(hf_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a folder"):
        from_pretrained(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        from_pretrained(tmp_path)
    folder = copy_case(hf_checkpoint, "llama", tmp_path)
    edit_config(folder, model_type="gemma3")
    config_path = re.escape(str(folder / "config.json"))
    with pytest.raises(
        ValueError, match=rf"^{config_path}: .*model_type='gemma3'.*Supported: llama, mistral"
    ):
        from_pretrained(folder)
    edit_config(folder, model_type="llama", quantization_config={"quant_method": "gptq"})
    with pytest.raises(ValueError, match=rf"^{config_path}: .*'gptq'.*quantised"):
        from_pretrained(folder)
    edit_config(folder, quantization_config=None)
    # the weights file itself: the folder is what it takes
    hint = rf"is not a folder; it takes the folder .*from_pretrained\('{re.escape(str(folder))}'\)"
    with pytest.raises(FileNotFoundError, match=hint):
        from_pretrained(folder / "model.safetensors")
    edit_config(folder, model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported yet"):
        from_pretrained(folder)
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(
        lm.CheckpointError, match=r"neither model.safetensors.*pytorch_model.bin.*convert"
    ):
        from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(lm.CheckpointError, match="is not a readable safetensors file"):
        from_pretrained(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(lm.CheckpointError, match=r"config\.json is not valid JSON"):
        from_pretrained(folder)


def test_errors_of_a_sharded_folder(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "llama_sharded", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (folder / shard).unlink()
    with pytest.raises(
        lm.CheckpointError, match=f"lists shard\\(s\\) that are not in the folder: {shard}"
    ):
        from_pretrained(folder)
    folder = copy_case(hf_checkpoint, "llama_sharded", tmp_path / "again")
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != shard)
    index["weight_map"]["model.norm.weight"] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(lm.CheckpointError, match=f"model.norm.weight \\(in {other}\\)"):
        from_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(lm.CheckpointError, match="is not a safetensors index"):
        from_pretrained(folder)


def test_shardings_errors(loaded):
    folder, _, _, variables = loaded("llama")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, placed = from_pretrained(folder, shardings=device)
    assert all(a.sharding == device for a in jax.tree.leaves(placed))
    tree = jax.tree.map(lambda _: device, variables)
    del tree["params"]["final_norm"]
    tree["params"]["extra"] = device
    with pytest.raises(lm.VariablesError, match=r"not a jax.sharding.Sharding \(1\): params/embed"):
        spec = jax.tree.map(lambda _: device, variables)
        spec["params"]["embed"]["embedding"] = jax.sharding.PartitionSpec()
        from_pretrained(folder, shardings=spec)
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)no sharding for \(1\): params/final_norm/scale.*"
        r"no such variable \(1\): params/extra",
    ):
        from_pretrained(folder, shardings=tree)
    with pytest.raises(lm.VariablesError, match=r"lacks the variables' 'params' level.*wrap it in"):
        from_pretrained(folder, shardings=jax.tree.map(lambda _: device, variables)["params"])


def test_shardings_on_eight_devices(hf_checkpoint):
    """Sharded loads equal unsharded ones, and every device reads only its slice."""
    folder, _ = hf_checkpoint("llama_sharded")
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip(),
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",  # as pytest.mark.fast_compile (conftest.py)
    }
    result = subprocess.run(
        [sys.executable, __file__, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok sharded" in result.stdout


# --- save_pretrained --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "qwen3", "gemma", "mistral", "llama3_rope", "llama_bf16"]
)
def test_save_then_transformers_loads_the_same_weights(loaded, tmp_path, name):
    import torch
    import transformers

    folder, torch_model, model, variables = loaded(name)
    save_pretrained(model, variables, tmp_path / "out")
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype="auto", attn_implementation="eager"
    )
    assert type(back) is type(torch_model)
    ours, theirs = back.state_dict(), torch_model.state_dict()
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype, key
        assert torch.equal(ours[key], tensor), key
    if model.config.tie_embeddings:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = back(ids).logits
        if name != "llama_bf16":  # (the original's RoPE buffer was cast to bf16 with it)
            torch.testing.assert_close(want, torch_model(ids).logits, rtol=0, atol=0)
    # and lamina's model of the same variables gives transformers' logits
    logits, _ = lm.transform(model).apply(variables, None, jnp.asarray(ids.numpy()))
    tolerance = 5e-2 if name == "llama_bf16" else 2e-5
    np.testing.assert_allclose(
        np.asarray(logits, np.float32), want.float().numpy(), rtol=1e-4, atol=tolerance
    )


def test_sharded_save_has_an_index_transformers_reads(loaded, tmp_path):
    import torch
    import transformers

    _, torch_model, model, variables = loaded("llama_sharded")
    save_pretrained(model, variables, tmp_path / "out", max_shard_size="10KB")
    files = sorted(os.listdir(tmp_path / "out"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for shard in shards:  # at most 10 kB of data, unless one tensor alone is larger
        names = [n for n, f in index["weight_map"].items() if f == shard]
        data = sum(torch_model.state_dict()[n].numel() * 4 for n in names)
        assert data <= 10_000 or len(names) == 1, (shard, names)
    assert set(index["weight_map"]) == set(torch_model.state_dict())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in torch_model.state_dict().values()
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for key, tensor in torch_model.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    _, again = from_pretrained(tmp_path / "out")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), again, variables))


def test_save_checks_before_writing(loaded, tmp_path):
    _, _, model, variables = loaded("llama")
    params = dict(variables["params"])
    params["query_lora"] = {"lora_a": jnp.zeros((2, 2))}
    del params["final_norm"]
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)missing \(1\): params/final_norm/scale.*"
        r"unexpected \(1\): params/query_lora/lora_a.*lm.merge_lora",
    ):
        save_pretrained(model, {"params": params}, tmp_path / "out")
    with pytest.raises(lm.VariablesError, match=r"must be \{'params': ...\}"):
        save_pretrained(model, variables["params"], tmp_path / "out")
    with pytest.raises(ValueError, match="max_shard_size='big'"):
        save_pretrained(model, variables, tmp_path / "out", max_shard_size="big")
    with pytest.raises(TypeError, match=r"expected a lamina\.models\.CausalLM"):
        save_pretrained(lm.Dense(2, 2), variables, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_a_failed_save_leaves_no_half_written_folder(loaded, tmp_path, monkeypatch):
    import safetensors.numpy

    _, _, model, variables = loaded("llama_sharded")
    calls = []
    real = safetensors.numpy.save_file

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(saving.safetensors.numpy, "save_file", failing)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(model, variables, tmp_path / "out", max_shard_size="10KB")
    assert os.listdir(tmp_path) == []  # neither the folder nor a temporary one
    # an existing folder keeps its old contents
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("old")
    calls.clear()
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(model, variables, tmp_path / "out", max_shard_size="10KB")
    assert os.listdir(tmp_path) == ["out"]
    assert os.listdir(tmp_path / "out") == ["config.json"]
    assert (tmp_path / "out" / "config.json").read_text() == "old"


def test_saving_over_a_folder_keeps_other_files_and_copies_the_tokenizer(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "llama_sharded", tmp_path)
    write_tokenizer(folder)
    (folder / "README.md").write_text("my notes")
    model, variables = from_pretrained(folder)
    # into a fresh folder: the source's tokenizer and generation config come along
    save_pretrained(model, variables, tmp_path / "copy")
    copied = sorted(os.listdir(tmp_path / "copy"))
    assert copied == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert load_tokenizer(tmp_path / "copy").encode("hello world").ids == [1, 2]
    # over the folder it was loaded from: one file now, the old shards and index gone
    save_pretrained(model, variables, folder)
    assert sorted(os.listdir(folder)) == sorted([*copied, "README.md"])
    assert (folder / "README.md").read_text() == "my notes"
    _, again = from_pretrained(folder)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), again, variables))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_merged_lora_model_saves_with_its_tokenizer(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "qwen2", tmp_path)
    write_tokenizer(folder)
    model, variables = from_pretrained(folder)
    adapted = lm.replace(
        lm.assign_variables(model, variables),
        lambda path, layer: lm.LoRA(layer, rank=2),
        where=lm.PathContains("attention/query"),
    )
    # the loaded weights, and random adapters (no initializer run: fast)
    rng = np.random.default_rng(0)

    def fill(path, shape):
        names = [p.key for p in path]
        if names[-1] in ("lora_a", "lora_b"):
            return jnp.asarray(rng.normal(0, 0.1, shape.shape).astype(np.float32))
        return leaf(variables, [n for n in names if n != "base"])

    shapes = jax.eval_shape(lm.transform(adapted).init, jax.random.key(1))
    with_adapters = jax.tree_util.tree_map_with_path(fill, shapes)
    with pytest.raises(lm.VariablesError, match=r"merge them into the kernels first"):
        save_pretrained(adapted, with_adapters, tmp_path / "out")
    merged_model, merged = lm.merge_lora(adapted, with_adapters)
    # a model derived from the loaded one names its source; nothing is guessed
    save_pretrained(merged_model, merged, tmp_path / "guess")
    assert "tokenizer.json" not in os.listdir(tmp_path / "guess")
    save_pretrained(merged_model, merged, tmp_path / "out", source=folder)
    assert "tokenizer.json" in os.listdir(tmp_path / "out")
    _, back = from_pretrained(tmp_path / "out")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, merged))
    query = ("params", "layers", "block", "attention", "query", "kernel")
    assert not np.array_equal(leaf(back, query), leaf(variables, query))  # the update is in


def test_only_the_loaded_model_object_copies_its_folder(hf_checkpoint, tmp_path):
    folder = copy_case(hf_checkpoint, "qwen3", tmp_path)
    (folder / "generation_config.json").write_text('{"eos_token_id": 77, "temperature": 0.6}')
    # what transformers 5's tokenizers write (and the slow ones' vocabularies)
    tokenizer_files = [
        "added_tokens.json",
        "chat_template.jinja",
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "vocab.json",
    ]
    for name in tokenizer_files:
        (folder / name).write_text("{}")
    (folder / "notes.txt").write_text("not copied")
    model, variables = from_pretrained(folder)
    save_pretrained(model, variables, tmp_path / "same")
    assert sorted(os.listdir(tmp_path / "same")) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *tokenizer_files]
    )
    assert (
        json.loads((tmp_path / "same" / "generation_config.json").read_text())["eos_token_id"] == 77
    )
    # an equal model made from the config is another model: nothing of the folder is copied
    fresh = lamina_models.CausalLM(model.config)
    save_pretrained(fresh, variables, tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path / "fresh")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    generation = json.loads((tmp_path / "fresh" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    with pytest.raises(FileNotFoundError, match=r"source='.*absent' is not a folder"):
        save_pretrained(fresh, variables, tmp_path / "bad", source=tmp_path / "absent")
    assert not (tmp_path / "bad").exists()


def test_save_paths_symlinks_and_the_working_directory(loaded, tmp_path, monkeypatch):
    _, _, model, variables = loaded("llama")
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("kept")
    (tmp_path / "link").symlink_to(real)
    # a symlink keeps pointing at its folder, which gets the checkpoint
    save_pretrained(model, variables, tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(real)) == [
        "config.json",
        "generation_config.json",
        "keep.txt",
        "model.safetensors",
    ]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # no .lamina-old nor -tmp left
    # the working directory (or a folder holding it) is refused, untouched
    monkeypatch.chdir(real)
    for target in (".", str(tmp_path), str(tmp_path / "link")):
        with pytest.raises(ValueError, match=r"is \(or contains\) the current working directory"):
            save_pretrained(model, variables, target)
    assert (real / "keep.txt").read_text() == "kept" and os.getcwd() == str(real)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        save_pretrained(model, variables, tmp_path / "file")


# --- tokenizers -------------------------------------------------------------------------------


def write_tokenizer(folder: pathlib.Path) -> None:
    spec = {
        "version": "1.0",
        "model": {"type": "WordLevel", "unk_token": "?", "vocab": {"?": 0, "hello": 1, "world": 2}},
        "pre_tokenizer": {"type": "Whitespace"},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def test_load_tokenizer(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    assert load_tokenizer(tmp_path) is None
    write_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("hello there world").ids == [1, 0, 2]
    assert tokenizer.decode([2, 1]) == "world hello"
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("world").ids == [2]
    with pytest.raises(FileNotFoundError, match="neither a folder nor a file"):
        load_tokenizer(tmp_path / "absent")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)
    monkeypatch.undo()
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="is not a tokenizer the tokenizers package reads"):
        load_tokenizer(tmp_path)


# --- eight devices (this file as a script) ----------------------------------------------------


def main(folder: str) -> None:
    """Sharded loads on a 2x2x2 mesh: equal values, given shardings, only each slice read."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 8, jax.device_count()
    mesh = jax.make_mesh((2, 2, 2), ("layers", "heads", "mlp"))
    model, whole = from_pretrained(folder)
    block = {
        "attention_norm": {"scale": P("layers", None)},
        "mlp_norm": {"scale": P("layers", None)},
        "attention": {
            "query": {
                "kernel": P("layers", None, "heads", None),
                "bias": P("layers", "heads", None),
            },
            "key": {"kernel": P("layers", None, "heads", None), "bias": P("layers", "heads", None)},
            # a head's features split between devices: whole heads are read, then sliced
            "value": {
                "kernel": P("layers", None, None, "heads"),
                "bias": P("layers", None, "heads"),
            },
            "out": {"kernel": P("layers", "heads", None, None), "bias": P("layers", None)},
        },
        "mlp": {
            "gate": {"kernel": P("layers", None, "mlp"), "bias": P("layers", "mlp")},
            "up": {"kernel": P(None, "heads", "mlp"), "bias": P(None, "mlp")},
            "down": {"kernel": P("layers", "mlp", None), "bias": P("layers", None)},
        },
    }
    specs = {
        "params": {
            "embed": {"embedding": P(("heads", "mlp"), None)},
            "final_norm": {"scale": P()},
            "lm_head": {"kernel": P(None, "mlp")},
            "layers": {"block": block},
        }
    }
    tree = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )

    reads: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    real_memmap = checkpoints.memmap

    class Spy:
        """A memory map that records the block each read copies."""

        def __init__(self, name: str, array: np.ndarray) -> None:
            self.name, self.array = name, array
            self.shape, self.dtype = array.shape, array.dtype

        def __getitem__(self, index):
            block = self.array[index]
            reads.setdefault(self.name, []).append(tuple(block.shape))
            return block

    def spying(file, offset, info):
        return Spy(info.name, real_memmap(file, offset, info))

    checkpoints.memmap = spying
    _, sharded = from_pretrained(folder, shardings=tree)
    checkpoints.memmap = real_memmap
    assert jax.tree.map(lambda a: a.sharding, sharded) == tree
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole), strict=True):
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))

    # each stored tensor was read in the blocks the devices hold, each distinct block once
    for v in expected_variables(model.config):
        sharding = leaf(tree, v.key)
        indices = {
            tuple((s.start, s.stop) for s in index)
            for index in sharding.devices_indices_map(v.shape).values()
        }
        for i, name in enumerate(v.hf_names()):
            wanted = []
            for index in indices:
                layer_index = index if v.layers is None else index[1:]
                if v.layers is not None and not (index[0][0] or 0) <= i < (index[0][1] or v.layers):
                    continue
                block = [
                    (stop if stop is not None else n) - (start or 0)
                    for (start, stop), n in zip(layer_index, v.relayout.shape, strict=True)
                ]
                if v.key[-2:] == ("value", "kernel"):
                    block[-1] = v.relayout.shape[-1]  # a split head is read whole
                if v.key[-2:] == ("value", "bias"):
                    block[-1] = v.relayout.shape[-1]
                groups = [len(g.split()) for g in v.name.layout.split("|")]
                moved, k = [], 0
                for g in groups:
                    moved.append(int(np.prod(block[k : k + g])))
                    k += g
                wanted.append(tuple(reversed(moved)) if v.name.transpose else tuple(moved))
            got = reads.pop(name)
            assert sorted(got) == sorted(wanted), (name, got, wanted)
    assert not reads, sorted(reads)

    # the shardings the model's logical axis names give, as lm.shardings builds them
    rules = {"layers": "layers", "heads": "heads", "kv_heads": "heads", "mlp": "mlp"}
    rules.update(vocab=("heads", "mlp"), embed=None)
    logical = lm.shardings(model, mesh, rules)
    _, placed = from_pretrained(folder, shardings=logical)
    assert jax.tree.map(lambda a: a.sharding, placed) == logical
    kernel = placed["params"]["layers"]["block"]["attention"]["key"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (1, 32, 1, 8)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(whole), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))

    # cast per block on the host, sharded
    _, half = from_pretrained(folder, dtype=jnp.bfloat16, shardings=tree)
    for got, want in zip(jax.tree.leaves(half), jax.tree.leaves(whole), strict=True):
        assert got.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))
    bad = jax.tree.map(lambda s: s, tree)
    key = bad["params"]["layers"]["block"]["attention"]["key"]
    key["kernel"] = NamedSharding(mesh, P(None, None, ("layers", "heads", "mlp"), None))
    try:
        from_pretrained(folder, shardings=bad)
        raise AssertionError("2 key/value heads were split over 8 devices")
    except lm.VariablesError as error:
        assert (
            "the sharding for params/layers/block/attention/key/kernel does not fit its "
            "shape (2, 32, 2, 8)" in str(error)
        ), error

    # sharded variables save as they load (each layer's slice gathered to the host)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        save_pretrained(model, placed, os.path.join(out, "saved"), max_shard_size="20KB")
        _, again = from_pretrained(os.path.join(out, "saved"))
    for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(whole), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    print("ok sharded")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1])
