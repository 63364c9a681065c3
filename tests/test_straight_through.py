"""examples/straight_through.py: the quantising rule, the network, and a run end to end."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

from .test_examples import EXAMPLES, check_saved, run_example

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

NETWORKS = ["unquantised", "quantised", "quantised, round's gradient"]


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # it imports _common
    return importlib.import_module("straight_through")


def test_quantize_rounds_forward_and_passes_gradients_straight_through(example):
    x = jnp.array([-0.3, 0.1, 0.2, 0.5, 0.8, 1.0, 1.4])
    y = example.quantize(x, levels=4)
    np.testing.assert_allclose(y, [0, 0, 1 / 3, 2 / 3, 2 / 3, 1, 1], rtol=1e-6)
    np.testing.assert_array_equal(y, example.round_to_levels(x, 4))
    grad = jax.grad(lambda x: jnp.sum(example.quantize(x, levels=4)))(x)
    np.testing.assert_array_equal(grad, [0, 1, 1, 1, 1, 1, 0])  # the clip's gradient
    plain = jax.grad(lambda x: jnp.sum(example.round_to_levels(x, 4)))(x)
    np.testing.assert_array_equal(plain, np.zeros(7))  # rounding's own: nothing to learn from


@pytest.mark.parametrize("levels", [2, 3])
def test_the_network_quantises_and_learns_only_with_the_rule(example, levels, getkey):
    images = jax.random.uniform(getkey(), (16, 8, 8, 1))
    labels = jnp.arange(16) % 10
    grid = set((np.arange(levels, dtype=np.float32) / np.float32(levels - 1)).tolist())
    params = None
    first_layer_gradients = []
    for straight_through in (True, False):
        model = example.Mlp(64, 10, 32, 2, levels, straight_through)
        init, apply = lm.transform(model)
        if params is None:  # the same paths and shapes: the same parameters for both
            params = init(jax.random.key(0))["params"]
        hidden = jax.jit(lambda params, apply=apply: apply({"params": params}, None, images, True))
        (_, activations), _ = hidden(params)
        for activation in activations:
            values = set(np.unique(np.asarray(activation)).tolist())
            assert values <= grid and len(values) >= 2

        def loss(params, apply=apply):
            logits, _ = apply({"params": params}, None, images)
            return example.cross_entropy(logits, labels)

        grads = jax.jit(jax.grad(loss))(params)
        first_layer_gradients.append(grads["layers"]["0"]["kernel"])
    with_rule, without = first_layer_gradients
    assert np.abs(with_rule).sum() > 0
    np.testing.assert_array_equal(without, 0.0)  # rounding's own gradient stops it


def test_example_on_digits(monkeypatch, capsys, tmp_path):
    argv = ["--digits", "--epochs", "3", "--quiet", "--out", str(tmp_path)]
    results = run_example("straight_through.py", argv, monkeypatch)
    assert results["data"] == "digits (scikit-learn)" and results["levels"] == 4
    networks = results["networks"]
    assert list(networks) == NETWORKS
    for row in networks.values():
        history = row["history"]
        assert [r["epoch"] for r in history] == [1, 2, 3]
        assert history[-1]["train_loss"] < history[0]["train_loss"]
    # well above chance (0.1), and the straight-through network close to the unquantised one
    assert networks["unquantised"]["test_accuracy"] > 0.85
    assert networks["quantised"]["test_accuracy"] > 0.85
    assert networks["quantised"]["test_accuracy"] > networks["unquantised"]["test_accuracy"] - 0.05
    # without the rule only the output layer learns: clearly worse in the same steps
    zero_gradient = networks["quantised, round's gradient"]
    assert zero_gradient["test_accuracy"] < networks["quantised"]["test_accuracy"] - 0.05
    # the quantised activations take the 4 allowed values, and only those
    grid = (np.arange(4, dtype=np.float32) / np.float32(3)).tolist()
    assert results["allowed_activations"] == grid and results["quantised_on_grid"]
    for name in ("quantised", "quantised, round's gradient"):
        values = networks[name]["activation_values"]
        assert set(values) <= set(grid) and len(values) >= 3
    assert networks["unquantised"]["distinct_activations"] > 1000
    assert networks["unquantised"]["activation_values"] is None  # too many to list

    out = capsys.readouterr().out
    assert "Results on digits (scikit-learn)" in out
    assert "the quantised networks' activations all lie on the 4 levels" in out
    saved = check_saved(results, tmp_path, out)
    assert saved["networks"]["quantised"]["test_accuracy"] == pytest.approx(
        networks["quantised"]["test_accuracy"]
    )
    last = out.strip().splitlines()[-1]
    quantised = networks["quantised"]["test_accuracy"]
    unquantised = networks["unquantised"]["test_accuracy"]
    assert last.startswith(
        f"test accuracy with activations quantised to 4 levels (straight-through): "
        f"{quantised:.4f}, unquantised: {unquantised:.4f}"
    )


def test_example_bad_arguments(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"error: no data folder at .*--data-dir"):
        run_example("straight_through.py", ["--data-dir", str(tmp_path / "missing")], monkeypatch)
    with pytest.raises(SystemExit):
        run_example("straight_through.py", ["--digits", "--levels", "1"], monkeypatch)
    with pytest.raises(SystemExit, match=r"error: 1,438 training images make no full batch"):
        argv = ["--digits", "--batch-size", "5000", "--out", str(tmp_path)]
        run_example("straight_through.py", argv, monkeypatch)
