"""One walk of the module tree, and the plan it produces.

Every feature that needs to know what a model holds (transform, assign_variables, filters,
summary, sharding, io) asks a `Plan` instead of walking the objects itself. The walk follows
attributes in insertion order, then list/tuple items and dict entries, and meets each `Module`
and `State` once: an object reachable by two paths (weight tying) belongs to its first path.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
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
        elif isinstance(node, (list, tuple, dict)):
            if id(node) in open_containers:
                return  # a container that holds itself
        else:
            return
        open_containers.add(id(node))
        for key, child in children(node):
            yield from visit((*path, key), child)
        open_containers.discard(id(node))

    yield from visit((), root)


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
    """

    path: Path
    state: State
    key: FlatKey

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
        for path, node in walk(root):
            if isinstance(node, Module):
                modules.append((path, node))
                continue
            key = (node.collection, *(str(k) for k in path))
            _insert(skeleton, key, len(declared), declared)
            declared.append(VariableEntry(path, node, key))
        order, self.treedef = jax.tree_util.tree_flatten(skeleton)
        self.modules = tuple(modules)
        self.declared = tuple(declared)
        self.variables = tuple(declared[i] for i in order)
        self.shapes = [entry.state.shape for entry in self.variables]
        self.index = {entry.key: i for i, entry in enumerate(self.variables)}

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
        """The number folded into the init key for `entry`: a hash of its path.

        Its high bit is set, so these keys never coincide with the keys `next_rng_key` draws
        (which fold in a counter below 2**31).
        """
        return zlib.crc32(entry.name.encode()) | 0x80000000


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
