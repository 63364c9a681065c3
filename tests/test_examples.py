"""The examples, run as a user runs them (end to end, on real data)."""

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


@pytest.mark.slow
def test_transfer_learning_example_on_digits(monkeypatch, capsys):
    argv = ["--digits", "--pretrain-steps", "400", "--steps", "200", "--quiet"]
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
    assert "bit-identical to the pretrained one" in capsys.readouterr().out


@pytest.mark.slow
def test_lora_example_on_digits(monkeypatch, capsys):
    argv = ["--digits", "--pretrain-steps", "500", "--steps", "300", "--quiet"]
    results = run_example("lora_finetune.py", argv, monkeypatch)
    assert results["before"]["source"] > 0.9
    # the adapters start as a no-op: the wrapped model is the pretrained one
    assert results["start_target"] == pytest.approx(results["before"]["target"])
    assert results["adapted"]["target"] > results["before"]["target"] + 0.5
    assert results["trainable_params"] < results["total_params"] / 5
    assert results["base_unchanged"]
    # merged: plain layers (no "base" level), the same predictions
    assert "LoRA" not in results["merged_layer_types"]
    assert results["merged_paths"] == ["bias", "kernel"]
    assert results["merged_params"] == results["pretrained_params"]
    assert results["merged_max_logit_difference"] < 1e-3
    assert results["merged"]["target"] == pytest.approx(results["adapted"]["target"], abs=0.01)
    assert "base weights are bit-identical" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["transfer_learning.py", "lora_finetune.py"])
def test_fine_tuning_examples_bad_arguments(name, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example(name, ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit):
        run_example(name, ["--steps", "0"], monkeypatch)
