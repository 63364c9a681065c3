"""The seed's MNIST program: a small ConvNet, SGD with momentum, on any MNIST-format data.

By default it trains on Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(`sudo apt-get install dataset-fashion-mnist` puts it in /usr/share/datasets/fashion-mnist), and
otherwise on scikit-learn's bundled 8x8 digits, so it runs anywhere without downloading anything.
It says which data it found. It saves the per-epoch metrics (metrics.json) and the loss and
accuracy curves (curves.png) in runs/mnist-<date>-<time>/, or in the folder --out names. With
--export it also writes the trained network as files that run without lamina: mnist.stablehlo
(JAX and flatbuffers: jax.export.deserialize) and, with the onnx extra, mnist.onnx (ONNX
Runtime); metrics.json then records their paths and their differences from apply. Both take
float32 images [batch, height, width, 1] scaled to [0, 1] and return 10 logits per image.

    python examples/mnist.py                          # the default data, 10 epochs
    python examples/mnist.py --data-dir path/to/mnist # MNIST, KMNIST, ... (IDX files)
    python examples/mnist.py --epochs 2 --limit 10000 # a quick run
    python examples/mnist.py --digits                 # the bundled digits
    python examples/mnist.py --export                 # + the network as deployable files
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import _common
import jax
import jax.random as jr
import numpy as np
import optax
from tqdm import tqdm

import lamina as mx


class ConvNet(mx.Module):
    """The seed's CNN, sized for the input images (28x28 in the seed)."""

    def __init__(self, image_size=(28, 28), channels=1, num_classes=10):
        super().__init__()
        h, w = image_size
        self.conv1 = mx.Conv(channels, 32, kernel_size=(3, 3), strides=(1, 1), padding="SAME")
        self.conv2 = mx.Conv(32, 64, kernel_size=(3, 3), strides=(1, 1), padding="SAME")
        self.fc1 = mx.Dense((h // 4) * (w // 4) * 64, 128)
        self.fc2 = mx.Dense(128, num_classes)

    def __call__(self, x, is_training):
        x = self.conv1(x)  # (batch, height, width, channels)
        x = mx.relu(x)
        x = mx.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = self.conv2(x)
        x = mx.relu(x)
        x = mx.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = mx.dropout(x, rate=0.5, is_training=is_training)
        x = self.fc1(x)
        x = mx.relu(x)
        return self.fc2(x)


def make_steps(apply, optimizer):
    """The seed's jitted train and eval steps."""

    @jax.jit
    def train_step(rng, params, state, opt_state, batch):
        def loss_fn(params):
            variables = {"params": params, **state}
            logits, new_state = apply(variables, rng, batch["image"], is_training=True)
            new_state.pop("params")
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits=logits, labels=batch["label"]
            ).mean()
            accuracy = (logits.argmax(axis=-1) == batch["label"]).mean()
            return loss, (new_state, {"loss": loss, "accuracy": accuracy})

        (_, (new_state, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, new_opt_state, metrics

    @jax.jit
    def eval_step(params, state, batch):
        variables = {"params": params, **state}
        logits, _ = apply(variables, None, batch["image"], is_training=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]
        ).mean()
        accuracy = (logits.argmax(axis=-1) == batch["label"]).mean()
        return {"loss": loss, "accuracy": accuracy}

    return train_step, eval_step


def evaluate(eval_step, params, state, data, batch_size):
    meter = mx.utils.AverageMeter()
    for batch in mx.data.batches(data, batch_size):
        meter.update(eval_step(params, state, batch), n=len(batch["image"]))
    return meter.compute()


def train(args) -> tuple[dict, dict]:
    """Trains and evaluates.

    Returns:
        The per-epoch history and the final test metrics; and the trained network: ``{"model":
        net, "variables": variables, "test_images": the test set's images}``.
    """
    data = _common.load_data(args)
    available = len(data.train["label"])
    train_data = data.train
    if args.limit is not None:
        if args.limit < available:
            train_data = {k: v[: args.limit] for k, v in data.train.items()}
        else:
            print(
                f"--limit {args.limit:,}: {data.name} has only {available:,} training images; "
                f"training on all of them"
            )
    train_size = len(train_data["label"])
    if train_size < args.batch_size:
        raise SystemExit(
            f"error: {train_size:,} training images make no full batch of {args.batch_size} "
            f"(--batch-size); lower --batch-size or raise --limit."
        )
    image_shape = data.train["image"].shape[1:]
    print(
        f"{data.name}: {train_size:,} of {available:,} training images, "
        f"{len(data.test['label']):,} test images of shape {image_shape}"
    )

    net = ConvNet(image_shape[:2], image_shape[2], data.num_classes)
    print(mx.summary(net))
    init, apply = mx.transform(net)
    rng = jr.PRNGKey(args.seed)
    rng, init_rng = jr.split(rng)
    state = init(init_rng)
    params = state.pop("params")
    optimizer = optax.sgd(learning_rate=args.learning_rate, momentum=args.momentum)
    opt_state = optimizer.init(params)
    train_step, eval_step = make_steps(apply, optimizer)

    shuffle = np.random.default_rng(args.seed)
    steps_per_epoch = train_size // args.batch_size  # full batches: one compiled step
    history = []
    for epoch in range(1, args.epochs + 1):
        meter = mx.utils.AverageMeter()
        start = time.perf_counter()
        bar = tqdm(
            mx.data.batches(train_data, args.batch_size, rng=shuffle, drop_last=True),
            total=steps_per_epoch,
            desc=f"epoch {epoch}/{args.epochs}",
            unit="step",
            leave=False,
            disable=args.quiet,
        )
        for step, batch in enumerate(bar, 1):
            rng, rng_apply = jr.split(rng)
            params, state, opt_state, metrics = train_step(
                rng_apply, params, state, opt_state, batch
            )
            meter.update(metrics, n=len(batch["image"]))
            if step % 100 == 0:
                bar.set_postfix({k: f"{v:.4f}" for k, v in meter.compute().items()})
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        trained = meter.compute()
        tested = evaluate(eval_step, params, state, data.test, args.batch_size)
        history.append(
            {
                "epoch": epoch,
                "train_loss": trained["loss"],
                "train_accuracy": trained["accuracy"],
                "test_loss": tested["loss"],
                "test_accuracy": tested["accuracy"],
                "seconds": seconds,
            }
        )
        print(
            f"epoch {epoch:2d}  train loss {trained['loss']:.4f} "
            f"accuracy {trained['accuracy']:.4f}  test loss {tested['loss']:.4f} "
            f"accuracy {tested['accuracy']:.4f}  ({seconds:.1f} s)"
        )
    results = {
        "data": data.name,
        "train_size": train_size,
        "test_size": len(data.test["label"]),
        "history": history,
        "test": history[-1] if history else None,
        "steps_per_epoch": steps_per_epoch,
    }
    trained = {
        "model": net,
        "variables": {"params": params, **state},
        "test_images": data.test["image"],
    }
    return results, trained


def print_results(results: dict) -> None:
    history = results["history"]
    print(f"\nResults on {results['data']}")
    print("epoch  train loss  train acc  test loss  test acc  seconds")
    for row in history:
        print(
            f"{row['epoch']:5d}  {row['train_loss']:10.4f}  {row['train_accuracy']:9.4f}  "
            f"{row['test_loss']:9.4f}  {row['test_accuracy']:8.4f}  {row['seconds']:7.1f}"
        )
    if len(history) > 1:
        seconds = float(np.median([row["seconds"] for row in history[1:]]))
        timing = "median over the epochs after the first, which compiles"
    else:
        seconds = history[0]["seconds"]
        timing = "one epoch, including the compilation; run 2 or more for a steady figure"
    best = max(history, key=lambda row: row["test_accuracy"])
    print(
        f"final test accuracy {history[-1]['test_accuracy']:.4f} (best "
        f"{best['test_accuracy']:.4f} at epoch {best['epoch']}); {seconds:.1f} s per epoch, "
        f"{1000 * seconds / results['steps_per_epoch']:.2f} ms per step ({timing})"
    )


def save(results: dict, args, folder: Path) -> dict:
    """Saves the metrics and the loss/accuracy curves in the run's folder."""
    epochs = [row["epoch"] for row in results["history"]]

    def line(key):
        return epochs, [row[key] for row in results["history"]]

    panels = {
        "loss": {"train": line("train_loss"), "test": line("test_loss")},
        "accuracy": {"train": line("train_accuracy"), "test": line("test_accuracy")},
    }
    return _common.save_run(folder, results, args, panels, "epoch")


def export(trained: dict, folder: Path) -> dict:
    """Writes the trained network as files that run without lamina, and checks them.

    ``mnist.stablehlo`` (``lm.export`` with ``batch_dims="b"``: any batch size, loaded by JAX
    and flatbuffers, no lamina) and, when the onnx extra is installed, ``mnist.onnx``
    (``lm.export_onnx``: ONNX Runtime). Each file is loaded back and run on 8 test images;
    the largest difference from ``apply`` is printed.

    Returns:
        ``{"stablehlo": path, "onnx": path or None, "max_diff": {format: float}}``.
    """
    model, variables = trained["model"], trained["variables"]
    images = np.asarray(trained["test_images"][:8], np.float32)
    expected, _ = mx.apply(model)(variables, None, images, False)
    folder.mkdir(parents=True, exist_ok=True)
    # is_training=False is a Python value: fixed in the file, whose one input is the images
    paths = {"stablehlo": folder / "mnist.stablehlo", "onnx": None}
    mx.export(model, variables, images, False, batch_dims="b", path=paths["stablehlo"])
    with open(paths["stablehlo"], "rb") as file:  # what a server with JAX + flatbuffers does
        loaded = jax.export.deserialize(bytearray(file.read()))
    max_diff = {"stablehlo": float(np.max(np.abs(loaded.call(images) - expected)))}
    if any(importlib.util.find_spec(name) is None for name in ("jax2onnx", "onnxruntime")):
        print(
            "skipped ONNX: it needs the onnx extra: pip install 'lamina[onnx]', or in a lamina "
            "checkout pip install -c constraints.txt -e '.[onnx]'"
        )
    else:
        import onnxruntime as ort

        paths["onnx"] = folder / "mnist.onnx"
        mx.export_onnx(model, variables, images, False, batch_dims="b", path=paths["onnx"])
        session = ort.InferenceSession(str(paths["onnx"]), providers=["CPUExecutionProvider"])
        (logits,) = session.run(None, {"x": images})
        max_diff["onnx"] = float(np.max(np.abs(logits - expected)))
    for name, path in paths.items():
        if path is not None:
            print(f"exported {name}: {path}")
    checks = ", ".join(f"{name} {diff:.1e}" for name, diff in max_diff.items())
    print(f"max |difference| from apply on {len(images)} test images: {checks}")
    return {**paths, "max_diff": max_diff}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _common.add_data_arguments(parser)
    parser.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="passes over the training images (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--learning-rate", type=float, default=0.01, help="SGD's (default: %(default)s)"
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's (default: %(default)s)")
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="seeds the initial weights, the dropout masks and the shuffle (default: %(default)s)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="train on the first N training images only (any data set; all of them when it "
        "has fewer); the test set stays whole",
    )
    _common.add_output_argument(parser, "mnist")
    parser.add_argument(
        "--export",
        nargs="?",
        const="",
        metavar="DIR",
        help="after training, write the network to DIR (default: the run's folder) as "
        "mnist.stablehlo (runs with JAX and flatbuffers: pip install jax flatbuffers) and "
        "mnist.onnx (ONNX Runtime; needs the onnx extra: pip install 'lamina[onnx]', or "
        "pip install -c constraints.txt -e '.[onnx]' in a checkout), and check both against "
        "apply",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.export is not None:  # before training: a bad folder would only show after it
        problem = export_folder_problem(Path(args.export or args.out or "runs"))
        if problem:
            parser.error(f"argument --export: {problem}")
    return args


def export_folder_problem(folder: Path) -> str | None:
    """Why the files of `export` cannot be written in `folder` (created if missing), or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder: give a folder to write mnist.stablehlo in"
    for name in ("mnist.stablehlo", "mnist.onnx"):
        if (folder / name).is_dir():
            return f"{folder / name} is a folder: remove it, or give another --export folder"
    existing = folder
    while not existing.exists():  # the nearest folder that exists: the others are created in it
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so the folder {folder} cannot be created in it"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder {existing} is not writable: give a folder you can write in"
    return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        results, trained = train(args)
    except (FileNotFoundError, mx.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    folder = _common.run_folder(args, "mnist")
    if args.export is not None:  # before saving: metrics.json records the files
        results["exported"] = export(trained, Path(args.export) if args.export else folder)
    results["files"] = save(results, args, folder)
    results["trained"] = trained  # not in metrics.json: for a caller (the tests) to use
    return results


if __name__ == "__main__":
    main()
