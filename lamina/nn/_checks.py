"""The checks that only layers run: read-only settings, windows, paddings, precisions, inputs.

Built on the core's checks (`lamina._core.checks`), which every part of lamina shares and this
module re-exports, so that a layer reads all of its checks as ``_checks.<name>``. Each check
takes `where`, the layer or function as messages name it (``"LSTMCell"``,
``"Conv(in_size=3, out_size=8, kernel_size=(3, 3))"``), and raises with what was wrong and
what to do; the checks of settings return the value in its canonical type.

`Setting` makes a layer's settings read-only once `__init__` has written them: the variables
were declared with them, so an edit afterwards could only be ignored or crash inside a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.checks import as_dim as as_dim
from .._core.checks import as_dtype as as_dtype
from .._core.checks import flag as flag
from .._core.checks import flags as flags
from .._core.checks import function as function
from .._core.checks import is_concrete as is_concrete
from .._core.checks import is_dim as is_dim
from .._core.checks import is_int as is_int
from .._core.checks import is_real as is_real
from .._core.checks import non_negative as non_negative
from .._core.checks import non_negative_int as non_negative_int
from .._core.checks import positive_int as positive_int
from .._core.checks import static_flags as static_flags
from .._core.errors import SettingTypeError as SettingTypeError
from .._core.initializer import initializer as initializer
from .._core.types import PrecisionLike

# A padding as the kernels receive it: a name, or one (low, high) pair per spatial axis.
CanonicalPadding = str | tuple[tuple[int, int], ...]


class Setting:
    """A layer's setting: written once, in ``__init__``, and read-only afterwards.

    Declared on the class (``in_size = Setting()``); the value lives in the instance's
    ``__dict__`` under the same name, so copies, ``repr`` and the module walk see a plain
    attribute. A second assignment raises `AttributeError` saying to build a new layer.
    """

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(
                f"{type(obj).__name__!r} object has no attribute {self.name!r}"
            ) from None

    def __set__(self, obj: Any, value: Any) -> None:
        if self.name in obj.__dict__:
            raise AttributeError(_read_only_message(obj, self.name, f"to {_short(value)}"))
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        raise AttributeError(_read_only_message(obj, self.name, "(deleted)"))


def _short(value: Any) -> str:
    """`value` for a message: a layer by its sizes (``Dense(in_size=4, out_size=2)``)."""
    describe = getattr(value, "_describe", None)
    if callable(describe):
        return str(describe())
    if isinstance(value, np.dtype):
        return value.name
    text = repr(value)
    return text if len(text) <= 60 and "\n" not in text else f"a {type(value).__name__}"


def _read_only_message(obj: Any, name: str, change: str) -> str:
    layer = type(obj).__name__
    return (
        f"{layer}.{name} is read-only: it is fixed when the layer is built (the layer's "
        f"variables and checks were made with {name}={_short(obj.__dict__.get(name))}), so "
        f"changing "
        f"it {change} could only be ignored or break the layer. Build a new layer with the "
        f"setting you want and put it in the old one's place, e.g. "
        f"model.layer = lm.{layer}(..., {name}=...)."
    )


_PRECISION_TYPES: tuple[type, ...] = tuple(
    t
    for t in (
        lax.Precision,
        getattr(lax, "DotAlgorithm", None),
        getattr(lax, "DotAlgorithmPreset", None),
    )
    if isinstance(t, type)
)


def precision(where: str, value: Any) -> PrecisionLike:
    """Returns `value` as `jax.lax` takes it; raises unless it is a precision (or None).

    Accepts None, a `jax.lax.Precision` or its name (``"highest"``), a pair of those (one per
    operand), or a `jax.lax.DotAlgorithm`/`DotAlgorithmPreset`.
    """

    def one(p: Any) -> Any:
        if isinstance(p, _PRECISION_TYPES):
            return p
        if isinstance(p, str):
            try:
                return lax.Precision(p)
            except ValueError:
                pass
        raise TypeError(
            f"{where}: precision must be None, a jax.lax.Precision (e.g. "
            f"jax.lax.Precision.HIGHEST) or its name ('default', 'high', 'highest'), or a pair "
            f"of them; got {value!r}."
        )

    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (one(value[0]), one(value[1]))
    return one(value)


def sharding(where: str, name: str, value: Any, ndim: int) -> tuple[str | None, ...] | None:
    """Returns `value` as a tuple; raises unless it is None or `ndim` axis names (str or None)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        names: Any = None
    else:
        names = tuple(value)
    if names is None or not all(n is None or isinstance(n, str) for n in names):
        raise TypeError(
            f"{where}: {name} must be None or a tuple of logical axis names (str, or None for a "
            f"replicated axis), one per dimension; got {value!r}."
        )
    if len(names) != ndim:
        raise ValueError(
            f"{where}: {name} names one logical axis per dimension of a {ndim}-dimensional "
            f"variable, got {len(names)}: {value!r}."
        )
    return names


def broadcasts_to(shape: Sequence[Any], target: Sequence[Any]) -> bool:
    """Whether an array of `shape` broadcasts to exactly `target` (size-1 or equal axes).

    Either shape may hold symbolic dimensions (`jax.export`'s ``b``), which NumPy's
    `np.broadcast_shapes` refuses; `jnp.broadcast_shapes` accepts them.
    """
    target = tuple(target)
    if len(shape) > len(target):
        return False
    try:
        return tuple(jnp.broadcast_shapes(tuple(shape), target)) == target
    except ValueError:
        return False


def _ints(value: Any) -> tuple[int, ...] | None:
    """`value` as a tuple of ints if it is a sequence of ints, else None."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        return None
    if not all(is_int(v) for v in value):
        return None
    return tuple(int(v) for v in value)


def window(where: str, name: str, value: Any, max_axes: int | None = None) -> tuple[int, ...]:
    """Returns a window (``kernel_size``) as a tuple of positive ints, one per spatial axis.

    An int is a window over one spatial axis (as Flax Linen reads ``Conv``'s ``kernel_size``).
    """
    sizes = (int(value),) if is_int(value) else _ints(value)
    if sizes is None:
        raise TypeError(
            f"{where}: {name} must be an int or a tuple of ints, one per spatial axis, got "
            f"{value!r}."
        )
    if not sizes or (max_axes is not None and len(sizes) > max_axes):
        allowed = "1, 2 or 3" if max_axes == 3 else "at least 1"
        raise ValueError(
            f"{where}: {name} {value!r} has {len(sizes)} entries; it must have {allowed} (one per "
            f"spatial axis), e.g. {name}=(3, 3) for images."
        )
    if not all(k >= 1 for k in sizes):
        raise ValueError(f"{where}: every entry of {name} must be >= 1, got {value!r}.")
    return sizes


def per_axis(where: str, name: str, value: Any, num_spatial: int) -> tuple[int, ...]:
    """Returns `value` (an int for every axis, or one per axis) as `num_spatial` positive ints."""
    values = (int(value),) * num_spatial if is_int(value) else _ints(value)
    if values is None:
        raise TypeError(
            f"{where}: {name} must be an int or a tuple of {num_spatial} ints, got {value!r}."
        )
    if len(values) != num_spatial:
        raise ValueError(
            f"{where}: {name}={value!r} has {len(values)} entries but kernel_size has "
            f"{num_spatial} spatial axes; give one per axis, or a single int for all of them."
        )
    if not all(v >= 1 for v in values):
        raise ValueError(f"{where}: every entry of {name} must be >= 1, got {value!r}.")
    return values


def padding(where: str, value: Any, num_spatial: int, allowed: tuple[str, ...]) -> CanonicalPadding:
    """Returns a padding name (upper case) or one ``(low, high)`` pair per spatial axis.

    Accepts one of the `allowed` names (any case), an int for every side, or one entry per
    spatial axis, each an int or a ``(low, high)`` pair.
    """
    names = ", ".join(repr(a) for a in allowed)
    if isinstance(value, str):
        name = value.upper()
        if name not in allowed:
            raise ValueError(
                f"{where}: unknown padding {value!r}; use one of {names}, an int, or one "
                f"(low, high) pair per spatial axis."
            )
        if name == "CAUSAL" and num_spatial != 1:
            raise ValueError(
                f"{where}: padding='CAUSAL' is only defined for 1-D convolutions, but "
                f"kernel_size has {num_spatial} spatial axes; pad explicitly with (low, high) "
                f"pairs instead."
            )
        return name
    if is_int(value):
        return ((int(value), int(value)),) * num_spatial
    bad = TypeError(
        f"{where}: padding must be one of {names}, an int, or a sequence of {num_spatial} "
        f"entries (one per spatial axis), each an int or a (low, high) pair of ints; got "
        f"{value!r}."
    )
    if not isinstance(value, Sequence):
        raise bad
    pairs = []
    for p in value:
        pair = (int(p), int(p)) if is_int(p) else _ints(p)
        if pair is None or len(pair) != 2:
            raise bad
        pairs.append(pair)
    if len(pairs) != num_spatial:
        raise ValueError(
            f"{where}: padding {value!r} has {len(pairs)} (low, high) pairs but kernel_size "
            f"has {num_spatial} spatial axes; give exactly one pair per spatial axis."
        )
    return tuple(pairs)


def check_window_fits(
    where: str,
    shape: tuple[int, ...],
    window_: tuple[int, ...],
    dilation: tuple[int, ...],
    padding_: CanonicalPadding,
) -> None:
    """Raises unless each spatial axis of an input of `shape` holds at least one window.

    The spatial axes are the ``len(window_)`` axes before the last. With ``"VALID"`` (or
    explicit pairs) a window larger than the (padded) input would give an empty output.
    """
    n = len(window_)
    spatial = shape[len(shape) - n - 1 : -1]
    for axis, (size, k, d) in enumerate(zip(spatial, window_, dilation, strict=True)):
        span = (k - 1) * d + 1
        if isinstance(padding_, str):
            padded, how = size, f"padding={padding_!r}"
            needed = span if padding_ == "VALID" else 1
        else:
            low, high = padding_[axis]
            padded, how = size + low + high, f"padding {padding_[axis]}"
            needed = span
        if padded < needed:
            if needed == 1:
                raise ValueError(
                    f"{where} got an input of shape {shape}: spatial axis {axis} has size "
                    f"{size}, so the output would be empty. Pass an input with at least one "
                    f"position on every spatial axis."
                )
            dilated = f" (kernel {k} with dilation {d})" if d != 1 else ""
            raise ValueError(
                f"{where} got an input of shape {shape}: spatial axis {axis} has size {size} "
                f"({how}), smaller than the window {span}{dilated}, so the output would be "
                f"empty. Pass a larger input, a smaller window, or padding='SAME'."
            )


def check_last_axis(
    where: str | Callable[[], str],
    x: Any,
    expected: int,
    setting: str,
    what: str = "an input",
    hint: str = "",
) -> tuple[int, ...]:
    """Returns the shape of `x`; raises `ValueError` unless its last axis has size `expected`.

    Args:
        where: The layer, as messages name it (with its settings: ``"Dense(in_size=4, ...)"``),
            or a function that returns it, so that a layer's call formats it only on error.
        x: The input.
        expected: The size the layer was built for.
        setting: The name of the layer's setting that holds `expected` (``"in_size"``).
        what: The input, as the message names it (``"an input"``, ``"inputs_q"``).
        hint: A sentence appended to the message.
    """
    try:
        shape = tuple(x.shape)
    except AttributeError:
        shape = tuple(jnp.shape(x))
    if shape[-1:] != (expected,):
        if shape:
            got = f"got {shape[-1]}"
            fix = f", or build the layer with {setting}={shape[-1]}"
        else:
            got, fix = "but a scalar has none", ""
        raise ValueError(
            f"{where() if callable(where) else where} got {what} of shape {shape}: its last axis "
            f"must be {setting}={expected}, {got}. Pass {what} of shape (..., {expected}){fix}."
            f"{hint and ' ' + hint}"
        )
    return shape
