"""`Sequential`: layers applied one after another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core.module import Module


class Sequential(Module):
    """Applies its layers in order, each to the previous one's output.

    Layers may be modules or plain functions (``lm.relu``). Arguments of the call go to the
    first layer; a tuple output is unpacked into the next layer's arguments and a dict output
    into its keyword arguments (as Flax Linen's ``Sequential``). Layers are stored as the
    attributes ``layers_0``, ``layers_1``, ..., the names Linen gives them, so the variables
    of a Linen ``Sequential`` load directly.

    Args:
        *layers: The layers.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> mlp = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
        >>> init, apply = lm.transform(mlp)
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"])
        ['layers_0', 'layers_2']
        >>> apply(variables, None, jnp.ones((3, 4)))[0].shape
        (3, 2)
    """

    def __init__(self, *layers: Module | Callable[..., Any]):
        super().__init__()
        if not layers:
            raise ValueError("Sequential needs at least one layer.")
        for i, layer in enumerate(layers):
            if not callable(layer):
                raise TypeError(
                    f"Sequential: layer {i} is a {type(layer).__name__}, which cannot be "
                    f"called; pass modules or functions."
                )
            setattr(self, f"layers_{i}", layer)
        self.num_layers = len(layers)

    @property
    def layers(self) -> list[Module | Callable[..., Any]]:
        """The layers, in order."""
        return [getattr(self, f"layers_{i}") for i in range(self.num_layers)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the layers in order."""
        layers = self.layers
        outputs = layers[0](*args, **kwargs)
        for layer in layers[1:]:
            if isinstance(outputs, tuple):
                outputs = layer(*outputs)
            elif isinstance(outputs, dict):
                outputs = layer(**outputs)
            else:
                outputs = layer(outputs)
        return outputs
