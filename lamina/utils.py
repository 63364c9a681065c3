"""Training utilities: `AverageMeter`."""

from __future__ import annotations

import time
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

    As Metoryx's: ``AverageMeter(with_timer=True)`` also reports, under `timer_key`, the mean
    wall-clock seconds between updates (the first counts from the meter's creation or last
    `reset`), i.e. the time per step of a loop that updates once a step (an unweighted
    mean: `n` weighs the metrics, not the time); ``update(metrics, prefix="train/")`` names
    the metrics ``"train/loss"``... (the time too).

    Args:
        with_timer: Whether to time the updates.
        timer_key: The name of the time per update among the metrics.

    Raises:
        TypeError: `with_timer` is not a bool or `timer_key` not a non-empty str.

    Example:
        >>> import lamina as lm
        >>> meter = lm.utils.AverageMeter()
        >>> meter.update({"loss": 1.0, "accuracy": 0.5}, n=2)
        >>> meter.update({"loss": 4.0, "accuracy": 1.0}, n=1)
        >>> meter.compute()
        {'loss': 2.0, 'accuracy': 0.6666666666666666}
    """

    def __init__(self, with_timer: bool = False, timer_key: str = "time") -> None:
        if not isinstance(with_timer, bool):
            raise TypeError(f"AverageMeter: with_timer must be a bool, got {with_timer!r}.")
        if not isinstance(timer_key, str) or not timer_key:
            raise TypeError(
                f"AverageMeter: timer_key must be a non-empty str (the time's name among the "
                f"metrics), got {timer_key!r}."
            )
        self.with_timer = with_timer
        self.timer_key = timer_key
        self.reset()

    def reset(self) -> None:
        """Forgets every update."""
        self._keys: tuple[str, ...] | None = None
        self._prefix = ""
        self._pending: list[tuple[Any, int]] = []
        self._sums: np.ndarray | None = None
        self._count = 0
        self._times: list[float] = []
        self._tick = time.perf_counter()

    def update(self, metrics: Mapping[str, Any] | Any, n: int = 1, prefix: str = "") -> None:
        """Adds one observation of each metric, weighted by `n` (e.g. the batch size).

        Args:
            metrics: A dict of scalars, or a single scalar (without a timer or a prefix). An
                empty dict records only the time of the step (with a timer).
            n: The weight (number of examples the values average over).
            prefix: Put in front of each metric's name (and the timer's), e.g. ``"train/"``.

        Raises:
            ValueError: `n` is not positive, a value is not a scalar, the keys (with their
                prefix) differ from the first update's, a metric is named as the timer, or
                a single scalar is given with a prefix or a timer (they name metrics).
            TypeError: `prefix` is not a str.
        """
        if not isinstance(n, (int, np.integer)) or n <= 0:
            raise ValueError(f"AverageMeter.update: n must be a positive int, got {n!r}.")
        if not isinstance(prefix, str):
            raise TypeError(f"AverageMeter.update: prefix must be a str, got {prefix!r}.")
        if isinstance(metrics, Mapping):
            named = tuple(f"{prefix}{k}" for k in metrics)
            keys: tuple[str, ...] | None = named
            if self.with_timer and prefix + self.timer_key in named:
                raise ValueError(
                    f"AverageMeter.update: the metric {prefix + self.timer_key!r} has the "
                    f"timer's name; rename it, or build the meter with another timer_key."
                )
        elif prefix or self.with_timer:
            what = f"prefix={prefix!r}" if prefix else "with_timer=True"
            raise ValueError(
                f"AverageMeter.update: {what} names the metrics, which needs them in a dict; "
                f"got a single {type(metrics).__name__}. Pass {{'loss': value}}."
            )
        else:
            keys = None
        if self._count == 0 and not self._pending:
            self._keys, self._prefix = keys, prefix
        elif keys != self._keys:
            raise ValueError(
                f"AverageMeter.update: got metrics {keys}, but earlier updates had "
                f"{self._keys}; use one meter per set of metrics, or call reset()."
            )
        values = tuple(metrics.values()) if keys is not None else (metrics,)
        # `keys` is None for a single scalar; an empty dict names no metric (a timer-only meter)
        for key, value in zip(("value",) if keys is None else keys, values, strict=True):
            if np.size(value) != 1:
                raise ValueError(
                    f"AverageMeter.update: {key!r} has shape {np.shape(value)}; metrics must "
                    f"be scalars (reduce them with .mean() first)."
                )
        self._pending.append((values, n))
        if self.with_timer:
            now = time.perf_counter()
            self._times.append(now - self._tick)
            self._tick = now
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
        result = {key: float(mean) for key, mean in zip(self._keys, means, strict=True)}
        if self.with_timer:
            result[self._prefix + self.timer_key] = float(np.mean(self._times))
        return result

    def _fold(self) -> None:
        if not self._pending:
            return
        values = np.asarray(jax.device_get([v for v, _ in self._pending]), dtype=np.float64)
        weights = np.asarray([n for _, n in self._pending], dtype=np.float64)
        width = 1 if self._keys is None else len(self._keys)  # 0 for a timer-only meter
        sums = (values.reshape(len(weights), width) * weights[:, None]).sum(axis=0)
        self._sums = sums if self._sums is None else self._sums + sums
        self._count += int(weights.sum())
        self._pending = []
