"""`GatedMLP`: ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import initializers
from .._core.module import Module
from .._core.types import Dtype, Initializer, PrecisionLike
from . import _checks
from .linear import Dense

# The activations by name. Each runs in float32 (at least) and is rounded once to the gate's
# dtype, as PyTorch's silu/gelu kernels compute a bfloat16 input (jax.nn.silu on bfloat16
# rounds its intermediates to bfloat16, which is not transformers' result bit for bit).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,  # SwiGLU: Llama, Mistral, Qwen
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU: Gemma
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # the exact (erf) GELU
}
# transformers' ACT2FN names of the same functions (the same formula: "gelu_new" is the tanh
# approximation written out, which transformers evaluates step by step in the input dtype).
ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _activation(where: str, value: Any) -> str | Callable[[jax.Array], jax.Array]:
    if isinstance(value, str):
        value = ALIASES.get(value, value)
        if value not in ACTIVATIONS:
            raise ValueError(
                f"{where}: activation must be one of {', '.join(map(repr, ACTIVATIONS))} (or "
                f"transformers' aliases {', '.join(map(repr, ALIASES))}) or a function, got "
                f"{value!r}. For another activation, pass the function, e.g. jax.nn.relu."
            )
        return value
    return _checks.function(where, "activation", value, "jax.nn.silu or 'silu'")


def _named(name: str, gate: jax.Array) -> jax.Array:
    """The activation `name` of `gate`, computed in float32 (at least), rounded once."""
    narrow = jnp.issubdtype(gate.dtype, jnp.floating) and jnp.finfo(gate.dtype).bits < 32
    wide = jnp.float32 if narrow else gate.dtype
    return ACTIVATIONS[name](gate.astype(wide)).astype(gate.dtype)


def _names(where: str, value: Any) -> tuple[tuple[Any, Any] | None, tuple[Any, Any] | None]:
    """The kernel shardings of gate/up and of down from the pair ``(input, hidden)``."""
    if value is None:
        return None, None
    names = _checks.sharding(where, "kernel_sharding", value, 2)
    assert names is not None
    return (names[0], names[1]), (names[1], names[0])


class GatedMLP(Module):
    """A gated feed-forward block, ``down(act(gate(x)) * up(x))``: SwiGLU, GeGLU.

    The block of Llama, Mistral and Qwen (``activation="silu"``, SwiGLU) and Gemma
    (``"gelu_tanh"``, GeGLU), as ``transformers``' ``LlamaMLP``. Three `Dense` submodules:
    ``gate`` and ``up`` with kernels ``(in_size, hidden_size)``, ``down`` with kernel
    ``(hidden_size, in_size)``; a Hugging Face ``gate_proj.weight`` is ``gate/kernel``
    transposed.

    Args:
        in_size: Size of the input's (and the output's) last axis (``hidden_size`` in a
            transformers config).
        hidden_size: Size of the gated hidden layer (``intermediate_size``).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU), ``"gelu"`` (the exact
            erf GELU), or a function. transformers' names of the same functions are
            accepted and stored as lamina's: ``"swish"`` (``"silu"``),
            ``"gelu_pytorch_tanh"`` and ``"gelu_new"`` (``"gelu_tanh"``). A named activation
            is computed in float32 and rounded once to the gate's dtype, as PyTorch does:
            in bfloat16, ``"silu"`` equals PyTorch's bit for bit; the GELUs too except in
            their negative tails (below about -3.1 for ``"gelu"``, -3.6 for
            ``"gelu_tanh"``, where XLA's float32 erf and tanh near -1 are not PyTorch's:
            values below 3e-3 in magnitude may differ in their last bits); ``"gelu_new"``,
            which transformers evaluates step by step in bfloat16, within rounding. A
            function runs in the gate's dtype as it is.
        use_bias: Whether the three projections add a bias (Llama's ``mlp_bias``).
        kernel_init: Initializer of the three kernels.
        bias_init: Initializer of the three biases.
        dtype: Compute dtype (`Dense`'s; None infers it from the inputs and variables).
        param_dtype: Storage dtype of the variables (default: `dtype`, float32 when `dtype`
            is None).
        precision: `jax.lax.Precision` of the three matrix products.
        kernel_sharding: The logical axis names of the input and hidden axes, e.g.
            ``("embed", "mlp")``: the kernels of ``gate`` and ``up`` get ``("embed", "mlp")``,
            that of ``down`` ``("mlp", "embed")``, and the biases the names of their output
            axes. None: replicated.

    Everything after the sizes is keyword-only; the settings are read-only once built.

    Raises:
        ValueError: A size that is not positive; an unknown activation name; a sharding that
            is not two names.
        TypeError: A setting of the wrong type.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> mlp = lm.GatedMLP(8, 32, activation="silu")
        >>> init, apply = lm.transform(mlp)
        >>> variables = init(jax.random.key(0))
        >>> [variables["params"][name]["kernel"].shape for name in ("gate", "up", "down")]
        [(8, 32), (8, 32), (32, 8)]
        >>> apply(variables, None, jnp.ones((2, 5, 8)))[0].shape
        (2, 5, 8)
    """

    _lamina_casts_inputs = True  # the three Dense cast their inputs; the gate runs in theirs

    in_size = _checks.Setting()
    hidden_size = _checks.Setting()
    activation = _checks.Setting()
    use_bias = _checks.Setting()

    def __init__(
        self,
        in_size: int,
        hidden_size: int,
        *,
        activation: str | Callable[[jax.Array], jax.Array] = "silu",
        use_bias: bool = False,
        kernel_init: Initializer = initializers.lecun_normal(),
        bias_init: Initializer = initializers.zeros(),
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        precision: PrecisionLike = None,
        kernel_sharding: Sequence[str | None] | None = None,
    ):
        super().__init__()
        where = type(self).__name__
        self.in_size = _checks.positive_int(where, "in_size", in_size)
        self.hidden_size = _checks.positive_int(where, "hidden_size", hidden_size)
        self.activation = _activation(where, activation)
        self.use_bias = _checks.flag(where, "use_bias", use_bias)
        inward, outward = _names(where, kernel_sharding)
        options: dict[str, Any] = dict(
            use_bias=self.use_bias,
            kernel_init=kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
        )
        hidden_bias = None if inward is None else (inward[1],)
        out_bias = None if outward is None else (outward[1],)
        self.gate = Dense(
            self.in_size,
            self.hidden_size,
            kernel_sharding=inward,
            bias_sharding=hidden_bias,
            **options,
        )
        self.up = Dense(
            self.in_size,
            self.hidden_size,
            kernel_sharding=inward,
            bias_sharding=hidden_bias,
            **options,
        )
        self.down = Dense(
            self.hidden_size,
            self.in_size,
            kernel_sharding=outward,
            bias_sharding=out_bias,
            **options,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the block to `x` of shape ``(..., in_size)``."""
        _checks.check_last_axis(self._describe, x, self.in_size, "in_size")
        gate = self.gate(x)
        up = self.up(x)
        if isinstance(self.activation, str):
            hidden = _named(self.activation, gate)
        else:
            hidden = self.activation(gate)
        if hidden.dtype != up.dtype or hidden.shape != up.shape:
            raise TypeError(
                f"{self._describe()}: the activation {self.activation!r} returned "
                f"{hidden.dtype}{list(hidden.shape)} for a gate of {gate.dtype}"
                f"{list(gate.shape)}; it must keep the shape and dtype (an elementwise function)."
            )
        return self.down(hidden * up)

    def _describe(self) -> str:
        return f"{type(self).__name__}(in_size={self.in_size}, hidden_size={self.hidden_size})"
