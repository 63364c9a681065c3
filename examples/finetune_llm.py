"""LoRA fine-tuning of a Hugging Face checkpoint, merged and saved back as a Hugging Face folder.

Loads a Llama-family folder with `lamina.models.from_pretrained` (no PyTorch needed), wraps
the attention's query and value projections of every layer in `lm.LoRA` adapters with one
`lm.replace`, freezes everything else with `lm.freeze`:

    model = lm.replace(
        lm.assign_variables(model, variables),
        lambda path, layer: lm.LoRA(layer, rank=8, alpha=16),
        where=lm.Any(lm.PathContains("attention/query"), lm.PathContains("attention/value")),
    )
    model = lm.freeze(model, where=lm.Not(lm.LoRAParam))

and trains the adapters alone (AdamW) to predict the next token of a text, a few hundred
steps. The layers are one `lm.Stack`, so each adapter is stacked along the layer axis like the
weights it adapts. Then `lm.merge_lora` folds the adapters into the projections (a plain
model again), `lamina.models.save_pretrained` writes it as a Hugging Face folder, and, when
`transformers` is installed, the folder is loaded back with
``AutoModelForCausalLM.from_pretrained`` and its logits compared with the adapted lamina
model's.

    python examples/finetune_llm.py                  # a tiny random Llama, the stdlib's text
    python examples/finetune_llm.py --data text.txt   # any UTF-8 text: tinyshakespeare, say
    python examples/finetune_llm.py --checkpoint path/to/Qwen2.5-0.5B --steps 100 --block-size 128

lamina never downloads: fetch a Hub model once (``huggingface-cli download Qwen/Qwen2.5-0.5B
--local-dir Qwen2.5-0.5B``) and pass that folder. It must hold ``tokenizer.json`` (a
SentencePiece ``tokenizer.model`` alone is not read); the text is tokenised as it is, with
no chat template.

Without ``--checkpoint`` it builds a tiny random Llama (2 layers, width 64) over the 256
byte values with lamina itself and saves it with `save_pretrained` into a temporary folder,
which it then loads as any checkpoint: so it runs offline, without `transformers`. Its loss
starts at about ln(256) = 5.5 and falls to about 5.2 in 300 steps: rank-8 adapters on two
projections can move a random network only so far (a trained checkpoint is the real use).
The text is tokenised with the folder's ``tokenizer.json``, or, for the built-in random
model alone, as UTF-8 bytes. Without ``--data`` it trains on Python's
own source (the standard library's top-level modules, in alphabetical order, up to about
300 KB); it says which. The last 10% of the tokens validate.

It saves the merged model in ``<out>/model``, and the metrics (metrics.json) and the loss
curves (curves.png) in ``<out>`` (default: runs/finetune_llm-<date>-<time>).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import tempfile
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import lamina as lm
from lamina import models

BYTE_VOCAB = 256
STDLIB_CHARACTERS = 300_000
ADAPTED = lm.Any(lm.PathContains("attention/query"), lm.PathContains("attention/value"))


# --- the checkpoint ---------------------------------------------------------------------


def tiny_config() -> models.ModelConfig:
    """A tiny Llama over the 256 byte values (untied output layer, grouped-query attention)."""
    return models.ModelConfig(
        model_type="llama",
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        norm_eps=1e-5,
    )


def write_random_checkpoint(folder: pathlib.Path, seed: int) -> pathlib.Path:
    """Builds `tiny_config`'s model with random weights and saves it as a Hugging Face folder."""
    model = models.CausalLM(tiny_config())
    variables = jax.jit(lm.transform(model).init)(jax.random.key(seed))
    models.save_pretrained(model, variables, folder)
    return folder


# --- the text ---------------------------------------------------------------------------


def stdlib_text(limit: int = STDLIB_CHARACTERS) -> tuple[str, str]:
    """Python's own source: the standard library's top-level modules, sorted, up to `limit`."""
    folder = pathlib.Path(inspect.getsourcefile(argparse)).parent  # type: ignore[arg-type]
    parts, files, size = [], [], 0
    for path in sorted(folder.glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        files.append(path.name)
        size += len(parts[-1])
        if size >= limit:
            break
    if not parts:
        raise FileNotFoundError(f"no *.py files in the standard library folder {folder}")
    return f"the standard library's {files[0]} to {files[-1]} ({len(files)} files)", "".join(parts)


def load_text(args) -> tuple[str, str, str]:
    """``(short name, full description, text)`` of --data (or the stdlib's source)."""
    if args.data:
        path = pathlib.Path(args.data)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {path.resolve()} (--data)")
        name = path.name if len(path.name) <= 60 else f"{path.name[:28]}...{path.name[-28:]}"
        return name, str(path.resolve()), path.read_text(encoding="utf-8")  # name: the title
    name, text = stdlib_text()
    return name, name + " (no --data given)", text


def tokens(args, text: str, described: str, tokenizer) -> np.ndarray:
    """The text as int32 token ids: the folder's tokenizer, or the random model's bytes."""
    if tokenizer is not None:
        ids = np.asarray(tokenizer.encode(text).ids, dtype=np.int32)
        how = "the folder's tokenizer"
    elif args.checkpoint is None:  # the built-in model's vocabulary is the byte values
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        how = "UTF-8 bytes"
    else:
        raise ValueError(
            f"the checkpoint {args.checkpoint} has no tokenizer.json (only that file is read; "
            f"a SentencePiece tokenizer.model is not), so the text cannot be tokenised: use a "
            f"folder with tokenizer.json"
        )
    print(f"data: {described}, {len(text):,} characters, {len(ids):,} tokens ({how})")
    return ids


def windows(ids: np.ndarray, starts: np.ndarray, block_size: int):
    """``(inputs, targets)``: for each start, `block_size` ids and the same shifted by one."""
    chunk = ids[starts[:, None] + np.arange(block_size + 1)]
    return chunk[:, :-1], chunk[:, 1:]


# --- training ---------------------------------------------------------------------------


def make_steps(model: lm.Module, optimizer):
    """The jitted training step (the adapters: the model's only Parameters) and evaluation."""
    _, apply = lm.transform(model)

    def loss_fn(variables, inputs, targets):
        logits, _ = apply(variables, None, inputs)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    grad_fn = lm.value_and_grad(loss_fn, model)  # the lm.Parameters: the adapters

    @jax.jit
    def train_step(variables, opt_state, inputs, targets):
        loss, grads = grad_fn(variables, inputs, targets)
        adapters, frozen = lm.split(model, variables, lm.Parameter, ...)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return lm.merge(optax.apply_updates(adapters, updates), frozen), opt_state, loss

    return train_step, jax.jit(loss_fn)


def logits_of(model: lm.Module, variables, ids) -> np.ndarray:
    logits, _ = jax.jit(lm.transform(model).apply)(variables, None, ids)
    return np.asarray(logits, dtype=np.float32)


def transformers_logits(folder: pathlib.Path, ids: np.ndarray, quiet: bool) -> np.ndarray | None:
    """The saved folder's logits in `transformers` (PyTorch), or None when it is missing."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    if quiet:
        transformers.utils.logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def run(args, folder: pathlib.Path) -> dict:
    data_name, data_described, text = load_text(args)  # a missing file fails before the model
    with tempfile.TemporaryDirectory() as scratch:
        if args.checkpoint is None:
            source = write_random_checkpoint(pathlib.Path(scratch) / "tiny-llama", args.seed)
            described = "a tiny random Llama over bytes, saved by lamina (no --checkpoint)"
        else:
            source = pathlib.Path(args.checkpoint)
            if not source.is_dir():
                raise FileNotFoundError(
                    f"no checkpoint folder at {source.resolve()} (--checkpoint)"
                )
            described = str(source.resolve())
        dtype = None if args.dtype == "keep" else jnp.dtype(args.dtype)
        pretrained_model, pretrained = models.from_pretrained(source, dtype=dtype)
        tokenizer = models.load_tokenizer(source)
    config = pretrained_model.config
    print(
        f"checkpoint: {described}: {config.model_type}, {config.num_layers} layers, width "
        f"{config.hidden_size}, vocabulary {config.vocab_size:,}"
    )
    ids = tokens(args, text, data_described, tokenizer)
    bad = ids[ids >= config.vocab_size]
    if bad.size:
        raise ValueError(
            f"the tokenizer gives ids up to {int(bad.max())}, outside the model's vocabulary "
            f"[0, {config.vocab_size}): the folder's tokenizer.json and config.json disagree"
        )
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    if len(val_ids) <= args.block_size + 1:
        raise ValueError(
            f"{len(ids):,} tokens leave {len(val_ids):,} for validation, too few for one "
            f"window of --block-size {args.block_size}; use a longer text or a smaller one"
        )

    # Surgery: the pretrained weights go in, the attention's query and value projections of
    # every layer are wrapped, everything but the adapters is frozen.
    model = lm.replace(
        lm.assign_variables(pretrained_model, pretrained),
        lambda path, layer: lm.LoRA(layer, rank=args.rank, alpha=args.alpha),
        where=ADAPTED,
    )
    model = lm.freeze(model, where=lm.Not(lm.LoRAParam))
    if not args.quiet:
        print(lm.summary(model))
    variables = jax.jit(lm.transform(model).init)(jax.random.key(args.seed))
    adapters, frozen_before = lm.split(model, variables, lm.Parameter, ...)
    num_adapters = sum(int(np.size(x)) for x in jax.tree.leaves(adapters))
    num_total = sum(int(np.size(x)) for x in jax.tree.leaves(variables))
    print(
        f"training {num_adapters:,} adapter parameters of {num_total:,} "
        f"({100 * num_adapters / num_total:.2f}%): rank {args.rank} on the query and value "
        f"projections of {config.num_layers} layers"
    )

    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    opt_state = optimizer.init(adapters)
    train_step, evaluate = make_steps(model, optimizer)
    rng = np.random.default_rng(args.seed)
    starts = np.linspace(0, len(val_ids) - args.block_size - 1, args.eval_windows).astype(int)
    validation = windows(val_ids, starts, args.block_size)

    val_before = float(evaluate(variables, *validation))
    history = [{"step": 0, "train_loss": None, "val_loss": val_before}]
    losses = []
    bar = tqdm(range(1, args.steps + 1), unit="step", disable=args.quiet, leave=False)
    start = time.perf_counter()
    compile_seconds = eval_seconds = 0.0
    for step in bar:
        last = len(train_ids) - args.block_size - 1
        batch = windows(train_ids, rng.integers(0, last + 1, args.batch_size), args.block_size)
        variables, opt_state, loss = train_step(variables, opt_state, *batch)
        # Waited for, so that the bar (and its steps per second) shows steps done, not queued
        losses.append(jax.block_until_ready(loss))
        if step == 1:
            compile_seconds = time.perf_counter() - start
        if step % args.eval_interval == 0 or step == args.steps:
            eval_start = time.perf_counter()
            recent = float(np.mean(jax.device_get(losses[-args.eval_interval :])))
            val = float(evaluate(variables, *validation))
            eval_seconds += time.perf_counter() - eval_start
            history.append({"step": step, "train_loss": recent, "val_loss": val})
            bar.set_postfix(loss=f"{recent:.3f}", val=f"{val:.3f}")
            message = f"step {step:5d}  train loss {recent:.4f}  val loss {val:.4f}"
            (print if args.quiet else tqdm.write)(message)
    seconds = time.perf_counter() - start
    bar.close()

    # Only the adapters moved: the checkpoint's weights (now FrozenParams, under the LoRAs'
    # "base") are bit for bit the ones loaded.
    _, frozen_after = lm.split(model, variables, lm.Parameter, ...)
    base_unchanged = jax.tree.structure(frozen_before) == jax.tree.structure(frozen_after) and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after), strict=True)
    )

    # Fold the adapters in: a plain model (paths lose the LoRA's "base" level), saved as a
    # Hugging Face folder.
    merged_model, merged = lm.merge_lora(model, variables)
    probe = validation[0][: min(2, args.eval_windows)]
    adapted_logits = logits_of(model, variables, probe)
    merged_difference = float(np.abs(logits_of(merged_model, merged, probe) - adapted_logits).max())
    out_model = folder / "model"
    # `source`: the checkpoint's tokenizer and generation config go along (the random
    # model's temporary folder is gone: nothing to copy)
    models.save_pretrained(merged_model, merged, out_model, source=args.checkpoint)
    print(f"saved the merged model to {out_model}")
    reloaded_model, reloaded = models.from_pretrained(out_model)
    reloaded_difference = float(
        np.abs(logits_of(reloaded_model, reloaded, probe) - adapted_logits).max()
    )
    hf = transformers_logits(out_model, probe, args.quiet)
    hf_difference = None if hf is None else float(np.abs(hf - adapted_logits).max())
    return {
        "data": data_name,
        "data_path": data_described,
        "checkpoint": described,
        "model_type": config.model_type,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "rank": args.rank,
        "adapter_params": num_adapters,
        "total_params": num_total,
        "history": history,
        "train_loss_per_step": np.asarray(jax.device_get(losses), dtype=np.float32),
        "val_loss_before": val_before,
        "val_loss": history[-1]["val_loss"],
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "eval_seconds": eval_seconds,
        # the training steps after the first, evaluation excluded
        "ms_per_step": 1000 * (seconds - compile_seconds - eval_seconds) / max(args.steps - 1, 1),
        "base_unchanged": base_unchanged,
        "saved": out_model,
        "saved_files": sorted(p.name for p in out_model.iterdir()),
        "merged_max_logit_difference": merged_difference,
        "reloaded_max_logit_difference": reloaded_difference,
        "transformers_max_logit_difference": hf_difference,
    }


def print_results(results: dict) -> None:
    print(
        f"\n{results['rank']}-rank LoRA on {results['checkpoint']}: {len(results['history']) - 1} "
        f"evaluations, {results['ms_per_step']:.1f} ms per step after the first (which "
        f"compiled: {results['compile_seconds']:.1f} s), evaluation excluded"
    )
    state = "bit-identical to" if results["base_unchanged"] else "CHANGED from"
    print(f"the checkpoint's weights are {state} the ones loaded: only the adapters trained")
    print(
        f"validation loss {results['val_loss_before']:.4f} before, {results['val_loss']:.4f} "
        f"after; merged model's logits within {results['merged_max_logit_difference']:.1e} of "
        f"the adapted model's, reloaded by lamina within "
        f"{results['reloaded_max_logit_difference']:.1e}"
    )
    hf = results["transformers_max_logit_difference"]
    if hf is None:
        print("transformers is not installed: the folder was not loaded in PyTorch")
    else:
        print(f"loaded in transformers (PyTorch): logits within {hf:.1e} of the adapted model's")
    print(f"val loss: {results['val_loss']:.4f}")


# --- the command line -------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--checkpoint", metavar="DIR", help="a Hugging Face folder (default: a tiny random Llama)")
    add("--data", metavar="PATH", help="a UTF-8 text file (default: the stdlib's source)")
    add("--steps", type=int, default=300, help="training steps (default: %(default)s)")
    add("--batch-size", type=int, default=8, help="(default: %(default)s)")
    add("--block-size", type=int, default=64, help="tokens per window (default: %(default)s)")
    add("--rank", type=int, default=8, help="of every adapter (default: %(default)s)")
    add("--alpha", type=float, default=16.0, help="adapter scale alpha / rank (default: 16)")
    add("--lr", type=float, default=1e-2, help="AdamW's learning rate (default: %(default)s)")
    add(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "keep"),
        help="the weights' dtype for training ('keep': the checkpoint's; default: float32)",
    )
    add("--eval-interval", type=int, default=50, help="steps between evaluations (default: 50)")
    add("--eval-windows", type=int, default=16, help="validation windows (default: 16)")
    add("--seed", type=int, default=0, help="(default: %(default)s)")
    add(
        "--out",
        metavar="DIR",
        help="the folder for the merged model (<out>/model), metrics.json and curves.png "
        "(default: runs/finetune_llm-<date>-<time>, under the current folder)",
    )
    add("--quiet", action="store_true", help="no progress bar or model summary")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "rank", "eval_interval", "eval_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.lr <= 0:
        parser.error("--lr must be positive")
    if args.data and not pathlib.Path(args.data).is_file():
        parser.error(f"--data: no text file at {pathlib.Path(args.data).resolve()}")
    max_positions = max_position_embeddings(args.checkpoint)
    if max_positions is not None and args.block_size > max_positions:
        parser.error(
            f"--block-size {args.block_size} exceeds the model's max_position_embeddings "
            f"({max_positions}): use --block-size {max_positions} or less"
        )
    return args


def max_position_embeddings(checkpoint: str | None) -> int | None:
    """The model's longest sequence, from config.json; None when the folder has no readable
    one (loading it says why)."""
    if checkpoint is None:
        return tiny_config().max_position_embeddings
    try:
        with open(pathlib.Path(checkpoint) / "config.json") as f:
            return models.ModelConfig.from_hf(json.load(f)).max_position_embeddings
    except (OSError, ValueError, TypeError, KeyError):
        return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    folder = _common.run_folder(args, "finetune_llm")
    try:
        results = run(args, folder)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results)
    steps = np.arange(1, len(results["train_loss_per_step"]) + 1)
    panels = {
        "loss": {
            "train (each step)": (steps, results["train_loss_per_step"]),
            "validation": (
                [row["step"] for row in results["history"]],
                [row["val_loss"] for row in results["history"]],
            ),
        }
    }
    results["files"] = _common.save_run(folder, results, args, panels, "step")
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
