"""One walk of the module tree, and the plan it produces.

Every feature that needs to know what a model holds (transform, assign_variables, filters,
summary, sharding, io) asks a `Plan` instead of walking the objects itself. The walk follows
attributes in insertion order, then list/tuple items and dict entries, and meets each `Module`
and `State` once: an object reachable by two paths (weight tying) belongs to its first path.
A `Stack` adds a leading axis to every variable reached through it (`StackedAxis`): the stored
layout is the plan's, and the user's declarations keep their declared shapes.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax

from .checks import format_path
from .module import Module, running_module
from .types import Key, Path, Shape
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


class StackedAxis(NamedTuple):
    """A leading axis that an enclosing module (a `Stack`) stores the variables below it with.

    A module class declares one by defining
    ``_lamina_stacked_axis(self) -> (size, name, attributes)``: the walk adds the axis to
    everything reached through the named attributes (a `Stack`'s ``("block",)``), and only
    those; the module's other attributes (a subclass's own layers) keep their layout.

    Attributes:
        size: The axis's length (the number of copies).
        name: Its logical axis name for `lm.shardings`, or None.
        path: The path of the module that adds it.
        owner: That module.
    """

    size: int
    name: str | None
    path: Path
    owner: Any


Axes = tuple[StackedAxis, ...]  # the stacked axes a node lies under, outermost first


def walk(root: Any, outer: Axes = ()) -> Iterator[tuple[Path, Node, Axes]]:
    """Yields ``(path, node, axes)`` for every `Module` and `State` under `root`, each once.

    The walk is depth first, in attribute insertion order, then list/tuple items and dict
    entries. A module whose class defines ``_lamina_stacked_axis`` (`Stack`) adds one axis to
    every node reached through the attributes that hook names (a Stack's ``block``), and to no
    other: `axes` are the stacked axes a node lies under, outermost first. The stored layout of
    a variable is those axes in front of its declared shape: it belongs to the plan, the
    declarations stay as the user made them. An object met again must lie under the same
    stacking modules: one reached inside a `Stack` and outside it, or inside two, would need
    two layouts at once, which is an error naming both paths.

    Args:
        root: A module (or a container of modules).
        outer: Axes that `root` itself lies under (a `Stack`'s block planned on its own as
            part of a model: `take_variables`).

    Yields:
        The path from `root` (attribute names and dict keys as ``str``, list and tuple indices
        as ``int``), the object, and its stacked axes.

    Raises:
        ValueError: An object is reached both inside and outside a `Stack` (or inside two).
    """
    seen: dict[int, tuple[Path, Axes]] = {}
    open_containers: set[int] = set()  # a container that holds itself is walked once
    # One loop over a stack of the open nodes' children, not a generator per level (a deep
    # model's nodes would each pass through every level above them); each level's children
    # are read as the walk reaches them. `opened` holds the id each level closes.
    levels: list[Iterator[tuple[Path, Any, Axes]]] = [iter((((), root, tuple(outer)),))]
    opened: list[int | None] = [None]
    while levels:
        entry = next(levels[-1], None)
        if entry is None:
            levels.pop()
            open_containers.discard(opened.pop())
            continue
        path, node, axes = entry
        inner, attributes = axes, ()
        if isinstance(node, (Module, State)):
            first = seen.get(id(node))
            if first is not None:
                if _owners(first[1]) != _owners(axes):
                    raise _stacked_twice(node, first, (path, axes))
                continue
            seen[id(node)] = (path, axes)
            yield path, node, axes
            if isinstance(node, State):
                continue
            _check_class_attributes(path, node)
            stacked = getattr(type(node), "_lamina_stacked_axis", None)
            if stacked is not None:
                size, name, attributes = stacked(node)
                inner = (*axes, StackedAxis(size, name, path, node))
        elif isinstance(node, (list, tuple, dict)):
            if id(node) in open_containers:
                continue
        else:
            _check_hidden(path, node)
            continue
        open_containers.add(id(node))
        opened.append(id(node))
        levels.append(_visited_children(path, node, axes, inner, attributes))


def _visited_children(
    path: Path, node: Any, axes: Axes, inner: Axes, attributes: Any
) -> Iterator[tuple[Path, Any, Axes]]:
    """The children of `node` that `walk` visits, in order, with the axes each lies under.

    Settings (numbers, strings, bools) hold nothing to find or refuse: they are passed by
    here, without a visit each.
    """
    for key, child in children(node):
        if type(child) not in _SETTINGS:
            yield (*path, key), child, inner if key in attributes else axes


def _owners(axes: Axes) -> tuple[int, ...]:
    return tuple(id(axis.owner) for axis in axes)


def _stacked_twice(
    node: Node,
    first: tuple[Path, Axes],
    again: tuple[Path, Axes],
) -> ValueError:
    def where(path: Path, axes: Axes) -> str:
        if not axes:
            return f"{format_path(path)} (outside any Stack)"
        inside = " and ".join(
            f"the {type(axis.owner).__name__} at {format_path(axis.path)}" for axis in axes
        )
        return f"{format_path(path)} (inside {inside})"

    return ValueError(
        f"the {type(node).__name__} at {where(*first)} is also reached at {where(*again)}. "
        f"A Stack stores every variable of its block with one leading axis per copy, so an "
        f"object inside it cannot also be used outside it or in another Stack. Give each use "
        f"its own object (copy.deepcopy(block) for a fresh copy), or share the whole Stack."
    )


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
        axes: Sizes of the axes stored in front of the declared shape: the depth of each
            `Stack` the variable lies in, outermost first (found by the walk, never written on
            the declaration); empty for a plain variable. Everything that checks shapes reads
            `shape`, never ``state.shape``.
        axis_names: The logical name of each of `axes` (``Stack(..., depth_sharding=...)``),
            None for an unnamed one; as long as `axes`.
    """

    path: Path
    state: State
    key: FlatKey
    axes: tuple[int, ...] = ()
    axis_names: tuple[str | None, ...] = ()

    @property
    def shape(self) -> Shape:
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

    Args:
        root: The module to plan.
        outer: The stacked axes `root` lies under in a larger model (`StackedAxis`, outermost
            first; `Plan.stacked_axes` of that model's plan), so that the entries have the
            layout the model stores; empty (the default): `root` as a model of its own.
    """

    def __init__(self, root: Module, outer: Axes = ()):
        if not isinstance(root, Module):
            raise TypeError(
                f"expected an lm.Module, got {type(root).__name__}. Models are defined by "
                f"subclassing lm.Module."
            )
        self.root = root
        modules: list[tuple[Path, Module]] = []
        declared: list[VariableEntry] = []
        skeleton: dict[str, Any] = {}
        stacked: dict[int, Axes] = {}
        with deep_recursion():
            for path, node, axes in walk(root, outer):
                _check_path(path)
                if isinstance(node, Module):
                    modules.append((path, node))
                    if axes:
                        stacked[id(node)] = axes
                    continue
                key = (node.collection, *(str(k) for k in path))
                _insert(skeleton, key, len(declared), declared)
                sizes = tuple(axis.size for axis in axes)
                names = tuple(axis.name for axis in axes)
                declared.append(VariableEntry(path, node, key, sizes, names))
            order, treedef = jax.tree_util.tree_flatten(skeleton)  # as deep as the model
        self.treedef: jax.tree_util.PyTreeDef = treedef
        self.modules = tuple(modules)
        self.declared = tuple(declared)
        self.variables = tuple(declared[i] for i in order)
        self.shapes = [entry.shape for entry in self.variables]
        self.index = {entry.key: i for i, entry in enumerate(self.variables)}
        self._slots_of: dict[int, tuple[int, ...]] = {}
        self._module_paths: dict[int, Path] | None = None
        self._stacked = stacked

    def stacked_axes(self, module: Module) -> Axes:
        """The stacked axes that `module` (one of this plan's) lies under, outermost first.

        Every variable reached through `module` is stored with these axes in front of its
        declared shape (and any further ones of Stacks inside `module`).
        """
        return self._stacked.get(id(module), ())

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
            owned = {id(node) for _, node, _ in walk(module) if isinstance(node, State)}
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
            entry.state._lamina_stacked = bool(entry.axes)

    def check_one_copy(self, frame: Any, slot: int) -> None:
        """Raises unless `frame` holds one copy of the stacked variable at `slot`.

        A variable inside a `Stack` is stored with one leading axis per copy. Its value can be
        read only where those axes are mapped away: inside the Stack's own call, or inside
        `lm.vmap`/`lm.scan` over the block with axis 0. Elsewhere a read would hand the
        block's code every copy at once, and it would compute with all of them silently
        (``x * g`` broadcasts). The hazard is the block's own code only: a read from a
        method of a module outside the held Stacks' blocks (the Stack's parent computing a
        weight penalty, the root) or from no module's method gets the stored value, every
        copy as one array. `State.value` calls this only for variables that `bind` marked as
        stacked, so other reads pay nothing for it.

        Args:
            frame: The frame the variable is read in (`frame.Frame`): a top-level call holds
                every stacked axis; a lifted transform's nested frame counts those it still
                holds per slot (``frame.shapes.stacked``).
            slot: The variable's slot.

        Raises:
            ValueError: The frame holds stacked axes of the variable, naming the variable,
                its stored layout and the ways to run one copy.
        """
        counts = getattr(frame.shapes, "stacked", None)
        entry = self.variables[slot]
        left = len(entry.axes) if counts is None else counts[slot]
        if not left:
            return
        owners = self._stacked_owners(entry)
        if not self._copies_run_here(owners[len(owners) - left :] if owners else ()):
            return
        stack = "its Stack"
        if len(owners) >= left:
            owner = owners[len(owners) - left]
            stack = f"the {type(owner.owner).__name__} at '{format_path(owner.path)}'"
        raise ValueError(
            f"{type(entry.state).__name__} at {entry.name} is stored as {entry.shape} "
            f"(stacked axes {entry.axes} in front of its declared shape {entry.state.shape}), "
            f"and here it still holds {left} of those axes, shape {tuple(frame.shapes[slot])}: "
            f"reading it would hand the block every copy of {stack} at once, and its code "
            f"would compute with all of them. A Stack's block runs on one copy: call it "
            f"through the Stack (stack(x)), or map the copies with lm.vmap or lm.scan over "
            f"the block with axis 0 (lm.vmap(lambda m, x: m(x), in_axes=(0, None))"
            f"(stack.block, x) for an ensemble). For every copy as arrays, read the "
            f"variables dict outside the call."
        )

    def _copies_run_here(self, held: Axes) -> bool:
        """Whether the running method is code of a block that `held` stacks (or unknown).

        The module whose method is running (`module.running_module`) runs once per copy when
        it lies under one of the stacked axes `held` still holds: reading with those axes
        would hand its code every copy. A module outside them (the Stack's parent, the root)
        reads the variable as stored, every copy as one array, as the variables dict holds it;
        so does a read while no module's method runs. When the Stacks of `held` are not
        known, any module's code counts as the block's.
        """
        module = running_module(self.module_paths())
        if module is None:
            return False
        if not held:
            return True
        paths = {axis.path for axis in held}
        return any(axis.path in paths for axis in self.stacked_axes(module))

    def _stacked_owners(self, entry: VariableEntry) -> Axes:
        """The stacked axes of `entry` with the Stacks that add them (for messages)."""
        deepest: Axes = ()
        for path, module in self.modules:
            if entry.path[: len(path)] == path and len(path) < len(entry.path):
                axes = self.stacked_axes(module)
                if len(axes) > len(deepest):
                    deepest = axes
        return deepest

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
