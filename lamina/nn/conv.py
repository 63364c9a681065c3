"""Convolutions: `Conv` and `ConvTranspose`, channels last, over 1, 2 or 3 spatial axes."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.module import Module
from .._core.variables import Initializer, Parameter
from . import _checks

PaddingLike = str | int | Sequence[int | Sequence[int]]
# What the kernels receive: a padding name, or one (low, high) pair per spatial axis.
CanonicalPadding = _checks.CanonicalPadding

_CONV_PADDINGS = ("SAME", "VALID", "CIRCULAR", "REFLECT", "CAUSAL")
_CONV_TRANSPOSE_PADDINGS = ("SAME", "VALID", "CIRCULAR")


def _dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    # Channels last: NHWC input and output, HWIO kernel (Linen's `_conv_dimension_numbers`).
    lhs = (0, ndim - 1, *range(1, ndim - 1))
    rhs = (ndim - 1, ndim - 2, *range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def _flatten_batch(x: jax.Array, num_spatial: int) -> tuple[jax.Array, tuple[int, ...]]:
    # Any number of leading batch axes (none included) becomes exactly one, as in Linen.
    batch_shape = x.shape[: x.ndim - num_spatial - 1]
    return jnp.reshape(x, (math.prod(batch_shape), *x.shape[len(batch_shape) :])), batch_shape


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


@functools.partial(
    jax.jit, static_argnames=("dtype", "strides", "padding", "dilation", "groups", "precision")
)
def conv(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    dtype: Any,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    groups: int = 1,
    precision: Any = None,
) -> jax.Array:
    """Convolves `x` (``(*batch, *spatial, in)``) with `kernel` (``(*window, in // groups, out)``).

    `padding` is ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ``"REFLECT"``, ``"CAUSAL"`` (1-D) or
    one ``(low, high)`` pair per spatial axis; the arithmetic is Flax Linen's ``Conv``.
    """
    num_spatial = kernel.ndim - 2
    x, batch_shape = _flatten_batch(jnp.asarray(x, dtype), num_spatial)
    kernel = jnp.asarray(kernel, dtype)
    if padding in ("CIRCULAR", "REFLECT"):
        window = [(k - 1) * d + 1 for k, d in zip(kernel.shape[:-2], dilation, strict=True)]
        pads = [(0, 0), *(((w - 1) // 2, w // 2) for w in window), (0, 0)]
        x = jnp.pad(x, pads, mode="wrap" if padding == "CIRCULAR" else "reflect")
        padding = "VALID"
    elif padding == "CAUSAL":
        x = jnp.pad(x, [(0, 0), (dilation[0] * (kernel.shape[0] - 1), 0), (0, 0)])
        padding = "VALID"
    y = lax.conv_general_dilated(
        x,
        kernel,
        strides,
        padding,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(x.ndim),
        feature_group_count=groups,
        precision=precision,
    )
    y = _add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
    return jnp.reshape(y, batch_shape + y.shape[1:])


@functools.partial(
    jax.jit,
    static_argnames=("dtype", "strides", "padding", "dilation", "transpose_kernel", "precision"),
)
def conv_transpose(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    dtype: Any,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    transpose_kernel: bool = False,
    precision: Any = None,
) -> jax.Array:
    """The transposed convolution of `x` (``(*batch, *spatial, in)``), as Linen computes it.

    `kernel` is ``(*window, in, out)``, or ``(*window, out, in)`` with `transpose_kernel`;
    `padding` is ``"SAME"``, ``"VALID"``, ``"CIRCULAR"`` or one ``(low, high)`` pair per axis.
    """
    num_spatial = kernel.ndim - 2
    x, batch_shape = _flatten_batch(jnp.asarray(x, dtype), num_spatial)
    kernel = jnp.asarray(kernel, dtype)
    y = lax.conv_transpose(
        x,
        kernel,
        strides,
        "VALID" if padding == "CIRCULAR" else padding,
        rhs_dilation=dilation,
        transpose_kernel=transpose_kernel,
        precision=precision,
    )
    if padding == "CIRCULAR":
        # Linen's periodic wrap: pad each spatial axis to a whole number of periods (input size
        # times stride), aligned so the input starts on a period boundary, then fold and sum.
        periods = [n * s for n, s in zip(x.shape[1:-1], strides, strict=True)]
        diffs = [-(m - p) % (2 * p) for m, p in zip(y.shape[1:-1], periods, strict=True)]
        if transpose_kernel:
            pads = [(d // 2, (d + 1) // 2) for d in diffs]
        else:
            pads = [((d + 1) // 2, d // 2) for d in diffs]
        y = jnp.pad(y, [(0, 0), *pads, (0, 0)])
        for i in range(1, y.ndim - 1):
            y = jnp.reshape(y, (*y.shape[:i], -1, periods[i - 1], *y.shape[i + 1 :]))
            y = y.sum(axis=i)
    y = _add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
    return jnp.reshape(y, batch_shape + y.shape[1:])


def _layer_name(layer: str, in_size: Any, out_size: Any, kernel_size: Any) -> str:
    return f"{layer}(in_size={in_size!r}, out_size={out_size!r}, kernel_size={kernel_size!r})"


class _Convolution(Module):
    """What `Conv` and `ConvTranspose` share: their settings, their weights, and the checks."""

    in_size = _checks.Setting()
    out_size = _checks.Setting()
    kernel_size = _checks.Setting()
    strides = _checks.Setting()
    padding = _checks.Setting()
    dilation = _checks.Setting()
    use_bias = _checks.Setting()
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
        where = _layer_name(type(self).__name__, in_size, out_size, kernel_size)
        self.in_size = _checks.positive_int(where, "in_size", in_size)
        self.out_size = _checks.positive_int(where, "out_size", out_size)
        self.kernel_size = _checks.window(where, "kernel_size", kernel_size, max_axes=3)
        n = len(self.kernel_size)
        self.strides = _checks.per_axis(where, "strides", strides, n)
        self.padding = _checks.padding(where, padding, n, paddings)
        self.dilation = _checks.per_axis(where, "dilation", dilation, n)

    def _declare_weights(
        self,
        channels: tuple[int, int],
        use_bias: Any,
        kernel_init: Any,
        bias_init: Any,
        dtype: Any,
        param_dtype: Any,
        precision: Any,
        kernel_sharding: Any,
        bias_sharding: Any,
    ) -> None:
        """Declares ``kernel`` (``kernel_size + channels``) and, with `use_bias`, ``bias``."""
        where = self._describe()
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.dtype = _checks.inexact_dtype(where, "dtype", dtype)
        self.param_dtype = _checks.storage_dtype(where, param_dtype, self.dtype)
        self.precision = _checks.precision(where, precision)
        shape = (*self.kernel_size, *channels)
        self.kernel = Parameter(
            shape,
            _checks.initializer(where, "kernel_init", kernel_init),
            self.dtype,
            self.param_dtype,
            sharding=_checks.sharding(where, "kernel_sharding", kernel_sharding, len(shape)),
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

    def _describe(self) -> str:
        return _layer_name(type(self).__name__, self.in_size, self.out_size, self.kernel_size)

    def _check_input(self, x: Any, *, transposed: bool = False) -> None:
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
        if not transposed:
            where = self._describe()
            _checks.check_window_fits(where, shape, self.kernel_size, self.dilation, self.padding)
            return
        # A transposed convolution of a non-empty input is non-empty, except with explicit
        # negative padding (lax.conv_transpose pads the stride-dilated input).
        _checks.check_window_fits(self._describe(), shape, self.kernel_size, self.dilation, "SAME")
        if isinstance(self.padding, str):
            return
        spatial = shape[-n - 1 : -1]
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


class Conv(_Convolution):
    """A convolution over 1, 2 or 3 spatial axes, channels last (Flax Linen's ``Conv``).

    The number of spatial axes is ``len(kernel_size)``. The input has shape
    ``(*batch, *spatial, in_size)``: as in Linen, any number of leading batch axes is accepted,
    one, several (flattened for the convolution and restored) or none (a single example).
    Variables are Linen's: ``kernel`` of shape ``kernel_size + (in_size // groups, out_size)``,
    ``bias`` of shape ``(out_size,)``.

    Args:
        in_size: Number of input channels (the last axis).
        out_size: Number of output channels (filters).
        kernel_size: Window size, one int per spatial axis (an int means a 1-D window).
        strides: Step between windows: an int for every axis or one per axis.
        padding: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"`` (periodic), ``"REFLECT"``,
            ``"CAUSAL"`` (1-D, left padding only), an int for every side, or one entry per
            spatial axis, each an int or a ``(low, high)`` pair. Strings are case-insensitive.
        dilation: Kernel dilation (atrous convolution): an int or one per axis.
        groups: Number of feature groups (Linen's ``feature_group_count``); must divide
            `in_size` and `out_size`. ``groups=in_size`` is a depthwise convolution.
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (the input, kernel and bias are cast to it).
        param_dtype: Storage dtype of the variables (default: `dtype`).
        precision: `jax.lax.Precision` of the convolution.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis name of the bias, e.g. ``("mlp",)``.

    Everything after `kernel_size` is keyword-only, and the settings are read-only once the
    layer is built. A ``"VALID"`` (or explicitly padded) window larger than the input is an
    error, not an empty output.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Conv(1, 32, kernel_size=(3, 3), strides=(1, 1)))
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (32,), 'kernel': (3, 3, 1, 32)}}
        >>> apply(variables, None, jnp.ones((8, 28, 28, 1)))[0].shape
        (8, 28, 28, 32)
    """

    groups = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        out_size: int,
        kernel_size: int | Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        precision: Any = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(in_size, out_size, kernel_size, strides, padding, dilation, _CONV_PADDINGS)
        where = self._describe()
        self.groups = _checks.positive_int(where, "groups", groups)
        in_size, out_size = self.in_size, self.out_size
        if in_size % self.groups or out_size % self.groups:
            raise ValueError(
                f"{where}: groups={groups} must divide both in_size={in_size} and "
                f"out_size={out_size}; choose a groups that divides both (groups=1 for an "
                f"ordinary convolution, groups=in_size for a depthwise one)."
            )
        self._declare_weights(
            (in_size // self.groups, out_size),
            use_bias,
            kernel_init,
            bias_init,
            dtype,
            param_dtype,
            precision,
            kernel_sharding,
            bias_sharding,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Convolves `x` of shape ``(*batch, *spatial, in_size)``."""
        self._check_input(x)
        bias = self.bias.value if self.bias is not None else None
        return conv(
            x,
            self.kernel.value,
            bias,
            self.kernel.dtype,
            self.strides,
            self.padding,
            self.dilation,
            self.groups,
            self.precision,
        )


class ConvTranspose(_Convolution):
    """A transposed convolution over 1, 2 or 3 spatial axes (Flax Linen's ``ConvTranspose``).

    It computes what Linen computes (``jax.lax.conv_transpose``, and Linen's periodic wrap for
    ``"CIRCULAR"``), with the same variables: ``kernel`` of shape
    ``kernel_size + (in_size, out_size)``, or ``kernel_size + (out_size, in_size)`` when
    `transpose_kernel` is set, and ``bias`` of shape ``(out_size,)``. The input has shape
    ``(*batch, *spatial, in_size)`` with any number of leading batch axes, none included.

    Args:
        in_size: Number of input channels (the last axis).
        out_size: Number of output channels.
        kernel_size: Window size, one int per spatial axis (an int means a 1-D window).
        strides: Upsampling factor: an int for every axis or one per axis.
        padding: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"`` (periodic), an int for every side,
            or one entry per spatial axis, each an int or a ``(low, high)`` pair; as in
            ``jax.lax.conv_transpose``, pairs pad the stride-dilated input.
        dilation: Kernel dilation: an int or one per axis.
        use_bias: Whether to add a bias.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (the input, kernel and bias are cast to it).
        param_dtype: Storage dtype of the variables (default: `dtype`).
        precision: `jax.lax.Precision` of the convolution.
        transpose_kernel: Flip the kernel's spatial axes and swap its channel axes, so that with
            a `Conv`'s kernel this layer computes that convolution's gradient.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis name of the bias.

    Everything after `kernel_size` is keyword-only, and the settings are read-only once the
    layer is built.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.ConvTranspose(16, 8, kernel_size=(3, 3), strides=2)
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> variables["params"]["kernel"].shape
        (3, 3, 16, 8)
        >>> apply(variables, None, jnp.ones((2, 7, 7, 16)))[0].shape
        (2, 14, 14, 8)
    """

    transpose_kernel = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        out_size: int,
        kernel_size: int | Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        dilation: int | Sequence[int] = 1,
        use_bias: bool = True,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        precision: Any = None,
        transpose_kernel: bool = False,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        paddings = _CONV_TRANSPOSE_PADDINGS
        super().__init__(in_size, out_size, kernel_size, strides, padding, dilation, paddings)
        self.transpose_kernel = _checks.flag(self._describe(), "transpose_kernel", transpose_kernel)
        in_size, out_size = self.in_size, self.out_size
        self._declare_weights(
            (out_size, in_size) if self.transpose_kernel else (in_size, out_size),
            use_bias,
            kernel_init,
            bias_init,
            dtype,
            param_dtype,
            precision,
            kernel_sharding,
            bias_sharding,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the transposed convolution to `x` of shape ``(*batch, *spatial, in_size)``."""
        self._check_input(x, transposed=True)
        bias = self.bias.value if self.bias is not None else None
        return conv_transpose(
            x,
            self.kernel.value,
            bias,
            self.kernel.dtype,
            self.strides,
            self.padding,
            self.dilation,
            self.transpose_kernel,
            self.precision,
        )
