"""Input saliency and per-layer activation gradients of the MNIST example's ConvNet.

Trains the ConvNet of examples/mnist.py briefly (lamina has no checkpoints yet: by default
1 epoch on the first 12,800 training images, or as many epochs as make 200 steps on a small
set such as the digits), then, for a few test images, takes the gradient of each image's
predicted-class logit (--target true: its true class) with respect to the input image (the
saliency) and to the output of each layer (conv1 and conv2 after their ReLU and pooling,
fc1 after its ReLU), all in one jitted call of `lm.probe`. The network it probes is
`ProbedConvNet`: the ConvNet with `lm.perturb` and `lm.sow` at each layer's output, and the
same parameters, so the trained ConvNet's parameters go into it unchanged.

It prints a table of the per-layer gradient norms and saves one PNG grid (a row per image:
the image, its saliency, and a map per layer) as saliency.png beside the run's metrics.json
and training curves (curves.png), in runs/saliency-<date>-<time>/ or the folder --out names.

By default it uses Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(/usr/share/datasets/fashion-mnist), and otherwise scikit-learn's bundled 8x8 digits; it says
which.

    python examples/saliency.py                      # the default data, 6 test images
    python examples/saliency.py --digits --images 4  # the bundled digits
    python examples/saliency.py --target true        # gradients of the true class's logit
    python examples/saliency.py --data-dir path/to/mnist --epochs 2 --limit 60000
"""

from __future__ import annotations

import argparse
import math
import time

import _common
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from mnist import ConvNet, evaluate, make_steps
from tqdm import tqdm

import lamina as lm

DEFAULT_LIMIT = 12_800  # training images when --limit is not given
MIN_STEPS = 200  # without --epochs: as many epochs as make at least this many steps
EVAL_BATCH = 500
LAYERS = ("input", "conv1", "conv2", "fc1")  # the perturbation and record names, in order
FASHION_CLASSES = (
    "T-shirt",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def tag(name: str, x: jax.Array) -> jax.Array:
    """Marks `x` as a layer's output: a perturbation point (its gradient) and a record (its
    value). Both do nothing unless the caller asks (`lm.probe` does)."""
    x = lm.perturb(name, x)
    lm.sow(name, x)
    return x


class ProbedConvNet(ConvNet):
    """mnist.py's ConvNet with each layer's output tagged; the same modules and parameters.

    The forward pass is ConvNet's, line for line, with `tag` at the input and after each
    layer as the next layer receives it: conv1 and conv2 after ReLU and max pooling, fc1
    after its ReLU. Under a plain `apply` the tags do nothing and the logits are ConvNet's.
    """

    def __call__(self, x, is_training):
        x = tag("input", x)
        x = self.conv1(x)
        x = lm.relu(x)
        x = lm.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = tag("conv1", x)
        x = self.conv2(x)
        x = lm.relu(x)
        x = lm.max_pool(x, kernel_size=(2, 2), strides=(2, 2))
        x = tag("conv2", x)
        x = x.reshape((x.shape[0], -1))
        x = lm.dropout(x, rate=0.5, is_training=is_training)
        x = self.fc1(x)
        x = lm.relu(x)
        x = tag("fc1", x)
        return self.fc2(x)


# --- training -------------------------------------------------------------------------------


def train(args, data: lm.data.ImageData) -> dict:
    """Trains mnist.py's ConvNet with its own train step; returns the parameters, the state,
    the per-step curves and the test metrics."""
    available = len(data.train["label"])
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    if limit < available:
        train_data = {k: v[:limit] for k, v in data.train.items()}
    else:
        train_data = data.train
        if args.limit is not None:
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
    steps_per_epoch = train_size // args.batch_size  # full batches: one compiled step
    epochs = args.epochs or math.ceil(MIN_STEPS / steps_per_epoch)
    image_shape = data.train["image"].shape[1:]
    print(
        f"{data.name}: training on {train_size:,} of {available:,} training images for "
        f"{epochs} epoch{'s' if epochs > 1 else ''} ({epochs * steps_per_epoch} steps), "
        f"{len(data.test['label']):,} test images of shape {image_shape}"
    )

    net = ConvNet(image_shape[:2], image_shape[2], data.num_classes)
    init, apply = lm.transform(net)
    rng = jr.PRNGKey(args.seed)
    rng, init_rng = jr.split(rng)
    state = init(init_rng)
    params = state.pop("params")
    optimizer = optax.sgd(learning_rate=args.learning_rate, momentum=args.momentum)
    opt_state = optimizer.init(params)
    train_step, eval_step = make_steps(apply, optimizer)

    shuffle = np.random.default_rng(args.seed)
    curve = {"step": [], "loss": [], "accuracy": []}
    every = max(1, epochs * steps_per_epoch // 50)  # about 50 points on the curves
    step = 0
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        meter = lm.utils.AverageMeter()
        bar = tqdm(
            lm.data.batches(train_data, args.batch_size, rng=shuffle, drop_last=True),
            total=steps_per_epoch,
            desc=f"training {epoch}/{epochs}",
            unit="step",
            leave=False,
            disable=args.quiet,
        )
        for batch in bar:
            rng, rng_apply = jr.split(rng)
            params, state, opt_state, metrics = train_step(
                rng_apply, params, state, opt_state, batch
            )
            meter.update(metrics, n=len(batch["image"]))
            step += 1
            if step % every == 0:
                averaged = meter.compute()
                curve["step"].append(step)
                curve["loss"].append(averaged["loss"])
                curve["accuracy"].append(averaged["accuracy"])
                meter = lm.utils.AverageMeter()
                bar.set_postfix({k: f"{v:.4f}" for k, v in averaged.items()})
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    tested = evaluate(eval_step, params, state, data.test, EVAL_BATCH)
    print(
        f"trained {step} steps in {seconds:.1f} s (including the compilation): test loss "
        f"{tested['loss']:.4f}, accuracy {tested['accuracy']:.4f}"
    )
    return {
        "params": params,
        "state": state,
        "curve": curve,
        "train_size": train_size,
        "epochs": epochs,
        "steps": step,
        "seconds": seconds,
        "test_loss": tested["loss"],
        "test_accuracy": tested["accuracy"],
    }


# --- probing --------------------------------------------------------------------------------


def pick_images(test: dict, count: int) -> np.ndarray:
    """Indices of `count` test images: the first of each class in turn, so the rows show
    different classes, then the next ones in order."""
    labels = np.asarray(test["label"])
    _, firsts = np.unique(labels, return_index=True)  # each class's first image, by class
    firsts = firsts[:count]
    rest = np.setdiff1d(np.arange(len(labels)), firsts)[: count - len(firsts)]
    return np.concatenate([firsts, rest])


def class_logit(targets: jax.Array | None):
    """The loss `lm.probe` differentiates: the sum over the images of each one's logit for
    its target class (`targets`), or for its predicted class (None). The images do not
    interact (no batch statistics, no dropout at test time), so the gradient of the sum with
    respect to an image, or to its activations, is the gradient of that image's own logit."""

    def loss(logits: jax.Array) -> jax.Array:
        chosen = jnp.argmax(logits, axis=-1) if targets is None else targets
        return jnp.sum(jnp.take_along_axis(logits, chosen[:, None], axis=-1))

    return loss


def probe(params, state, images: np.ndarray, num_classes: int, targets=None) -> lm.Probe:
    """`lm.probe` on `ProbedConvNet` with the trained ConvNet's variables: the logits, every
    layer's output (`intermediates`) and the target logit's gradient at the input and at every
    layer's output (`gradients`), in one jitted call."""
    height, width, channels = images.shape[1:]
    apply = lm.transform(ProbedConvNet((height, width), channels, num_classes)).apply
    targets = None if targets is None else jnp.asarray(targets)
    variables = {"params": params, **state}
    loss = class_logit(targets)
    return lm.probe(apply, variables, None, jnp.asarray(images), False, loss=loss)


def layer_table(result: lm.Probe) -> list[dict]:
    """Per layer: the activation's shape (one image's), the mean over the images of the
    gradient's L2 norm, and the mean |activation|."""
    rows = []
    for name in LAYERS:
        (activation,) = result.intermediates[name]  # one record: the layer runs once
        activation, gradient = np.asarray(activation), np.asarray(result.gradients[name])
        norms = np.sqrt(np.sum(gradient.reshape(len(gradient), -1) ** 2, axis=1))
        rows.append(
            {
                "layer": name,
                "shape": list(activation.shape[1:]),
                "grad_norm": float(norms.mean()),
                "mean_abs_activation": float(np.abs(activation).mean()),
            }
        )
    return rows


def print_table(rows: list[dict], target: str) -> None:
    print(f"\nGradients of each image's {target}-class logit, averaged over the images")
    print("layer   activation shape  grad L2 norm  mean |activation|")
    for row in rows:
        shape = "x".join(str(n) for n in row["shape"])
        print(
            f"{row['layer']:<6}  {shape:>16}  {row['grad_norm']:12.4g}  "
            f"{row['mean_abs_activation']:17.4g}"
        )


# --- the grid -------------------------------------------------------------------------------


def plot_grid(path, images, labels, predicted, result: lm.Probe, class_names, title) -> None:
    """One row per image: the image, |input gradient|, the mean |gradient| over the channels
    of conv1's and conv2's outputs (at their own resolution), and fc1's units' gradient x
    activation (their first-order share of the logit: fc1's gradient alone is fc2's kernel
    column for the class, the same for every image of that class)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    grads = {name: np.asarray(result.gradients[name]) for name in LAYERS}
    fc1 = np.asarray(result.intermediates["fc1"][0])
    columns = ["image", "input saliency", "conv1 grad", "conv2 grad", "fc1 grad x act"]
    rows = len(images)
    figure, axes = plt.subplots(
        rows, len(columns), figsize=(2.3 * len(columns), 2.3 * rows), squeeze=False
    )
    for i in range(rows):
        row = axes[i]
        row[0].imshow(images[i].mean(axis=-1), cmap="gray")
        row[0].set_title(
            f"true {class_names[labels[i]]}\npred {class_names[predicted[i]]}",
            fontsize=9,
            color="black" if labels[i] == predicted[i] else "red",
        )
        row[1].imshow(np.abs(grads["input"][i]).max(axis=-1), cmap="inferno")
        for ax, name in zip(row[2:4], ("conv1", "conv2"), strict=True):
            ax.imshow(np.abs(grads[name][i]).mean(axis=-1), cmap="viridis")
        share = grads["fc1"][i] * fc1[i]
        row[4].bar(np.arange(len(share)), share, width=1.0, color=np.where(share > 0, "C0", "C3"))
        row[4].axhline(0, color="black", linewidth=0.5)
        for j, ax in enumerate(row):
            if i == 0:
                ax.set_title(
                    f"{columns[j]}\n{ax.get_title()}" if j == 0 else columns[j], fontsize=9
                )
            if j < 4:
                ax.set_xticks([])
                ax.set_yticks([])
            else:
                ax.tick_params(labelsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --- the program ----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _common.add_data_arguments(parser)
    parser.add_argument(
        "--images", type=int, default=6, metavar="N", help="test images to probe (default: 6)"
    )
    parser.add_argument(
        "--target",
        choices=("predicted", "true"),
        default="predicted",
        help="whose logit to differentiate: each image's predicted class or its true class "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        help=f"passes over the training images (default: as many as make {MIN_STEPS} steps; "
        "1 with the default --limit on Fashion-MNIST)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"train on the first N training images only (default: {DEFAULT_LIMIT:,}; all of "
        "them when the set has fewer); the test set stays whole",
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
    _common.add_output_argument(parser, "saliency")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("images", "epochs", "batch_size", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> dict:
    """Runs the example. Returns what metrics.json holds plus the saved files (`files`) and,
    not saved, the trained `params`, the probed images' test-set `indices` and the `probe`
    result."""
    args = parse_args(argv)
    try:
        data = _common.load_data(args)
    except (FileNotFoundError, lm.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    test_size = len(data.test["label"])
    if args.images > test_size:
        raise SystemExit(f"error: --images {args.images}: the test set has only {test_size:,}")
    trained = train(args, data)

    indices = pick_images(data.test, args.images)
    images = data.test["image"][indices]
    labels = data.test["label"][indices]
    targets = labels if args.target == "true" else None
    result = probe(trained["params"], trained["state"], images, data.num_classes, targets)
    predicted = np.asarray(jnp.argmax(result.outputs, axis=-1))
    rows = layer_table(result)
    print_table(rows, args.target)

    names = (
        FASHION_CLASSES
        if data.name == "Fashion-MNIST"
        else [str(c) for c in range(data.num_classes)]
    )
    folder = _common.run_folder(args, "saliency")
    grid = folder / "saliency.png"
    plot_grid(
        grid,
        images,
        labels,
        predicted,
        result,
        names,
        f"{data.name}: gradients of the {args.target} class's logit",
    )
    results = {
        "data": data.name,
        "train_size": trained["train_size"],
        "epochs": trained["epochs"],
        "steps": trained["steps"],
        "train_seconds": trained["seconds"],
        "test_loss": trained["test_loss"],
        "test_accuracy": trained["test_accuracy"],
        "target": args.target,
        "images": [
            {"index": int(i), "label": int(t), "predicted": int(p)}
            for i, t, p in zip(indices, labels, predicted, strict=True)
        ],
        "layers": rows,
        "curve": trained["curve"],
    }
    curve = trained["curve"]
    last = [trained["steps"]], [trained["test_accuracy"]]
    panels = {
        "loss": {"train": (curve["step"], curve["loss"])},
        "accuracy": {"train": (curve["step"], curve["accuracy"]), "test (end)": last},
    }
    files = _common.save_run(folder, results, args, panels, "step")
    results["files"] = {**files, "saliency": grid}
    print(
        f"test accuracy {trained['test_accuracy']:.4f} after {trained['steps']} steps on "
        f"{data.name}; the saliency grid of {len(images)} test images is {grid}"
    )
    return {
        **results,
        "params": trained["params"],
        "indices": indices,
        "probe": result,
    }


if __name__ == "__main__":
    main()
