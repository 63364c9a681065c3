"""`Sequential`: layers applied one after another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._core.module import Module
from . import _checks


class Sequential(Module):
    """Applies its layers in order, each to the previous one's output.

    Layers may be modules or plain functions (``lm.relu``). Arguments of the call go to the
    first layer; a tuple output is unpacked into the next layer's arguments and a dict output
    into its keyword arguments (as Flax Linen's ``Sequential``). Layers are stored as the
    attributes ``layers_0``, ``layers_1``, ..., the names Linen gives them, so the variables
    of a Linen ``Sequential`` load directly.

    ``seq.layers`` is a tuple, read-only: to replace a layer, assign its attribute
    (``seq.layers_0 = lm.Dense(4, 16)``); to add or remove layers, build a new
    ``Sequential(*seq.layers, extra)``.

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

    num_layers = _checks.Setting()

    def __init__(self, *layers: Module | Callable[..., Any]):
        super().__init__()
        where = type(self).__name__
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            raise TypeError(
                f"{where} takes the layers as separate arguments, got one "
                f"{type(layers[0]).__name__}; unpack it: {where}(*layers)."
            )
        if not layers:
            raise ValueError(f"{where} needs at least one layer.")
        for i, layer in enumerate(layers):
            if not callable(layer):
                raise TypeError(
                    f"{where}: layer {i} is a {type(layer).__name__}, which cannot be "
                    f"called; pass modules or functions."
                )
            setattr(self, f"layers_{i}", layer)
        self.num_layers = len(layers)

    @property
    def layers(self) -> tuple[Callable[..., Any], ...]:
        """The layers, in order: a tuple (assign ``seq.layers_<i>`` to replace one)."""
        return _Layers(self._ordered(), type(self).__name__)

    @layers.setter
    def layers(self, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__}.layers is read-only (a tuple made from the attributes "
            f"layers_0, layers_1, ...). To replace layer i, assign seq.layers_i = new_layer; "
            f"to change the number of layers, build a new {type(self).__name__}(*layers)."
        )

    def _ordered(self) -> tuple[Callable[..., Any], ...]:
        return tuple(getattr(self, f"layers_{i}") for i in range(self.num_layers))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the layers in order."""
        layers = self._ordered()
        outputs = layers[0](*args, **kwargs)
        for layer in layers[1:]:
            if isinstance(outputs, tuple):
                outputs = layer(*outputs)
            elif isinstance(outputs, dict):
                outputs = layer(**outputs)
            else:
                outputs = layer(outputs)
        return outputs


class _Layers(tuple):
    """``seq.layers``: a tuple of the layers that says how to replace one when assigned to.

    Args:
        layers: The layers, in order.
        owner: The Sequential's class name, for messages.
    """

    owner: str

    def __new__(cls, layers: Any = (), owner: str = "Sequential") -> _Layers:
        # `owner` has a default: code that rebuilds a tuple by its type (model surgery,
        # `type(t)(items)`) gets a `_Layers` again.
        result = super().__new__(cls, layers)
        result.owner = owner
        return result

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle
        return tuple(self), self.owner

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(self._refusal(index, "replace"))

    def __delitem__(self, index: Any) -> None:
        raise TypeError(self._refusal(index, "remove"))

    def _refusal(self, index: Any, action: str) -> str:
        owner = self.owner
        if isinstance(index, int) and -len(self) <= index < len(self):
            i = index % len(self)
            replace = f"seq.layers_{i} = new_layer"
            rebuild = (
                f"{owner}(*seq.layers[:{i}], *seq.layers[{i + 1}:])"
                if action == "remove"
                else f"{owner}(*seq.layers[:{i}], new_layer, *seq.layers[{i}:])"
            )
        else:
            replace = "seq.layers_<i> = new_layer"
            rebuild = f"{owner}(*layers)"
        return (
            f"{owner}.layers is read-only: a tuple of the attributes layers_0, layers_1, .... "
            f"To replace a layer, assign its attribute ({replace}); to add or remove layers, "
            f"build a new {owner}: {rebuild}."
        )


# A tuple to JAX as well (`jax.tree.map` over `seq.layers`), not a leaf.
jax.tree_util.register_pytree_node(
    _Layers,
    lambda layers: (tuple(layers), layers.owner),
    lambda owner, children: _Layers(tuple(children), owner),
)
