"""LoRA: adapt a pretrained ConvNet to a shifted domain by training low-rank adapters only.

A ConvNet is pretrained on half of the training images. The target domain is the same task on
inverted images (``1 - x``: light objects on a dark background become dark on light), where the
pretrained network does badly. After `lm.assign_variables` has put the pretrained weights in,
one `lm.replace` wraps every layer in a `lm.LoRA` adapter, and `lm.freeze` turns everything
but the adapters into `lm.FrozenParam`s:

    model = lm.replace(
        lm.assign_variables(ConvNet(...), pretrained_variables),
        lambda path, layer: lm.LoRA(layer, rank=4),
        where=(lm.Conv, lm.Dense),
    )
    model = lm.freeze(model, where=lm.Not(lm.LoRAParam))

so the adapters are the model's only `lm.Parameter`s: the usual training step (``lm.grad``'s
default, an optimizer over ``lm.split(model, variables, lm.Parameter, ...)``) trains them
alone, on inverted images from the other half of the training set, with no mask to build.
The base weights stay bit for bit the pretrained ones; `lm.merge_lora` finally folds the
adapters into a plain ConvNet that computes the same function.

By default it uses Fashion-MNIST when Debian's `dataset-fashion-mnist` is installed
(/usr/share/datasets/fashion-mnist), and otherwise scikit-learn's bundled 8x8 digits; it says
which. It saves the results (metrics.json) and each run's training loss and test accuracy
(curves.png) in runs/lora_finetune-<date>-<time>/, or in the folder --out names.

    python examples/lora_finetune.py                    # the default data
    python examples/lora_finetune.py --digits           # the bundled digits
    python examples/lora_finetune.py --rank 8 --target-examples 5000
    python examples/lora_finetune.py --data-dir path/to/mnist
"""

from __future__ import annotations

import argparse

import _common
import _finetuning as ft
import jax
import numpy as np
import optax

import lamina as lm

LAYERS = ("conv1", "conv2", "fc", "head")  # every one is adapted: all are Conv or Dense


class ConvNet(lm.Module):
    """A small ConvNet: two convolutions, a hidden layer and an output layer."""

    def __init__(self, image_shape=(28, 28, 1), num_classes=10, width=16, hidden=64):
        super().__init__()
        h, w, c = image_shape
        self.conv1 = lm.Conv(c, width, kernel_size=(3, 3))
        self.conv2 = lm.Conv(width, 2 * width, kernel_size=(3, 3))
        self.fc = lm.Dense((h // 4) * (w // 4) * 2 * width, hidden)
        self.head = lm.Dense(hidden, num_classes)

    def __call__(self, x):
        x = lm.max_pool(lm.relu(self.conv1(x)), kernel_size=(2, 2), strides=(2, 2))
        x = lm.max_pool(lm.relu(self.conv2(x)), kernel_size=(2, 2), strides=(2, 2))
        x = lm.relu(self.fc(x.reshape((x.shape[0], -1))))
        return self.head(x)


# --- data -------------------------------------------------------------------------------


def invert(split: dict) -> dict:
    """The target domain: the same images with their intensities inverted, ``1 - x``."""
    return {"image": 1.0 - split["image"], "label": split["label"]}


def run(args) -> dict:
    data = _common.load_data(args)
    # Pretraining and adaptation use disjoint halves of the training images.
    order = np.random.default_rng(0).permutation(len(data.train["label"]))
    half = len(order) // 2
    source_train = {k: v[order[:half]] for k, v in data.train.items()}
    target_train = invert(
        {k: v[order[half:][: args.target_examples]] for k, v in data.train.items()}
    )
    source_test, target_test = data.test, invert(data.test)
    image_shape = data.train["image"].shape[1:]
    print(
        f"{data.name}: images of shape {image_shape}, {data.num_classes} classes\n"
        f"  source (pretraining): {len(source_train['label']):,} training images\n"
        f"  target (inverted, 1 - x): {len(target_train['label']):,} other training images\n"
        f"  test: {len(source_test['label']):,} images, as they are (source) and inverted "
        f"(target)"
    )

    # 1. Pretrain on the source domain.
    net = ConvNet(image_shape, data.num_classes, args.width, args.hidden)
    evaluate_net = ft.make_evaluate(net)
    pretrained = lm.transform(net).init(jax.random.key(args.seed))
    print(f"\npretraining on the source domain: {args.pretrain_steps} steps")
    pretrained, pretrain_time = ft.train(
        "pretrain",
        net,
        lm.Parameter,
        optax.adam(args.pretrain_learning_rate),
        pretrained,
        (source_train, source_test),
        args.pretrain_steps,
        max(args.pretrain_steps // args.evaluations, 1),
        args,
    )

    def accuracies(evaluate, variables) -> dict:
        return {
            "source": evaluate(variables, source_test)["accuracy"],
            "target": evaluate(variables, target_test)["accuracy"],
        }

    before = accuracies(evaluate_net, pretrained)
    print(
        f"pretrained: source test accuracy {before['source']:.4f}, target (inverted) test "
        f"accuracy {before['target']:.4f}"
    )

    # 2. Model surgery: the pretrained weights go in, every Conv and Dense is wrapped in a
    # LoRA (on a copy: `net` stays the plain ConvNet), and everything but the adapters is
    # frozen, so the adapters are the only lm.Parameters left to train.
    model = lm.replace(
        lm.assign_variables(net, pretrained),
        lambda path, layer: lm.LoRA(layer, rank=args.rank, alpha=args.alpha),
        where=(lm.Conv, lm.Dense),
    )
    model = lm.freeze(model, where=lm.Not(lm.LoRAParam))
    print(lm.summary(model))
    evaluate_lora = ft.make_evaluate(model)
    variables = lm.transform(model).init(jax.random.key(args.seed))
    adapters, base = lm.split(model, variables, lm.Parameter, ...)
    # what trains is exactly the adapters: the LoRAParams, under their paths
    trainable_are_adapters = ft.same_arrays(
        adapters, lm.filter_variables(model, variables, lm.LoRAParam)
    )
    num_adapters, num_total = ft.count(adapters), ft.count(variables)
    # The adapters start as a no-op (lora_b = 0): the wrapped model is the pretrained one.
    start_target = evaluate_lora(variables, target_test)["accuracy"]
    print(
        f"\nadapting {num_adapters:,} of {num_total:,} parameters "
        f"({100 * num_adapters / num_total:.1f}%) for {args.steps} steps; target accuracy at "
        f"the start {start_target:.4f}"
    )

    # 3. Train the adapters alone (the model's only Parameters), on the target domain.
    variables, adapt_time = ft.train(
        "LoRA",
        model,
        lm.Parameter,
        optax.adam(args.learning_rate),
        variables,
        (target_train, target_test),
        args.steps,
        max(args.steps // args.evaluations, 1),
        args,
    )
    adapted = accuracies(evaluate_lora, variables)

    # The base weights are the pretrained ones, bit for bit: only lora_a/lora_b moved. Each
    # layer's variables now sit under "base" (params/conv1/base/kernel).
    _, base_after = lm.split(model, variables, lm.Parameter, ...)
    expected = {"params": {n: {"base": p} for n, p in pretrained["params"].items()}}
    base_unchanged = ft.same_arrays(base_after, expected) and ft.same_arrays(base_after, base)

    # 4. Fold the adapters into the base kernels: a plain ConvNet (paths lose "base"), whose
    # parameters are still FrozenParams (for inference; lm.assign_variables(net, merged_variables)
    # gives a trainable one).
    merged_model, merged_variables = lm.merge_lora(model, variables)
    evaluate_merged = ft.make_evaluate(merged_model)
    merged = accuracies(evaluate_merged, merged_variables)
    logits_difference = float(
        np.abs(
            evaluate_merged(merged_variables, target_test)["logits"]
            - evaluate_lora(variables, target_test)["logits"]
        ).max()
    )

    # 5. For comparison: fine-tune every parameter of the pretrained ConvNet, same steps.
    full = None
    if args.full_finetune:
        print(f"\nfor comparison, fine-tuning all {ft.count(pretrained):,} parameters")
        finetuned, full_time = ft.train(
            "full",
            net,
            lm.Parameter,
            optax.adam(args.full_learning_rate),
            pretrained,
            (target_train, target_test),
            args.steps,
            max(args.steps // args.evaluations, 1),
            args,
        )
        full = {**accuracies(evaluate_net, finetuned), **full_time}

    return {
        "data": data.name,
        "source_train_size": len(source_train["label"]),
        "target_train_size": len(target_train["label"]),
        "test_size": len(target_test["label"]),
        "rank": args.rank,
        "pretrain": pretrain_time,
        "adapt": adapt_time,
        "before": before,
        "start_target": start_target,
        "adapted": adapted,
        "merged": merged,
        "full_finetune": full,
        "merged_max_logit_difference": logits_difference,
        "merged_layer_types": [type(getattr(merged_model, n)).__name__ for n in LAYERS],
        "merged_paths": sorted(merged_variables["params"]["conv1"]),
        "trainable_params": num_adapters,
        "total_params": num_total,
        "merged_params": ft.count(merged_variables),
        "pretrained_params": ft.count(pretrained),
        "base_unchanged": base_unchanged,
        "trainable_are_adapters": trainable_are_adapters,
    }


def print_results(results: dict) -> None:
    adapt = results["adapt"]
    print(
        f"\nResults on {results['data']}: pretrained on {results['source_train_size']:,} "
        f"images ({results['pretrain']['steps']} steps, {results['pretrain']['seconds']:.1f} s), "
        f"adapted on {results['target_train_size']:,} inverted images ({adapt['steps']} "
        f"steps); test accuracy on {results['test_size']:,} test images as they are (source) "
        f"and inverted (target)"
    )
    print("model                     parameters  trained  source acc  target acc  train s")
    total, pretrained = results["total_params"], results["pretrained_params"]
    rows = [
        ("pretrained", results["before"], pretrained, "-", None),
        (
            f"rank-{results['rank']} LoRA",
            results["adapted"],
            total,
            results["trainable_params"],
            adapt["seconds"],
        ),
        ("LoRA merged (plain)", results["merged"], results["merged_params"], "-", None),
    ]
    if results["full_finetune"]:
        full = results["full_finetune"]
        rows.append(("full fine-tune", full, pretrained, pretrained, full["seconds"]))
    for name, row, params, trained, seconds in rows:
        trained = f"{trained:,}" if isinstance(trained, int) else trained
        seconds = f"{seconds:7.1f}" if seconds is not None else f"{'-':>7}"
        print(
            f"{name:<24}  {params:>10,}  {trained:>7}  {row['source']:10.4f}  "
            f"{row['target']:10.4f}  {seconds}"
        )
    gain = results["adapted"]["target"] - results["before"]["target"]
    print(
        f"LoRA trained {results['trainable_params']:,} of {total:,} parameters "
        f"({100 * results['trainable_params'] / total:.1f}%, {adapt['ms_per_step']:.2f} ms per "
        f"step) and raised target accuracy by {100 * gain:+.1f} points; the base weights are "
        f"{'bit-identical to the pretrained ones' if results['base_unchanged'] else 'CHANGED'} "
        f"(dropping the adapters gives the pretrained model back); the merged plain ConvNet's "
        f"logits are within {results['merged_max_logit_difference']:.1e} of the adapted "
        f"model's. (train s includes the first step's compilation.)"
    )


def save(results: dict, args) -> dict:
    # pretraining is tested on the source domain, the two others on the target domain
    runs = {"pretrain (source)": results["pretrain"], "LoRA (target)": results["adapt"]}
    if results["full_finetune"]:
        runs["full fine-tune (target)"] = results["full_finetune"]
    return ft.save(results, args, "lora_finetune", runs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ft.add_common_arguments(parser, "lora_finetune")
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=1000,
        help="training steps on the source domain (default: %(default)s)",
    )
    parser.add_argument(
        "--target-examples",
        type=int,
        default=2000,
        help="inverted training images to adapt on, from the half not used for "
        "pretraining (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=500, help="adaptation steps (default: %(default)s)"
    )
    parser.add_argument(
        "--rank", type=int, default=4, help="rank of every adapter (default: %(default)s)"
    )
    parser.add_argument("--alpha", type=float, help="adapter scale alpha / rank (default: rank)")
    parser.add_argument("--batch-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=3e-3,
        help="Adam's, for the adapters (default: %(default)s)",
    )
    parser.add_argument(
        "--pretrain-learning-rate",
        type=float,
        default=1e-3,
        help="Adam's, for pretraining (default: %(default)s)",
    )
    parser.add_argument(
        "--full-learning-rate",
        type=float,
        default=1e-3,
        help="Adam's, for the full fine-tune (default: %(default)s)",
    )
    parser.add_argument(
        "--width", type=int, default=16, help="channels of the first conv (default: %(default)s)"
    )
    parser.add_argument(
        "--hidden", type=int, default=64, help="units of the hidden layer (default: %(default)s)"
    )
    parser.add_argument(
        "--no-full-finetune",
        dest="full_finetune",
        action="store_false",
        help="skip the comparison with fine-tuning every parameter",
    )
    parser.add_argument(
        "--evaluations",
        type=int,
        default=4,
        help="test evaluations during each training run (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    positive = ("pretrain_steps", "target_examples", "steps", "rank", "batch_size", "evaluations")
    ft.check_positive(parser, args, positive)
    return args


def main(argv=None) -> dict:
    return ft.main(run, print_results, save, parse_args(argv))


if __name__ == "__main__":
    main()
