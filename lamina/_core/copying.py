"""Copying model objects, as `transform` and `assign_variables` do.

A copy of a model is deep, except for JAX's arrays and functions: they are immutable, so the
copy shares them. Sharing arrays keeps pretrained weights from being duplicated in memory, and
sharing functions (``jax.jit``-compiled ones, ``custom_jvp`` activations such as
``jax.nn.relu``) keeps them the same objects, so a layer that passes one as a static argument
to a compiled kernel hits the same compilation cache after every copy.
"""

from __future__ import annotations

import copy
import functools
import importlib
import types
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


def picklable_state(obj: Any) -> dict[str, Any]:
    """A module's attributes for `pickle`, with JAX's functions named so that they pickle.

    ``jax.nn.relu``, ``lm.sigmoid`` and the like are ``jax.jit`` or ``custom_jvp`` objects
    that `pickle` cannot find by name; held by a module (directly, in its lists, tuples and
    dicts, or in a ``functools.partial``), each is replaced by a reference to the public name
    it is found under in `lamina.activations`, `jax.nn`, `jax.numpy` or `jax.lax` (or, for
    a decorated function of another module, such as ``@jax.jit def f``, under its own module
    and name), which unpickles as the same function object. Everything else pickles as
    itself.
    """
    return {name: _picklable(value) for name, value in vars(obj).items()}


def _picklable(value: Any) -> Any:
    kind = type(value)
    if kind in _ATOMIC:
        return value
    if kind in (list, tuple, dict):
        items = list(value.items()) if kind is dict else list(enumerate(value))
        new = [(key, _picklable(item)) for key, item in items]
        if all(a is b for (_, a), (_, b) in zip(new, items, strict=True)):
            return value
        return dict(new) if kind is dict else kind(item for _, item in new)
    if kind is functools.partial:
        func = _picklable(value.func)
        if func is value.func:
            return value
        return functools.partial(func, *value.args, **value.keywords)
    if callable(value) and not isinstance(value, (type, types.FunctionType)):
        name = _public_functions().get(id(value)) or _own_name(value)
        if name is not None:
            return _FunctionName(*name)
    return value


def _own_name(value: Any) -> tuple[str, str] | None:
    """Where a decorated function (``@jax.jit def f``) lives, if it is found there by name."""
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(name, str)):
        return None
    try:
        found = _public_function(module, name)
    except Exception:  # not importable, or not there: pickle decides, and says why
        return None
    return (module, name) if found is value else None


class _FunctionName:
    """Pickles as a reference to ``module.name``: unpickling returns that function itself."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return _public_function, (self.module, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # inside a functools.partial
        return _public_function(self.module, self.name)(*args, **kwargs)


def _public_function(module: str, name: str) -> Any:
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


@functools.cache
def _public_functions() -> dict[int, tuple[str, str]]:
    """``id(function) -> (module, name)`` for the functions of the modules named above."""
    found: dict[int, tuple[str, str]] = {}
    for module in ("lamina.activations", "jax.nn", "jax.numpy", "jax.lax"):
        namespace = importlib.import_module(module)
        for name in getattr(namespace, "__all__", None) or dir(namespace):
            value = getattr(namespace, name, None)
            if not name.startswith("_") and callable(value) and not isinstance(value, type):
                found.setdefault(id(value), (module, name))
    return found


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
