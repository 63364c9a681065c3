"""Straight-through estimation: a network whose hidden activations take 4 values, trained by SGD.

Every hidden activation of the network is ``clip(x, 0, 1)`` rounded to a few evenly spaced
levels (4 by default: 0, 1/3, 2/3, 1; 2 bits), in training as in testing. Rounding has a zero
gradient almost everywhere, so the network would not learn through it; the straight-through
estimator (Bengio et al., 2013; Hubara et al., 2016) passes the gradient through the rounding as
if it were not there, and through the clip as usual. That is a gradient rule written together
with its forward pass, Flux's ``@grad``, which `lm.grad_rule` gives to JAX:

    @lm.grad_rule
    def quantize(x, *, levels):
        inside = (x >= 0) & (x <= 1)
        return round_to_levels(x, levels), lambda g: (jnp.where(inside, g, 0),)

Three copies of the same MLP are trained the same way (same initial weights, same batches):
unquantised (activations ``clip(x, 0, 1)``), quantised with the straight-through rule, and
quantised with plain ``jnp.round`` (whose gradient is zero: only the output layer learns). It
reports their test accuracy and checks that the quantised networks' activations really take
only the allowed values.

By default it trains on Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(/usr/share/datasets/fashion-mnist), and otherwise on scikit-learn's bundled 8x8 digits; it says
which. It saves the per-epoch metrics (metrics.json) and the loss and accuracy curves
(curves.png) in runs/straight_through-<date>-<time>/, or in the folder --out names. The last
line it prints is the quantised network's test accuracy against the unquantised one's.

    python examples/straight_through.py                 # the default data, 10 epochs
    python examples/straight_through.py --digits        # the bundled digits
    python examples/straight_through.py --levels 2      # binary activations
    python examples/straight_through.py --data-dir path/to/mnist
"""

from __future__ import annotations

import argparse
import itertools
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import lamina as lm

# --- the gradient rule ------------------------------------------------------------------


def round_to_levels(x, levels):
    """``clip(x, 0, 1)`` rounded to `levels` evenly spaced values: 0, 1/(levels-1), ..., 1."""
    return jnp.round(jnp.clip(x, 0.0, 1.0) * (levels - 1)) / (levels - 1)


@lm.grad_rule
def quantize(x, *, levels):
    """`round_to_levels`, with the straight-through gradient: 1 inside [0, 1], 0 outside.

    The forward pass rounds; the pullback treats the rounding as the identity and keeps the
    clip's own gradient, so a unit saturated beyond 0 or 1 gets none (the "clipped" estimator).
    `levels` is a keyword argument: a setting, not differentiated.
    """
    inside = (x >= 0.0) & (x <= 1.0)

    def pullback(g):
        return (jnp.where(inside, g, jnp.zeros_like(g)),)

    return round_to_levels(x, levels), pullback


# --- the network ------------------------------------------------------------------------

NETWORKS = {  # name: (levels or None, straight-through)
    "unquantised": (None, False),
    "quantised": (True, True),
    "quantised, round's gradient": (True, False),
}


class Mlp(lm.Module):
    """An MLP whose hidden activations are ``clip(x, 0, 1)``, optionally rounded to levels."""

    def __init__(self, in_features, num_classes, width, depth, levels=None, straight_through=True):
        super().__init__()
        sizes = [in_features] + [width] * depth
        self.layers = [lm.Dense(a, b) for a, b in itertools.pairwise(sizes)]
        self.head = lm.Dense(width, num_classes)
        self.levels = levels  # None: not quantised
        self.straight_through = straight_through

    def activation(self, x):
        if self.levels is None:
            return jnp.clip(x, 0.0, 1.0)
        if self.straight_through:
            return quantize(x, levels=self.levels)
        return round_to_levels(x, self.levels)  # plain JAX: rounding's gradient is zero

    def __call__(self, x, return_activations=False):
        x = x.reshape((x.shape[0], -1))  # flatten the images
        activations = []
        for layer in self.layers:
            x = self.activation(layer(x))
            activations.append(x)
        logits = self.head(x)
        return (logits, activations) if return_activations else logits


# --- training and evaluation ------------------------------------------------------------


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_steps(apply, optimizer):
    """The jitted train step, and a jitted prediction (logits and hidden activations)."""

    @jax.jit
    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits, _ = apply({"params": params}, None, batch["image"])
            loss = cross_entropy(logits, batch["label"])
            return loss, (logits.argmax(axis=-1) == batch["label"]).mean()

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, "accuracy": accuracy}
        return optax.apply_updates(params, updates), opt_state, metrics

    @jax.jit
    def predict(params, images):
        (logits, activations), _ = apply({"params": params}, None, images, True)
        return logits, activations

    return train_step, predict


def evaluate(predict, params, data, activation_values=False, batch_size=1000):
    """Test loss and accuracy, and (if asked) the distinct values the hidden activations took."""
    logits, values = [], set()
    for batch in lm.data.batches(data, batch_size):
        batch_logits, activations = predict(params, batch["image"])
        logits.append(np.asarray(batch_logits))
        if activation_values:
            for activation in activations:
                values.update(np.unique(np.asarray(activation)).tolist())
    logits = np.concatenate(logits)
    return {
        "loss": float(cross_entropy(logits, data["label"])),
        "accuracy": float((logits.argmax(axis=-1) == data["label"]).mean()),
        "activation_values": sorted(values),
    }


def train_network(name, model, data, args):
    """Trains one network for `args.epochs` epochs; returns its report."""
    init, apply = lm.transform(model)
    params = init(jax.random.key(args.seed))["params"]  # the same weights for every network
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)
    train_step, predict = make_steps(apply, optimizer)
    shuffle = np.random.default_rng(args.seed)  # the same batches for every network
    steps_per_epoch = len(data.train["label"]) // args.batch_size
    history = []
    for epoch in range(1, args.epochs + 1):
        meter = lm.utils.AverageMeter()
        start = time.perf_counter()
        bar = tqdm(
            lm.data.batches(data.train, args.batch_size, rng=shuffle, drop_last=True),
            total=steps_per_epoch,
            desc=f"{name}, epoch {epoch}/{args.epochs}",
            unit="step",
            leave=False,
            disable=args.quiet,
        )
        for step, batch in enumerate(bar, 1):
            params, opt_state, metrics = train_step(params, opt_state, batch)
            meter.update(metrics, n=len(batch["label"]))
            if step % 100 == 0:
                bar.set_postfix({k: f"{v:.4f}" for k, v in meter.compute().items()})
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
        trained = meter.compute()
        tested = evaluate(predict, params, data.test, activation_values=epoch == args.epochs)
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
            f"{name:>27}  epoch {epoch:2d}  train loss {trained['loss']:.4f} "
            f"accuracy {trained['accuracy']:.4f}  test loss {tested['loss']:.4f} "
            f"accuracy {tested['accuracy']:.4f}  ({seconds:.2f} s)"
        )
    values = tested["activation_values"]
    seconds = [row["seconds"] for row in history]
    return {
        "test_accuracy": tested["accuracy"],
        "test_loss": tested["loss"],
        "train_accuracy": trained["accuracy"],
        "distinct_activations": len(values),
        "activation_values": values if len(values) <= 16 else None,
        "seconds": float(sum(seconds)),
        # the first epoch compiles: the median of the others is the steady figure
        "seconds_per_epoch": float(np.median(seconds[1:] if len(seconds) > 1 else seconds)),
        "history": history,
    }


def run(args) -> dict:
    data = _common.load_data(args)
    image_shape = data.train["image"].shape[1:]
    train_size = len(data.train["label"])
    if train_size < args.batch_size:
        raise SystemExit(
            f"error: {train_size:,} training images make no full batch of {args.batch_size} "
            f"(--batch-size); lower --batch-size."
        )
    print(
        f"{data.name}: {train_size:,} training and {len(data.test['label']):,} test images of "
        f"shape {image_shape}; an MLP of {args.depth} hidden layers of {args.width}, hidden "
        f"activations clip(x, 0, 1), quantised to {args.levels} levels or not"
    )
    in_features = int(np.prod(image_shape))
    reports = {}
    for name, (quantised, straight_through) in NETWORKS.items():
        levels = args.levels if quantised else None
        model = Mlp(in_features, data.num_classes, args.width, args.depth, levels, straight_through)
        reports[name] = train_network(name, model, data, args)
    grid = (np.arange(args.levels, dtype=np.float32) / np.float32(args.levels - 1)).tolist()
    return {
        "data": data.name,
        "train_size": train_size,
        "test_size": len(data.test["label"]),
        "levels": args.levels,
        "allowed_activations": grid,
        "networks": reports,
        "quantised_on_grid": all(
            set(reports[name]["activation_values"] or [None]) <= set(grid)
            for name in NETWORKS
            if NETWORKS[name][0]
        ),
    }


def print_results(results: dict) -> None:
    networks = results["networks"]
    print(
        f"\nResults on {results['data']}: test accuracy on {results['test_size']:,} images; "
        f"distinct values of the hidden activations on them (allowed when quantised: "
        f"{', '.join(f'{v:.3g}' for v in results['allowed_activations'])})"
    )
    print("network                      test acc  test loss  train acc  activation values  s/epoch")
    for name, row in networks.items():
        print(
            f"{name:<27}  {row['test_accuracy']:8.4f}  {row['test_loss']:9.4f}  "
            f"{row['train_accuracy']:9.4f}  {row['distinct_activations']:17,}  "
            f"{row['seconds_per_epoch']:7.2f}"
        )
    print(
        f"the quantised networks' activations "
        f"{'all lie on' if results['quantised_on_grid'] else 'do NOT all lie on'} the "
        f"{results['levels']} levels. (s/epoch: the median over the epochs after the first, "
        f"which compiles.)"
    )


def save(results: dict, args) -> dict:
    """Saves the metrics and each network's loss and accuracy curves."""

    def line(report, key):
        history = report["history"]
        return [row["epoch"] for row in history], [row[key] for row in history]

    networks = results["networks"]
    panels = {
        "training loss": {name: line(row, "train_loss") for name, row in networks.items()},
        "test accuracy": {name: line(row, "test_accuracy") for name, row in networks.items()},
    }
    folder = _common.run_folder(args, "straight_through")
    return _common.save_run(folder, results, args, panels, "epoch")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _common.add_data_arguments(parser)
    parser.add_argument(
        "--levels",
        type=int,
        default=4,
        help="values a quantised activation may take, evenly spaced in [0, 1] (default: "
        "%(default)s, 2 bits)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="passes over the training images, per network (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--learning-rate", type=float, default=1e-3, help="Adam's (default: %(default)s)"
    )
    parser.add_argument(
        "--width", type=int, default=256, help="units per hidden layer (default: %(default)s)"
    )
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (default: %(default)s)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the initial weights and the shuffle, the same for every network "
        "(default: %(default)s)",
    )
    _common.add_output_argument(parser, "straight_through")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "width", "depth"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.levels < 2:
        parser.error("--levels must be at least 2 (0 and 1)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        results = run(args)
    except (FileNotFoundError, lm.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    results["files"] = save(results, args)
    networks = results["networks"]
    quantised, unquantised = networks["quantised"], networks["unquantised"]
    zero_gradient = networks["quantised, round's gradient"]
    gap = quantised["test_accuracy"] - unquantised["test_accuracy"]
    print(
        f"test accuracy with activations quantised to {results['levels']} levels "
        f"(straight-through): {quantised['test_accuracy']:.4f}, unquantised: "
        f"{unquantised['test_accuracy']:.4f} ({100 * gap:+.1f} points); with rounding's own "
        f"gradient: {zero_gradient['test_accuracy']:.4f}"
    )
    return results


if __name__ == "__main__":
    main()
