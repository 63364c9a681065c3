"""What the convolutions share: the `Convolution` base class and the kernels' common steps.

`Conv` and `ConvTranspose` (in `conv`) and `ConvLocal` (in `conv_local`) are channels last,
over 1-3 spatial axes, as Flax Linen's. Here: their settings, weights and input checks
(`Convolution`), and the steps of their compiled kernels (flattening the batch, padding,
masking the kernel, the sharded ``lax.conv_general_dilated`` call, the bias).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from .._core.variables import Parameter
from ..sharding.explicit import result_sharding
from . import _checks, _dtypes

# What the kernels receive: a padding name, or one (low, high) pair per spatial axis.
CanonicalPadding = _checks.CanonicalPadding


CONV_PADDINGS = ("SAME", "VALID", "CIRCULAR", "REFLECT", "CAUSAL")


def dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """Channels last: NHWC input and output, HWIO kernel (Linen's `_conv_dimension_numbers`)."""
    lhs = (0, ndim - 1, *range(1, ndim - 1))
    rhs = (ndim - 1, ndim - 2, *range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def convolve(
    x: jax.Array,
    kernel: jax.Array,
    strides: Sequence[int],
    padding: CanonicalPadding,
    *,
    input_dilation: Sequence[int] | None,
    dilation: Sequence[int],
    groups: int,
    precision: PrecisionLike,
) -> jax.Array:
    """``lax.conv_general_dilated`` channels last, with the result's sharding on explicit axes.

    `x` is ``(batch, *spatial, in)``, `kernel` ``(*window, in // groups, out)``. On a mesh with
    explicit axes the result is ``(batch, *spatial, out)`` sharded as `result_sharding` says:
    the batch as `x`'s, the spatial axes whole, the features as the kernel's last axis (a
    sharded input-channel axis is summed across its devices); elsewhere JAX's default.
    """
    space = range(x.ndim - 2)
    out = result_sharding(
        ("batch", *(("y", i) for i in space), "features"),
        (x, ("batch", *(("x", i) for i in space), "in")),
        (kernel, (*(("window", i) for i in space), "in", "features")),
    )
    return lax.conv_general_dilated(
        x,
        kernel,
        strides,
        padding,
        lhs_dilation=input_dilation,
        rhs_dilation=dilation,
        dimension_numbers=dimension_numbers(x.ndim),
        feature_group_count=groups,
        precision=precision,
        out_sharding=out,
    )


def flatten_batch(x: jax.Array, num_spatial: int) -> tuple[jax.Array, tuple[int, ...]]:
    """Any number of leading batch axes (none included) made exactly one, as in Linen.

    Returns the reshaped `x` and the batch shape it had.
    """
    batch_shape = x.shape[: x.ndim - num_spatial - 1]
    return jnp.reshape(x, (math.prod(batch_shape), *x.shape[len(batch_shape) :])), batch_shape


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """`y` plus a bias of the output channels, or (a local convolution's) of every position."""
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)


def masked_kernel(kernel: jax.Array, mask: jax.Array | None, dtype: Dtype) -> jax.Array:
    """Linen's ``kernel * mask`` (in their promoted dtype), then cast to the compute `dtype`."""
    if mask is None:
        return jnp.asarray(kernel, dtype)
    wide = _dtypes.compute_dtype("mask", None, kernel, mask)
    return jnp.asarray(kernel.astype(wide) * mask.astype(wide), dtype)


def pad_input(
    x: jax.Array,
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None,
) -> tuple[jax.Array, CanonicalPadding]:
    """Pads `x` for the paddings that lax lacks (Linen's way); returns it and lax's padding.

    With an input dilation, lax takes only explicit pairs: a name is turned into the pairs it
    means for the dilated input (Linen raises there).
    """
    if padding in ("CIRCULAR", "REFLECT"):
        spans = [(k - 1) * d + 1 for k, d in zip(window, dilation, strict=True)]
        pads = [(0, 0), *(((w - 1) // 2, w // 2) for w in spans), (0, 0)]
        x, padding = jnp.pad(x, pads, mode="wrap" if padding == "CIRCULAR" else "reflect"), "VALID"
    elif padding == "CAUSAL":
        x, padding = jnp.pad(x, [(0, 0), (dilation[0] * (window[0] - 1), 0), (0, 0)]), "VALID"
    if isinstance(padding, str) and input_dilation and any(d != 1 for d in input_dilation):
        sizes = [(n - 1) * d + 1 for n, d in zip(x.shape[1:-1], input_dilation, strict=True)]
        spans = [(k - 1) * d + 1 for k, d in zip(window, dilation, strict=True)]
        pads = lax.padtype_to_pads(sizes, spans, strides, padding)
        padding = tuple((int(lo), int(hi)) for lo, hi in pads)
    return x, padding


def layer_name(layer: str, in_size: Any, out_size: Any, kernel_size: Any) -> str:
    """How a convolution names itself in messages: ``Conv(in_size=..., out_size=..., ...)``."""
    return f"{layer}(in_size={in_size!r}, out_size={out_size!r}, kernel_size={kernel_size!r})"


def kernel_mask(where: str, value: Any, shape: tuple[int, ...]) -> jax.Array | None:
    """`mask` as a (concrete, immutable) array of the kernel's `shape`, or None."""
    if value is None:
        return None
    try:
        mask = np.array(value)
    except Exception:  # a tracer, or something that is no array
        mask = None
    if mask is None or not (mask.dtype == np.bool_ or jnp.issubdtype(mask.dtype, jnp.number)):
        raise TypeError(
            f"{where}: mask must be a concrete array of numbers or booleans of the kernel's "
            f"shape {shape} (it multiplies the kernel), got {type(value).__name__} {value!r}."
        )
    if mask.shape != shape:
        raise ValueError(
            f"{where}: mask has shape {mask.shape} but the kernel has shape {shape}; the mask "
            f"multiplies the kernel, so give it the kernel's shape."
        )
    return jnp.asarray(mask)  # immutable (a NumPy array would be copied writeable)


class Convolution(Module):
    """What the convolutions share: their settings, their weights, and the checks."""

    in_size = _checks.Setting()
    out_size = _checks.Setting()
    kernel_size = _checks.Setting()
    strides = _checks.Setting()
    padding = _checks.Setting()
    dilation = _checks.Setting()
    use_bias = _checks.Setting()
    mask = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()
    precision = _checks.Setting()

    def __init__(
        self,
        in_size: Any,
        out_size: Any,
        kernel_size: Any,
        strides: Any,
        padding: Any,
        dilation: Any,
        paddings: tuple[str, ...],
    ):
        super().__init__()
        where = layer_name(type(self).__name__, in_size, out_size, kernel_size)
        self.in_size = _checks.positive_int(where, "in_size", in_size)
        self.out_size = _checks.positive_int(where, "out_size", out_size)
        self.kernel_size = _checks.window(where, "kernel_size", kernel_size, max_axes=3)
        n = len(self.kernel_size)
        self.strides = _checks.per_axis(where, "strides", strides, n)
        self.padding = _checks.padding(where, padding, n, paddings)
        self.dilation = _checks.per_axis(where, "dilation", dilation, n)

    def _declare_weights(
        self,
        kernel_shape: tuple[int, ...],
        bias_shape: tuple[int, ...],
        use_bias: Any,
        mask: Any,
        kernel_init: Initializer,
        bias_init: Initializer,
        dtype: Dtype,
        param_dtype: Dtype,
        precision: PrecisionLike,
        kernel_sharding: Any,
        bias_sharding: Any,
    ) -> None:
        """Declares ``kernel`` and, with `use_bias`, ``bias``; checks the `mask` of the kernel."""
        where = self._describe()
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.mask = kernel_mask(where, mask, kernel_shape)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        self.kernel = Parameter(
            kernel_shape,
            _checks.initializer(where, "kernel_init", kernel_init),
            self.dtype,
            self.param_dtype,
            sharding=_checks.sharding(where, "kernel_sharding", kernel_sharding, len(kernel_shape)),
        )
        bias_init = _checks.initializer(where, "bias_init", bias_init)
        bias_sharding = _checks.sharding(where, "bias_sharding", bias_sharding, len(bias_shape))
        self.bias = (
            Parameter(bias_shape, bias_init, self.dtype, self.param_dtype, sharding=bias_sharding)
            if self.use_bias
            else None
        )

    def _weights(self, x: Any) -> tuple[jax.Array, jax.Array | None, Any]:
        """The kernel and bias values, and the compute dtype.

        With ``dtype=None``, the promotion of the input, the variables and the mask: Linen
        promotes ``kernel * mask``.
        """
        kernel = self.kernel.value
        bias = self.bias.value if self.bias is not None else None
        return kernel, bias, _dtypes.compute_dtype(self, self.dtype, x, kernel, bias, self.mask)

    def _describe(self) -> str:
        return layer_name(type(self).__name__, self.in_size, self.out_size, self.kernel_size)

    def _check_input(
        self,
        x: Any,
        *,
        input_dilation: tuple[int, ...] | None = None,
        transposed: bool = False,
        spatial_shape: tuple[int, ...] | None = None,
    ) -> None:
        shape, n = tuple(jnp.shape(x)), len(self.kernel_size)
        if len(shape) < n + 1:
            axes = ", ".join(["spatial"] * n)
            raise ValueError(
                f"{self._describe()} got input of shape {shape}: a kernel with {n} spatial axes "
                f"needs input of shape (batch..., {axes}, {self.in_size}), channels last, of "
                f"rank at least {n + 1}."
            )
        hint = "Inputs are channels last."
        _checks.check_last_axis(self._describe, x, self.in_size, "in_size", hint=hint)
        spatial = shape[-n - 1 : -1]
        if spatial_shape is not None and spatial != spatial_shape:
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: its spatial axes must have "
                f"the sizes spatial_shape={spatial_shape} that the layer's weights (one kernel "
                f"per output position) were built for, got {spatial}. Pass inputs of those "
                f"sizes, or build a layer for these."
            )
        if not transposed:
            where = self._describe()
            if input_dilation and input_dilation != (1,) * n:
                # The window must fit the dilated input: (size - 1) * input_dilation + 1.
                where = f"{where} (input_dilation={input_dilation} dilates the input)"
                dilated = (
                    max(0, (m - 1) * d + 1) for m, d in zip(spatial, input_dilation, strict=True)
                )
                shape = (*shape[: -n - 1], *dilated, shape[-1])
            _checks.check_window_fits(where, shape, self.kernel_size, self.dilation, self.padding)
            return
        # A transposed convolution of a non-empty input is non-empty, except with explicit
        # negative padding (lax.conv_transpose pads the stride-dilated input).
        _checks.check_window_fits(self._describe(), shape, self.kernel_size, self.dilation, "SAME")
        if isinstance(self.padding, str):
            return
        for axis, (size, k, s, d, (lo, hi)) in enumerate(
            zip(spatial, self.kernel_size, self.strides, self.dilation, self.padding, strict=True)
        ):
            out = (size - 1) * s + 1 + lo + hi - ((k - 1) * d + 1) + 1
            if out < 1:
                raise ValueError(
                    f"{self._describe()} got an input of shape {shape}: with padding "
                    f"{(lo, hi)} on spatial axis {axis}, the output would have {out} positions "
                    f"there. Use padding='SAME' or 'VALID', or less negative padding."
                )
