"""Tiny random Hugging Face checkpoints of each supported architecture, built offline.

`hf_folder(name, root)` builds (once per process) a ``transformers`` model from a tiny
configuration with every weight randomised (transformers initialises biases to 0 and norms
to 1, which would hide bias, norm and offset bugs), saves it with ``save_pretrained`` under
`root` and returns ``(folder, torch_model)``. Tests use it through the ``hf_checkpoint``
fixture of `tests/conftest.py`. `hf_loaded(name, build)` reads such a folder with lamina's
``from_pretrained`` once per process (the ``hf_model`` fixture), so that the test files that
compare lamina's model with transformers' share one lamina model, its variables and one
reference torch model per architecture (and `lm.generate`'s programs, kept with the model).
Nothing is downloaded.
"""

from __future__ import annotations

import pathlib
from typing import Any

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (config class name, extra config, save options). The variants each exercise a
# different part of the loader and the model.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), {}),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=1e4,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # head_dim 8: wavelengths 6.3, 63, 628, 6283 fall in all three bands
                # (< 64/4 kept, between smoothed, > 64 divided).
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=True,
        ),
        {},
    ),
    "llama_linear": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
        {},
    ),
    "llama_sharded": (
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True),
        {"max_shard_size": "20KB"},
    ),
    "mistral": ("MistralConfig", dict(sliding_window=4), {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", {}, {}),
    "gemma": ("GemmaConfig", {}, {}),
    "llama_bf16": ("LlamaConfig", {}, {"bfloat16": True}),
}

_BUILT: dict[tuple[str, str], tuple[pathlib.Path, Any]] = {}
_LOADED: dict[tuple[str, int], tuple[Any, Any, Any]] = {}


def randomise(model: Any, seed: int = 0) -> None:
    """Draws every parameter of a torch model: weights N(0, 0.1), norm weights U(0.5, 1.5).

    Gemma's norms store the offset from 1 (``(1 + w)``): they are drawn N(0, 0.1) like the
    other weights.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and not gemma:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def hf_folder(name: str, root: pathlib.Path) -> tuple[pathlib.Path, Any]:
    """The folder of the tiny checkpoint `name` (a key of `CASES`) and its torch model (eval)."""
    key = (name, str(root))
    if key in _BUILT:
        return _BUILT[key]
    import torch
    import transformers

    class_name, extra, options = CASES[name]
    config = getattr(transformers, class_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomise(model)
    if options.get("bfloat16"):
        model = model.to(torch.bfloat16)
    model.eval()
    folder = root / name
    model.save_pretrained(folder, max_shard_size=options.get("max_shard_size", "5GB"))
    _BUILT[key] = (folder, model)
    return folder, model


def hf_loaded(name: str, build: Any) -> tuple[Any, Any, Any]:
    """``(model, variables, torch_model)`` of case `name`, read once per process.

    `build` is the ``hf_checkpoint`` fixture (``name -> (folder, torch_model)``). The torch
    model of the bfloat16 case is transformers' own reading of the folder: the fixture's
    model was cast with ``.to(torch.bfloat16)``, which also rounds RoPE's ``inv_freq`` buffer
    to bfloat16, where ``from_pretrained`` keeps it float32 (as lamina). Callers must not
    change what they get (copy a dict before editing it).
    """
    key = (name, id(build))
    if key not in _LOADED:
        from lamina.models import from_pretrained

        folder, torch_model = build(name)
        model, variables = from_pretrained(folder)
        if CASES[name][2].get("bfloat16"):
            torch_model = reference(folder, "bfloat16")
        _LOADED[key] = (model, variables, torch_model)
    return _LOADED[key]


def reference(folder: pathlib.Path, dtype: str) -> Any:
    """transformers' model read from `folder` in `dtype` (eager attention, eval mode)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.eval()
