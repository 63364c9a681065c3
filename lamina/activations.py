"""Activation functions: `jax.nn`'s, exported flat as `lm.relu`, `lm.gelu`, `lm.softmax`...

`relu`, `relu6`, `gelu` and `softmax` are wrapped in `jax.jit`: in `jax.nn` they dispatch
through Python on every eager call (about 100 microseconds on a CPU, against 5 for a jitted
call); compiled, they are the same program. Everything else is `jax.nn`'s own function.

Example:
    >>> import jax.numpy as jnp, lamina as lm
    >>> lm.relu(jnp.array([-1.0, 2.0]))
    Array([0., 2.], dtype=float32)
"""

import jax
import jax.numpy as jnp
from jax.nn import (
    celu,
    elu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    identity,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    mish,
    one_hot,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softplus,
    sparse_plus,
    sparse_sigmoid,
    squareplus,
    standardize,
    swish,
)

relu = jax.jit(jax.nn.relu)
relu6 = jax.jit(jax.nn.relu6)
gelu = jax.jit(jax.nn.gelu, static_argnames=("approximate",))
softmax = jax.jit(jax.nn.softmax, static_argnames=("axis",))
tanh = jnp.tanh

__all__ = [
    "celu",
    "elu",
    "gelu",
    "glu",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "identity",
    "leaky_relu",
    "log_sigmoid",
    "log_softmax",
    "mish",
    "one_hot",
    "relu",
    "relu6",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "sparse_plus",
    "sparse_sigmoid",
    "squareplus",
    "standardize",
    "swish",
    "tanh",
]
