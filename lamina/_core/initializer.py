"""`Initializer`: a named initializer that prints its settings and pickles, and `from_jax`.

The factories that make them are `lm.initializers`; declarations pass every initializer they
are given through `from_jax`, which makes the closures of `jax.nn.initializers` picklable.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checks import as_dtype
from .types import Dtype

# The factories of `lm.initializers` by name, which that module registers: an initializer
# that one of them made is made again by it when unpickled (its closure cannot be pickled).
FACTORIES: dict[str, Callable[..., Initializer]] = {}


class Initializer:
    """A named initializer: ``init(key, shape, dtype=float32) -> array``.

    Two initializers compare equal only when they provably make the same arrays: `init`
    initialises variables with equal initializers, shapes and dtypes in one vectorised call,
    and caches that call's compiled program by this equality. The factories of this module
    compare by their name and *every* argument; an `Initializer` built directly compares by its
    function's identity.

    Args:
        name: The factory's name, for printing.
        fn: The function that makes the array.
        config: The settings to print.

    Example:
        >>> import lamina as lm
        >>> lm.initializers.normal(0.02) == lm.initializers.normal(0.02)
        True
        >>> lm.initializers.lecun_normal() == lm.initializers.lecun_normal(in_axis=0)
        False
    """

    # A pure function of its key: `init` may vectorise it over many variables' keys.
    lamina_batchable = True

    def __init__(self, name: str, fn: Any, **config: Any):
        self.name = name
        self.fn = fn
        self.config = config
        self.dtype: Dtype = jnp.float32  # when a call gives none (a factory's `dtype=`)
        self._identity: tuple = ("fn", fn)
        self._factory: tuple[str, dict[str, Any]] | None = None  # (name, arguments) to remake

    @classmethod
    def of_factory(
        cls, name: str, fn: Any, arguments: dict[str, Any], dtype: Dtype = None, **shown: Any
    ) -> Initializer:
        """An initializer made by factory `name` from all of its `arguments`.

        `dtype` is the factory's ``dtype=``: the dtype of a call that names none (as in
        `jax.nn.initializers`); a variable's declaration always names its own.
        """
        if dtype is not None:
            dtype = as_dtype(name, "dtype", dtype)
            shown["dtype"] = dtype.name
        init = cls(name, fn, **shown)
        if dtype is not None:
            init.dtype = dtype
        init._identity = ("factory", name, _canonical(arguments), str(init.dtype))
        init._factory = (name, {**arguments, "dtype": dtype})
        return init

    @classmethod
    def _of_jax(cls, name: str, fn: Any, arguments: dict[str, Any], dtype: Dtype) -> Initializer:
        """`fn` itself, a closure that ``jax.nn.initializers.<name>(**arguments)`` made.

        Its values are `fn`'s own (a call without a dtype passes None, as JAX's would); what
        changes is that it pickles, by its factory and arguments, and prints them.
        """
        shown = dict(arguments)
        if dtype is not None:
            shown["dtype"] = np.dtype(dtype).name
        init = cls(f"jax.nn.initializers.{name}", fn, **shown)
        init.dtype = dtype
        init._identity = ("jax", name, _canonical(arguments), str(dtype))
        init._factory = (f"jax.nn.initializers.{name}", {**arguments, "dtype": dtype})
        return init

    def __getstate__(self) -> dict[str, Any]:
        # A factory's function is a closure of `jax.nn.initializers`, which pickle cannot
        # name: the factory's arguments travel instead and make it again (`__setstate__`).
        state = dict(vars(self))
        if self._factory is not None:
            del state["fn"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        if "fn" not in state and self._factory is not None:
            name, arguments = self._factory
            jax_name = name.removeprefix("jax.nn.initializers.")
            if jax_name != name:
                self.fn = getattr(jax.nn.initializers, jax_name)(**arguments)
            else:
                self.fn = FACTORIES[name](**arguments).fn

    def __deepcopy__(self, memo: dict[int, Any]) -> Initializer:
        return self  # immutable: a model's copy shares it (and its compiled group function)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __call__(self, key: Any, shape: Sequence[int], dtype: Dtype = None) -> jax.Array:
        """Makes an array of `shape` and `dtype` (default: the factory's) from `key`."""
        return self.fn(key, shape, self.dtype if dtype is None else dtype)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.name}({args})"


class _ByIdentity:
    """Compares equal to nothing but the same object (an array among the settings)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj  # held, so that its id cannot be reused while this exists

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _canonical(value: Any) -> Any:
    """A hashable form of a setting that is equal only for settings that act the same.

    Scalars compare with their type (``1`` and ``1.0`` and ``True`` differ), sequences item by
    item, mappings entry by entry; anything else (arrays, functions) by identity.
    """
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return (type(value), value)
    if isinstance(value, (np.generic, np.dtype)):
        return (type(value), value.item() if isinstance(value, np.generic) else str(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _canonical(v)) for k, v in value.items()))
    return _ByIdentity(value)


# The factories of `jax.nn.initializers` that return a closure (`zeros` and `ones` are
# module-level functions, which pickle by name); the glorot, he, lecun and xavier ones return
# `variance_scaling`'s.
_JAX_FACTORIES: dict[str, tuple] = {
    "constant": (0.0,),
    "uniform": (),
    "normal": (),
    "truncated_normal": (),
    "variance_scaling": (1.0, "fan_in", "normal"),
    "orthogonal": (),
    "delta_orthogonal": (),
}


@functools.cache
def _jax_closures() -> dict[int, tuple[str, Any, tuple[str, ...]]]:
    """``id(code) -> (factory name, code, its parameters)`` for the closures of the factories."""
    found = {}
    for name, example in _JAX_FACTORIES.items():
        factory = getattr(jax.nn.initializers, name)
        code = factory(*example).__code__
        found[id(code)] = (name, code, tuple(inspect.signature(factory).parameters))
    return found


def from_jax(init: Any) -> Any:
    """`init` as an `Initializer` if it is a closure made by `jax.nn.initializers`, else `init`.

    ``jax.nn.initializers.he_normal()`` and the like return local functions, which `pickle`
    cannot find by name: a model holding one could not be saved with `pickle`. Each layer and
    declaration passes the initializers it is given through this function: a closure of
    `jax.nn.initializers` (recognised by its code, its arguments read from its cells) becomes
    an `Initializer` that calls the very same closure, so its values are unchanged, and pickles
    as its factory and arguments (``jax.nn.initializers.variance_scaling(2.0, "fan_in",
    "truncated_normal", ...)`` is made again when it is unpickled). Anything else is returned
    as it is.

    Example:
        >>> import jax, lamina as lm
        >>> lm.initializers.from_jax(jax.nn.initializers.normal(0.5))
        jax.nn.initializers.normal(stddev=0.5)
    """
    code = getattr(init, "__code__", None)
    if type(init) is not types.FunctionType or code is None:
        return init
    known = _jax_closures().get(id(code))
    if known is None or known[1] is not code:
        return init
    name, _, parameters = known
    try:
        arguments = {
            var: cell.cell_contents
            for var, cell in zip(code.co_freevars, init.__closure__ or (), strict=True)
        }
    except ValueError:  # an empty cell: not a closure the factory finished making
        return init
    positional = code.co_varnames[: code.co_argcount]
    values = init.__defaults__ or ()
    defaults = dict(zip(positional[len(positional) - len(values) :], values, strict=True))
    if not set(arguments) <= set(parameters) or "dtype" not in defaults:
        return init  # another version of JAX: left as it is (pickle then says why it fails)
    ordered = {p: arguments[p] for p in parameters if p in arguments}
    return Initializer._of_jax(name, init, ordered, defaults["dtype"])


def initializer(where: str, name: str, value: Any) -> Callable[..., Any]:
    """Returns `value`; raises `TypeError` unless it is a function ``init(key, shape, dtype)``.

    A closure of `jax.nn.initializers` comes back as the `Initializer` that calls it
    (`from_jax`: same values, and it pickles).
    """
    if not callable(value):
        raise TypeError(
            f"{where}: {name} must be an initializer, a function init(key, shape, dtype) -> "
            f"array such as lm.initializers.lecun_normal(); got {value!r}."
        )
    return from_jax(value)
