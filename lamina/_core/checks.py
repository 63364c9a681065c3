"""Argument checks shared by the core and the layers, and the rule of casts into a variable.

Each check takes `where`, the caller as messages name it (``"lm.load"``, ``"LSTMCell"``,
``"Conv(in_size=3, out_size=8, kernel_size=(3, 3))"``), then the argument's name and value, and
raises with what was wrong and what to do; the checks of settings return the value in its
canonical type. Messages write paths with `format_path` and long lists with `format_list`.

How a value enters a variable: a cast may widen it, never narrow its dtype or change its kind.

Every way a value reaches a variable's storage checks its dtype here (`check_cast`): a write
inside a call (`Frame.write`), a read of a value that `apply` was given in another dtype
(`State.value`), a substitution (`substitution.substituted`), an initializer that returns
another dtype (`transform._initial_value`), and ``.value =`` or `assign_variables` before
`transform`. The rule is decided by dtypes, so it holds under `jax.jit` as it does eagerly;
values are looked at only where they are known and the dtypes leave it open:

- A value in the variable's storage dtype is stored as it is. One in its compute dtype (a
  declaration with ``dtype`` wider than ``param_dtype`` says that storage rounds) is too, but
  where its values are known they must be within the storage's range (1e5 into float16
  storage is a `ValueError`; a traced one is accepted, as declared).
- Otherwise the cast must widen: bool to anything, an integer to an integer type that holds
  every value of it, an integer to a float whose range holds it, a float to a float (or complex)
  with at least its precision and range. int32 to int8, float32 to float16 or bfloat16,
  bfloat16 to float16, uint8 to int8 all narrow, and a float becoming an int or a complex a
  real loses its kind: each is a `TypeError` that says how to cast explicitly.
- Python numbers and weak-typed arrays take the variable's dtype, as in JAX's weak-type
  promotion (``int8_array + jnp.where(c, 1, 0)`` is int8), whatever their size; their kind
  must not be higher. Where the value is known it must fit (`check_number`: 300 into int8, -1
  into uint32 and 1e300 into float32 are `ValueError`, as is ``jnp.full(shape, 1e5)`` into
  float16; ``3_000_000_000`` into uint32 is fine). A traced one (``jnp.where(x > 0, 1.0, 0.0)``
  under `jax.jit`, or a Python number passed to a jitted function) has unknown values: it is
  cast as JAX's promotion casts it, so values beyond the target's range wrap (integers) or
  become inf (floats) exactly as they would in ``int8_array + x``.
- Without ``jax_enable_x64``, 64-bit NumPy values become 32-bit as everywhere in JAX; their
  values must fit.

A value fits when every integer lies within ``np.iinfo(target)`` (a sign change narrows:
uint8 200 into int8, -1 into uint8), and every finite float within the target's finite range
(for a complex target, both parts within its component's): `narrowing_damage`, shared with
`from_torch`. Values that `assign_variables`, ``.value =`` and initializers install may narrow
within their kind: loading float32 weights into a bfloat16 model, or drawing them with
``jax.random.normal`` for it, is surgery on initial values, not a silent cast. Concrete ones
must fit; traced ones (``jax.jit(init)``, a Stack's copies) are cast, rounding as the cast does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import SettingTypeError
from .types import Dtype, Key

# --- how messages write paths and lists ------------------------------------------------------


def format_path(path: Sequence[Key], collection: str | None = None) -> str:
    """Writes a path the way messages show it: ``params/layers/0/kernel``.

    Args:
        path: Keys from the model root.
        collection: Written in front of the path when given.

    Returns:
        The keys joined by ``/``; ``<root>`` for the empty path.
    """
    parts = ([collection] if collection is not None else []) + [str(k) for k in path]
    return "/".join(parts) if parts else "<root>"


def format_list(items: Iterable[str], limit: int = 8) -> str:
    """Joins at most `limit` items with commas and says how many were left out."""
    items = list(items)
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f", ... and {len(items) - limit} more"
    return shown


def format_problems(groups: Iterable[tuple[str, Sequence[str], int]]) -> list[str]:
    """One line per non-empty group, ``label (count): items``, at most `limit` items shown.

    Example:
        >>> from lamina._core.checks import format_problems
        >>> format_problems([("missing", ["a", "b", "c"], 2), ("unexpected", [], 8)])
        ['missing (3): a, b, ... and 1 more']
    """
    return [
        f"{label} ({len(items)}): {format_list(items, limit=limit)}"
        for label, items, limit in groups
        if items
    ]


# --- flags ------------------------------------------------------------------------------------


def flag(where: str, name: str, value: Any, *, static: bool = False) -> bool:
    """Returns `value` as a bool; raises unless it is one.

    For on/off settings (``use_bias``, ``strict``...), Python's or NumPy's bool:
    ``use_bias="False"`` or ``use_bias=0`` would otherwise be read by truthiness
    (`SettingTypeError`). With `static`, for the flags of a call (``is_training``,
    ``decode``...): they choose what is computed, so they must be known while tracing (under
    `jax.jit`, static), and only a Python bool is one (`TypeError`).
    """
    if static:
        if not isinstance(value, bool):
            raise TypeError(
                f"{where}: {name} must be a Python bool, got {type(value).__name__}: it "
                f"chooses what is computed, so it cannot be a traced value. Under jax.jit, make "
                f"it static: jax.jit(step, static_argnames='{name}'), or call apply with a "
                f"literal True/False inside the jitted function."
            )
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise SettingTypeError(
            f"{where}: {name} must be True or False, got {type(value).__name__} "
            f"{_short_repr(value)}."
        )
    return bool(value)


def _short_repr(value: Any, limit: int = 100) -> str:
    """`repr(value)` on one line, cut to about `limit` characters (a dict can be huge)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flags(where: str, /, **values: Any) -> None:
    """`flag` for each of `values` (name=value): on/off settings, Python's or NumPy's bools."""
    for name, value in values.items():
        flag(where, name, value)


def static_flags(where: str, /, **values: Any) -> None:
    """`flag` with `static` for each of `values` (name=value): a call's flags, Python bools."""
    for name, value in values.items():
        flag(where, name, value, static=True)


# --- numbers ----------------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """Whether `value` is a real number (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_dim(value: Any) -> bool:
    """Whether `value` is an array dimension: an int >= 0, or a symbolic one.

    `jax.export` traces with symbolic sizes (``b`` of ``batch_dims="b"``), which are not ints:
    a check of shapes accepts them through this, and keeps them with `as_dim`.
    """
    return (is_int(value) and value >= 0) or jax.export.is_symbolic_dim(value)


def as_dim(value: Any) -> Any:
    """A dimension as shapes hold it: a Python int, or a symbolic dimension unchanged."""
    return value if jax.export.is_symbolic_dim(value) else int(value)


def is_concrete(x: Any) -> bool:
    """Whether `x` holds known values (not a tracer of `jax.jit`, `vmap`, `grad`...)."""
    return not isinstance(x, jax.core.Tracer)


def positive_int(where: str, name: str, value: Any, meaning: str = "") -> int:
    """Returns `value` as an int; raises unless it is an integer >= 1 (a bool is not).

    Args:
        where: The caller, as messages name it.
        name: The setting's name.
        value: The setting.
        meaning: Appended to "must be a positive int", e.g. ``", the size of the input's last
            axis"``.
    """
    if not is_int(value) or value < 1:
        error = ValueError if is_int(value) else SettingTypeError
        raise error(f"{where}: {name} must be a positive int{meaning}, got {value!r}.")
    return int(value)


def non_negative_int(where: str, name: str, value: Any, meaning: str = "") -> int:
    """Returns `value` as an int; raises unless it is an integer >= 0 (a bool is not)."""
    if not is_int(value) or value < 0:
        error = ValueError if is_int(value) else SettingTypeError
        raise error(f"{where}: {name} must be a non-negative int{meaning}, got {value!r}.")
    return int(value)


def non_negative(
    where: str,
    name: str,
    value: Any,
    *,
    at_most: float | None = None,
    below: float | None = None,
    meaning: str = "",
) -> float:
    """Returns `value` as a float; raises unless it is a finite real number >= 0 (in bounds).

    A bool is not a number here (``Dropout(True)`` is a mistake, not a rate of 1).

    Args:
        where: The caller, as messages name it.
        name: The setting's name.
        value: The setting.
        at_most: An upper bound that `value` may equal (``[0, at_most]``).
        below: An upper bound that `value` must stay under (``[0, below)``).
        meaning: Appended to the requirement, e.g. ``" (the weight of the old average)"``.
    """
    if below is not None:
        requirement = f"a number in [0, {below:g})"
    elif at_most is not None:
        requirement = f"a number in [0, {at_most:g}]"
    else:
        requirement = "a finite non-negative number"
    fits = is_real(value) and math.isfinite(value) and value >= 0
    fits = fits and (below is None or value < below) and (at_most is None or value <= at_most)
    if not fits:
        error = ValueError if is_real(value) else SettingTypeError
        hint = ""
        if isinstance(value, str):
            hint = " (a string is not a number: write 0.5, not '0.5')"
        elif isinstance(value, (bool, np.bool_)):
            hint = " (True and False are not numbers here)"
        raise error(f"{where}: {name} must be {requirement}{meaning}, got {value!r}{hint}.")
    return float(value)


# --- dtypes and functions ---------------------------------------------------------------------


def as_dtype(where: str, name: str, value: Dtype) -> np.dtype:
    """Returns `value` as JAX stores it; raises `TypeError` if it names no dtype (None included).

    64-bit types become 32-bit ones unless ``jax_enable_x64`` is on, as JAX's own arrays do, so
    that a declared dtype is the dtype of the arrays (and `summary` counts the right bytes).
    """
    if value is None:
        raise TypeError(
            f"{where}: {name} must be a dtype such as jnp.float32, got None; leave the "
            f"argument out for the default."
        )
    try:
        result = jnp.dtype(value)
    except TypeError:
        raise TypeError(
            f"{where}: {name} must be a dtype such as jnp.float32, got {value!r}."
        ) from None
    return np.dtype(jax.dtypes.canonicalize_dtype(result))


def function(where: str, name: str, value: Any, example: str) -> Callable[..., Any]:
    """Returns `value`; raises `TypeError` unless it is callable (an activation, ...)."""
    if not callable(value):
        raise TypeError(f"{where}: {name} must be a function such as {example}, got {value!r}.")
    return value


# --- casts into a variable --------------------------------------------------------------------


def check_cast(
    value: Any,
    target: Any,
    what: Callable[[], str],
    also: Any = None,
    *,
    by_value: bool = False,
    given: Any = None,
) -> None:
    """Raises if `value` may not enter a variable stored as `target` (see the module's rule).

    Args:
        value: The array, NumPy array or tracer entering the variable (its ``dtype`` and
            ``weak_type`` decide; its values are looked at only where the rule says so).
        target: The variable's storage dtype (``param_dtype``).
        what: Builds the start of the message (only on failure), e.g. ``"cannot write a
            int32 value to State at counters/steps, stored as int8"``.
        also: A second dtype that is stored as it is: the variable's compute dtype. Its
            concrete values must still fit in `target` (rounding is what it declares).
        by_value: Accept a narrower dtype of the same kind when the concrete values survive
            the cast but for rounding (``.value =``, `assign_variables` and initializers);
            a tracer's values are unknown, so a narrower dtype of its kind is accepted.
        given: What the user wrote, if `value` was made from it: a Python number is known
            even where its array is a tracer (``jnp.asarray(300)`` under `jax.jit`).

    Raises:
        TypeError: The cast would narrow a strong dtype, drop a fraction or an imaginary part,
            or turn numbers into bools, or the value is not numeric. A weak-typed tracer of a
            kind no higher than `target` is accepted: its values are unknown, and the caller's
            cast wraps (integers) or overflows to inf (floats) those beyond `target`'s range,
            exactly as JAX's weak-type promotion does.
        ValueError: A concrete value that must fit (a Python number, a weak-typed array, a
            64-bit NumPy value without x64, an assigned value, a value in the compute dtype)
            does not.
    """
    source = value.dtype
    if source == target:
        return
    if is_number(given):
        check_number(given, target, what)
        return
    if also is not None and source == also:  # declared rounding; its range is still checked
        _raise_damage(narrowing_damage(value, np.dtype(source), np.dtype(target)), what)
        return
    source, target = np.dtype(source), np.dtype(target)
    weak = bool(getattr(value, "weak_type", False))
    x64 = jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)
    verdict = _verdict(source, target, weak, bool(x64))
    if verdict == "widens":
        return
    if verdict in ("fits", "weak") or (verdict == "narrows" and by_value):
        _raise_damage(narrowing_damage(value, source, target), what)
        return
    raise TypeError(f"{what()}: {_refusal(verdict, source, target)}")


# Python's numbers, by exact type: NumPy's scalars (np.float64 subclasses float) are arrays.
_PYTHON_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64, complex: np.complex128}


def is_number(value: Any) -> bool:
    """Whether `value` is a Python number (not a NumPy scalar): JAX types it weakly."""
    return type(value) in _PYTHON_DTYPES


def check_number(number: Any, target: Any, what: Callable[[], str]) -> None:
    """Raises if the Python `number` may not be stored as `target` (see the module's rule).

    A Python number takes the variable's dtype, as in JAX's weak-type promotion: its kind
    must not be higher (1.5 into an int is a `TypeError`) and its value must fit (300 into
    int8, -1 into uint32 or 1e300 into float32 is a `ValueError`). Ints beyond int32 are
    fine where they fit (``3_000_000_000`` into uint32).
    """
    target = np.dtype(target)
    source = np.dtype(jax.dtypes.canonicalize_dtype(_PYTHON_DTYPES[type(number)]))
    x64 = jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)
    verdict = _verdict(source, target, True, bool(x64))
    if verdict not in ("widens", "weak"):
        raise TypeError(f"{what()}: {_refusal(verdict, source, target)}")
    _raise_damage(narrowing_damage(number, source, target), what)


def _raise_damage(damage: str | None, what: Callable[[], str]) -> None:
    if damage is not None:
        raise ValueError(
            f"{what()}: {damage}. Declare the variable with a wider dtype, or bring the "
            f"values into range first."
        )


def _refusal(verdict: str, source: np.dtype, target: np.dtype) -> str:
    name = f"jnp.{target.name}"
    if verdict == "not numeric":
        return (
            f"a {source} array is not a numeric array (strings and Python objects cannot be "
            f"variables). Pass numbers: an array of a numeric dtype such as {name}."
        )
    if verdict == "imaginary":
        return (
            f"the cast would drop the imaginary part. Convert it explicitly "
            f"(jnp.real(x).astype({name})), or declare the variable with dtype={source}."
        )
    if verdict == "fraction":
        return (
            f"the cast would drop the fraction. Convert it explicitly "
            f"(jnp.round(x).astype({name})), or declare the variable with dtype={source}."
        )
    if verdict == "truth":
        return (
            f"the cast would turn every nonzero value into True. Compare explicitly (x != 0), "
            f"or declare the variable with dtype={source}."
        )
    source = np.dtype(jax.dtypes.canonicalize_dtype(source))  # int64 is int32 without x64
    if _rank(target) == 1:
        loss = "wrap the values that do not fit"
    elif _rank(source) == 1:
        loss = "turn large values into inf"
    else:
        loss = "round the values, or turn those beyond its range into inf"
    rounding = ""
    if _rank(target) in (2, 3) and _rank(source) in (2, 3):
        rounding = (
            f", or declare that storage rounds (dtype={source}, param_dtype={target}: a "
            f"compute dtype wider than the storage is accepted and rounded into it)"
        )
    return (
        f"{source} is wider than {target}, and the cast would {loss}. Casts into a variable "
        f"only widen: cast explicitly if the loss is meant (x.astype({name})){rounding}, or "
        f"store the variable as {source} (param_dtype={source})."
    )


@functools.cache
def _verdict(source: np.dtype, target: np.dtype, weak: bool, x64: bool) -> str:
    """What storing a `source` value as `target` does (`x64`: part of the cache's key).

    Returns:
        ``widens``, ``fits`` (allowed if the concrete values fit), ``narrows`` (refused
        unless judged by value), ``weak`` (a weak-typed value whose dtype `target` does not
        hold: judged by value where concrete, cast as JAX promotes where traced), ``fraction``,
        ``imaginary``, ``truth`` (a number to a bool) or ``not numeric``.
    """
    have, want = _rank(source), _rank(target)
    if have is None or want is None:
        return "not numeric"
    if have > want:
        return {3: "imaginary", 2: "fraction"}.get(have, "truth")
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(source))
    if _holds(canonical, target):
        return "widens" if canonical == source else "fits"
    # A Python number takes the variable's dtype, as in JAX's promotion: where it is known
    # its value must fit; where it is traced, it is cast as JAX's promotion casts it.
    return "weak" if weak else "narrows"


def _rank(dtype: np.dtype) -> int | None:
    """0 bool, 1 integer, 2 float, 3 complex; None for what is not a number."""
    # jnp.issubdtype, not NumPy's `kind`: bfloat16 and the float8 kinds have kind "V"
    for rank, kind in enumerate((jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)):
        if jnp.issubdtype(dtype, kind):
            return rank
    return None


def _holds(source: np.dtype, target: np.dtype) -> bool:
    """Whether `target` holds every value of `source`, a kind no higher (ints round in floats)."""
    if source == target or np.can_cast(source, target, "safe") or _rank(source) == 0:
        return True
    if _rank(target) == 1:
        return False  # integers: NumPy's safe casting decided
    wide = jnp.finfo(target)
    if _rank(source) == 1:
        return float(wide.max) >= float(jnp.iinfo(source).max)
    narrow = jnp.finfo(source)
    return bool(
        wide.nmant >= narrow.nmant and wide.maxexp >= narrow.maxexp and wide.minexp <= narrow.minexp
    )


def narrowing_damage(array: Any, source: np.dtype, target: np.dtype) -> str | None:
    """What casting the concrete `array` to a narrower `target` would break.

    Integers beyond the target's range (``np.iinfo``: 200 into int8, -1 into uint8) wrap
    around, and finite numbers beyond a float target's range (for a complex target, either
    part beyond its component's) become inf (or NaN in float8 kinds without inf); rounding
    within the range is a cast's business. Tracers (values not known yet) and other kinds of
    cast (a float into an integer) are not judged here.

    Args:
        array: The values: an array, a NumPy array or a Python number (any size).
        source: The dtype `array` has (for a Python number: its weak dtype, which tells its
            kind; its value may lie beyond it).
        target: The dtype it would be cast to.

    Returns:
        A description for an error message, or None when the cast keeps every value.
    """
    if isinstance(array, jax.core.Tracer):
        return None
    if not is_number(array) and np.can_cast(source, target, "safe"):
        return None
    have, want = _rank(source), _rank(target)
    if have is None or want is None or have > want or want == 0:
        return None  # another kind: check_cast decides
    values = np.asarray(array)
    if not values.size:
        return None
    if want == 1:
        info = np.iinfo(target)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            return (
                f"its values ({low} to {high}) do not fit in {target} ({info.min} to "
                f"{info.max}), and a cast would wrap them"
            )
        return None
    part = np.dtype(jnp.finfo(target).dtype)  # a complex target's component
    parts = (values.real, values.imag) if have == 3 else (values,)
    lost = [_beyond(p, part) for p in parts]
    count = sum(int(p.sum()) for p in lost)
    if not count:
        return None
    largest = max(
        _magnitude(np.abs(p[m].astype(object)).max())
        for p, m in zip(parts, lost, strict=True)
        if m.any()
    )
    limit = float(jnp.finfo(part).max)
    within = f"largest {limit:g}" if want == 2 else f"each part at most {limit:g}"
    return (
        f"{count} finite value(s) (the largest {largest:g}) are beyond {target}'s range "
        f"({within}), and a cast would make them inf or NaN"
    )


def _magnitude(value: Any) -> float:
    try:
        return abs(float(value))
    except OverflowError:  # a Python int beyond float64
        return float("inf")


def _beyond(values: np.ndarray, target: np.dtype) -> np.ndarray:
    """Which of the real `values` are finite but become inf or NaN as the float `target`."""
    if values.dtype.kind in "biuO":  # integers (Python's unbounded ones too) are finite
        limit = int(float(jnp.finfo(target).max))
        return np.asarray(np.abs(values.astype(object)) > limit, dtype=bool)
    with np.errstate(over="ignore", invalid="ignore"):  # what the cast breaks is the question
        cast = values.astype(target).astype(np.float64)
        return np.asarray(np.isfinite(values.astype(np.float64)) & ~np.isfinite(cast))


# False while a caller traces a program that must not call the host (see below).
_RUN_TIME_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lamina_run_time_checks", default=True
)


@contextlib.contextmanager
def without_run_time_checks() -> Iterator[None]:
    """Programs traced inside leave out the layers' run-time checks that call the host.

    A layer that can only check a traced value when the program runs (a decoding step's cache
    index: `nn.attention_decoding.check_at_run_time`) puts a `lax.cond` calling the host
    (`jax.debug.callback`) into the program. Two callers trace without it: `lm.generate`, which
    made the cache and counts the steps itself (the check would cost a `cond` per layer and
    step), and `lm.export`, whose artifacts cannot hold host callbacks. A concrete value is
    still checked, and the layers' on-device guards stay (a step that does not fit, past
    ``max_length`` or at a negative index, keeps the cached keys and values and gives NaN,
    while ``cache_index`` still advances by the step's length): only the error from the host
    goes. It acts while tracing, so enter it inside the function that `jax.jit` traces.

    Example:
        >>> from lamina._core.checks import run_time_checks_wanted, without_run_time_checks
        >>> with without_run_time_checks():
        ...     print(run_time_checks_wanted())
        False
        >>> run_time_checks_wanted()
        True
    """
    token = _RUN_TIME_CHECKS.set(False)
    try:
        yield
    finally:
        _RUN_TIME_CHECKS.reset(token)


def run_time_checks_wanted() -> bool:
    """Whether a layer may put a host-calling run-time check into the traced program."""
    return _RUN_TIME_CHECKS.get()
