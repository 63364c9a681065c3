"""A Llama-shaped language model: generation against transformers and a hand-written JAX loop,
compile time against depth, and an AdamW training step against Flax NNX.

The model is the issue's: 4 layers, width 256, 8 query heads sharing 2 key/value heads (head
size 32), a SwiGLU MLP of 688, rotary positions, RMSNorm, an untied output layer over a
vocabulary of 32,000; random weights (lamina's `init`), the same in every contestant.

- Generation (rows ``llm_prefill_b{B}`` and ``llm_decode_b{B}``, batch 1 and 8, prompt 128,
  128 new tokens, greedy): lamina's `lm.generate` (prefill in one call into a static cache,
  then a compiled ``lax.while_loop``); a hand-written raw-JAX loop doing the same with the
  same weights (the layers as one ``lax.scan`` over stacked weights, a static cache updated
  with ``dynamic_update_slice``, grouped-query attention without copying the key/value
  heads, the output layer run on the prompt's last position alone, as lamina's and
  transformers' ``generate`` do, prefill and ``lax.while_loop`` in one ``jax.jit``); and
  `transformers` (PyTorch on the CPU, its own dynamic KV cache,
  ``generate(do_sample=False)``) reading the same weights
  from a folder written by `lamina.models.save_pretrained`. The prefill row is the time of a
  call that writes one token; the decode row is the time per decoding step after it,
  ``(t(128 new) - t(1 new)) / 127``, each run of 128 less the fastest run of 1 (the tokens
  per second are in the row's ``extra``).
  The raw-JAX loop is the base of the ratios; transformers' figure, which has no column in
  the table, is in ``extra`` and in the targets. All three must write the same first tokens
  (checked before any timing), then take turns round by round (5 rounds each, transformers
  included), so that the machine's drift hits all alike.
- Compile time (rows ``compile_llm_{n}``, n = 4, 16, 64 layers): ``jax.jit(...).lower(...)
  .compile()`` of the forward pass (logits of a 128-token prompt), lamina's `CausalLM`
  (its layers are an `lm.Stack`: one block traced, a scan) against the raw-JAX forward
  (a ``lax.scan`` over stacked weights); abstract inputs, no weights allocated. run.py's
  target: the deepest at most 1.5x the shallowest.
- Training (row ``train_llm``): one ``jax.jit``-ed AdamW step (cross-entropy of next tokens,
  batch 8 of 128 tokens) of lamina's `CausalLM`, of the raw-JAX forward, and of the same
  network in Flax NNX (a plain list of blocks, `nnx.List`, each of `nnx.LinearGeneral`
  projections, `nnx.RMSNorm`, `nnx.Linear`; run as ``nnx.merge`` inside ``jax.jit``, as in
  the other parts); same weights, same loss checked first.

PyTorch and transformers are optional: without them the generation rows keep the JAX
columns and say so. Run:

    python benchmarks/llm.py             # the issue's sizes (several minutes on 2 cores)
    python benchmarks/llm.py --quick     # batch 1 alone, depths 4 and 64 alone
    python benchmarks/llm.py --smoke     # tiny sizes, batch 2 alone: checks that it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lamina as lm
from lamina import models

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _harness import COLUMNS, Row, blocking, check_same, interleaved, row_from_samples


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 4
    width: int = 256
    heads: int = 8
    kv_heads: int = 2
    mlp: int = 688
    vocab: int = 32_000
    prompt: int = 128
    new_tokens: int = 128
    batches: tuple[int, ...] = (1, 8)
    depths: tuple[int, ...] = (4, 16, 64)
    train_batch: int = 8
    rounds: int = 5  # timed samples of each contestant, transformers' included
    number: int = 1  # generate calls per timed sample

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


SIZES = {
    "full": Sizes(),
    # batch 1, depths 4 and 64 alone; the full rounds (5): fewer would not be a measurement
    "quick": Sizes(batches=(1,), depths=(4, 64)),
    # checks that it runs, not a measurement: the fewest calls that exercise every path
    "smoke": Sizes(
        layers=1,
        width=32,
        heads=4,
        kv_heads=2,
        mlp=48,
        vocab=256,
        prompt=8,
        new_tokens=64,  # so that decoding outweighs the timing noise of a busy machine
        batches=(2,),  # a batch: the same code as batch 1, each batch size compiled anew
        depths=(1, 2),
        train_batch=2,
        rounds=2,
        number=1,
    ),
}
THETA, EPS = 10_000.0, 1e-5
NO_PEER = "no generation loop or checkpoint loader of its own: see transformers in extra"
NOT_HERE = "not written for this row (the issue compares with Flax NNX)"


def config(sizes: Sizes, layers: int | None = None) -> models.ModelConfig:
    return models.ModelConfig(
        model_type="llama",
        vocab_size=sizes.vocab,
        hidden_size=sizes.width,
        intermediate_size=sizes.mlp,
        num_layers=sizes.layers if layers is None else layers,
        num_heads=sizes.heads,
        num_kv_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=4096,
        rope_theta=THETA,
        norm_eps=EPS,
    )


# --- the hand-written model -------------------------------------------------------------


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return scale * normed.astype(x.dtype)


def rope(x, positions):
    """Half-split rotary embedding of ``x (B, T, N, D)`` at int ``positions (B, T)``."""
    d = x.shape[-1]
    inv_freq = 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, D/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    rotated = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def attend(q, k, v, allowed):
    """Grouped-query attention: ``q (B, T, N, D)``, ``k, v (B, S, K, D)``, ``allowed (T, S)``."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k) * d**-0.5
    logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, n, d)


def mlp(x, p):
    return (jax.nn.silu(x @ p["gate"]["kernel"]) * (x @ p["up"]["kernel"])) @ p["down"]["kernel"]


def block(h, p, k_cache, v_cache, positions, index):
    """One decoder layer. With caches (``(B, S, K, D)``), writes slots ``[index, index + T)``
    and attends to the cache; without (None), attends causally within `h`."""
    a = rms_norm(h, p["attention_norm"]["scale"])
    att = p["attention"]
    q = rope(jnp.einsum("bth,hnd->btnd", a, att["query"]["kernel"]), positions)
    k = rope(jnp.einsum("bth,hnd->btnd", a, att["key"]["kernel"]), positions)
    v = jnp.einsum("bth,hnd->btnd", a, att["value"]["kernel"])
    if k_cache is not None:
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
        k, v = k_cache, v_cache
    t, s = h.shape[1], k.shape[1]
    allowed = jnp.arange(s)[None, :] <= index + jnp.arange(t)[:, None]
    o = attend(q, k, v, allowed)
    h = h + jnp.einsum("btnd,ndh->bth", o, att["out"]["kernel"])
    return h + mlp(rms_norm(h, p["mlp_norm"]["scale"]), p["mlp"]), k_cache, v_cache


def forward(params, ids, caches, index, last_only=False):
    """Logits of ``ids (B, T)`` after the ``index`` cached tokens; the updated caches.

    ``last_only``: the logits of the last position alone, ``(B, 1, vocab)`` (the output
    layer is most of a prefill's work; generation reads the last position only).
    """
    b, t = ids.shape
    positions = jnp.broadcast_to(index + jnp.arange(t), (b, t))
    h = params["embed"]["embedding"][ids]

    def layer(h, xs):
        p, k_cache, v_cache = xs
        h, k_cache, v_cache = block(h, p, k_cache, v_cache, positions, index)
        return h, (k_cache, v_cache)

    h, caches = jax.lax.scan(layer, h, (params["layers"]["block"], *caches))
    if last_only:
        h = h[:, -1:]
    h = rms_norm(h, params["final_norm"]["scale"])
    return h @ params["lm_head"]["kernel"], caches


def full_forward(params, ids):
    """Logits of a whole sequence, no cache (the compile and training rows)."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def layer(h, p):
        return block(h, p, None, None, positions, 0)[0], None

    h, _ = jax.lax.scan(layer, params["embed"]["embedding"][ids], params["layers"]["block"])
    return rms_norm(h, params["final_norm"]["scale"]) @ params["lm_head"]["kernel"]


@functools.partial(jax.jit, static_argnames="max_new_tokens")
def raw_generate(params, prompt, max_new_tokens):
    """Greedy decoding: prefill (the last position's logits alone), then a
    ``lax.while_loop`` of one token per step."""
    b, t = prompt.shape
    n = params["layers"]["block"]["attention_norm"]["scale"].shape[0]
    kv, d = params["layers"]["block"]["attention"]["key"]["kernel"].shape[-2:]
    shape = (n, b, t + max_new_tokens, kv, d)
    caches = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    logits, caches = forward(params, prompt, caches, 0, last_only=True)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)
    out = jnp.zeros((b, max_new_tokens), prompt.dtype).at[:, 0].set(token)

    def step(carry):
        i, token, out, caches = carry
        logits, caches = forward(params, token[:, None], caches, t + i - 1)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)
        return i + 1, token, out.at[:, i].set(token), caches

    _, _, out, _ = jax.lax.while_loop(
        lambda c: c[0] < max_new_tokens, step, (jnp.int32(1), token, out, caches)
    )
    return jnp.concatenate([prompt, out], axis=1)


# --- Flax NNX ---------------------------------------------------------------------------


def nnx_model(sizes: Sizes, params):
    """The same network in Flax NNX with lamina's weights: ``(forward(state, ids), state)``."""
    from flax import nnx

    width, heads, kv, d = sizes.width, sizes.heads, sizes.kv_heads, sizes.head_dim

    class Attention(nnx.Module):
        def __init__(self, rngs):
            def proj(n):
                return nnx.LinearGeneral(width, (n, d), use_bias=False, rngs=rngs)

            self.query, self.key, self.value = proj(heads), proj(kv), proj(kv)
            self.out = nnx.LinearGeneral(
                (heads, d), width, axis=(-2, -1), use_bias=False, rngs=rngs
            )

        def __call__(self, x, positions, allowed):
            q, k = rope(self.query(x), positions), rope(self.key(x), positions)
            return self.out(attend(q, k, self.value(x), allowed))

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.gate = nnx.Linear(width, sizes.mlp, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(width, sizes.mlp, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(sizes.mlp, width, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.silu(self.gate(x)) * self.up(x))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention_norm = nnx.RMSNorm(width, epsilon=EPS, rngs=rngs)
            self.attention = Attention(rngs)
            self.mlp_norm = nnx.RMSNorm(width, epsilon=EPS, rngs=rngs)
            self.mlp = Mlp(rngs)

        def __call__(self, h, positions, allowed):
            h = h + self.attention(self.attention_norm(h), positions, allowed)
            return h + self.mlp(self.mlp_norm(h))

    class Llama(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(sizes.vocab, width, rngs=rngs)
            self.layers = nnx.List([Block(rngs) for _ in range(sizes.layers)])
            self.final_norm = nnx.RMSNorm(width, epsilon=EPS, rngs=rngs)
            self.lm_head = nnx.Linear(width, sizes.vocab, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            b, t = ids.shape
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
            allowed = jnp.tril(jnp.ones((t, t), bool))
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h, positions, allowed)
            return self.lm_head(self.final_norm(h))

    # abstract: the weights are lamina's, so nothing is initialised (eagerly, op by op)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(nnx.Rngs(0))))
    pure = nnx.to_pure_dict(state)
    stacked = params["layers"]["block"]
    pure["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(sizes.layers)}
    for name in ("embed", "final_norm", "lm_head"):
        pure[name] = params[name]
    nnx.replace_by_pure_dict(state, pure)
    return (lambda state, ids: nnx.merge(graphdef, state)(ids)), state


# --- the rows ---------------------------------------------------------------------------


def lamina_model(sizes: Sizes, layers: int | None = None):
    model = models.CausalLM(config(sizes, layers))
    return model, jax.jit(lm.transform(model).init)(jax.random.key(0))


def generation_rows(sizes: Sizes, model, variables) -> list[Row]:
    params = variables["params"]
    torch_model, torch_note = transformers_model(model, variables)
    rows = []
    for batch in sizes.batches:
        prompt = jax.random.randint(
            jax.random.key(batch), (batch, sizes.prompt), 0, sizes.vocab, jnp.int32
        )

        def lamina_fn(new, prompt=prompt):
            return blocking(
                functools.partial(lm.generate, max_new_tokens=new), model, variables, prompt
            )

        def jax_fn(new, prompt=prompt):
            return blocking(raw_generate, params, prompt, new)

        fns = {new: {"jax": jax_fn(new), "lamina": lamina_fn(new)} for new in (1, sizes.new_tokens)}
        outputs = {name: np.asarray(fn()) for name, fn in fns[sizes.new_tokens].items()}
        if torch_model is not None:
            outputs["transformers"] = torch_generate(torch_model, prompt, sizes.new_tokens)
        first = sizes.prompt + min(4, sizes.new_tokens)  # later tokens may differ by a near tie
        check_same({k: v[:, :first] for k, v in outputs.items()}, rtol=0, atol=0)
        generated = {k: v[:, sizes.prompt :] for k, v in outputs.items()}
        agree = {
            k: float((v == generated["jax"]).mean()) for k, v in generated.items() if k != "jax"
        }
        if torch_model is not None:  # timed in turn with the others, round by round
            for new in fns:
                fns[new]["transformers"] = functools.partial(
                    torch_generate, torch_model, prompt, new
                )
        samples = {new: interleaved(fns[new], sizes.rounds, sizes.number, warmup=1) for new in fns}
        steps = sizes.new_tokens - 1
        # Each full run less the fastest prefill: the noise floor, not another run's noise
        decode = {
            name: [
                (full - min(samples[1][name])) / steps for full in samples[sizes.new_tokens][name]
            ]
            for name in ("jax", "lamina")
        }
        extra: dict = {"batch": batch, "token_agreement_with_raw_jax": agree}
        prefill_extra, decode_extra = dict(extra), dict(extra)
        if torch_model is not None:
            torch_samples = {new: samples[new].pop("transformers") for new in samples}
            prefill_t = float(np.median(torch_samples[1]))
            decode_t = (
                float(np.median(torch_samples[sizes.new_tokens])) - min(torch_samples[1])
            ) / steps
            prefill_extra["transformers"] = prefill_t * 1e3
            decode_extra["transformers"] = decode_t * 1e3
        notes = {c: NO_PEER for c in COLUMNS if c not in ("jax", "lamina")}
        if torch_model is None:
            notes["lamina"] = torch_note
        prefill_row = row_from_samples(
            f"llm_prefill_b{batch}",
            f"LLM prefill, {sizes.prompt} tokens, batch {batch}",
            "ms",
            samples[1],
            1e3,
            notes=dict(notes),
            extra=prefill_extra,
        )
        decode_row = row_from_samples(
            f"llm_decode_b{batch}",
            f"LLM decode step, batch {batch} ({sizes.new_tokens} new tokens)",
            "ms",
            decode,
            1e3,
            notes=dict(notes),
            extra=decode_extra,
        )
        decode_row.extra["tokens_per_second"] = {
            name: batch * 1e3 / value for name, value in decode_row.values.items()
        }
        if "transformers" in decode_extra:
            decode_row.extra["tokens_per_second"]["transformers"] = (
                batch * 1e3 / decode_extra["transformers"]
            )
        for row in (prefill_row, decode_row):
            if "transformers" in row.extra:
                row.extra["lamina_over_transformers"] = (
                    row.values["lamina"] / row.extra["transformers"]
                )
        rows += [prefill_row, decode_row]
    return rows


def transformers_model(model, variables):
    """transformers' model of the same weights (a save_pretrained folder), or a reason."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        return None, f"transformers not measured: {error}"
    with tempfile.TemporaryDirectory() as folder:
        models.save_pretrained(model, variables, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return hf.eval(), None


def torch_generate(hf, prompt, new_tokens: int) -> np.ndarray:
    import torch

    ids = torch.tensor(np.asarray(prompt), dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            top_k=None,
            top_p=None,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out.numpy()


def _compile(fn, *args) -> None:
    jax.jit(fn).lower(*args).compile()


def compile_rows(sizes: Sizes) -> list[Row]:
    rows = []
    for depth in sizes.depths:
        model = models.CausalLM(config(sizes, depth))
        init, apply = lm.transform(model)
        shapes = jax.eval_shape(init, jax.random.key(0))
        ids = jax.ShapeDtypeStruct((1, sizes.prompt), jnp.int32)

        def lamina_forward(v, x, apply=apply):
            return apply(v, None, x)[0]

        fns = {
            "jax": functools.partial(_compile, full_forward, shapes["params"], ids),
            "lamina": functools.partial(_compile, lamina_forward, shapes, ids),
        }
        samples: dict[str, list[float]] = {"jax": [], "lamina": []}
        for _ in range(max(sizes.rounds // 2, 1)):
            for name, fn in fns.items():
                jax.clear_caches()
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
        rows.append(
            row_from_samples(
                f"compile_llm_{depth}",
                f"LLM trace + compile, {depth} layers",
                "s",
                samples,
                notes={c: "not measured in this part" for c in COLUMNS if c not in fns},
                extra={"depth": depth, "kind": "llm forward"},
            )
        )
    return rows


def training_row(sizes: Sizes, model, variables) -> Row:
    params = variables["params"]
    _, apply = lm.transform(model)
    nnx_forward, nnx_state = nnx_model(sizes, params)
    contestants = {
        "jax": (full_forward, params),
        "lamina": (lambda v, x: apply(v, None, x)[0], variables),
        "nnx": (nnx_forward, nnx_state),
    }
    ids = jax.random.randint(
        jax.random.key(1), (sizes.train_batch, sizes.prompt + 1), 0, sizes.vocab, jnp.int32
    )
    inputs, targets = ids[:, :-1], ids[:, 1:]
    optimizer = optax.adamw(1e-4)
    steps, losses = {}, {}
    for name, (fn, weights) in contestants.items():

        def loss_fn(weights, inputs, targets, fn=fn):
            logits = fn(weights, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        def step(weights, opt_state, inputs, targets, loss_fn=loss_fn):
            loss, grads = jax.value_and_grad(loss_fn)(weights, inputs, targets)
            updates, opt_state = optimizer.update(grads, opt_state, weights)
            return optax.apply_updates(weights, updates), opt_state, loss

        opt_state = optimizer.init(weights)
        jitted = jax.jit(step)
        losses[name] = jitted(weights, opt_state, inputs, targets)[2]  # compiles it, too
        steps[name] = blocking(jitted, weights, opt_state, inputs, targets)
    check_same(losses, rtol=1e-4, atol=1e-5)
    samples = interleaved(steps, sizes.rounds, 2 if sizes.rounds > 2 else 1)
    return row_from_samples(
        "train_llm",
        f"LLM AdamW step, batch {sizes.train_batch} x {sizes.prompt}",
        "ms",
        samples,
        1e3,
        notes={c: NOT_HERE for c in COLUMNS if c not in contestants},
        extra={"nnx_layers": "a plain list of blocks (nnx.List)"},
    )


def collect(mode: str) -> list[Row]:
    """The rows of this part, for `benchmarks/run.py`."""
    sizes = SIZES[mode]
    model, variables = lamina_model(sizes)
    rows = generation_rows(sizes, model, variables)
    rows += compile_rows(sizes)
    rows.append(training_row(sizes, model, variables))
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="batch 1, depths 4 and 64 alone")
    group.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--json", metavar="PATH", help="also write the rows there")
    args = parser.parse_args(argv)
    rows = collect("smoke" if args.smoke else "quick" if args.quick else "full")
    for row in rows:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in row.ratios().items())
        line = f"{row.label}: " + ", ".join(
            f"{k} {v:.4g} {row.unit}" for k, v in row.values.items()
        )
        if "transformers" in row.extra:
            line += (
                f", transformers {row.extra['transformers']:.4g} {row.unit} "
                f"(lamina / transformers {row.extra['lamina_over_transformers']:.3g})"
            )
        print(f"{line}; ratios to {row.base}: {ratios}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([r.as_dict() for r in rows], indent=2))
    return rows


if __name__ == "__main__":
    main()
