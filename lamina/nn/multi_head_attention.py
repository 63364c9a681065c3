"""`MultiHeadAttention`: Flax Linen's ``MultiHeadDotProductAttention``.

The variables and numerics are Linen's, so Linen's variables, its ``"cache"`` collection
included, load directly. The attention itself is the layer's ``attention_fn``, by default
`dot_product_attention`: the layer projects the inputs to heads (one compiled call),
normalises the queries and keys (``normalize_qk``), updates the cache and builds the mask
(one call), attends, and projects the heads back (one call); under `jax.jit` the steps
compile into one program.

Incremental decoding. lamina declares every shape up front, so the decoding cache is sized
when the layer is built: ``MultiHeadAttention(..., decode_shape=(batch, max_length))``
declares three `Cache` variables (collection ``"cache"``, Linen's names and layout):

- ``cached_key`` and ``cached_value``: ``(*batch, max_length, num_heads, head_dim)``, in the
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
from .._core.variables import Cache, FrozenParam, Parameter, State
from . import _checks, _dtypes
from ._projections import Projection, dense_general, project_heads_out, project_qkv
from .attention import check_broadcast, check_key, check_mask, dot_product_attention
from .attention_arguments import accepted_arguments, call_attention_fn, function_name
from .attention_decoding import (
    cache_and_mask,
    check_cache_kind,
    check_decoding_step,
    checked_decode_shape,
)
from .layer_normalization import LayerNorm


class MultiHeadAttention(Module):
    """Multi-head dot-product attention, Flax Linen's ``MultiHeadDotProductAttention``.

    Projects the queries, keys and values to ``num_heads`` heads of ``head_dim =
    qkv_size // num_heads`` features, attends (`dot_product_attention`) and projects the
    heads back to ``out_size``. Variables are Linen's: submodules ``query``, ``key`` and
    ``value`` (``kernel`` ``(in_size, num_heads, head_dim)``, ``bias`` ``(num_heads,
    head_dim)``) and ``out`` (``kernel`` ``(num_heads, head_dim, out_size)``, ``bias``
    ``(out_size,)``); with `decode_shape`, the cache ``cached_key``, ``cached_value`` and
    ``cache_index`` (see the module's documentation for incremental decoding).

    Cross-attention: the keys and values may come from other inputs, whose feature sizes
    (`key_size`, `value_size`) are declared here because the key and value kernels
    are sized by them.

    Args:
        num_heads: Number of heads; must divide `qkv_size`.
        in_size: Feature size of the queries' input (``inputs_q.shape[-1]``).
        qkv_size: Total size of the projected queries, keys and values (default
            `in_size`).
        out_size: Size of the output's last axis (default `in_size`).
        key_size: Feature size of ``inputs_k`` (default `in_size`).
        value_size: Feature size of ``inputs_v`` (default `key_size`).
        dropout_rate: Dropout on the attention weights while training, in ``[0, 1)``.
        use_bias: Whether the four projections add a bias.
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
            ``query_ln``/``key_ln`` scales and the decoding cache are not named: replicated.)
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
            cannot take is an error, not silently dropped.
        normalize_qk: Layer-normalise the queries and keys of each head before the product
            (Linen's ``normalize_qk``, from ViT-22B): submodules ``query_ln`` and ``key_ln``,
            `LayerNorm` of `head_dim` features without a bias.
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

    def __init__(
        self,
        num_heads: int,
        in_size: int,
        *,
        qkv_size: int | None = None,
        out_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        dropout_rate: float = 0.0,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        out_kernel_init: Initializer | None = None,
        out_bias_init: Initializer | None = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
        out_kernel_sharding: Sequence[str | None] | None = None,
        out_bias_sharding: Sequence[str | None] | None = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        broadcast_dropout: bool = True,
        force_fp32_for_softmax: bool = False,
        attention_fn: Callable[..., jax.Array] = dot_product_attention,
        normalize_qk: bool = False,
        decode_shape: Sequence[int] | None = None,
    ):
        super().__init__()
        self._set_sizes(num_heads, in_size, qkv_size, out_size, key_size, value_size)
        self._set_options(
            dropout_rate,
            use_bias,
            dtype,
            param_dtype,
            precision,
            broadcast_dropout,
            force_fp32_for_softmax,
            attention_fn,
            normalize_qk,
        )
        self._declare_projections(
            (kernel_init, bias_init, out_kernel_init, out_bias_init),
            (kernel_sharding, bias_sharding, out_kernel_sharding, out_bias_sharding),
        )
        self._declare_qk_norms()
        self._declare_cache(decode_shape)

    def _set_sizes(
        self,
        num_heads: int,
        in_size: int,
        qkv_size: int | None,
        out_size: int | None,
        key_size: int | None,
        value_size: int | None,
    ) -> None:
        """Checks and sets the number of heads and the sizes (defaults: `in_size`), `head_dim`."""
        name = type(self).__name__
        self.num_heads = _checks.positive_int(name, "num_heads", num_heads)
        self.in_size = _checks.positive_int(name, "in_size", in_size)

        def size(setting: str, value: Any, default: int) -> int:
            return _checks.positive_int(name, setting, default if value is None else value)

        self.qkv_size = size("qkv_size", qkv_size, self.in_size)
        self.out_size = size("out_size", out_size, self.in_size)
        self.key_size = size("key_size", key_size, self.in_size)
        self.value_size = size("value_size", value_size, self.key_size)
        if self.qkv_size % self.num_heads:
            raise ValueError(
                f"{name}: qkv_size={self.qkv_size} is not divisible by "
                f"num_heads={self.num_heads}; each head gets qkv_size // num_heads "
                f"features, so choose qkv_size as a multiple of num_heads."
            )
        self.head_dim = self.qkv_size // self.num_heads

    def _set_options(
        self,
        dropout_rate: float,
        use_bias: bool,
        dtype: Dtype,
        param_dtype: Dtype,
        precision: PrecisionLike,
        broadcast_dropout: bool,
        force_fp32_for_softmax: bool,
        attention_fn: Callable[..., jax.Array],
        normalize_qk: bool,
    ) -> None:
        """Checks and sets the options of the attention: dropout, dtypes, `attention_fn`..."""
        name = type(self).__name__
        self.dropout_rate = _checks.non_negative(name, "dropout_rate", dropout_rate, below=1.0)
        self.use_bias = _checks.flag(name, "use_bias", use_bias)
        self.dtype = _dtypes.layer_dtype(name, dtype)
        self.param_dtype = _dtypes.storage_dtype(name, param_dtype, self.dtype)
        self.precision = _checks.precision(name, precision)
        self.broadcast_dropout = _checks.flag(name, "broadcast_dropout", broadcast_dropout)
        self.force_fp32_for_softmax = _checks.flag(
            name, "force_fp32_for_softmax", force_fp32_for_softmax
        )
        self.attention_fn = _checks.function(
            name, "attention_fn", attention_fn, "lm.dot_product_attention"
        )
        accepted_arguments(name, self.attention_fn)  # its signature must be readable
        self.normalize_qk = _checks.flag(name, "normalize_qk", normalize_qk)

    def _declare_projections(
        self,
        inits: tuple[Initializer, Initializer, Initializer | None, Initializer | None],
        shardings: tuple[Sequence[str | None] | None, ...],
    ) -> None:
        """Declares the ``query``, ``key``, ``value`` and ``out`` projections (Linen's).

        `inits` is ``(kernel_init, bias_init, out_kernel_init, out_bias_init)``, the output's
        None for the others'; `shardings` the four shardings in that order.
        """
        name = type(self).__name__
        kernel_init, bias_init, out_kernel_init, out_bias_init = inits
        kernel_sharding, bias_sharding, out_kernel_sharding, out_bias_sharding = shardings
        kernel_init = _checks.initializer(name, "kernel_init", kernel_init)
        bias_init = _checks.initializer(name, "bias_init", bias_init)
        out_kernel_init = kernel_init if out_kernel_init is None else out_kernel_init
        out_kernel_init = _checks.initializer(name, "out_kernel_init", out_kernel_init)
        out_bias_init = bias_init if out_bias_init is None else out_bias_init
        out_bias_init = _checks.initializer(name, "out_bias_init", out_bias_init)
        use_bias, dtype, param_dtype = self.use_bias, self.dtype, self.param_dtype

        heads = (self.num_heads, self.head_dim)
        kernel_names = _checks.sharding(name, "kernel_sharding", kernel_sharding, 3)
        bias_names = _checks.sharding(name, "bias_sharding", bias_sharding, 2)
        out_kernel_names = _checks.sharding(name, "out_kernel_sharding", out_kernel_sharding, 3)
        out_bias_names = _checks.sharding(name, "out_bias_sharding", out_bias_sharding, 1)

        def projection(size: int) -> Projection:
            return Projection(
                (size, *heads),
                heads,
                1,
                use_bias,
                kernel_init,
                bias_init,
                dtype,
                param_dtype,
                kernel_names,
                bias_names,
            )

        self.query = projection(self.in_size)
        self.key = projection(self.key_size)
        self.value = projection(self.value_size)
        self.out = Projection(
            (*heads, self.out_size),
            (self.out_size,),
            2,
            use_bias,
            out_kernel_init,
            out_bias_init,
            dtype,
            param_dtype,
            out_kernel_names,
            out_bias_names,
        )

    def _declare_qk_norms(self) -> None:
        """Linen's LayerNorms of the queries and keys per head (ViT-22B's QK normalisation)."""
        self.query_ln: LayerNorm | None = None
        self.key_ln: LayerNorm | None = None
        if self.normalize_qk:
            self.query_ln, self.key_ln = (
                LayerNorm(
                    self.head_dim,
                    use_bias=False,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                )
                for _ in range(2)
            )

    def _declare_cache(self, decode_shape: Sequence[int] | None) -> None:
        """Checks `decode_shape` and declares the decoding cache (three `Cache`), or None."""
        name = type(self).__name__
        self.decode_shape = (
            None if decode_shape is None else checked_decode_shape(name, decode_shape)
        )
        # The cache: three Cache declarations when decoding, else None (Any: read only then).
        self.cached_key: Any
        self.cached_value: Any
        self.cache_index: Any
        if self.decode_shape is None:
            self.cached_key = self.cached_value = self.cache_index = None
        else:
            cache_shape = (*self.decode_shape, self.num_heads, self.head_dim)
            zeros = initializers.zeros()
            cache_dtype = self.param_dtype if self.dtype is None else self.dtype
            self.cached_key = Cache(cache_shape, zeros, cache_dtype)
            self.cached_value = Cache(cache_shape, zeros, cache_dtype)
            self.cache_index = Cache((), zeros, jnp.int32)

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
    ) -> jax.Array:
        """Attends from `inputs_q` to `inputs_k`/`inputs_v` (self-attention when omitted).

        Args:
            inputs_q: ``(batch..., q_length, in_size)``.
            inputs_k: ``(batch..., kv_length, key_size)``; default `inputs_q`.
            inputs_v: ``(batch..., kv_length, value_size)``; default `inputs_k`.
            mask: A bool array broadcastable to ``(batch..., num_heads, q_length,
                kv_length)`` (with ``decode=True``, kv_length is ``max_length``); True keeps a
                pair. Masks of other dtypes are an error: a 0/1 mask is ``mask.astype(bool)``,
                an additive one (0 keeps, -inf drops) is ``mask == 0``.
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

        Returns:
            ``(batch..., q_length, out_size)``.
        """
        name = type(self).__name__
        _checks.static_flags(
            name, causal=causal, is_training=is_training, decode=decode, sow_weights=sow_weights
        )
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

        query, key, value = self._project_inputs(inputs)
        if self.query_ln is not None and self.key_ln is not None:
            query, key = self.query_ln(query), self.key_ln(key)
        fits = None
        if cache is not None:
            check_cache_kind(self, key, value)
        if cache is not None or causal or mask is not None:
            key, value, mask, new_cache, fits = cache_and_mask(
                key, value, mask, cache, self.num_heads, q_len, causal and not decode
            )
            if new_cache is not None:
                self.cached_key.value, self.cached_value.value, self.cache_index.value = new_cache
        x = call_attention_fn(self, query, key, value, mask, is_training, dropout_rng, sow_weights)
        return self._project_output(x, (*batch, q_len), fits)

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
        """The queries, keys and values in heads: ``(batch..., length, num_heads, head_dim)``."""
        layers = (self.query, self.key, self.value)
        heads = (self.num_heads, self.head_dim)
        if all(type(layer) is Projection for layer in layers):
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
            self._projected(name, layer, x, 1, (*jnp.shape(x)[:-1], *heads))
            for name, layer, x in zip(names, layers, inputs, strict=True)
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
        if type(self.out) is not Projection:
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
        if type(layer) is Projection:
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
        heads = (self.num_heads, self.head_dim)
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


def _check_input(arg: str, x: Any, setting: str, expected: int) -> tuple[int, ...]:
    shape = tuple(jnp.shape(x))
    if len(shape) < 2:
        raise ValueError(
            f"MultiHeadAttention: {arg} must have shape (batch..., length, features), got "
            f"shape {shape}; add a length axis for a single position."
        )
    return _checks.check_last_axis("MultiHeadAttention", x, expected, setting, what=arg)
