"""What an entry of the layer table is (`LayerCase`) and the makers of its layers and inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import lamina as lm


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """A layer and how to call it.

    Attributes:
        name: The entry's id (also its key in the golden file).
        make: ``make(dtype, param_dtype) -> module``.
        inputs: ``inputs(rng, dtype) -> tuple`` of positional call arguments (arrays, or
            pytrees of arrays).
        kwargs: Static keyword arguments of the call (``is_training``...).
        to_callable: Which method apply runs (default ``__call__``).
        needs_rng: The call draws random keys (dropout).
        differentiable_inputs: Gradients with respect to the inputs make sense (not ids).
        output_in_dtype: The outputs come out in the compute dtype (the recurrent cells keep
            their carry, and so their outputs, in the storage dtype, as Linen's do).
    """

    name: str
    make: Callable[[Any, Any], lm.Module]
    inputs: Callable[[np.random.Generator, Any], tuple]
    kwargs: dict = dataclasses.field(default_factory=dict)
    to_callable: Callable | None = None
    needs_rng: bool = False
    differentiable_inputs: bool = True
    output_in_dtype: bool = True


def normal(*shape):
    def make(rng, dtype):
        return rng.standard_normal(shape).astype(dtype)

    return make


def args(*makers):
    return lambda rng, dtype: tuple(m(rng, dtype) for m in makers)


def ids(*shape, high=10):
    return lambda rng, dtype: rng.integers(0, high, shape).astype(np.int32)


def carry(*shape, lstm=True):
    def make(rng, dtype):
        one = lambda: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
        return (one(), one()) if lstm else one()

    return make


def d(dtype, param_dtype):
    return {"dtype": dtype, "param_dtype": param_dtype}


class Function(lm.Module):
    """A layer function (`lm.max_pool`, `lm.dropout`...) as a module, with fixed options."""

    def __init__(self, fn, **options):
        super().__init__()
        self.fn = fn
        self.options = options

    def __call__(self, *inputs):
        return self.fn(*inputs, **self.options)
