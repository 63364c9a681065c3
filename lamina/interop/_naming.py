"""Where each layer of a model finds its PyTorch tensors: targets, default names, `rename`.

The plan lists the model's modules with their paths. A module whose class has a converter is
a *target*, converted as a whole; its PyTorch name is its path joined with ``"."`` (a
`Sequential`'s ``layers_3`` written ``3``, as ``nn.Sequential`` names its children). One
convention more: a `Sequential` whose layers are all `RNN`s or `Bidirectional`s is a
multi-layer ``nn.LSTM``/``nn.GRU``, its layer ``k`` reading the names ``*_l<k>``; and an
`lm.Stack` of ``n`` copies at ``h`` is a ``ModuleList`` of ``n`` blocks, ``h.0`` to ``h.<n-1>``,
whose tensors are stacked on the variables' leading axis.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._core.checks import format_list
from .._core.graph import Plan, VariableEntry, walk
from .._core.module import Module
from .._core.types import Path
from .._core.variables import State
from ..nn.bidirectional import Bidirectional
from ..nn.combinators import Sequential
from ..nn.recurrent import RNN
from ..nn.stack import Stack
from ._registry import Converter, Tensors, converter_for

Rename = Callable[[str], str | None] | Mapping[str, str | None] | None

_SEQUENTIAL_CHILD = re.compile(r"layers_(\d+)")
_LAYER_NAME = re.compile(r"(?P<base>.+)_l(?P<layer>\d+)(?P<rest>(_reverse)?)")


@dataclass(frozen=True)
class Target:
    """One converted layer of a model.

    Attributes:
        path: The layer's path in the model.
        module: The layer.
        converter: Its converter.
        prefixes: Its PyTorch module name (``""`` for the root); inside an `lm.Stack` of
            ``n`` copies, the ``n`` names of the copies (``"h.0.attn"``, ``"h.1.attn"``...),
            whose arrays are stacked on the variables' leading axis.
        stacked: Whether the layer is inside an `lm.Stack`.
        layer: For a layer of a multi-layer ``nn.LSTM``/``nn.GRU``, its index; else None.
        variables: The layer's variables by their path below it (``"query/kernel"``).
    """

    path: Path
    module: Module
    converter: Converter
    prefixes: tuple[str, ...]
    stacked: bool
    layer: int | None
    variables: dict[str, VariableEntry]

    def full_name(self, local: str, copy: int = 0) -> str:
        """The (lamina-style) PyTorch name of the local torch name `local` (of `copy`)."""
        if self.layer is not None:
            match = _LAYER_NAME.fullmatch(local)
            if match and match["layer"] == "0":
                local = f"{match['base']}_l{self.layer}{match['rest']}"
        prefix = self.prefixes[copy]
        return f"{prefix}.{local}" if prefix else local

    def local_name(self, full: str, copy: int = 0) -> str | None:
        """The local torch name of `full`, or None if `full` is not this layer's (`copy`'s)."""
        prefix = self.prefixes[copy]
        if prefix:
            if not full.startswith(prefix + "."):
                return None
            full = full[len(prefix) + 1 :]
        if self.layer is None:
            return full
        match = _LAYER_NAME.fullmatch(full)
        if not match or int(match["layer"]) != self.layer:
            return None
        return f"{match['base']}_l0{match['rest']}"

    def tensors(self, arrays: Mapping[str, Any], copy: int = 0) -> Tensors:
        """A view of the state dict's `arrays` by this layer's (`copy`'s) local names."""
        return Tensors(
            arrays,
            functools.partial(self.full_name, copy=copy),
            functools.partial(self.local_name, copy=copy),
        )

    def describe(self) -> str:
        """How messages name the layer: ``encoder/fc (Dense)``."""
        path = "/".join(str(k) for k in self.path) or "<root>"
        return f"{path} ({type(self.module).__name__})"


@dataclass(frozen=True)
class Unconvertible:
    """A module that holds variables no converter covers."""

    path: Path
    module: Module
    variables: tuple[str, ...]


def torch_prefix(path: Path, modules: Mapping[Path, Module]) -> str:
    """The PyTorch module name of the lamina path `path`: its keys joined with ``"."``."""
    parts = []
    for depth, key in enumerate(path):
        match = _SEQUENTIAL_CHILD.fullmatch(key) if isinstance(key, str) else None
        parent = modules.get(path[:depth])
        parts.append(match[1] if match and isinstance(parent, Sequential) else str(key))
    return ".".join(parts)


def _is_stacked_rnn(module: Module) -> bool:
    return isinstance(module, Sequential) and all(
        isinstance(layer, (RNN, Bidirectional)) for layer in module.layers
    )


def find_targets(plan: Plan) -> tuple[list[Target], list[Unconvertible]]:
    """The model's targets, and the modules whose variables none of them covers."""
    finder = _TargetFinder(plan)
    targets = finder.targets()
    _check_distinct_names(targets)
    return targets, _unconvertible(plan, finder.modules, targets)


class _TargetFinder:
    """Walks a plan's modules, outermost first, and makes a `Target` of each converted one."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.modules = dict(plan.modules)
        self.by_state = {id(entry.state): entry for entry in plan.variables}
        self.stacks: dict[Path, Stack] = {}  # by the path of the Stack's block

    def targets(self) -> list[Target]:
        """The targets: modules with a converter, and the layers of a multi-layer RNN."""
        targets: list[Target] = []
        covered: set[Path] = set()
        for path, module in self.plan.modules:
            if any(path[:depth] in covered for depth in range(len(path))):
                continue
            prefix = torch_prefix(path, self.modules)
            if converter_for(module) is not None:
                targets.append(self._target(path, module, prefix, None))
                covered.add(path)
            elif isinstance(module, Sequential) and _is_stacked_rnn(module):
                for k, layer in enumerate(module.layers):
                    assert isinstance(layer, Module)  # an RNN or a Bidirectional
                    layer_path = (*path, f"layers_{k}")
                    targets.append(self._target(layer_path, layer, prefix, k))
                    covered.add(layer_path)
                covered.add(path)
            elif isinstance(module, Stack):
                self.stacks[(*path, "block")] = module
        return targets

    def _target(self, path: Path, module: Module, prefix: str, layer: int | None) -> Target:
        """The target of `module` at `path`; leading axes other than a Stack's are an error."""
        converter = converter_for(module)
        assert converter is not None
        variables = {
            "/".join(str(k) for k in local): self.by_state[id(node)]
            for local, node, _ in walk(module)
            if isinstance(node, State)
        }
        block = next((path[:d] for d in range(len(path), 0, -1) if path[:d] in self.stacks), None)
        prefixes = (prefix,) if block is None else self._copy_prefixes(block, prefix)
        axes = () if block is None else (self.stacks[block].n,)
        wrong = [e.name for e in variables.values() if e.axes != axes]
        if wrong:
            raise TypeError(
                f"{'/'.join(str(k) for k in path) or '<root>'} ({type(module).__name__}) has "
                f"variables stored with leading axes that no PyTorch layout has "
                f"({format_list(wrong, limit=3)}: a vmapped ensemble, or a Stack inside a "
                f"Stack). Convert a model with one layer per copy and stack the arrays with "
                f"jnp.stack, or register a converter for the enclosing module."
            )
        return Target(path, module, converter, prefixes, block is not None, layer, variables)

    def _copy_prefixes(self, block: Path, prefix: str) -> tuple[str, ...]:
        """The PyTorch names of a module below a Stack's `block`, one per copy.

        Copy i of a Stack at "h" is PyTorch's "h.<i>" (a ModuleList): the names below the
        stack's block follow the copy's index.
        """
        stack_prefix = torch_prefix(block[:-1], self.modules)
        below_block = prefix[len(torch_prefix(block, self.modules)) :]
        return tuple(
            f"{stack_prefix}.{i}{below_block}" if stack_prefix else f"{i}{below_block}"
            for i in range(self.stacks[block].n)
        )


def _check_distinct_names(targets: list[Target]) -> None:
    """No two targets read and write the same PyTorch names."""
    seen: dict[tuple[tuple[str, ...], int | None], Path] = {}
    for target in targets:
        other = seen.setdefault((target.prefixes, target.layer), target.path)
        if other != target.path:
            first, second = ("/".join(map(str, p)) or "<root>" for p in (other, target.path))
            raise ValueError(
                f"lamina layers {first} and {second} would both read and write the PyTorch "
                f"names '{target.prefixes[0]}.*': a dict key that contains '.' reads like a "
                f"nested name (PyTorch refuses such keys). Rename the key."
            )


def _unconvertible(
    plan: Plan, modules: dict[Path, Module], targets: list[Target]
) -> list[Unconvertible]:
    """The modules holding declared variables that no target covers, each with their names."""
    done = {id(entry.state) for target in targets for entry in target.variables.values()}
    unconvertible: dict[Path, list[str]] = {}
    for entry in plan.declared:
        if id(entry.state) in done:
            continue
        owner = max((p for p in modules if entry.path[: len(p)] == p), key=len)
        unconvertible.setdefault(owner, []).append(entry.name)
    return [Unconvertible(p, modules[p], tuple(v)) for p, v in unconvertible.items()]


def renamer(rename: Rename, inverse: bool) -> tuple[Callable[[str], str | None], set[str]]:
    """`rename` as a function of a key, and the set its prefixes that matched (filled in use).

    Args:
        rename: None, a function, or ``{prefix: new prefix or None}``.
        inverse: For `lm.to_torch`: a mapping is applied backwards (new prefix to prefix);
            a function is applied as it is (it maps lamina-style names to PyTorch's).
    """
    used: set[str] = set()
    if rename is None:
        return (lambda key: key), used
    if callable(rename):
        return rename, used
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in rename.items()
    ):
        raise TypeError(
            f"rename must be a function (name -> new name, or None to drop it) or a dict of "
            f"prefixes {{'old.': 'new.', 'dropped.': None}}, got {rename!r:.200}."
        )
    if inverse:
        sources: dict[str, list[str]] = {}
        for old, new in rename.items():
            if new is not None:
                sources.setdefault(new, []).append(old)
        shared = {new: olds for new, olds in sources.items() if len(olds) > 1}
        if shared:
            new, olds = next(iter(shared.items()))
            raise ValueError(
                f"lm.to_torch cannot reverse rename: it maps {format_list(map(repr, olds))} all "
                f"to {new!r}, so which PyTorch name a variable under {new!r} came from is "
                f"unknown. Pass a function (lamina-style name -> PyTorch name) or a dict with "
                f"one prefix per new prefix."
            )
        pairs: dict[str, str | None] = {new: olds[0] for new, olds in sources.items()}
    else:
        pairs = dict(rename)
    order = sorted(pairs, key=len, reverse=True)  # the longest prefix wins

    def apply(key: str) -> str | None:
        for prefix in order:
            if key.startswith(prefix):
                used.add(prefix)
                new = pairs[prefix]
                return None if new is None else new + key[len(prefix) :]
        return key

    return apply, used
