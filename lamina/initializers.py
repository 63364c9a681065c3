"""Initializer factories: each returns ``init(key, shape, dtype) -> array``.

They are `jax.nn.initializers` under names that print their settings (``lecun_normal()``),
which `lm.summary` and error messages show. Any function with that signature works where an
initializer is expected, `jax.nn.initializers.zeros` included.

Example:
    >>> import jax, lamina as lm
    >>> init = lm.initializers.normal(stddev=0.02)
    >>> init
    normal(stddev=0.02)
    >>> init(jax.random.key(0), (2, 3)).shape
    (2, 3)
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Axes = int | Sequence[int]

__all__ = [
    "Initializer",
    "constant",
    "delta_orthogonal",
    "from_jax",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]


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
        self.dtype: Any = jnp.float32  # when a call gives none (a factory's `dtype=`)
        self._identity: tuple = ("fn", fn)
        self._factory: tuple[str, dict[str, Any]] | None = None  # (name, arguments) to remake

    @classmethod
    def _of(
        cls, name: str, fn: Any, arguments: dict[str, Any], dtype: Any = None, **shown: Any
    ) -> Initializer:
        """An initializer made by factory `name` from all of its `arguments`.

        `dtype` is the factory's ``dtype=``: the dtype of a call that names none (as in
        `jax.nn.initializers`); a variable's declaration always names its own.
        """
        if dtype is not None:
            dtype = _as_dtype(name, dtype)
            shown["dtype"] = dtype.name
        init = cls(name, fn, **shown)
        if dtype is not None:
            init.dtype = dtype
        init._identity = ("factory", name, _canonical(arguments), str(init.dtype))
        init._factory = (name, {**arguments, "dtype": dtype})
        return init

    @classmethod
    def _of_jax(cls, name: str, fn: Any, arguments: dict[str, Any], dtype: Any) -> Initializer:
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
                self.fn = globals()[name](**arguments).fn

    def __deepcopy__(self, memo: dict[int, Any]) -> Initializer:
        return self  # immutable: a model's copy shares it (and its compiled group function)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __call__(self, key: Any, shape: Sequence[int], dtype: Any = None) -> jax.Array:
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


def _as_dtype(name: str, dtype: Any) -> np.dtype:
    try:
        return np.dtype(jax.dtypes.canonicalize_dtype(jnp.dtype(dtype)))
    except TypeError:
        raise TypeError(
            f"{name}: dtype must be a dtype such as jnp.float32, got {dtype!r}."
        ) from None


_DEFAULT_AXES = {"in_axis": -2, "out_axis": -1, "batch_axis": ()}


def _scaling(name: str, in_axis: Axes, out_axis: Axes, batch_axis: Axes, dtype: Any) -> Initializer:
    axes = {"in_axis": in_axis, "out_axis": out_axis, "batch_axis": batch_axis}
    fn = getattr(jax.nn.initializers, name)(**axes)
    shown = {k: v for k, v in axes.items() if v != _DEFAULT_AXES[k]}
    return Initializer._of(name, fn, axes, dtype, **shown)


def _real(name: str, setting: str, value: Any) -> Any:
    """`value` if it is a real number; a `TypeError` naming the setting otherwise."""
    try:
        kind = np.asarray(value).dtype if np.ndim(value) == 0 else None
    except (TypeError, ValueError):
        kind = None
    if (
        kind is None
        or kind == np.bool_
        or not np.issubdtype(kind, np.number)
        or (np.issubdtype(kind, np.complexfloating))
    ):
        raise TypeError(
            f"{name}: {setting} must be a real number, got {value!r} (a dtype goes in "
            f"dtype=, as in jax.nn.initializers.{name})."
        )
    return value


def zeros(dtype: Any = None) -> Initializer:
    """All zeros.

    Example:
        >>> import jax, lamina as lm
        >>> lm.initializers.zeros()(jax.random.key(0), (2,))
        Array([0., 0.], dtype=float32)
    """
    return Initializer._of("zeros", jax.nn.initializers.zeros, {}, dtype)


def ones(dtype: Any = None) -> Initializer:
    """All ones.

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> lm.initializers.ones(jnp.int32)(jax.random.key(0), (2,))
        Array([1, 1], dtype=int32)
    """
    return Initializer._of("ones", jax.nn.initializers.ones, {}, dtype)


def constant(value: Any, dtype: Any = None) -> Initializer:
    """Every element equal to `value` (an array broadcasts to the shape).

    Example:
        >>> import jax, lamina as lm
        >>> lm.initializers.constant(0.5)(jax.random.key(0), (3,))
        Array([0.5, 0.5, 0.5], dtype=float32)
    """
    return Initializer._of(
        "constant", jax.nn.initializers.constant(value), {"value": value}, dtype, value=value
    )


def normal(stddev: float = 1e-2, dtype: Any = None) -> Initializer:
    """Normal with mean 0 and the given standard deviation.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.normal(0.02)(jax.random.key(0), (1000,))
        >>> round(float(x.std()), 2)
        0.02
    """
    stddev = _real("normal", "stddev", stddev)
    return Initializer._of(
        "normal", jax.nn.initializers.normal(stddev), {"stddev": stddev}, dtype, stddev=stddev
    )


def uniform(scale: float = 1e-2, dtype: Any = None) -> Initializer:
    """Uniform on ``[0, scale)``.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.uniform(0.5)(jax.random.key(0), (1000,))
        >>> bool(x.min() >= 0), bool(x.max() < 0.5)
        (True, True)
    """
    scale = _real("uniform", "scale", scale)
    return Initializer._of(
        "uniform", jax.nn.initializers.uniform(scale), {"scale": scale}, dtype, scale=scale
    )


def truncated_normal(
    stddev: float = 1e-2, dtype: Any = None, lower: float = -2.0, upper: float = 2.0
) -> Initializer:
    """Normal truncated to ``[lower, upper]`` standard deviations, then scaled by `stddev`.

    The arguments are in `jax.nn.initializers.truncated_normal`'s order (and Metoryx's):
    `dtype` second.

    Example:
        >>> import jax, lamina as lm
        >>> x = lm.initializers.truncated_normal(1.0)(jax.random.key(0), (1000,))
        >>> bool(abs(x).max() <= 2.0)
        True
    """
    config = {
        "stddev": _real("truncated_normal", "stddev", stddev),
        "lower": _real("truncated_normal", "lower", lower),
        "upper": _real("truncated_normal", "upper", upper),
    }
    fn = jax.nn.initializers.truncated_normal(stddev, lower=lower, upper=upper)
    return Initializer._of("truncated_normal", fn, config, dtype, **config)


def variance_scaling(
    scale: float,
    mode: str = "fan_in",
    distribution: str = "truncated_normal",
    in_axis: Axes = -2,
    out_axis: Axes = -1,
    batch_axis: Axes = (),
    dtype: Any = None,
) -> Initializer:
    """Variance ``scale / fan`` with ``fan`` by `mode` (fan_in, fan_out, fan_avg, fan_geo_avg).

    Args:
        scale: Scaling factor of the variance.
        mode: Which fan divides it.
        distribution: ``"truncated_normal"``, ``"normal"`` or ``"uniform"``.
        in_axis: Axes that count towards fan-in.
        out_axis: Axes that count towards fan-out.
        batch_axis: Axes ignored by the fans.
        dtype: The dtype of a call that names none (default float32).

    Example:
        >>> import jax, lamina as lm
        >>> init = lm.initializers.variance_scaling(2.0, "fan_in", "normal")
        >>> kernel = init(jax.random.key(0), (512, 256))  # variance 2 / 512
        >>> round(float(kernel.var() * 512), 1)
        2.0
    """
    modes = ("fan_in", "fan_out", "fan_avg", "fan_geo_avg")
    distributions = ("truncated_normal", "normal", "uniform")
    if mode not in modes:
        raise ValueError(f"variance_scaling: mode must be one of {modes}, got {mode!r}.")
    if distribution not in distributions:
        raise ValueError(
            f"variance_scaling: distribution must be one of {distributions}, got {distribution!r}."
        )
    fn = jax.nn.initializers.variance_scaling(
        scale,
        mode,  # type: ignore[arg-type]  # checked above
        distribution,  # type: ignore[arg-type]
        in_axis=in_axis,
        out_axis=out_axis,
        batch_axis=batch_axis,
    )
    shown = {"scale": scale, "mode": mode, "distribution": distribution}
    axes = {"in_axis": in_axis, "out_axis": out_axis, "batch_axis": batch_axis}
    shown.update({k: v for k, v in axes.items() if v != _DEFAULT_AXES[k]})
    return Initializer._of("variance_scaling", fn, {**shown, **axes}, dtype, **shown)


def lecun_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Truncated normal, variance ``1 / fan_in`` (the default of `Dense` and `Conv`).

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.lecun_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256), 1)
        1.0
    """
    return _scaling("lecun_normal", in_axis, out_axis, batch_axis, dtype)


def lecun_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Uniform, variance ``1 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.lecun_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256), 1)
        1.0
    """
    return _scaling("lecun_uniform", in_axis, out_axis, batch_axis, dtype)


def glorot_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Truncated normal, variance ``2 / (fan_in + fan_out)``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.glorot_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 384 / 2), 1)
        1.0
    """
    return _scaling("glorot_normal", in_axis, out_axis, batch_axis, dtype)


def glorot_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Uniform, variance ``2 / (fan_in + fan_out)``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.glorot_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 384 / 2), 1)
        1.0
    """
    return _scaling("glorot_uniform", in_axis, out_axis, batch_axis, dtype)


def he_normal(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Truncated normal, variance ``2 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.he_normal()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256 / 2), 1)
        1.0
    """
    return _scaling("he_normal", in_axis, out_axis, batch_axis, dtype)


def he_uniform(
    in_axis: Axes = -2, out_axis: Axes = -1, batch_axis: Axes = (), dtype: Any = None
) -> Initializer:
    """Uniform, variance ``2 / fan_in``.

    Example:
        >>> import jax, lamina as lm
        >>> kernel = lm.initializers.he_uniform()(jax.random.key(0), (256, 128))
        >>> round(float(kernel.var() * 256 / 2), 1)
        1.0
    """
    return _scaling("he_uniform", in_axis, out_axis, batch_axis, dtype)


xavier_normal = glorot_normal
xavier_uniform = glorot_uniform
kaiming_normal = he_normal
kaiming_uniform = he_uniform


def _in_float32(fn: Any) -> Any:
    """`fn` computed in float32 for narrower floats (XLA's CPU has no bfloat16 QR), then cast."""

    def init(key: Any, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
            return fn(key, shape, jnp.float32).astype(dtype)
        return fn(key, shape, dtype)

    return init


def orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: Any = None) -> Initializer:
    """A (scaled) orthogonal matrix, over all axes but `column_axis`.

    bfloat16 and float16 matrices are made in float32 and rounded (Linen's fails on the CPU).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> q = lm.initializers.orthogonal()(jax.random.key(0), (4, 4))
        >>> bool(jnp.allclose(q.T @ q, jnp.eye(4), atol=1e-5))
        True
    """
    fn = _in_float32(jax.nn.initializers.orthogonal(scale, column_axis))
    config = {"scale": scale, "column_axis": column_axis}
    return Initializer._of("orthogonal", fn, config, dtype, **config)


def delta_orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: Any = None) -> Initializer:
    """Delta-orthogonal for convolution kernels (orthogonal at the centre, zero elsewhere).

    Example:
        >>> import jax, jax.numpy as jnp, lamina as lm
        >>> kernel = lm.initializers.delta_orthogonal()(jax.random.key(0), (3, 3, 4, 4))
        >>> float(jnp.abs(kernel[0, 0]).sum()), kernel[1, 1].shape  # zero off the centre
        (0.0, (4, 4))
    """
    fn = _in_float32(jax.nn.initializers.delta_orthogonal(scale, column_axis))
    config = {"scale": scale, "column_axis": column_axis}
    return Initializer._of("delta_orthogonal", fn, config, dtype, **config)
