"""The active call: which plan runs, the arrays bound to its variables, its random streams.

`init` and `apply` each open a `Frame`. Variables read and write through the innermost frame
of their own plan, so a model may call another transformed model inside its own call, and a
lifted transform can open a nested frame of the same plan.

A frame also records JAX's trace state when it opens (as Haiku's ``check_jax_usage`` and
Flax NNX's variables do). Drawing a key or writing a variable compares the trace state then
with the one recorded: a mismatch means the code runs inside a raw JAX transform (``jax.vmap``,
``jax.lax.scan``, ``jax.jit``, ``jax.checkpoint``...) that started *inside* the call, where a
key would repeat on every iteration and a written value would be a tracer that leaks out.
Transforms *around* ``apply`` are unaffected: the frame opens inside them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

from .checks import check_cast, check_number, format_path, is_number
from .errors import (
    ImmutableVariableError,
    TraceContextError,
    UnboundVariableError,
    VariablesError,
)
from .types import Shape

if TYPE_CHECKING:
    from .graph import Plan
    from .rng import RngStreams
    from .variables import State


class Declaration:
    """The base class of variable declarations (`variables.State` derives from it).

    Declarations lie above the frame (they read and write through it), so the frame
    recognises one by this base class rather than by importing them.
    """

    __slots__ = ()


class _Local(threading.local):
    frame: Frame | None = None


_LOCAL = _Local()


def current_frame() -> Frame | None:
    """Returns the innermost active frame of this thread, or None outside any call."""
    return _LOCAL.frame


def require_frame(where: str) -> Frame:
    """Returns the innermost active frame, or raises: `where` runs only inside init/apply."""
    frame = _LOCAL.frame
    if frame is None:
        raise RuntimeError(
            f"{where} runs only inside init/apply: call the model through "
            f"`init, apply = lm.transform(model)`."
        )
    return frame


class Frame:
    """One `init` or `apply` call in progress.

    Attributes:
        plan: The plan whose variables this frame binds.
        values: One array per variable, in the plan's slot order; writes replace entries.
        shapes: The shape each slot holds in this frame (the plan's stored shapes for a
            top-level call; a lifted transform's inner frame holds per-member shapes).
        rngs: The call's random streams.
        phase: ``"init"`` or ``"apply"``.
        parent: The frame that was active when this one opened.
        trace: JAX's trace state when the frame opened.
        inside: For a frame nested inside a transform, what runs it (``"lm.vmap"``).
        writable: The slots a nested frame may write (a lifted transform's argument
            modules); None for every slot, or, with `inside`, for none.
        records: What `lm.sow`/`lm.perturb` record into (`recording.Records`), or None when
            the caller asked for no such collection.
    """

    __slots__ = (
        "inside",
        "parent",
        "phase",
        "plan",
        "records",
        "rngs",
        "shapes",
        "trace",
        "values",
        "writable",
    )

    def __init__(
        self,
        plan: Plan,
        values: Any,
        rngs: RngStreams,
        phase: str,
        shapes: list[Shape] | None = None,
        inside: str | None = None,
        writable: frozenset[int] | None = None,
        records: Any = None,
    ):
        self.plan = plan
        self.records = records
        self.values = values
        self.shapes = plan.shapes if shapes is None else shapes
        self.rngs = rngs
        self.phase = phase
        self.inside = inside
        self.writable = writable
        self.parent: Frame | None = None
        self.trace: Any = None

    def __enter__(self) -> Frame:
        self.parent = _LOCAL.frame
        self.trace = get_opaque_trace_state()
        _LOCAL.frame = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        _LOCAL.frame = self.parent

    def check_trace(self, what: str | Callable[[], str], remedy: str) -> None:
        """Raises `TraceContextError` if a raw JAX transform started since the frame opened.

        Args:
            what: What was attempted, for the message (``"next_rng_key('dropout')"``), or a
                function that says it (called only when the check fails).
            remedy: What to do instead.
        """
        if get_opaque_trace_state() != self.trace:
            what = what() if callable(what) else what
            raise TraceContextError(
                f"{what} inside a JAX transform (jax.vmap, jax.lax.scan, jax.jit, "
                f"jax.checkpoint, jax.lax.cond, ...) that started inside this {self.phase} "
                f"call. {remedy} Transforms around apply (jax.jit(apply), jax.vmap(apply)) "
                f"are fine, and reading variables inside a transform is allowed."
            )

    def iterations(self, inside: str) -> Callable[[Any], Frame]:
        """Frames for the iterations of a JAX transform that lamina runs over user code.

        Call it before the transform; inside, open ``frame_for(i)`` around iteration `i`'s
        user code. Each such frame reads this frame's variables and draws keys from its own
        streams (forked here, folded with `i`), so keys differ per iteration; writing a
        variable there is an error (nothing would carry the value out).

        Args:
            inside: What runs the iterations, for messages (``"RNN's cell MyCell"``).

        Returns:
            ``frame_for(index) -> Frame``.
        """
        forked = self.rngs.fork()

        records = None if self.records is None else self.records.nested({}, blocked=inside)

        def frame_for(index: Any) -> Frame:
            streams = self.rngs.for_iteration(forked, index)
            return Frame(
                self.plan, self.values, streams, self.phase, self.shapes, inside, None, records
            )

        return frame_for

    def write(self, state: State, value: Any) -> None:
        """Stores a new value for `state`, checking that it may be written and fits.

        The checks compare a few attributes; messages (and the variable's path in them) are
        only built when a check fails, since writes run on every call.
        """
        slot: Any = state._lamina_slot
        if self.writable is not None and slot not in self.writable:
            raise TraceContextError(
                f"{_named(state)} was written inside {self.inside}, but its module is not an "
                f"argument of the transformed function: a module captured by closure can be "
                f"read inside a lifted transform, not written. Pass the module as an argument."
            )
        if self.inside is not None and self.writable is None:
            raise TraceContextError(
                f"{_named(state)} was written inside {self.inside}, which runs it under a JAX "
                f"transform: the written value would not be carried out of it. Keep state "
                f"updates outside, or return the new value and write it afterwards."
            )
        if not state.mutable:
            raise ImmutableVariableError(
                f"{_named(state)} is immutable and cannot be written inside {self.phase}. "
                f"Parameters change through the optimiser (new variables for the next call); "
                f"for state that a call updates, declare lm.State({state.collection!r}, shape, "
                f"init, mutable=True)."
            )
        self.check_trace(
            lambda: f"{_named(state)} was written",
            "The written value would be a tracer of that transform and leak out of it. Return "
            "the new value from the transformed function and write it after the transform.",
        )
        value = _as_value(value, state)
        expected = self.shapes[slot]
        if tuple(value.shape) != expected:
            raise ValueError(
                f"cannot write a value of shape {tuple(value.shape)} to {_named(state)}, "
                f"{self._held_as(state, expected)}."
            )
        target = state.param_dtype
        if value.dtype != target:
            check_cast(
                value,
                target,
                lambda: (
                    f"cannot write a {value.dtype} value to {_named(state)}, stored as {target}"
                ),
                state.dtype,
            )
            value = value.astype(target)
        self.values[slot] = value

    def _held_as(self, state: State, shape: Shape) -> str:
        """How a write's message states the shape this frame holds for `state`."""
        if shape == state.shape:
            return f"declared with shape {shape}"
        if self.inside is not None:
            each = {"lm.vmap": "each member of ", "lm.scan": "each step of "}
            within = each.get(self.inside, "")
            return f"of shape {shape} in {within}{self.inside} (declared {state.shape})"
        return f"stored as {shape} (declared {state.shape}, stacked axes in front)"


def _named(state: State) -> str:
    return f"{type(state).__name__} at {where_is(state)}"


def _as_value(value: Any, state: State) -> Any:
    """`value` as an array; a Python number checked and made in the storage dtype.

    A Python number takes the variable's dtype as in JAX's weak typing, whatever its size
    (``3_000_000_000`` into uint32), where it fits (`checks.check_number`).
    """
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, Declaration):
        return value
    if is_number(value):
        target = state.param_dtype
        check_number(
            value, target, lambda: f"cannot write {value!r} to {_named(state)}, stored as {target}"
        )
        return jnp.asarray(value, dtype=target)
    try:
        return jnp.asarray(value)
    except Exception as error:
        raise TypeError(
            f"cannot write {type(value).__name__} {value!r:.60} to {_named(state)}: expected "
            f"an array or a number."
        ) from error


def frame_of(state: State) -> Frame:
    """Finds the innermost active frame that binds `state`, or explains why there is none."""
    frame = _LOCAL.frame
    plan = state._lamina_plan
    while frame is not None:
        if frame.plan is plan:
            return frame
        frame = frame.parent
    kind = type(state).__name__
    if plan is None:
        if _LOCAL.frame is None:
            raise UnboundVariableError(
                f"{kind} has no value outside init/apply: a declaration only describes the "
                f"variable (shape {state.shape}, collection {state.collection!r}). Run "
                f"`init, apply = lm.transform(model)` and read values from the dict that "
                f"init/apply return, or use the variable inside the model's methods."
            )
        raise UnboundVariableError(
            f"this {kind} (shape {state.shape}) is not part of the model being applied. "
            f"lm.transform works on a copy of the model, so objects from the original model "
            f"(or ones created during the call) have no value here. Reach variables through "
            f"`self` inside the model's methods; if you used to_callable, make it use its "
            f"argument: `to_callable=lambda m: m.forward`. lamina finds submodules and "
            f"variables in a module's instance attributes and in lists, tuples and dicts of "
            f"them, nothing else."
        )
    raise UnboundVariableError(
        f"{kind} at {where_is(state)} belongs to a transformed model that is not running: "
        f"its value exists only inside that model's init/apply call."
    )


def where_is(state: State) -> str:
    """The path of a planned declaration as messages write it (``params/layer1/kernel``)."""
    path = state._lamina_path
    return format_path(path, state.collection) if path is not None else "<unplanned>"


class PendingValues:
    """Stands for `Frame.values` while `init` runs initializers: nothing is readable yet."""

    def __getitem__(self, slot: int) -> Any:
        raise UnboundVariableError(
            "variables cannot be read while init runs their initializers: an initializer "
            "receives (key, shape, dtype) and must not depend on other variables. Compute "
            "derived values inside apply instead."
        )

    def __setitem__(self, slot: int, value: Any) -> None:
        raise VariablesError("variables cannot be written while init runs their initializers.")
