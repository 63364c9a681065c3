"""The logits processors of `lm.generate`: temperature, top-k, top-p, and drawing a token.

Their order and semantics are those of Hugging Face ``transformers``' ``generate``
(``TemperatureLogitsWarper``, then ``TopKLogitsWarper``, then ``TopPLogitsWarper``, in
``generation/logits_process.py``): a removed token gets the logit ``-inf``.

- temperature: ``logits / temperature``.
- top-k: every logit below the k-th largest is removed; ties with the k-th are kept, so more
  than k tokens may stay. ``top_k`` None or 0: off; larger than the vocabulary: all kept.
- top-p (nucleus): the tokens sorted by ascending logit, ``cum = cumsum(softmax)``, the
  tokens with ``cum <= 1 - top_p`` removed, the most likely one always kept. ``top_p`` None or
  1.0: off. Tokens tied with the smallest kept logit are all kept, as top-k keeps ties:
  transformers removes an arbitrary subset of them (whichever PyTorch's unstable sort puts
  first), so on such ties lamina keeps a superset of its tokens, and otherwise the same.

`temperature` and `top_p` may be traced (changing them does not recompile); `top_k` is static
(it sets a shape).

NaN logits count as ``-inf`` (a NaN never wins, nor spreads to the other tokens: under
``jax.jit`` a value cannot raise). A row whose logits are all ``-inf`` (or NaN) has nothing
to draw from: `sample` returns token 0 for it, greedy or not.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks


def _concrete_number(value: Any) -> float | None:
    """`value` as a float when it is known now (not traced), else None."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return float(value)
    except TypeError:
        return None


def _check_options(where: str, temperature: Any, top_k: Any, top_p: Any) -> int | None:
    if temperature is not None:
        t = _concrete_number(temperature)
        if t is not None and not (math.isfinite(t) and t > 0):
            raise ValueError(
                f"{where}: temperature must be a finite number > 0 (it divides the logits), got "
                f"{temperature!r}. For greedy decoding, use sample(..., temperature=0.0)."
            )
    if top_k is not None:
        if not checks.is_int(top_k) or top_k < 0:
            raise ValueError(
                f"{where}: top_k must be None or an int >= 0 (0 or None: off), got {top_k!r}. "
                f"It sets a shape, so it cannot be traced."
            )
        top_k = int(top_k) or None
    if top_p is not None:
        p = _concrete_number(top_p)
        if p is not None and not (0.0 <= p <= 1.0):
            raise ValueError(
                f"{where}: top_p must be None or a number in [0, 1] (the probability mass "
                f"kept; 1.0: off), got {top_p!r}."
            )
    return top_k


def process_logits(
    logits: jax.Array,
    *,
    temperature: Any = None,
    top_k: int | None = None,
    top_p: Any = None,
) -> jax.Array:
    """Temperature, then top-k, then top-p, as ``transformers``' warpers: removed -> ``-inf``.

    Args:
        logits: ``(batch, vocab)``, any floating dtype (processed in float32; NaN counts as
            ``-inf``).
        temperature: None (off) or a number > 0, traced or not. As in transformers, a tiny
            temperature may overflow the logits to ``inf`` (`sample` shifts them first).
        top_k: None or 0 (off), or the number of largest logits kept (ties kept).
        top_p: None (off) or the probability mass kept, in [0, 1], traced or not.

    Returns:
        ``(batch, vocab)`` float32 logits, ``-inf`` where a token was removed.

    Raises:
        ValueError: A setting out of range; logits that are not ``(batch, vocab)`` floats.

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina.models.sampling import process_logits
        >>> process_logits(jnp.array([[1.0, 3.0, 2.0, 3.0]]), top_k=2)
        Array([[-inf,   3., -inf,   3.]], dtype=float32)
    """
    where = "process_logits"
    top_k = _check_options(where, temperature, top_k, top_p)
    logits = _check_logits(where, logits)
    if temperature is not None:
        logits = logits / jnp.asarray(temperature, jnp.float32)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and _concrete_number(top_p) != 1.0:
        logits = _top_p(logits, jnp.asarray(top_p, jnp.float32))
    return logits


def _check_logits(where: str, logits: Any) -> jax.Array:
    """`logits` as float32, NaN read as -inf (traced values cannot raise)."""
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{where}: logits must be a (batch, vocab) floating array, got {logits.dtype} of "
            f"shape {logits.shape}. For one sequence, pass logits[None]."
        )
    logits = logits.astype(jnp.float32)
    return jnp.where(jnp.isnan(logits), -jnp.inf, logits)


def _check_key(where: str, key: Any) -> None:
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        batch = shape != ()
    elif dtype == jnp.uint32 and shape is not None and len(shape) >= 1:  # legacy PRNGKey
        batch = len(shape) > 1
    else:
        raise TypeError(
            f"{where}: key must be a PRNG key, jax.random.key(seed), got "
            f"{type(key).__name__} {getattr(key, 'dtype', '')}{list(shape or ())}."
        )
    if batch:
        raise ValueError(
            f"{where} takes one key, got a batch of keys of shape {shape}. It draws each row "
            f"with its own key already (jax.random.fold_in(key, row)); pass one key, or "
            f"jax.vmap the call to draw with several."
        )


def _top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    ascending = jnp.sort(logits, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    # the removed tokens are a prefix of the ascending order (the cumulative sum grows); the
    # most likely token always stays; a traced 1.0 is off, as transformers skips the warper
    removed = (cumulative <= jnp.float32(1.0) - top_p) & (top_p < 1.0)
    count = jnp.minimum(jnp.sum(removed, axis=-1, keepdims=True), logits.shape[-1] - 1)
    boundary = jnp.take_along_axis(ascending, count, axis=-1)  # the smallest kept logit
    return jnp.where(logits < boundary, -jnp.inf, logits)


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: Any = 1.0,
    top_k: int | None = None,
    top_p: Any = None,
) -> jax.Array:
    """Draws one token per row from `logits` after `process_logits`; argmax at temperature 0.

    Each row draws with its own key, ``jax.random.fold_in(key, row)``, so a row's token
    depends only on its row index and `key`, not on the batch size or the other rows (the
    same logits at another row index draw another token).

    Args:
        logits: ``(batch, vocab)``, any floating dtype. NaN counts as ``-inf``; a row
            that is all ``-inf`` gives token 0.
        key: One PRNG key (``jax.random.key(seed)``, or a legacy ``PRNGKey``), not a batch
            of them; one draw per call (fold a step counter into it for each new token).
        temperature: 0 (greedy: argmax, the first of tied maxima), or a number > 0 (1.0 or
            None: the logits as they are); it may be traced, and a traced 0 is greedy too.
            Each row is shifted by its largest finite logit first (which changes no
            probability), so that a tiny temperature sends the others to ``-inf``, not
            the maximum to ``+inf``: it draws among the tied maxima (a traced temperature
            below float32's smallest normal number, 1.2e-38, may be flushed to 0: greedy).
        top_k: `process_logits`' (static); 0 or None: off.
        top_p: `process_logits`' (traced or not); 1.0 or None: off.

    Returns:
        ``(batch,)`` int32 tokens.

    Raises:
        ValueError: A setting out of range; `top_k`/`top_p` (other than the "off" values 0
            and 1.0) with a concrete temperature 0 (greedy decoding ignores them); a batch
            of keys.
        TypeError: A key that is not a PRNG key.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from lamina.models.sampling import sample
        >>> logits = jnp.array([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
        >>> sample(logits, jax.random.key(0), temperature=0.0)
        Array([1, 0], dtype=int32)
        >>> sample(logits, jax.random.key(0), top_k=1)
        Array([1, 0], dtype=int32)
    """
    where = "sample"
    if temperature is None:
        temperature = 1.0
    t = _concrete_number(temperature)
    if t is not None and not (math.isfinite(t) and t >= 0):
        raise ValueError(
            f"{where}: temperature must be 0 (greedy) or a finite number > 0, got {temperature!r}."
        )
    _check_key(where, key)
    logits = _check_logits(where, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if t == 0.0:
        p = None if top_p is None else _concrete_number(top_p)
        if (top_k or None) is not None or (top_p is not None and p != 1.0):
            raise ValueError(
                f"{where}: temperature=0 is greedy decoding (argmax), which ignores top_k="
                f"{top_k!r} and top_p={top_p!r}; pass temperature > 0 to sample with them, or "
                f"leave them None."
            )
        return greedy
    # a temperature below float32's smallest normal number (subnormal: flushed to 0 on some
    # devices) is that number, which leaves only the tied maxima anyway
    tiny = jnp.finfo(jnp.float32).tiny
    if t is not None:
        temperature = max(t, float(tiny))
    temperature = jnp.asarray(temperature, jnp.float32)
    safe = jnp.where(temperature > 0, jnp.maximum(temperature, tiny), jnp.float32(1.0))
    # the row's largest finite logit to 0: probabilities, top-k and top-p are unchanged, and
    # logits / tiny temperature overflow to -inf below the maximum, never to +inf at it
    finite = jnp.where(jnp.isfinite(logits), logits, -jnp.inf)
    peak = jnp.max(finite, axis=-1, keepdims=True)
    shifted = logits - jnp.where(jnp.isfinite(peak), peak, jnp.float32(0.0))
    processed = process_logits(shifted, temperature=safe, top_k=top_k, top_p=top_p)
    rows = jnp.arange(logits.shape[0], dtype=jnp.uint32)
    keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(rows)
    drawn = jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)
    if t is not None:
        return drawn
    return jnp.where(temperature > 0, drawn, greedy)
