"""What a call records when its caller asks: `Records`, and `apply`'s requests in and records out.

A collection the model does not declare, passed to `apply` among the variables
(``{**variables, "intermediates": {}}``), is a *request*: `split_requests` takes it out of the
variables, the call's frame holds a `Records` for it, the features of `lamina.records`
(``lm.sow``, ``lm.perturb``, ``lm.capture_intermediates``) record into that, and `finish`
returns the collections as nested dicts in the new variables. Entries given in a requested
collection are inputs; every given entry must be used, so a misspelt collection name is an
error, not ignored data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .checks import format_path
from .errors import VariablesError

if TYPE_CHECKING:
    from .module import Module

RecordKey = tuple
"""A record's key: the recording module's path, then the record's name."""

CaptureRequest = tuple[str, "Callable[[tuple, Module], bool]"]
"""What `capture_intermediates` asks for: ``(collection, predicate(path, module))``."""

MISSING: Any = object()
"""What `Records.read` returns for an entry neither recorded nor given."""


class Records:
    """What one frame records: the requested collections, given and produced entries.

    Attributes:
        given: ``{collection: {key: value}}``, the entries passed in.
        out: ``{collection: {key: value}}``, what the call recorded (and the given entries
            it used), in the order first recorded.
        used: The ``(collection, key)`` pairs of given entries that were read.
        capture: For `capture_intermediates`: ``(collection, predicate)`` or None.
        blocked: Where recording cannot happen (a raw JAX transform lamina runs, such as an
            RNN's scan over time), for the message; None where it can.
    """

    __slots__ = ("blocked", "calling", "capture", "given", "out", "used")

    def __init__(
        self,
        given: dict[str, dict[RecordKey, Any]],
        capture: CaptureRequest | None = None,
        blocked: str | None = None,
    ):
        self.given = given
        self.out: dict[str, dict[RecordKey, Any]] = {name: {} for name in given}
        self.used: set[tuple[str, RecordKey]] = set()
        self.capture = capture
        self.blocked = blocked
        self.calling: dict[int, int] = {}  # id(module) -> how many of its __call__ run

    def wants(self, collection: str) -> bool:
        """Whether the caller asked for `collection`."""
        return collection in self.out

    def read(self, collection: str, key: RecordKey) -> Any:
        """The entry recorded so far, else the given one (marked used), else `MISSING`."""
        out = self.out[collection]
        if key in out:
            return out[key]
        given = self.given[collection]
        if key in given:
            self.used.add((collection, key))
            return given[key]
        return MISSING

    def write(self, collection: str, key: RecordKey, value: Any) -> None:
        """Records `value` under `key`, unless recording is blocked here (`blocked`)."""
        if self.blocked is not None:
            raise VariablesError(
                f"cannot record {format_path(key, collection)} inside {self.blocked}: the "
                f"record could not leave that JAX transform. Record outside it, or return the "
                f"value and record it afterwards."
            )
        self.out[collection][key] = value

    def nested(self, given: dict[str, dict[RecordKey, Any]], blocked: str | None = None) -> Records:
        """Records for a frame nested inside a lifted transform, with the same requests."""
        inner = Records({c: given.get(c, {}) for c in self.out}, self.capture, blocked)
        return inner

    def absorb(self, inner: Records, produced: Mapping[str, Mapping[RecordKey, Any]], where: str):
        """Takes in what a nested frame recorded, and which given entries it used.

        `produced` is the nested frame's records as they came out of the transform, with its
        axes.
        """
        self.used |= inner.used
        for collection, entries in produced.items():
            out = self.out[collection]
            for key, value in entries.items():
                if key in out:
                    raise VariablesError(
                        f"{format_path(key, collection)} was recorded both inside {where} and "
                        f"outside it; the records inside carry the transform's axis, so they "
                        f"cannot be combined. Give them different names."
                    )
                out[key] = value

    def unused(self) -> list[tuple[str, RecordKey]]:
        """The given entries that nothing read."""
        given = self.given.items()
        return [(c, k) for c, entries in given for k in entries if (c, k) not in self.used]


def split_requests(
    variables: Any, declared: frozenset[str]
) -> tuple[Any, dict[str, dict[RecordKey, Any]] | None]:
    """Separates the collections the model does not declare (requests) from `variables`.

    Returns:
        ``(variables without them, {collection: {key: value}})``, or ``(variables, None)``
        when there is none (the common case, one pass over the top-level keys).
    """
    # every apply comes here: `issuperset` is the one pass over the keys, in C
    if not isinstance(variables, Mapping) or declared.issuperset(variables):
        return variables, None
    if declared and not any(c in declared for c in variables):
        return variables, None  # not a variables dict at all (variables["params"]?): bind says
    kept, requests = {}, {}
    for collection, tree in variables.items():
        if collection in declared:
            kept[collection] = tree
        else:
            requests[collection] = flatten_records(tree, collection)
    return kept, requests


def flatten_records(tree: Any, collection: str) -> dict[RecordKey, Any]:
    """``{key: leaf}`` of a nested dict of records.

    Dicts are followed; anything else is an entry (a tuple of sown values is one entry).
    """
    if not isinstance(tree, Mapping):
        raise VariablesError(
            f"the collection {collection!r} passed to apply is not a dict: the model does "
            f"not declare it, so it is taken as a request to record (lm.sow, lm.perturb), "
            f"which is a dict of records ({{}} to ask for them), got {type(tree).__name__}."
        )
    flat: dict[RecordKey, Any] = {}

    def visit(prefix: RecordKey, node: Mapping) -> None:
        for name, child in node.items():
            if isinstance(child, Mapping):
                visit((*prefix, name), child)
            else:
                flat[(*prefix, name)] = child

    visit((), tree)
    return flat


def finish(records: Records, plan_collections: frozenset[str]) -> dict[str, Any]:
    """The requested collections as nested dicts; raises if a given entry went unused."""
    _refuse_unused(records, plan_collections)
    return {collection: _nest(collection, entries) for collection, entries in records.out.items()}


def _refuse_unused(records: Records, plan_collections: frozenset[str]) -> None:
    unused = records.unused()
    if unused:
        shown = ", ".join(format_path(k, c) for c, k in unused[:5])
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        collections = sorted({c for c, _ in unused})
        declared = ", ".join(repr(c) for c in sorted(plan_collections)) or "none"
        raise VariablesError(
            f"apply was given {shown}{more}, but no lm.sow or lm.perturb of this call used "
            f"it. The model declares the collections {declared}; "
            f"{', '.join(repr(c) for c in collections)} is not one of them, so it is read as "
            f"records to reduce into. Check the collection's name and the record's path."
        )


def _nest(collection: str, entries: dict[RecordKey, Any]) -> dict[str, Any]:
    """One collection's records as a nested dict, refusing a record where a module records."""
    tree: dict[str, Any] = {}
    for key, value in entries.items():
        node = tree
        for part in key[:-1]:
            child = node.setdefault(str(part), {})
            if not isinstance(child, dict):
                raise VariablesError(
                    f"{format_path(key, collection)} and the record "
                    f"{format_path(key[: len(key) - 1], collection)} collide: a module "
                    f"path and a record name are the same. Rename the record."
                )
            node = child
        if isinstance(node.get(str(key[-1])), dict):
            raise VariablesError(
                f"the record {format_path(key, collection)} has the path of a module that "
                f"records too. Rename the record."
            )
        node[str(key[-1])] = value
    return tree


# `capture_intermediates`'s request, for the applies it wraps (this thread's).
class _Capture(threading.local):
    request: CaptureRequest | None = None


CAPTURE = _Capture()
