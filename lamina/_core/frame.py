"""The active call: which plan runs, the arrays bound to its variables, its random streams.

`init` and `apply` each open a `Frame`. Variables read and write through the innermost frame
of their own plan, so a model may call another transformed model inside its own call, and a
lifted transform can open a nested frame of the same plan.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from .errors import ImmutableVariableError, UnboundVariableError, format_path

if TYPE_CHECKING:
    from .rng import RngStreams
    from .variables import State


class _Local(threading.local):
    frame: Frame | None = None


_LOCAL = _Local()


def current_frame() -> Frame | None:
    """Returns the innermost active frame of this thread, or None outside any call."""
    return _LOCAL.frame


class Frame:
    """One `init` or `apply` call in progress.

    Attributes:
        plan: The plan whose variables this frame binds.
        values: One array per variable, in the plan's slot order; writes replace entries.
        rngs: The call's random streams.
        phase: ``"init"`` or ``"apply"``.
        parent: The frame that was active when this one opened.
    """

    __slots__ = ("parent", "phase", "plan", "rngs", "values")

    def __init__(self, plan: Any, values: list, rngs: RngStreams, phase: str):
        self.plan = plan
        self.values = values
        self.rngs = rngs
        self.phase = phase
        self.parent: Frame | None = None

    def __enter__(self) -> Frame:
        self.parent = _LOCAL.frame
        _LOCAL.frame = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        _LOCAL.frame = self.parent

    def write(self, state: State, value: Any) -> None:
        """Stores a new value for `state`, checking that it may be written and fits."""
        if not state.mutable:
            raise ImmutableVariableError(
                f"{type(state).__name__} at {_where(state)} is immutable and cannot be written "
                f"inside {self.phase}. Parameters change through the optimiser (new variables "
                f"for the next call); for state that a call updates, declare "
                f"lm.State({state.collection!r}, shape, init, mutable=True)."
            )
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            value = jnp.asarray(value)
        if tuple(value.shape) != state.shape:
            raise ValueError(
                f"cannot write a value of shape {tuple(value.shape)} to {type(state).__name__} "
                f"at {_where(state)}, declared with shape {state.shape}."
            )
        if value.dtype != state.param_dtype:
            value = value.astype(state.param_dtype)
        self.values[state._lamina_slot] = value


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
                f"{kind}.value has no value outside init/apply: a declaration only describes "
                f"the variable (shape {state.shape}, collection {state.collection!r}). "
                f"Run `init, apply = lm.transform(model)` and read values from the dict "
                f"that init/apply return, or read .value inside the model's methods."
            )
        raise UnboundVariableError(
            f"this {kind} (shape {state.shape}) is not part of the model being applied. "
            f"lm.transform works on a copy of the model, so objects from the original model "
            f"(or ones created during the call) have no value here. Reach variables through "
            f"`self` inside the model's methods; if you used to_callable, make it use its "
            f"argument: `to_callable=lambda m: m.forward`."
        )
    raise UnboundVariableError(
        f"{kind} at {_where(state)} belongs to a transformed model that is not running: "
        f"its value exists only inside that model's init/apply call."
    )


def _where(state: State) -> str:
    path = state._lamina_path
    return format_path(path, state.collection) if path is not None else "<unplanned>"
