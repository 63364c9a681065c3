import gzip

import numpy as np
import pytest

import lamina as lm


def write_idx(path, array, gz=False):
    codes = {np.uint8: 0x08, np.int32: 0x0C, np.float32: 0x0D}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim])
    header += np.asarray(array.shape, ">u4").tobytes()
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(header + body)


def make_folder(tmp_path, n_train=12, n_test=5, gz=False, sep="-", size=6):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(
            tmp_path / f"{prefix}-images{sep}idx3-ubyte{suffix}",
            rng.integers(0, 256, (n, size, size)).astype(np.uint8),
            gz,
        )
        write_idx(
            tmp_path / f"{prefix}-labels{sep}idx1-ubyte{suffix}",
            (np.arange(n) % 3).astype(np.uint8),
            gz,
        )
    return tmp_path


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
def test_read_idx_round_trip(tmp_path, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    if dtype is np.uint8:
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a-idx3", array)
    np.testing.assert_array_equal(lm.data.read_idx(tmp_path / "a-idx3"), array)


@pytest.mark.parametrize(("gz", "sep"), [(False, "-"), (True, "-"), (True, ".")])
def test_load_idx_folder(tmp_path, gz, sep):
    data = lm.data.load_idx_folder(make_folder(tmp_path, gz=gz, sep=sep), name="tiny")
    assert data.name == "tiny" and data.num_classes == 3
    assert data.train["image"].shape == (12, 6, 6, 1) and data.test["label"].shape == (5,)
    assert data.train["image"].dtype == np.float32 and data.train["label"].dtype == np.int32
    assert data.train["image"].min() >= 0.0 and data.train["image"].max() <= 1.0


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no data folder at .*--data-dir"):
        lm.data.load_idx_folder(tmp_path / "nowhere")
    folder = make_folder(tmp_path)
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"no t10k-labels-idx1-ubyte file"):
        lm.data.load_idx_folder(folder)


def test_truncated_file(tmp_path):
    folder = make_folder(tmp_path)
    path = folder / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        lm.data.IdxFormatError,
        match=r"truncated: the header promises shape "
        r"\(12, 6, 6\)",
    ):
        lm.data.load_idx_folder(folder)


def test_bad_magic_and_garbage_gzip(tmp_path):
    (tmp_path / "x").write_bytes(b"hello world")
    with pytest.raises(lm.data.IdxFormatError, match="not an IDX file"):
        lm.data.read_idx(tmp_path / "x")
    (tmp_path / "y.gz").write_bytes(b"not gzip")
    with pytest.raises(lm.data.IdxFormatError, match="cannot read it"):
        lm.data.read_idx(tmp_path / "y.gz")
    (tmp_path / "z").write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(lm.data.IdxFormatError, match="truncated inside its header"):
        lm.data.read_idx(tmp_path / "z")


def test_images_and_labels_disagree(tmp_path):
    folder = make_folder(tmp_path)
    write_idx(folder / "train-labels-idx1-ubyte", np.zeros(11, np.uint8))
    with pytest.raises(lm.data.IdxFormatError, match="12 train images but 11 labels"):
        lm.data.load_idx_folder(folder)
    write_idx(folder / "train-labels-idx1-ubyte", np.zeros((12, 2), np.uint8))
    with pytest.raises(lm.data.IdxFormatError, match="labels rank 1"):
        lm.data.load_idx_folder(folder)


def test_digits():
    data = lm.data.load_digits()
    assert data.train["image"].shape[1:] == (8, 8, 1)
    assert len(data.train["label"]) + len(data.test["label"]) == 1797
    assert data.num_classes == 10 and data.train["image"].max() == 1.0


def test_batches_shuffle_and_remainder():
    data = {"x": np.arange(10), "y": np.arange(10) * 2}
    a = list(lm.data.batches(data, 3, rng=np.random.default_rng(1)))
    b = list(lm.data.batches(data, 3, rng=np.random.default_rng(1)))
    assert [len(batch["x"]) for batch in a] == [3, 3, 3]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], 2 * x["x"])
    seen = np.concatenate([batch["x"] for batch in a])
    assert len(set(seen.tolist())) == 9 and not np.array_equal(seen, np.arange(9))
    full = list(lm.data.batches(data, 3, drop_remainder=False))
    assert sorted(np.concatenate([batch["x"] for batch in full]).tolist()) == list(range(10))


def test_batches_errors():
    with pytest.raises(ValueError, match="same length"):
        next(lm.data.batches({"a": np.zeros(3), "b": np.zeros(4)}, 2))
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        next(lm.data.batches({"a": np.zeros(3)}, 0))
