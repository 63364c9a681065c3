"""`summary`: a table of a model's modules, variables, parameter counts and bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ._core.checks import format_path
from ._core.graph import Plan
from ._core.module import Module


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


class Summary:
    """What `summary` returns: rows and totals; ``str()`` gives the table.

    Attributes:
        model_type: The model's class name.
        rows: One `SummaryRow` per variable, in the model's walk order.
        modules: ``(path, type)`` of every module, in walk order.
        totals: ``{collection: (count, bytes)}``.

    Example:
        >>> import lamina as lm
        >>> summary = lm.summary(lm.Dense(3, 2))
        >>> summary.totals, [row.name for row in summary.rows]
        ({'params': (8, 32)}, ['kernel', 'bias'])
    """

    def __init__(self, model: Module):
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
        widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
        right = {5, 6}

        def fmt(cells: tuple[str, ...]) -> str:
            return "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        rule = "  ".join("-" * w for w in widths)
        out = [
            f"{self.model_type}: {len(self.modules)} modules, {len(self.rows)} variables",
            fmt(header),
            rule,
            *map(fmt, lines),
            rule,
        ]
        for collection, (count, nbytes) in self.totals.items():
            out.append(f"{collection}: {count:,} ({_human_bytes(nbytes)})")
        if not self.totals:
            out.append("no variables")
        return "\n".join(out)

    def __repr__(self) -> str:
        return str(self)


def summary(model: Module) -> Summary:
    """A table of the model's modules and variables: shapes, dtypes, counts and bytes.

    Shared modules and variables are counted once, at their first path. ``print()`` it in a
    terminal, or log ``str()`` of it; the rows and totals are also available as data.

    Args:
        model: The model definition (no variables are needed: shapes are declared).

    Returns:
        A `Summary`.

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
    """
    return Summary(model)


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
