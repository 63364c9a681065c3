"""examples/saliency.py end to end on the digits, its gradients checked against independent ones."""

import contextlib
import io
import json
import pathlib
import re
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LAYERS = {"input": "8x8x1", "conv1": "4x4x32", "conv2": "2x2x64", "fc1": "128"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The example, run once with a tiny configuration, as tests/test_examples.py runs the
    examples: as a script's namespace, under JAX's default ("standard") dtype promotion.

    Returns ``(namespace, results, printed, out folder)``."""
    out = tmp_path_factory.mktemp("saliency")
    argv = ["--digits", "--epochs", "2", "--limit", "512", "--images", "3", "--quiet"]
    argv += ["--out", str(out)]
    patch = pytest.MonkeyPatch()
    patch.setattr(sys, "argv", ["saliency.py", *argv])
    patch.syspath_prepend(str(EXAMPLES))
    printed = io.StringIO()
    try:
        namespace = runpy.run_path(str(EXAMPLES / "saliency.py"), run_name="example")
        with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(printed):
            results = namespace["main"](argv)
    finally:
        patch.undo()
    return namespace, results, printed.getvalue(), out


@pytest.fixture(scope="module")
def probed(run):
    """The trained variables, the probed images and labels, and the example's Probe."""
    _, results, _, _ = run
    test = lm.data.load_digits().test
    indices = results["indices"]
    images, labels = jnp.asarray(test["image"][indices]), np.asarray(test["label"][indices])
    return {"params": results["params"]}, images, labels, results["probe"]


def assert_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=2e-5, atol=2e-6)


def test_the_run_saves_the_grid_and_prints_every_layer(run):
    _, results, printed, out = run
    grid = results["files"]["saliency"]
    assert grid == out / "saliency.png"
    with open(grid, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    assert grid.stat().st_size > 20_000  # 3 rows of 5 drawn panels, not an empty figure
    assert results["files"]["metrics"] == out / "metrics.json"
    assert results["files"]["curves"].is_file()
    assert "layer   activation shape  grad L2 norm  mean |activation|" in printed
    for layer, shape in LAYERS.items():
        assert re.search(rf"^{layer}\s+{shape}\s+\S+\s+\S+$", printed, re.MULTILINE), layer
    saved = json.loads((out / "metrics.json").read_text())
    assert [row["layer"] for row in saved["layers"]] == list(LAYERS)
    assert all(row["grad_norm"] > 0 for row in saved["layers"])
    assert saved["steps"] == 2 * (512 // 64) and len(saved["images"]) == 3
    assert 0.1 < saved["test_accuracy"] <= 1  # 16 steps: anything above chance
    assert printed.splitlines()[-1] == (
        f"test accuracy {saved['test_accuracy']:.4f} after 16 steps on digits (scikit-learn); "
        f"the saliency grid of 3 test images is {grid}"
    )


def test_probed_convnet_gives_the_convnet_s_logits(run, probed):
    namespace, *_ = run
    _, results, _, _ = run
    variables, images, labels, result = probed
    assert [row["label"] for row in results["images"]] == labels.tolist()
    args = ((8, 8), 1, 10)
    plain = lm.transform(namespace["ConvNet"](*args)).apply
    tagged = lm.transform(namespace["ProbedConvNet"](*args)).apply
    logits, _ = plain(variables, None, images, is_training=False)
    np.testing.assert_array_equal(tagged(variables, None, images, is_training=False)[0], logits)
    assert_close(result.outputs, logits)
    assert sorted(result.gradients) == sorted(result.intermediates) == sorted(LAYERS)


def test_input_saliency_is_jax_grad_of_the_plain_convnet(run, probed):
    namespace, *_ = run
    variables, images, labels, result = probed
    apply = lm.transform(namespace["ConvNet"]((8, 8), 1, 10)).apply
    predicted = jnp.argmax(result.outputs, axis=-1)

    @jax.jit
    @jax.grad
    def saliency(x, classes):
        logits, _ = apply(variables, None, x, is_training=False)
        return jnp.sum(jnp.take_along_axis(logits, classes[:, None], axis=-1))

    assert_close(result.gradients["input"], saliency(images, predicted))
    assert_close(result.intermediates["input"][0], images)
    # --target true: the true class's logit.
    with jax.numpy_dtype_promotion("standard"):
        true = namespace["probe"](variables["params"], {}, np.asarray(images), 10, labels)
    assert_close(true.gradients["input"], saliency(images, jnp.asarray(labels)))


# --- the network by hand, split at each layer's output -------------------------------------


def block(params, x):
    """conv (SAME, 3x3), ReLU, 2x2 max pooling, with jax.lax."""
    y = jax.lax.conv_general_dilated(
        x, params["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = jax.nn.relu(y + params["bias"][None, None, None])
    return jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def layers(params):
    """The hand-written forward, one function per layer: input -> conv1 -> conv2 -> fc1."""
    fc1, fc2 = params["fc1"], params["fc2"]
    return {
        "conv1": lambda x: block(params["conv1"], x),
        "conv2": lambda h: block(params["conv2"], h),
        "fc1": lambda h: jax.nn.relu(h.reshape(len(h), -1) @ fc1["kernel"] + fc1["bias"][None]),
        "logits": lambda h: h @ fc2["kernel"] + fc2["bias"][None],
    }


@jax.jit
def hand_split(params, images, classes):
    """Each layer's output, and the gradient of the classes' logits with respect to it, from
    the hand-written forward cut at that layer (one compiled program)."""
    steps = layers(params)
    names = list(steps)
    outputs, gradients = {}, {}
    h = images
    for i, name in enumerate(names[:-1]):
        h = outputs[name] = steps[name](h)

        def rest(h, i=i):  # the forward from this layer's output on
            for later in names[i + 1 :]:
                h = steps[later](h)
            return jnp.sum(jnp.take_along_axis(h, classes[:, None], axis=-1))

        gradients[name] = jax.grad(rest)(h)
    return outputs, gradients


def test_layer_gradients_match_a_hand_split_forward(probed):
    variables, images, _, result = probed
    params = variables["params"]
    predicted = jnp.argmax(result.outputs, axis=-1)
    outputs, gradients = hand_split(params, images, predicted)
    for name in ("conv1", "conv2", "fc1"):
        assert_close(result.intermediates[name][0], outputs[name])
        assert_close(result.gradients[name], gradients[name])
    # fc1's output feeds fc2 alone: its gradient is fc2's kernel column for the class.
    assert_close(result.gradients["fc1"], params["fc2"]["kernel"].T[predicted])
