"""The examples, run as a user runs them (end to end, on real data)."""

import pathlib
import runpy
import sys

import pytest

import lamina as lm

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run_example(name, argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    namespace = runpy.run_path(str(EXAMPLES / name), run_name="example")
    return namespace["main"](argv)


@pytest.mark.slow
def test_mnist_example_on_digits(monkeypatch, capsys):
    results = run_example("mnist.py", ["--digits", "--epochs", "8", "--quiet"], monkeypatch)
    history = results["history"]
    assert len(history) == 8 and results["data"] == "digits (scikit-learn)"
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert results["test"]["test_accuracy"] > 0.9
    out = capsys.readouterr().out
    assert "Results on digits (scikit-learn)" in out and "final test accuracy" in out


@pytest.mark.slow
@pytest.mark.skipif(
    not lm.data.FASHION_MNIST_DIR.is_dir(),
    reason="needs Debian's dataset-fashion-mnist; .ci/run installs it",
)
def test_mnist_example_on_fashion_mnist_subset(monkeypatch):
    results = run_example("mnist.py", ["--epochs", "1", "--limit", "12800", "--quiet"], monkeypatch)
    assert results["data"] == "Fashion-MNIST"
    assert results["test"]["test_accuracy"] > 0.72  # 200 steps: well above chance (0.1)


def test_mnist_example_bad_data_dir(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example("mnist.py", ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    with pytest.raises(SystemExit, match=r"error: .*train-images-idx3-ubyte: truncated"):
        run_example("mnist.py", ["--data-dir", str(tmp_path)], monkeypatch)
