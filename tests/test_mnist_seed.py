"""The Metoryx article's MNIST program, unchanged but for `import lamina as mx`, on real data.

It reads MNIST through TensorFlow Datasets; `tests/tf_shim.py` serves the same pipeline from
an MNIST-format folder (Fashion-MNIST from Debian's dataset-fashion-mnist). The program is
hard-wired to 60,000 training images and 10 epochs, so it needs a full-size set.
"""

import re
import sys

import pytest

import lamina as lm
from tests import tf_shim
from tests.seed_004_samples import SAMPLES

FOLDER = lm.data.FASHION_MNIST_DIR


@pytest.mark.full
@pytest.mark.skipif(
    not FOLDER.is_dir(),
    reason="needs Debian's dataset-fashion-mnist (60,000 MNIST-format images); .ci/run installs it",
)
def test_seed_mnist_program_trains(monkeypatch, capsys):
    tf, tfds = tf_shim.modules(FOLDER)
    monkeypatch.setitem(sys.modules, "tensorflow", tf)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", tfds)
    code = dict(SAMPLES)["mnist"].replace("import metoryx as mx", "import lamina as mx")
    exec(compile(code, "<seed 004: mnist>", "exec"), {"__name__": "seed_mnist"})
    lines = capsys.readouterr().out.strip().splitlines()
    epochs = [eval(line) for line in lines[:-1]]
    test = eval(lines[-1].removeprefix("Test: "))
    assert len(epochs) == 10 and set(epochs[0]) == {"loss", "accuracy"}
    # "the loss decreases and the accuracy rises as training goes on"
    assert epochs[-1]["loss"] < epochs[0]["loss"] and epochs[-1]["accuracy"] > epochs[0]["accuracy"]
    assert test["accuracy"] > 0.88, test  # Fashion-MNIST: small CNNs reach about 0.91-0.93
    assert re.fullmatch(r"Test: \{'accuracy': [0-9.]+, 'loss': [0-9.]+\}", lines[-1])
