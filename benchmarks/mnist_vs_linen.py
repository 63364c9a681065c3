"""The seed's ConvNet trained by lamina and by Flax Linen on the same batches, in one run.

Both start from the same weights (lamina's `init`, loaded into Linen unchanged: the layouts
are the same), see the same batches in the same order, and use the same optimiser; only the
dropout masks differ (each library draws its own). Epochs alternate between the two, and so
does which of the two goes first, so drift in the machine's speed hits both alike. The two
compiled training steps are the same XLA program (the same fusions and convolutions; only the
constants that derive the dropout key differ). Prints test accuracy and time per step.

    python benchmarks/mnist_vs_linen.py                 # default data (Fashion-MNIST/digits)
    python benchmarks/mnist_vs_linen.py --epochs 2 --limit 20000
    python benchmarks/mnist_vs_linen.py --data-dir path/to/mnist
    python benchmarks/mnist_vs_linen.py --digits --epochs 2      # a quick run
    python benchmarks/mnist_vs_linen.py --hlo      # compare the two compiled steps, op by op

The default data is Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed (`sudo
apt-get install dataset-fashion-mnist` puts it in /usr/share/datasets/fashion-mnist), else
scikit-learn's bundled 8x8 digits.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.random as jr
import numpy as np
import optax

import lamina as lm

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import _common
from mnist import ConvNet, make_steps


class LinenConvNet(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, is_training):
        x = nn.relu(nn.Conv(32, (3, 3), padding="SAME", name="conv1")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(64, (3, 3), padding="SAME", name="conv2")(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(0.5, deterministic=not is_training)(x)
        x = nn.relu(nn.Dense(128, name="fc1")(x))
        return nn.Dense(self.num_classes, name="fc2")(x)


def linen_steps(model, optimizer):
    def loss_and_metrics(params, rng, batch):
        logits = model.apply({"params": params}, batch["image"], True, rngs={"dropout": rng})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).mean()}

    @jax.jit
    def train_step(rng, params, state, opt_state, batch):
        (_, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(params, rng, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, metrics

    @jax.jit
    def eval_step(params, state, batch):
        logits = model.apply({"params": params}, batch["image"], False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).mean()}

    return train_step, eval_step


def compiled_ops(image_shape, num_classes, batch_size):
    """Each library's compiled training step as a count of XLA ops by kind.

    The two counts differ only where the programs do: with dropout on, in the constants and
    the one add that derive each library's dropout key.
    """
    init, apply = lm.transform(ConvNet(image_shape[:2], image_shape[2], num_classes))
    params = init(jr.PRNGKey(0))["params"]
    optimizer = optax.sgd(0.01, momentum=0.9)
    batch = {
        "image": np.zeros((batch_size, *image_shape), np.float32),
        "label": np.zeros((batch_size,), np.int32),
    }
    counts = {}
    for name, (train_step, _) in {
        "lamina": make_steps(apply, optimizer),
        "Flax Linen": linen_steps(LinenConvNet(num_classes), optimizer),
    }.items():
        compiled = train_step.lower(jr.PRNGKey(1), params, {}, optimizer.init(params), batch)
        text = compiled.compile().as_text()
        counts[name] = collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))
    return counts


def print_ops(counts):
    """The op counts side by side, the kinds that differ marked."""
    names = list(counts)
    kinds = sorted(set().union(*counts.values()), key=lambda k: -counts[names[0]][k])
    print(f"{'op':24s}" + "".join(f"{n:>12s}" for n in names))
    for kind in kinds:
        values = [counts[n][kind] for n in names]
        mark = "   <- differs" if len(set(values)) > 1 else ""
        print(f"{kind:24s}" + "".join(f"{v:12d}" for v in values) + mark)


def run_epoch(train_step, carry, batches, rng):
    params, state, opt_state = carry
    start = time.perf_counter()
    for batch in batches:
        rng, key = jr.split(rng)
        params, state, opt_state, _ = train_step(key, params, state, opt_state, batch)
    jax.block_until_ready(params)
    return (params, state, opt_state), (time.perf_counter() - start) / len(batches), rng


def evaluate(eval_step, params, state, data, batch_size):
    meter = lm.utils.AverageMeter()
    for batch in lm.data.batches(data, batch_size):
        meter.update(eval_step(params, state, batch), n=len(batch["label"]))
    return meter.compute()


def race(train, num_classes, epochs, batch_size, report=print):
    """Trains lamina's and Linen's ConvNet on the same batches, epochs alternating.

    Returns:
        (steps, carries, step_times): each library's (train_step, eval_step), its final
        (params, state, opt_state) and its seconds per step, one figure per epoch.
    """
    shape = train["image"].shape[1:]
    net = ConvNet(shape[:2], shape[2], num_classes)
    init, apply = lm.transform(net)
    variables = init(jr.PRNGKey(0))
    optimizer = optax.sgd(0.01, momentum=0.9)
    steps = {
        "lamina": make_steps(apply, optimizer),
        "Flax Linen": linen_steps(LinenConvNet(num_classes), optimizer),
    }
    params = variables["params"]
    carries = {name: (params, {}, optimizer.init(params)) for name in steps}
    rngs = {name: jr.PRNGKey(1) for name in steps}
    step_times = {name: [] for name in steps}
    order = np.random.default_rng(0)
    for epoch in range(epochs):
        batches = list(lm.data.batches(train, batch_size, rng=order, drop_last=True))
        # Who goes first alternates by epoch: whatever the first of a pair pays (a colder
        # cache, the batches' first touch) falls on each library alike.
        names = list(steps) if epoch % 2 == 0 else list(steps)[::-1]
        for name in names:
            train_step = steps[name][0]
            carries[name], per_step, rngs[name] = run_epoch(
                train_step, carries[name], batches, rngs[name]
            )
            step_times[name].append(per_step)
        report(
            f"epoch {epoch + 1}: "
            + ", ".join(f"{name} {1000 * step_times[name][-1]:.2f} ms/step" for name in steps)
        )
    return steps, carries, step_times


SIZES = {  # mode -> (images per epoch or None for all, epochs, batch size, digits)
    "smoke": (128, 2, 32, True),
    "quick": (3200, 3, 64, False),
    "full": (None, 3, 64, False),
}


def collect(mode: str = "quick") -> list:
    """run.py's row: seconds per epoch of the example's ConvNet, lamina against Linen.

    Fashion-MNIST when installed (else the 8x8 digits; the row says which); the epoch
    figure is steps per epoch times the median step time over the epochs after the first
    (which compiles). --quick trains on the first 3,200 images and scales the time up to
    a full epoch (the extra field holds the measured figure too).
    """
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _harness import Row

    limit, epochs, batch_size, digits = SIZES[mode]
    if digits or not lm.data.FASHION_MNIST_DIR.is_dir():
        data = lm.data.load_digits()
    else:
        data = lm.data.load_idx_folder(lm.data.FASHION_MNIST_DIR, "Fashion-MNIST")
    full_steps = len(data.train["label"]) // batch_size
    train = {k: v[:limit] for k, v in data.train.items()} if limit else data.train
    _, _, step_times = race(train, data.num_classes, epochs, batch_size, report=lambda _: None)
    columns = {"lamina": "lamina", "linen": "Flax Linen"}
    values, spread = {}, {}
    for column, name in columns.items():
        later = step_times[name][1:] or step_times[name]
        values[column] = full_steps * statistics.median(later)
        spread[column] = (full_steps * min(later), full_steps * max(later))
    notes = {
        c: "the example exists in lamina and Linen only (every peer's CNN step: the CNN row)"
        for c in ("jax", "nnx", "haiku", "equinox")
    }
    used = f"first {limit:,} images, scaled to" if limit else "all"
    return [
        Row(
            "mnist_epoch",
            f"examples/mnist.py, s per epoch ({data.name}, {used} {full_steps:,} steps of "
            f"{batch_size}, dropout on)",
            "s",
            values,
            spread,
            notes=notes,
            base="linen",
            extra={"data": data.name, "s_per_step": step_times, "steps_per_epoch": full_steps},
        )
    ]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _common.add_data_arguments(parser)  # --data-dir, --digits
    parser.add_argument(
        "--epochs",
        type=int,
        default=3,
        help="epochs per library, alternating; ms/step is the median over the epochs after "
        "the first, which compiles (default: %(default)s)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="train on the first N training images only (default: all); the test set stays whole",
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="examples per step (default: %(default)s)"
    )
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="print both compiled training steps' XLA op counts instead of training",
    )
    args = parser.parse_args()
    for name in ("epochs", "limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    try:
        data = _common.load_data(args)  # says which data it found
    except (FileNotFoundError, lm.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    if args.hlo:
        shape = data.train["image"].shape[1:]
        print(f"{data.name} images {shape}, batch {args.batch_size}; compiled training steps:")
        print_ops(compiled_ops(shape, data.num_classes, args.batch_size))
        return
    train = {k: v[: args.limit] for k, v in data.train.items()} if args.limit else data.train
    print(
        f"{data.name}: {len(train['label']):,} training images, batch {args.batch_size}, "
        f"{args.epochs} epochs; jax {jax.__version__} on {jax.default_backend()}"
    )
    steps, carries, step_times = race(train, data.num_classes, args.epochs, args.batch_size)
    print(f"\n{'':12s} {'test acc':>9s} {'test loss':>10s} {'ms/step':>8s} {'x Linen':>8s}")
    measured = {name: statistics.median(t[1:] or t) for name, t in step_times.items()}
    for name, (_, eval_step) in steps.items():
        params, state, _ = carries[name]
        result = evaluate(eval_step, params, state, data.test, 256)
        print(
            f"{name:12s} {result['accuracy']:9.4f} {result['loss']:10.4f} "
            f"{1000 * measured[name]:8.2f} {measured[name] / measured['Flax Linen']:8.3f}"
        )
    if args.epochs > 1:
        print("(ms/step: median over the epochs after the first, which includes compilation)")
    else:
        print("(ms/step: one epoch, including compilation; run --epochs 2 or more to leave it out)")


if __name__ == "__main__":
    main()
