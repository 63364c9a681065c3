"""`ModelConfig`: a decoder's hyperparameters, from and to Hugging Face's ``config.json``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# model types whose checkpoints look alike but need what one homogeneous Stack block cannot
# hold yet (per-layer attention kinds, soft-capping, mixtures of experts)
LATER = {
    "gemma2": "alternating local/global layers and attention logit soft-capping",
    "gemma3": "alternating local/global layers with two RoPE bases",
    "gemma3_text": "alternating local/global layers with two RoPE bases",
    "mixtral": "a mixture-of-experts MLP",
    "qwen2_moe": "a mixture-of-experts MLP",
    "qwen3_moe": "a mixture-of-experts MLP",
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
# transformers' class defaults for keys a config.json may leave out
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, num_key_value_heads=None, tie=False),
    "mistral": dict(max_position_embeddings=4096 * 32, num_key_value_heads=8, tie=False),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32, tie=False),
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32, tie=False, head_dim=128),
    "gemma": dict(max_position_embeddings=8192, num_key_value_heads=16, tie=True, head_dim=256),
}
# the special tokens of those classes (bos, eos, pad), for a config.json that leaves them out
_TOKEN_DEFAULTS: dict[str, tuple[int | None, int | None, int | None]] = {
    "llama": (1, 2, None),
    "mistral": (1, 2, None),
    "qwen2": (None, None, None),
    "qwen3": (None, None, None),
    "gemma": (2, 1, 0),
}
# hidden_act of transformers' ACT2FN -> GatedMLP's activation
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
_HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# rope_type -> the keys its scaling needs (besides rope_type)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}
_LATER_ROPE = ("dynamic", "yarn", "longrope", "proportional")
_DTYPES = ("float32", "bfloat16", "float16")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The hyperparameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma).

    `from_hf` reads a Hugging Face ``config.json`` (as a dict) with the rules `transformers`
    itself applies (its class defaults, legacy keys, Gemma's ``hidden_act``); `to_hf` writes
    the dict back in transformers 5's form, which ``transformers.AutoConfig`` reads into the
    same configuration. The checks here run on every instance, so a `CausalLM` is never built
    from an inconsistent one.

    Attributes:
        model_type: One of ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"gemma"``:
            the architecture ``config.json`` names, and the name map a checkpoint uses.
        vocab_size: Tokens in the vocabulary.
        hidden_size: The width of the residual stream.
        intermediate_size: The width of the gated MLP.
        num_layers: Decoder blocks.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention); divides `num_heads`.
        head_dim: Features per head (need not be ``hidden_size // num_heads``).
        max_position_embeddings: The context length the model was trained for.
        rope_theta: RoPE's base.
        rope_scaling: None, or RoPE's frequency scaling in `lm.RotaryEmbedding`'s form:
            ``{"rope_type": "linear", "factor": 2.0}`` or ``{"rope_type": "llama3", "factor":
            ..., "low_freq_factor": ..., "high_freq_factor": ...,
            "original_max_position_embeddings": ...}``.
        partial_rotary_factor: The fraction of each head's features that RoPE rotates.
        norm_eps: RMSNorm's epsilon.
        activation: The gated MLP's: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU, Gemma) or
            ``"gelu"``.
        qkv_bias: Whether the query, key and value projections have biases (Qwen2).
        out_bias: Whether the output projection has one.
        mlp_bias: Whether the MLP's projections have them (some Llama variants).
        qk_norm: Whether queries and keys are RMS-normalised per head before RoPE (Qwen3).
        sliding_window: None, or how many keys (itself included) each query sees (Mistral).
        tie_embeddings: Whether the output head reuses the embedding table.
        embed_scale: Whether embeddings are multiplied by ``sqrt(hidden_size)`` (Gemma).
        norm_offset: Added to every RMSNorm scale: 1.0 for Gemma's ``(1 + w)`` norms.
        dtype: The checkpoint's storage dtype (``"float32"``, ``"bfloat16"``, ``"float16"``),
            or None; `from_pretrained` keeps it unless told otherwise.
        bos_token_id: The beginning-of-sequence token, or None.
        eos_token_id: The end-of-sequence tokens (Llama 3 has two); may be empty.
        pad_token_id: The padding token, or None.

    Example:
        >>> from lamina.models import ModelConfig
        >>> config = ModelConfig.from_hf({
        ...     "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2, "rope_theta": 500000.0, "eos_token_id": [1, 2],
        ... })
        >>> config.head_dim, config.num_kv_heads, config.rope_theta, config.eos_token_id
        (8, 2, 500000.0, (1, 2))
        >>> config.to_hf()["rope_parameters"]
        {'rope_type': 'default', 'rope_theta': 500000.0}
        >>> ModelConfig.from_hf(config.to_hf()) == config
        True
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-6
    activation: str = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_embeddings: bool = False
    embed_scale: bool = False
    norm_offset: float = 0.0
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _check_model_type(self.model_type)
        sizes = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ]
        bad = [
            f"{name}={getattr(self, name)!r}"
            for name in sizes
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1
        ]
        if self.sliding_window is not None and (
            not _is_int(self.sliding_window) or self.sliding_window < 1
        ):
            bad.append(f"sliding_window={self.sliding_window!r}")
        if bad:
            raise ValueError(
                f"ModelConfig: {', '.join(bad)}: must be positive ints (sliding_window may "
                f"also be None)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads} (each key/value head serves a group of query heads)"
            )
        if self.activation not in _HF_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig: activation={self.activation!r}; expected one of "
                f"{sorted(_HF_ACTIVATIONS)}"
            )
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(
                f"ModelConfig: dtype={self.dtype!r}; expected None or one of {list(_DTYPES)}"
            )
        numbers = {"rope_theta": self.rope_theta, "norm_eps": self.norm_eps}
        for name, value in numbers.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig: {name}={value!r} must be a positive number")
        if self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"ModelConfig: partial_rotary_factor={self.partial_rotary_factor!r}: the "
                f"supported architectures rotate whole heads (1.0); partial rotation is "
                f"lm.RotaryEmbedding's option for other models"
            )
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        if scaling is not None:
            _check_rope_scaling(scaling, "ModelConfig.rope_scaling")
            if scaling["rope_type"] == "default":
                scaling = None
        object.__setattr__(self, "rope_scaling", scaling)
        given: Any = self.eos_token_id
        eos = () if given is None else (given,) if _is_int(given) else tuple(given)
        if not all(_is_int(t) for t in eos):
            raise ValueError(f"ModelConfig: eos_token_id={self.eos_token_id!r} must be ints")
        object.__setattr__(self, "eos_token_id", eos)

    def __hash__(self) -> int:
        scaling = None if self.rope_scaling is None else tuple(sorted(self.rope_scaling.items()))
        values = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return hash(tuple(scaling if v is self.rope_scaling else v for v in values))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` (parsed into a dict).

        Follows `transformers`' own reading: its class defaults for absent keys (Gemma's
        ``head_dim`` 256, Qwen3's 128, ``num_key_value_heads`` and the special tokens of each
        class: Llama/Mistral bos 1 and eos 2, Gemma bos 2, eos 1 and pad 0, Qwen none), the
        legacy ``rope_theta``/``rope_scaling`` keys as well as the v5 ``rope_parameters``
        (a ``"default"`` RoPE ignores other keys, such as a ``factor``), Gemma's legacy
        ``hidden_act="gelu"`` meaning the tanh approximation, Qwen2/Qwen3's
        ``use_sliding_window`` and ``layer_types`` (Mistral ignores ``layer_types``: its
        ``sliding_window`` applies to every layer).

        Args:
            config: The parsed ``config.json``.

        Returns:
            The configuration.

        Raises:
            ValueError: If the ``model_type`` is not supported (the message lists those that
                are, and says which are planned), a required key is missing, the RoPE type is
                not supported (``dynamic``, ``yarn``, ``longrope``), layers mix sliding and
                full attention, the checkpoint is quantised (``quantization_config``), or a
                value is invalid.
        """
        if not isinstance(config, Mapping):
            raise TypeError(
                f"ModelConfig.from_hf takes a dict (a parsed config.json), got {config!r:.60}"
            )
        model_type = config.get("model_type")
        _check_model_type(model_type)
        assert isinstance(model_type, str)
        quantization = config.get("quantization_config")
        if quantization:
            method = (
                quantization.get("quant_method", "unknown")
                if isinstance(quantization, Mapping)
                else "unknown"
            )
            raise ValueError(
                f"config.json has a quantization_config (quant_method {method!r}): quantised "
                f"checkpoints are not supported; load the unquantised (float32, bfloat16 or "
                f"float16) release of the model"
            )
        defaults = _CLASS_DEFAULTS[model_type]
        missing = [key for key in _REQUIRED if config.get(key) is None]
        if missing:
            raise ValueError(
                f"config.json of a {model_type} model lacks {', '.join(missing)}; is it the "
                f"config of a causal language model?"
            )
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", defaults["num_key_value_heads"])
        head_dim = config.get("head_dim", defaults.get("head_dim"))
        if head_dim is None:
            head_dim = config["hidden_size"] // heads
        max_positions = config.get("max_position_embeddings", defaults["max_position_embeddings"])
        theta, scaling = _read_rope(config, max_positions)
        activation = config.get(
            "hidden_act", "gelu_pytorch_tanh" if model_type == "gemma" else "silu"
        )
        if model_type == "gemma" and activation == "gelu":
            activation = "gelu_pytorch_tanh"  # as transformers' GemmaConfig rewrites it
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"config.json: hidden_act={activation!r} is not supported; expected one of "
                f"{sorted(_ACTIVATIONS)}"
            )
        if model_type == "gemma" and config.get("use_bidirectional_attention"):
            raise ValueError(
                "config.json: use_bidirectional_attention=true makes an encoder, not a causal "
                "language model; lamina.models reads causal decoders only"
            )
        attention_bias = bool(config.get("attention_bias", False))
        qkv_bias, out_bias = {
            "mistral": (False, False),
            "qwen2": (True, False),
        }.get(model_type, (attention_bias, attention_bias))
        bos, eos, pad = (
            config.get(key, default)
            for key, default in zip(
                ("bos_token_id", "eos_token_id", "pad_token_id"),
                _TOKEN_DEFAULTS[model_type],
                strict=True,
            )
        )
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            activation=_ACTIVATIONS[activation],
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            sliding_window=_read_sliding_window(config, model_type),
            tie_embeddings=bool(config.get("tie_word_embeddings", defaults["tie"])),
            embed_scale=model_type == "gemma",
            norm_offset=1.0 if model_type == "gemma" else 0.0,
            dtype=_read_dtype(config),
            bos_token_id=bos,
            eos_token_id=() if eos is None else (eos,) if _is_int(eos) else tuple(eos),
            pad_token_id=pad,
        )

    def to_hf(self) -> dict[str, Any]:
        """This configuration as a Hugging Face ``config.json`` dict (transformers 5's form).

        RoPE goes into ``rope_parameters`` (with ``rope_theta``); ``architectures`` names the
        causal-LM class, so ``transformers.AutoModelForCausalLM`` can build the model.

        Returns:
            A JSON-serialisable dict.

        Raises:
            ValueError: If the configuration cannot be written as its ``model_type``'s
                config (a Llama with q/k norms, a Qwen2 without q/k/v biases, ...): say
                which architecture it is by its ``model_type``.
        """
        self._check_expressible()
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        eos: int | list[int] | None = (
            None
            if not self.eos_token_id
            else self.eos_token_id[0]
            if len(self.eos_token_id) == 1
            else list(self.eos_token_id)
        )
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps,
            "hidden_act": _HF_ACTIVATIONS[self.activation],
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("llama", "qwen3", "gemma"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            window = self.sliding_window is not None
            out["use_sliding_window"] = window
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = 0 if window else self.num_layers
            kind = "sliding_attention" if window else "full_attention"
            out["layer_types"] = [kind] * self.num_layers
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    def _check_expressible(self) -> None:
        kind = self.model_type
        wrong = []
        if kind == "qwen2" and (not self.qkv_bias or self.out_bias):
            wrong.append(
                "qwen2 has q/k/v biases and no output bias (qkv_bias=True, out_bias=False)"
            )
        elif kind == "mistral" and (self.qkv_bias or self.out_bias):
            wrong.append("mistral has no attention biases")
        elif kind in ("llama", "qwen3", "gemma") and self.qkv_bias != self.out_bias:
            wrong.append(
                f"{kind}'s one attention_bias covers q/k/v and output: qkv_bias == out_bias"
            )
        if self.mlp_bias and kind != "llama":
            wrong.append(f"only llama has MLP biases (mlp_bias=True for {kind})")
        if self.qk_norm != (kind == "qwen3"):
            wrong.append("q/k norms (qk_norm=True) are qwen3's, and always there")
        gemma = kind == "gemma"
        if self.embed_scale != gemma or self.norm_offset != (1.0 if gemma else 0.0):
            wrong.append("embed_scale=True and norm_offset=1.0 are gemma's, and always there")
        if self.sliding_window is not None and kind not in ("mistral", "qwen2", "qwen3"):
            wrong.append(f"{kind} has no sliding window")
        if gemma and self.activation == "gelu":
            wrong.append('gemma\'s "gelu" means the tanh approximation: use activation="gelu_tanh"')
        if wrong:
            raise ValueError(
                f"ModelConfig.to_hf: this configuration is not a {kind} model: "
                + "; ".join(wrong)
                + ". Pick the model_type whose architecture it is."
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_model_type(model_type: Any) -> None:
    if model_type in SUPPORTED:
        return
    later = LATER.get(model_type) if isinstance(model_type, str) else None
    why = f" ({model_type} needs {later}; planned)" if later else ""
    raise ValueError(
        f"lamina.models does not support model_type={model_type!r}{why}. Supported: "
        f"{', '.join(SUPPORTED)}. Not yet: {', '.join(sorted(LATER))}."
    )


def _check_rope_scaling(scaling: dict[str, Any], where: str) -> None:
    kind = scaling.get("rope_type")
    if kind in _LATER_ROPE:
        raise ValueError(
            f"{where}: rope_type {kind!r} is not supported yet (its frequencies depend on the "
            f"sequence length, or it is not implemented); supported: {list(ROPE_TYPES)}"
        )
    if kind not in ROPE_TYPES:
        raise ValueError(f"{where}: unknown rope_type {kind!r}; supported: {list(ROPE_TYPES)}")
    missing = [key for key in ROPE_TYPES[kind] if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{where}: rope_type {kind!r} needs {', '.join(missing)}; got {scaling}")
    extra = sorted(set(scaling) - {"rope_type", *ROPE_TYPES[kind]})
    if extra:
        raise ValueError(
            f"{where}: rope_type {kind!r} takes {', '.join(ROPE_TYPES[kind]) or 'no options'}, "
            f"not {', '.join(extra)}"
        )
    for key in ROPE_TYPES[kind]:
        value = scaling[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{where}: {key}={value!r} must be a positive number")


# keys of rope_parameters that carry no frequency setting of the supported types
_ROPE_IGNORED = {"rope_theta", "type", "partial_rotary_factor"}


def _read_rope(
    config: Mapping[str, Any], max_positions: int
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` or the legacy keys, as transformers."""
    legacy = config.get("rope_scaling")
    given = legacy if legacy else config.get("rope_parameters")
    params = dict(given) if given else {}
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            f"config.json: rope_parameters per layer type ({', '.join(params)}) are not "
            f"supported: the layers of one lamina Stack share one RoPE"
        )
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(
            f"config.json: partial_rotary_factor={partial} is not supported for these "
            f"architectures (transformers' Llama ignores it for the default RoPE); the "
            f"supported checkpoints rotate whole heads"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":  # transformers warns about other keys (a factor) and ignores them
        params = {k: v for k, v in params.items() if k in _ROPE_IGNORED}
    scaling = {k: v for k, v in params.items() if k not in _ROPE_IGNORED}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", max_positions),
        )
    if kind == "linear" or kind == "llama3":
        for key in ("attention_factor", "beta_fast", "beta_slow"):
            scaling.pop(key, None)
    _check_rope_scaling(scaling, "config.json's RoPE parameters")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ValueError(f"config.json: rope_theta={theta!r} must be a positive number")
    return float(theta), (None if kind == "default" else scaling)


def _read_sliding_window(config: Mapping[str, Any], model_type: str) -> int | None:
    """The one window all layers share, or None; mixed layers are refused."""
    if model_type in ("llama", "gemma"):
        return None
    window = config.get("sliding_window", 4096)
    layers = config["num_hidden_layers"]
    if model_type == "mistral":  # transformers' Mistral ignores layer_types: every layer slides
        kinds = None
    else:
        if not config.get("use_sliding_window", False) or window is None:
            return None
        kinds = config.get("layer_types")
        if kinds is None:
            first = config.get("max_window_layers", 28)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if kinds is not None and window is not None:
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        if not sliding:
            return None
        if len(sliding) != len(kinds):
            raise ValueError(
                f"config.json: layers {sliding} use a sliding window of {window} and the "
                f"others full attention; lamina's Stack shares one attention kind across all "
                f"layers, so mixed windows are not supported yet"
            )
    return None if window is None else int(window)


def _read_dtype(config: Mapping[str, Any]) -> str | None:
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype is None or dtype == "auto":
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"config.json: dtype {dtype!r} is not one of {list(_DTYPES)}")
    return name
