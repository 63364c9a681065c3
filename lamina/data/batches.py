"""A NumPy input pipeline: shuffle, batch, drop the remainder."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


def batches(
    data: Mapping[str, np.ndarray],
    batch_size: int,
    *,
    rng: np.random.Generator | None = None,
    drop_remainder: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields one epoch of batches of `data` (a dict of arrays with a common first axis).

    Args:
        data: Arrays of equal length, such as ``{"image": ..., "label": ...}``.
        batch_size: Examples per batch.
        rng: Shuffles the order when given (a `numpy.random.Generator`); in order otherwise.
        drop_remainder: Leave out the last, smaller batch.

    Yields:
        ``{key: array[batch]}``.

    Raises:
        ValueError: A bad batch size, or arrays of different lengths.

    Example:
        >>> import numpy as np, lamina as lm
        >>> data = {"x": np.arange(10)}
        >>> [b["x"].tolist() for b in lm.data.batches(data, 4)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> [len(b["x"]) for b in lm.data.batches(data, 4, drop_remainder=False)]
        [4, 4, 2]
    """
    lengths = {key: len(value) for key, value in data.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"batches: all arrays need the same length, got {lengths}.")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batches: batch_size must be a positive int, got {batch_size!r}.")
    n = next(iter(lengths.values()))
    order = rng.permutation(n) if rng is not None else np.arange(n)
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        index = order[start : start + batch_size]
        yield {key: value[index] for key, value in data.items()}
