"""Transfer learning: pretrain a ConvNet on one task, reuse its body for another with a new head.

Task A is the first half of the classes (Fashion-MNIST: T-shirt, trouser, pullover, dress,
coat; digits: 0-4); task B is the other half (sandal, shirt, sneaker, bag, ankle boot; 5-9),
relabelled 0-4, with only a few labelled training images per class. The network is pretrained
on all of task A's training images; then the same network, with a NEW head for task B, gets
the pretrained body by model surgery on the object (the seed's recipe):

    model = lm.assign_variables(pretrained_model, pretrained_variables)
    model.head = lm.Dense(64, 5)  # a new, randomly initialised output layer

and is trained on task B's few images three ways, for the same steps on the same batches:
from scratch (no pretraining), fine-tuned (every parameter trains), and with the body frozen
(only `head` trains: ``lm.grad(loss, model, lm.DiffState(0, lm.PathContains("head")))``).

By default it uses Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(/usr/share/datasets/fashion-mnist), and otherwise scikit-learn's bundled 8x8 digits; it says
which. It saves the results (metrics.json) and each run's training loss and test accuracy
(curves.png) in runs/transfer_learning-<date>-<time>/, or in the folder --out names.

    python examples/transfer_learning.py                       # the default data
    python examples/transfer_learning.py --digits              # the bundled digits
    python examples/transfer_learning.py --target-per-class 100
    python examples/transfer_learning.py --data-dir path/to/mnist
"""

from __future__ import annotations

import argparse

import _common
import _finetuning as ft
import jax
import numpy as np
import optax

import lamina as lm


class ConvNet(lm.Module):
    """A small ConvNet: a convolutional body (`conv1`, `conv2`) and a linear `head`."""

    def __init__(self, image_shape=(28, 28, 1), num_classes=10, width=16):
        super().__init__()
        h, w, c = image_shape
        self.conv1 = lm.Conv(c, width, kernel_size=(3, 3))
        self.conv2 = lm.Conv(width, 2 * width, kernel_size=(3, 3))
        self.head = lm.Dense((h // 4) * (w // 4) * 2 * width, num_classes)

    def features(self, x):
        x = lm.max_pool(lm.relu(self.conv1(x)), kernel_size=(2, 2), strides=(2, 2))
        x = lm.max_pool(lm.relu(self.conv2(x)), kernel_size=(2, 2), strides=(2, 2))
        return x.reshape((x.shape[0], -1))

    def __call__(self, x):
        return self.head(self.features(x))


# --- data -------------------------------------------------------------------------------


def select_classes(split: dict, classes: np.ndarray) -> dict:
    """The examples of `classes`, relabelled 0, 1, ... in the order given."""
    keep = np.isin(split["label"], classes)
    relabel = np.full(int(split["label"].max()) + 1, -1, np.int32)
    relabel[classes] = np.arange(len(classes), dtype=np.int32)
    return {"image": split["image"][keep], "label": relabel[split["label"][keep]]}


def few_per_class(split: dict, per_class: int, rng: np.random.Generator) -> dict:
    """`per_class` random examples of each label (all of them where there are fewer)."""
    index = np.concatenate(
        [
            rng.permutation(np.flatnonzero(split["label"] == label))[:per_class]
            for label in np.unique(split["label"])
        ]
    )
    index = rng.permutation(index)
    return {key: value[index] for key, value in split.items()}


def run(args) -> dict:
    data = _common.load_data(args)
    classes = np.arange(data.num_classes)
    task_a, task_b = classes[: data.num_classes // 2], classes[data.num_classes // 2 :]
    source_train = select_classes(data.train, task_a)
    source_test = select_classes(data.test, task_a)
    target_all = select_classes(data.train, task_b)
    target_train = few_per_class(
        target_all, args.target_per_class, np.random.default_rng(args.seed)
    )
    target_test = select_classes(data.test, task_b)
    image_shape = data.train["image"].shape[1:]
    print(
        f"{data.name}: images of shape {image_shape}\n"
        f"  task A (pretraining): classes {task_a.tolist()}, "
        f"{len(source_train['label']):,} training and {len(source_test['label']):,} test images\n"
        f"  task B (transfer):    classes {task_b.tolist()} as 0-{len(task_b) - 1}, "
        f"{len(target_train['label']):,} training images ({args.target_per_class} per class; "
        f"{len(target_all['label']):,} available) and {len(target_test['label']):,} test images"
    )

    # 1. Pretrain on task A.
    pretrained_model = ConvNet(image_shape, len(task_a), args.width)
    print(lm.summary(pretrained_model))
    epochs = args.pretrain_steps * args.batch_size / len(source_train["label"])
    print(f"\npretraining on task A: {args.pretrain_steps} steps ({epochs:.1f} epochs)")
    pretrained_variables, pretrained = ft.train(
        "pretrain",
        pretrained_model,
        lm.Parameter,
        optax.adam(args.learning_rate),
        lm.transform(pretrained_model).init(jax.random.key(args.seed)),
        (source_train, source_test),
        args.pretrain_steps,
        max(args.pretrain_steps // 4, 1),
        args,
    )

    # 2. The same network for task B: the pretrained body, a new head (model surgery).
    transferred = lm.assign_variables(pretrained_model, pretrained_variables)
    transferred.head = lm.Dense(transferred.head.in_size, len(task_b))
    scratch = ConvNet(image_shape, len(task_b), args.width)

    # 3. Train each variant on the same few task-B images, for the same steps. The head is
    # new in every variant (the same initial weights: init derives them from the key and the
    # path "head"); with the body frozen only the head trains, and with a larger rate.
    head = lm.PathContains("head")
    is_head = lm.mask(transferred, lm.transform(transferred).init(jax.random.key(0)), head)
    slow_body = optax.multi_transform(
        {"head": optax.adam(args.learning_rate), "body": optax.adam(args.body_learning_rate)},
        jax.tree.map(lambda in_head: "head" if in_head else "body", is_head),
    )
    variants = {
        "scratch": (scratch, lm.Parameter, optax.adam(args.learning_rate)),
        "fine-tune": (transferred, lm.Parameter, optax.adam(args.learning_rate)),
        "slow body": (transferred, lm.Parameter, slow_body),
        "frozen body": (transferred, head, optax.adam(args.head_learning_rate)),
    }
    print(f"\ntraining on task B's {len(target_train['label'])} images: {args.steps} steps each")
    reports, trained = {}, {}
    for name, (model, trainable, optimizer) in variants.items():
        trained[name], reports[name] = ft.train(
            name,
            model,
            trainable,
            optimizer,
            lm.transform(model).init(jax.random.key(args.seed)),
            (target_train, target_test),
            args.steps,
            args.eval_every,
            args,
        )
    # With the body frozen, only the head moved: the body is the pretrained one, bit for bit.
    body = lm.Not(lm.PathContains("head"))
    frozen_body = lm.filter_variables(transferred, trained["frozen body"], body)
    pretrained_body = lm.filter_variables(pretrained_model, pretrained_variables, body)
    return {
        "data": data.name,
        "task_a": task_a.tolist(),
        "task_b": task_b.tolist(),
        "target_train_size": len(target_train["label"]),
        "target_test_size": len(target_test["label"]),
        "pretrain": pretrained,
        "variants": reports,
        "total_params": ft.count(trained["scratch"]),
        "frozen_body_unchanged": ft.same_arrays(frozen_body, pretrained_body),
    }


def print_results(results: dict) -> None:
    pretrain = results["pretrain"]
    print(
        f"\nResults on {results['data']}: pretrained on classes {results['task_a']} "
        f"(test accuracy {pretrain['test_accuracy']:.4f}, {pretrain['steps']} steps, "
        f"{pretrain['seconds']:.1f} s), then classes {results['task_b']} from "
        f"{results['target_train_size']} training images; task-B test accuracy on "
        f"{results['target_test_size']:,} images"
    )
    print("variant      trainable params  test acc  test loss  train s  ms/step")
    for name, row in results["variants"].items():
        print(
            f"{name:<11}  {row['trainable_params']:>9,} of {results['total_params']:<,}  "
            f"{row['test_accuracy']:8.4f}  {row['test_loss']:9.4f}  {row['seconds']:7.1f}  "
            f"{row['ms_per_step']:7.2f}"
        )
    variants = results["variants"]
    gain = variants["fine-tune"]["test_accuracy"] - variants["scratch"]["test_accuracy"]
    print(
        f"fine-tuning the pretrained body vs training from scratch: {100 * gain:+.1f} "
        f"points of test accuracy; with the body frozen it is "
        f"{'bit-identical to' if results['frozen_body_unchanged'] else 'NOT the same as'} the "
        f"pretrained one. (train s: the training loop, with the first step's compilation; "
        f"ms/step: the steps after it.)"
    )


def save(results: dict, args) -> dict:
    runs = {"pretrain (task A)": results["pretrain"], **results["variants"]}
    return ft.save(results, args, "transfer_learning", runs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ft.add_common_arguments(parser, "transfer_learning")
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=1000,
        help="training steps on task A (default: %(default)s)",
    )
    parser.add_argument(
        "--target-per-class",
        type=int,
        default=20,
        help="labelled task-B training images per class (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="training steps on task B, each (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="evaluate on task B's test set every N steps (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=1e-3,
        help="Adam's, for pretraining, scratch and fine-tuning (default: %(default)s)",
    )
    parser.add_argument(
        "--body-learning-rate",
        type=float,
        default=1e-4,
        help="Adam's, for the body in the 'slow body' variant (default: %(default)s)",
    )
    parser.add_argument(
        "--head-learning-rate",
        type=float,
        default=1e-2,
        help="Adam's, for the head when the body is frozen (default: %(default)s)",
    )
    parser.add_argument(
        "--width", type=int, default=16, help="channels of the first conv (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    positive = ("pretrain_steps", "target_per_class", "steps", "eval_every", "batch_size", "width")
    ft.check_positive(parser, args, positive)
    return args


def main(argv=None) -> dict:
    return ft.main(run, print_results, save, parse_args(argv))


if __name__ == "__main__":
    main()
