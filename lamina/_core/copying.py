"""Copying model objects, as `transform` and `assign_variables` do.

A copy of a model is deep, except for JAX's arrays and functions: they are immutable, so the
copy shares them. Sharing arrays keeps pretrained weights from being duplicated in memory, and
sharing functions (``jax.jit``-compiled ones, ``custom_jvp`` activations such as
``jax.nn.relu``) keeps them the same objects, so a layer that passes one as a static argument
to a compiled kernel hits the same compilation cache after every copy.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import numpy as np


def _is_jax_immutable(value: Any) -> bool:
    if isinstance(value, jax.Array):
        return True
    return callable(value) and type(value).__module__.partition(".")[0] in ("jax", "jaxlib")


_ATOMIC = frozenset({int, float, bool, complex, str, bytes, type(None)})


def copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """Deep-copies `value`, sharing JAX arrays and functions (also inside lists and dicts)."""
    kind = type(value)
    if kind in _ATOMIC or isinstance(value, np.dtype):
        # A model's settings are mostly numbers, strings and dtypes: immutable, so shared
        # (as `copy.deepcopy` shares the built-in ones), without its dispatch on every one.
        return value
    if _is_jax_immutable(value):
        return value
    if kind not in (list, tuple, dict):
        return copy.deepcopy(value, memo)
    if id(value) in memo:
        return memo[id(value)]
    if kind is tuple:
        result: Any = tuple(copy_value(item, memo) for item in value)
    elif kind is list:
        result = memo[id(value)] = []
        result.extend(copy_value(item, memo) for item in value)
    else:
        result = memo[id(value)] = {}
        for key, item in value.items():
            result[key] = copy_value(item, memo)
    memo[id(value)] = result
    return result


def copy_object(obj: Any, memo: dict[int, Any]) -> Any:
    """`__deepcopy__` for modules and declarations: a new object with copied attributes."""
    cls: Any = type(obj)
    result = cls.__new__(cls)
    memo[id(obj)] = result
    for name, value in vars(obj).items():
        result.__dict__[name] = copy_value(value, memo)
    return result


class FrozenList(list):
    """A list of a transformed model's snapshot: it refuses every change.

    `apply` is a pure function only if nothing a call does to the model's Python objects
    survives the call, so `transform` freezes the containers its snapshot holds. It is still a
    `list` (isinstance checks, indexing, iteration and `jax.tree_util` all work as before).
    """

    __slots__ = ("_lamina_where",)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_frozen_message("list", getattr(self, "_lamina_where", "the model")))

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (list, (list(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> list:
        return copy_value(list(self), memo)


class FrozenDict(dict):
    """A dict of a transformed model's snapshot: it refuses every change (see `FrozenList`)."""

    __slots__ = ("_lamina_where",)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_frozen_message("dict", getattr(self, "_lamina_where", "the model")))

    __setitem__ = __delitem__ = __ior__ = _refuse
    setdefault = update = pop = popitem = clear = _refuse

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (dict, (dict(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> dict:
        return copy_value(dict(self), memo)


def _frozen_message(kind: str, where: str) -> str:
    return (
        f"cannot change the {kind} at {where}: a transformed model is frozen, so that apply "
        f"stays a pure function (a change would survive into the next call and alter its "
        f"result). Work on a copy in a local variable (`items = list(self.items)`), or keep "
        f"values that must change across calls in a mutable lm.State."
    )


def _flatten_list(x: FrozenList) -> tuple[list, None]:
    return list(x), None


def _unflatten_list(aux: None, children: Any) -> Any:
    return list(children)  # a result of tree_map is the caller's, so a plain list


def _flatten_dict(x: FrozenDict) -> tuple[tuple, tuple]:
    keys = tuple(sorted(x))
    return tuple(x[k] for k in keys), keys


def _unflatten_dict(keys: tuple, children: Any) -> Any:
    return dict(zip(keys, children, strict=True))


jax.tree_util.register_pytree_node(FrozenList, _flatten_list, _unflatten_list)
jax.tree_util.register_pytree_node(FrozenDict, _flatten_dict, _unflatten_dict)


def freeze(module: Any, where: str) -> None:
    """Freezes the containers among the attributes of a snapshot's `module`, recursively.

    Lists become `FrozenList`, dicts `FrozenDict`, sets `frozenset`, NumPy arrays read-only;
    tuples are rebuilt when an item changed. Modules and declarations inside are left as
    they are (each module is frozen on its own). Other objects are not looked into.

    Args:
        module: A module of a snapshot that `transform` made.
        where: The module's path, for messages.
    """
    for name, value in list(vars(module).items()):
        if name.startswith("_lamina_"):
            continue
        frozen = _frozen(value, f"{where}/{name}" if where != "<root>" else name)
        if frozen is not value:
            # the instance dict itself: a data descriptor (a layer's read-only setting) would
            # refuse the write, and the attribute already lives here
            vars(module)[name] = frozen


def _frozen(value: Any, where: str) -> Any:
    kind = type(value)
    if kind is list or kind is FrozenList:
        result: Any = FrozenList(_frozen(v, f"{where}/{i}") for i, v in enumerate(value))
        result._lamina_where = where
        return result
    if kind is dict or kind is FrozenDict:
        result = FrozenDict((k, _frozen(v, f"{where}/{k}")) for k, v in value.items())
        result._lamina_where = where
        return result
    if kind is set:
        return frozenset(value)
    if isinstance(value, tuple):
        items = [_frozen(v, f"{where}/{i}") for i, v in enumerate(value)]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    return value
