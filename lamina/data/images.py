"""Image classification data: any MNIST-format folder, or scikit-learn's bundled digits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .idx import IdxFormatError, read_idx

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist

_SPLITS = {"train": "train", "test": "t10k"}


class ImageData(NamedTuple):
    """A labelled image set split into train and test.

    Attributes:
        name: Where it came from, for reports.
        train: ``{"image": float32 (N, H, W, C) in [0, 1], "label": int32 (N,)}``.
        test: The same for the test split.
        num_classes: Number of label values.

    Example:
        >>> import numpy as np, lamina as lm
        >>> split = {"image": np.zeros((2, 8, 8, 1), np.float32), "label": np.array([0, 1])}
        >>> data = lm.data.ImageData("tiny", split, split, num_classes=2)
        >>> data.train["image"].shape, data.num_classes
        ((2, 8, 8, 1), 2)
    """

    name: str
    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    num_classes: int


def load_idx_folder(folder: str | os.PathLike, name: str | None = None) -> ImageData:
    """Loads an MNIST-format folder: ``train-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``...

    Works for MNIST, Fashion-MNIST, KMNIST and any set in the same format; the files may be
    gzipped (``.gz``) and named with ``-`` or ``.`` before ``idx``.

    Args:
        folder: The folder holding the four files.
        name: A name for reports (default: the folder's name).

    Returns:
        The data, images scaled to [0, 1] with a channel axis.

    Raises:
        FileNotFoundError: The folder or one of the four files is missing.
        IdxFormatError: A file is malformed or truncated, or images and labels disagree.

    Example:
        >>> import pathlib, tempfile, numpy as np, lamina as lm
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> def write(name, array):  # IDX: 0 0 8 <rank>, big-endian sizes, then uint8 data
        ...     header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
        ...     _ = (folder / name).write_bytes(header + array.astype(np.uint8).tobytes())
        >>> for split, n in (("train", 3), ("t10k", 2)):
        ...     write(f"{split}-images-idx3-ubyte", np.full((n, 4, 4), 255))
        ...     write(f"{split}-labels-idx1-ubyte", np.arange(n))
        >>> data = lm.data.load_idx_folder(folder, "tiny")
        >>> data.train["image"].shape, data.train["image"].max(), data.test["label"].tolist()
        ((3, 4, 4, 1), np.float32(1.0), [0, 1])
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no data folder at {folder}. Pass --data-dir pointing at a folder with the four "
            f"MNIST-format files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
            f"t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])."
        )
    splits = {}
    for split, prefix in _SPLITS.items():
        images = read_idx(_find(folder, prefix, "images", "idx3"))
        labels = read_idx(_find(folder, prefix, "labels", "idx1"))
        if images.ndim != 3 or labels.ndim != 1:
            raise IdxFormatError(
                f"{folder}: {prefix} images must have rank 3 and labels rank 1, got shapes "
                f"{images.shape} and {labels.shape}."
            )
        if len(images) != len(labels):
            raise IdxFormatError(
                f"{folder}: {len(images):,} {prefix} images but {len(labels):,} labels; the "
                f"two files must describe the same examples."
            )
        splits[split] = {
            "image": (images.astype(np.float32) / 255.0)[..., None],
            "label": labels.astype(np.int32),
        }
    num_classes = int(max(splits["train"]["label"].max(), splits["test"]["label"].max())) + 1
    return ImageData(name or folder.name, splits["train"], splits["test"], num_classes)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> ImageData:
    """scikit-learn's 8x8 handwritten digits (1,797 images, in its wheel: nothing downloads).

    Args:
        test_fraction: Share of the images held out for testing (a fixed shuffle).
        seed: Seed of that shuffle.

    Returns:
        The data, images scaled to [0, 1] with a channel axis.

    Example:
        >>> import lamina as lm
        >>> data = lm.data.load_digits()
        >>> data.train["image"].shape, data.test["image"].shape, data.num_classes
        ((1438, 8, 8, 1), (359, 8, 8, 1), 10)
    """
    from sklearn.datasets import load_digits as sklearn_digits

    features, target = sklearn_digits(return_X_y=True)  # (1797, 64) pixel values 0-16
    images = (np.asarray(features, np.float32).reshape(-1, 8, 8) / 16.0)[..., None]
    labels = np.asarray(target).astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(images))
    cut = len(images) - round(len(images) * test_fraction)
    train, test = order[:cut], order[cut:]
    return ImageData(
        "digits (scikit-learn)",
        {"image": images[train], "label": labels[train]},
        {"image": images[test], "label": labels[test]},
        10,
    )


def load_default_images() -> ImageData:
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` if installed, else the digits.

    ``sudo apt-get install dataset-fashion-mnist`` (Debian, Ubuntu) installs the set in
    `FASHION_MNIST_DIR`. The result's ``name`` says which set was loaded.

    Example:
        >>> import lamina as lm
        >>> data = lm.data.load_default_images()
        >>> data.name in ("Fashion-MNIST", "digits (scikit-learn)"), data.num_classes
        (True, 10)
    """
    if FASHION_MNIST_DIR.is_dir():
        return load_idx_folder(FASHION_MNIST_DIR, "Fashion-MNIST")
    return load_digits()


def _find(folder: Path, prefix: str, kind: str, idx: str) -> Path:
    for sep in ("-", "."):
        for suffix in ("", ".gz"):
            path = folder / f"{prefix}-{kind}{sep}{idx}-ubyte{suffix}"
            if path.exists():
                return path
    raise FileNotFoundError(
        f"{folder} has no {prefix}-{kind}-{idx}-ubyte file (plain or .gz); an MNIST-format "
        f"folder holds train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte."
    )
