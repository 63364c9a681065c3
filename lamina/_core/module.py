"""`Module`: a plain Python object whose attributes hold submodules and variable declarations."""

from __future__ import annotations

from typing import Any

from .copying import copy_object
from .errors import FrozenModuleError, format_path
from .frame import current_frame

_MISSING = object()
CALL_CODES: set[Any] = set()  # the code of every Module subclass's own __call__


class Module:
    """Base class of every model and layer.

    Subclass it and keep submodules and variables (`State`, `Parameter`, ...) in attributes,
    or in lists, tuples and dicts of them. A module is mutable until `lm.transform` snapshots
    it; during `init`/`apply` the snapshot is frozen, and state that must change across calls
    lives in a mutable `State`. Calling ``super().__init__()`` is customary but optional.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class Mlp(lm.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = [lm.Dense(4, 8), lm.Dense(8, 2)]
        ...     def __call__(self, x):
        ...         return self.layers[1](lm.relu(self.layers[0](x)))
        >>> init, apply = lm.transform(Mlp())
        >>> variables = init(jax.random.key(0))
        >>> sorted(variables["params"]["layers"])
        ['0', '1']
        >>> apply(variables, None, jnp.ones((3, 4)))[0].shape
        (3, 2)
    """

    # Set on the snapshot that `transform` plans (the module's path from the root).
    _lamina_path: tuple | None = None

    def __init__(self) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is not None and hasattr(call, "__code__"):
            # lm.capture_intermediates recognises module calls by their code (no wrapper:
            # calling a module costs nothing more when nothing is captured).
            CALL_CODES.add(call.__code__)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._lamina_path is not None and current_frame() is not None:
            if self.__dict__.get(name, _MISSING) is value:
                return  # `self.count += 1` on a State rebinds the same declaration
            raise FrozenModuleError(
                f"cannot set attribute {name!r} of {type(self).__name__} at "
                f"{format_path(self._lamina_path)}: modules are frozen while init/apply runs, "
                f"so that apply stays a pure function. To keep a value across calls, declare "
                f"it in __init__ as `self.{name} = lm.State(collection, shape, init, "
                f"mutable=True)` and write `self.{name}.value = ...`; to pass a value to "
                f"other methods, use a local variable or an argument."
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._lamina_path is not None and current_frame() is not None:
            raise FrozenModuleError(
                f"cannot delete attribute {name!r} of {type(self).__name__} at "
                f"{format_path(self._lamina_path)}: modules are frozen while init/apply runs."
            )
        object.__delattr__(self, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> Module:
        return copy_object(self, memo)

    def __repr__(self) -> str:
        return _repr_module(self, indent="", seen=set())


def _repr_module(module: Module, indent: str, seen: set[int]) -> str:
    from .variables import State

    name = type(module).__name__
    if id(module) in seen:
        return f"{name}(...)"  # shared: shown in full where first met
    seen.add(id(module))
    lines = []
    inner = indent + "  "
    for key, child in vars(module).items():
        if key.startswith("_lamina_"):
            continue
        if isinstance(child, Module):
            lines.append(f"{inner}{key}={_repr_module(child, inner, seen)},")
        elif isinstance(child, State):
            lines.append(f"{inner}{key}={child!r},")
        elif isinstance(child, (list, tuple, dict)) and _holds_nodes(child):
            lines.append(f"{inner}{key}={_repr_container(child, inner, seen)},")
        elif isinstance(child, (bool, int, float, str, type(None))) or (
            isinstance(child, tuple) and all(isinstance(c, (int, float, str)) for c in child)
        ):
            lines.append(f"{inner}{key}={child!r},")
    if not lines:
        return f"{name}()"
    return f"{name}(\n" + "\n".join(lines) + f"\n{indent})"


def _repr_container(container: Any, indent: str, seen: set[int]) -> str:
    from .variables import State

    items = container.items() if isinstance(container, dict) else enumerate(container)
    inner = indent + "  "
    lines = []
    for key, child in items:
        prefix = f"{key!r}: " if isinstance(container, dict) else ""
        if isinstance(child, Module):
            lines.append(f"{inner}{prefix}{_repr_module(child, inner, seen)},")
        elif isinstance(child, State):
            lines.append(f"{inner}{prefix}{child!r},")
        elif isinstance(child, (list, tuple, dict)):
            lines.append(f"{inner}{prefix}{_repr_container(child, inner, seen)},")
        else:
            lines.append(f"{inner}{prefix}{child!r},")
    if isinstance(container, dict):
        open_, close = "{", "}"
    elif isinstance(container, list):
        open_, close = "[", "]"
    else:
        open_, close = "(", ")"
    return open_ + "\n" + "\n".join(lines) + f"\n{indent}" + close


def _holds_nodes(container: Any) -> bool:
    from .variables import State

    items = container.values() if isinstance(container, dict) else container
    for child in items:
        if isinstance(child, (Module, State)):
            return True
        if isinstance(child, (list, tuple, dict)) and _holds_nodes(child):
            return True
    return False
