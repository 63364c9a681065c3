"""GPT-2 in lamina, with its weights imported from a Hugging Face `transformers` model.

The lamina model is GPT-2 as `transformers` defines it: token and position embeddings, pre-norm
blocks (``ln_1``, causal self-attention, ``ln_2``, an MLP with GELU's tanh approximation,
``gelu_new``), a final ``ln_f`` and an output layer tied to the token embedding. The weights come
from the PyTorch model's ``state_dict()`` through `lm.from_torch`, which shows both of its hooks:

- ``rename`` drops the ``transformer.`` prefix (lamina's model *is* the transformer) and the
  tied ``lm_head.weight`` (lamina's output layer reads the token embedding, ``wte.attend``);
- Hugging Face stores its projections as ``Conv1D``, a linear layer whose weight is ``(in,
  out)``, and the attention's query, key and value in one ``c_attn``: two lamina subclasses,
  `Conv1D` (of `lm.Dense`) and `GPT2Attention` (of `lm.MultiHeadAttention`), get converters of
  their own with `lm.register_torch`.

It checks that lamina's logits equal PyTorch's, then generates greedily, decoding one token
at a time with the attention layers' `Cache`, and checks that `transformers`' ``generate``
picks the same tokens:

    python examples/import_gpt2.py                          # a small random GPT-2 (offline)
    python examples/import_gpt2.py --checkpoint DIR --prompt "Hello, my name is"

``--checkpoint`` is a folder of your own with a Hugging Face GPT-2 (``config.json`` and the
weights, e.g. from ``save_pretrained``); it is read with ``local_files_only=True``, so nothing
is downloaded, and its tokenizer is used when the folder has one. The last line printed is a
summary: ``logits max |diff| ...; generated N tokens, same as transformers: True``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm

# --- the model --------------------------------------------------------------------------


class Conv1D(lm.Dense):
    """Hugging Face's ``Conv1D``: a linear layer whose PyTorch weight is ``(in, out)``."""


class GPT2Attention(lm.MultiHeadAttention):
    """GPT-2's causal self-attention; in PyTorch ``c_attn`` (q, k, v together) and ``c_proj``."""


class Mlp(lm.Module):
    """``c_proj(gelu_new(c_fc(x)))``."""

    def __init__(self, width):
        super().__init__()
        self.c_fc = Conv1D(width, 4 * width)
        self.c_proj = Conv1D(4 * width, width)

    def __call__(self, x):
        return self.c_proj(lm.gelu(self.c_fc(x), approximate=True))


class Block(lm.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, width, heads, epsilon, decode_shape):
        super().__init__()
        self.ln_1 = lm.LayerNorm(width, epsilon=epsilon)
        self.attn = GPT2Attention(heads, width, decode_shape=decode_shape)
        self.ln_2 = lm.LayerNorm(width, epsilon=epsilon)
        self.mlp = Mlp(width)

    def __call__(self, x, decode):
        x = x + self.attn(self.ln_1(x), causal=True, decode=decode)
        return x + self.mlp(self.ln_2(x))


class GPT2(lm.Module):
    """GPT-2 (``GPT2LMHeadModel`` without dropout): ids ``(batch, length)`` to logits.

    With `decode_batch`, the attention layers hold a cache for that many sequences of up to
    ``n_positions`` tokens: ``model(ids, start=n, decode=True)`` reads the tokens at positions
    ``n, n + 1, ...`` after the cached ones.
    """

    def __init__(self, config, decode_batch=None):
        super().__init__()
        width, positions = config.n_embd, config.n_positions
        decode_shape = None if decode_batch is None else (decode_batch, positions)
        self.wte = lm.Embed(config.vocab_size, width)
        self.wpe = lm.Embed(positions, width)
        epsilon = config.layer_norm_epsilon
        self.h = [Block(width, config.n_head, epsilon, decode_shape) for _ in range(config.n_layer)]
        self.ln_f = lm.LayerNorm(width, epsilon=epsilon)

    def __call__(self, ids, *, start=0, decode=False):
        positions = start + jnp.arange(ids.shape[-1], dtype=jnp.int32)
        x = self.wte(ids) + self.wpe(positions)[None]
        for block in self.h:
            x = block(x, decode)
        return self.wte.attend(self.ln_f(x))  # lm_head, tied to wte


# --- the converters: Hugging Face's layouts ----------------------------------------------


def conv1d_to_lamina(layer, tensors):
    """``Conv1D`` stores ``(in, out)``, lamina's kernel layout: nothing to transpose."""
    return {"kernel": tensors["weight"], "bias": tensors["bias"]}


def conv1d_to_torch(layer, arrays):
    return {"weight": arrays["kernel"], "bias": arrays["bias"]}


def attention_to_lamina(layer, tensors):
    """``c_attn`` ``(width, 3 * width)``: the query, key and value columns, head by head."""
    heads = (layer.num_heads, layer.head_dim)
    kernels = np.split(tensors["c_attn.weight"], 3, axis=1)
    biases = np.split(tensors["c_attn.bias"], 3)
    out = {}
    for name, kernel, bias in zip(("query", "key", "value"), kernels, biases, strict=True):
        out[f"{name}/kernel"] = kernel.reshape(layer.in_size, *heads)
        out[f"{name}/bias"] = bias.reshape(heads)
    out["out/kernel"] = tensors["c_proj.weight"].reshape(*heads, layer.out_size)
    out["out/bias"] = tensors["c_proj.bias"]
    return out


def attention_to_torch(layer, arrays):
    names = ("query", "key", "value")
    return {
        "c_attn.weight": np.concatenate(
            [arrays[f"{n}/kernel"].reshape(layer.in_size, -1) for n in names], axis=1
        ),
        "c_attn.bias": np.concatenate([arrays[f"{n}/bias"].reshape(-1) for n in names]),
        "c_proj.weight": arrays["out/kernel"].reshape(-1, layer.out_size),
        "c_proj.bias": arrays["out/bias"],
    }


lm.register_torch(Conv1D, conv1d_to_lamina, conv1d_to_torch)
lm.register_torch(GPT2Attention, attention_to_lamina, attention_to_torch)

# lamina's model is the `transformer`; its output layer is the token embedding (tied).
RENAME = {"transformer.": "", "lm_head.": None}


def convert(model, state_dict):
    """The lamina variables of a ``GPT2LMHeadModel``'s ``state_dict()``."""
    head, embedding = state_dict.get("lm_head.weight"), state_dict["transformer.wte.weight"]
    if head is not None and not np.array_equal(np.asarray(head), np.asarray(embedding)):
        raise ValueError(
            "this checkpoint's lm_head.weight differs from transformer.wte.weight, but GPT-2 "
            "ties them and this model reads the output layer from the token embedding."
        )
    return lm.from_torch(model, state_dict, rename=RENAME)


# --- generation -----------------------------------------------------------------------------


def generate(config, variables, prompt, num_tokens):
    """Greedy decoding: `prompt` ``(batch, length)`` ids, then `num_tokens` more (argmax).

    The prompt is read in one step, then each new token in a step of one position, with the
    cache of the attention layers (`variables` from a `GPT2` built with ``decode_batch``).
    """
    prompt = np.asarray(prompt, np.int32)
    if prompt.shape[1] + num_tokens > config.n_positions:
        raise ValueError(
            f"{prompt.shape[1]} prompt tokens and {num_tokens} new ones exceed GPT-2's "
            f"n_positions={config.n_positions}."
        )
    apply = lm.transform(GPT2(config, decode_batch=prompt.shape[0])).apply

    @jax.jit
    def step(params, cache, ids, start):
        logits, new = apply({"params": params, "cache": cache}, None, ids, start=start, decode=True)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), new["cache"]

    params, cache = variables["params"], variables["cache"]
    token, cache = step(params, cache, jnp.asarray(prompt), 0)
    tokens = [token]
    for i in range(1, num_tokens):
        token, cache = step(params, cache, token[:, None], prompt.shape[1] + i - 1)
        tokens.append(token)
    return np.concatenate([prompt, np.stack(tokens, axis=1)], axis=1)


# --- the command line ---------------------------------------------------------------------


def load_torch_model(args):
    """The PyTorch model (and tokenizer, or None): the user's folder, or a small random one."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    if args.checkpoint:
        model = GPT2LMHeadModel.from_pretrained(args.checkpoint, local_files_only=True)
        tokenizer = None
        if any(
            os.path.exists(os.path.join(args.checkpoint, name))
            for name in ("tokenizer.json", "vocab.json", "tokenizer_config.json")
        ):
            tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
        return model.eval(), tokenizer
    torch.manual_seed(args.seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # larger weights than GPT-2's initialisation: varied tokens
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    return model, None


def generate_with_transformers(torch_model, prompt, num_tokens):
    """`transformers`' greedy ``generate``, never stopping early at an end-of-text token.

    ``generate`` fills settings left None from the model's own generation config, so the end
    token is switched off there, for this call.
    """
    import torch

    ids = torch.from_numpy(np.asarray(prompt, np.int64))
    saved = torch_model.generation_config
    torch_model.generation_config = copy.deepcopy(saved)
    torch_model.generation_config.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    try:
        with torch.no_grad():
            out = torch_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False
            )
    finally:
        torch_model.generation_config = saved
    return out.numpy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a folder with a Hugging Face GPT-2 of your own")
    parser.add_argument("--prompt", default="Hello, my name is", help="text (with a tokenizer)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0, help="of the random model")
    args = parser.parse_args(argv)

    import torch

    torch_model, tokenizer = load_torch_model(args)
    config = torch_model.config
    if tokenizer is not None:
        prompt = np.asarray(tokenizer([args.prompt])["input_ids"], np.int32)
    else:
        prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, (2, 5))
    tick = time.perf_counter()
    model = GPT2(config, decode_batch=prompt.shape[0])
    variables = convert(model, torch_model.state_dict())
    seconds = time.perf_counter() - tick
    print(f"converted {len(torch_model.state_dict())} tensors in {seconds:.2f} s")

    ids = torch.from_numpy(prompt.astype(np.int64))
    with torch.no_grad():
        expected = torch_model(ids).logits.numpy()
    logits, _ = lm.transform(model).apply(variables, None, jnp.asarray(prompt))
    difference = float(np.max(np.abs(np.asarray(logits) - expected)))
    print(f"logits of the prompt, lamina vs PyTorch: max |diff| = {difference:.2e}")

    tokens = generate(config, variables, prompt, args.tokens)
    reference = generate_with_transformers(torch_model, prompt, args.tokens)
    same = bool(np.array_equal(tokens, reference))
    for row in tokens:
        print(repr(tokenizer.decode(row)) if tokenizer is not None else row.tolist())
    print(
        f"logits max |diff| {difference:.2e}; generated {args.tokens} tokens, "
        f"same as transformers: {same}"
    )
    return {"logits_difference": difference, "tokens": tokens, "reference": reference, "same": same}


if __name__ == "__main__":
    main()
