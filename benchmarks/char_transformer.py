"""Milliseconds per training step of the char transformer: lamina beside Linen, NNX, Haiku, Equinox.

The lamina model is `examples/char_transformer.py`'s own (`CharTransformer`, its `lm.Stack`
of pre-norm blocks, its AdamW); Flax Linen, Flax NNX, Haiku and Equinox build the same
network (same layers and shapes, LayerNorm epsilon, GELU, tied output layer) and train it
with the same optimiser (weight decay on the same matrices), each twice: with its scan over
layers (Linen `nn.scan`, NNX `nnx.scan` over `nnx.vmap`-created blocks, Haiku
`hk.layer_stack`, Equinox `jax.lax.scan` over `eqx.filter_vmap`-created blocks) and with a
plain loop over a list of blocks. lamina runs the example's model and, for comparison, the
same blocks as a Python list. Every contestant starts from lamina's initial weights (lamina's
layouts are Linen's; Haiku's and Equinox's attention projections merge the heads, and
Equinox's matrices are transposed), so all compute the same loss on the same batch: the
script checks that before timing.

Each step is `jax.jit`-compiled (``donate_argnums`` for the parameters and optimiser state,
as the example does; Equinox's model is split once into its arrays, `eqx.partition`, so that
its step is jitted and donated the same way), warmed up, then timed one step at a time in
interleaved rounds, so drift in the machine's speed hits every contestant alike; the figure
is the median step, on the clock and in CPU time (all threads; steadier when other
processes share the CPUs). Defaults are nanoGPT's CPU settings (4 layers, 4 heads, width
128, context 64, batch 12):

    python benchmarks/char_transformer.py              # about a minute on 2 quiet cores
    python benchmarks/char_transformer.py --quick      # fewer steps, about 40 seconds
    python benchmarks/char_transformer.py --scans --hlo   # where a scan's time goes
    python benchmarks/char_transformer.py --layers 8 --width 256

The batch comes from ``--data`` (default: ../shared/data/tinyshakespeare.txt when it is
there, else the example's default text, Python's own source). The ratios printed are each
contestant's median over the best peer's (the fastest Linen, NNX, Haiku or Equinox row).
The example's Stack is unrolled in full (straight-line code, the fastest on a CPU for 4
blocks), so its peers are Linen's `nn.scan` and Haiku's `hk.layer_stack` unrolled in full
and the lists. ``--scans`` adds lamina's Stack and Linen's, NNX's, Haiku's and Equinox's
scans run as loops, which tells the cost of the loop (a scan against straight-line code)
from the library's; ``--hlo`` prints each step's lowered program size. Other processes on
the machine add noise: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import operator
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lamina as lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def load_example():
    """examples/char_transformer.py as a module (this file has the same name)."""
    sys.path.insert(0, str(ROOT / "examples"))  # the example imports _common
    spec = importlib.util.spec_from_file_location(
        "char_transformer_example", ROOT / "examples" / "char_transformer.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


example = load_example()


# --- lamina: the example's model, and the same blocks as a Python list --------------------


class BlockList(lm.Module):
    """`n` copies of `block` in a Python list, called in turn (what `lm.Stack` replaces)."""

    def __init__(self, block, n):
        super().__init__()
        self.layers = [copy.deepcopy(block) for _ in range(n)]

    def __call__(self, x, *args, **kwargs):
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x


class LoopStack(lm.Stack):
    """`lm.Stack` whose scan is a loop of one block per step: a diagnostic row."""

    def __call__(self, x, *args, **kwargs):
        def step(block, x):
            return block(x, *args, **kwargs)

        run = lm.scan(step, in_axes=(0, lm.Carry), out_axes=lm.Carry, unroll=1, split_rngs=True)
        return run(self.block, x)


def lamina_model(config, vocab_size, *, blocks=None):
    """The example's model; `blocks` ("list", "loop") replaces its Stack by a twin."""
    model = example.build_model(config, vocab_size)
    if blocks is not None:  # a fresh block: a Stack's template carries the stacked axis
        block = example.Block(config.width, config.heads, config.dropout, config.layers)
        twin = BlockList if blocks == "list" else LoopStack
        model.blocks = twin(block, config.layers)
    return model


def lamina_contestant(config, vocab_size, weights, *, blocks=None):
    """(params, loss, optimizer) for the example's model (or a twin, see `lamina_model`)."""
    model = lamina_model(config, vocab_size, blocks=blocks)
    init, apply = lm.transform(model)
    template = jax.eval_shape(init, jax.random.key(0))["params"]
    params = {**weights, "blocks": lamina_blocks(template["blocks"], weights["blocks"])}
    check_shapes("lamina", params, template)

    def loss(params, inputs, targets, key):
        logits, _ = apply({"params": params}, {"dropout": key}, inputs, True)
        return example.cross_entropy(logits, targets)

    optimizer, _ = example.make_optimizer(config, model, params)
    return params, loss, optimizer


# --- the weights, moved between layouts ---------------------------------------------------

BLOCK_KEYS = {"attention_norm", "attention", "mlp_norm", "mlp_in", "mlp_out"}


def stacked_blocks(blocks) -> dict:
    """The blocks' parameters with a leading layer axis, from a Stack's or a list's subtree."""
    while True:
        if set(blocks) >= BLOCK_KEYS:
            return blocks  # a Stack's block: already stacked
        keys = list(blocks)
        if all(str(k).isdigit() for k in keys):  # a list of blocks
            items = [blocks[k] for k in sorted(keys, key=int)]
            return jax.tree.map(lambda *xs: jnp.stack(xs), *items)
        if len(keys) != 1:
            raise ValueError(f"cannot find the transformer blocks among {keys}")
        (blocks,) = blocks.values()  # Stack's template or a list attribute: one level down


def unstack(stacked) -> list:
    n = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)]


def canonical(params) -> dict:
    """lamina's parameters with the blocks as one stacked subtree under "blocks"."""
    return {**params, "blocks": stacked_blocks(params["blocks"])}


def lamina_blocks(template, stacked) -> dict:
    """The stacked blocks in the layout of `template`, a lamina model's "blocks" subtree."""
    if set(template) >= BLOCK_KEYS:
        return stacked  # a Stack's block
    keys = list(template)
    if all(str(k).isdigit() for k in keys):  # a list of blocks
        keys = sorted(keys, key=int)
        return {k: block for k, block in zip(keys, unstack(stacked), strict=True)}
    (name,) = keys  # Stack's template or a list attribute: one level down
    return {name: lamina_blocks(template[name], stacked)}


# --- Flax Linen ---------------------------------------------------------------------------


def linen_model(config, vocab_size, *, scan, unroll=1):
    import flax.linen as nn

    width, heads, layers = config.width, config.heads, config.layers
    weights = nn.initializers.normal(0.02)
    residual = nn.initializers.normal(0.02 / math.sqrt(2 * layers))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm(epsilon=1e-5, name="attention_norm")(x)
            h = nn.MultiHeadDotProductAttention(
                heads, kernel_init=weights, out_kernel_init=residual, name="attention"
            )(h, mask=mask, deterministic=True)
            x = x + h
            h = nn.LayerNorm(epsilon=1e-5, name="mlp_norm")(x)
            h = nn.Dense(4 * width, kernel_init=weights, name="mlp_in")(h)
            h = nn.Dense(width, kernel_init=residual, name="mlp_out")(nn.gelu(h))
            return x + h, None

    class CharTransformer(nn.Module):
        @nn.compact
        def __call__(self, ids):
            token = nn.Embed(vocab_size, width, embedding_init=weights, name="token")
            position = nn.Embed(config.block_size, width, embedding_init=weights, name="position")
            x = token(ids) + position(jnp.arange(ids.shape[-1]))
            mask = nn.make_causal_mask(ids)
            if scan:
                blocks = nn.scan(
                    Block,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    in_axes=nn.broadcast,
                    length=layers,
                    unroll=unroll,
                )
                x, _ = blocks(name="blocks")(x, mask)
            else:
                for i in range(layers):
                    x, _ = Block(name=f"blocks_{i}")(x, mask)
            x = nn.LayerNorm(epsilon=1e-5, name="norm")(x)
            if config.tie:
                return token.attend(x)
            return nn.Dense(vocab_size, kernel_init=weights, name="head")(x)

    return CharTransformer()


def linen_contestant(config, vocab_size, weights, *, scan, unroll=1):
    model = linen_model(config, vocab_size, scan=scan, unroll=unroll)
    if scan:
        params = weights
    else:
        blocks = unstack(weights["blocks"])
        params = {k: v for k, v in weights.items() if k != "blocks"}
        params.update({f"blocks_{i}": b for i, b in enumerate(blocks)})
    expected = jax.eval_shape(
        model.init, jax.random.key(0), jnp.zeros((1, config.block_size), jnp.int32)
    )["params"]
    check_shapes("Flax Linen", params, expected)

    def loss(params, inputs, targets, key):
        del key  # no dropout
        return example.cross_entropy(model.apply({"params": params}, inputs), targets)

    return params, loss, peer_optimizer(config, params)


# --- Flax NNX -----------------------------------------------------------------------------


def nnx_model(config, vocab_size, *, scan):
    from flax import nnx

    width, heads, layers = config.width, config.heads, config.layers
    weights = nnx.initializers.normal(0.02)
    residual = nnx.initializers.normal(0.02 / math.sqrt(2 * layers))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention_norm = nnx.LayerNorm(width, epsilon=1e-5, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                heads,
                width,
                kernel_init=weights,
                out_kernel_init=residual,
                decode=False,
                deterministic=True,
                keep_rngs=False,
                rngs=rngs,
            )
            self.mlp_norm = nnx.LayerNorm(width, epsilon=1e-5, rngs=rngs)
            self.mlp_in = nnx.Linear(width, 4 * width, kernel_init=weights, rngs=rngs)
            self.mlp_out = nnx.Linear(4 * width, width, kernel_init=residual, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attention(self.attention_norm(x), mask=mask)
            return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))

    class CharTransformer(nnx.Module):
        def __init__(self, rngs):
            self.token = nnx.Embed(vocab_size, width, embedding_init=weights, rngs=rngs)
            self.position = nnx.Embed(config.block_size, width, embedding_init=weights, rngs=rngs)
            if scan:

                @nnx.split_rngs(splits=layers)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def create(rngs):
                    return Block(rngs)

                self.blocks = create(rngs)
            else:
                self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(width, epsilon=1e-5, rngs=rngs)
            self.head = (
                None
                if config.tie
                else nnx.Linear(width, vocab_size, kernel_init=weights, rngs=rngs)
            )

        def __call__(self, ids):
            x = self.token(ids) + self.position(jnp.arange(ids.shape[-1]))
            mask = nnx.make_causal_mask(ids)
            if scan:

                @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
                def forward(x, block, mask):
                    return block(x, mask)

                x = forward(x, self.blocks, mask)
            else:
                for block in self.blocks:
                    x = block(x, mask)
            x = self.norm(x)
            return self.token.attend(x) if self.head is None else self.head(x)

    return CharTransformer(nnx.Rngs(0))


def nnx_contestant(config, vocab_size, weights, *, scan):
    from flax import nnx

    model = nnx_model(config, vocab_size, scan=scan)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    pure = dict(weights)
    if not scan:
        pure["blocks"] = dict(enumerate(unstack(weights["blocks"])))
    check_shapes("Flax NNX", pure, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)

    def loss(params, inputs, targets, key):
        del key  # no dropout
        logits = nnx.merge(graphdef, params, rest)(inputs)
        return example.cross_entropy(logits, targets)

    return state, loss, peer_optimizer(config, state)


# --- Haiku --------------------------------------------------------------------------------


def merge_heads(x):
    """(..., heads, head size) -> (..., heads * head size): Linen's attention to one matrix."""
    return x.reshape(*x.shape[:-2], -1)


def merge_out_heads(kernel):
    """Linen's output kernel (..., heads, head size, width) -> (..., heads * head size, width)."""
    return kernel.reshape(*kernel.shape[:-3], -1, kernel.shape[-1])


def haiku_model(config, vocab_size, *, scan, unroll=1):
    """The network as a `hk.transform`: its blocks in a `hk.layer_stack` (`scan`) or a list."""
    import haiku as hk

    width, heads, layers = config.width, config.heads, config.layers
    weights = hk.initializers.RandomNormal(0.02)
    residual = hk.initializers.RandomNormal(0.02 / math.sqrt(2 * layers))

    def layer_norm(name):
        return hk.LayerNorm(-1, create_scale=True, create_offset=True, eps=1e-5, name=name)

    class Block(hk.Module):
        def __call__(self, x, mask):
            h = layer_norm("attention_norm")(x)
            # Haiku's attention takes one initialiser for its four projections
            attention = hk.MultiHeadAttention(
                heads, width // heads, w_init=weights, model_size=width, name="attention"
            )
            x = x + attention(h, h, h, mask=mask)
            h = layer_norm("mlp_norm")(x)
            h = hk.Linear(4 * width, w_init=weights, name="mlp_in")(h)
            return x + hk.Linear(width, w_init=residual, name="mlp_out")(jax.nn.gelu(h))

    def forward(ids):
        token = hk.Embed(vocab_size, width, w_init=weights, name="token")
        position = hk.Embed(config.block_size, width, w_init=weights, name="position")
        x = token(ids) + position(jnp.arange(ids.shape[-1]))
        length = ids.shape[-1]
        mask = jnp.tril(jnp.ones((length, length), bool))[None, None]  # batch, heads
        if scan:
            stack = hk.layer_stack(layers, unroll=unroll, name="blocks")
            x = stack(lambda x: Block(name="block")(x, mask))(x)
        else:
            for i in range(layers):
                x = Block(name=f"blocks_{i}")(x, mask)
        x = layer_norm("norm")(x)
        if config.tie:
            return x @ token.embeddings.T
        return hk.Linear(vocab_size, w_init=weights, name="head")(x)

    return hk.without_apply_rng(hk.transform(forward))


def haiku_params(weights, *, scan) -> dict:
    """The weights (Linen's layout) in Haiku's: one flat dict of module paths."""

    def linear(p):
        return {"w": p["kernel"], "b": p["bias"]}

    def norm(p):
        return {"scale": p["scale"], "offset": p["bias"]}

    def block(w, prefix):  # one block, or the stacked blocks of a layer_stack
        attention = w["attention"]
        params = {
            f"{prefix}/attention/{name}": {
                "w": merge_heads(attention[name]["kernel"]),
                "b": merge_heads(attention[name]["bias"]),
            }
            for name in ("query", "key", "value")
        }
        params[f"{prefix}/attention/linear"] = {
            "w": merge_out_heads(attention["out"]["kernel"]),
            "b": attention["out"]["bias"],
        }
        params[f"{prefix}/attention_norm"] = norm(w["attention_norm"])
        params[f"{prefix}/mlp_norm"] = norm(w["mlp_norm"])
        params[f"{prefix}/mlp_in"] = linear(w["mlp_in"])
        params[f"{prefix}/mlp_out"] = linear(w["mlp_out"])
        return params

    params = {
        "token": {"embeddings": weights["token"]["embedding"]},
        "position": {"embeddings": weights["position"]["embedding"]},
        "norm": norm(weights["norm"]),
    }
    if "head" in weights:
        params["head"] = linear(weights["head"])
    if scan:
        params.update(block(weights["blocks"], "blocks/block"))
    else:
        for i, w in enumerate(unstack(weights["blocks"])):
            params.update(block(w, f"blocks_{i}"))
    return params


def haiku_contestant(config, vocab_size, weights, *, scan, unroll=1):
    model = haiku_model(config, vocab_size, scan=scan, unroll=unroll)
    params = haiku_params(weights, scan=scan)
    expected = jax.eval_shape(
        model.init, jax.random.key(0), jnp.zeros((1, config.block_size), jnp.int32)
    )
    check_shapes("Haiku", params, expected)

    def loss(params, inputs, targets, key):
        del key  # no dropout
        return example.cross_entropy(model.apply(params, inputs), targets)

    # Haiku's matrices are the Linear layers' "w" and the Embed layers' "embeddings"
    mask = {name: {k: k in ("w", "embeddings") for k in p} for name, p in params.items()}
    return params, loss, peer_optimizer(config, params, mask)


# --- Equinox ------------------------------------------------------------------------------


def equinox_model(config, vocab_size, *, scan):
    """The network as an `eqx.Module` for one sequence (vmap it over the batch).

    With `scan`, the blocks are one block whose arrays have a leading layer axis, made by
    `eqx.filter_vmap` over keys, and run by `jax.lax.scan`; else they are a list. The
    initialisers are Equinox's own: `equinox_contestant` puts lamina's weights in.
    """
    import equinox as eqx

    width, heads, layers = config.width, config.heads, config.layers

    class Block(eqx.Module):
        attention_norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        mlp_norm: eqx.nn.LayerNorm
        mlp_in: eqx.nn.Linear
        mlp_out: eqx.nn.Linear

        def __init__(self, key):
            attention_key, in_key, out_key = jax.random.split(key, 3)
            self.attention_norm = eqx.nn.LayerNorm(width, eps=1e-5)
            self.attention = eqx.nn.MultiheadAttention(
                heads,
                width,
                use_query_bias=True,
                use_key_bias=True,
                use_value_bias=True,
                use_output_bias=True,
                key=attention_key,
            )
            self.mlp_norm = eqx.nn.LayerNorm(width, eps=1e-5)
            self.mlp_in = eqx.nn.Linear(width, 4 * width, key=in_key)
            self.mlp_out = eqx.nn.Linear(4 * width, width, key=out_key)

        def __call__(self, x, mask):  # x: (sequence, width)
            h = jax.vmap(self.attention_norm)(x)
            x = x + self.attention(h, h, h, mask=mask)
            h = jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.mlp_norm)(x)))
            return x + jax.vmap(self.mlp_out)(h)

    class CharTransformer(eqx.Module):
        token: eqx.nn.Embedding
        position: eqx.nn.Embedding
        blocks: Block | list[Block]
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear | None

        def __init__(self, key):
            token_key, position_key, blocks_key, head_key = jax.random.split(key, 4)
            self.token = eqx.nn.Embedding(vocab_size, width, key=token_key)
            self.position = eqx.nn.Embedding(config.block_size, width, key=position_key)
            block_keys = jax.random.split(blocks_key, layers)
            if scan:
                self.blocks = eqx.filter_vmap(Block)(block_keys)
            else:
                self.blocks = [Block(k) for k in block_keys]
            self.norm = eqx.nn.LayerNorm(width, eps=1e-5)
            self.head = None if config.tie else eqx.nn.Linear(width, vocab_size, key=head_key)

        def __call__(self, ids):  # ids: (sequence,)
            length = ids.shape[-1]
            x = jax.vmap(self.token)(ids) + jax.vmap(self.position)(jnp.arange(length))
            mask = jnp.tril(jnp.ones((length, length), bool))
            if scan:
                arrays, static = eqx.partition(self.blocks, eqx.is_array)

                def forward(x, arrays):
                    return eqx.combine(arrays, static)(x, mask), None

                x, _ = jax.lax.scan(forward, x, arrays)
            else:
                for block in self.blocks:
                    x = block(x, mask)
            x = jax.vmap(self.norm)(x)
            return x @ self.token.weight.T if self.head is None else jax.vmap(self.head)(x)

    return CharTransformer(jax.random.key(0))


def equinox_block(block, w):
    """An Equinox block (or the stacked blocks) holding `w`, a block's weights in Linen's layout.

    Equinox's attention projects to heads * head size at once, and its `Linear` weights are
    (out, in): Linen's kernels are merged over the heads and transposed.
    """
    import equinox as eqx

    def linear(kernel, bias):
        return jnp.swapaxes(kernel, -1, -2), bias

    def heads(p):
        return linear(merge_heads(p["kernel"]), merge_heads(p["bias"]))

    def norm(p):
        return p["scale"], p["bias"]

    attention = w["attention"]
    layers = {  # where in the block -> (weight, bias)
        "attention_norm": norm(w["attention_norm"]),
        "attention.query_proj": heads(attention["query"]),
        "attention.key_proj": heads(attention["key"]),
        "attention.value_proj": heads(attention["value"]),
        "attention.output_proj": linear(
            merge_out_heads(attention["out"]["kernel"]), attention["out"]["bias"]
        ),
        "mlp_norm": norm(w["mlp_norm"]),
        "mlp_in": linear(w["mlp_in"]["kernel"], w["mlp_in"]["bias"]),
        "mlp_out": linear(w["mlp_out"]["kernel"], w["mlp_out"]["bias"]),
    }

    def where(module):
        found = [operator.attrgetter(path)(module) for path in layers]
        return [x for layer in found for x in (layer.weight, layer.bias)]

    return eqx.tree_at(where, block, [x for pair in layers.values() for x in pair])


def equinox_decay_mask(params):
    """True on the `Linear` and `Embedding` weights (a LayerNorm's `weight` is its scale)."""
    import equinox as eqx

    def is_matrix_layer(node):
        return isinstance(node, eqx.nn.Linear | eqx.nn.Embedding)

    def mask(node):
        flags = jax.tree.map(lambda _: False, node)
        return eqx.tree_at(lambda m: m.weight, flags, True) if is_matrix_layer(node) else flags

    return jax.tree.map(mask, params, is_leaf=is_matrix_layer)


def equinox_contestant(config, vocab_size, weights, *, scan):
    """(arrays, loss, optimizer): the model split once into its arrays and the rest.

    The step is `jax.jit` over the arrays (`eqx.partition`), recombined inside the loss
    (`eqx.combine`), not `eqx.filter_jit`: so the arrays are donated and the compiled step
    called exactly as every other contestant's, and the figure is the XLA program's and the
    library's trace, not `filter_jit`'s per-call partition of the model in Python.
    """
    import equinox as eqx

    model = equinox_model(config, vocab_size, scan=scan)
    if scan:
        blocks = equinox_block(model.blocks, weights["blocks"])
    else:
        blocks = [
            equinox_block(b, w)
            for b, w in zip(model.blocks, unstack(weights["blocks"]), strict=True)
        ]
    loaded = eqx.tree_at(
        lambda m: (m.token.weight, m.position.weight, m.norm.weight, m.norm.bias, m.blocks),
        model,
        (
            weights["token"]["embedding"],
            weights["position"]["embedding"],
            weights["norm"]["scale"],
            weights["norm"]["bias"],
            blocks,
        ),
    )
    if model.head is not None:
        head = weights["head"]
        loaded = eqx.tree_at(
            lambda m: (m.head.weight, m.head.bias), loaded, (head["kernel"].T, head["bias"])
        )
    params, static = eqx.partition(loaded, eqx.is_array)
    check_shapes("Equinox", params, eqx.filter(model, eqx.is_array))

    def loss(params, inputs, targets, key):
        del key  # no dropout
        logits = jax.vmap(eqx.combine(params, static))(inputs)
        return example.cross_entropy(logits, targets)

    return params, loss, peer_optimizer(config, params, equinox_decay_mask(params))


# --- shared -------------------------------------------------------------------------------


def check_shapes(name, params, expected):
    def shapes(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {tuple(str(getattr(k, "key", k)) for k in p): tuple(x.shape) for p, x in flat}

    got, want = shapes(params), shapes(expected)
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))
        raise ValueError(f"{name}: the weights do not fit the model: {diff[:6]}")


def decay_mask(params):
    """True on the matrices (kernels and embeddings): the example's weight-decay mask."""

    def is_matrix(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return any("kernel" in n or "embedding" in n for n in names)

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def peer_optimizer(config, params, mask=None):
    """The example's optimiser (`make_optimizer`); the decay mask defaults to `decay_mask`.

    Args:
        config: the example's settings (learning rate, warm-up, steps).
        params: the peer's parameters.
        mask: True on the parameters that decay; default: `decay_mask(params)`, by the
            paths' Linen and NNX names (Haiku's and Equinox's names differ).
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=min(config.warmup_iters, config.iters),
        decay_steps=max(config.iters, config.warmup_iters + 1),
        end_value=config.lr / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.99,
            weight_decay=0.1,
            mask=decay_mask(params) if mask is None else mask,
        ),
    )


def make_step(loss, optimizer):
    def step(params, opt_state, inputs, targets, key):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


CONTESTANTS = {
    "lamina (example, Stack)": lambda c, v, w: lamina_contestant(c, v, w),
    "lamina list": lambda c, v, w: lamina_contestant(c, v, w, blocks="list"),
    "Linen nn.scan, unroll=n": lambda c, v, w: linen_contestant(
        c, v, w, scan=True, unroll=c.layers
    ),
    "Linen list": lambda c, v, w: linen_contestant(c, v, w, scan=False),
    "NNX list": lambda c, v, w: nnx_contestant(c, v, w, scan=False),
    "Haiku layer_stack, unroll=n": lambda c, v, w: haiku_contestant(
        c, v, w, scan=True, unroll=c.layers
    ),
    "Haiku list": lambda c, v, w: haiku_contestant(c, v, w, scan=False),
    "Equinox list": lambda c, v, w: equinox_contestant(c, v, w, scan=False),
}
# --scans: the scans as loops (one block per step), to tell the cost of a loop from the library's
UNROLLED = {
    "lamina Stack, unroll=1": lambda c, v, w: lamina_contestant(c, v, w, blocks="loop"),
    "Linen nn.scan": lambda c, v, w: linen_contestant(c, v, w, scan=True),
    "NNX nnx.scan": lambda c, v, w: nnx_contestant(c, v, w, scan=True),
    "Haiku layer_stack": lambda c, v, w: haiku_contestant(c, v, w, scan=True),
    "Equinox lax.scan": lambda c, v, w: equinox_contestant(c, v, w, scan=True),
}
LAMINA = ("lamina (example, Stack)", "lamina list", "lamina Stack, unroll=1")


def setup(layers, heads, width, block_size, batch_size, data=None):
    """(config, vocab_size, inputs, targets, key, weights): one batch and lamina's weights."""
    data = data or (str(DEFAULT_DATA) if DEFAULT_DATA.is_file() else None)
    config = example.parse_args(
        [
            "--layers",
            str(layers),
            "--heads",
            str(heads),
            "--width",
            str(width),
            "--block-size",
            str(block_size),
            "--batch-size",
            str(batch_size),
        ]
        + (["--data", data] if data else [])
    )
    text = example.load_text(config)
    vocab_size = len(text.chars)
    starts = np.random.default_rng(0).integers(
        0, len(text.train) - config.block_size - 1, config.batch_size
    )
    inputs, targets = example.windows(
        jnp.asarray(text.train), jnp.asarray(starts), config.block_size
    )
    key = jax.random.key(0)

    model = lamina_model(config, vocab_size)
    init, _ = lm.transform(model)
    weights = canonical(init(jax.random.key(config.seed))["params"])
    return config, vocab_size, inputs, targets, key, weights


def compile_step(name, config, vocab_size, weights, inputs, targets, key):
    """(compiled step, (params, opt_state), loss before any step) of one contestant."""
    params, loss, optimizer = {**CONTESTANTS, **UNROLLED}[name](config, vocab_size, weights)
    params = jax.tree.map(jnp.copy, params)  # the step donates its buffers: not `weights`
    opt_state = optimizer.init(params)
    value = float(jax.jit(loss)(params, inputs, targets, key))
    step = (
        jax.jit(make_step(loss, optimizer), donate_argnums=(0, 1))
        .lower(params, opt_state, inputs, targets, key)
        .compile()
    )
    return step, (params, opt_state), value


# run.py's columns: the example's model, and each peer's same straight-line program
COLUMN_CONTESTANTS = {
    "lamina": "lamina (example, Stack)",
    "linen": "Linen list",
    "nnx": "NNX list",
    "haiku": "Haiku list",
    "equinox": "Equinox list",
}
COLUMN_NOTES = {
    "jax": "no hand-written JAX version (about 150 lines); ratios to Linen",
    "haiku": "hk.MultiHeadAttention and hk.LayerNorm: the same function, not the same XLA "
    "program (--hlo counts its ops)",
    "equinox": "eqx.nn.MultiheadAttention and LayerNorm, vmapped over the batch: the same "
    "function, not the same XLA program (--hlo counts its ops)",
}
SIZES = {  # mode -> (layers, heads, width, block size, batch size, rounds, steps per round)
    "smoke": (1, 2, 16, 8, 2, 2, 1),
    "quick": (4, 4, 128, 64, 12, 5, 4),
    "full": (4, 4, 128, 64, 12, 10, 10),
}


def collect(mode: str = "quick") -> list:
    """run.py's row: ms per training step (lamina's example beside each peer's list)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _harness import check_same, interleaved, row_from_samples

    layers, heads, width, block_size, batch_size, rounds, number = SIZES[mode]
    config, vocab_size, inputs, targets, key, weights = setup(
        layers, heads, width, block_size, batch_size
    )
    fns, losses = {}, {}
    for column, name in COLUMN_CONTESTANTS.items():
        step, state, losses[column] = compile_step(
            name, config, vocab_size, weights, inputs, targets, key
        )
        holder = [state]

        def run(step=step, holder=holder):
            params, opt_state, value = step(*holder[0], inputs, targets, key)
            holder[0] = (params, opt_state)
            jax.block_until_ready(value)

        fns[column] = run
    check_same(losses, rtol=1e-3, atol=1e-4)
    samples = interleaved(fns, rounds, number)
    return [
        row_from_samples(
            "train_char_transformer",
            f"train step, char transformer ({layers} blocks, width {width}, context "
            f"{block_size}, batch {batch_size}), ms",
            "ms",
            samples,
            1e3,
            base="linen",
            notes=dict(COLUMN_NOTES),
        )
    ]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4, help="blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="heads (default: %(default)s)")
    parser.add_argument("--width", type=int, default=128, help="width (default: %(default)s)")
    parser.add_argument(
        "--block-size", type=int, default=64, help="context length (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=12, help="(default: %(default)s)")
    parser.add_argument(
        "--data",
        metavar="PATH",
        help=f"a UTF-8 text to take the batch from (default: {DEFAULT_DATA} if it exists, "
        "else the example's default text)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds of timed steps (default: 5; with --quick 3)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="timed steps per contestant per round (default: 10; with --quick 5)",
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps after compiling (default: 5)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        choices=[*CONTESTANTS, *UNROLLED],
        help="time only these contestants (repeatable; default: all)",
    )
    parser.add_argument(
        "--scans",
        action="store_true",
        help="also time lamina's Stack, Linen's nn.scan, NNX's nnx.scan, Haiku's "
        "hk.layer_stack and Equinox's lax.scan as loops (one block per step), to separate "
        "the cost of the loop from the library's",
    )
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="also print each step's lowered program size (characters, op count)",
    )
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (5 if args.quick else 10)
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1, --warmup at least 0")

    config, vocab_size, inputs, targets, key, weights = setup(
        args.layers, args.heads, args.width, args.block_size, args.batch_size, args.data
    )
    stack = "lm.Stack" if hasattr(lm, "Stack") else "a list (lm.Stack is not in lamina yet)"
    print(
        f"model: {config.layers} layers, {config.heads} heads, width {config.width}, context "
        f"{config.block_size}, batch {config.batch_size}, vocabulary {vocab_size}, "
        f"{sum(x.size for x in jax.tree.leaves(weights)):,} parameters; the example's blocks "
        f"are {stack}\njax {jax.__version__} on {jax.default_backend()}; {load()}"
    )

    names = args.only or [*CONTESTANTS, *(UNROLLED if args.scans else ())]
    everyone = {**CONTESTANTS, **UNROLLED}
    steps, states, losses, compile_s, programs = {}, {}, {}, {}, {}
    for name in names:
        params, loss, optimizer = everyone[name](config, vocab_size, weights)
        params = jax.tree.map(jnp.copy, params)  # the step donates its buffers: not `weights`
        opt_state = optimizer.init(params)
        losses[name] = float(jax.jit(loss)(params, inputs, targets, key))
        start = time.perf_counter()
        lowered = jax.jit(make_step(loss, optimizer), donate_argnums=(0, 1)).lower(
            params, opt_state, inputs, targets, key
        )
        steps[name] = lowered.compile()
        compile_s[name] = time.perf_counter() - start
        if args.hlo:
            hlo = lowered.as_text()
            ops = sum(1 for line in hlo.splitlines() if " = " in line and "stablehlo." in line)
            programs[name] = (len(hlo), ops)
        for _ in range(args.warmup):
            params, opt_state, _ = steps[name](params, opt_state, inputs, targets, key)
        states[name] = jax.block_until_ready((params, opt_state))

    print("\nloss on the same batch, same initial weights (before any step):")
    reference = losses[names[0]]
    for name in names:
        print(f"  {name:28s} {losses[name]:.6f}")
        if not math.isfinite(losses[name]):
            raise SystemExit(f"{name}: the loss is not finite")
    spread = max(abs(v - reference) for v in losses.values())
    if spread > 1e-3 * abs(reference):
        print(f"warning: the losses differ by up to {spread:.3g}: not the same function?")

    wall = {name: [] for name in names}  # seconds per step, on the clock
    cpu = {name: [] for name in names}  # CPU seconds per step, all of this process's threads
    for _ in range(args.rounds):
        for name in names:  # interleaved
            params, opt_state = states[name]
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                params, opt_state, value = steps[name](params, opt_state, inputs, targets, key)
                jax.block_until_ready(value)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            states[name] = (params, opt_state)

    median = {name: 1000 * statistics.median(t) for name, t in wall.items()}
    median_cpu = {name: 1000 * statistics.median(t) for name, t in cpu.items()}
    peers = [n for n in names if n not in LAMINA]
    best = min(peers, key=median.get) if peers else None
    best_cpu = min(peers, key=median_cpu.get) if peers else None
    count = args.rounds * args.steps
    print(
        f"\nmilliseconds per training step, median of {count} ({args.rounds} interleaved "
        f"rounds); cpu ms: CPU time of all threads, less sensitive to other processes"
    )
    header = f"{'':28s} {'ms/step':>8s} {'p10':>7s} {'p90':>7s} {'cpu ms':>7s} {'compile s':>10s}"
    header += f" {'x best':>7s} {'x best cpu':>10s}" if best else ""
    header += f" {'HLO chars':>10s} {'ops':>6s}" if args.hlo else ""
    print(header)
    print("-" * len(header))
    for name in names:
        p10, p90 = np.percentile(1000 * np.array(wall[name]), [10, 90])
        row = f"{name:28s} {median[name]:8.2f} {p10:7.2f} {p90:7.2f} {median_cpu[name]:7.2f}"
        row += f" {compile_s[name]:10.2f}"
        if best:
            row += f" {median[name] / median[best]:7.3f}"
            row += f" {median_cpu[name] / median_cpu[best_cpu]:10.3f}"
        row += f" {programs[name][0]:10d} {programs[name][1]:6d}" if args.hlo else ""
        print(row)
    if best:
        print(f"(best peer: {best}; by CPU time: {best_cpu})")
        for name in LAMINA:
            if name in median:
                print(
                    f"{name} / best peer = {median[name] / median[best]:.3f} "
                    f"(CPU time: {median_cpu[name] / median_cpu[best_cpu]:.3f})"
                )
    print(f"\n{load()}")


if __name__ == "__main__":
    main()
