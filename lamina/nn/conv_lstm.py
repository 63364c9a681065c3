"""`ConvLSTMCell`: an LSTM cell whose gates are convolutions, equal to Flax Linen's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.frame import require_frame
from .._core.module import Module
from .._core.types import Dtype, PaddingLike
from ..activations import sigmoid, tanh
from . import _checks, _dtypes
from .cells import Carry, checked_batch_shape, step_dtype, tree_shapes
from .conv import Conv
from .lstm_cells import lstm_update

# The paddings of `Conv` that keep a spatial axis's size at stride 1, whatever the window.
_SIZE_KEEPING = ("SAME", "CIRCULAR", "REFLECT", "CAUSAL")


@jax.jit
def conv_lstm_update(
    carry: tuple[jax.Array, jax.Array], x_gates: jax.Array, h_gates: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Linen's `ConvLSTMCell` update from its two convolutions' outputs: ``((c', h'), h')``.

    The ``4 * hidden_size`` channels of ``x_gates + h_gates`` are the gates ``i, g, f, o`` in
    that order (Linen's), and 1 is added to ``f`` before its sigmoid; then `lstm_update`.
    """
    c, h = carry
    i, g, f, o = jnp.split(x_gates + h_gates, 4, axis=-1)
    return lstm_update(c, h, (i, f + 1, g, o), sigmoid, tanh)


class ConvLSTMCell(Module):
    r"""A convolutional LSTM cell (Shi et al. 2015), equal to Flax Linen's `ConvLSTMCell`.

    .. math::

        i, g, f, o = \mathrm{split}(W_{ih} * x + b_{ih} + W_{hh} * h + b_{hh}),

        c' = \sigma(f + 1)\, c + \sigma(i) \tanh(g), \qquad h' = \sigma(o) \tanh(c'),

    where ``*`` is a convolution over the spatial axes. ``cell(carry, x)`` takes the carry
    ``(c, h)``, each of shape ``(*batch, *spatial, hidden_size)``, and an input of shape
    ``(*batch, *spatial, in_size)``, and returns ``((c', h'), h')``. Variables are Linen's: two
    `Conv` submodules, ``ih`` (input to gates, ``kernel`` of shape ``kernel_size + (in_size,
    4 * hidden_size)``) and ``hh`` (hidden to gates, ``kernel_size + (hidden_size,
    4 * hidden_size)``), each with a ``bias`` unless ``use_bias=False``.

    The carry has the input's spatial shape, so the convolutions must keep it: stride 1 and a
    padding that keeps sizes (``"SAME"``, the default, ``"CIRCULAR"``, ``"REFLECT"``,
    ``"CAUSAL"``, or pairs that add ``kernel_size - 1`` per axis). Linen accepts other strides
    and paddings and fails on the first step; here they are an error when the cell is built.

    Inside `RNN` the spatial axes and the channels are the cell's feature axes
    (`num_feature_axes`): inputs are ``(*batch, time, *spatial, in_size)``.

    Args:
        in_size: Number of input channels (the last axis).
        hidden_size: Number of channels of ``c`` and ``h`` (Linen's `features`).
        kernel_size: Window of both convolutions, one int per spatial axis (an int means a
            1-D window).
        strides: Linen's option; must be 1 (an int or one per axis), see above.
        padding: Padding of both convolutions, as `Conv`'s (default ``"SAME"``).
        use_bias: Whether the convolutions add a bias.
        dtype: Compute dtype of the gates; None infers it from the input, the carry and the
            variables (Linen's ``promote_dtype``). The carry keeps its own dtype.
        param_dtype: Storage dtype of the variables and dtype of `initialize_carry`'s carry
            (default: `dtype`, float32 when `dtype` is None).

    Everything after `kernel_size` is keyword-only.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> cell = lm.ConvLSTMCell(3, 4, kernel_size=(3, 3))
        >>> init, apply = lm.transform(cell)
        >>> variables = init(jax.random.key(0))
        >>> jax.tree.map(jnp.shape, variables["params"]["ih"])
        {'bias': (16,), 'kernel': (3, 3, 3, 16)}
        >>> carry = cell.initialize_carry((2, 8, 8))  # the input's shape without channels
        >>> (c, h), y = apply(variables, None, carry, jnp.ones((2, 8, 8, 3)))[0]
        >>> y.shape
        (2, 8, 8, 4)
        >>> rnn = lm.transform(lm.RNN(lm.ConvLSTMCell(3, 4, kernel_size=(3, 3))))
        >>> ys, _ = rnn.apply({"params": {"cell": variables["params"]}}, None,
        ...                   jnp.ones((2, 5, 8, 8, 3)))  # (batch, time, height, width, channels)
        >>> ys.shape
        (2, 5, 8, 8, 4)
    """

    # lm.with_policy: the carry this method makes goes in and out of every call, so under
    # a policy it is made in the dtype the calls exchange it in (_core/casting.py).
    _lamina_carry_methods = ("initialize_carry",)

    in_size = _checks.Setting()
    hidden_size = _checks.Setting()
    kernel_size = _checks.Setting()
    strides = _checks.Setting()
    padding = _checks.Setting()
    use_bias = _checks.Setting()
    dtype = _checks.Setting()
    param_dtype = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        kernel_size: int | Sequence[int],
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        use_bias: bool = True,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
    ):
        super().__init__()
        where = type(self).__name__
        self.in_size = _checks.positive_int(where, "in_size", in_size)
        self.hidden_size = _checks.positive_int(where, "hidden_size", hidden_size)
        self.kernel_size = _checks.window(where, "kernel_size", kernel_size, max_axes=3)
        n = len(self.kernel_size)
        self.strides = _checks.per_axis(where, "strides", strides, n)
        self.padding = _checks.padding(where, padding, n, ("VALID", *_SIZE_KEEPING))
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        self.dtype = _dtypes.layer_dtype(where, dtype)
        self.param_dtype = _dtypes.storage_dtype(where, param_dtype, self.dtype)
        self._check_size_kept(strides, padding)
        options = {
            "padding": self.padding,
            "use_bias": self.use_bias,
            "dtype": self.dtype,
            "param_dtype": self.param_dtype,
        }
        self.ih = Conv(self.in_size, 4 * self.hidden_size, self.kernel_size, **options)
        self.hh = Conv(self.hidden_size, 4 * self.hidden_size, self.kernel_size, **options)

    def _check_size_kept(self, strides: Any, padding: Any) -> None:
        if any(s != 1 for s in self.strides):
            raise ValueError(
                f"{self._describe()}: strides={strides!r} would shrink the spatial axes, but the "
                f"carry keeps the input's spatial shape (Linen's cell fails on its first step). "
                f"Use strides=1, and downsample before the cell (e.g. lm.Conv with strides)."
            )
        if isinstance(self.padding, str):
            kept = self.padding != "VALID" or all(k == 1 for k in self.kernel_size)
        else:
            kept = all(
                lo + hi == k - 1 for (lo, hi), k in zip(self.padding, self.kernel_size, strict=True)
            )
        if not kept:
            raise ValueError(
                f"{self._describe()}: padding={padding!r} changes the spatial shape with "
                f"kernel_size={self.kernel_size}, but the carry keeps the input's spatial shape "
                f"(Linen's cell fails on its first step). Use padding='SAME' (or pairs adding "
                f"kernel_size - 1 on each axis)."
            )

    @property
    def num_feature_axes(self) -> int:
        """The trailing axes that are features, not batch: the spatial axes and the channels."""
        return len(self.kernel_size) + 1

    def _describe(self) -> str:
        return (
            f"{type(self).__name__}(in_size={self.in_size}, hidden_size={self.hidden_size}, "
            f"kernel_size={self.kernel_size})"
        )

    def initialize_carry(self, batch_shape: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        """Returns the zero carry ``(c, h)``, each of shape ``(*batch_shape, hidden_size)``.

        Args:
            batch_shape: The input's shape without its channel axis: ``(*batch, *spatial)``
                (at least the ``len(kernel_size)`` spatial axes).

        Returns:
            Two zero arrays of dtype `param_dtype`.
        """
        shape = checked_batch_shape(type(self).__name__, batch_shape)
        n = len(self.kernel_size)
        if len(shape) < n:
            raise ValueError(
                f"{self._describe()}.initialize_carry takes the input's shape without its "
                f"channel axis, (*batch, *spatial) with {n} spatial axes; got {shape}. E.g. "
                f"initialize_carry(x.shape[:-1]) for an input x of one step."
            )
        zeros = jnp.zeros((*shape, self.hidden_size), self.param_dtype)
        return zeros, zeros

    def __call__(self, carry: Carry, x: jax.Array) -> tuple[Carry, jax.Array]:
        """One step: ``((c', h'), h')`` for `x` of shape ``(*batch, *spatial, in_size)``."""
        n = len(self.kernel_size)
        shape = tuple(jnp.shape(x))
        if len(shape) < n + 1:
            raise ValueError(
                f"{self._describe()} got an input of shape {shape}: it needs (*batch, "
                f"{n} spatial axes, {self.in_size}), channels last."
            )
        _checks.check_last_axis(self._describe, x, self.in_size, "in_size")
        expected = ((*shape[:-1], self.hidden_size),) * 2
        got = tree_shapes(carry)
        if got != expected:
            raise ValueError(
                f"{self._describe()} got a carry of shapes {got} for an input of shape {shape}; "
                f"the carry must be a tuple (c, h) with shapes {expected} (the input's shape "
                f"with hidden_size channels). Create one with "
                f"cell.initialize_carry({shape[:-1]})."
            )
        # The convolutions are called as modules (whatever they are: a `LoRA`, a user's), so
        # the step's dtype comes from the input, the carry and the values of the variables
        # under the cell, not from reading the convolutions' own arrays.
        frame = require_frame(f"{type(self).__name__}.__call__")
        values = [frame.values[slot] for slot in frame.plan.slots_of(self)]
        dtype = step_dtype(self, self.dtype, carry, x, values)
        h = carry[1]
        x_gates = self.ih(jnp.asarray(x, dtype))
        h_gates = self.hh(jnp.asarray(h, dtype))
        return conv_lstm_update(carry, x_gates, h_gates)
