"""Which lamina layer converts from and to which PyTorch weights: `register_torch`.

A converter is a pair of functions over NumPy arrays, keyed by *local* names: the torch names
below the layer's own PyTorch module (``"weight"``, ``"out_proj.bias"``) and the paths of the
layer's variables below the layer (``"kernel"``, ``"query/kernel"``, ``"cell/ii/kernel"``).
`lm.from_torch` and `lm.to_torch` find the converter of every layer of a model through its
class (the most derived registered class wins), and do the naming, the checks and the dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.module import Module
from .._core.types import Shape

ToLamina = Callable[[Any, Mapping[str, np.ndarray]], Mapping[str, Any]]
ToTorch = Callable[[Any, Mapping[str, np.ndarray]], Mapping[str, Any]]


@dataclass(frozen=True)
class Converter:
    """The two directions of one layer type's conversion.

    Attributes:
        to_lamina: ``to_lamina(layer, tensors) -> {variable path below the layer: array}``.
        to_torch: ``to_torch(layer, arrays) -> {torch name below the layer: array}``.
    """

    to_lamina: ToLamina
    to_torch: ToTorch


_CONVERTERS: dict[type, Converter] = {}


def register_torch(layer_type: type, to_lamina: ToLamina, to_torch: ToTorch) -> None:
    """Teaches `lm.from_torch` and `lm.to_torch` a layer type (replacing any converter it had).

    ``to_lamina(layer, tensors)`` gets the layer (the model's own instance, to read its sizes)
    and the PyTorch tensors below its module, as NumPy arrays by local name (``tensors["weight"]``
    for ``"encoder.fc.weight"`` when the layer sits at ``encoder/fc``), and returns the layer's
    variables by their path below it (``{"kernel": ..., "bias": ...}``; a submodule's variables
    as ``"query/kernel"``). ``to_torch(layer, arrays)`` is the inverse: it gets the layer's
    variables by the same local paths and returns tensors by local torch name. Both work on
    NumPy arrays; the caller converts from and to torch tensors and jax arrays, casts to the
    variables' dtypes, and checks every name and shape.

    `tensors` is a read-only mapping that records what the converter reads: a name it never
    reads is reported unused by ``strict=True``, and reading a name that is absent reports it
    missing. ``tensors.get(name)`` reads a name that may be absent without that error.

    A class registered here is converted as a whole: the walk does not look into its
    submodules. Subclasses inherit the converter unless they register their own.

    Args:
        layer_type: A subclass of `lm.Module`.
        to_lamina: The PyTorch to lamina direction.
        to_torch: The lamina to PyTorch direction.

    Raises:
        TypeError: If `layer_type` is not a Module class or a converter is not callable.

    Example:
        >>> import numpy as np, lamina as lm
        >>> class Scale(lm.Module):  # y = x * weight, PyTorch's parameter is named "weight"
        ...     def __init__(self, size):
        ...         super().__init__()
        ...         self.w = lm.Parameter((size,), lm.initializers.ones())
        >>> lm.register_torch(
        ...     Scale,
        ...     to_lamina=lambda layer, tensors: {"w": tensors["weight"]},
        ...     to_torch=lambda layer, arrays: {"weight": arrays["w"]},
        ... )
        >>> lm.from_torch(Scale(3), {"weight": np.arange(3.0)})
        {'params': {'w': Array([0., 1., 2.], dtype=float32)}}
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, Module)):
        raise TypeError(
            f"register_torch: layer_type must be a subclass of lm.Module (the class of the "
            f"layers to convert), got {layer_type!r}."
        )
    for name, fn in (("to_lamina", to_lamina), ("to_torch", to_torch)):
        if not callable(fn):
            raise TypeError(
                f"register_torch({layer_type.__name__}, ...): {name} must be a function "
                f"{name}(layer, arrays) -> dict of arrays, got {fn!r}."
            )
    _CONVERTERS[layer_type] = Converter(to_lamina, to_torch)


def converter_for(module: Any) -> Converter | None:
    """The converter of `module`'s class or of its nearest registered base class, or None."""
    for cls in type(module).__mro__:
        converter = _CONVERTERS.get(cls)
        if converter is not None:
            return converter
    return None


class MissingTensor(KeyError):
    """A converter read a torch name that the state dict lacks (`Tensors.__getitem__`)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class ShapeMismatch(ValueError):
    """A torch tensor whose shape does not fit the layer (`take`)."""

    def __init__(self, name: str, got: Shape, expected: Shape, layout: str):
        super().__init__(name)
        self.name, self.got, self.expected, self.layout = name, got, expected, layout


class Unsupported(TypeError):
    """A layer a converter cannot convert after all (an RNN of a cell PyTorch lacks)."""


class Tensors(Mapping[str, np.ndarray]):
    """The tensors below one layer, by local name, recording which names are read.

    Args:
        arrays: Every tensor of the state dict, by its (renamed) full name.
        full_name: The full name of a local name.
        local_name: The local name of a full name, or None if it is not the layer's.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        full_name: Callable[[str], str],
        local_name: Callable[[str], str | None],
    ):
        self._arrays = arrays
        self._full = full_name
        self._local = local_name
        self.read: set[str] = set()  # full names

    def full_name(self, name: str) -> str:
        """The full (renamed) key of the local `name`."""
        return self._full(name)

    def __getitem__(self, name: str) -> np.ndarray:
        full = self._full(name)
        if full not in self._arrays:
            raise MissingTensor(name)
        self.read.add(full)
        return self._arrays[full]

    def get(self, name: str, default: Any = None) -> Any:
        """The tensor `name` if the state dict has it (then it counts as used), else `default`."""
        if name in self:
            return self[name]
        return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._full(name) in self._arrays

    def __iter__(self) -> Iterator[str]:
        for full in self._arrays:
            local = self._local(full)
            if local is not None:
                yield local

    def __len__(self) -> int:
        return sum(1 for _ in self)


def take(tensors: Mapping[str, np.ndarray], name: str, shape: Shape, layout: str) -> Any:
    """``tensors[name]``, checked to have `shape` (`layout` says what the axes are)."""
    array = tensors[name]
    if tuple(array.shape) != tuple(shape):
        raise ShapeMismatch(name, tuple(array.shape), tuple(shape), layout)
    return array


def prefixed(prefix: str, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """``{prefix + name: array}``: a submodule's local names as its parent's."""
    return {prefix + name: array for name, array in arrays.items()}


def below(prefix: str, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The entries whose name starts with `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
