"""Casts at a module's boundary: what a mixed-precision policy adds to a transformed model.

`lm.with_policy` decides, for each module of a copy of a model, what its call must cast and
records it on the module as a `Boundary` (the attribute ``_lamina_boundary``); `transform`
calls `install_boundaries` on its private snapshot, which gives each such module a subclass of
its class (`boundary_class`) whose ``__call__`` casts the floating inputs, calls the module's
own ``__call__`` and casts the floating outputs. The user's objects keep their classes: only
the snapshot that `apply` runs is changed, and a module without a boundary (a layer that
casts its inputs itself, the common case) runs exactly the code it runs without a policy.

State a module carries from one call to the next (an RNN cell's carry) must keep one dtype,
so a module can also be given the dtype its carry is made in (``_lamina_carry_dtype``): the
methods its class names in ``_lamina_carry_methods`` (``("initialize_carry",)``) then return
their floating results in that dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from .module import Module
from .variables import State


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The casts around one module's call.

    Attributes:
        input_dtype: The dtype every floating argument is cast to before the call (arrays and
            tracers of a floating dtype, in any pytree; integers, booleans, keys and Python
            numbers pass unchanged), or None to pass them as they come.
        output_dtype: The dtype every floating output is cast to, or None.
        output_like_input: Whether each floating output leaf is cast back to the dtype of
            the first argument's leaf in its place (a `Stack`'s block: the scan's carry must
            leave it in the dtype it came in), where no `output_dtype` is given.

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina._core.casting import Boundary
        >>> Boundary(jnp.dtype("bfloat16"), None)
        Boundary(input_dtype=bfloat16, output_dtype=None)
    """

    input_dtype: np.dtype | None
    output_dtype: np.dtype | None
    output_like_input: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> Boundary:
        return self  # immutable: copies of a model share it

    def __repr__(self) -> str:
        def name(dtype: np.dtype | None) -> str:
            return "None" if dtype is None else np.dtype(dtype).name

        like = ", output_like_input=True" if self.output_like_input else ""
        return (
            f"Boundary(input_dtype={name(self.input_dtype)}, "
            f"output_dtype={name(self.output_dtype)}{like})"
        )


def is_floating(value: Any) -> bool:
    """Whether `value` is an array (or tracer) of a real floating dtype."""
    dtype = getattr(value, "dtype", None)
    return (
        isinstance(dtype, np.dtype)
        and not isinstance(value, (State, Module))
        and hasattr(value, "shape")
        and bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))
    )


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with every floating array leaf of another dtype cast to `dtype`.

    Leaves already in `dtype`, and leaves that are not floating arrays (integer and boolean
    arrays, PRNG keys, Python numbers, strings, None), are returned as they are, so a cast
    appears in a program only where a value changes dtype. Declarations (`State`) and modules
    passed as arguments are leaves too: they pass as they are (what they hold is cast where
    it is read, in the module's own dtypes).

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina._core.casting import cast_floating
        >>> x, ids = cast_floating((jnp.ones(2), jnp.arange(2)), jnp.bfloat16)
        >>> x.dtype, ids.dtype
        (dtype(bfloat16), dtype('int32'))
    """

    def cast(leaf: Any) -> Any:
        if not is_floating(leaf) or leaf.dtype == dtype:
            return leaf
        if isinstance(leaf, np.ndarray):
            return jax.numpy.asarray(leaf.astype(dtype))  # rounded once, from its own dtype
        return leaf.astype(dtype)

    return jax.tree_util.tree_map(cast, tree, is_leaf=_opaque)


def _opaque(value: Any) -> bool:
    return isinstance(value, (State, Module))


def cast_like(tree: Any, like: Any) -> Any:
    """`tree`'s floating array leaves cast to the dtypes of `like`'s leaves in their places.

    Only where both are floating arrays; `tree` comes back as it is when the structures
    differ.

    Example:
        >>> import jax.numpy as jnp
        >>> from lamina._core.casting import cast_like
        >>> cast_like((jnp.ones(2, jnp.bfloat16), 1), (jnp.ones(2), 2))[0].dtype
        dtype('float32')
    """
    leaves, structure = jax.tree_util.tree_flatten(tree, is_leaf=_opaque)
    targets, target_structure = jax.tree_util.tree_flatten(like, is_leaf=_opaque)
    if not _same_structure(structure, target_structure):
        return tree
    cast = [
        leaf.astype(target.dtype)
        if is_floating(leaf) and is_floating(target) and leaf.dtype != target.dtype
        else leaf
        for leaf, target in zip(leaves, targets, strict=True)
    ]
    return jax.tree_util.tree_unflatten(structure, cast)


def _same_structure(a: Any, b: Any) -> bool:
    return bool(a == b)


def _call_with_boundary(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``__call__`` of a boundary class: casts, the module's own call, casts."""
    boundary = self.__dict__["_lamina_boundary"]
    if boundary.input_dtype is not None:
        args, kwargs = cast_floating((args, kwargs), boundary.input_dtype)
    outputs = type(self)._lamina_unwrapped.__call__(self, *args, **kwargs)
    if boundary.output_dtype is not None:
        outputs = cast_floating(outputs, boundary.output_dtype)
    elif boundary.output_like_input and args:
        outputs = cast_like(outputs, args[0])
    return outputs


@functools.cache
def boundary_class(cls: type) -> type:
    """The subclass of `cls` that a module with a boundary runs as (one per class, cached).

    It has `cls`'s ``__name__``, ``__qualname__`` and ``__module__``, so messages and
    ``type(module).__name__`` read as before, and only a ``__call__`` of its own, which
    `Module.__init_subclass__` registers like every module's (so
    `lm.capture_intermediates` records the cast output once, as the module's).

    Example:
        >>> import lamina as lm
        >>> from lamina._core.casting import boundary_class
        >>> cls = boundary_class(lm.LayerNorm)
        >>> cls.__name__, issubclass(cls, lm.LayerNorm), boundary_class(lm.LayerNorm) is cls
        ('LayerNorm', True, True)
    """
    namespace = {
        "__call__": _call_with_boundary,
        "__qualname__": cls.__qualname__,
        "__module__": cls.__module__,
        "__doc__": cls.__doc__,
        "_lamina_unwrapped": cls,
    }
    return type(cls.__name__, (cls,), namespace)


class _CarryIn:
    """A module's carry method whose floating results come in `dtype` (see the module doc)."""

    __slots__ = ("dtype", "method")

    def __init__(self, method: Any, dtype: Any):
        self.method = method
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return cast_floating(self.method(*args, **kwargs), self.dtype)


def install_boundaries(modules: Any) -> None:
    """Gives the modules of a transformed snapshot the casts `lm.with_policy` decided.

    A module holding a `Boundary` (``_lamina_boundary``) becomes an instance of
    `boundary_class` of its class; one holding a carry dtype (``_lamina_carry_dtype``) gets
    the methods its class names in ``_lamina_carry_methods`` wrapped to return that dtype.
    Every other module is left as it is. Only `transform` calls this, on its own snapshot,
    whose modules the user never sees.

    Args:
        modules: The snapshot's modules (`Plan.modules`: ``(path, module)`` pairs).
    """
    for _, module in modules:
        own = module.__dict__
        boundary = own.get("_lamina_boundary")
        if boundary is not None and "_lamina_unwrapped" not in vars(type(module)):
            cls: Any = type(module)
            object.__setattr__(module, "__class__", boundary_class(cls))
        carry = own.get("_lamina_carry_dtype")
        if carry is not None:
            for name in getattr(type(module), "_lamina_carry_methods", ()):
                own[name] = _CarryIn(getattr(module, name), carry)
