"""Variable declarations: `State` and its kinds. A declaration describes an array, holds none.

Inside `init`/`apply` a declaration *is* its array, to Python and to JAX: every operator and
protocol (arithmetic, comparisons, ``bool``, ``len``, iteration, indexing, ``int``/``float``)
acts on the value, and a declaration passed to a JAX function (``jnp.sum(self.w)``,
``jax.nn.relu(self.w)``, ``jax.lax.stop_gradient(self.w)``) or returned from a jitted function
is its value: declarations are pytree nodes whose one leaf is the value. Outside a call they
have no value, and all of these raise `UnboundVariableError`; only `.value = array` works there
(a constant initial value, for model surgery). Hashing is by identity, so declarations can be
set members and dict keys.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checks import as_dtype, check_cast, check_number, format_path, is_number
from .copying import copy_object
from .frame import Declaration, current_frame, frame_of, where_is
from .initializer import from_jax
from .types import Dtype, Initializer, Shape

# How models and declarations render in treescope (notebooks): filled by `lamina/rendering.py`
# when lamina is imported (a registration, so the core never imports it). Keys: ``"module"``
# and ``"state"``: ``fn(obj, path, subtree_renderer)``, a `__treescope_repr__`; ``"html"``:
# ``fn(module) -> str | None``, a module's ``_repr_html_``.
RENDERERS: dict[str, Callable[..., Any]] = {}


class State(Declaration):
    """An array the model declares: its collection, shape, initializer and dtypes.

    A `State` holds no value. Inside a call, `.value` is the array bound to it (cast to
    `dtype`); assigning `.value` stores a new one if the state is `mutable`. Outside a call,
    assigning `.value` replaces the initializer with that constant (the shape must match).
    Inside a call a state also behaves like its array: ``x @ self.kernel``, ``self.count += 1``.

    Args:
        collection: The top-level key its value lives under (``"params"``, ``"batch_stats"``...).
        shape: The array's shape.
        init: ``init(key, shape, dtype) -> array``; any `jax.nn.initializers` function works.
        dtype: The dtype `.value` returns (compute dtype); None: the storage dtype.
        param_dtype: The dtype stored in the variables (default: `dtype`, or float32 when
            `dtype` is None).
        mutable: Whether `apply` may write it.
        tags: Extra names that string filters match (the collection always matches).
        sharding: Logical axis names, one per dimension (``None`` for a replicated one).

    Example:
        >>> import jax.numpy as jnp, lamina as lm
        >>> count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)
        >>> count.shape, count.collection
        ((), 'counters')
    """

    # Set on the copy that `transform` plans; never on the user's own objects.
    _lamina_plan: Any = None
    _lamina_slot: int | None = None
    _lamina_path: tuple | None = None
    _lamina_stacked = False  # stored with a Stack's axes: reads check the frame (Plan.bind)
    _lamina_fixed_collection = False  # True for kinds whose constructor sets the collection

    def __init__(
        self,
        collection: str,
        shape: Sequence[int] | int,
        init: Initializer,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        mutable: bool = False,
        *,
        tags: Sequence[str] | str = (),
        sharding: Sequence[str | None] | None = None,
    ):
        where = type(self).__name__
        if not isinstance(collection, str) or not collection or "/" in collection:
            raise ValueError(
                f"{where}: collection must be a non-empty string without '/', got {collection!r}."
            )
        self.collection = collection
        self.shape = _as_shape(where, shape)
        if not callable(init):
            raise TypeError(
                f"{where}: init must be a function init(key, shape, dtype) -> array, such as "
                f"lm.initializers.zeros(); got {init!r}."
            )
        self.init = from_jax(init)  # JAX's closures: the same function, made picklable
        stored = (
            as_dtype(where, "param_dtype", param_dtype)
            if param_dtype is not None
            else as_dtype(where, "dtype", jnp.float32 if dtype is None else dtype)
        )
        self.dtype = stored if dtype is None else as_dtype(where, "dtype", dtype)
        self.param_dtype = stored
        if jnp.issubdtype(stored, jnp.complexfloating) and not jnp.issubdtype(
            self.dtype, jnp.complexfloating
        ):
            raise TypeError(
                f"{where}: param_dtype={stored} is complex but dtype={self.dtype} is not: every "
                f"read of .value would drop the imaginary part. Pass dtype={stored} or "
                f"dtype=None (read in the stored dtype)."
            )
        self.mutable = bool(mutable)
        self.tags = (tags,) if isinstance(tags, str) else tuple(tags)
        if not all(isinstance(t, str) for t in self.tags):
            raise TypeError(f"{where}: tags must be strings, got {self.tags!r}.")
        self.sharding = None if sharding is None else tuple(sharding)
        if self.sharding is not None and len(self.sharding) != len(self.shape):
            raise ValueError(
                f"{where}: sharding names one logical axis per dimension; shape {self.shape} has "
                f"{len(self.shape)} dimensions but sharding={self.sharding!r}."
            )

    @property
    def value(self) -> Any:
        """The bound array inside a call, cast to `dtype`.

        A variable of a `Stack`'s block is readable only as one copy: inside the Stack's
        call, or inside `lm.vmap`/`lm.scan` over the block with axis 0 (else `ValueError`,
        `Plan.check_one_copy`).
        """
        frame = current_frame()
        if frame is None or frame.plan is not self._lamina_plan:
            frame = frame_of(self)
        v = frame.values[self._lamina_slot]
        if self._lamina_stacked:  # inside a Stack's block: only one copy may be read
            self._lamina_plan.check_one_copy(frame, self._lamina_slot)
        if v.dtype == self.dtype:
            return v
        # A value stored as `param_dtype` always casts to the compute dtype; one that `apply`
        # was given in another dtype must widen to `param_dtype` (int32 for an int8 state
        # would wrap): checked only here, off the common path.
        if v.dtype != self.param_dtype:
            check_cast(v, self.param_dtype, lambda: self._given(v.dtype))
        return v.astype(self.dtype)

    @value.setter
    def value(self, new: Any) -> None:
        if self._lamina_plan is None:
            self._assign_initial(new)
            return
        frame = current_frame()
        if frame is None or frame.plan is not self._lamina_plan:
            frame = frame_of(self)
        frame.write(self, new)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register_pytree(cls)

    def _given(self, dtype: Dtype) -> str:
        """The start of the message for a value of `dtype` that `apply` got for this state."""
        stored = f"read as {self.dtype}"
        if self.dtype != self.param_dtype:
            stored = f"stored as {self.param_dtype} ({stored})"
        return f"{type(self).__name__} at {where_is(self)} got a {dtype} value, but it is {stored}"

    def _assign_initial(
        self, array: Any, path: str | None = None, stored: tuple[int, ...] | None = None
    ) -> None:
        # `stored`: the shape a plan stores (`VariableEntry.shape`, with a Stack's axes in
        # front); without a plan, `.value =` gives the declared shape (every copy of a Stack's
        # block starts from it).
        where = f" at {path}" if path else ""
        if isinstance(array, (str, bytes, State, jax.ShapeDtypeStruct)) or array is None:
            raise TypeError(
                f"cannot assign {type(array).__name__} {array!r:.60} to "
                f"{type(self).__name__}{where}: an initial value is an array (or a number)."
            )
        got = tuple(np.shape(array))
        if stored is None:
            stored = self.shape
        if got != stored:
            kind = "stored" if stored != self.shape else "declared"
            hint = ""
            lead = len(got) - len(stored)
            if kind == "declared" and lead > 0 and got[lead:] == stored:
                hint = (
                    f" A declaration holds one copy (under a Stack, every copy starts from "
                    f"it); to give each copy its own value (leading axes {got[:lead]}), use "
                    f"lm.assign_variables on the model that holds the Stack."
                )
            raise ValueError(
                f"cannot assign a value of shape {got} to {type(self).__name__}{where} {kind} "
                f"with shape {stored}; the shapes must be equal.{hint}"
            )
        name = f"{type(self).__name__}{where}, stored as {self.param_dtype}"
        if is_number(array):  # typed weakly, as a write's: any size that fits
            check_number(array, self.param_dtype, lambda: f"cannot assign {array!r} to {name}")
        else:
            value = array if hasattr(array, "dtype") else np.asarray(array)
            what = f"cannot assign a {value.dtype} value to {name}"
            check_cast(value, self.param_dtype, lambda: what, by_value=True)
        # A NumPy array is copied: the caller may change it before the model is transformed.
        self.init = Assigned(np.array(array) if isinstance(array, np.ndarray) else array)

    @property
    def ndim(self) -> int:
        """The number of dimensions of the declared shape."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements of the declared shape."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def T(self) -> Any:
        """The transposed value (inside a call)."""
        return self.value.T

    def __getattr__(self, name: str) -> Any:
        # Array methods (`reshape`, `sum`, `astype`, ...) on the value, inside a call only.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if not hasattr(jax.Array, name):
            renamed = _RENAMED.get(name)
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
                + (f" (Metoryx's .{name} is .{renamed} here)" if renamed else "")
                + ": a declaration has collection, shape, dtype, param_dtype, mutable, tags, "
                "sharding and init, and inside a call .value and the array's methods."
            )
        if self._lamina_plan is None and current_frame() is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} outside init/apply: "
                f"a declaration holds no array. Array methods such as .{name} work on it "
                f"inside the model's methods, while a call runs."
            )
        return getattr(self.value, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> State:
        return copy_object(self, memo)

    # NumPy: `np_array + state` and `np.float32(2) * state` defer to State's reflected methods.
    __array_priority__ = 1000

    def __jax_array__(self) -> Any:
        return self.value

    def __array__(self, dtype: Dtype = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.value, dtype=dtype)

    __hash__ = object.__hash__  # identity: the plan keys declarations by object

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def __setitem__(self, index: Any, new: Any) -> None:
        self.value = self.value.at[index].set(_unwrap(new))

    def __iter__(self) -> Any:
        return iter(self.value)

    def __len__(self) -> int:
        return len(self.value)

    def __contains__(self, item: Any) -> bool:
        return _unwrap(item) in self.value

    def __bool__(self) -> bool:
        return bool(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    def __complex__(self) -> complex:
        return complex(self.value)

    def __index__(self) -> int:
        return operator.index(self.value)

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(self.value, ndigits)

    def __format__(self, spec: str) -> str:
        if self._lamina_plan is None or current_frame() is None:
            return format(repr(self), spec)
        return format(self.value, spec)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        # A declaration is a pytree whose flattening reads its value, so treescope's pytree
        # handler would raise outside a call: it renders as a declaration instead.
        render = RENDERERS.get("state")
        return NotImplemented if render is None else render(self, path, subtree_renderer)

    def __repr__(self) -> str:
        where = ""
        if self._lamina_path is not None:
            where = f", path={format_path(self._lamina_path, self.collection)!r}"
        extra = "" if self.param_dtype == self.dtype else f", param_dtype={self.param_dtype}"
        collection = "" if self._lamina_fixed_collection else f"{self.collection!r}, "
        return (
            f"{type(self).__name__}({collection}shape={self.shape}, dtype={self.dtype}{extra}, "
            f"init={_name_of(self.init)}{where})"
        )


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, State) else x


def _unary(op: Callable[[Any], Any]) -> Callable:
    def method(self: State) -> Any:
        return op(self.value)

    return method


def _binary(op: Callable) -> Callable:
    def method(self: State, other: Any) -> Any:
        return op(self.value, _unwrap(other))

    return method


def _reflected(op: Callable) -> Callable:
    def method(self: State, other: Any) -> Any:
        return op(_unwrap(other), self.value)

    return method


def _inplace(op: Callable) -> Callable:
    def method(self: State, other: Any) -> State:
        self.value = op(self.value, _unwrap(other))
        return self  # so that `self.count += 1` rebinds the same declaration

    return method


_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": operator.abs,
    "invert": operator.invert,
}
for _name, _fn in _UNARY.items():
    setattr(State, f"__{_name}__", _unary(_fn))
for _name, _op in {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "matmul": operator.matmul,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
}.items():
    setattr(State, f"__{_name}__", _binary(_op))
    setattr(State, f"__r{_name}__", _reflected(_op))
    setattr(State, f"__i{_name}__", _inplace(_op))
for _name, _op in {"divmod": divmod}.items():
    setattr(State, f"__{_name}__", _binary(_op))
    setattr(State, f"__r{_name}__", _reflected(_op))
for _name, _op in {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
}.items():
    setattr(State, f"__{_name}__", _binary(_op))


def _register_pytree(cls: type) -> None:
    # A declaration flattens to its value and unflattens to the bare leaf: to JAX it *is* its
    # array, so `jnp.sum(self.w)`, `jax.nn.relu(self.w)` or returning `self.w` from a jitted
    # function see the value (and outside a call, flattening raises UnboundVariableError).
    jax.tree_util.register_pytree_node(cls, _flatten, _unflatten)


def _flatten(state: State) -> tuple[tuple[Any], None]:
    return (state.value,), None


def _unflatten(aux: None, children: Any) -> Any:
    del aux
    (leaf,) = children
    return leaf


_register_pytree(State)


class Parameter(State):
    """A trainable array: a `State` in collection ``"params"``, never mutable.

    Example:
        >>> import lamina as lm
        >>> w = lm.Parameter((3, 4), lm.initializers.lecun_normal())
        >>> w.collection, w.mutable
        ('params', False)
    """

    _lamina_fixed_collection = True

    def __init__(
        self,
        shape: Sequence[int] | int,
        init: Initializer,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        *,
        tags: Sequence[str] | str = (),
        sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(
            "params", shape, init, dtype, param_dtype, mutable=False, tags=tags, sharding=sharding
        )


class FrozenParam(State):
    """A parameter left out of training: collection ``"params"``, but not a `Parameter`.

    `lm.freeze` turns the chosen parameters of a copy of a model into `FrozenParam`s: paths,
    shapes, dtypes and checkpoints stay the same, while every filter for `lm.Parameter`
    (`lm.grad`'s default, `lm.split`, `lm.mask`) leaves them out, so an optimizer never
    updates them. The string ``"params"`` still matches them, and so does ``"frozen"``.

    Its value is read through `jax.lax.stop_gradient`, so differentiating anyway (plain
    `jax.grad` over the whole variables dict, or a filter such as ``"params"`` that includes
    it) gives exact zeros for it. An optimizer with weight decay over the whole tree would
    still shrink it: give the optimizer ``lm.split(model, variables, lm.Parameter, ...)[0]``.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> w = lm.FrozenParam((3, 4), lm.initializers.lecun_normal())
        >>> w.collection, w.mutable, isinstance(w, lm.Parameter)
        ('params', False, False)
        >>> model = lm.freeze(lm.Dense(2, 1), where=lm.PathContains("kernel"))
        >>> init, apply = lm.transform(model)
        >>> loss = lambda v: jnp.sum(apply(v, None, jnp.ones((1, 2)))[0])
        >>> jax.grad(loss)(init(jax.random.key(0)))["params"]
        {'bias': Array([1.], dtype=float32), 'kernel': Array([[0.],
               [0.]], dtype=float32)}
    """

    _lamina_fixed_collection = True

    def __init__(
        self,
        shape: Sequence[int] | int,
        init: Initializer,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        *,
        tags: Sequence[str] | str = (),
        sharding: Sequence[str | None] | None = None,
    ):
        tags = (tags,) if isinstance(tags, str) else tuple(tags)
        super().__init__(
            "params",
            shape,
            init,
            dtype,
            param_dtype,
            mutable=False,
            tags=(*tags, "frozen") if "frozen" not in tags else tags,
            sharding=sharding,
        )

    @property
    def value(self) -> Any:
        """The bound array inside a call, as `State.value`, behind `jax.lax.stop_gradient`."""
        return jax.lax.stop_gradient(super().value)

    @value.setter
    def value(self, new: Any) -> None:
        State.value.fset(self, new)  # type: ignore[attr-defined]  # mypy: an overload


class BatchStat(State):
    """A running statistic (collection ``"batch_stats"``, mutable), as in `BatchNorm`.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class RunningMean(lm.Module):
        ...     def __init__(self, size):
        ...         super().__init__()
        ...         self.mean = lm.BatchStat((size,), lm.initializers.zeros())
        ...     def __call__(self, x):
        ...         self.mean.value = 0.9 * self.mean.value + 0.1 * x.mean(0)
        ...         return x - self.mean.value[None]
        >>> init, apply = lm.transform(RunningMean(2))
        >>> _, new = apply(init(jax.random.key(0)), None, jnp.ones((4, 2)))
        >>> new["batch_stats"]["mean"]
        Array([0.1, 0.1], dtype=float32)
    """

    _lamina_fixed_collection = True

    def __init__(
        self,
        shape: Sequence[int] | int,
        init: Initializer,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        *,
        tags: Sequence[str] | str = (),
        sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(
            "batch_stats",
            shape,
            init,
            dtype,
            param_dtype,
            mutable=True,
            tags=tags,
            sharding=sharding,
        )


class Cache(State):
    """A decoding cache (collection ``"cache"``, mutable), as in incremental attention.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> class LastInput(lm.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.last = lm.Cache((2,), lm.initializers.zeros())
        ...     def __call__(self, x):
        ...         previous = self.last.value
        ...         self.last.value = x
        ...         return previous
        >>> init, apply = lm.transform(LastInput())
        >>> variables = init(jax.random.key(0))
        >>> _, variables = apply(variables, None, jnp.ones(2))
        >>> apply(variables, None, jnp.zeros(2))[0]
        Array([1., 1.], dtype=float32)
    """

    _lamina_fixed_collection = True

    def __init__(
        self,
        shape: Sequence[int] | int,
        init: Initializer,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = None,
        *,
        tags: Sequence[str] | str = (),
        sharding: Sequence[str | None] | None = None,
    ):
        super().__init__(
            "cache", shape, init, dtype, param_dtype, mutable=True, tags=tags, sharding=sharding
        )


class Assigned:
    """The initializer that `.value = array` installs: it returns that array.

    Args:
        array: The constant initial value.
    """

    def __init__(self, array: Any):
        self.array = array

    def __deepcopy__(self, memo: dict[int, Any]) -> Assigned:
        return copy_object(self, memo)  # a JAX array is shared, a NumPy array copied

    def __call__(self, key: Any, shape: Sequence[int], dtype: Dtype = jnp.float32) -> Any:
        del key, shape
        return jnp.asarray(self.array, dtype=dtype)

    def __repr__(self) -> str:
        return f"assigned{tuple(np.shape(self.array))}"


def _name_of(init: Any) -> str:
    name = getattr(init, "__qualname__", None)  # functions; initializer objects print themselves
    return name if name is not None else repr(init)


def _as_shape(where: str, shape: Any) -> Shape:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{where}: shape must be a tuple of ints, got {shape!r}.") from None
    if not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise TypeError(f"{where}: shape must be a tuple of non-negative ints, got {shape!r}.")
    return tuple(int(d) for d in dims)


# Attributes of Metoryx's declarations that lamina names otherwise.
_RENAMED = {"col": "collection"}
