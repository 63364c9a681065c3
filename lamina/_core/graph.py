"""One walk of the module tree, and the plan it produces.

Every feature that needs to know what a model holds (transform, assign_variables, filters,
summary, sharding, io) asks a `Plan` instead of walking the objects itself. The walk follows
attributes in insertion order, then list/tuple items and dict entries, and meets each `Module`
and `State` once: an object reachable by two paths (weight tying) belongs to its first path.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from .errors import Key, Path, format_path
from .module import Module
from .variables import State

Node = Module | State
FlatKey = tuple[str, ...]  # (collection, *path as strings): a leaf of the variables dict


def children(node: Any) -> Iterator[tuple[Key, Any]]:
    """The (key, child) pairs the walk descends into: attributes, list items, dict entries."""
    if isinstance(node, Module):
        for key, child in vars(node).items():
            if not key.startswith("_lamina_"):
                yield key, child
    elif isinstance(node, dict):
        for key, child in node.items():
            yield str(key), child
    elif isinstance(node, (list, tuple)):
        yield from enumerate(node)


@contextlib.contextmanager
def deep_recursion() -> Iterator[None]:
    """Lets walks and copies descend models thousands of modules deep.

    Python's default limit of 1000 frames allows a nesting of a few hundred modules; a
    400-deep model is legitimate, so the walk and the copy raise the limit while they run.
    """
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 50_000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def walk(root: Any) -> Iterator[tuple[Path, Node]]:
    """Yields ``(path, node)`` for every `Module` and `State` under `root`, each once.

    Args:
        root: A module (or a container of modules).

    Yields:
        The path from `root` (attribute names and dict keys as ``str``, list and tuple indices
        as ``int``) and the object, depth first, in attribute insertion order.
    """
    seen: set[int] = set()
    open_containers: set[int] = set()

    def visit(path: Path, node: Any) -> Iterator[tuple[Path, Node]]:
        if isinstance(node, (Module, State)):
            if id(node) in seen:
                return
            seen.add(id(node))
            yield path, node
            if isinstance(node, State):
                return
            _check_class_attributes(path, node)
        elif isinstance(node, (list, tuple, dict)):
            if id(node) in open_containers:
                return  # a container that holds itself
        else:
            _check_hidden(path, node)
            return
        open_containers.add(id(node))
        for key, child in children(node):
            if type(child) in _SETTINGS:
                continue  # nothing to find or refuse in it: skip a generator per setting
            yield from visit((*path, key), child)
        open_containers.discard(id(node))

    yield from visit((), root)


# Types of most module attributes (sizes, flags, names): they hold no submodules or
# variables, so the walk passes them by (`_check_hidden` would accept them too).
_SETTINGS = frozenset({str, bytes, int, float, complex, bool, type(None)})

_WHERE_LAMINA_LOOKS = (
    "lamina finds submodules and variables in a module's instance attributes (set in "
    "__init__) and in lists, tuples and dicts of them, nothing else"
)


def _check_path(path: Path) -> None:
    for depth, key in enumerate(path):
        if isinstance(key, str) and (not key or "/" in key):
            raise ValueError(
                f"{format_path(path[:depth]) if depth else 'the model'} holds a submodule or "
                f"variable under the key {key!r}: keys name variables in the variables dict "
                f"and in checkpoints, so they must be non-empty and contain no '/' (which "
                f"separates path parts). Rename it, or nest dicts instead of joining names "
                f"with '/'."
            )


_CLASS_NODES: dict[type, tuple[tuple[str, Any], ...]] = {}


def _class_nodes(cls: type) -> tuple[tuple[str, Any], ...]:
    """Modules and declarations defined in the body of `cls` or its bases (cached)."""
    nodes = _CLASS_NODES.get(cls)
    if nodes is None:
        nodes = _CLASS_NODES[cls] = tuple(
            (name, value)
            for base in cls.__mro__
            if base is not Module and base is not object
            for name, value in vars(base).items()
            if isinstance(value, (Module, State))
        )
    return nodes


def _check_class_attributes(path: Path, module: Module) -> None:
    for name, value in _class_nodes(type(module)):
        if name not in vars(module):
            raise TypeError(
                f"{type(module).__name__}.{name} is a {type(value).__name__} defined in the "
                f"class body (at {format_path((*path, name))}), so every instance would "
                f"share it and lamina does not see it: {_WHERE_LAMINA_LOOKS}. Create it in "
                f"__init__: `self.{name} = ...`."
            )


def _check_hidden(path: Path, node: Any) -> None:
    """Refuses containers that hide submodules or variables from the walk."""
    if isinstance(node, (str, bytes, int, float, complex, bool, type(None), type)):
        return
    items: Any = None
    if isinstance(node, (set, frozenset, collections.deque)):
        items = node
    elif isinstance(node, Mapping):
        items = node.values()
    elif hasattr(node, "__dict__") and not callable(node):
        items = vars(node).values()
    if items is None:
        return
    for item in items:
        if isinstance(item, (Module, State)):
            raise TypeError(
                f"{format_path(path)} is a {type(node).__name__} that holds a "
                f"{type(item).__name__}, where lamina cannot see it: {_WHERE_LAMINA_LOOKS}. "
                f"Keep it in a list or dict attribute of the module instead."
            )


def substitute(root: Module, replacements: dict[int, Any]) -> None:
    """Replaces in place every reference, anywhere under `root`, to the objects keyed by id.

    Attributes, list items and dict values are reassigned; a tuple that holds a replaced
    object is rebuilt. Shared objects are replaced at every path, so tying survives surgery.

    Args:
        root: The model to edit (not a snapshot that is being applied).
        replacements: ``{id(old): new}``.
    """
    seen: set[int] = set()

    def visit(node: Any) -> Any:
        if id(node) in replacements:
            return replacements[id(node)]
        if isinstance(node, Module):
            if id(node) not in seen:
                seen.add(id(node))
                for key, child in list(children(node)):
                    new = visit(child)
                    if new is not child:
                        setattr(node, str(key), new)
            return node
        if isinstance(node, list):
            node[:] = [visit(child) for child in node]
        elif isinstance(node, dict):
            for key in list(node):
                node[key] = visit(node[key])
        elif isinstance(node, tuple):
            items = [visit(child) for child in node]
            if any(new is not old for new, old in zip(items, node, strict=True)):
                return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        return node

    visit(root)


@dataclass(frozen=True, eq=False)
class VariableEntry:
    """One variable of a plan.

    Attributes:
        path: Keys from the model root to the declaration (list indices as ``int``).
        state: The declaration.
        key: Its leaf key in the variables dict: ``(collection, *path as str)``.
        axes: Sizes of the axes stored in front of the declared shape (a `Stack`'s depth, a
            vmapped ensemble's members); empty for a plain variable. Everything that checks
            shapes reads `shape`, never ``state.shape``.
        axis_names: The logical name of each of `axes` (``Stack(..., depth_sharding=...)``),
            None for an unnamed one; as long as `axes`.
    """

    path: Path
    state: State
    key: FlatKey
    axes: tuple[int, ...] = ()
    axis_names: tuple[str | None, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape stored in the variables: `axes` in front of the declared shape."""
        return self.axes + self.state.shape

    @property
    def logical_axes(self) -> tuple[str | None, ...]:
        """A logical axis name (or None) for each dimension of `shape`.

        `axis_names`, then the declaration's ``sharding`` (all None when it has none).
        """
        declared = self.state.sharding
        return self.axis_names + (
            (None,) * len(self.state.shape) if declared is None else tuple(declared)
        )

    @property
    def collection(self) -> str:
        """The collection the variable lives in."""
        return self.state.collection

    @property
    def name(self) -> str:
        """The path as messages write it: ``params/layer1/kernel``."""
        return "/".join(self.key)


class Plan:
    """What one walk of a module tree finds, in the order `jax.tree_util` flattens variables.

    Attributes:
        root: The walked module.
        modules: ``(path, module)`` for every module, in walk order (the root first).
        variables: One `VariableEntry` per variable, in the flatten order of the variables
            dict, so that ``jax.tree_util.tree_leaves(variables)[i]`` belongs to
            ``variables[i]``.
        declared: The same entries in walk order (the order the model declares them).
        treedef: The tree structure of a valid variables dict.
        shapes: The stored shape of each variable, in the same order.
        index: Position of each variable, by its `VariableEntry.key`.
    """

    def __init__(self, root: Module):
        if not isinstance(root, Module):
            raise TypeError(
                f"expected an lm.Module, got {type(root).__name__}. Models are defined by "
                f"subclassing lm.Module."
            )
        self.root = root
        modules: list[tuple[Path, Module]] = []
        declared: list[VariableEntry] = []
        skeleton: dict[str, Any] = {}
        with deep_recursion():
            for path, node in walk(root):
                _check_path(path)
                if isinstance(node, Module):
                    modules.append((path, node))
                    continue
                key = (node.collection, *(str(k) for k in path))
                _insert(skeleton, key, len(declared), declared)
                axes = tuple(node._lamina_axes)
                names = _axis_names(node, len(axes))
                declared.append(VariableEntry(path, node, key, axes, names))
        order, treedef = jax.tree_util.tree_flatten(skeleton)
        self.treedef: jax.tree_util.PyTreeDef = treedef
        self.modules = tuple(modules)
        self.declared = tuple(declared)
        self.variables = tuple(declared[i] for i in order)
        self.shapes = [entry.shape for entry in self.variables]
        self.index = {entry.key: i for i, entry in enumerate(self.variables)}
        self._slots_of: dict[int, tuple[int, ...]] = {}
        self._module_paths: dict[int, Path] | None = None

    def module_paths(self) -> dict[int, Path]:
        """``{id(module): path}`` for every module of the plan (built once)."""
        if self._module_paths is None:
            self._module_paths = {id(module): path for path, module in self.modules}
        return self._module_paths

    def slots_of(self, module: Module) -> tuple[int, ...]:
        """The slots (indices into `variables`) of the variables reachable from `module`.

        Reachability, not path prefix: a variable tied into `module` whose first path lies
        outside it still belongs to it. The result is cached per module.

        Args:
            module: A module of this plan (the root or any submodule).

        Returns:
            Slot indices in increasing order.
        """
        slots = self._slots_of.get(id(module))
        if slots is None:
            owned = {id(node) for _, node in walk(module) if isinstance(node, State)}
            slots = tuple(i for i, entry in enumerate(self.variables) if id(entry.state) in owned)
            self._slots_of[id(module)] = slots
        return slots

    def bind(self) -> None:
        """Marks the walked objects as this plan's: variables know their slot and path.

        Only `transform` calls this, on its private snapshot; a bound module is frozen while
        a call of this plan runs.
        """
        for path, module in self.modules:
            object.__setattr__(module, "_lamina_path", path)
        for slot, entry in enumerate(self.variables):
            entry.state._lamina_plan = self
            entry.state._lamina_slot = slot
            entry.state._lamina_path = entry.path

    def init_salt(self, entry: VariableEntry) -> int:
        """The number folded into the init key for `entry`: a hash of its key tuple.

        The hash reads the parts of the key, each with its length, so no two keys share an
        encoding. Its high bit is set, so these keys never coincide with the keys
        `next_rng_key` draws (which fold in a counter below 2**31).
        """
        encoded = b"".join(
            len(raw).to_bytes(4, "little") + raw for raw in (part.encode() for part in entry.key)
        )
        return zlib.crc32(encoded) | 0x80000000


def _axis_names(state: State, count: int) -> tuple[str | None, ...]:
    """The logical names of `state`'s `count` leading axes (set by `Stack`), None if unnamed."""
    # the instance dict, not getattr: a declaration's __getattr__ would build an error
    # message for every variable that has no names (almost all)
    names = tuple(vars(state).get("_lamina_axis_names", ()))
    padded = (None,) * count + names
    return padded[len(padded) - count :]


def _insert(skeleton: dict, key: FlatKey, value: int, declared: list[VariableEntry]) -> None:
    node = skeleton
    for depth, part in enumerate(key[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(
                f"two variables need the same place in the variables dict: "
                f"{format_path(declared[child].path, key[0])} is a variable but "
                f"{'/'.join(key)} sits below it. Rename one of the attributes or dict keys "
                f"(at {'/'.join(key[: depth + 2])})."
            )
        node = child
    if key[-1] in node:
        other = node[key[-1]]
        first = (
            format_path(declared[other].path, key[0])
            if isinstance(other, int)
            else "a group of variables"
        )
        raise ValueError(
            f"two variables need the same place in the variables dict, {'/'.join(key)}: "
            f"{first} already has it. Dict keys are written with str(), so keys such as 1 "
            f"and '1' collide; rename one."
        )
    node[key[-1]] = value
