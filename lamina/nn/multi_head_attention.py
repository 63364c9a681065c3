"""`MultiHeadAttention`: Flax Linen's ``MultiHeadDotProductAttention``.

The variables and numerics are Linen's, so Linen's variables, its ``"cache"`` collection
included, load directly. The attention itself is the layer's ``attention_fn``, by default
`dot_product_attention`: the layer projects the inputs to heads (one compiled call),
normalises the queries and keys (``qk_norm``), rotates them (``rope``), updates the cache
and builds the mask (one call), attends, and projects the heads back (one call); under
`jax.jit` the steps compile into one program. The options of Llama-family models
(grouped-query heads, RoPE, RMS q/k norms, sliding windows, `jax.nn.dot_product_attention`)
are keyword-only and off by default.

Incremental decoding. lamina declares every shape up front, so the decoding cache is sized
when the layer is built: ``MultiHeadAttention(..., decode_shape=(batch, max_length))``
declares three `Cache` variables (collection ``"cache"``, Linen's names and layout):

- ``cached_key`` and ``cached_value``: ``(*batch, max_length, num_kv_heads, head_dim)``, in the
  compute dtype (with ``dtype=None``, in ``param_dtype``; keys and values are cast to it when
  written), zeros at `init`;
- ``cache_index``: an int32 scalar, the number of positions written so far.

``layer(x, decode=True)`` then writes the keys and values of `x`'s positions at
``cache_index``, advances it, and returns the outputs of those positions, each attending to
the cached positions up to and including its own. A step may hold one position (Linen's
decoding) or several (a prompt, in one call): decoding a sequence in steps gives the outputs
of the full ``causal=True`` pass. To start a new sequence, use fresh ``"cache"`` variables
(from `init`, or zeros).

A step that would go past ``max_length`` is an error, never a result (Linen silently
overwrites the last position). When the index is concrete (eager calls) it raises
`ValueError` before anything runs. Under `jax.jit` (or `jax.vmap`, `lax.scan`) the index is
traced, so the program checks it when it runs: a step that overflows calls back to the host
(`jax.debug.callback`, only then: a step that fits costs one comparison) and the call fails
with a `jax.errors.JaxRuntimeError` (a `RuntimeError`) whose message holds the same
"decoding past max_length" text; where dispatch is asynchronous (accelerators) it may surface
at the first use of the result. As a last guard, the outputs of such a step are NaN and the
cached keys and values are left unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import FrozenParam, Parameter, State
from . import _checks, _dtypes
from . import attention_setup as setup
from ._projections import Projection, dense_general, project_heads_out, project_qkv
from .attention import check_broadcast, check_key, check_mask, dot_product_attention
from .attention_arguments import function_name
from .attention_decoding import cache_and_mask, check_cache_kind, check_decoding_step
from .attention_fused import attend
from .layer_normalization import LayerNorm, RMSNorm


class MultiHeadAttention(Module):
    """Multi-head dot-product attention, Flax Linen's ``MultiHeadDotProductAttention``.

    Projects the queries to ``num_heads`` heads of ``head_dim = qkv_size // num_heads``
    features and the keys and values to `num_kv_heads` heads (all by default), attends
    (`dot_product_attention`) and projects the heads back to ``out_size``. Variables are
    Linen's: submodules ``query`` (``kernel`` ``(in_size, num_heads, head_dim)``, ``bias``
    ``(num_heads, head_dim)``), ``key`` and ``value`` (``(key_size, num_kv_heads,
    head_dim)``, ``(num_kv_heads, head_dim)``) and ``out`` (``kernel`` ``(num_heads,
    head_dim, out_size)``, ``bias`` ``(out_size,)``); with `decode_shape`, the cache
    ``cached_key``, ``cached_value`` and ``cache_index`` (see the module's documentation).

    Cross-attention: the keys and values may come from other inputs, whose feature sizes
    (`key_size`, `value_size`) are declared here because the key and value kernels
    are sized by them.

    Args:
        num_heads: Number of (query) heads; must divide `qkv_size`.
        in_size: Feature size of the queries' input (``inputs_q.shape[-1]``).
        qkv_size: Total size of the projected queries, keys and values (default
            `in_size`).
        out_size: Size of the output's last axis (default `in_size`).
        key_size: Feature size of ``inputs_k`` (default `in_size`).
        value_size: Feature size of ``inputs_v`` (default `key_size`).
        num_kv_heads: Number of key and value heads (default `num_heads`); a divisor of
            `num_heads` gives grouped-query attention (1: multi-query), query head ``h``
            using key/value head ``h // (num_heads // num_kv_heads)`` as Hugging Face's.
        head_dim: Features per head; default ``qkv_size // num_heads``. Given, `qkv_size`
            defaults to ``num_heads * head_dim`` (which may differ from `in_size`, as in
            Qwen3 and Gemma) and must equal it.
        dropout_rate: Dropout on the attention weights while training, in ``[0, 1)``.
        use_bias: Whether the four projections add a bias.
        out_use_bias: Whether the output projection adds one (default `use_bias`; Qwen2:
            ``use_bias=True, out_use_bias=False``).
        kernel_init: Initializer of the projection kernels, called (as Linen's) with the
            kernel seen as a ``(fan_in, fan_out)`` matrix.
        bias_init: Initializer of the biases.
        out_kernel_init: Initializer of the output kernel (default `kernel_init`).
        out_bias_init: Initializer of the output bias (default `bias_init`).
        kernel_sharding: Logical axis names of the query, key and value kernels, ``(in,
            heads, head_dim)``, e.g. ``("embed", "heads", "kv")`` (for `lm.shardings`; None:
            replicated). The three share one layout, as they share `kernel_init`.
        bias_sharding: Logical axis names of their biases, ``(heads, head_dim)``.
        out_kernel_sharding: Logical axis names of the output kernel, ``(heads, head_dim,
            out)``, e.g. ``("heads", "kv", "embed")``. Not derived from `kernel_sharding`
            (its axes are in another order): None replicates it.
        out_bias_sharding: Logical axis name of the output bias, ``(out,)``. (The small
            q/k norm scales and the decoding cache are not named: replicated.)
        kv_kernel_sharding: Logical axis names of the key and value kernels, e.g.
            ``("embed", "kv_heads", None)`` (default `kernel_sharding`).
        kv_bias_sharding: Logical axis names of their biases (default `bias_sharding`).
        dtype: Compute dtype (inputs, variables and cache are used in it); None computes
            each step in the promotion of its operands, as Linen's default: each projection
            in that of its input and variables, the attention in that of the queries, keys
            and values (bfloat16 stays bfloat16, complex stays complex).
        param_dtype: Storage dtype of the parameters (default: `dtype`, float32 when `dtype`
            is None); with ``dtype=None`` also the dtype of the decoding cache.
        precision: `jax.lax.Precision` of the products.
        broadcast_dropout: One dropout mask shared by the batch and the heads (Linen's).
        force_fp32_for_softmax: Compute the softmax in float32 when `dtype` is lower.
        attention_fn: The attention of the projected heads, ``attention_fn(query, key,
            value, **options) -> (batch..., q_length, num_heads, head_dim)``; default
            `dot_product_attention`. It gets the options its signature names, among lamina's
            (``mask``, ``dropout_rng``, ``dropout_rate``, ``broadcast_dropout``,
            ``is_training``, ``dtype``, ``precision``, ``force_fp32_for_softmax``,
            ``sow_weights``) and Linen's (``deterministic``, and ``module``, an object whose
            ``sow(collection, name, value)`` records with `lm.sow`): lamina's functions and
            Linen's (``flax.linen.dot_product_attention``) both work. A ``**kwargs`` gets
            nothing, as in Linen. A call whose mask, dropout or `sow_weights` the function
            cannot take is an error, not silently dropped. With `num_kv_heads` <
            `num_heads`, a function other than `dot_product_attention` gets the keys and
            values repeated to `num_heads` heads.
        normalize_qk: Layer-normalise the queries and keys of each head before the product
            (Linen's ``normalize_qk``, from ViT-22B): ``qk_norm="layer"``.
        qk_norm: Normalise each head's queries and keys: None; ``"layer"``: submodules
            ``query_ln`` and ``key_ln``, `LayerNorm` of `head_dim` features without a bias;
            ``"rms"``: ``query_norm`` and ``key_norm``, `RMSNorm` scaling in the input dtype
            (``scale_in_input_dtype=True``), as Qwen3.
        qk_norm_eps: The epsilon of those norms.
        rope: A `RotaryEmbedding` of `head_dim` (submodule ``rope``) rotating the queries
            and keys, after their norms, by the call's ``positions``; None: no rotation.
        sliding_window: ``w``: a query at position (cache slot, when decoding) ``q`` sees
            only the keys at ``k > q - w`` (itself and the ``w - 1`` before it; Mistral's).
            It bounds the past keys only, so calls need ``causal=True`` or `decode` (else a
            `ValueError`); for a two-sided window, pass a `mask` instead.
        implementation: None: attend with `attention_fn`; ``"xla"`` or ``"cudnn"``: call
            `jax.nn.dot_product_attention` with that implementation (cuDNN's fused attention
            needs a GPU and float16/bfloat16). It needs the default `attention_fn`, no
            `precision`, and per call no dropout while training and no `sow_weights`:
            otherwise a `ValueError` names what stands in the way. Its softmax is always in
            float32; in float32 it matches None within about 1e-6, not bit for bit.
        decode_shape: ``(*batch, max_length)``: declares the decoding cache for inputs with
            that batch shape and up to `max_length` positions. None: no cache, and calls
            with ``decode=True`` are an error.

    Attention weights: ``layer(x, sow_weights=True)`` records them (before dropout) as
    ``"attention_weights"`` in the ``"intermediates"`` collection under the layer's path, as
    Linen's ``sow_weights``; they come back when the caller of `apply` asks for that
    collection. The option stays (rather than recording always, as an unrequested `lm.sow`
    would cost nothing) so that asking for ``"intermediates"`` does not also return the
    ``(batch, heads, q_length, kv_length)`` weights of every attention layer of a model.

    Everything after `in_size` is keyword-only. Linen's names differ: ``qkv_features``,
    ``out_features`` are `qkv_size`, `out_size` here, and Linen infers the input sizes
    (`in_size`, `key_size`, `value_size`) that lamina declares.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> mha = lm.MultiHeadAttention(num_heads=2, in_size=8)
        >>> init, apply = lm.transform(mha)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["query"]["kernel"].shape
        (8, 2, 4)
        >>> x = jnp.ones((3, 5, 8))  # (batch, length, features)
        >>> y, _ = apply(variables, None, x, causal=True)
        >>> y.shape
        (3, 5, 8)

        Decoding one position at a time, with a cache for batch 3 and 5 positions:

        >>> mha = lm.MultiHeadAttention(num_heads=2, in_size=8, decode_shape=(3, 5))
        >>> init, apply = lm.transform(mha)
        >>> variables = init(jax.random.key(0))
        >>> y0, variables = apply(variables, None, x[:, :1], decode=True)
        >>> int(variables["cache"]["cache_index"]), y0.shape
        (1, (3, 1, 8))

        Grouped-query attention (2 key/value heads for 4 query heads) with RoPE:

        >>> rope = lm.RotaryEmbedding(4)
        >>> mha = lm.MultiHeadAttention(4, 8, num_kv_heads=2, head_dim=4, rope=rope)
        >>> variables = lm.transform(mha)[0](jax.random.key(0))
        >>> variables["params"]["key"]["kernel"].shape
        (8, 2, 4)

        The attention weights, recorded on request:

        >>> mha = lm.MultiHeadAttention(num_heads=2, in_size=8, normalize_qk=True)
        >>> init, apply = lm.transform(mha)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"])
        ['key', 'key_ln', 'out', 'query', 'query_ln', 'value']
        >>> y, new = apply({**variables, "intermediates": {}}, None, x, sow_weights=True)
        >>> [w.shape for w in new["intermediates"]["attention_weights"]]
        [(3, 2, 5, 5)]
    """

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

    num_heads = _checks.Setting()
    in_size = _checks.Setting()
    qkv_size = _checks.Setting()
    out_size = _checks.Setting()
    key_size = _checks.Setting()
    value_size = _checks.Setting()
    head_dim = _checks.Setting()
    dropout_rate = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()
    broadcast_dropout = _checks.Setting()
    force_fp32_for_softmax = _checks.Setting()
    attention_fn = _checks.Setting()
    normalize_qk = _checks.Setting()
    decode_shape = _checks.Setting()
    num_kv_heads = _checks.Setting()
    qk_norm = _checks.Setting()
    qk_norm_eps = _checks.Setting()
    out_use_bias = _checks.Setting()
    sliding_window = _checks.Setting()
    implementation = _checks.Setting()

    # Submodules and the cache, declared by attention_setup (None when absent; the cache's
    # three `Cache` declarations are Any: read only when decoding).
    query: Any
    key: Any
    value: Any
    out: Any
    query_ln: LayerNorm | None
    key_ln: LayerNorm | None
    query_norm: RMSNorm | None
    key_norm: RMSNorm | None
    rope: Any
    cached_key: Any
    cached_value: Any
    cache_index: Any

    def __init__(
        self,
        num_heads: int,
        in_size: int,
        *,
        qkv_size: int | None = None,
        out_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dropout_rate: float = 0.0,
        use_bias: bool = True,
        out_use_bias: bool | None = None,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        out_kernel_init: Initializer | None = None,
        out_bias_init: Initializer | None = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
        out_kernel_sharding: Sequence[str | None] | None = None,
        out_bias_sharding: Sequence[str | None] | None = None,
        kv_kernel_sharding: Sequence[str | None] | None = None,
        kv_bias_sharding: Sequence[str | None] | None = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        broadcast_dropout: bool = True,
        force_fp32_for_softmax: bool = False,
        attention_fn: Callable[..., jax.Array] = dot_product_attention,
        normalize_qk: bool = False,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        rope: Module | None = None,
        sliding_window: int | None = None,
        implementation: str | None = None,
        decode_shape: Sequence[int] | None = None,
    ):
        super().__init__()
        setup.set_sizes(
            self,
            num_heads,
            in_size,
            qkv_size,
            out_size,
            key_size,
            value_size,
            num_kv_heads,
            head_dim,
        )
        setup.set_options(
            self,
            dropout_rate,
            use_bias,
            dtype,
            param_dtype,
            precision,
            broadcast_dropout,
            force_fp32_for_softmax,
            attention_fn,
        )
        setup.set_modern_options(
            self, normalize_qk, qk_norm, qk_norm_eps, out_use_bias, sliding_window, implementation
        )
        setup.declare_projections(
            self,
            (kernel_init, bias_init, out_kernel_init, out_bias_init),
            (
                kernel_sharding,
                bias_sharding,
                out_kernel_sharding,
                out_bias_sharding,
                kv_kernel_sharding,
                kv_bias_sharding,
            ),
        )
        setup.declare_qk_norms(self)
        setup.declare_rope(self, rope)
        setup.declare_cache(self, decode_shape)

    @property
    def max_length(self) -> int | None:
        """The number of positions the decoding cache holds (None without a cache)."""
        return None if self.decode_shape is None else self.decode_shape[-1]

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        causal: bool = False,
        is_training: bool = False,
        decode: bool = False,
        dropout_rng: Any = None,
        sow_weights: bool = False,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Attends from `inputs_q` to `inputs_k`/`inputs_v` (self-attention when omitted).

        The steps: project to heads, normalise the queries and keys (`qk_norm`), rotate them
        (`rope`, by `positions`), write the keys and values to the cache (`decode`), attend,
        project the heads back.

        Args:
            inputs_q: ``(batch..., q_length, in_size)``.
            inputs_k: ``(batch..., kv_length, key_size)``; default `inputs_q`.
            inputs_v: ``(batch..., kv_length, value_size)``; default `inputs_k`.
            mask: A bool array broadcastable to ``(batch..., num_heads, q_length,
                kv_length)`` (with ``decode=True``, kv_length is ``max_length``: a
                ``(batch, 1, 1, max_length)`` mask marks the valid cache slots, e.g. not the
                left padding of a prompt); True keeps a pair. It is AND-ed with the causal,
                cache and window masks. Masks of other dtypes are an error: a 0/1 mask is
                ``mask.astype(bool)``, an additive one (0 keeps, -inf drops) is ``mask == 0``.
            causal: Also keep only the pairs with key position <= query position (positions
                count from the start of both sequences). Implied by `decode`.
            is_training: Apply dropout to the attention weights. A Python bool.
            decode: Write this step's keys and values to the cache at ``cache_index`` and
                attend to the cache (needs `decode_shape`). A Python bool.
            dropout_rng: The key of the dropout (Linen's ``dropout_rng``); default
                ``lm.next_rng_key("dropout")``. Used only while training.
            sow_weights: Record the attention weights (before dropout) as
                ``"attention_weights"`` in the ``"intermediates"`` collection, kept when the
                caller of `apply` asks for it (``{**variables, "intermediates": {}}``).
            positions: The positions `rope` rotates the queries and keys by: integers
                broadcastable to ``(batch..., q_length)`` along the batch axes (``(q_length,)``,
                or Hugging Face's ``(1, q_length)``). Default: ``0, 1, ...`` (plus
                ``cache_index`` with ``decode=True``); a left-padded batch passes each row's
                own (Hugging Face's ``cumsum(mask) - 1``). Only with `rope`.

        Returns:
            ``(batch..., q_length, out_size)``.
        """
        name = type(self).__name__
        _checks.static_flags(
            name, causal=causal, is_training=is_training, decode=decode, sow_weights=sow_weights
        )
        setup.check_window_call(self, causal, decode)
        inputs = self._inputs(inputs_q, inputs_k, inputs_v)
        q_shape, k_shape = tuple(jnp.shape(inputs[0])), tuple(jnp.shape(inputs[1]))
        batch, q_len = q_shape[:-2], q_shape[-2]
        cache = None
        kv_len = k_shape[-2]
        if decode:
            cache = self._cache_for_step(batch, q_len, k_shape)
            kv_len = self.decode_shape[-1]
        if mask is not None:
            check_mask(name, mask)
            weights_shape = (*batch, self.num_heads, q_len, kv_len)
            check_broadcast(name, "mask", jnp.shape(mask), weights_shape)
        if dropout_rng is not None:
            check_key(name, "dropout_rng", dropout_rng)
        positions = setup.checked_positions(self, positions, batch, q_len, k_shape[-2], cache)

        query, key, value = self._project_inputs(inputs)
        query, key = self._normalized(query, key)
        if self.rope is not None:
            query, key = self.rope(query, positions), self.rope(key, positions)
        fits = None
        if cache is not None:
            check_cache_kind(self, key, value)
        window = self.sliding_window
        if cache is not None or causal or mask is not None or window is not None:
            key, value, mask, new_cache, fits = cache_and_mask(
                key, value, mask, cache, q_len, causal and not decode, window
            )
            if new_cache is not None:
                self.cached_key.value, self.cached_value.value, self.cache_index.value = new_cache
        x = attend(self, query, key, value, mask, is_training, dropout_rng, sow_weights)
        return self._project_output(x, (*batch, q_len), fits)

    def _normalized(self, query: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The queries and keys normalised per head (`qk_norm`), or as they are."""
        if self.query_ln is not None and self.key_ln is not None:
            return self.query_ln(query), self.key_ln(key)
        if self.query_norm is not None and self.key_norm is not None:
            return self.query_norm(query), self.key_norm(key)
        return query, key

    def _inputs(
        self, inputs_q: jax.Array, inputs_k: jax.Array | None, inputs_v: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The queries', keys' and values' inputs (defaults filled in), their shapes checked."""
        name = type(self).__name__
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(
                    f"{name}: inputs_v was given without inputs_k. Pass inputs_k too; to use "
                    f"the same array for keys and values, pass it as inputs_k alone."
                )
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        q_shape = _check_input("inputs_q", inputs_q, "in_size", self.in_size)
        k_shape = _check_input("inputs_k", inputs_k, "key_size", self.key_size)
        v_shape = _check_input("inputs_v", inputs_v, "value_size", self.value_size)
        batch = q_shape[:-2]
        if not k_shape[:-2] == v_shape[:-2] == batch:
            raise ValueError(
                f"{name}: inputs_q, inputs_k and inputs_v must have the same batch shape "
                f"(all axes but the last two); got shapes {q_shape}, {k_shape} and {v_shape}."
            )
        if k_shape[-2] != v_shape[-2]:
            raise ValueError(
                f"{name}: inputs_k and inputs_v must have the same length (axis -2); got "
                f"shapes {k_shape} and {v_shape}."
            )
        return inputs_q, inputs_k, inputs_v

    def _project_inputs(
        self, inputs: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, ...]:
        """The queries, keys and values in heads: ``(batch..., length, heads, head_dim)``.

        The queries have `num_heads` heads, the keys and values `num_kv_heads`.
        """
        layers = (self.query, self.key, self.value)
        kv_heads = (self.num_kv_heads, self.head_dim)
        heads = ((self.num_heads, self.head_dim), kv_heads, kv_heads)
        if all(_own_projection(layer) for layer in layers):
            # The fused path (one compiled call for the three): only for the layer's own
            # projections, whose computation it provably is.
            projections = tuple(self._arrays(name) for name in ("query", "key", "value"))
            # Each projection computes in its own dtype, as Linen's DenseGeneral (dtype=None:
            # the promotion of its input and variables).
            dtypes = tuple(
                _dtypes.compute_dtype(self, self.dtype, x, *p)
                for x, p in zip(inputs, projections, strict=True)
            )
            return project_qkv(inputs, projections, dtypes, self.precision)
        names = ("query", "key", "value")
        return tuple(
            self._projected(name, layer, x, 1, (*jnp.shape(x)[:-1], *shape))
            for name, layer, x, shape in zip(names, layers, inputs, heads, strict=True)
        )

    def _project_output(
        self, x: jax.Array, positions: tuple[int, ...], fits: jax.Array | None
    ) -> jax.Array:
        """The output projection of the heads `x` (checked: `attention_fn` returned them).

        `positions` is ``(*batch, q_length)``; the outputs are NaN where a decoding step
        overflowed the cache (`fits` False).
        """
        name = type(self).__name__
        expected = (*positions, self.num_heads, self.head_dim)
        if tuple(jnp.shape(x)) != expected:
            raise ValueError(
                f"{name}: attention_fn={function_name(self.attention_fn)} returned shape "
                f"{tuple(jnp.shape(x))}, but the output projection takes the heads' shape "
                f"(batch..., q_length, num_heads, head_dim) = {expected}. An attention_fn "
                f"returns one vector per query position and head, as "
                f"lm.dot_product_attention."
            )
        if not _own_projection(self.out):
            out = self._projected("out", self.out, x, 2, (*positions, self.out_size))
            return out if fits is None else jnp.where(fits, out, jnp.nan)
        kernel, bias = self._arrays("out")
        dtype = _dtypes.compute_dtype(self, self.dtype, x, kernel, bias)
        return project_heads_out(x, kernel, bias, fits, dtype, self.precision)

    def _projected(
        self, name: str, layer: Any, x: jax.Array, n_contract: int, expected: tuple[int, ...]
    ) -> jax.Array:
        """One projection: the layer's own, or a module put in its place, called as a module.

        A replaced projection (e.g. ``mha.query = lm.DenseGeneral(...)``, or a LoRA-style
        wrapper of the user's) is called, never read for a ``kernel``: its computation is its
        own. Its output must have the shape the attention takes.
        """
        if _own_projection(layer):
            kernel, bias = self._arrays(name)
            dtype = _dtypes.compute_dtype(self, self.dtype, x, kernel, bias)
            return dense_general(x, kernel, bias, n_contract, dtype, self.precision)
        if not callable(layer):
            raise TypeError(
                f"{_dtypes.layer_name(self)}: its {name!r} projection was replaced by a "
                f"{type(layer).__name__}, which cannot be called. Put a module that maps "
                f"{tuple(jnp.shape(x))} to {expected} there (e.g. lm.DenseGeneral)."
            )
        y = layer(x)
        if tuple(jnp.shape(y)) != expected:
            raise ValueError(
                f"{_dtypes.layer_name(self)}: its {name!r} projection, a "
                f"{type(layer).__name__} put in place of the layer's own, maps an input of shape "
                f"{tuple(jnp.shape(x))} to "
                f"{tuple(jnp.shape(y))}, but the attention needs {expected}. Give it the "
                f"output shape of the projection it replaces."
            )
        return y

    def _arrays(self, name: str) -> tuple[jax.Array, jax.Array | None]:
        """The kernel and bias of the projection `name`, the layer's own `Projection`.

        They are read, not called: the kernel must still be exactly a `Parameter` (or
        `FrozenParam`) of the shape the layer built (a replaced one of another shape would
        change the heads' shape silently), the bias none or one of its shape.
        """
        layer = getattr(self, name)
        heads = (self.num_heads if name in ("query", "out") else self.num_kv_heads, self.head_dim)
        sizes = {"query": self.in_size, "key": self.key_size, "value": self.value_size}
        if name == "out":
            shapes: tuple[tuple[int, ...], tuple[int, ...]] = (
                (*heads, self.out_size),
                (self.out_size,),
            )
        else:
            shapes = ((sizes[name], *heads), heads)
        own = layer.__dict__
        kernel, bias = own.get("kernel"), own.get("bias")
        for what, declaration, shape in (("kernel", kernel, shapes[0]), ("bias", bias, shapes[1])):
            if what == "bias" and declaration is None:
                continue
            if type(declaration) not in (Parameter, FrozenParam) or declaration.shape != shape:
                got = (
                    f"a {type(declaration).__name__} of shape {declaration.shape}"
                    if isinstance(declaration, State)
                    else f"{type(declaration).__name__}"
                )
                raise ValueError(
                    f"{_dtypes.layer_name(self)}: its {name!r} projection's {what} is {got}, but "
                    f"the layer reads it as a Parameter of shape {shape}. Put back a "
                    f"Parameter of that shape (or None for the bias), or replace the whole "
                    f"projection by a module (e.g. mha.{name} = lm.DenseGeneral(...))."
                )
        return layer.arrays()

    def _cache_for_step(
        self, batch: tuple[int, ...], q_len: int, k_shape: tuple[int, ...]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The cached keys and values and the index, once the step is checked to fit."""
        index = check_decoding_step(self, batch, q_len, k_shape)
        return self.cached_key.value, self.cached_value.value, index


def _own_projection(layer: Any) -> bool:
    """Whether `layer` is a `Projection` the layer reads (under a policy's boundary too)."""
    return getattr(type(layer), "_lamina_unwrapped", type(layer)) is Projection


def _check_input(arg: str, x: Any, setting: str, expected: int) -> tuple[int, ...]:
    shape = tuple(jnp.shape(x))
    if len(shape) < 2:
        raise ValueError(
            f"MultiHeadAttention: {arg} must have shape (batch..., length, features), got "
            f"shape {shape}; add a length axis for a single position."
        )
    return _checks.check_last_axis("MultiHeadAttention", x, expected, setting, what=arg)
