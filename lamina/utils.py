"""Training utilities: `AverageMeter`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

_FOLD_EVERY = 512  # pending updates kept on the device before they are summed on the host


class AverageMeter:
    """Running weighted means of metrics, such as per-batch loss and accuracy.

    `update` does not wait for the device: values are kept as they come and summed in float64
    on the host when `compute` is called (or every few hundred updates), so a training loop
    that updates every step is not slowed down by device-to-host copies.

    Example:
        >>> import lamina as lm
        >>> meter = lm.utils.AverageMeter()
        >>> meter.update({"loss": 1.0, "accuracy": 0.5}, n=2)
        >>> meter.update({"loss": 4.0, "accuracy": 1.0}, n=1)
        >>> meter.compute()
        {'loss': 2.0, 'accuracy': 0.6666666666666666}
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every update."""
        self._keys: tuple[str, ...] | None = None
        self._pending: list[tuple[Any, int]] = []
        self._sums: np.ndarray | None = None
        self._count = 0

    def update(self, metrics: Mapping[str, Any] | Any, n: int = 1) -> None:
        """Adds one observation of each metric, weighted by `n` (e.g. the batch size).

        Args:
            metrics: A dict of scalars, or a single scalar.
            n: The weight (number of examples the values average over).

        Raises:
            ValueError: `n` is not positive, a value is not a scalar, or the keys differ
                from the first update's.
        """
        if not isinstance(n, (int, np.integer)) or n <= 0:
            raise ValueError(f"AverageMeter.update: n must be a positive int, got {n!r}.")
        keys = tuple(metrics) if isinstance(metrics, Mapping) else None
        if self._count == 0 and not self._pending:
            self._keys = keys
        elif keys != self._keys:
            raise ValueError(
                f"AverageMeter.update: got metrics {keys}, but earlier updates had "
                f"{self._keys}; use one meter per set of metrics, or call reset()."
            )
        values = tuple(metrics.values()) if keys is not None else (metrics,)
        for key, value in zip(keys or ("value",), values, strict=True):
            if np.size(value) != 1:
                raise ValueError(
                    f"AverageMeter.update: {key!r} has shape {np.shape(value)}; metrics must "
                    f"be scalars (reduce them with .mean() first)."
                )
        self._pending.append((values, n))
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def compute(self) -> dict[str, float] | float:
        """Returns the weighted mean of each metric since the last `reset`.

        Raises:
            ValueError: No update was made.
        """
        self._fold()
        if self._count == 0:
            raise ValueError("AverageMeter.compute: no update since the last reset.")
        assert self._sums is not None  # _fold made them, since _count > 0
        means = np.asarray(self._sums / self._count)
        if self._keys is None:
            return float(means[0])
        return {key: float(mean) for key, mean in zip(self._keys, means, strict=True)}

    def _fold(self) -> None:
        if not self._pending:
            return
        values = np.asarray(jax.device_get([v for v, _ in self._pending]), dtype=np.float64)
        weights = np.asarray([n for _, n in self._pending], dtype=np.float64)
        sums = (values.reshape(len(weights), -1) * weights[:, None]).sum(axis=0)
        self._sums = sums if self._sums is None else self._sums + sums
        self._count += int(weights.sum())
        self._pending = []
