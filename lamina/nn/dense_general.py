"""`DenseGeneral`: a linear map over any axes of its input, Flax Linen's ``DenseGeneral``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from . import _checks, _dtypes
from ._projections import contract, declare


def _ints(value: Any) -> tuple[int, ...] | None:
    """`value` as a tuple of ints if it is an int or a sequence of ints, else None."""
    if _checks.is_int(value):
        return (int(value),)
    if isinstance(value, str) or not isinstance(value, Sequence):
        return None
    if not all(_checks.is_int(v) for v in value):
        return None
    return tuple(int(v) for v in value)


def _sizes(where: str, name: str, value: Any, meaning: str, empty: bool = False) -> tuple[int, ...]:
    """`value` (an int, or a sequence of them, each >= 1) as a tuple of ints.

    Empty only with `empty` (`batch_shape`).
    """
    sizes = _ints(value)
    if sizes is None or not (sizes or empty):
        raise _checks.SettingTypeError(
            f"{where}: {name} must be a positive int or a {'' if empty else 'non-empty '}tuple "
            f"of them ({meaning}), got {value!r}."
        )
    if sizes and min(sizes) < 1:
        raise ValueError(f"{where}: every entry of {name} must be >= 1 ({meaning}), got {value!r}.")
    return tuple(int(s) for s in sizes)


def _axes(where: str, value: Any) -> tuple[int, ...]:
    """`axis` (an int or a non-empty sequence of distinct ints) as a tuple of ints."""
    axes = _ints(value)
    if axes is None or not axes:
        raise _checks.SettingTypeError(
            f"{where}: axis must be an int or a non-empty tuple of ints (the input axes to "
            f"contract, e.g. -1 or (-2, -1)), got {value!r}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where}: axis {value!r} names an axis twice; name each axis once.")
    return tuple(int(a) for a in axes)


def _shape_text(sizes: tuple[int, ...]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


class DenseGeneral(Module):
    """A linear map over any axes of the input, Flax Linen's ``DenseGeneral``.

    The input's axes `axis` (of sizes `in_size`) are contracted with the kernel and replaced
    by output axes of sizes `out_size`, appended last: ``x`` of shape ``(2, 3, 4)`` with
    ``DenseGeneral((3, 4), (5, 6), axis=(1, 2))`` gives ``(2, 5, 6)``. With `batch_shape`, the
    input's leading axes of those sizes are batch axes with a kernel (and bias) each.

    Variables are Linen's: ``kernel`` of shape ``batch_shape + in_size + out_size`` and
    ``bias`` of shape ``batch_shape + out_size``, initialised as Linen initialises them, as the
    ``(prod(batch_shape + in_size), prod(out_size))`` matrix (and the flat vector) reshaped, so
    fan-in and fan-out are the products of the input and output sizes.

    lamina declares every shape when the layer is built, so where Linen reads the sizes from
    the first input, they are given here: Linen's ``DenseGeneral(features, axis)`` is
    ``DenseGeneral(in_size, features, axis=axis)`` with `in_size` the sizes of the input's axes
    `axis`, and Linen's ``batch_dims=(0, ..., k - 1)`` (which must be leading axes) is
    ``batch_shape`` with the sizes of those `k` axes.

    Args:
        in_size: Sizes of the contracted input axes, one per entry of `axis`, in the order
            the axes have in the input (the kernel's order, as in Linen, which sorts `axis`);
            an int when one axis is contracted.
        out_size: Sizes of the output axes that replace them (Linen's `features`): an int or a
            tuple.
        axis: The input axes to contract: an int or a tuple (negative counts from the end).
        batch_shape: Sizes of the input's leading batch axes (default: none); each batch entry
            has its own kernel and bias.
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel (called with the flattened matrix's shape).
        bias_init: Initializer of the bias (called with the flattened vector's shape).
        dtype: Compute dtype (inputs and variables are cast to it); None infers it from the
            inputs and variables, as Linen's ``promote_dtype``.
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the contraction.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis names of the bias, one per dimension.

    Everything after the sizes is keyword-only; the settings are read-only once the layer is
    built.

    Raises:
        ValueError: A size that is not positive, `in_size` and `axis` of different lengths, an
            axis named twice; at call time, an input whose axes do not have the sizes the layer
            was built for, or an `axis` that is a batch axis or out of range.
        TypeError: A setting of the wrong type.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.DenseGeneral((3, 4), (5, 6), axis=(1, -1))
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (5, 6), 'kernel': (3, 4, 5, 6)}}
        >>> apply(variables, None, jnp.ones((2, 3, 7, 4)))[0].shape
        (2, 7, 5, 6)
    """

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

    in_size = _checks.Setting()
    out_size = _checks.Setting()
    axis = _checks.Setting()
    batch_shape = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()

    def __init__(
        self,
        in_size: int | Sequence[int],
        out_size: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        batch_shape: Sequence[int] = (),
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
        where = f"{type(self).__name__}(in_size={in_size!r}, out_size={out_size!r})"
        self.in_size = _sizes(where, "in_size", in_size, "the sizes of the contracted axes")
        self.out_size = _sizes(where, "out_size", out_size, "the sizes of the output axes")
        self.axis = _axes(where, axis)
        if len(self.axis) != len(self.in_size):
            raise ValueError(
                f"{where}: axis={axis!r} contracts {len(self.axis)} input axes but in_size "
                f"gives {len(self.in_size)} sizes; give one size per contracted axis, in the "
                f"order of the input's axes."
            )
        meaning = "the sizes of the input's leading batch axes, Linen's batch_dims"
        self.batch_shape = _sizes(where, "batch_shape", batch_shape, meaning, empty=True)
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        kernel_shape = (*self.batch_shape, *self.in_size, *self.out_size)
        bias_shape = (*self.batch_shape, *self.out_size)
        self.kernel, self.bias = declare(
            kernel_shape,
            bias_shape,
            len(self.batch_shape) + len(self.in_size),
            self.use_bias,
            _checks.initializer(where, "kernel_init", kernel_init),
            _checks.initializer(where, "bias_init", bias_init),
            self.dtype,
            self.param_dtype,
            _checks.sharding(where, "kernel_sharding", kernel_sharding, len(kernel_shape)),
            _checks.sharding(where, "bias_sharding", bias_sharding, len(bias_shape)),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Contracts the axes `axis` of `x`; returns ``(*batch, *other axes, *out_size)``."""
        axis = self._check_input(tuple(jnp.shape(x)))
        kernel = self.kernel.value
        bias = self.bias.value if self.bias is not None else None
        dtype = _dtypes.compute_dtype(self, self.dtype, x, kernel, bias)
        return contract(x, kernel, bias, axis, len(self.batch_shape), dtype, self.precision)

    def _check_input(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Returns `axis` as sorted non-negative axes of an input of `shape` (Linen's order).

        Raises `ValueError` unless they are distinct axes after the batch axes, and the input
        has the sizes the layer was built for.
        """
        n_batch, ndim = len(self.batch_shape), len(shape)
        in_range = all(-ndim <= a < ndim for a in self.axis)
        axis = tuple(sorted(a % ndim for a in self.axis)) if in_range else ()
        if not in_range or min(axis) < n_batch or len(set(axis)) != len(axis):
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: axis={self.axis} must name "
                f"{len(self.axis)} distinct axes of it after its {n_batch} leading batch axes. "
                f"Pass an input of shape (*batch_shape, ...) with batch_shape="
                f"{self.batch_shape} and the contracted axes of sizes in_size={self.in_size}."
            )
        sizes = tuple(shape[a] for a in axis)
        if shape[:n_batch] != self.batch_shape or sizes != self.in_size:
            got = f"{sizes}" + (f" and batch axes {shape[:n_batch]}" if n_batch else "")
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: its axes {axis} (axis="
                f"{_shape_text(self.axis)}) must have sizes in_size={self.in_size}"
                f"{f' and its leading axes batch_shape={self.batch_shape}' if n_batch else ''}, "
                f"got {got}. Pass an input of these sizes, or build the layer for yours."
            )
        return axis

    def _describe(self) -> str:
        sizes = [f"in_size={_shape_text(self.in_size)}", f"out_size={_shape_text(self.out_size)}"]
        if self.axis != (-1,):
            sizes.append(f"axis={_shape_text(self.axis)}")
        if self.batch_shape:
            sizes.append(f"batch_shape={self.batch_shape}")
        return f"{type(self).__name__}({', '.join(sizes)})"
