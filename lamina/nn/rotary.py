"""Rotary position embeddings (RoPE): frequencies, the rotation, and a module.

RoPE rotates pairs of features of each query and key by an angle ``position * inv_freq[i]``,
so that their dot product depends on the distance between the two positions only. Three
pieces, numerically those of Hugging Face ``transformers`` (``modeling_rope_utils.py`` and
the Llama model's rotary module), up to one difference: lamina's base frequencies ``1 /
theta ** (2i / d)`` are correctly rounded to float32, PyTorch's float32 ``pow`` is not always,
so a few of them (e.g. 1 of 64 at ``theta=1e6``, ``head_dim=128``) are 1 ulp apart; the rest,
and every scaling computed from equal base frequencies, are equal bit for bit:

- `rope_frequencies` computes the inverse frequencies ``inv_freq`` (NumPy float32) for the
  variants checkpoints use: ``"default"``, ``"linear"`` (position interpolation) and
  ``"llama3"`` (Llama 3.1's frequency-dependent scaling), with an optional partial rotary
  factor (only the first ``int(head_dim * factor)`` features rotate).
- `apply_rotary` rotates an array of queries or keys ``(*batch, length, heads, head_dim)`` at
  integer positions. Angles and their cosines and sines are computed in float32 and then cast
  to the input's dtype, and the rotation runs in the input's dtype, as ``transformers`` does
  (so bfloat16 results agree bit for bit).
- `RotaryEmbedding` is a module (no variables) holding the frequencies of one setting.

Two layouts pair the features differently. ``"half"`` pairs feature ``i`` with feature
``i + d/2`` (``rotate_half``): every Hugging Face checkpoint of the Llama family uses it
(Llama 2/3, Mistral, Qwen2/2.5/3, Gemma, GPT-NeoX), since ``transformers``' converters
permute the rows of Meta's query and key weights. ``"interleaved"`` pairs features ``2i`` and
``2i + 1`` (a complex multiply): Meta's original ``consolidated.*.pth`` files, GPT-J
(``rotate_every_two``), Mistral's reference code, ChatGLM. The two agree once the head
features are permuted ``[0, 2, 4, ..., 1, 3, 5, ...]`` (which is how a query or key kernel of
one layout converts to the other).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.module import Module
from . import _checks

SUPPORTED = ("default", "linear", "llama3")
# Rope types transformers knows that lamina does not compute (yet), and why.
UNSUPPORTED = {
    "dynamic": "its frequencies depend on the current length, which one compiled step over a "
    "static cache cannot follow",
    "yarn": "not implemented yet",
    "longrope": "its frequencies depend on the current length",
    "proportional": "not implemented yet",
}
LAYOUTS = ("half", "interleaved")
# The keys each variant reads from `scaling` (besides "rope_type").
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _positive(where: str, name: str, value: Any) -> float:
    if not (_checks.is_real(value) and math.isfinite(value) and value > 0):
        error = ValueError if _checks.is_real(value) else _checks.SettingTypeError
        raise error(f"{where}: {name} must be a finite positive number, got {value!r}.")
    return float(value)


def rope_type_of(where: str, scaling: Mapping[str, Any]) -> str:
    """The variant a `scaling` dict names (``"rope_type"``, or the legacy ``"type"``)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in UNSUPPORTED:
        raise NotImplementedError(
            f"{where}: rope_type {rope_type!r} is not supported ({UNSUPPORTED[rope_type]}); "
            f"lamina computes the rope types {', '.join(map(repr, SUPPORTED))}."
        )
    if rope_type not in SUPPORTED:
        raise ValueError(
            f"{where}: unknown rope_type {rope_type!r} in scaling={dict(scaling)!r}; the "
            f"supported rope types are {', '.join(map(repr, SUPPORTED))}."
        )
    return str(rope_type)


def rope_scaling(where: str, scaling: Any, theta: float, partial: float) -> dict[str, Any] | None:
    """Checks `scaling` (None or a dict in transformers' ``rope_parameters`` form).

    Returns None for the default variant, else a new dict with ``"rope_type"`` and the keys
    the variant reads, as floats (``original_max_position_embeddings`` an int). ``rope_theta``
    and ``partial_rotary_factor`` may appear in it when they equal the arguments.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise _checks.SettingTypeError(
            f"{where}: scaling must be None or a dict such as {{'rope_type': 'linear', "
            f"'factor': 2.0}} (transformers' rope_parameters), got {type(scaling).__name__}."
        )
    rope_type = rope_type_of(where, scaling)
    for name, given in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if name in scaling and scaling[name] != given:
            argument = "theta" if name == "rope_theta" else name
            raise ValueError(
                f"{where}: scaling[{name!r}]={scaling[name]!r} differs from {argument}="
                f"{given!r}; pass it as the argument {argument} (scaling holds the variant's "
                f"other settings only)."
            )
    needed = _KEYS[rope_type]
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *needed}
    extra = sorted(set(scaling) - allowed)
    missing = [k for k in needed if k not in scaling]
    if extra or missing:
        raise ValueError(
            f"{where}: scaling for rope_type {rope_type!r} takes the keys "
            f"{list(needed)} (and 'rope_type'); "
            + (f"missing {missing}" if missing else "")
            + ("; " if extra and missing else "")
            + (f"unexpected {extra}" if extra else "")
            + "."
        )
    if rope_type == "default":
        return None
    result: dict[str, Any] = {"rope_type": rope_type}
    for key in needed:
        if key == "original_max_position_embeddings":
            meaning = " (the context length the model was trained with)"
            result[key] = _checks.positive_int(where, f"scaling[{key!r}]", scaling[key], meaning)
        else:
            result[key] = _positive(where, f"scaling[{key!r}]", scaling[key])
    if rope_type == "llama3" and not result["high_freq_factor"] > result["low_freq_factor"]:
        raise ValueError(
            f"{where}: scaling['high_freq_factor']={result['high_freq_factor']!r} must be "
            f"greater than scaling['low_freq_factor']={result['low_freq_factor']!r} (Llama 3.1 "
            f"uses 4.0 and 1.0)."
        )
    return result


def _rotary_dim(where: str, head_dim: Any, partial: Any) -> tuple[int, float, int]:
    head_dim = _checks.positive_int(where, "head_dim", head_dim, ", the size of each head")
    partial = _checks.non_negative(
        where, "partial_rotary_factor", partial, at_most=1.0, meaning=" (the rotated fraction)"
    )
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"{where}: head_dim={head_dim} and partial_rotary_factor={partial!r} rotate "
            f"int(head_dim * partial_rotary_factor) = {dim} features, which must be even and at "
            f"least 2 (features rotate in pairs)."
        )
    return head_dim, partial, dim


def rope_frequencies(
    head_dim: int,
    *,
    theta: float = 10_000.0,
    scaling: Mapping[str, Any] | None = None,
    partial_rotary_factor: float = 1.0,
) -> np.ndarray:
    """The inverse frequencies of RoPE, as ``transformers`` computes them (float32, within 1 ulp).

    ``inv_freq[i] = 1 / theta ** (2i / d)`` for ``i < d/2``, with ``d = int(head_dim *
    partial_rotary_factor)``, computed in float32, then scaled by the variant `scaling` names:

    - None or ``{"rope_type": "default"}``: unscaled (Llama 2, Mistral, Qwen, Gemma).
    - ``{"rope_type": "linear", "factor": f}``: ``inv_freq / f`` (position interpolation).
    - ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}`` (Llama 3.1 and later): long wavelengths
      (``> original / low_freq_factor``) divided by `factor`, short ones (``< original /
      high_freq_factor``) kept, those between interpolated smoothly.

    The legacy key ``"type"`` is read as ``"rope_type"``. Frequencies that depend on the
    current length (``"dynamic"``, ``"longrope"``) and ``"yarn"`` raise `NotImplementedError`.

    The powers are correctly rounded to float32; PyTorch's float32 ``pow`` is not always, so
    a frequency may be 1 ulp from transformers' (e.g. 1 of the 64 at ``theta=1e6``,
    ``head_dim=128``). The scalings repeat transformers' float32 operations, so they give its
    values bit for bit from equal base frequencies.

    Args:
        head_dim: Size of each attention head.
        theta: The base (``rope_theta``: 1e4 in Llama 2, 5e5 in Llama 3, 1e6 in Qwen2).
        scaling: None, or a dict in transformers' ``rope_parameters`` form without
            ``rope_theta``.
        partial_rotary_factor: The fraction of each head's features that rotate, in (0, 1].

    Returns:
        A NumPy float32 array of shape ``(d // 2,)``.

    Raises:
        NotImplementedError: A rope type lamina does not compute.
        ValueError: An unknown rope type, a missing or unexpected key, a setting out of range.

    Example:
        >>> import lamina as lm
        >>> lm.rope_frequencies(8, theta=10_000.0)
        array([1.   , 0.1  , 0.01 , 0.001], dtype=float32)
        >>> lm.rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0})
        array([0.5   , 0.05  , 0.005 , 0.0005], dtype=float32)
    """
    where = "rope_frequencies"
    theta = _positive(where, "theta", theta)
    head_dim, partial, dim = _rotary_dim(where, head_dim, partial_rotary_factor)
    settings = rope_scaling(where, scaling, theta, partial)
    return _frequencies(theta, dim, settings)


def _frequencies(theta: float, dim: int, scaling: dict[str, Any] | None) -> np.ndarray:
    f32 = np.float32
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    # the power in float64, rounded once: correctly rounded (NumPy's float32 pow is not;
    # neither is torch's, which is why a few frequencies are 1 ulp from transformers')
    powers = (np.float64(f32(theta)) ** exponents.astype(np.float64)).astype(f32)
    inv_freq = (f32(1.0) / powers).astype(f32)
    if scaling is None:
        return inv_freq
    factor = f32(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(f32)
    # llama3, in transformers' float32 operations (modeling_rope_utils._compute_llama3_parameters)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = f32(old / low), f32(old / high)
    # torch computes `scalar / tensor` as `tensor.reciprocal() * scalar` (two roundings), so
    # `2 * pi / inv_freq` and `old / wavelen` are the reciprocal times the scalar here too
    wavelen = ((f32(1) / inv_freq).astype(f32) * f32(2 * math.pi)).astype(f32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(f32)
    smooth = ((f32(1) / wavelen).astype(f32) * f32(old) - f32(low)) / f32(high - low)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def apply_rotary(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: Any,
    *,
    layout: str = "half",
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotates the first ``2 * len(inv_freq)`` features of each head of `x` by its position.

    The angles ``positions * inv_freq`` and their cosines and sines are computed in float32,
    multiplied by `attention_factor`, cast to `x`'s dtype, and the rotation runs in `x`'s
    dtype (``x * cos + rotate(x) * sin``), as ``transformers``' Llama does. The features past
    ``2 * len(inv_freq)`` (partial rotary) pass unchanged.

    Args:
        x: Queries or keys, ``(*batch, length, heads, head_dim)``, any floating dtype.
        positions: Integer positions, ``(*batch, length)`` or ``(length,)`` (any shape that
            broadcasts to ``x.shape[:-2]``, NumPy's rule: aligned on the right); traced
            values are fine. A ``(length,)`` array is the same for every batch row, so a 1-D
            array is always read as ``(length,)``: a ``(batch,)`` array of one position per
            row (decoding one token) must be ``(batch, 1)``.
        inv_freq: The inverse frequencies, ``(d // 2,)`` (`rope_frequencies`).
        layout: ``"half"`` (feature ``i`` pairs with ``i + d/2``: Hugging Face checkpoints)
            or ``"interleaved"`` (features ``2i`` and ``2i + 1``: Meta's originals, GPT-J).
        attention_factor: Multiplies the cosines and sines (1.0 for the variants lamina
            computes; YaRN's ``mscale`` later).

    Returns:
        `x` rotated, same shape and dtype.

    Raises:
        TypeError: `x` not floating, `positions` not integers.
        ValueError: An unknown layout; shapes that do not fit.

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> x = jnp.ones((1, 3, 2, 8))  # (batch, length, heads, head_dim)
        >>> inv_freq = lm.rope_frequencies(8)
        >>> y = lm.apply_rotary(x, jnp.arange(3), inv_freq)
        >>> y.shape, bool(jnp.allclose(y[0, 0], x[0, 0]))  # position 0 does not rotate
        ((1, 3, 2, 8), True)
    """
    where = "apply_rotary"
    if layout not in LAYOUTS:
        raise ValueError(
            f"{where}: layout must be 'half' (Hugging Face checkpoints) or 'interleaved' "
            f"(Meta's original files, GPT-J), got {layout!r}."
        )
    factor = _positive(where, "attention_factor", attention_factor)
    x, positions, inv_freq = _check_inputs(where, x, positions, inv_freq)
    return _rotate(x, positions, inv_freq, layout, factor)


def _check_inputs(
    where: str, x: Any, positions: Any, inv_freq: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, positions = jnp.asarray(x), jnp.asarray(positions)
    inv_freq = jnp.asarray(inv_freq)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{where}: x must be a floating array (queries or keys), got {x.dtype}.")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(
            f"{where}: positions must be integers (token positions), got {positions.dtype}. "
            f"Pass jnp.arange(length) or positions.astype(jnp.int32)."
        )
    if inv_freq.ndim != 1 or not jnp.issubdtype(inv_freq.dtype, jnp.floating):
        raise ValueError(
            f"{where}: inv_freq must be a 1-D floating array (rope_frequencies), got "
            f"{inv_freq.dtype} of shape {inv_freq.shape}."
        )
    if x.ndim < 3:
        raise ValueError(
            f"{where}: x must have shape (*batch, length, heads, head_dim), got {x.shape}. "
            f"For one head, add the axis: x[..., None, :]."
        )
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(
            f"{where}: inv_freq has {inv_freq.shape[0]} frequencies, which rotate "
            f"{2 * inv_freq.shape[0]} features, but x has head_dim {x.shape[-1]} (shape "
            f"{x.shape}). Compute the frequencies for this head_dim."
        )
    lead = x.shape[:-2]
    if not _checks.broadcasts_to(positions.shape, lead):
        raise ValueError(
            f"{where}: positions of shape {positions.shape} do not fit x of shape {x.shape}: "
            f"they must be (*batch, length) = {lead} or broadcast to it, e.g. (length,) = "
            f"({x.shape[-3]},)."
        )
    return x, positions, inv_freq


@functools.partial(jax.jit, static_argnames=("layout", "factor"))
def _rotate(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, layout: str, factor: float
) -> jax.Array:
    half = inv_freq.shape[0]
    freqs = jnp.reshape(inv_freq.astype(jnp.float32), (1,) * positions.ndim + (half,))
    angles = positions.astype(jnp.float32)[..., None] * freqs
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor != 1.0:
        cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
    # (..., length, half) -> (..., length, 1, half), padded to x's rank with size-1 axes
    shape = (1,) * (x.ndim - 1 - angles.ndim) + angles.shape[:-1] + (1, half)
    cos = jnp.reshape(cos.astype(x.dtype), shape)
    sin = jnp.reshape(sin.astype(x.dtype), shape)
    rotated, rest = x[..., : 2 * half], x[..., 2 * half :]
    if layout == "half":
        x1, x2 = rotated[..., :half], rotated[..., half:]
    else:
        pairs = jnp.reshape(rotated, (*rotated.shape[:-1], half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
    y1 = x1 * cos + (-x2) * sin
    y2 = x2 * cos + x1 * sin
    if layout == "half":
        y = jnp.concatenate([y1, y2], axis=-1)
    else:
        y = jnp.reshape(jnp.stack([y1, y2], axis=-1), rotated.shape)
    return jnp.concatenate([y, rest], axis=-1) if rest.shape[-1] else y


class _ReadOnlyArray(_checks.Setting):
    """A `Setting` holding a NumPy array that stays read-only.

    Pickle and `copy.deepcopy` make writeable copies of arrays, so the array is marked
    read-only again whenever it is read.
    """

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        value = super().__get__(obj, owner)
        if obj is not None and isinstance(value, np.ndarray):
            value.flags.writeable = False
        return value


class RotaryEmbedding(Module):
    """Rotary position embeddings of one setting, as a module (it holds no variables).

    ``rope(x, positions)`` rotates queries or keys ``x`` of shape ``(*batch, length, heads,
    head_dim)`` (any floating dtype) at integer `positions` ``(*batch, length)`` or
    ``(length,)``, and returns them in `x`'s dtype (`apply_rotary`). ``(length,)`` positions
    apply to every batch row; a 1-D array is always read as ``(length,)``, so one position
    per row (decoding one token) is ``(batch, 1)``, not ``(batch,)`` (which, when ``batch ==
    length``, would silently be read as positions along the sequence). The frequencies are
    computed once, when the module is built (`rope_frequencies`), and kept in ``inv_freq``
    (a read-only NumPy array).

    Which layout: ``"half"`` for every Hugging Face checkpoint of the Llama family (Llama,
    Mistral, Qwen2/2.5/3, Gemma, GPT-NeoX); ``"interleaved"`` for Meta's original
    ``consolidated.*.pth`` weights, GPT-J and ChatGLM.

    Args:
        head_dim: Size of each head (the last axis of `x`).
        theta: The base, ``rope_theta`` (1e4 in Llama 2, 5e5 in Llama 3, 1e6 in Qwen2).
        scaling: None, or a dict in transformers' ``rope_parameters`` form without
            ``rope_theta``: ``{"rope_type": "linear", "factor": 2.0}``, or ``"llama3"`` with
            ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
            ``original_max_position_embeddings``.
        partial_rotary_factor: The fraction of each head's features that rotate (the first
            ``int(head_dim * partial_rotary_factor)``); the rest pass unchanged.
        layout: ``"half"`` or ``"interleaved"`` (above).

    Everything after `head_dim` is keyword-only; the settings are read-only once built.

    Raises:
        NotImplementedError: A rope type lamina does not compute (``"dynamic"``, ``"yarn"``,
            ``"longrope"``...).
        ValueError: An unknown rope type or layout, a missing key, a setting out of range.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> rope = lm.RotaryEmbedding(8, theta=500_000.0)
        >>> init, apply = lm.transform(rope)
        >>> init(jax.random.key(0))
        {}
        >>> q = jnp.ones((2, 5, 4, 8))  # (batch, length, heads, head_dim)
        >>> y, _ = apply({}, None, q, jnp.arange(5))
        >>> y.shape, y.dtype
        ((2, 5, 4, 8), dtype('float32'))
    """

    head_dim = _checks.Setting()
    theta = _checks.Setting()
    scaling = _checks.Setting()
    partial_rotary_factor = _checks.Setting()
    layout = _checks.Setting()
    inv_freq = _ReadOnlyArray()

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10_000.0,
        scaling: Mapping[str, Any] | None = None,
        partial_rotary_factor: float = 1.0,
        layout: str = "half",
    ):
        super().__init__()
        where = type(self).__name__
        self.theta = _positive(where, "theta", theta)
        self.head_dim, self.partial_rotary_factor, dim = _rotary_dim(
            where, head_dim, partial_rotary_factor
        )
        self.scaling = rope_scaling(where, scaling, self.theta, self.partial_rotary_factor)
        if layout not in LAYOUTS:
            raise ValueError(
                f"{where}: layout must be 'half' (Hugging Face checkpoints) or 'interleaved' "
                f"(Meta's original files, GPT-J), got {layout!r}."
            )
        self.layout = layout
        inv_freq = _frequencies(self.theta, dim, self.scaling)
        inv_freq.flags.writeable = False
        self.inv_freq = inv_freq

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotates `x` ``(*batch, length, heads, head_dim)`` at integer `positions`."""
        where = self._describe()
        x = jnp.asarray(x)
        if x.ndim and x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{where} got x with {x.shape[-1]} features on its last axis (shape "
                f"{x.shape}); it must be head_dim={self.head_dim}. Pass (*batch, length, "
                f"heads, head_dim) queries or keys, or build RotaryEmbedding({x.shape[-1]})."
            )
        x, positions, inv_freq = _check_inputs(where, x, positions, self.inv_freq)
        return _rotate(x, positions, inv_freq, self.layout, 1.0)

    def __repr__(self) -> str:
        text = super().__repr__()
        if "\n  scaling=" in text:  # None, or a Module repr that shows plain dicts
            return text
        # Module's repr shows plain values only, not a dict of them
        lines = text.split("\n")
        lines.insert(-1, f"  scaling={self.scaling!r},")
        return "\n".join(lines)

    def _describe(self) -> str:
        return f"{type(self).__name__}(head_dim={self.head_dim})"
