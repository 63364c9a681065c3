"""The Llama-family decoder: `DecoderBlock`, `CausalLM`, and `init_cache` for its decoding cache.

One class serves Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Gemma: a `ModelConfig` says which
parts differ (biases on q/k/v, q/k RMSNorms, a sliding window, Gemma's ``(1 + w)`` norms,
scaled embeddings and GeGLU). The layers are an `lm.Stack` of one `DecoderBlock`, so the
traced program and the compile time do not grow with depth.

Padding and positions follow transformers' ``generate``: a batch of prompts of different
lengths is left padded, ``mask`` marks the real tokens, each token's position is the number
of real tokens before it (``cumsum(mask) - 1``; padding gets 0) and padded keys are masked.
With ``decode=True`` the model keeps, beside the attention layers' caches, which cached slots
hold real tokens and how many real tokens each row has seen, so that a prefill call and the
one-token steps after it need no other argument.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import initializers
from .._core.checks import as_dtype, is_concrete, is_int, positive_int, static_flags
from .._core.graph import Plan, deep_recursion
from .._core.module import Module
from .._core.types import Dtype
from .._core.variables import Cache
from ..nn.attention_setup import redeclare_cache
from ..nn.gated_mlp import GatedMLP
from ..nn.layer_normalization import RMSNorm
from ..nn.linear import Dense, Embed
from ..nn.multi_head_attention import MultiHeadAttention
from ..nn.rotary import RotaryEmbedding
from ..nn.stack import Stack
from .config import ModelConfig


class DecoderBlock(Module):
    """One pre-norm decoder layer: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    Submodules (the names the checkpoint map reads): ``attention_norm`` and ``mlp_norm``
    (`lm.RMSNorm`), ``attention`` (`lm.MultiHeadAttention` with grouped-query heads, RoPE,
    and per the config q/k/v biases, q/k RMSNorms and a sliding window) and ``mlp``
    (`lm.GatedMLP`: ``gate``, ``up``, ``down``). `CausalLM` stacks `num_layers` of them.

    Args:
        config: The model's `ModelConfig`.
        dtype: Compute dtype; None (the default) computes in the storage dtype, as
            transformers does (a bfloat16 checkpoint computes in bfloat16).
        param_dtype: Storage dtype of the variables.
        decode_shape: ``(batch, max_length)``: declares the attention's decoding cache.
        implementation: The attention's ``implementation`` (None, ``"xla"``, ``"cudnn"``).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.models import ModelConfig
        >>> from lamina.models.llama import DecoderBlock
        >>> config = ModelConfig("llama", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
        >>> init, apply = lm.transform(DecoderBlock(config))
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"])
        ['attention', 'attention_norm', 'mlp', 'mlp_norm']
        >>> y, _ = apply(variables, None, jnp.ones((1, 3, 8)), positions=jnp.arange(3))
        >>> y.shape
        (1, 3, 8)
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        decode_shape: Sequence[int] | None = None,
        implementation: str | None = None,
    ):
        super().__init__()
        options = dict(dtype=dtype, param_dtype=param_dtype)
        self.attention_norm = rms_norm(config, config.hidden_size, **options)
        rope = RotaryEmbedding(
            config.head_dim,
            theta=config.rope_theta,
            scaling=config.rope_scaling,
            partial_rotary_factor=config.partial_rotary_factor,
        )
        self.attention = MultiHeadAttention(
            config.num_heads,
            config.hidden_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            use_bias=config.qkv_bias,
            out_use_bias=config.out_bias,
            rope=rope,
            qk_norm="rms" if config.qk_norm else None,
            qk_norm_eps=config.norm_eps,
            sliding_window=config.sliding_window,
            force_fp32_for_softmax=True,  # transformers' softmax is float32 in every dtype
            decode_shape=decode_shape,
            implementation=implementation,
            kernel_sharding=("embed", "heads", None),
            kv_kernel_sharding=("embed", "kv_heads", None),
            bias_sharding=("heads", None),
            kv_bias_sharding=("kv_heads", None),
            out_kernel_sharding=("heads", None, "embed"),
            **options,
        )
        self.mlp_norm = rms_norm(config, config.hidden_size, **options)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            activation=config.activation,  # GatedMLP's names: "silu", "gelu_tanh", "gelu"
            use_bias=config.mlp_bias,
            kernel_sharding=("embed", "mlp"),
            **options,
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array,
        mask: jax.Array | None = None,
        decode: bool = False,
    ) -> jax.Array:
        """``(batch, length, hidden)`` -> same; `positions` and `mask` as `CausalLM` passes."""
        h = self.attention(
            self.attention_norm(x),
            mask=mask,
            positions=positions,
            causal=not decode,
            decode=decode,
        )
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


def rms_norm(config: ModelConfig, size: int, **options: Any) -> RMSNorm:
    """An RMSNorm in the config's order: Llama's (cast, then scale) or Gemma's ``(1 + w)``."""
    if config.norm_offset:
        return RMSNorm(
            size,
            epsilon=config.norm_eps,
            scale_offset=config.norm_offset,
            scale_init=initializers.zeros(),
            scale_sharding=("embed",),
            **options,
        )
    return RMSNorm(
        size,
        epsilon=config.norm_eps,
        scale_in_input_dtype=True,
        scale_sharding=("embed",),
        **options,
    )


class CausalLM(Module):
    """A Llama-family decoder-only language model: ids ``(batch, length)`` -> logits.

    Built from a `ModelConfig` (`lamina.models.from_pretrained` builds one from a Hugging
    Face folder and loads its weights). Submodules: ``embed`` (`lm.Embed`), ``layers`` (an
    `lm.Stack` of `num_layers` `DecoderBlock`), ``final_norm`` (`lm.RMSNorm`) and ``lm_head``
    (`lm.Dense` without bias; None with tied embeddings, whose logits are
    ``embed.attend(x)``). Gemma multiplies the embeddings by ``sqrt(hidden_size)``, rounded
    to the embeddings' dtype first, as transformers does.

    ``model(ids, mask=None)``: `mask` ``(batch, length)`` bool marks the real tokens (default:
    all). Each token's position is the number of real tokens before it (transformers'
    ``cumsum(mask) - 1`` of ``generate``; padding gets 0) and padded keys are masked, so a
    left-padded row gives the logits it gives alone (at its real positions).

    Decoding (needs `decode_shape`, or a copy from `with_cache`): ``model(prompt, mask=...,
    decode=True)`` runs the prompt and fills the cache (prefill); then ``model(next[:, None],
    decode=True)`` runs one token per call. Beside the attention layers' keys and values, the
    cache (collection ``"cache"``) holds ``key_valid`` ``(batch, max_length)`` (which slots
    hold real tokens), ``token_counts`` ``(batch,)`` (real tokens seen, the next position) and
    ``cache_index`` (slots written). `init_cache` makes it without running any initializer.

    Args:
        config: The hyperparameters (`ModelConfig`).
        dtype: Compute dtype; None (the default) computes in the storage dtype, as
            transformers does.
        param_dtype: Storage dtype of the variables (and, with ``dtype=None``, of the
            decoding cache).
        decode_shape: ``(batch, max_length)``: declares the decoding cache for `batch`
            sequences of up to `max_length` tokens (prompt included).
        implementation: The attention's ``implementation``: None (the plain path), ``"xla"``
            or ``"cudnn"`` (`jax.nn.dot_product_attention`'s fused kernels).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.models import CausalLM, ModelConfig, init_cache
        >>> config = ModelConfig("llama", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
        >>> init, apply = lm.transform(CausalLM(config))
        >>> variables = init(jax.random.key(0))
        >>> ids = jnp.array([[3, 1, 4, 1, 5]])
        >>> logits, _ = apply(variables, None, ids)
        >>> logits.shape
        (1, 5, 16)
        >>> last, _ = apply(variables, None, ids, logits_to_keep=1)  # the last position's
        >>> last.shape, bool(jnp.allclose(last, logits[:, -1:], atol=1e-6))
        ((1, 1, 16), True)

        Decoding: a prefill of 3 tokens, then one token per call, gives the same logits.

        >>> decoder = CausalLM(config).with_cache(batch=1, max_length=8)
        >>> state = {**variables, **init_cache(decoder)}
        >>> apply = lm.transform(decoder).apply
        >>> first, state = apply(state, None, ids[:, :3], decode=True)
        >>> step, state = apply(state, None, ids[:, 3:4], decode=True)
        >>> bool(jnp.allclose(step[:, 0], logits[:, 3], atol=1e-5))
        True
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: Dtype = None,
        param_dtype: Dtype = jnp.float32,
        decode_shape: Sequence[int] | None = None,
        implementation: str | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"{where}: config must be a lamina.models.ModelConfig (e.g. "
                f"ModelConfig.from_hf(json.load(open('config.json')))), got "
                f"{type(config).__name__}."
            )
        self.config = config
        self.dtype = None if dtype is None else as_dtype(where, "dtype", dtype)
        self.param_dtype = as_dtype(where, "param_dtype", param_dtype)
        self.implementation = implementation
        self.decode_shape = None if decode_shape is None else _decode_shape(decode_shape)
        # dtype=None computes in the storage dtype, everywhere: each layer gets it explicitly
        # (an inferred dtype would follow the attention's float32 softmax into the residual).
        compute = self.param_dtype if self.dtype is None else self.dtype
        options: dict[str, Any] = dict(dtype=compute, param_dtype=self.param_dtype)
        self.embed = Embed(
            config.vocab_size,
            config.hidden_size,
            embedding_init=initializers.normal(0.02),
            embedding_sharding=("vocab", "embed"),
            **options,
        )
        block = DecoderBlock(
            config, decode_shape=self.decode_shape, implementation=implementation, **options
        )
        self.layers = Stack(block, config.num_layers, depth_sharding="layers")
        self.final_norm = rms_norm(config, config.hidden_size, **options)
        self.lm_head = (
            None
            if config.tie_embeddings
            else Dense(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                kernel_init=initializers.normal(0.02),
                kernel_sharding=("embed", "vocab"),
                **options,
            )
        )
        self._declare_cache(self.decode_shape)

    def _declare_cache(self, decode_shape: tuple[int, int] | None) -> None:
        """Declares the model's own part of the decoding cache (None: no cache)."""
        self.decode_shape = decode_shape
        self.key_valid: Any = None
        self.token_counts: Any = None
        self.cache_index: Any = None
        if decode_shape is not None:
            batch, max_length = decode_shape
            zeros = initializers.zeros()
            self.key_valid = Cache((batch, max_length), zeros, jnp.bool_)
            self.token_counts = Cache((batch,), zeros, jnp.int32)
            self.cache_index = Cache((), zeros, jnp.int32)

    def with_cache(self, batch: int, max_length: int) -> CausalLM:
        """A copy of this model with a decoding cache for `batch` sequences of `max_length`.

        The copy is this model as it is now, changes after it was built included (`lm.LoRA`
        wrappers from `lm.replace`, `lm.freeze`, `lm.with_policy`), so it takes the same
        variables, plus the cache from `init_cache`. Every `lm.MultiHeadAttention` in it gets
        a cache of ``(batch, max_length, num_kv_heads, head_dim)`` in its compute dtype (a
        policy's compute dtype under `lm.with_policy`); a cache it had is replaced. This
        model is not changed.

        Raises:
            TypeError, ValueError: `batch` or `max_length` is not a positive int.
        """
        where = f"{type(self).__name__}.with_cache"
        shape = (positive_int(where, "batch", batch), positive_int(where, "max_length", max_length))
        with deep_recursion():
            result = copy.deepcopy(self)
        for _, module in Plan(result).modules:
            if isinstance(module, MultiHeadAttention):
                redeclare_cache(module, shape)
        result._declare_cache(shape)
        return result

    def __call__(
        self,
        ids: jax.Array,
        *,
        mask: jax.Array | None = None,
        decode: bool = False,
        logits_to_keep: int | None = None,
    ) -> jax.Array:
        """Logits ``(batch, length, vocab_size)`` of the next token at each position.

        Args:
            ids: Integer token ids ``(batch, length)``.
            mask: Bool ``(batch, length)``, True at real tokens (default: all); padding is
                the False entries, on the left for batched prompts.
            decode: Run these tokens after the cached ones and cache them (needs
                `decode_shape`): the prompt (prefill), then one token per call. A Python bool.
            logits_to_keep: Compute the logits of the last `logits_to_keep` positions only,
                ``(batch, min(logits_to_keep, length), vocab_size)``, as transformers'
                ``logits_to_keep`` (an int): None or 0 keeps all. The output layer is most
                of a long prompt's work, and a prefill for generation reads the last
                position alone (``logits_to_keep=1``). A Python int.

        Returns:
            The logits, in the compute dtype (float32 from a bfloat16 model only with
            ``dtype=jnp.float32``).

        Raises:
            TypeError, ValueError: `logits_to_keep` is not None or an int >= 0.
        """
        where = type(self).__name__
        static_flags(where, decode=decode)
        keep = _logits_to_keep(where, logits_to_keep)
        ids, mask = _check_inputs(where, ids, mask)
        batch, length = ids.shape
        if decode:
            positions, attention_mask = self._cache_step(batch, length, mask)
        elif mask is None:
            positions, attention_mask = jnp.arange(length, dtype=jnp.int32), None
        else:
            positions = _positions(mask, jnp.zeros((batch,), jnp.int32))
            attention_mask = mask[:, None, None, :]
        x = self.embed(ids)
        if self.config.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), jnp.float32).astype(x.dtype)
        x = self.layers(x, positions=positions, mask=attention_mask, decode=decode)
        if keep:  # before the norm and the output layer: only these positions' logits
            x = x[:, -keep:]
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.embed.attend(x)
        return self.lm_head(x)

    def _cache_step(
        self, batch: int, length: int, mask: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """This step's positions and key mask; writes the model's own part of the cache."""
        where = type(self).__name__
        if self.decode_shape is None:
            raise ValueError(
                f"{where}: decode=True needs a decoding cache, and this model has none. Make "
                f"a copy with one, model.with_cache(batch, max_length), and pass its cache "
                f"(lamina.models.init_cache(decoder)) with the variables to apply."
            )
        cache_batch, max_length = self.decode_shape
        if batch != cache_batch:
            raise ValueError(
                f"{where}: decode=True with a batch of {batch} sequences, but the cache holds "
                f"{cache_batch} (decode_shape={self.decode_shape}). Decode with "
                f"model.with_cache({batch}, max_length)."
            )
        index = self.cache_index.value
        if is_concrete(index) and not 0 <= int(index) <= max_length - length:
            raise ValueError(
                f"{where}: decoding past max_length: {int(index)} tokens are cached and this "
                f"call adds {length}, but the cache holds max_length={max_length} "
                f"(decode_shape={self.decode_shape}). Start again from a fresh cache "
                f"(lamina.models.init_cache), or decode with a larger model.with_cache(...)."
            )
        valid = jnp.ones((batch, length), jnp.bool_) if mask is None else mask
        counts = self.token_counts.value
        positions = _positions(valid, counts)
        zero = jnp.zeros((), jnp.int32)
        key_valid = lax.dynamic_update_slice(self.key_valid.value, valid, (zero, index))
        self.key_valid.value = key_valid
        self.token_counts.value = counts + jnp.sum(valid, axis=-1, dtype=jnp.int32)
        self.cache_index.value = index + length
        return positions, key_valid[:, None, None, :]


def _positions(valid: jax.Array, start: jax.Array) -> jax.Array:
    """Transformers' positions: ``start + cumsum(valid) - 1`` at real tokens, 0 at padding."""
    counted = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1 + start[:, None]
    return jnp.where(valid, counted, jnp.zeros_like(counted))


def _logits_to_keep(where: str, value: Any) -> int:
    """`logits_to_keep` as an int, 0 for all positions; checked."""
    if value is None:
        return 0
    if not is_int(value):
        raise TypeError(
            f"{where}: logits_to_keep must be a Python int (how many of the last positions "
            f"get logits; None or 0 for all), got {type(value).__name__} {value!r}. It sets "
            f"a shape: under jax.jit, make it static (static_argnames=('logits_to_keep',))."
        )
    if value < 0:
        raise ValueError(
            f"{where}: logits_to_keep must be >= 0 (how many of the last positions get "
            f"logits; None or 0 for all), got {value}."
        )
    return int(value)


def _check_inputs(where: str, ids: Any, mask: Any) -> tuple[jax.Array, jax.Array | None]:
    """`ids` as an integer ``(batch, length)`` array and `mask` as bool of its shape."""
    if not hasattr(ids, "dtype"):
        try:
            ids = jnp.asarray(ids)
        except TypeError:
            raise TypeError(
                f"{where} takes integer token ids (batch, length), got {type(ids).__name__}."
            ) from None
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{where} takes integer token ids, got dtype {ids.dtype}; convert with "
            f"ids.astype(jnp.int32)."
        )
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(
            f"{where} takes token ids of shape (batch, length) with length >= 1, got shape "
            f"{tuple(ids.shape)}; for one sequence pass ids[None]."
        )
    if mask is None:
        return ids, None
    if not hasattr(mask, "dtype"):
        mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{where}: mask must be bool (True at real tokens), got dtype {mask.dtype}; a 0/1 "
            f"attention mask (a tokenizer's) is mask.astype(bool)."
        )
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"{where}: mask must have the ids' shape {tuple(ids.shape)}, got {tuple(mask.shape)}."
        )
    return ids, mask


def _decode_shape(shape: Any) -> tuple[int, int]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = ()
    if len(dims) != 2 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in dims):
        raise ValueError(
            f"CausalLM: decode_shape must be (batch, max_length), two positive ints; got {shape!r}."
        )
    return int(dims[0]), int(dims[1])


def init_cache(model: Module) -> dict[str, Any]:
    """The decoding cache of `model` as zeros: ``{"cache": {...}}``, no initializer run.

    Shapes and dtypes come from the model's plan (``decode_shape`` of its layers), so this
    is cheap for any size of model. Pass it with the parameters to apply:
    ``apply({**variables, **init_cache(decoder)}, None, prompt, decode=True)``; a fresh one
    starts a new sequence.

    Raises:
        ValueError: The model declares no cache (build it with ``decode_shape``, or
            ``model.with_cache(batch, max_length)``).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> from lamina.models import init_cache
        >>> mha = lm.MultiHeadAttention(2, 8, decode_shape=(3, 5))
        >>> jax.tree.map(jnp.shape, init_cache(mha))
        {'cache': {'cache_index': (), 'cached_key': (3, 5, 2, 4), 'cached_value': (3, 5, 2, 4)}}
    """
    if not isinstance(model, Module):
        raise TypeError(f"init_cache takes an lm.Module, got {type(model).__name__}.")
    cache: dict[str, Any] = {}
    for entry in Plan(model).variables:
        if entry.collection != "cache":
            continue
        node = cache
        for key in entry.key[1:-1]:
            node = node.setdefault(key, {})
        node[entry.key[-1]] = jnp.zeros(entry.shape, entry.state.param_dtype)
    if not cache:
        raise ValueError(
            f"init_cache: this {type(model).__name__} declares no decoding cache. Build it "
            f"with decode_shape=(batch, max_length) (a CausalLM: model.with_cache(batch, "
            f"max_length))."
        )
    return {"cache": cache}
