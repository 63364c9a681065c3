"""`Einsum`: an einsum of the input with a learned kernel, plus a bias, Flax Linen's ``Einsum``."""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import Parameter
from ..sharding.explicit import result_sharding
from . import _checks, _dtypes


def _labels(subscripts: str) -> list[str]:
    """The labels of one operand's subscripts: letters, and ``"..."`` for an ellipsis."""
    head, dots, tail = subscripts.partition("...")
    return [*head, *(["..."] if dots else []), *tail]


def _expand(subscripts: str, ndim: int, block: int) -> list[Any]:
    """One label per axis of an operand of `ndim` axes: the ellipsis becomes its axes.

    An ellipsis stands for the last axes of a `block` of broadcast axes (NumPy's alignment
    from the right), labelled ``("...", i)`` with ``i < block``, so that the axes of two
    operands' ellipses that broadcast together get the same label.
    """
    labels = _labels(subscripts)
    if "..." not in labels:
        return labels
    at = labels.index("...")
    n = ndim - len(labels) + 1
    return [*labels[:at], *[("...", block - n + i) for i in range(n)], *labels[at + 1 :]]


def _ellipsis_size(subscripts: str, ndim: int) -> int:
    """How many axes the ellipsis of an operand of `ndim` axes stands for (0 without one)."""
    return ndim - len(subscripts) + 3 if "..." in subscripts else 0


def _bias_shape(equation: str, kernel_shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """The bias's shape broadcast to an output of `ndim` axes (Linen's ``_get_bias_shape``).

    The kernel's sizes where the output keeps a kernel axis (an axis of the kernel's
    ellipsis included), 1 elsewhere.
    """
    inputs, out = equation.split("->")
    rhs = inputs.split(",")[1]
    block = ndim - len(_labels(out)) + 1
    sizes = dict(zip(_expand(rhs, len(kernel_shape), block), kernel_shape, strict=True))
    return tuple(sizes.get(label, 1) for label in _expand(out, ndim, block))


@functools.partial(
    jax.jit, static_argnames=("equation", "dtype", "precision", "preferred_element_type")
)
def einsum(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    equation: str,
    dtype: Dtype,
    precision: PrecisionLike = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``jnp.einsum(equation, x, kernel) + bias``, the operands cast to `dtype`.

    `bias` holds the output's axes that come from the kernel, in the output's order.
    """
    x, kernel = jnp.asarray(x, dtype), jnp.asarray(kernel, dtype)
    lhs, rhs, out = equation.replace("->", ",").split(",")
    block = max(_ellipsis_size(lhs, x.ndim), _ellipsis_size(rhs, kernel.ndim))
    ndim = len(out.replace("...", "")) + (block if "..." in out else 0)
    y = jnp.einsum(
        equation,
        x,
        kernel,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=result_sharding(
            _expand(out, ndim, block),
            (x, _expand(lhs, x.ndim, block)),
            (kernel, _expand(rhs, kernel.ndim, block)),
        ),
    )
    if bias is not None:
        shape = _bias_shape(equation, kernel.shape, y.ndim)
        y = y + jnp.reshape(jnp.asarray(bias, dtype).astype(y.dtype), shape)
    return y


def _parse(where: str, einsum_str: Any, ndim: int) -> str:
    """Checks `einsum_str` (``"lhs,kernel->out"``); returns it without spaces."""
    if not isinstance(einsum_str, str):
        raise TypeError(
            f"{where}: einsum_str must be a string such as '...d,dh->...h', got "
            f"{type(einsum_str).__name__} {einsum_str!r}."
        )
    equation = einsum_str.replace(" ", "")
    inputs, arrow, out = equation.partition("->")
    if not arrow or "->" in out:
        raise ValueError(
            f"{where}: einsum_str {einsum_str!r} must be explicit, with exactly one '->' "
            f"before the output's subscripts, e.g. '...d,dh->...h'."
        )
    if inputs.count(",") != 1:
        raise ValueError(
            f"{where}: einsum_str {einsum_str!r} must have exactly two operands, the input and "
            f"the kernel, so exactly one ',' (it has {inputs.count(',')})."
        )
    lhs, rhs = inputs.split(",")
    for part, name in ((lhs, "input"), (rhs, "kernel"), (out, "output")):
        rest = part.replace("...", "", 1)
        if not all(c in string.ascii_letters for c in rest):
            raise ValueError(
                f"{where}: einsum_str {einsum_str!r}: the {name}'s subscripts {part!r} may only "
                f"hold letters and one '...'."
            )
    letters = rhs.replace("...", "")
    if (
        len(letters) > ndim
        or ("..." not in rhs and len(letters) != ndim)
        or len(set(letters)) != len(letters)
    ):
        raise ValueError(
            f"{where}: einsum_str {einsum_str!r} gives the kernel the subscripts {rhs!r}, but "
            f"the kernel has shape with {ndim} axes: give one distinct letter per axis (a "
            f"'...' may stand for the axes the letters do not name)."
        )
    labels = _labels(out)
    if len(set(labels)) != len(labels) or ("..." in labels and "..." not in lhs + rhs):
        raise ValueError(
            f"{where}: einsum_str {einsum_str!r}: the output's subscripts {out!r} must name each "
            f"label once, and have '...' only if the input's or the kernel's have it."
        )
    unknown = [c for c in labels if c != "..." and c not in lhs and c not in rhs]
    if unknown:
        raise ValueError(
            f"{where}: einsum_str {einsum_str!r}: the output's label {unknown[0]!r} is neither "
            f"the input's nor the kernel's; name an axis of one of them."
        )
    return equation


class Einsum(Module):
    """An einsum of the input with a learned kernel, plus a bias (Flax Linen's ``Einsum``).

    ``y = jnp.einsum(einsum_str, x, kernel) + bias``. The kernel has the given `shape`; the
    bias, as Linen derives it, has the kernel's axes that the output keeps, in the output's
    order: ``Einsum((5, 6, 7), "abc,cde->abde")`` has a ``bias`` of shape ``(6, 7)``.

    The equation is given when the layer is built, or (as Linen allows) at call time, for a
    layer built without one and with ``use_bias=False``: the bias's shape follows from the
    equation, and every variable's shape is known when the layer is built. Each operand and
    the output may hold one ``...``; the kernel's letters name distinct axes, and its ``...``
    stands for the axes they do not name (leading, trailing or between), as in `jnp.einsum`.

    Args:
        shape: The kernel's shape.
        einsum_str: The equation, ``"<input>,<kernel>-><output>"``, e.g. ``"...d,dh->...h"``
            (spaces are ignored); None to give it at call time (needs ``use_bias=False``).
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel (called with `shape`, as in Linen).
        bias_init: Initializer of the bias.
        dtype: Compute dtype (inputs and variables are cast to it); None infers it from the
            inputs and variables, as Linen's ``promote_dtype``.
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the einsum.
        preferred_element_type: The einsum's accumulation and output dtype (default: the
            compute dtype), as `jnp.einsum`'s.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis names of the bias, one per dimension.

    Everything after `einsum_str` is keyword-only; the settings are read-only once the layer
    is built.

    Raises:
        ValueError: A size that is not positive, an equation that is not
            ``"<input>,<kernel>-><output>"`` with one distinct letter per kernel axis (or a
            ``...`` for the rest), or no equation with ``use_bias=True``; at call time, an
            input whose axes do not fit the equation and the kernel, or the equation given
            both when built and at call time, or neither.
        TypeError: A setting of the wrong type.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.Einsum((5, 6, 7), "abc,cde->abde")
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (6, 7), 'kernel': (5, 6, 7)}}
        >>> apply(variables, None, jnp.ones((3, 4, 5)))[0].shape
        (3, 4, 6, 7)
    """

    shape = _checks.Setting()
    einsum_str = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()
    preferred_element_type = _checks.Setting()

    def __init__(
        self,
        shape: Sequence[int],
        einsum_str: str | None = None,
        *,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        preferred_element_type: Any = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        where = f"{type(self).__name__}(shape={shape!r}, einsum_str={einsum_str!r})"
        if isinstance(shape, str) or not isinstance(shape, Sequence) or not shape:
            raise _checks.SettingTypeError(
                f"{where}: shape must be a non-empty tuple of positive ints (the kernel's "
                f"shape), got {shape!r}."
            )
        self.shape = tuple(_checks.positive_int(where, "every entry of shape", s) for s in shape)
        self.einsum_str = None if einsum_str is None else _parse(where, einsum_str, len(shape))
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        if self.einsum_str is None and self.use_bias:
            raise ValueError(
                f"{where}: the bias's shape follows from the equation, and lamina declares "
                f"every variable when the layer is built: pass einsum_str here, or build the "
                f"layer with use_bias=False to give the equation at call time."
            )
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        self.preferred_element_type = (
            None
            if preferred_element_type is None
            else _dtypes.inexact(where, "preferred_element_type", preferred_element_type)
        )
        self.kernel = Parameter(
            self.shape,
            _checks.initializer(where, "kernel_init", kernel_init),
            self.dtype,
            self.param_dtype,
            sharding=_checks.sharding(where, "kernel_sharding", kernel_sharding, len(self.shape)),
        )
        bias_shape: tuple[int, ...] = ()
        if self.einsum_str is not None:
            rhs, out = self.einsum_str.split(",")[1].split("->")
            k = _ellipsis_size(rhs, len(self.shape))
            sizes = dict(zip(_expand(rhs, len(self.shape), k), self.shape, strict=True))
            ellipsis = tuple(sizes[("...", i)] for i in range(k))
            bias_shape = sum(
                (
                    ellipsis if c == "..." else (sizes[c],)
                    for c in _labels(out)
                    if c in sizes or c == "..."
                ),
                (),
            )
        bias_init = _checks.initializer(where, "bias_init", bias_init)
        bias_sharding = _checks.sharding(where, "bias_sharding", bias_sharding, len(bias_shape))
        self.bias = (
            Parameter(bias_shape, bias_init, self.dtype, self.param_dtype, sharding=bias_sharding)
            if self.use_bias
            else None
        )

    def __call__(self, x: jax.Array, einsum_str: str | None = None) -> jax.Array:
        """Returns ``jnp.einsum(einsum_str, x, kernel) + bias``.

        Args:
            x: The input.
            einsum_str: The equation, when the layer was built without one (and without a
                bias), as Linen's ``Einsum.__call__(inputs, einsum_str)``; giving it both
                when built and here is an error, as in Linen.
        """
        equation = self.einsum_str
        if einsum_str is not None or equation is None:
            if einsum_str is None or equation is not None:
                given = "neither" if einsum_str is None else "both"
                raise ValueError(
                    f"{self._describe()} was given {given} einsum_str when built and at call "
                    f"time; give the equation once, in one of the two places (as in Linen)."
                )
            equation = _parse(self._describe(), einsum_str, len(self.shape))
        self._check_input(tuple(jnp.shape(x)), equation)
        kernel = self.kernel.value
        bias = self.bias.value if self.bias is not None else None
        dtype = _dtypes.compute_dtype(self, self.dtype, x, kernel, bias)
        return einsum(x, kernel, bias, equation, dtype, self.precision, self.preferred_element_type)

    def _check_input(self, shape: tuple[int, ...], equation: str) -> None:
        """Raises `ValueError` unless an input of `shape` fits the equation and the kernel."""
        lhs, rhs = equation.split("->")[0].split(",")
        labels = _labels(lhs)
        letters = len(labels) - ("..." in labels)
        if len(shape) < letters or ("..." not in labels and len(shape) != letters):
            axes = f"at least {letters}" if "..." in labels else f"{letters}"
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: its subscripts {lhs!r} "
                f"need {axes} axes. Pass an input of that rank, or change einsum_str."
            )
        k = _ellipsis_size(rhs, len(self.shape))
        kernel = zip(_expand(rhs, len(self.shape), k), self.shape, strict=True)
        sizes = {c: size for c, size in kernel if isinstance(c, str)}
        where = {c: "the kernel" for c in sizes}
        head = labels[: labels.index("...")] if "..." in labels else labels
        tail = labels[len(head) + 1 :] if "..." in labels else []
        pairs = [
            *zip(head, shape[: len(head)], strict=True),
            *zip(tail, shape[len(shape) - len(tail) :], strict=True),
        ]
        for label, size in pairs:
            if sizes.setdefault(label, size) != size:
                raise ValueError(
                    f"{self._describe()} got an input of shape {shape}: its axis {label!r} has "
                    f"size {size} but {where.get(label, 'another axis of the input')} has "
                    f"{sizes[label]} for that label. Pass an input whose axes fit {equation!r}."
                )
            where.setdefault(label, "another axis of the input")

    def _describe(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, einsum_str={self.einsum_str!r})"
