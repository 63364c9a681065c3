"""`summary`: a table of a model's modules, variables, parameter counts and bytes.

With example inputs it adds each module's calls: output shapes and FLOPs (`flops.py`), with
the loops lamina runs (a `Stack`'s block, an `RNN`'s cell) counted as many times as they run.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ._core.checks import format_path
from ._core.graph import Plan
from ._core.module import Module
from .flops import CallCost, Loop, call_costs
from .nn.recurrent import RNN
from .nn.stack import Stack
from .records.capture import Call


@dataclass(frozen=True)
class SummaryRow:
    """One variable of the model, with the module that holds it."""

    module_path: str
    module_type: str
    name: str
    collection: str
    shape: tuple[int, ...]
    dtype: str
    size: int
    bytes: int


@dataclass(frozen=True)
class CallRow:
    """One module's calls in one call of the model on the example inputs.

    Attributes:
        module_path: The module's path (``<root>`` for the model).
        module_type: Its class name.
        calls: How many times it runs (a `Stack`'s block: its depth; an `RNN`'s cell: the
            time steps; a module called twice: 2); a branch of `lm.cond`/`lm.switch` counts
            as if it runs (its note says so).
        output_shapes: The shapes of what its first call returns (one per array).
        flops: Its forward FLOPs over all its calls, those of the modules it calls included
            (XLA's cost analysis); None where XLA could not count it alone.
        grad_flops: The FLOPs of its forward and backward pass (``backward=True``), else None.
        note: Why a count may be off (a loop XLA counts once, a branch that may not run),
            or "".
    """

    module_path: str
    module_type: str
    calls: int
    output_shapes: tuple[tuple[int, ...], ...]
    flops: int | None
    grad_flops: int | None
    note: str = ""


class Summary:
    """What `summary` returns: rows and totals; ``str()`` gives the table.

    In a notebook it shows as an HTML table (`_repr_html_`).

    Each module's count is its call lowered alone, on the shapes it received, with the
    modules it calls included: work the whole program would drop as dead code (an output
    the parent never uses, the backward pass of what it passes through
    `jax.lax.stop_gradient`) still counts in that module's row and in the total. Of the
    branches of an `lm.cond` or `lm.switch`, each counts in its own rows as if it ran; the
    parent's row and the total count the costliest, as XLA does.

    Attributes:
        model_type: The model's class name.
        rows: One `SummaryRow` per variable, in the model's walk order.
        modules: ``(path, type)`` of every module, in walk order.
        totals: ``{collection: (count, bytes)}``.
        calls: With example inputs, one `CallRow` per module that ran, in the order its
            first call started; else empty.
        flops: The forward FLOPs of the model on the example inputs, or None without them.
        grad_flops: The FLOPs of its forward and backward pass with ``backward=True``, else
            None.

    Example:
        >>> import lamina as lm
        >>> summary = lm.summary(lm.Dense(3, 2))
        >>> summary.totals, [row.name for row in summary.rows]
        ({'params': (8, 32)}, ['kernel', 'bias'])
    """

    # Defaults for a summary pickled before it had calls: it unpickles without them.
    calls: Sequence[CallRow] = ()
    flops: int | None = None
    grad_flops: int | None = None

    def __init__(
        self,
        model: Module,
        example: tuple[tuple, dict[str, Any]] | None = None,
        backward: bool = False,
    ):
        plan = Plan(model)
        owners = {path: module for path, module in plan.modules}
        self.model_type = type(model).__name__
        self.modules = [(format_path(p), type(m).__name__) for p, m in plan.modules]
        rows = []
        for entry in plan.declared:
            owner_path = _owner(entry.path, owners)
            state = entry.state
            itemsize = np.dtype(state.param_dtype).itemsize
            size = int(np.prod(entry.shape, dtype=np.int64))
            rows.append(
                SummaryRow(
                    module_path=format_path(owner_path),
                    module_type=type(owners[owner_path]).__name__,
                    name=format_path(entry.path[len(owner_path) :]),
                    collection=state.collection,
                    shape=entry.shape,
                    dtype=str(np.dtype(state.param_dtype)),
                    size=size,
                    bytes=size * itemsize,
                )
            )
        self.rows = rows
        sizes: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for row in rows:
            sizes[row.collection] += row.size
            nbytes[row.collection] += row.bytes
        self.totals = {c: (sizes[c], nbytes[c]) for c in sizes}
        self.calls = []
        self.flops = None
        self.grad_flops = None
        if example is not None:
            costs = call_costs(model, *example, backward=backward, repeats=_repeats)
            self.calls = _call_rows(costs)
            roots = [cost for cost in costs if cost.call.parent is None]
            self.flops = _sum([cost.flops for cost in roots])
            if backward:
                self.grad_flops = _sum([cost.grad_flops for cost in roots])

    @property
    def num_params(self) -> int:
        """The number of elements in the ``"params"`` collection."""
        return self.totals.get("params", (0, 0))[0]

    def __str__(self) -> str:
        header = ("module", "type", "variable", "shape", "dtype", "count", "bytes")
        lines = []
        seen_modules = set()
        for row in self.rows:
            first = row.module_path not in seen_modules
            seen_modules.add(row.module_path)
            name = row.name if row.collection == "params" else f"{row.name} ({row.collection})"
            lines.append(
                (
                    row.module_path if first else "",
                    row.module_type if first else "",
                    name,
                    str(row.shape),
                    row.dtype,
                    f"{row.size:,}",
                    _human_bytes(row.bytes),
                )
            )
        out = [
            f"{self.model_type}: {len(self.modules)} modules, {len(self.rows)} variables",
            *_table(header, lines, right={5, 6}),
        ]
        out.extend(self._total_lines())
        if self.calls:
            out.extend(["", *self._calls_text()])
        return "\n".join(out)

    def __repr__(self) -> str:
        return str(self)

    def _total_lines(self) -> list[str]:
        lines = [
            f"{collection}: {count:,} ({_human_bytes(nbytes)})"
            for collection, (count, nbytes) in self.totals.items()
        ]
        return lines or ["no variables"]

    def _call_cells(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        header: tuple[str, ...] = ("module", "type", "calls", "output", "FLOPs")
        backward = self.grad_flops is not None
        if backward:
            header += ("forward+backward",)
        lines = []
        for row in self.calls:
            cells = (
                row.module_path,
                row.module_type,
                f"{row.calls:,}",
                ", ".join(str(shape) for shape in row.output_shapes),
                _count(row.flops),
            )
            lines.append(cells + ((_count(row.grad_flops),) if backward else ()))
        return header, lines

    def _flop_totals(self) -> list[str]:
        lines = [f"forward FLOPs: {_count(self.flops)} (XLA's cost analysis)"]
        if self.grad_flops is not None:
            lines.append(f"forward+backward FLOPs: {_count(self.grad_flops)}")
        lines += [f"note: {row.module_path}: {row.note}" for row in self.calls if row.note]
        return lines

    def _calls_text(self) -> list[str]:
        header, lines = self._call_cells()
        return [*_table(header, lines, right={2, 4, 5}), *self._flop_totals()]

    def _repr_html_(self) -> str:
        """The summary as HTML tables, for notebooks (every value escaped)."""
        header = ("module", "type", "variable", "collection", "shape", "dtype", "count", "bytes")
        rows: list[tuple[str, ...]] = [
            (
                row.module_path,
                row.module_type,
                row.name,
                row.collection,
                str(row.shape),
                row.dtype,
                f"{row.size:,}",
                _human_bytes(row.bytes),
            )
            for row in self.rows
        ]
        title = f"{self.model_type}: {len(self.modules)} modules, {len(self.rows)} variables"
        parts = [f"<div><p><b>{html.escape(title)}</b></p>", _html_table(header, rows)]
        parts.append(_html_lines(self._total_lines()))
        if self.calls:
            parts.append(_html_table(*self._call_cells()))
            parts.append(_html_lines(self._flop_totals()))
        return "".join(parts) + "</div>"


def summary(
    model: Module, /, *example_args: Any, backward: bool = False, **example_kwargs: Any
) -> Summary:
    """A table of the model's modules and variables: shapes, dtypes, counts and bytes.

    Shared modules and variables are counted once, at their first path. ``print()`` it in a
    terminal, or log ``str()`` of it; the rows and totals are also available as data.

    With example inputs (arrays, or `jax.ShapeDtypeStruct`: nothing is computed), it also
    lists every module that runs, in the order it first runs: how many times, the shapes it
    returns, and its FLOPs as XLA's cost analysis counts them, those of the modules it calls
    included (``Summary.calls``, ``Summary.flops``). Each module is lowered alone on the
    shapes it received, so work the whole program would drop as dead code still counts;
    XLA counts a loop's body once, so a `Stack`'s block and an `RNN`'s cell are counted
    once per layer or time step (other loops, `lm.scan` in your own module, are flagged),
    and of an `lm.cond`/`lm.switch` the total counts the costliest branch. Inputs other than
    arrays (flags such as ``is_training``) are passed as they are.

    Args:
        model: The model definition (no variables are needed: shapes are declared).
        *example_args: Example positional inputs of the model's ``__call__``.
        backward: Also count each module's forward and backward pass: the gradient with
            respect to its float parameters (every ``lm.Parameter``) and its float inputs.
        **example_kwargs: Example keyword inputs.

    Returns:
        A `Summary`.

    Raises:
        ValueError: ``backward=True`` without example inputs, or with nothing to
            differentiate. The model's own error (its type kept) on inputs it cannot take,
            naming the module whose call failed; JAX's error (its type kept) when the
            model's own pass cannot be lowered (the backward pass of an `lm.while_loop` or
            a `jax.pure_callback`).

    Example:
        >>> import lamina as lm
        >>> s = lm.summary(lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2)))
        >>> s.num_params
        58
        >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
        Sequential: 3 modules, 4 variables
        module    type   variable  shape   dtype    count  bytes
        --------  -----  --------  ------  -------  -----  -----
        layers_0  Dense  kernel    (4, 8)  float32     32  128 B
                         bias      (8,)    float32      8   32 B
        layers_2  Dense  kernel    (8, 2)  float32     16   64 B
                         bias      (2,)    float32      2    8 B
        --------  -----  --------  ------  -------  -----  -----
        params: 58 (232 B)

        With example inputs, the FLOPs of each module (``2 * 3 * 4 * 8`` multiply-adds and
        ``3 * 8`` bias additions in the first layer):

        >>> import jax.numpy as jnp
        >>> s = lm.summary(lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2)), jnp.ones((3, 4)))
        >>> [(row.module_path, row.output_shapes, row.flops) for row in s.calls]
        [('<root>', ((3, 2),), 342), ('layers_0', ((3, 8),), 216), ('layers_2', ((3, 2),), 102)]
    """
    if not isinstance(backward, bool):
        raise TypeError(f"lm.summary: backward is True or False, got {backward!r}.")
    if not example_args and not example_kwargs:
        if backward:
            raise ValueError(
                "lm.summary(model, backward=True) counts the FLOPs of a call on example "
                "inputs: pass them, lm.summary(model, x, backward=True)."
            )
        return Summary(model)
    return Summary(model, (example_args, example_kwargs), backward)


def _repeats(parent: Call, child: Call) -> Loop | None:
    """How a `Stack` runs its block, or an `RNN` its cell, per call; None for other children.

    A Stack's block has its own parameters at each layer, and is rematerialised with
    ``remat=True``; an RNN's cell shares its parameters over the time steps.
    """
    module = parent.module
    if isinstance(module, Stack) and child.module is module.block:
        return Loop(module.n, _bodies(module.n, module.unroll), remat=module.remat)
    if isinstance(module, RNN) and child.module is module.cell:
        inputs = parent.args[0] if parent.args else parent.kwargs.get("inputs")
        time_major = parent.kwargs.get("time_major")
        time_major = module.time_major if time_major is None else time_major
        shape = tuple(getattr(inputs, "shape", ()))
        axis = 0 if time_major else len(shape) - getattr(module.cell, "num_feature_axes", 1) - 1
        if not shape or not 0 <= axis < len(shape):
            return None
        return Loop(shape[axis], _bodies(shape[axis], module.unroll), shared=True)
    return None


def _bodies(length: int, unroll: int | bool) -> int:
    """Copies of a scan's body in its program: `unroll` in the loop, the remainder after."""
    if length == 0:
        return 0
    copies = length if unroll is True else min(max(1, int(unroll)), length)
    return copies + length % copies


def _call_rows(costs: list[CallCost]) -> list[CallRow]:
    """One row per module path: its calls' runs and FLOPs added up, in first-call order."""
    rows: dict[tuple, CallRow] = {}
    for cost in costs:
        call = cost.call
        output = tuple(
            tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(call.output) if _shaped(leaf)
        )
        row = rows.get(call.path)
        if row is None:
            rows[call.path] = CallRow(
                module_path=format_path(call.path),
                module_type=type(call.module).__name__,
                calls=cost.runs,
                output_shapes=output,
                flops=_times(cost.runs, cost.flops),
                grad_flops=_times(cost.runs, cost.grad_flops),
                note=cost.note,
            )
            continue
        rows[call.path] = CallRow(
            module_path=row.module_path,
            module_type=row.module_type,
            calls=row.calls + cost.runs,
            output_shapes=row.output_shapes,
            flops=_sum([row.flops, _times(cost.runs, cost.flops)]),
            grad_flops=_sum([row.grad_flops, _times(cost.runs, cost.grad_flops)]),
            note=row.note or cost.note,
        )
    return list(rows.values())


def _shaped(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _times(runs: int, count: int | None) -> int | None:
    return None if count is None else runs * count


def _sum(counts: list[int | None]) -> int | None:
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def _count(count: int | None) -> str:
    return "?" if count is None else f"{count:,}"


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def cells(tag: str, values: tuple[str, ...]) -> str:
        return "".join(f"<{tag}>{html.escape(v)}</{tag}>" for v in values)

    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<table><thead><tr>{cells('th', header)}</tr></thead><tbody>{body}</tbody></table>"


def _html_lines(lines: list[str]) -> str:
    return "".join(f"<p>{html.escape(line)}</p>" for line in lines)


def _table(header: tuple[str, ...], lines: Sequence[tuple[str, ...]], right: set[int]) -> list[str]:
    """A plain-text table: the header, a rule, the lines, a rule; `right` columns right-aligned."""
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [fmt(header), rule, *map(fmt, lines), rule]


def _owner(path: tuple, owners: dict) -> tuple:
    for cut in range(len(path) - 1, -1, -1):
        if path[:cut] in owners:
            return path[:cut]
    return ()


def _human_bytes(count: int) -> str:
    n = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{count:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"
