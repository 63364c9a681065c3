"""What the fine-tuning examples share: data, a selective training loop, evaluation, `main`.

`transfer_learning.py` and `lora_finetune.py` both train a subset of a model's parameters (the
ones a filter matches) and report test accuracy; the loop lives here once. Not an example to
run: import it.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax
from tqdm import tqdm

import lamina as lm

# --- data -------------------------------------------------------------------------------


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        help="an MNIST-format folder (default: Fashion-MNIST if installed, else "
        "scikit-learn's digits)",
    )
    parser.add_argument(
        "--digits",
        action="store_true",
        help="use scikit-learn's 8x8 digits even if Fashion-MNIST is there",
    )


def load_data(args) -> lm.data.ImageData:
    if args.digits:
        return lm.data.load_digits()
    if args.data_dir:
        return lm.data.load_idx_folder(args.data_dir)
    return lm.data.load_default_images()


def endless_batches(data: dict, batch_size: int, rng: np.random.Generator):
    """Shuffled batches, epoch after epoch (every batch full, so one compiled step)."""
    batch_size = min(batch_size, len(data["label"]))
    while True:
        yield from lm.data.batches(data, batch_size, rng=rng)


# --- training and evaluation ------------------------------------------------------------


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_train_step(model: lm.Module, optimizer, trainable):
    """A jitted step that trains only the parameters `trainable` matches.

    `lm.value_and_grad` differentiates the matched variables alone (the rest are constants,
    and JAX leaves out the work their gradients would need); `lm.split` and `lm.merge` take
    them out of the variables and put the updated ones back.
    """
    _, apply = lm.transform(model)

    def loss_fn(variables, batch):
        logits, _ = apply(variables, None, batch["image"])
        loss = cross_entropy(logits, batch["label"])
        return loss, (logits.argmax(axis=-1) == batch["label"]).mean()

    grad_fn = lm.value_and_grad(loss_fn, model, lm.DiffState(0, trainable), has_aux=True)

    @jax.jit
    def train_step(variables, opt_state, batch):
        (loss, accuracy), grads = grad_fn(variables, batch)
        params, frozen = lm.split(model, variables, trainable, ...)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        variables = lm.merge(optax.apply_updates(params, updates), frozen)
        return variables, opt_state, {"loss": loss, "accuracy": accuracy}

    return train_step


def make_evaluate(model: lm.Module):
    """``evaluate(variables, data)``: accuracy, loss, and the logits (to compare two models)."""
    _, apply = lm.transform(model)
    predict = jax.jit(lambda variables, images: apply(variables, None, images)[0])

    def evaluate(variables, data: dict, batch_size: int = 1000) -> dict:
        logits = np.concatenate(
            [
                np.asarray(predict(variables, batch["image"]))
                for batch in lm.data.batches(data, batch_size, drop_remainder=False)
            ]
        )
        return {
            "accuracy": float((logits.argmax(axis=-1) == data["label"]).mean()),
            "loss": float(cross_entropy(logits, data["label"])),
            "logits": logits,
        }

    return evaluate


def train(name, model, trainable, optimizer, variables, data, steps, eval_every, args):
    """Trains `model`'s `trainable` parameters from `variables` for `steps` steps.

    Args:
        name: the run's name, in the progress bar and the log lines.
        model: the model, whose `lm.transform` runs the steps.
        trainable: a filter: the parameters that train (the rest stay bit for bit).
        optimizer: an optax optimiser, for the trainable parameters alone.
        variables: the initial variables.
        data: ``(train_split, test_split)``.
        steps: how many steps.
        eval_every: evaluate on the test split every this many steps (and at the end).
        args: the command line (`batch_size`, `seed`, `quiet`).

    Returns:
        ``(variables, report)``: the trained variables, and the final test accuracy and loss,
        the trainable parameter count, the training time and the time per step.
    """
    train_data, test_data = data
    evaluate = make_evaluate(model)
    opt_state = optimizer.init(lm.filter_variables(model, variables, trainable))
    train_step = make_train_step(model, optimizer, trainable)
    batches = endless_batches(train_data, args.batch_size, np.random.default_rng(args.seed))
    bar = tqdm(range(1, steps + 1), desc=name, unit="step", leave=False, disable=args.quiet)
    meter, seconds, compile_seconds = lm.utils.AverageMeter(), 0.0, 0.0
    for step in bar:
        batch = next(batches)
        start = time.perf_counter()
        variables, opt_state, metrics = train_step(variables, opt_state, batch)
        evaluating = step % eval_every == 0 or step == steps
        if step == 1 or evaluating:
            jax.block_until_ready(variables)  # steps run asynchronously: wait before timing
        seconds += time.perf_counter() - start
        if step == 1:
            compile_seconds = seconds  # the first step compiles: timed apart
        meter.update(metrics, n=len(batch["label"]))
        if step % 50 == 0:
            bar.set_postfix({k: f"{v:.4f}" for k, v in meter.compute().items()})
        if evaluating:
            tested = evaluate(variables, test_data)
            trained, meter = meter.compute(), lm.utils.AverageMeter()
            tqdm.write(
                f"{name:>11}  step {step:5d}  train loss {trained['loss']:.4f} "
                f"accuracy {trained['accuracy']:.4f}  test accuracy {tested['accuracy']:.4f}"
            )
    return variables, {
        "test_accuracy": tested["accuracy"],
        "test_loss": tested["loss"],
        "trainable_params": count(lm.filter_variables(model, variables, trainable)),
        "seconds": seconds,
        "ms_per_step": 1000 * (seconds - compile_seconds) / max(steps - 1, 1),
        "steps": steps,
    }


def count(tree) -> int:
    """How many numbers a tree of arrays holds."""
    return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree))


def same_arrays(a, b) -> bool:
    """Whether two variables trees hold bit-identical arrays at the same paths."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in leaves)


# --- the command line -------------------------------------------------------------------


def check_positive(parser: argparse.ArgumentParser, args, names) -> None:
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def main(run, print_results, args) -> dict:
    """Runs `run(args)`; a missing or broken data folder ends it with a one-line error."""
    try:
        results = run(args)
    except (FileNotFoundError, lm.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    return results
