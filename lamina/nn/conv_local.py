"""`ConvLocal`: a convolution with a kernel per output position (Flax Linen's ``ConvLocal``).

Its compiled kernel is `conv_local`; what it shares with the other convolutions is in
`convolution`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from .. import initializers
from .._core.types import Dtype, Initializer, PaddingLike, PrecisionLike
from ..sharding.explicit import gather_axis, result_sharding
from . import _checks
from .conv import conv
from .convolution import (
    CONV_PADDINGS,
    CanonicalPadding,
    Convolution,
    add_bias,
    dimension_numbers,
    flatten_batch,
    masked_kernel,
    pad_input,
)


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
    dtype: Dtype,
    window: tuple[int, ...],
    strides: tuple[int, ...],
    padding: CanonicalPadding,
    dilation: tuple[int, ...],
    input_dilation: tuple[int, ...] | None = None,
    precision: PrecisionLike = None,
) -> jax.Array:
    """The unshared convolution of `x` (``(*batch, *spatial, in)``), Flax Linen's ``ConvLocal``.

    `kernel` is ``(*out_spatial, prod(window) * in, out)``, one matrix per output position;
    `bias` is ``(*out_spatial, out)``. The other arguments are `conv`'s.
    """
    x, batch_shape = flatten_batch(jnp.asarray(x, dtype), len(window))
    x, padding = pad_input(x, window, strides, padding, dilation, input_dilation)
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
        dimension_numbers=dimension_numbers(x.ndim),
        # lax's stubs say `Precision`; it takes a name ("highest") as well.
        precision=cast(Any, precision[0] if isinstance(precision, tuple) else precision),
    )
    kernel = masked_kernel(kernel, mask, dtype)
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
    y = add_bias(y, None if bias is None else jnp.asarray(bias, dtype))
    return jnp.reshape(y, batch_shape + y.shape[1:])


class ConvLocal(Convolution):
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

    # lm.with_policy: this __call__ casts every floating input (and variable) to the
    # layer's dtype itself, and returns that dtype, so a policy adds no casts to it.
    _lamina_casts_inputs = True

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
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        kernel_sharding: Sequence[str | None] | None = None,
        bias_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(in_size, out_size, kernel_size, strides, padding, dilation, CONV_PADDINGS)
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
