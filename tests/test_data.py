import gzip

import jax
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
    a = list(lm.data.batches(data, 3, rng=np.random.default_rng(1), drop_last=True))
    b = list(lm.data.batches(data, 3, rng=np.random.default_rng(1), drop_last=True))
    assert [len(batch["x"]) for batch in a] == [3, 3, 3]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], 2 * x["x"])
    seen = np.concatenate([batch["x"] for batch in a])
    assert len(set(seen.tolist())) == 9 and not np.array_equal(seen, np.arange(9))
    full = list(lm.data.batches(data, 3))
    assert [len(batch["x"]) for batch in full] == [3, 3, 3, 1]
    assert sorted(np.concatenate([batch["x"] for batch in full]).tolist()) == list(range(10))


def test_batches_keep_the_partial_batch_by_default():
    # 10 examples, batch 64: one batch of 10 (it used to yield nothing)
    (batch,) = lm.data.batches({"x": np.arange(10)}, 64)
    assert batch["x"].tolist() == list(range(10))
    with pytest.raises(ValueError, match=r"10 examples make no full batch of 64.*drop_last=False"):
        lm.data.batches({"x": np.arange(10)}, 64, drop_last=True)
    assert len(list(lm.data.batches({"x": np.arange(64)}, 64, drop_last=True))) == 1


def test_batches_checks_arguments_when_called():
    # errors come at the call, not at the first next()
    with pytest.raises(ValueError, match="same length"):
        lm.data.batches({"a": np.zeros(3), "b": np.zeros(4)}, 2)


@pytest.mark.parametrize("batch_size", [np.int64(4), np.int32(4), np.uint8(4), 4])
def test_batches_numpy_int_batch_size(batch_size):
    sizes = [len(batch["x"]) for batch in lm.data.batches({"x": np.arange(10)}, batch_size)]
    assert sizes == [4, 4, 2]


@pytest.mark.parametrize(
    ("batch_size", "error", "match"),
    [
        (True, TypeError, "batch_size must be a positive int, got the bool True"),
        (np.bool_(True), TypeError, "batch_size must be a positive int, got the bool True"),
        (4.0, TypeError, r"batch_size must be a positive int, got 4.0 \(float\)"),
        ("4", TypeError, r"batch_size must be a positive int, got '4' \(str\)"),
        (0, ValueError, "batch_size must be a positive int, got 0"),
        (np.int64(-2), ValueError, "batch_size must be a positive int, got -2"),
    ],
)
def test_batches_bad_batch_size(batch_size, error, match):
    with pytest.raises(error, match=match):
        lm.data.batches({"a": np.zeros(3)}, batch_size)


def test_batches_rng_forms():
    data = {"x": np.arange(20)}

    def order(rng):
        return np.concatenate([b["x"] for b in lm.data.batches(data, 8, rng=rng)]).tolist()

    assert order(None) == list(range(20))
    # an int seed or a JAX key: the same order for the same value, a permutation of all
    for rng in (7, np.int64(7), jax.random.key(7), jax.random.PRNGKey(7)):
        assert sorted(order(rng)) == list(range(20)) and order(rng) != list(range(20))
        assert order(rng) == order(rng)
    assert order(7) == order(np.int64(7)) and order(jax.random.key(7)) == order(
        jax.random.PRNGKey(7)
    )
    assert order(7) != order(8) and order(jax.random.key(7)) != order(jax.random.key(8))
    # one Generator passed every epoch: a new order every epoch
    generator = np.random.default_rng(0)
    assert order(generator) != order(generator)


@pytest.mark.parametrize(
    ("rng", "error", "match"),
    [
        ("0", TypeError, r"rng must be None \(in order\), a numpy.random.Generator, an int "),
        (0.5, TypeError, r"rng must be .* or a JAX key .*; got float"),
        (True, TypeError, "rng must be .*; got the bool True"),
        (-1, ValueError, "an int seed must be at least 0, got -1"),
        (np.random.RandomState(0), TypeError, r"legacy RandomState: use numpy.random.default_rng"),
        (jax.random.split(jax.random.key(0), 3), ValueError, r"one JAX key, got .* shape \(3,\)"),
        (
            jax.numpy.zeros(3),
            TypeError,
            r"JAX array of dtype float32 and shape \(3,\), which is not",
        ),
    ],
)
def test_batches_bad_rng(rng, error, match):
    with pytest.raises(error, match=match):
        lm.data.batches({"a": np.zeros(3)}, 2, rng=rng)


def test_batches_tuple_and_list_data():
    images, labels = np.arange(10).reshape(5, 2), np.arange(5)
    got = list(lm.data.batches((images, labels), 2))
    assert all(isinstance(batch, tuple) and len(batch) == 2 for batch in got)
    np.testing.assert_array_equal(got[0][0], images[:2])
    np.testing.assert_array_equal(got[-1][1], labels[4:])
    (x, y), *_ = lm.data.batches([images, labels], 2, rng=0)
    np.testing.assert_array_equal(x[:, 0] // 2, y)  # rows stay paired when shuffled
    # lists of numbers and JAX arrays are arrays too
    (batch,) = lm.data.batches({"x": [1, 2, 3], "y": jax.numpy.arange(3)}, 3)
    assert batch["x"].tolist() == [1, 2, 3] and batch["y"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (np.zeros(3), TypeError, r"got a single array of shape \(3,\)\. Write batches\(\(array,\)"),
        (
            None,
            TypeError,
            r"data must be a dict of arrays .* or a tuple of arrays .*; got NoneType",
        ),
        ("abc", TypeError, r"data must be a dict of arrays .*; got str"),
        ({}, ValueError, "data holds no arrays"),
        ((), ValueError, "data holds no arrays"),
        ({"x": np.zeros(0)}, ValueError, "the data holds no examples"),
        ({"x": 3.0}, ValueError, r"data\['x'\] is a scalar"),
        ((np.zeros(3), np.zeros(2)), ValueError, r"same length .*got data\[0\]: 3, data\[1\]: 2"),
    ],
)
def test_batches_bad_data(data, error, match):
    with pytest.raises(error, match=match):
        lm.data.batches(data, 2)
