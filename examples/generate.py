"""Text generation from a Hugging Face checkpoint folder: `lamina.models` and `lm.generate`.

Loads a Llama-family folder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma: ``config.json``
and ``model.safetensors`` or its shards) with `lamina.models.from_pretrained`, no PyTorch
needed; tokenises the prompt with the folder's ``tokenizer.json`` (`lamina.models.load_tokenizer`,
through the `tokenizers` package), or takes the token ids themselves (``--prompt-ids``), which
a folder without ``tokenizer.json`` needs (a SentencePiece ``tokenizer.model`` is not read);
and writes the continuation with `lm.generate`: the prompt read in one call
(the prefill) into a static key/value cache, then one token per step in a compiled
``lax.while_loop``, the whole loop one program. Greedy by default (``--temperature 0``), or
sampled with a temperature, top-k and top-p (nucleus) filtering, as `transformers` does.
The prompt is tokenised as plain text: a chat template is not applied. lamina never
downloads: fetch a Hub model once, e.g. ``huggingface-cli download Qwen/Qwen2.5-0.5B
--local-dir Qwen2.5-0.5B``, and pass that folder.

    python examples/generate.py --checkpoint path/to/Qwen2.5-0.5B --prompt "The capital of France"
    python examples/generate.py --checkpoint DIR --prompt "Once upon" --temperature 0.8 --top-p 0.9
    python examples/generate.py --checkpoint DIR --prompt-ids 1 450 7483 --max-new-tokens 20
    python examples/generate.py                # no --checkpoint: a small random model, offline

Without ``--checkpoint`` it builds a small random Llama-shaped `lamina.models.CausalLM` (4
layers, width 256, 8 query heads sharing 2 key/value heads, a SwiGLU MLP, rotary positions)
whose vocabulary is the 256 byte values: the prompt is its UTF-8 bytes, and the output bytes
are decoded back (invalid sequences shown as U+FFFD). Byte ids are for this built-in model
only: a folder's vocabulary is its tokenizer's, whatever its size. Its text is noise, since
nothing was trained; it is there to show the program and the speed on a fresh machine, with
nothing to download.

It reports the compilation time (the first call compiles the whole loop), the prefill time (a
call that writes one token: the prompt's pass, plus one step), the decoding speed in tokens
per second (the steps after the first, timed apart from the prefill) and the text. The
timings are medians of ``--repeats`` runs after the compiling one. The loop is one compiled
program, so the new tokens come back together at its end: it cannot stream them one by one
as they are written (a Python loop over ``model(token, decode=True)`` steps can, see
docs/language-models.md, "The decoding cache"). ``--out DIR`` also saves
them with the command line in ``DIR/metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import lamina as lm
from lamina import models

BYTE_VOCAB = 256


# --- the model --------------------------------------------------------------------------


def random_config() -> models.ModelConfig:
    """A small Llama-shaped configuration over the 256 byte values."""
    return models.ModelConfig(
        model_type="llama",
        vocab_size=BYTE_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        norm_eps=1e-5,
    )


def random_model(seed: int, dtype) -> tuple[models.CausalLM, dict]:
    """A `CausalLM` of `random_config` with lamina's default initialisation."""
    param_dtype = jnp.float32 if dtype is None else dtype
    model = models.CausalLM(random_config(), param_dtype=param_dtype)
    variables = jax.jit(lm.transform(model).init)(jax.random.key(seed))
    return model, variables


def load(args) -> tuple[models.CausalLM, dict, object, str]:
    """``(model, variables, tokenizer, description)``; no tokenizer for the random model."""
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    if args.checkpoint is None:
        model, variables = random_model(args.seed, dtype)
        return model, variables, None, "a random Llama-shaped model over bytes (no --checkpoint)"
    folder = pathlib.Path(args.checkpoint)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder.resolve()} (--checkpoint)")
    model, variables = models.from_pretrained(folder, dtype=dtype)
    tokenizer = models.load_tokenizer(folder)
    return model, variables, tokenizer, f"{folder.resolve()} ({model.config.model_type})"


def prompt_ids(args, tokenizer, vocab_size: int, max_positions: int) -> np.ndarray:
    """The prompt as int32 token ids: --prompt-ids, the tokenizer's, or (the random model's
    vocabulary being the byte values) the UTF-8 bytes."""
    if args.prompt_ids is not None:
        ids = np.asarray(args.prompt_ids, dtype=np.int64)
        source = "--prompt-ids"
    elif tokenizer is not None:
        ids = np.asarray(tokenizer.encode(args.prompt).ids, dtype=np.int64)
        source = "the folder's tokenizer"
    elif args.checkpoint is None:
        ids = np.frombuffer(args.prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        source = "its UTF-8 bytes"
    else:
        raise ValueError(
            f"the checkpoint {args.checkpoint} has no tokenizer.json (only that file is read; "
            f"a SentencePiece tokenizer.model is not), so the text of --prompt cannot be "
            f"tokenised: give the prompt as token ids with --prompt-ids"
        )
    if ids.size == 0:
        raise ValueError(f"the prompt is empty ({source}): give at least one token")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"prompt token ids {sorted(set(bad.tolist()))[:5]} ({source}) are outside the "
            f"vocabulary [0, {vocab_size})"
        )
    if len(ids) + args.max_new_tokens > max_positions:
        fits = max_positions - len(ids)
        advice = (
            f"use --max-new-tokens {fits} or fewer, or a shorter prompt"
            if fits > 0
            else "use a shorter prompt"
        )
        raise ValueError(
            f"{len(ids)} prompt tokens plus --max-new-tokens {args.max_new_tokens} exceed the "
            f"model's max_position_embeddings ({max_positions}): {advice}"
        )
    return ids.astype(np.int32)


def decode(ids, tokenizer) -> str:
    """Token ids back to text: the tokenizer's, or the bytes as UTF-8."""
    ids = [int(i) for i in ids]
    if tokenizer is not None:
        return tokenizer.decode(ids)
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def continuation(prompt, out, tokenizer) -> tuple[str, str, str]:
    """``(prompt text, new text, whole text)`` of the prompt ids and the whole output `out`.

    The whole output is decoded once, and the new text is what follows the part it shares
    with the prompt's text: decoded apart, a SentencePiece-style (Metaspace) decoder drops
    the continuation's leading space, and a character's UTF-8 bytes may straddle the two.
    """
    prompt_text, whole = decode(prompt, tokenizer), decode(out, tokenizer)
    shared = next(
        (i for i, (a, b) in enumerate(zip(prompt_text, whole, strict=False)) if a != b),
        min(len(prompt_text), len(whole)),
    )
    return prompt_text, whole[shared:], whole


# --- generating and timing --------------------------------------------------------------


def run(args) -> dict:
    model, variables, tokenizer, description = load(args)
    config = model.config
    ids = prompt_ids(args, tokenizer, config.vocab_size, config.max_position_embeddings)
    params = sum(int(np.size(x)) for x in jax.tree.leaves(variables))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(variables)})
    print(f"model: {description}")
    print(
        f"  {config.num_layers} layers, width {config.hidden_size}, {config.num_heads} heads "
        f"({config.num_kv_heads} key/value), vocabulary {config.vocab_size:,}, "
        f"{params:,} parameters in {', '.join(dtypes)}"
    )
    eos_id = args.eos_id if args.eos_id is not None else (config.eos_token_id or None)
    rng = jax.random.key(args.seed)
    sampling = dict(temperature=args.temperature, eos_id=eos_id)
    if args.temperature > 0:
        sampling.update(top_k=args.top_k, top_p=args.top_p, rng=rng)

    def generate(max_new_tokens: int):
        out = lm.generate(model, variables, ids, max_new_tokens=max_new_tokens, **sampling)
        return np.asarray(jax.block_until_ready(out))

    bar = tqdm(total=2 + 2 * args.repeats, unit="call", disable=args.quiet, leave=False)
    lengths = {"prefill": 1, "generate": args.max_new_tokens}
    compile_seconds = {}
    for phase, new in lengths.items():
        bar.set_description(f"compiling ({phase})")
        start = time.perf_counter()
        out = generate(new)  # the first call compiles the loop for this length
        compile_seconds[phase] = time.perf_counter() - start
        bar.update(1)
    # The timed calls alternate, so that the machine's drift hits both alike.
    timings: dict[str, list[float]] = {"prefill": [], "generate": []}
    bar.set_description("timing")
    for _ in range(args.repeats):
        for phase, new in lengths.items():
            start = time.perf_counter()
            out = generate(new)
            timings[phase].append(time.perf_counter() - start)
            if phase == "generate":  # the last call's new tokens per second, prefill included
                bar.set_postfix(tokens_per_s_with_prefill=f"{new / timings[phase][-1]:,.0f}")
            bar.update(1)
    bar.close()

    # the compilation: each program's first call less a later call's median
    first_calls = dict(compile_seconds)
    for phase in compile_seconds:
        compile_seconds[phase] = max(first_calls[phase] - statistics.median(timings[phase]), 0.0)
    new_ids = out[len(ids) :]
    prompt_text, text, whole = continuation(ids, out, tokenizer)
    prefill = statistics.median(timings["prefill"])
    total = statistics.median(timings["generate"])
    decoded_steps = len(new_ids) - 1  # the first new token comes with the prefill
    # None when the decoding steps took less than the timing noise (a handful of tokens)
    tokens_per_second = decoded_steps / (total - prefill) if total > prefill else None
    return {
        "model": description,
        "model_type": config.model_type,
        "parameters": params,
        "prompt_tokens": len(ids),
        "new_tokens": len(new_ids),
        "stopped_at_eos": len(new_ids) < args.max_new_tokens,
        "compile_seconds": compile_seconds["generate"],
        "prefill_compile_seconds": compile_seconds["prefill"],
        "prefill_seconds": prefill,
        "generate_seconds": total,
        "decode_tokens_per_second": tokens_per_second,
        "tokens_per_second_overall": len(new_ids) / total,
        "prompt_ids": ids.tolist(),
        "new_ids": new_ids.tolist(),
        "text": text,
        "prompt_text": prompt_text,
        "whole_text": whole,
    }


def print_results(results: dict, args) -> None:
    mode = (
        "greedy"
        if args.temperature == 0
        else f"sampled: temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    )
    print(f"\n{results['whole_text']}\n")
    speed = results["decode_tokens_per_second"]
    decode_text = (
        f"{speed:,.1f} tokens/s decoding"
        if speed
        else "too few new tokens to time the decoding apart from the prefill"
    )
    print(
        f"{results['new_tokens']} new tokens ({mode}"
        f"{', stopped at the end-of-sequence token' if results['stopped_at_eos'] else ''}) "
        f"after {results['prompt_tokens']} prompt tokens: prefill "
        f"{1000 * results['prefill_seconds']:.1f} ms, {decode_text}, "
        f"{results['generate_seconds']:.3f} s in all "
        f"({results['tokens_per_second_overall']:,.1f} tokens/s overall, prefill included; "
        f"median of {args.repeats})"
    )
    print(
        f"compiling (the first call's time less a later one's): "
        f"{results['compile_seconds']:.1f} s for the {args.max_new_tokens}-token loop, "
        f"{results['prefill_compile_seconds']:.1f} s for the one-token (prefill) program"
    )


# --- the command line -------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--checkpoint",
        metavar="DIR",
        help="a Hugging Face folder: config.json, *.safetensors, tokenizer.json (default: a "
        "small random model over bytes)",
    )
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="The meaning of life is", help="the text to continue")
    prompt.add_argument(
        "--prompt-ids",
        metavar="ID",
        type=int,
        nargs="+",
        help="the prompt as token ids (needed for a folder without tokenizer.json)",
    )
    add("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    add(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy decoding; above, sampling (default: %(default)s)",
    )
    add("--top-k", type=int, help="sample among the k likeliest tokens (with --temperature)")
    add(
        "--top-p",
        type=float,
        help="sample among the likeliest tokens holding this probability (with --temperature)",
    )
    add("--eos-id", type=int, help="stop at this token (default: the config's eos_token_id)")
    add("--seed", type=int, default=0, help="sampling key, and the random model's (default: 0)")
    add(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="cast the weights (default: the checkpoint's own; float32 for the random model)",
    )
    add("--repeats", type=int, default=3, help="timed runs after the first (default: 3)")
    add("--out", metavar="DIR", help="save metrics.json there")
    add("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeats < 1:
        parser.error("--max-new-tokens and --repeats must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must not be negative")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        parser.error("--top-k and --top-p filter sampling: give a --temperature above 0 too")
    if args.top_k is not None and args.top_k < 1:
        parser.error("--top-k must be at least 1")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        parser.error("--top-p must be in (0, 1]")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        results = run(args)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print_results(results, args)
    if args.out:
        folder = pathlib.Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"command": [pathlib.Path(sys.argv[0]).name, *sys.argv[1:]], "args": vars(args)}
        path = folder / "metrics.json"
        path.write_text(json.dumps({**record, **results}, indent=2) + "\n")
        results["files"] = {"metrics": path}
        print(f"saved the metrics to {path}")
    return results


if __name__ == "__main__":
    main()
