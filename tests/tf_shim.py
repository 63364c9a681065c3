"""Just enough of `tensorflow` and `tensorflow_datasets` for the Metoryx article's MNIST program.

The article loads MNIST with `tfds.load("mnist")` and a `tf.data` pipeline. lamina depends on
neither, and nothing may be downloaded, so this shim serves the same pipeline from an
MNIST-format folder with NumPy: `load` returns uint8 images of shape (28, 28, 1) and int64
labels, as TFDS does; `map` applies the element function to whole batches (correct for the
element-wise functions the seed maps); `shuffle` permutes each repetition of the data (a
full shuffle, where TF's buffer of 1024 shuffles locally).
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

import lamina as lm


class Dataset:
    def __init__(self, arrays, ops=(), seed=0):
        self.arrays, self.ops, self.seed = arrays, tuple(ops), seed

    def _then(self, *op):
        return Dataset(self.arrays, (*self.ops, op), self.seed)

    def map(self, fn):
        return self._then("map", fn)

    def repeat(self, count):
        return self._then("repeat", count)

    def shuffle(self, buffer_size):
        return self._then("shuffle", buffer_size)

    def batch(self, batch_size, drop_remainder=False):
        return self._then("batch", batch_size, drop_remainder)

    def prefetch(self, buffer_size):
        return self

    def as_numpy_iterator(self):
        n = len(next(iter(self.arrays.values())))
        repeats, shuffled, batch, drop, fns = 1, False, None, False, []
        for op in self.ops:
            if op[0] == "repeat":
                repeats *= op[1]
            elif op[0] == "shuffle":
                shuffled = True
            elif op[0] == "batch":
                batch, drop = op[1], op[2]
            else:
                fns.append(op[1])
        rng = np.random.default_rng(self.seed)
        order = np.concatenate(
            [rng.permutation(n) if shuffled else np.arange(n) for _ in range(repeats)]
        )
        size = batch or 1
        stop = len(order) - len(order) % size if drop else len(order)
        for start in range(0, stop, size):
            index = order[start : start + size]
            item = {key: value[index] for key, value in self.arrays.items()}
            for fn in fns:
                item = fn(item)
            yield item if batch else {k: v[0] for k, v in item.items()}


def modules(folder: Path):
    """Returns fake ``tensorflow`` and ``tensorflow_datasets`` modules reading `folder`."""
    seed = {"value": 0}

    def load(name, split):
        assert name == "mnist", name
        prefix = {"train": "train", "test": "t10k"}[split]
        images = lm.data.read_idx(_find(folder, f"{prefix}-images"))
        labels = lm.data.read_idx(_find(folder, f"{prefix}-labels"))
        return Dataset(
            {"image": images[..., None], "label": labels.astype(np.int64)}, seed=seed["value"]
        )

    tf = types.ModuleType("tensorflow")
    tf.float32 = np.float32
    tf.cast = lambda x, dtype: np.asarray(x).astype(dtype)
    tf.random = types.SimpleNamespace(set_seed=lambda s: seed.update(value=s))
    tfds = types.ModuleType("tensorflow_datasets")
    tfds.load = load
    return tf, tfds


def _find(folder: Path, stem: str) -> Path:
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(stem):
            return path
    raise FileNotFoundError(f"{folder} has no {stem}* file")
