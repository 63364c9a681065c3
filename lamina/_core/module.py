"""`Module`: a plain Python object whose attributes hold submodules and variable declarations."""

from __future__ import annotations

import collections
import functools
import pickle
import sys
import types
import weakref
from typing import Any

from .checks import format_path
from .copying import copy_object, picklable_state
from .errors import FrozenModuleError
from .frame import current_frame
from .initializer import Initializer
from .variables import RENDERERS, State

_MISSING = object()
# Code objects by id (hashing a code object hashes its bytecode: slow; the values keep the
# ids unique). CALL_CODES: every Module subclass's __call__. METHOD_CODES: every method of
# a Module subclass or of its bases that are not modules; `lm.sow`/`lm.perturb` find the
# module whose method is running by these, on the stack. Both are filled when a class is
# created; a method assigned to a class later is found when it matters: `method_of` looks a
# frame's code up in its module's class, `register_calls` runs when a capture starts.
CALL_CODES: dict[int, Any] = {}
METHOD_CODES: dict[int, Any] = {}


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
        # lm.capture_intermediates recognises module calls by their code (no wrapper:
        # calling a module costs nothing more when nothing is captured).
        CALL_CODES.update((id(c), c) for c in _method_codes([cls.__dict__.get("__call__")]))
        for klass in cls.__mro__:
            if klass is cls or not (issubclass(klass, Module) or klass is object):
                METHOD_CODES.update((id(c), c) for c in _method_codes(vars(klass).values()))

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
        if name.startswith("_lamina_") and _holds_parts(value):
            raise AttributeError(
                f"cannot set attribute {name!r} of {type(self).__name__}: the prefix "
                f"'_lamina_' is reserved for lamina's own bookkeeping, and lamina does not "
                f"look for submodules or variables in such attributes, so this "
                f"{type(value).__name__} would silently not be part of the model. Rename the "
                f"attribute (e.g. {name.removeprefix('_lamina_') or 'part'!r})."
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

    def __getstate__(self) -> dict[str, Any]:
        # The module pickled first checks its whole tree, so that an error names the path
        # from it; the submodules it checked skip the check when pickle reaches them.
        _check_picklable(self, whole=_CHECKED.pop(id(self), None) is None)
        return picklable_state(self)  # JAX's functions (activations) pickle by name

    def __copy__(self) -> Module:
        # `copy.copy` shares the attributes; without this it would go through `__getstate__`.
        result = object.__new__(type(self))
        result.__dict__.update(vars(self))
        return result

    def __repr__(self) -> str:
        return _repr_module(self, indent="", seen=set())

    @property
    def _repr_html_(self) -> Any:
        """The model as foldable HTML (treescope) for Jupyter; it returns None without treescope.

        A property that gives the bound method: treescope appends the output of a class's
        callable ``_repr_html_`` under its own rendering of the object, which would show every
        model twice, while IPython and Jupyter read the attribute of the instance.
        """
        return types.MethodType(_repr_html, self)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        render = RENDERERS.get("module")
        return NotImplemented if render is None else render(self, path, subtree_renderer)


def _repr_html(module: Module) -> str | None:
    render = RENDERERS.get("html")
    return None if render is None else render(module)


# Submodules whose attributes the pickling of an enclosing module has checked: id -> a weak
# reference (the entry goes when the module does, so an id is never mistaken).
_CHECKED: dict[int, Any] = {}


def _check_picklable(root: Module, whole: bool) -> None:
    """Raises `pickle.PicklingError` if `root`'s tree holds a function pickle cannot name.

    `pickle` stores a function as a reference to its module and name, so a lambda or a
    function defined inside another function (an activation, an initializer) fails, with
    Python's message naming neither the module nor the setting. This finds such a function
    first and names it by its attribute path from `root` (``layers_0.kernel.init``): in the
    `whole` tree, or (a submodule whose enclosing module checked it) in `root`'s own
    attributes only, so that pickling a model checks each module once.
    """
    stack: collections.deque[tuple[str, Module]] = collections.deque([(type(root).__name__, root)])
    seen = {id(root)}
    checked = []
    while stack:
        where, module = stack.popleft()  # in the order of the attributes
        checked.append(module)
        for name, value in vars(module).items():
            _check_value(f"{where}.{name}", value, stack if whole else None, seen)
    for module in checked[1:]:
        _CHECKED[id(module)] = weakref.ref(module, functools.partial(_forget, id(module)))


def _forget(key: int, _: Any) -> None:
    _CHECKED.pop(key, None)


def _check_value(where: str, value: Any, stack: collections.deque | None, seen: set[int]) -> None:
    if isinstance(value, Module):
        if stack is not None and id(value) not in seen:
            seen.add(id(value))
            stack.append((where, value))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(f"{where}[{i}]", item, stack, seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_value(f"{where}[{key!r}]", item, stack, seen)
    elif isinstance(value, functools.partial):
        _check_value(f"{where}.func", value.func, stack, seen)
        for i, item in enumerate(value.args):
            _check_value(f"{where}.args[{i}]", item, stack, seen)
        for key, item in value.keywords.items():
            _check_value(f"{where}.keywords[{key!r}]", item, stack, seen)
    elif isinstance(value, State):
        _check_value(f"{where}.init", value.init, stack, seen)
    elif isinstance(value, Initializer):
        if getattr(value, "_factory", None) is None:  # made from a function: pickled with it
            _check_value(f"{where}.fn", value.fn, stack, seen)
    elif isinstance(value, types.FunctionType):
        if not _named(value):
            raise pickle.PicklingError(_unnamed_message(where, value))
    elif (
        type(value).__module__.startswith("lamina.")
        and isinstance(getattr(value, "__dict__", None), dict)
        and id(value) not in seen
    ):
        seen.add(id(value))
        for name, item in vars(value).items():  # lamina's helpers (an initializer's view)
            _check_value(f"{where}.{name}", item, stack, seen)


def _named(function: types.FunctionType) -> bool:
    """Whether pickle finds `function` by its module and qualified name."""
    found: Any = sys.modules.get(function.__module__ or "")
    if found is None:
        return True  # not imported here: pickle decides
    for part in function.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is function


def _unnamed_message(where: str, function: types.FunctionType) -> str:
    kind = "a lambda" if function.__name__ == "<lambda>" else "a function defined in a function"
    initializer = ".init" in where or where.rsplit(".", 1)[-1].endswith("init")
    fix = (
        "Use an initializer of lm.initializers (such as lm.initializers.normal(0.02)) or "
        "jax.nn.initializers, or define the function at the top level of a module"
        if initializer
        else "Define it at the top level of a module (def, not lambda), or use a function "
        "lamina or JAX provides (lm.relu, jax.nn.gelu); functools.partial of a top-level "
        "function pickles too"
    )
    return (
        f"cannot pickle {where}: it is {kind} ({function.__qualname__!r} in module "
        f"{function.__module__}), and pickle stores a function as a reference to its module "
        f"and name, which cannot reach this one. {fix}."
    )


def _holds_parts(value: Any) -> bool:
    """Whether `value` is, or its lists, tuples and dicts hold, a module or a declaration."""
    if isinstance(value, (Module, State)):
        return True
    if isinstance(value, dict):
        return any(_holds_parts(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_parts(v) for v in value)
    return False


def _method_codes(attributes: Any) -> list[Any]:
    """The code objects of the functions among a class's attributes.

    Static and class methods, properties' accessors, cached properties and decorated
    functions (through ``__wrapped__``, as `functools.wraps` sets it) count; other attributes
    are skipped.
    """
    codes = []
    for attribute in attributes:
        functions: list[Any]
        if isinstance(attribute, (staticmethod, classmethod)):
            functions = [attribute.__func__]
        elif isinstance(attribute, property):
            functions = [attribute.fget, attribute.fset, attribute.fdel]
        elif isinstance(attribute, functools.cached_property):
            functions = [attribute.func]
        else:
            functions = [attribute]
        for function in functions:
            for _ in range(100):  # a chain of decorators (never a cycle)
                if isinstance(function, types.FunctionType):
                    codes.append(function.__code__)
                function = _wrapped(function)
                if function is None:
                    break
    return codes


def method_of(cls: type, code: Any) -> bool:
    """Whether `code` is a method's code of `cls`, looked up in its classes' attributes now.

    For a frame whose code `METHOD_CODES` does not hold (a function assigned to the class after
    it was created): the functions in ``vars()`` of each class of ``cls.__mro__`` count, by
    `_method_codes`'s rule. A method found is added to `METHOD_CODES`.
    """
    for klass in cls.__mro__:
        if klass is not object and any(c is code for c in _method_codes(vars(klass).values())):
            METHOD_CODES[id(code)] = code
            return True
    return False


def running_module(modules: Any) -> Module | None:
    """The module whose method is running: the innermost on the stack among `modules`.

    A frame counts when its first parameter holds a module whose id `modules` holds (a
    mapping or set of ids) and its code is a method of that module's classes
    (`METHOD_CODES`, else `method_of`). Other frames (closures, lambdas, helpers given a
    module, JAX's own frames) are passed over. Walks the Python stack: off hot paths only.

    Returns:
        The module, or None when no method of one of `modules` is running.
    """
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount:
            candidate = frame.f_locals.get(code.co_varnames[0])
            if (
                isinstance(candidate, Module)
                and id(candidate) in modules
                and (id(code) in METHOD_CODES or method_of(type(candidate), code))
            ):
                return candidate
        frame = frame.f_back
    return None


def register_calls() -> None:
    """Adds to `CALL_CODES` the ``__call__`` every Module subclass has now.

    Classes given a ``__call__`` after they were created, and ``__call__`` inherited from a
    base that is not a module, count. One dict lookup per class of each subclass's MRO.
    """
    pending, expanded, seen = [Module], set(), set()
    while pending:
        cls = pending.pop()
        if id(cls) in expanded:
            continue  # a subclass of two modules
        expanded.add(id(cls))
        for klass in cls.__mro__:
            if id(klass) not in seen:
                seen.add(id(klass))
                call = vars(klass).get("__call__") if klass is not object else None
                if call is not None:
                    CALL_CODES.update((id(c), c) for c in _method_codes([call]))
        pending.extend(cls.__subclasses__())


def _wrapped(value: Any) -> Any:
    """What `value` wraps (its own ``__wrapped__``), or None; never runs the value's code."""
    try:
        attributes = vars(value)
    except Exception:  # no __dict__ (or a __getattr__ that refuses): nothing wrapped
        return None
    return attributes.get("__wrapped__") if isinstance(attributes, dict) else None


def _repr_module(module: Module, indent: str, seen: set[int]) -> str:
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
    items = container.values() if isinstance(container, dict) else container
    for child in items:
        if isinstance(child, (Module, State)):
            return True
        if isinstance(child, (list, tuple, dict)) and _holds_nodes(child):
            return True
    return False
