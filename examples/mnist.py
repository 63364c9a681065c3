"""The seed's MNIST program: a small ConvNet, SGD with momentum, on any MNIST-format data.

By default it trains on Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(/usr/share/datasets/fashion-mnist), and otherwise on scikit-learn's bundled 8x8 digits, so it
runs anywhere without downloading anything.

    python examples/mnist.py                          # the default data, 10 epochs
    python examples/mnist.py --data-dir path/to/mnist # MNIST, KMNIST, ... (IDX files)
    python examples/mnist.py --epochs 2 --limit 10000 # a quick run
    python examples/mnist.py --digits                 # the bundled digits
"""

from __future__ import annotations

import argparse
import time

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
    for batch in mx.data.batches(data, batch_size, drop_remainder=False):
        meter.update(eval_step(params, state, batch), n=len(batch["image"]))
    return meter.compute()


def train(args) -> dict:
    """Trains and evaluates; returns the per-epoch history and the final test metrics."""
    if args.digits:
        data = mx.data.load_digits()
    elif args.data_dir:
        data = mx.data.load_idx_folder(args.data_dir)
    else:
        data = mx.data.load_default_images()
    train_data = {k: v[: args.limit] for k, v in data.train.items()} if args.limit else data.train
    image_shape = data.train["image"].shape[1:]
    print(
        f"data: {data.name}: {len(train_data['label']):,} training and "
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
    steps_per_epoch = len(train_data["label"]) // args.batch_size
    history = []
    for epoch in range(1, args.epochs + 1):
        meter = mx.utils.AverageMeter()
        start = time.perf_counter()
        bar = tqdm(
            mx.data.batches(train_data, args.batch_size, rng=shuffle),
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
    return {
        "data": data.name,
        "history": history,
        "test": history[-1] if history else None,
        "steps_per_epoch": steps_per_epoch,
    }


def print_results(results: dict) -> None:
    history = results["history"]
    print(f"\nResults on {results['data']}")
    print("epoch  train loss  train acc  test loss  test acc  seconds")
    for row in history:
        print(
            f"{row['epoch']:5d}  {row['train_loss']:10.4f}  {row['train_accuracy']:9.4f}  "
            f"{row['test_loss']:9.4f}  {row['test_accuracy']:8.4f}  {row['seconds']:7.1f}"
        )
    epoch_seconds = [row["seconds"] for row in history[1:]] or [history[0]["seconds"]]
    best = max(history, key=lambda row: row["test_accuracy"])
    print(
        f"final test accuracy {history[-1]['test_accuracy']:.4f} (best "
        f"{best['test_accuracy']:.4f} at epoch {best['epoch']}); "
        f"{np.median(epoch_seconds):.1f} s per epoch, "
        f"{1000 * np.median(epoch_seconds) / results['steps_per_epoch']:.2f} ms per step "
        f"(median over epochs after the first, which compiles)"
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        help="an MNIST-format folder (default: Fashion-MNIST "
        "if installed, else scikit-learn's digits)",
    )
    parser.add_argument(
        "--digits",
        action="store_true",
        help="train on scikit-learn's 8x8 digits even if Fashion-MNIST is there",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--limit", type=int, help="train on the first N images only")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        results = train(args)
    except (FileNotFoundError, mx.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    return results


if __name__ == "__main__":
    main()
