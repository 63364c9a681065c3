"""What every part of `benchmarks/run.py` shares: the columns, a row, interleaved timing.

A row is one measurement made for every contestant: ``values`` holds each contestant's
figure (the median of repeated runs) in the row's unit, ``spread`` its 10th and 90th
percentiles, ``notes`` a footnote for a contestant that has no figure (or a caveat). Ratios
are to the row's ``base``: raw JAX where the row has a hand-written JAX version, else the
peer named there (the footnote says so).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

# The columns of the table, in order: raw JAX first, then lamina and its peers.
COLUMNS = ("jax", "lamina", "linen", "nnx", "haiku", "equinox")
TITLES = {
    "jax": "raw JAX",
    "lamina": "lamina",
    "linen": "linen",
    "nnx": "nnx",
    "haiku": "haiku",
    "equinox": "equinox",
}


@dataclasses.dataclass
class Row:
    """One measurement for every contestant (see the module's docstring)."""

    id: str
    label: str
    unit: str
    values: dict[str, float]
    spread: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    base: str = "jax"
    extra: dict = dataclasses.field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """Each contestant's figure over the base's (none when the base has no figure)."""
        base = self.values.get(self.base)
        if not base:
            return {}
        return {name: value / base for name, value in self.values.items()}

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ratios": self.ratios()}


def summary(samples: list[float]) -> tuple[float, tuple[float, float]]:
    """The median and the (10th, 90th) percentiles."""
    p10, p90 = np.percentile(np.asarray(samples), [10, 90])
    return statistics.median(samples), (float(p10), float(p90))


def row_from_samples(
    id: str, label: str, unit: str, samples: dict[str, list[float]], scale: float = 1.0, **kw
) -> Row:
    """A row of medians (times `scale`, e.g. 1e6 for microseconds) from lists of samples."""
    values, spread = {}, {}
    for name, times in samples.items():
        median, (low, high) = summary([t * scale for t in times])
        values[name], spread[name] = median, (low, high)
    return Row(id, label, unit, values, spread, **kw)


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, number: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of each function: `rounds` samples, each the mean of `number` calls.

    Each function must block until its result is ready (`jax.block_until_ready`). The
    contestants take turns round by round, so drift in the machine's speed hits all alike,
    and the one that starts a round changes from round to round, so whatever the first (or
    the last) of a round pays falls on each in turn.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for round_ in range(rounds):
        shift = round_ % len(order)
        for name, fn in order[shift:] + order[:shift]:
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
    return samples


def blocking(fn: Callable, *args) -> Callable[[], object]:
    """``fn(*args)``, waited for."""
    return lambda: jax.block_until_ready(fn(*args))


def check_same(outputs: dict[str, object], rtol: float = 2e-4, atol: float = 2e-5) -> None:
    """Every contestant computed the same thing (against the first), before any timing."""
    names = list(outputs)
    reference = np.asarray(outputs[names[0]])
    for name in names[1:]:
        np.testing.assert_allclose(
            np.asarray(outputs[name]), reference, rtol=rtol, atol=atol, err_msg=name
        )
