"""Milliseconds per training step of the char transformer: lamina beside Flax Linen and NNX.

The lamina model is `examples/char_transformer.py`'s own (`CharTransformer`, its `lm.Stack`
of pre-norm blocks, its AdamW); Linen and NNX build the same network (same names, shapes,
initialisation, LayerNorm epsilon, GELU, tied output layer) and train it with the same
optimiser, each twice: with its scan over layers (Linen `nn.scan`, NNX `nnx.scan` over
`nnx.vmap`-created blocks) and with a plain loop over a list of blocks. lamina runs the
example's model and, for comparison, the same blocks as a Python list. Every contestant
starts from lamina's initial weights (the layouts are Linen's), so all compute the same loss
on the same batch: the script checks that before timing.

Each step is `jax.jit`-compiled (``donate_argnums`` for the parameters and optimiser state,
as the example does), warmed up, then timed one step at a time in interleaved rounds, so
drift in the machine's speed hits every contestant alike; the figure is the median step,
on the clock and in CPU time (all threads; steadier when other processes share the CPUs).
Defaults are nanoGPT's CPU settings (4 layers, 4 heads, width 128, context 64, batch 12):

    python benchmarks/char_transformer.py              # 2 to 4 minutes on 2 busy cores
    python benchmarks/char_transformer.py --quick      # fewer steps, about 2 minutes
    python benchmarks/char_transformer.py --scans --hlo   # where a scan's time goes
    python benchmarks/char_transformer.py --layers 8 --width 256

The batch comes from ``--data`` (default: ../shared/data/tinyshakespeare.txt when it is
there, else the example's default text, Python's own source). The ratios printed are each
contestant's median over the best peer's (the fastest Linen or NNX row). The example's
Stack is unrolled in full (straight-line code, the fastest on a CPU for 4 blocks), so its
peers are Linen's `nn.scan` unrolled in full and the lists. ``--scans`` adds lamina's Stack
and Linen's and NNX's scans run as loops, which tells the cost of the loop (a scan against
straight-line code) from the library's; ``--hlo`` prints
each step's lowered program size. Other processes on the machine add noise: the load
average is printed with the figures.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
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

        with lm.split_rngs(splits=self.n):
            run = lm.scan(step, in_axes=(0, lm.Carry), out_axes=lm.Carry, unroll=1)
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


def peer_optimizer(config, params):
    """The example's optimiser (`make_optimizer`), with the mask made from the paths."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=min(config.warmup_iters, config.iters),
        decay_steps=max(config.iters, config.warmup_iters + 1),
        end_value=config.lr / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.1, mask=decay_mask(params)),
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
}
# --scans: the scans as loops (one block per step), to tell the cost of a loop from the library's
UNROLLED = {
    "lamina Stack, unroll=1": lambda c, v, w: lamina_contestant(c, v, w, blocks="loop"),
    "Linen nn.scan": lambda c, v, w: linen_contestant(c, v, w, scan=True),
    "NNX nnx.scan": lambda c, v, w: nnx_contestant(c, v, w, scan=True),
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
}
COLUMN_NOTES = {
    "jax": "no hand-written JAX version (about 150 lines); ratios to Linen",
    "haiku": "not written yet: the model would be ported to Haiku's modules",
    "equinox": "not written yet: the model would be ported to Equinox's modules",
}
SIZES = {  # mode -> (layers, heads, width, block size, batch size, rounds, steps per round)
    "smoke": (1, 2, 16, 8, 2, 2, 1),
    "quick": (4, 4, 128, 64, 12, 5, 4),
    "full": (4, 4, 128, 64, 12, 10, 10),
}


def collect(mode: str = "quick") -> list:
    """run.py's row: ms per training step (lamina's example beside Linen's and NNX's lists)."""
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
        help="also time lamina's Stack, Linen's nn.scan and NNX's nnx.scan as loops (one "
        "block per step), to separate the cost of the loop from the library's",
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
        print(f"  {name:26s} {losses[name]:.6f}")
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
    header = f"{'':26s} {'ms/step':>8s} {'p10':>7s} {'p90':>7s} {'cpu ms':>7s} {'compile s':>10s}"
    header += f" {'x best':>7s} {'x best cpu':>10s}" if best else ""
    header += f" {'HLO chars':>10s} {'ops':>6s}" if args.hlo else ""
    print(header)
    print("-" * len(header))
    for name in names:
        p10, p90 = np.percentile(1000 * np.array(wall[name]), [10, 90])
        row = f"{name:26s} {median[name]:8.2f} {p10:7.2f} {p90:7.2f} {median_cpu[name]:7.2f}"
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
