"""Linear layers: `Dense`, and `Embed` (a lookup table that can also act as a tied output layer)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import Parameter
from ..sharding.explicit import result_sharding
from . import _checks, _dtypes


@functools.partial(jax.jit, static_argnames=("dtype", "precision"))
def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    dtype: Dtype,
    precision: PrecisionLike = None,
) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of `x`, computed in `dtype`.

    One compiled call: eagerly it costs one dispatch instead of three, and inside `jax.jit`
    it inlines into the caller's program. On a mesh with explicit axes the result is sharded
    as `result_sharding` says (the batch axes as `x`'s, the features as the kernel's columns).
    """
    x, kernel = jnp.asarray(x, dtype), jnp.asarray(kernel, dtype)
    batch = tuple(range(x.ndim - 1))
    out = result_sharding((*batch, "out"), (x, (*batch, "in")), (kernel, ("in", "out")))
    y = lax.dot_general(
        x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision, out_sharding=out
    )
    if bias is not None:
        y = y + jnp.reshape(jnp.asarray(bias, dtype), (1,) * (y.ndim - 1) + (-1,))
    return y


class Dense(Module):
    """A fully connected layer, ``y = x @ kernel + bias``, over the last axis.

    Variables are Flax Linen's: ``kernel`` of shape ``(in_size, out_size)``, ``bias`` of
    shape ``(out_size,)``. Linen's ``Dense(features)`` is ``Dense(in_size, out_size)`` here:
    lamina declares every shape when the layer is built.

    Args:
        in_size: Size of the input's last axis.
        out_size: Size of the output's last axis.
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (inputs are cast to it); None infers it from the inputs and
            variables, as Linen's ``promote_dtype`` (bfloat16 stays bfloat16, complex stays
            complex).
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the matrix product.
        kernel_sharding: Logical axis names of the kernel, e.g. ``("embed", "mlp")``.
        bias_sharding: Logical axis name of the bias, e.g. ``("mlp",)``.

    Everything after the sizes is keyword-only; the settings are read-only once the layer is
    built (build a new layer to change one).

    Raises:
        ValueError: A size that is not positive; a sharding with the wrong number of names.
        TypeError: A setting of the wrong type (a float or bool size, a string dtype that
            names none, an initializer that is not a function...).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Dense(4, 2))
        >>> y, _ = apply(init(jax.random.key(0)), None, jnp.ones((3, 4)))
        >>> y.shape
        (3, 2)
    """

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

    in_size = _checks.Setting()
    out_size = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        out_size: int,
        *,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        self.in_size = _checks.positive_int(where, "in_size", in_size)
        self.out_size = _checks.positive_int(where, "out_size", out_size)
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        self.kernel = Parameter(
            (self.in_size, self.out_size),
            _checks.initializer(where, "kernel_init", kernel_init),
            self.dtype,
            self.param_dtype,
            sharding=_checks.sharding(where, "kernel_sharding", kernel_sharding, 2),
        )
        bias_init = _checks.initializer(where, "bias_init", bias_init)
        bias_sharding = _checks.sharding(where, "bias_sharding", bias_sharding, 1)
        self.bias = (
            Parameter(
                (self.out_size,), bias_init, self.dtype, self.param_dtype, sharding=bias_sharding
            )
            if self.use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to `x` of shape ``(..., in_size)``."""
        _checks.check_last_axis(self._describe, x, self.in_size, "in_size")
        kernel = self.kernel.value
        bias = self.bias.value if self.bias is not None else None
        dtype = _dtypes.compute_dtype(self, self.dtype, x, kernel, bias)
        return dense(x, kernel, bias, dtype, self.precision)

    def _describe(self) -> str:
        return f"{type(self).__name__}(in_size={self.in_size}, out_size={self.out_size})"


@jax.jit
def embed_lookup(embedding: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `embedding` for the integer `ids` (any shape).

    On a mesh with explicit axes the rows come sharded as `ids` (and the features as the
    table's columns, `result_sharding`); an id past the end gives NaN rows, as `jnp.take`.
    """
    labels = tuple(range(ids.ndim))
    out = result_sharding((*labels, "size"), (ids, labels), (embedding, ("rows", "size")))
    if out is None:
        return jnp.take(embedding, ids, axis=0)
    return embedding.at[ids].get(mode="fill", out_sharding=out)


@functools.partial(jax.jit, static_argnames=("dtype", "precision"))
def embed_attend(
    query: jax.Array, embedding: jax.Array, dtype: Dtype, precision: PrecisionLike = None
) -> jax.Array:
    """``query @ embedding.T``: similarity of each query vector to every embedding."""
    query, embedding = jnp.asarray(query, dtype), jnp.asarray(embedding, dtype)
    batch = tuple(range(query.ndim - 1))
    out = result_sharding(
        (*batch, "rows"), (query, (*batch, "size")), (embedding, ("rows", "size"))
    )
    return lax.dot_general(
        query,
        embedding,
        (((query.ndim - 1,), (1,)), ((), ())),
        precision=precision,
        out_sharding=out,
    )


class Embed(Module):
    """A lookup table of `num_embeddings` vectors of size `size`.

    ``embed(ids)`` returns the rows for integer `ids`; ``embed.attend(x)`` multiplies by the
    transposed table, the output layer of a model whose input and output embeddings are tied.
    The variable is Flax Linen's: ``embedding`` of shape ``(num_embeddings, size)``.

    The order of the sizes is Linen's and PyTorch's, ``Embed(num_embeddings, size)``;
    Metoryx's own ``Embed`` takes ``(size, num_embeddings)``.

    Ids must lie in ``[0, num_embeddings)``. They are checked when their values are known
    (eager calls); under `jax.jit` they are traced and cannot be checked, and, as in Linen, an
    id past the end gives a row of NaN and a negative one counts from the end.

    Args:
        num_embeddings: Number of rows (the vocabulary size).
        size: Size of each vector (Linen's `features`).
        embedding_init: Initializer of the table (Linen's default: normal, variance 1/size).
        dtype: Compute dtype of the returned vectors; None: the table's own dtype (and
            `attend` computes in the promotion of the query's and the table's).
        param_dtype: Storage dtype of the table (default: `dtype`, float32 when `dtype` is
            None).
        precision: `jax.lax.Precision` of `attend`'s matrix product.
        embedding_sharding: Logical axis names of the table, e.g. ``("vocab", "embed")``.

    Everything after `size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Embed(100, 8))
        >>> variables = init(jax.random.key(0))
        >>> apply(variables, None, jnp.array([[1, 2, 3]]))[0].shape
        (1, 3, 8)
        >>> attend = lm.transform(lm.Embed(100, 8), to_callable=lambda m: m.attend).apply
        >>> attend(variables, None, jnp.ones((2, 8)))[0].shape
        (2, 100)
    """

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

    num_embeddings = _checks.Setting()
    size = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()

    def __init__(
        self,
        num_embeddings: int,
        size: int,
        *,
        embedding_init: Initializer = initializers.variance_scaling(
            1.0, "fan_in", "normal", out_axis=0
        ),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        embedding_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        self.num_embeddings = _checks.positive_int(where, "num_embeddings", num_embeddings)
        self.size = _checks.positive_int(where, "size", size)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        self.embedding = Parameter(
            (self.num_embeddings, self.size),
            _checks.initializer(where, "embedding_init", embedding_init),
            self.dtype,
            self.param_dtype,
            sharding=_checks.sharding(where, "embedding_sharding", embedding_sharding, 2),
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Looks up integer `ids` of any shape; returns ``ids.shape + (size,)``."""
        if not hasattr(ids, "dtype"):
            try:
                ids = jnp.asarray(ids)
            except TypeError:
                raise TypeError(
                    f"{self._describe()} takes integer ids (an array or nested lists of ints), "
                    f"got {type(ids).__name__} {ids!r}."
                ) from None
        if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
            raise TypeError(
                f"{self._describe()} takes integer ids, got dtype {jnp.result_type(ids)}; "
                f"convert with ids.astype(jnp.int32) (for vectors, use embed.attend(x))."
            )
        if _checks.is_concrete(ids) and jnp.size(ids):
            values = np.asarray(ids)  # not a jax op: no tracer under an outer jit
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{self._describe()} got id {bad}: ids must be in [0, "
                    f"{self.num_embeddings}), one row of the table each. Map unknown tokens "
                    f"to a reserved id, or build the layer with a larger num_embeddings."
                )
        return embed_lookup(self.embedding.value, ids)

    def attend(self, query: jax.Array) -> jax.Array:
        """Returns ``query @ embedding.T`` for `query` of shape ``(..., size)``."""
        where = f"{self._describe()}.attend"
        _checks.check_last_axis(where, query, self.size, "size", what="a query")
        embedding = self.embedding.value
        dtype = _dtypes.compute_dtype(self, self.dtype, query, embedding)
        return embed_attend(query, embedding, dtype, self.precision)

    def _describe(self) -> str:
        return f"{type(self).__name__}(num_embeddings={self.num_embeddings}, size={self.size})"
