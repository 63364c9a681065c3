"""PyTorch state dicts to lamina variables and back: `from_torch`, `to_torch`.

The model's plan says which layers it holds and where (`_naming.find_targets`); each layer's
converter (`_registry`, built-ins in `_layers` and `_recurrent`) maps its tensors. This file
does the rest: `rename`, torch tensors to arrays and back, dtypes, and one error that lists
every missing, unused and misshapen name. torch itself is needed only by `to_torch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import flags, format_list, narrowing_damage
from .._core.errors import VariablesError
from .._core.graph import Plan, VariableEntry
from .._core.layout import check_variables, flatten_variables, nest
from .._core.types import Variables
from .._core.variables import Cache
from ._arrays import import_torch, to_numpy, to_tensor
from ._layers import register as register_layers
from ._naming import Rename, Target, Unconvertible, find_targets, renamer
from ._recurrent import register as register_recurrent_layers
from ._registry import MissingTensor, ShapeMismatch, Tensors, Unsupported

__all__ = ["from_torch", "to_torch"]

register_layers()  # the built-in converters
register_recurrent_layers()

_NAMING = (
    "A layer at the lamina path encoder/layers/0 reads the torch names 'encoder.layers.0.*' "
    "(a Sequential's layers_3 is '3'); map other names with rename= (a function of the torch "
    "name, or a dict of prefixes such as {'transformer.': '', 'lm_head.': None}; None drops a "
    "name)"
)


def from_torch(
    model: Any, state_dict: Mapping[str, Any], *, rename: Rename = None, strict: bool = True
) -> Variables:
    """The lamina variables of `model` from a PyTorch ``state_dict`` (kernels transposed).

    Each converted layer of `model` (``Dense``, ``Conv``, ``ConvTranspose``, ``Embed``, the
    norms, ``MultiHeadAttention``, ``RNN`` of an LSTM or GRU cell, ``Bidirectional``, and any
    class given to `lm.register_torch`) reads the tensors of the PyTorch module of the
    same name: its path with ``"."`` between the keys, ``encoder/layers/0`` reading
    ``"encoder.layers.0.weight"``; a `Sequential`'s ``layers_3`` is ``"3"``, as in
    ``nn.Sequential``. A `Sequential` of RNNs is a multi-layer ``nn.LSTM``/``nn.GRU`` (its
    layer ``k`` reads ``weight_ih_l<k>``...), and an `lm.Stack` of ``n`` copies at ``h`` is
    a ``ModuleList`` ``h.0`` ... ``h.<n-1>`` (the copies' arrays stacked). The layouts are in
    docs/pytorch.md.

    Decoding caches (`lm.Cache` variables) are not weights: they get their initial value (an
    empty cache). The arrays are cast to each variable's storage dtype.

    Args:
        model: The lamina model (an `lm.Module`), built with the PyTorch model's sizes.
        state_dict: ``{name: tensor}``, torch tensors or NumPy arrays (``model.state_dict()``).
        rename: Maps the state dict's names to the names the default naming expects: a
            function ``torch_name -> name`` (None drops the entry), or a dict of prefixes,
            ``{"transformer.": "", "lm_head.": None}`` (the longest matching prefix is
            replaced; None drops the entry).
        strict: Require every variable of `model` to be filled and every (kept) entry of the
            state dict to be used. False returns the variables that could be converted, for
            `lm.merge` or `lm.assign_variables` with others. Wrong shapes are always errors,
            and so is converting nothing at all from a non-empty state dict (every name
            missed: a rename that matched nothing).

    Returns:
        ``{collection: nested dict of jax arrays}``, ready for ``apply``.

    Raises:
        TypeError: A layer holding variables that no converter covers (register one with
            `lm.register_torch`), or an entry that is no tensor or array.
        VariablesError: Missing, unused or misshapen names, all listed in one message.
        ValueError: Two names that `rename` maps to the same name.

    Example:
        >>> import numpy as np, lamina as lm
        >>> model = lm.Sequential(lm.Dense(3, 4), lm.relu, lm.Dense(4, 2))
        >>> state_dict = {  # torch.nn.Sequential(Linear(3, 4), ReLU(), Linear(4, 2))
        ...     "0.weight": np.ones((4, 3)), "0.bias": np.zeros(4),
        ...     "2.weight": np.ones((2, 4)), "2.bias": np.zeros(2),
        ... }
        >>> variables = lm.from_torch(model, state_dict)
        >>> variables["params"]["layers_0"]["kernel"].shape  # Linear's weight, transposed
        (3, 4)
    """
    flags("lm.from_torch", strict=strict)
    plan = Plan(model)
    targets, unconvertible = find_targets(plan)
    _refuse_unconvertible("from_torch", unconvertible)
    arrays, origin, used_prefixes = _renamed_state_dict(state_dict, rename)
    values: dict[int, Any] = {}  # by id of the declaration
    problems = _Problems()
    read: set[str] = set()
    for target in targets:
        produced = _convert(target, arrays, origin, problems, read)
        if produced is None:
            continue
        for local, (array, sources) in produced.items():
            _store(values, target.variables[local], array, sources, problems)
    filled = []
    for entry in plan.variables:
        if id(entry.state) in values:
            filled.append((entry.key, values[id(entry.state)]))
        elif isinstance(entry.state, Cache):
            filled.append((entry.key, _initial(entry)))
        elif id(entry.state) not in problems.explained:
            problems.unfilled.append(entry.name)
    problems.unused = [origin[k] for k in arrays if k not in read]
    problems.raise_if_any(type(model).__name__, strict, rename, used_prefixes)
    if values or not plan.variables or not arrays:
        return nest(filled)
    # strict=False, and not one name matched: the caller would get variables that are only
    # caches, or nothing at all, and a later step would fail far from the cause.
    missing = f"missing {format_list(problems.missing)}" if problems.missing else "no match"
    raise VariablesError(
        f"lm.from_torch(strict=False) converted none of {type(model).__name__}'s variables "
        f"({missing}; the state dict's names look like {format_list(sorted(arrays)[:3])}, "
        f"the model's variables like {plan.variables[0].name}). {_NAMING}."
    )


def to_torch(model: Any, variables: Variables, *, rename: Rename = None) -> dict[str, Any]:
    """A PyTorch ``state_dict`` from `model`'s lamina variables: `from_torch`'s inverse.

    Names follow `from_torch`'s default naming. LSTM and GRU biases that lamina holds summed
    (``bias_ih + bias_hh``) go to ``bias_hh_l*`` with zeros in ``bias_ih_l*``; a BatchNorm's
    ``num_batches_tracked`` is left out (``load_state_dict`` keeps the module's own); decoding
    caches are not exported. So lamina -> torch -> lamina is exact, and torch -> lamina ->
    torch is exact but for those biases and ``num_batches_tracked``.

    Args:
        model: The lamina model the variables belong to.
        variables: Its variables (``{collection: nested dict}``; the ``"cache"`` collection
            may be left out).
        rename: Maps the default (lamina-style) names to the PyTorch model's: a function
            ``name -> torch_name`` (None drops the entry), or the same dict of prefixes that
            `from_torch` took, applied backwards (``{"transformer.": ""}`` puts
            ``"transformer."`` back in front).

    Returns:
        ``{name: torch.Tensor}``, for ``torch_model.load_state_dict``.

    Raises:
        ImportError: If PyTorch is not installed.
        TypeError: A layer holding variables that no converter covers.
        VariablesError: Variables that do not match `model`.
        ValueError: Two names that `rename` maps to the same name.

    Example:
        >>> import jax, lamina as lm
        >>> model = lm.Dense(3, 2)
        >>> variables = lm.transform(model).init(jax.random.key(0))
        >>> state_dict = lm.to_torch(model, variables)
        >>> {name: tuple(t.shape) for name, t in state_dict.items()}
        {'weight': (2, 3), 'bias': (2,)}
    """
    import_torch()
    plan = Plan(model)
    targets, unconvertible = find_targets(plan)
    _refuse_unconvertible("to_torch", unconvertible)
    flat = flatten_variables(variables, "lm.to_torch's variables")
    check_variables(plan, flat, "lm.to_torch", allow_missing=True)
    missing = [
        e.name for e in plan.variables if e.key not in flat and not isinstance(e.state, Cache)
    ]
    if missing:
        raise VariablesError(
            f"lm.to_torch got variables without {len(missing)} of {type(model).__name__}'s "
            f"weights: {format_list(missing)}. Pass the whole dict that init or from_torch "
            f"returned (the 'cache' collection may be left out)."
        )
    rename_fn, _ = renamer(rename, inverse=True)
    state_dict: dict[str, Any] = {}
    origin: dict[str, str] = {}
    unsupported = []
    for target in targets:
        arrays = {
            local: np.asarray(flat[entry.key])
            for local, entry in target.variables.items()
            if not isinstance(entry.state, Cache)
        }
        for copy in range(len(target.prefixes)):
            # a Stack's copy i: the arrays' slice i, under the names of PyTorch's block i
            own = {k: a[copy] for k, a in arrays.items()} if target.stacked else arrays
            try:
                tensors = target.converter.to_torch(target.module, own)
            except Unsupported as error:
                unsupported.append(f"{target.describe()}: {error}")
                break
            for local, array in tensors.items():
                full = target.full_name(local, copy)
                name = _renamed(rename_fn, full)
                if name is None:
                    continue
                if name in state_dict:
                    raise ValueError(
                        f"lm.to_torch: rename maps both {origin[name]!r} and {full!r} to "
                        f"{name!r}; each entry needs its own name."
                    )
                origin[name] = full
                state_dict[name] = to_tensor(array)
    if unsupported:
        raise TypeError(
            f"lm.to_torch cannot export {len(unsupported)} layer(s): "
            f"{format_list(unsupported)}. Register a converter for them with "
            f"lm.register_torch (see docs/pytorch.md)."
        )
    return state_dict


class _Problems:
    """What went wrong in `from_torch`, gathered for one message."""

    def __init__(self) -> None:
        self.missing: list[str] = []  # torch names a converter read but the state dict lacks
        self.unfilled: list[str] = []  # lamina variables no converter filled
        self.unused: list[str] = []  # state dict names no converter read
        self.wrong: list[str] = []  # shapes and dtypes
        self.unsupported: list[str] = []
        self.explained: set[int] = set()  # declarations of layers that failed

    def add(self, error: Exception, target: Target, tensors: Tensors, origin: dict) -> None:
        """Records a converter's failure on `target`."""
        if isinstance(error, MissingTensor):
            self.missing.append(f"{tensors.full_name(error.name)} (for {target.describe()})")
        elif isinstance(error, ShapeMismatch):
            name = origin[tensors.full_name(error.name)]
            self.wrong.append(
                f"torch {name!r} has shape {error.got}, but the lamina layer "
                f"{target.describe()} needs {error.layout} = {error.expected}"
            )
        else:
            self.unsupported.append(f"{target.describe()}: {error}")

    def raise_if_any(
        self, model: str, strict: bool, rename: Rename, used_prefixes: set[str]
    ) -> None:
        if self.unsupported:
            raise TypeError(
                f"lm.from_torch cannot convert {len(self.unsupported)} layer(s) of {model}: "
                f"{format_list(self.unsupported)}. Register a converter with "
                f"lm.register_torch(layer_type, to_lamina, to_torch) (docs/pytorch.md)."
            )
        lines = []
        if strict and self.missing:
            lines.append(f"missing from the state dict ({len(self.missing)}): ")
            lines[-1] += format_list(self.missing)
        if strict and self.unfilled:
            lines.append(f"lamina variables not filled ({len(self.unfilled)}): ")
            lines[-1] += format_list(self.unfilled)
        if strict and self.unused:
            lines.append(f"unused state dict entries ({len(self.unused)}): ")
            lines[-1] += format_list(self.unused)
        if self.wrong:
            lines.append(f"wrong shape or dtype ({len(self.wrong)}): " + "; ".join(self.wrong[:5]))
            if len(self.wrong) > 5:
                lines[-1] += f"; ... and {len(self.wrong) - 5} more"
        if not lines:
            return
        hint = _NAMING + "."
        if isinstance(rename, Mapping):
            unmatched = [p for p in rename if p not in used_prefixes]
            if unmatched:
                hint += f" These rename prefixes matched no name: {format_list(unmatched)}."
        if not self.wrong:
            hint += " strict=False converts what matches and leaves the rest out."
        raise VariablesError(
            f"lm.from_torch could not convert the state dict into {model}'s variables:\n  "
            + "\n  ".join(lines)
            + f"\n{hint}"
        )


def _refuse_unconvertible(what: str, unconvertible: list[Unconvertible]) -> None:
    if not unconvertible:
        return
    items = [
        f"{'/'.join(str(k) for k in u.path) or '<root>'} ({type(u.module).__name__}, holding "
        f"{format_list(u.variables, limit=3)})"
        for u in unconvertible
    ]
    first = type(unconvertible[0].module).__name__
    raise TypeError(
        f"lm.{what}: no PyTorch converter for {format_list(items, limit=4)}. Either register "
        f"one, lm.register_torch({first}, to_lamina, to_torch) (see docs/pytorch.md), "
        f"or build the model from the converted layers (Dense, Conv, ConvTranspose, Embed, "
        f"the norms, MultiHeadAttention, RNN, Bidirectional) and map the PyTorch names onto "
        f"them with rename=."
    )


def _renamed(rename_fn: Any, name: str) -> str | None:
    new = rename_fn(name)
    if new is not None and not isinstance(new, str):
        raise TypeError(
            f"rename returned {new!r} for {name!r}; it must return a str (the new name) or "
            f"None (to drop the entry)."
        )
    return new


def _renamed_state_dict(
    state_dict: Any, rename: Rename
) -> tuple[dict[str, np.ndarray], dict[str, str], set[str]]:
    """The state dict as NumPy arrays under renamed names, and each one's original name."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"lm.from_torch takes a state dict {{name: tensor}} (torch_model.state_dict()), got "
            f"{type(state_dict).__name__}. For a torch.nn.Module, pass module.state_dict()."
        )
    rename_fn, used_prefixes = renamer(rename, inverse=False)
    arrays: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"lm.from_torch: state dict names must be str, got {name!r}.")
        new = _renamed(rename_fn, name)
        if new is None:
            continue
        if new in arrays:
            raise ValueError(
                f"lm.from_torch: rename maps both {origin[new]!r} and {name!r} to {new!r}; "
                f"each entry needs its own name (drop one with None)."
            )
        arrays[new], origin[new] = to_numpy(value, name), name
    return arrays, origin, used_prefixes


def _convert(
    target: Target,
    arrays: dict[str, np.ndarray],
    origin: dict[str, str],
    problems: _Problems,
    read: set[str],
) -> dict[str, tuple[np.ndarray, str]] | None:
    """Runs `target`'s converter: ``{local variable path: (array, the torch names read)}``.

    A layer inside an `lm.Stack` converts once per copy, and each variable's arrays are
    stacked. A failure is recorded in `problems` (one per layer: its other variables and
    tensors are not listed again) and gives None.
    """
    copies: list[dict[str, Any]] = []
    used: set[str] = set()
    for copy in range(len(target.prefixes)):
        tensors = target.tensors(arrays, copy)
        try:
            produced = target.converter.to_lamina(target.module, tensors)
        except (MissingTensor, ShapeMismatch, Unsupported) as error:
            problems.explained.update(id(e.state) for e in target.variables.values())
            if any(target.prefixes) or not isinstance(error, MissingTensor):
                # The layer's other tensors are not listed again as unused.
                for other in range(len(target.prefixes)):
                    mine = target.tensors(arrays, other)
                    read.update(mine.full_name(name) for name in mine)
            else:
                # A name missing in a model that is this one layer: its empty prefix would
                # claim every entry, hiding the misnamed ones; list all it did not read.
                read |= tensors.read
            problems.add(error, target, tensors, origin)
            return None
        read |= tensors.read
        used |= tensors.read
        copies.append({k: to_numpy(a, k) for k, a in _checked_names(target, produced).items()})
    sources = ", ".join(repr(origin[k]) for k in sorted(used)) or "no tensors"
    if not target.stacked:
        return {local: (array, sources) for local, array in copies[0].items()}
    stacked = {}
    for local in copies[0]:
        shapes = {str(c[local].shape) if local in c else "none" for c in copies}
        if len(shapes) != 1:
            problems.wrong.append(
                f"{target.variables[local].name}: the copies of the Stack's layer got "
                f"different shapes, {sorted(shapes)}, from {sources}"
            )
            problems.explained.add(id(target.variables[local].state))
            continue
        stacked[local] = (np.stack([c[local] for c in copies]), sources)
    return stacked


def _checked_names(target: Target, produced: Any) -> dict[str, Any]:
    """The converter's result, every name checked to be a variable of the layer."""
    unknown = [name for name in produced if name not in target.variables]
    if unknown:
        raise ValueError(
            f"the PyTorch converter of {target.describe()} returned {format_list(unknown)}, "
            f"which the layer does not declare; its variables are "
            f"{format_list(list(target.variables))}. Return them by their path below the layer."
        )
    return dict(produced)


def _store(
    values: dict[int, Any], entry: VariableEntry, array: np.ndarray, sources: str, problems: Any
) -> None:
    """Checks `array` against `entry` (shape, kind of number) and keeps it, cast."""
    if tuple(array.shape) != entry.shape:
        problems.wrong.append(
            f"{entry.name} needs shape {entry.shape}, but the converter made {array.shape} "
            f"from {sources}"
        )
        return
    dtype = entry.state.param_dtype
    lossy = (
        jnp.issubdtype(array.dtype, jnp.complexfloating)
        and not jnp.issubdtype(dtype, jnp.complexfloating)
    ) or (jnp.issubdtype(array.dtype, jnp.inexact) and not jnp.issubdtype(dtype, jnp.inexact))
    if lossy:
        problems.wrong.append(
            f"{entry.name} is stored as {dtype}, but {sources} gave {array.dtype}, which would "
            f"lose its fraction or imaginary part"
        )
        return
    damage = narrowing_damage(array, np.dtype(array.dtype), np.dtype(dtype))
    if damage is not None:
        problems.wrong.append(
            f"{entry.name} is stored as {dtype}, but {sources} gave {array.dtype}: {damage}"
        )
        return
    # A copy: on the CPU, jax may otherwise share the memory of an aligned NumPy array, and
    # with it a torch tensor's, which PyTorch updates in place (BatchNorm's running stats).
    converted = jnp.array(array, dtype, copy=True)
    if id(entry.state) in values and not np.array_equal(
        values[id(entry.state)], converted, equal_nan=True
    ):
        problems.wrong.append(
            f"{entry.name} is shared by two layers, which got different values (from {sources})"
        )
        return
    values[id(entry.state)] = converted


def _initial(entry: VariableEntry) -> jax.Array:
    """A decoding cache's initial value (its initializer's: zeros for MultiHeadAttention)."""
    state = entry.state
    return jnp.asarray(state.init(jax.random.key(0), entry.shape, state.param_dtype))
