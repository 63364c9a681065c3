"""What the fine-tuning examples share: data, a selective training loop, evaluation, `main`.

`transfer_learning.py` and `lora_finetune.py` both train a subset of a model's parameters (the
ones a filter matches) and report test accuracy; the loop lives here once. Not an example to
run: import it.
"""

from __future__ import annotations

import argparse
import time

import _common
import jax
import numpy as np
import optax
from tqdm import tqdm

import lamina as lm

# --- data -------------------------------------------------------------------------------


def endless_batches(data: dict, batch_size: int, rng: np.random.Generator):
    """Shuffled batches, epoch after epoch (every batch full, so one compiled step)."""
    batch_size = min(batch_size, len(data["label"]))
    while True:
        yield from lm.data.batches(data, batch_size, rng=rng, drop_last=True)


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
                for batch in lm.data.batches(data, batch_size)
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
        the trainable parameter count, the training time, the time per step, and the history
        (train loss and accuracy since the last evaluation, test loss and accuracy, at each
        evaluation).
    """
    train_data, test_data = data
    evaluate = make_evaluate(model)
    opt_state = optimizer.init(lm.filter_variables(model, variables, trainable))
    train_step = make_train_step(model, optimizer, trainable)
    batches = endless_batches(train_data, args.batch_size, np.random.default_rng(args.seed))
    bar = tqdm(range(1, steps + 1), desc=name, unit="step", leave=False, disable=args.quiet)
    meter, seconds, compile_seconds, history = lm.utils.AverageMeter(), 0.0, 0.0, []
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
            history.append(
                {
                    "step": step,
                    "train_loss": trained["loss"],
                    "train_accuracy": trained["accuracy"],
                    "test_loss": tested["loss"],
                    "test_accuracy": tested["accuracy"],
                }
            )
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
        "history": history,
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


def add_common_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """--data-dir, --digits, --out."""
    _common.add_data_arguments(parser)
    _common.add_output_argument(parser, example)


def save(results: dict, args, example: str, runs: dict[str, dict]) -> dict:
    """Saves the results and, for each training run in `runs`, its loss and accuracy curves."""

    def line(report, key):
        return [row["step"] for row in report["history"]], [row[key] for row in report["history"]]

    panels = {
        "training loss (since the last evaluation)": {
            name: line(report, "train_loss") for name, report in runs.items()
        },
        "test accuracy": {name: line(report, "test_accuracy") for name, report in runs.items()},
    }
    folder = _common.run_folder(args, example)
    return _common.save_run(folder, results, args, panels, "step")


def main(run, print_results, save_results, args) -> dict:
    """Runs `run(args)`, prints and saves the results; a bad data folder ends it in one line."""
    try:
        results = run(args)
    except (FileNotFoundError, lm.data.IdxFormatError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    results["files"] = save_results(results, args)
    return results
