"""The name maps: which Hugging Face tensor fills which lamina variable, and how.

One table of `Name` rows per ``model_type`` (the five supported architectures share the Llama
naming; what differs between them is in the `ModelConfig`'s flags), from which
`expected_variables` derives every variable's path, shape, stored shape and relayout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..io.tensors import Relayout
from .config import ModelConfig

__all__ = ["IGNORED", "INDEX", "NAME_MAPS", "WEIGHTS", "Name", "Variable", "expected_variables"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Name:
    """One row of a name map: a Hugging Face tensor and the lamina variable it fills.

    Attributes:
        hf: The tensor's name; ``{i}`` stands for the layer (those rows fill a `Stack`'s
            variable, stacked on a leading layer axis).
        path: The variable's path under ``params`` (``/``-separated).
        layout: The variable's axes, ``|`` between the groups that form one axis of the
            stored tensor (``"H|Nq D"``: the variable is ``(H, Nq, D)``, the stored tensor's
            axis is ``Nq * D``), in symbols of the config: ``V`` vocabulary, ``H`` hidden,
            ``I`` intermediate, ``Nq``/``Nkv`` query/key-value heads, ``D`` head dim.
        transpose: Whether the stored tensor is transposed (PyTorch's ``Linear`` keeps
            ``(out, in)``, lamina's `Dense` ``(in, out)``).
        when: The `ModelConfig` flag that must be on for the tensor to exist (``untied``:
            ``not tie_embeddings``), or None.
    """

    hf: str
    path: str
    layout: str
    transpose: bool = False
    when: str | None = None


_LAYER = "model.layers.{i}."
_BLOCK = "layers/block/"
# The Llama naming, which Mistral, Qwen2, Qwen3 and Gemma share; what differs between them
# (biases, q/k norms, Gemma's (1 + w) norms stored as offsets) is in the config's flags.
LLAMA_NAMES = (
    Name("model.embed_tokens.weight", "embed/embedding", "V|H"),
    Name("model.norm.weight", "final_norm/scale", "H"),
    Name("lm_head.weight", "lm_head/kernel", "H|V", True, "untied"),
    Name(_LAYER + "input_layernorm.weight", _BLOCK + "attention_norm/scale", "H"),
    Name(_LAYER + "self_attn.q_proj.weight", _BLOCK + "attention/query/kernel", "H|Nq D", True),
    Name(_LAYER + "self_attn.k_proj.weight", _BLOCK + "attention/key/kernel", "H|Nkv D", True),
    Name(_LAYER + "self_attn.v_proj.weight", _BLOCK + "attention/value/kernel", "H|Nkv D", True),
    Name(_LAYER + "self_attn.o_proj.weight", _BLOCK + "attention/out/kernel", "Nq D|H", True),
    Name(
        _LAYER + "self_attn.q_proj.bias", _BLOCK + "attention/query/bias", "Nq D", when="qkv_bias"
    ),
    Name(_LAYER + "self_attn.k_proj.bias", _BLOCK + "attention/key/bias", "Nkv D", when="qkv_bias"),
    Name(
        _LAYER + "self_attn.v_proj.bias", _BLOCK + "attention/value/bias", "Nkv D", when="qkv_bias"
    ),
    Name(_LAYER + "self_attn.o_proj.bias", _BLOCK + "attention/out/bias", "H", when="out_bias"),
    Name(
        _LAYER + "self_attn.q_norm.weight",
        _BLOCK + "attention/query_norm/scale",
        "D",
        when="qk_norm",
    ),
    Name(
        _LAYER + "self_attn.k_norm.weight", _BLOCK + "attention/key_norm/scale", "D", when="qk_norm"
    ),
    Name(_LAYER + "post_attention_layernorm.weight", _BLOCK + "mlp_norm/scale", "H"),
    Name(_LAYER + "mlp.gate_proj.weight", _BLOCK + "mlp/gate/kernel", "H|I", True),
    Name(_LAYER + "mlp.up_proj.weight", _BLOCK + "mlp/up/kernel", "H|I", True),
    Name(_LAYER + "mlp.down_proj.weight", _BLOCK + "mlp/down/kernel", "I|H", True),
    Name(_LAYER + "mlp.gate_proj.bias", _BLOCK + "mlp/gate/bias", "I", when="mlp_bias"),
    Name(_LAYER + "mlp.up_proj.bias", _BLOCK + "mlp/up/bias", "I", when="mlp_bias"),
    Name(_LAYER + "mlp.down_proj.bias", _BLOCK + "mlp/down/bias", "H", when="mlp_bias"),
)
NAME_MAPS: dict[str, tuple[Name, ...]] = {
    "llama": LLAMA_NAMES,
    "mistral": LLAMA_NAMES,
    "qwen2": LLAMA_NAMES,
    "qwen3": LLAMA_NAMES,
    "gemma": LLAMA_NAMES,
}
# tensors some files hold that the model does not need (old checkpoints saved RoPE's buffer)
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Variable:
    """A lamina variable of a config: its row of the name map, path, shape and stored shape."""

    name: Name
    key: tuple[str, ...]  # ("params", ...)
    layers: int | None  # stacked over this many layers, or None
    relayout: Relayout
    stored: tuple[int, ...]  # the shape of each stored tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The variable's shape (the layer axis first for a stacked one)."""
        layer = tuple(self.relayout.shape)
        return layer if self.layers is None else (self.layers, *layer)

    def hf_names(self) -> list[str]:
        """The stored tensors' names, one per layer for a stacked variable."""
        if self.layers is None:
            return [self.name.hf]
        return [self.name.hf.format(i=i) for i in range(self.layers)]


def expected_variables(config: ModelConfig) -> list[Variable]:
    """Every variable a `CausalLM` of `config` has, with the stored tensors it comes from."""
    sizes = {
        "V": config.vocab_size,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "Nq": config.num_heads,
        "Nkv": config.num_kv_heads,
        "D": config.head_dim,
    }
    flags = {"untied": not config.tie_embeddings}
    result = []
    for name in NAME_MAPS[config.model_type]:
        if name.when is not None and not flags.get(name.when, getattr(config, name.when, False)):
            continue
        groups = [[sizes[s] for s in group.split()] for group in name.layout.split("|")]
        shape = tuple(n for group in groups for n in group)
        moved = tuple(math.prod(group) for group in groups)
        stored = tuple(reversed(moved)) if name.transpose else moved
        layers = config.num_layers if "{i}" in name.hf else None
        key = ("params", *name.path.split("/"))
        result.append(Variable(name, key, layers, Relayout(name.transpose, shape), stored))
    return result
