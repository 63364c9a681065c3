"""Convolutions `Conv` and `ConvTranspose`, channels last, over 1-3 spatial axes (Flax Linen's).

Their compiled kernels are `conv` and `conv_transpose`; what they share with `ConvLocal` is
in `convolution`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.types import Dtype, Initializer, PaddingLike, PrecisionLike
from ..sharding.explicit import gather_axis
from . import _checks
from .convolution import (
    CONV_PADDINGS,
    CanonicalPadding,
    Convolution,
    add_bias,
    convolve,
    flatten_batch,
    masked_kernel,
    pad_input,
)

_CONV_TRANSPOSE_PADDINGS = ("SAME", "VALID", "CIRCULAR")


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
    dtype: Dtype,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None = None,
    groups: int = 1,
    precision: PrecisionLike = None,
) -> jax.Array:
    """Convolves `x` (``(*batch, *spatial, in)``) with `kernel` (``(*window, in // groups, out)``).

    `padding` is ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ``"REFLECT"``, ``"CAUSAL"`` (1-D) or
    one ``(low, high)`` pair per spatial axis; `mask` (None, or the kernel's shape) multiplies
    the kernel; `input_dilation` dilates `x` (None: 1). The arithmetic is Flax Linen's ``Conv``.
    """
    window = kernel.shape[:-2]
    x, batch_shape = flatten_batch(jnp.asarray(x, dtype), len(window))
    kernel = masked_kernel(kernel, mask, dtype)
    if groups > 1:
        x, kernel = gather_axis(x, -1, groups), gather_axis(kernel, -1, groups)
    x, padding = pad_input(x, window, strides, padding, dilation, input_dilation)
    y = convolve(
        x,
        kernel,
        strides,
        padding,
        input_dilation=input_dilation,
        dilation=dilation,
        groups=groups,
        precision=precision,
    )
    y = add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
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
    dtype: Dtype,
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    transpose_kernel: bool = False,
    precision: PrecisionLike = None,
) -> jax.Array:
    """The transposed convolution of `x` (``(*batch, *spatial, in)``), as Linen computes it.

    `kernel` is ``(*window, in, out)``, or ``(*window, out, in)`` with `transpose_kernel`;
    `mask` (None, or the kernel's shape) multiplies it; `padding` is ``"SAME"``, ``"VALID"``,
    ``"CIRCULAR"`` or one ``(low, high)`` pair per axis.
    """
    num_spatial = kernel.ndim - 2
    x, batch_shape = flatten_batch(jnp.asarray(x, dtype), num_spatial)
    kernel, window = masked_kernel(kernel, mask, dtype), kernel.shape[:-2]
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
    y = convolve(
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
    y = add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
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


class Conv(Convolution):
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

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

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
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(in_size, out_size, kernel_size, strides, padding, dilation, CONV_PADDINGS)
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


class ConvTranspose(Convolution):
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

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

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
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
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
