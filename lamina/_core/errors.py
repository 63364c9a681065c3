"""The exceptions a user can meet, and how paths are written in their messages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Key = str | int
Path = tuple[Key, ...]


class VariablesError(ValueError):
    """Variables that do not fit the model: missing, unexpected or misshapen entries."""


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint: truncated, corrupted, or in another format."""


class FrozenModuleError(AttributeError):
    """An attribute of a module was assigned while the module was being applied."""


class ImmutableVariableError(AttributeError):
    """An immutable variable (a `Parameter`, or a `State` with `mutable=False`) was written."""


class RngError(ValueError):
    """A random key was asked for that the call was not given."""


class UnboundVariableError(RuntimeError):
    """A variable's value was read where it has none: outside `init`/`apply`."""


class TraceContextError(RuntimeError):
    """A key was drawn or a variable written inside a raw JAX transform begun inside a call."""


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
