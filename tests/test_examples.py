"""The examples, run as a user runs them (end to end, on real data)."""

import argparse
import importlib
import json
import pathlib
import runpy
import sys

import jax
import pytest

import lamina as lm

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run_example(name, argv, monkeypatch):
    """Runs `examples/<name>` with `argv`, under JAX's default ("standard") dtype promotion.

    The suite runs with strict promotion to keep lamina itself honest; an example is user code
    that also runs optax's optimisers, which are not strict-clean (adam's bias correction
    raises a float to an int32 power), so it runs as a user would run it.
    """
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    namespace = runpy.run_path(str(EXAMPLES / name), run_name="example")
    with jax.numpy_dtype_promotion("standard"):
        return namespace["main"](argv)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_saved(results, folder, out):
    """The run wrote metrics.json (what `main` returned) and curves.png in `folder`; said so."""
    files = results["files"]
    assert files == {"metrics": folder / "metrics.json", "curves": folder / "curves.png"}
    saved = json.loads(files["metrics"].read_text())
    assert saved["data"] == results["data"] and "--quiet" in saved["command"]
    with open(files["curves"], "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    assert files["curves"].stat().st_size > 10_000  # a drawn figure, not an empty one
    assert f"saved the metrics to {files['metrics']} and the curves to {files['curves']}" in out
    return saved


@pytest.mark.slow
def test_mnist_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = ["--digits", "--epochs", "8", "--quiet", "--out", str(tmp_path)]
    results = run_example("mnist.py", argv, monkeypatch)
    history = results["history"]
    assert len(history) == 8 and results["data"] == "digits (scikit-learn)"
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert results["test"]["test_accuracy"] > 0.9
    out = capsys.readouterr().out
    assert "Results on digits (scikit-learn)" in out and "final test accuracy" in out
    assert "median over the epochs after the first" in out
    saved = check_saved(results, tmp_path, out)
    assert [row["epoch"] for row in saved["history"]] == list(range(1, 9))
    assert saved["history"][-1]["test_accuracy"] == pytest.approx(results["test"]["test_accuracy"])


def test_mnist_example_limit_and_saved_files(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default folder: runs/mnist-<date>-<time> under it
    argv = ["--digits", "--epochs", "1", "--limit", "200", "--quiet"]
    results = run_example("mnist.py", argv, monkeypatch)
    assert results["train_size"] == 200 and results["steps_per_epoch"] == 200 // 64
    out = capsys.readouterr().out
    assert "data: scikit-learn's 8x8 digits (--digits)" in out
    assert "200 of 1,438 training images" in out
    # one epoch: no claim of a median over the epochs after the first
    assert "one epoch, including the compilation" in out and "after the first" not in out
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("mnist-")
    saved = check_saved(results, pathlib.Path("runs") / folder.name, out)
    assert saved["train_size"] == 200 and saved["args"]["limit"] == 200
    assert set(saved["history"][0]) >= {"train_loss", "train_accuracy", "test_accuracy"}


def test_mnist_example_limit_beyond_the_data(monkeypatch, capsys, tmp_path):
    argv = ["--digits", "--epochs", "1", "--limit", "100000", "--batch-size", "512", "--quiet"]
    results = run_example("mnist.py", [*argv, "--out", str(tmp_path)], monkeypatch)
    assert results["train_size"] == 1438
    out = capsys.readouterr().out
    assert "--limit 100,000: digits (scikit-learn) has only 1,438 training images" in out
    with pytest.raises(SystemExit, match=r"error: 10 training images make no full batch of 64"):
        run_example("mnist.py", ["--digits", "--limit", "10", "--out", str(tmp_path)], monkeypatch)
    with pytest.raises(SystemExit):
        run_example("mnist.py", ["--digits", "--limit", "0"], monkeypatch)


def test_examples_say_how_to_get_fashion_mnist(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    common = importlib.import_module("_common")
    monkeypatch.setattr(lm.data, "FASHION_MNIST_DIR", tmp_path / "not-installed")
    data = common.load_data(argparse.Namespace(digits=False, data_dir=None))
    assert data.name == "digits (scikit-learn)"
    out = capsys.readouterr().out
    assert "because Fashion-MNIST is not installed at" in out
    assert "sudo apt-get install dataset-fashion-mnist" in out and "--data-dir" in out


@pytest.mark.slow
@pytest.mark.skipif(
    not lm.data.FASHION_MNIST_DIR.is_dir(),
    reason="needs Debian's dataset-fashion-mnist; .ci/run installs it",
)
def test_mnist_example_on_fashion_mnist_subset(monkeypatch, capsys, tmp_path):
    argv = ["--epochs", "1", "--limit", "12800", "--quiet", "--out", str(tmp_path)]
    results = run_example("mnist.py", argv, monkeypatch)
    assert results["data"] == "Fashion-MNIST" and results["train_size"] == 12800
    assert f"data: Fashion-MNIST, from {lm.data.FASHION_MNIST_DIR}" in capsys.readouterr().out
    assert results["test"]["test_accuracy"] > 0.72  # 200 steps: well above chance (0.1)


def test_mnist_example_bad_data_dir(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example("mnist.py", ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    with pytest.raises(SystemExit, match=r"error: .*train-images-idx3-ubyte: truncated"):
        run_example("mnist.py", ["--data-dir", str(tmp_path)], monkeypatch)


@pytest.mark.slow
def test_transfer_learning_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = [
        "--digits",
        "--pretrain-steps",
        "400",
        "--steps",
        "200",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    results = run_example("transfer_learning.py", argv, monkeypatch)
    assert results["task_a"] == [0, 1, 2, 3, 4] and results["task_b"] == [5, 6, 7, 8, 9]
    assert results["pretrain"]["test_accuracy"] > 0.95
    variants = results["variants"]
    assert set(variants) == {"scratch", "fine-tune", "slow body", "frozen body"}
    for name, row in variants.items():
        assert row["test_accuracy"] > 0.8, name  # 5 classes: chance is 0.2
    # frozen: only the head trains, and the body is the pretrained one bit for bit
    assert variants["frozen body"]["trainable_params"] < results["total_params"] / 4
    assert variants["fine-tune"]["trainable_params"] == results["total_params"]
    assert results["frozen_body_unchanged"]
    out = capsys.readouterr().out
    assert "bit-identical to the pretrained one" in out
    saved = check_saved(results, tmp_path, out)
    assert (
        saved["variants"]["frozen body"]["test_accuracy"]
        == variants["frozen body"]["test_accuracy"]
    )
    # the curves' data: one row per evaluation (every 100 steps)
    assert [row["step"] for row in saved["variants"]["scratch"]["history"]] == [100, 200]


@pytest.mark.slow
def test_lora_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = [
        "--digits",
        "--pretrain-steps",
        "500",
        "--steps",
        "300",
        "--quiet",
        "--out",
        str(tmp_path),
    ]
    results = run_example("lora_finetune.py", argv, monkeypatch)
    assert results["before"]["source"] > 0.9
    # the adapters start as a no-op: the wrapped model is the pretrained one
    assert results["start_target"] == pytest.approx(results["before"]["target"])
    assert results["adapted"]["target"] > results["before"]["target"] + 0.5
    assert results["trainable_params"] < results["total_params"] / 5
    assert results["base_unchanged"]
    # lm.replace + lm.freeze: the adapters are the model's only trainable Parameters
    assert results["trainable_are_adapters"]
    # merged: plain layers (no "base" level), the same predictions
    assert "LoRA" not in results["merged_layer_types"]
    assert results["merged_paths"] == ["bias", "kernel"]
    assert results["merged_params"] == results["pretrained_params"]
    assert results["merged_max_logit_difference"] < 1e-3
    assert results["merged"]["target"] == pytest.approx(results["adapted"]["target"], abs=0.01)
    out = capsys.readouterr().out
    assert "base weights are bit-identical" in out
    saved = check_saved(results, tmp_path, out)
    assert saved["adapted"] == results["adapted"] and saved["rank"] == 4
    assert [row["step"] for row in saved["adapt"]["history"]] == [75, 150, 225, 300]


@pytest.mark.parametrize("name", ["transfer_learning.py", "lora_finetune.py"])
def test_fine_tuning_examples_bad_arguments(name, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example(name, ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit):
        run_example(name, ["--steps", "0"], monkeypatch)
