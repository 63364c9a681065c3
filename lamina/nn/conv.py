"""Convolutions: `Conv`, `ConvTranspose` and `ConvLocal`, channels last, over 1-3 spatial axes."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import initializers
from .._core.module import Module
from ..sharding.shardings import gather_axis, result_sharding
from .._core.variables import Initializer, Parameter
from . import _checks, _dtypes

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


def _convolve(
    x: jax.Array,
    kernel: jax.Array,
    strides: Sequence[int],
    padding: CanonicalPadding,
    *,
    input_dilation: Sequence[int] | None,
    dilation: Sequence[int],
    groups: int,
    precision: Any,
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
        dimension_numbers=_dimension_numbers(x.ndim),
        feature_group_count=groups,
        precision=precision,
        out_sharding=out,
    )


def _flatten_batch(x: jax.Array, num_spatial: int) -> tuple[jax.Array, tuple[int, ...]]:
    # Any number of leading batch axes (none included) becomes exactly one, as in Linen.
    batch_shape = x.shape[: x.ndim - num_spatial - 1]
    return jnp.reshape(x, (math.prod(batch_shape), *x.shape[len(batch_shape) :])), batch_shape


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    # A bias of the output channels, or (a local convolution's) of every output position.
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)


def _masked(kernel: jax.Array, mask: jax.Array | None, dtype: Any) -> jax.Array:
    # Linen's ``kernel * mask`` (in their promoted dtype), then the cast to the compute dtype.
    if mask is None:
        return jnp.asarray(kernel, dtype)
    wide = _dtypes.compute_dtype("mask", None, kernel, mask)
    return jnp.asarray(kernel.astype(wide) * mask.astype(wide), dtype)


def _pad(
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "dtype",
        "strides",
        "padding",
        "dilation",
        "input_dilation",
        "groups",
        "precision",
    ),
)
def conv(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dtype: Any,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None = None,
    groups: int = 1,
    precision: Any = None,
) -> jax.Array:
    """Convolves `x` (``(*batch, *spatial, in)``) with `kernel` (``(*window, in // groups, out)``).

    `padding` is ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ``"REFLECT"``, ``"CAUSAL"`` (1-D) or
    one ``(low, high)`` pair per spatial axis; `mask` (None, or the kernel's shape) multiplies
    the kernel; `input_dilation` dilates `x` (None: 1). The arithmetic is Flax Linen's ``Conv``.
    """
    window = kernel.shape[:-2]
    x, batch_shape = _flatten_batch(jnp.asarray(x, dtype), len(window))
    kernel = _masked(kernel, mask, dtype)
    if groups > 1:
        x, kernel = gather_axis(x, -1, groups), gather_axis(kernel, -1, groups)
    x, padding = _pad(x, window, strides, padding, dilation, input_dilation)
    y = _convolve(
        x,
        kernel,
        strides,
        padding,
        input_dilation=input_dilation,
        dilation=dilation,
        groups=groups,
        precision=precision,
    )
    y = _add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
    return jnp.reshape(y, batch_shape + y.shape[1:])


@functools.partial(
    jax.jit,
    static_argnames=(
        "dtype",
        "window",
        "strides",
        "padding",
        "dilation",
        "input_dilation",
        "precision",
    ),
)
def conv_local(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    dtype: Any,
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None = None,
    precision: Any = None,
) -> jax.Array:
    """The unshared convolution of `x` (``(*batch, *spatial, in)``), Flax Linen's ``ConvLocal``.

    `kernel` is ``(*out_spatial, prod(window) * in, out)``, one matrix per output position;
    `bias` is ``(*out_spatial, out)``. The other arguments are `conv`'s.
    """
    x, batch_shape = _flatten_batch(jnp.asarray(x, dtype), len(window))
    x, padding = _pad(x, window, strides, padding, dilation, input_dilation)
    # `lax.conv_general_dilated_local` (which takes no `out_sharding`): the patches (a
    # convolution grouped per channel, so with the channels gathered on a mesh), then one
    # matrix product per output position, sharded as `result_sharding` says.
    patches = lax.conv_general_dilated_patches(
        gather_axis(x, -1),
        window,
        strides,
        padding,
        lhs_dilation=input_dilation,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(x.ndim),
        precision=precision[0] if isinstance(precision, tuple) else precision,
    )
    kernel = _masked(kernel, mask, dtype)
    space = tuple(range(len(window)))
    p_labels = ("batch", *(("space", i) for i in space), "patch")
    k_labels = (*(("space", i) for i in space), "patch", "features")
    out = result_sharding(
        (*(("space", i) for i in space), "batch", "features"),
        (patches, p_labels),
        (kernel, k_labels),
    )
    y = lax.dot_general(
        patches,
        kernel,
        (((patches.ndim - 1,), (kernel.ndim - 2,)), (tuple(i + 1 for i in space), space)),
        precision=precision,
        out_sharding=out,
    )
    y = jnp.moveaxis(y, -2, 0)
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
    mask: jax.Array | None,
    dtype: Any,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    transpose_kernel: bool = False,
    precision: Any = None,
) -> jax.Array:
    """The transposed convolution of `x` (``(*batch, *spatial, in)``), as Linen computes it.

    `kernel` is ``(*window, in, out)``, or ``(*window, out, in)`` with `transpose_kernel`;
    `mask` (None, or the kernel's shape) multiplies it; `padding` is ``"SAME"``, ``"VALID"``,
    ``"CIRCULAR"`` or one ``(low, high)`` pair per axis.
    """
    num_spatial = kernel.ndim - 2
    x, batch_shape = _flatten_batch(jnp.asarray(x, dtype), num_spatial)
    kernel, window = _masked(kernel, mask, dtype), kernel.shape[:-2]
    if transpose_kernel:
        # The gradient of a forward convolution: its kernel with the window flipped and the
        # channel axes swapped.
        kernel = jnp.swapaxes(lax.rev(kernel, tuple(range(num_spatial))), -1, -2)
    # `lax.conv_transpose` (which takes no `out_sharding`): a convolution of the input dilated
    # by the strides, padded as it pads.
    if isinstance(padding, str):
        named = "VALID" if padding == "CIRCULAR" else padding
        spans = [(k - 1) * d + 1 if k else 0 for k, d in zip(window, dilation, strict=True)]
        lax_pads = tuple(_transpose_pads(k, s, named) for k, s in zip(spans, strides, strict=True))
    else:
        lax_pads = padding
    y = _convolve(
        x,
        kernel,
        (1,) * num_spatial,
        lax_pads,
        input_dilation=strides,
        dilation=dilation,
        groups=1,
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


def _transpose_pads(span: int, stride: int, padding: str) -> tuple[int, int]:
    # One spatial axis's (low, high) padding of `lax.conv_transpose` for a padding name; `span`
    # is the dilated window.
    if padding == "SAME":
        total = span + stride - 2
        low = span - 1 if stride > span - 1 else -(-total // 2)
    else:
        total = span + stride - 2 + max(span - stride, 0)
        low = span - 1
    return low, total - low


def _layer_name(layer: str, in_size: Any, out_size: Any, kernel_size: Any) -> str:
    return f"{layer}(in_size={in_size!r}, out_size={out_size!r}, kernel_size={kernel_size!r})"


def _mask(where: str, value: Any, shape: tuple[int, ...]) -> jax.Array | None:
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


class _Convolution(Module):
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
        kernel_shape: tuple[int, ...],
        bias_shape: tuple[int, ...],
        use_bias: Any,
        mask: Any,
        kernel_init: Any,
        bias_init: Any,
        dtype: Any,
        param_dtype: Any,
        precision: Any,
        kernel_sharding: Any,
        bias_sharding: Any,
    ) -> None:
        """Declares ``kernel`` and, with `use_bias`, ``bias``; checks the `mask` of the kernel."""
        where = self._describe()
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.mask = _mask(where, mask, kernel_shape)
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
        return _layer_name(type(self).__name__, self.in_size, self.out_size, self.kernel_size)

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
        input_dilation: Input dilation (``lhs_dilation``): an int or one per axis; ``d``
            inserts ``d - 1`` zeros between the input's positions, as a transposed convolution
            with stride ``d`` does.
        dilation: Kernel dilation (atrous convolution, Linen's ``kernel_dilation``): an int or
            one per axis.
        groups: Number of feature groups (Linen's ``feature_group_count``); must divide
            `in_size` and `out_size`. ``groups=in_size`` is a depthwise convolution.
        use_bias: Whether to add a bias.
        mask: An array of the kernel's shape that multiplies the kernel at every call (a masked
            convolution, e.g. PixelCNN's); a constant, not a variable. None: no mask.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (the input, kernel and bias are cast to it); None infers it from
            the input, the variables and the mask, as Linen's ``promote_dtype``.
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the convolution.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis name of the bias, e.g. ``("mlp",)``.

    Everything after `kernel_size` is keyword-only, and the settings are read-only once the
    layer is built. A ``"VALID"`` (or explicitly padded) window larger than the (dilated)
    input is an error, not an empty output.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> init, apply = lm.transform(lm.Conv(1, 32, kernel_size=(3, 3), strides=(1, 1)))
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (32,), 'kernel': (3, 3, 1, 32)}}
        >>> apply(variables, None, jnp.ones((8, 28, 28, 1)))[0].shape
        (8, 28, 28, 32)

        A causal 1-D convolution by a mask, and an input dilation:

        >>> mask = jnp.ones((3, 2, 4)).at[2].set(0)  # never the window's last position
        >>> layer = lm.Conv(2, 4, 3, padding="VALID", mask=mask, input_dilation=2)
        >>> y, _ = lm.transform(layer).apply(lm.transform(layer).init(jax.random.key(0)),
        ...                                  None, jnp.ones((1, 5, 2)))
        >>> y.shape  # 5 positions dilated to 9, then a VALID window of 3
        (1, 7, 4)
    """

    groups = _checks.Setting()
    input_dilation = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        out_size: int,
        kernel_size: int | Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        mask: Any = None,
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
        n = len(self.kernel_size)
        self.input_dilation = _checks.per_axis(where, "input_dilation", input_dilation, n)
        self.groups = _checks.positive_int(where, "groups", groups)
        in_size, out_size = self.in_size, self.out_size
        if in_size % self.groups or out_size % self.groups:
            raise ValueError(
                f"{where}: groups={groups} must divide both in_size={in_size} and "
                f"out_size={out_size}; choose a groups that divides both (groups=1 for an "
                f"ordinary convolution, groups=in_size for a depthwise one)."
            )
        self._declare_weights(
            (*self.kernel_size, in_size // self.groups, out_size),
            (out_size,),
            use_bias,
            mask,
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
        self._check_input(x, input_dilation=self.input_dilation)
        kernel, bias, dtype = self._weights(x)
        return conv(
            x,
            kernel,
            bias,
            self.mask,
            dtype,
            self.strides,
            self.padding,
            self.dilation,
            self.input_dilation,
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
        mask: An array of the kernel's shape that multiplies the kernel at every call; a
            constant, not a variable. None: no mask.
        kernel_init: Initializer of the kernel.
        bias_init: Initializer of the bias.
        dtype: Compute dtype (the input, kernel and bias are cast to it); None infers it from
            the input, the variables and the mask, as Linen's ``promote_dtype``.
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
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
        mask: Any = None,
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
        channels = (out_size, in_size) if self.transpose_kernel else (in_size, out_size)
        self._declare_weights(
            (*self.kernel_size, *channels),
            (out_size,),
            use_bias,
            mask,
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
        kernel, bias, dtype = self._weights(x)
        return conv_transpose(
            x,
            kernel,
            bias,
            self.mask,
            dtype,
            self.strides,
            self.padding,
            self.dilation,
            self.transpose_kernel,
            self.precision,
        )


class ConvLocal(_Convolution):
    """A locally connected layer: a convolution without weight sharing (Linen's ``ConvLocal``).

    Every output position has its own kernel (and bias): the window's ``prod(kernel_size) *
    in_size`` inputs there map to `out_size` outputs through a matrix of that position. The
    windows are `Conv`'s (the same `strides`, `padding`, `input_dilation` and `dilation`), so
    the weights depend on the number of output positions, and thus on the input's spatial
    shape: lamina declares every shape when the layer is built, so `spatial_shape` gives it
    (Linen reads it from the first input), and inputs must have it.

    Variables are Linen's: ``kernel`` of shape ``out_spatial + (prod(kernel_size) * in_size,
    out_size)`` and ``bias`` of shape ``out_spatial + (out_size,)``, with ``out_spatial`` the
    output's spatial shape (that of a `Conv` with the same settings).

    Args:
        in_size: Number of input channels (the last axis).
        out_size: Number of output channels.
        kernel_size: Window size, one int per spatial axis (an int means a 1-D window).
        spatial_shape: The input's spatial shape (the sizes of the axes between the batch
            axes and the channels): one int per spatial axis, or an int for all of them.
        strides: Step between windows: an int for every axis or one per axis.
        padding: As `Conv`'s: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ``"REFLECT"``,
            ``"CAUSAL"`` (1-D), an int, or one int or ``(low, high)`` pair per spatial axis.
        input_dilation: Input dilation: an int or one per axis.
        dilation: Kernel dilation (Linen's ``kernel_dilation``): an int or one per axis.
        use_bias: Whether to add a bias.
        mask: An array of the kernel's shape that multiplies the kernel at every call; a
            constant, not a variable. None: no mask.
        kernel_init: Initializer of the kernel (called with its full shape, as in Linen).
        bias_init: Initializer of the bias.
        dtype: Compute dtype (the input, kernel and bias are cast to it); None infers it from
            the input, the variables and the mask, as Linen's ``promote_dtype``.
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the convolution.
        kernel_sharding: Logical axis names of the kernel, one per dimension.
        bias_sharding: Logical axis names of the bias, one per dimension.

    Linen's ``feature_group_count`` is not an option: Linen's ``ConvLocal`` supports only 1.
    Everything after `spatial_shape` is keyword-only, and the settings are read-only once the
    layer is built.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> layer = lm.ConvLocal(3, 4, kernel_size=3, spatial_shape=8, padding="VALID")
        >>> init, apply = lm.transform(layer)
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables)
        {'params': {'bias': (6, 4), 'kernel': (6, 9, 4)}}
        >>> apply(variables, None, jnp.ones((2, 8, 3)))[0].shape
        (2, 6, 4)
    """

    spatial_shape = _checks.Setting()
    input_dilation = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        out_size: int,
        kernel_size: int | Sequence[int],
        spatial_shape: int | Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] = 1,
        dilation: int | Sequence[int] = 1,
        use_bias: bool = True,
        mask: Any = None,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        precision: Any = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(in_size, out_size, kernel_size, strides, padding, dilation, _CONV_PADDINGS)
        n = len(self.kernel_size)
        where = f"{super()._describe()[:-1]}, spatial_shape={spatial_shape!r})"
        self.spatial_shape = _checks.per_axis(where, "spatial_shape", spatial_shape, n)
        self.input_dilation = _checks.per_axis(where, "input_dilation", input_dilation, n)
        in_size, out_size = self.in_size, self.out_size
        example = jax.ShapeDtypeStruct((1, *self.spatial_shape, in_size), jnp.float32)
        self._check_input(example, input_dilation=self.input_dilation)
        kernel = jax.ShapeDtypeStruct((*self.kernel_size, in_size, out_size), jnp.float32)
        out = jax.eval_shape(
            functools.partial(
                conv,
                bias=None,
                mask=None,
                dtype=jnp.float32,
                strides=self.strides,
                padding=self.padding,
                dilation=self.dilation,
                input_dilation=self.input_dilation,
            ),
            example,
            kernel,
        )
        out_spatial = tuple(out.shape[1:-1])
        self._declare_weights(
            (*out_spatial, math.prod(self.kernel_size) * in_size, out_size),
            (*out_spatial, out_size),
            use_bias,
            mask,
            kernel_init,
            bias_init,
            dtype,
            param_dtype,
            precision,
            kernel_sharding,
            bias_sharding,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to `x` of shape ``(*batch, *spatial_shape, in_size)``."""
        self._check_input(x, input_dilation=self.input_dilation, spatial_shape=self.spatial_shape)
        kernel, bias, dtype = self._weights(x)
        return conv_local(
            x,
            kernel,
            bias,
            self.mask,
            dtype,
            self.kernel_size,
            self.strides,
            self.padding,
            self.dilation,
            self.input_dilation,
            self.precision,
        )

    def _describe(self) -> str:
        return f"{super()._describe()[:-1]}, spatial_shape={self.spatial_shape})"
