"""A NumPy input pipeline: shuffle and batch arrays that share their first axis."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

Batch = dict[str, Any] | tuple[Any, ...]

_DATA_FORMS = (
    "a dict of arrays ({'image': images, 'label': labels}) or a tuple of arrays "
    "((images, labels)), every array with the examples along its first axis"
)
_RNG_FORMS = (
    "None (in order), a numpy.random.Generator, an int seed, or a JAX key "
    "(jax.random.key(0) or jax.random.PRNGKey(0))"
)


def batches(
    data: Mapping[str, Any] | Sequence[Any],
    batch_size: int,
    *,
    rng: np.random.Generator | int | jax.Array | None = None,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Returns an iterator over one epoch of batches of `data`.

    The arguments are checked when `batches` is called, before the first batch.

    Args:
        data: Arrays of equal length along their first axis: a dict (``{"image": ...,
            "label": ...}``, batches are dicts with the same keys) or a tuple or list (batches
            are tuples). NumPy arrays, JAX arrays, and anything ``numpy.asarray`` takes.
        batch_size: Examples per batch, a positive int (Python's or NumPy's; not a bool).
        rng: How to shuffle. ``None`` keeps the order. A ``numpy.random.Generator`` is drawn
            from, so one generator passed every epoch gives a new order every epoch. An int
            seed or a JAX key (``jax.random.key``, or the legacy ``jax.random.PRNGKey``)
            always gives the same order for the same value: pass a different one each epoch
            (``seed + epoch``, ``jax.random.fold_in(key, epoch)``).
        drop_last: Leave out the last batch when it is smaller than `batch_size` (as
            PyTorch's ``DataLoader(drop_last=True)``; a fixed batch shape means one compiled
            step under ``jax.jit``). By default it is kept, as PyTorch and Grain do.

    Returns:
        An iterator of batches, ``{key: array[batch]}`` or ``(array[batch], ...)``.

    Raises:
        TypeError: `data`, `batch_size` or `rng` is of a kind it does not take.
        ValueError: A batch size below 1, no examples, arrays of different lengths, or
            ``drop_last=True`` with fewer examples than one batch (the epoch would be empty).

    Example:
        >>> import numpy as np, lamina as lm
        >>> data = {"x": np.arange(10)}
        >>> [len(b["x"]) for b in lm.data.batches(data, 4)]
        [4, 4, 2]
        >>> [b["x"].tolist() for b in lm.data.batches(data, 4, drop_last=True)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> [x.tolist() for x, y in lm.data.batches((np.arange(5), np.zeros(5)), 2, rng=0)]
        [[2, 4], [3, 0], [1]]
    """
    keys, names, arrays = _split_data(data)
    size = _check_batch_size(batch_size)
    lengths = {name: array.shape[0] for name, array in zip(names, arrays, strict=True)}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"batches: every array needs the same length (examples along the first axis), "
            f"got {_describe_lengths(lengths)}."
        )
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError("batches: the data holds no examples (its arrays have length 0).")
    if drop_last and n < size:
        raise ValueError(
            f"batches: {n:,} examples make no full batch of {size:,}, and drop_last=True leaves "
            f"out the partial one: the epoch would be empty. Use a batch_size of at most {n:,}, "
            f"or drop_last=False to get the {n:,} examples as one smaller batch."
        )
    order = _order(rng, n)
    stop = n - n % size if drop_last else n
    return _generate(keys, arrays, order, size, stop, as_dict=isinstance(data, Mapping))


def _generate(
    keys: list[Any], arrays: list[Any], order: np.ndarray, size: int, stop: int, as_dict: bool
) -> Iterator[Batch]:
    for start in range(0, stop, size):
        index = order[start : start + size]
        if as_dict:
            yield {key: array[index] for key, array in zip(keys, arrays, strict=True)}
        else:
            yield tuple(array[index] for array in arrays)


def _split_data(data: Any) -> tuple[list[Any], list[str], list[Any]]:
    """The keys, the names (for messages) and the arrays of `data`, a dict or a tuple."""
    if isinstance(data, Mapping):
        keys = list(data)
        names = [f"data[{key!r}]" for key in keys]
    elif isinstance(data, tuple | list):
        keys = list(range(len(data)))
        names = [f"data[{i}]" for i in keys]
    elif isinstance(data, np.ndarray | jax.Array):
        raise TypeError(
            f"batches: data must be {_DATA_FORMS}; got a single array of shape "
            f"{data.shape}. Write batches((array,), ...) or batches({{'x': array}}, ...)."
        )
    else:
        raise TypeError(f"batches: data must be {_DATA_FORMS}; got {type(data).__name__}.")
    if not keys:
        raise ValueError(f"batches: data holds no arrays; it must be {_DATA_FORMS}.")
    arrays = []
    for key, name in zip(keys, names, strict=True):
        value = data[key]
        array = value if isinstance(value, np.ndarray | jax.Array) else np.asarray(value)
        if array.ndim == 0:
            raise ValueError(
                f"batches: {name} is a scalar; every array needs the examples along its first axis."
            )
        arrays.append(array)
    return keys, names, arrays


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool | np.bool_):
        raise TypeError(
            f"batches: batch_size must be a positive int, got the bool {bool(batch_size)}."
        )
    try:
        size = operator.index(batch_size)  # int, numpy.int64, ...; not 4.0 or "4"
    except TypeError:
        raise TypeError(
            f"batches: batch_size must be a positive int, got {batch_size!r} "
            f"({type(batch_size).__name__})."
        ) from None
    if size < 1:
        raise ValueError(f"batches: batch_size must be a positive int, got {size}.")
    return size


def _order(rng: Any, n: int) -> np.ndarray:
    if rng is None:
        return np.arange(n)
    if isinstance(rng, np.random.Generator):
        return rng.permutation(n)
    if isinstance(rng, jax.Array):
        return np.random.default_rng(_key_seed(rng)).permutation(n)
    if isinstance(rng, bool | np.bool_):
        raise TypeError(f"batches: rng must be {_RNG_FORMS}; got the bool {bool(rng)}.")
    if isinstance(rng, int | np.integer):
        if rng < 0:
            raise ValueError(f"batches: an int seed must be at least 0, got {rng}.")
        return np.random.default_rng(int(rng)).permutation(n)
    hint = ""
    if isinstance(rng, np.random.RandomState):
        hint = " (the legacy RandomState: use numpy.random.default_rng(seed))"
    raise TypeError(f"batches: rng must be {_RNG_FORMS}; got {type(rng).__name__}{hint}.")


def _key_seed(key: jax.Array) -> np.ndarray:
    """The words of one JAX key, as a NumPy seed."""
    if jax.numpy.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(
                f"batches: rng must be one JAX key, got an array of keys of shape {key.shape}."
            )
        return np.asarray(jax.random.key_data(key))
    if key.dtype == np.uint32 and key.shape in ((2,), (4,)):  # jax.random.PRNGKey's raw form
        return np.asarray(key)
    raise TypeError(
        f"batches: rng must be {_RNG_FORMS}; got a JAX array of dtype {key.dtype} and shape "
        f"{key.shape}, which is not a key."
    )


def _describe_lengths(lengths: dict[str, int]) -> str:
    return ", ".join(f"{key}: {length:,}" for key, length in lengths.items())
