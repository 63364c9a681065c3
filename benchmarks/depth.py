"""Compile time against depth: lamina's `Stack` beside a Python list and its peers' scans.

Each contestant is a residual MLP of `depth` identical blocks (``x + relu(Dense(x)) / depth``,
width 64, batch 16), trained by the same step: mean-square loss, `jax.value_and_grad` and
an `optax.adam` update. For every depth the step is lowered and compiled once,
``jax.jit(step).lower(...)`` then ``.compile()``, and the compiled step is called once:

- lamina `lm.Stack(block, n)` (a scan over stacked variables) and a Python list of blocks;
- Flax Linen `nn.scan` (``variable_axes={"params": 0}``, ``split_rngs={"params": True}``,
  ``length=n``) and a plain Linen loop of `nn.Dense` blocks;
- Flax NNX `nnx.scan` over layers created with `nnx.vmap` (flax's "scan over layers"
  pattern), and a plain NNX list; both run as ``nnx.merge`` inside `jax.jit`, as the others;
- Haiku `hk.layer_stack(n)` over a block of `hk.Linear`, and a plain Haiku loop;
- Equinox `jax.lax.scan` over a block created with `eqx.filter_vmap` (its arrays stacked
  along a leading layer axis), and a plain list of `eqx.Module` blocks; the model is
  written for one example and `jax.vmap`-ed over the batch (Equinox's idiom), split once
  into its arrays (`eqx.partition`) that `jax.jit` takes as the others' parameters, and
  recombined in the loss (`eqx.combine`).

A scanned stack compiles one block whatever the depth; a list is unrolled, and its trace
and compile time grow with the depth. Run:

    python benchmarks/depth.py              # depths 4, 8, 16, 32, 64 (a few minutes)
    python benchmarks/depth.py --quick      # depths 4, 16, 64
    python benchmarks/depth.py --big        # a Stack of 1,000 and 10,000 Dense(4, 4) blocks

Prints a table of seconds per depth (trace + compile, then the compiled step's first call)
and the ratios, and saves ``metrics.json`` and ``curves.png`` in ``runs/depth-<date>-<time>``
(or ``--out``). The lamina rows need `lm.Stack`; without it they are left out and said so.
Other processes on the machine add noise to the timings: run it on a quiet machine, or read
the load (printed) with the figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lamina as lm

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import _common

WIDTH, BATCH = 64, 16


def residual_scale(depth: int) -> float:
    """The residual branch's weight: 1 / depth keeps the activations finite at any depth."""
    return 1.0 / depth


# A contestant: depth, width -> (params, loss), with loss(params, x) -> a scalar.
Builder = Callable[[int, int], tuple[object, Callable]]


# --- lamina ---------------------------------------------------------------------------


class LaminaBlock(lm.Module):
    def __init__(self, width, scale):
        super().__init__()
        self.dense = lm.Dense(width, width)
        self.scale = scale

    def __call__(self, x):
        return x + self.scale * lm.relu(self.dense(x))


class LaminaList(lm.Module):
    def __init__(self, depth, width):
        super().__init__()
        self.blocks = [LaminaBlock(width, residual_scale(depth)) for _ in range(depth)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def lamina_loss(model):
    init, apply = lm.transform(model)
    params = init(jax.random.key(0))["params"]

    def loss(params, x):
        y, _ = apply({"params": params}, None, x)
        return jnp.mean(y**2)

    return params, loss


def lamina_stack(depth, width):
    return lamina_loss(lm.Stack(LaminaBlock(width, residual_scale(depth)), depth))


def lamina_list(depth, width):
    return lamina_loss(LaminaList(depth, width))


def has_stack() -> bool:
    return hasattr(lm, "Stack")


# --- Flax Linen -----------------------------------------------------------------------


def linen_block(scale):
    import flax.linen as nn

    class LinenBlock(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x, _):  # nn.scan's (carry, x) -> (carry, y)
            return x + scale * nn.relu(nn.Dense(self.width)(x)), None

    return LinenBlock


def linen_loss(model, width):
    params = model.init(jax.random.key(0), jnp.ones((1, width)))["params"]

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    return params, loss


def linen_scan(depth, width):
    import flax.linen as nn

    block = linen_block(residual_scale(depth))

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=depth,
            )
            x, _ = blocks(width, name="blocks")(x, None)
            return x

    return linen_loss(Scanned(), width)


def linen_list(depth, width):
    import flax.linen as nn

    block = linen_block(residual_scale(depth))

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(depth):
                x, _ = block(width, name=f"blocks_{i}")(x, None)
            return x

    return linen_loss(Unrolled(), width)


# --- Flax NNX -------------------------------------------------------------------------


def nnx_block(scale):
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, width, rngs):
            self.linear = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + scale * nnx.relu(self.linear(x))

    return NnxBlock


def nnx_loss(model):
    from flax import nnx

    graphdef, params = nnx.split(model)

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

    return params, loss


def nnx_scan(depth, width):
    from flax import nnx

    block = nnx_block(residual_scale(depth))

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return block(width, rngs)

            self.blocks = create(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, block):
                return block(x)

            return forward(x, self.blocks)

    return nnx_loss(Scanned(nnx.Rngs(0)))


def nnx_list(depth, width):
    from flax import nnx

    block = nnx_block(residual_scale(depth))

    class Unrolled(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([block(width, rngs) for _ in range(depth)])

        def __call__(self, x):
            for block_ in self.blocks:
                x = block_(x)
            return x

    return nnx_loss(Unrolled(nnx.Rngs(0)))


# --- Haiku ----------------------------------------------------------------------------


def haiku_block(scale):
    import haiku as hk

    def block(x):
        return x + scale * jax.nn.relu(hk.Linear(x.shape[-1], name="dense")(x))

    return block


def haiku_loss(forward, width):
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), jnp.ones((1, width)))

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    return params, loss


def haiku_scan(depth, width):
    import haiku as hk

    block = haiku_block(residual_scale(depth))

    def forward(x):
        return hk.layer_stack(depth, name="blocks")(block)(x)

    return haiku_loss(forward, width)


def haiku_list(depth, width):
    import haiku as hk

    block = haiku_block(residual_scale(depth))

    def forward(x):
        for i in range(depth):
            with hk.name_scope(f"blocks_{i}"):
                x = block(x)
        return x

    return haiku_loss(forward, width)


# --- Equinox --------------------------------------------------------------------------


def equinox_block(scale):
    import equinox as eqx

    class EquinoxBlock(eqx.Module):
        dense: eqx.nn.Linear

        def __init__(self, width, key):
            self.dense = eqx.nn.Linear(width, width, key=key)

        def __call__(self, x):  # x: (width,), one example
            return x + scale * jax.nn.relu(self.dense(x))

    return EquinoxBlock


def equinox_loss(model):
    """(arrays, loss): `jax.jit` takes the model's arrays, as it takes the others' params.

    `eqx.partition` splits the model once and the loss recombines it (`eqx.combine`), so
    the step is lowered and compiled by `measure`'s own ``jax.jit(step).lower(...)``, as
    every other contestant's; `eqx.filter_jit` would partition its arguments itself.
    """
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x):
        return jnp.mean(jax.vmap(eqx.combine(params, static))(x) ** 2)

    return params, loss


def equinox_scan(depth, width):
    import equinox as eqx

    block = equinox_block(residual_scale(depth))

    class Scanned(eqx.Module):
        blocks: eqx.Module  # one block, its arrays stacked along a leading layer axis

        def __init__(self, key):
            keys = jax.random.split(key, depth)
            self.blocks = eqx.filter_vmap(lambda key: block(width, key))(keys)

        def __call__(self, x):
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def forward(x, arrays):
                return eqx.combine(arrays, static)(x), None

            return jax.lax.scan(forward, x, arrays)[0]

    return equinox_loss(Scanned(jax.random.key(0)))


def equinox_list(depth, width):
    import equinox as eqx

    block = equinox_block(residual_scale(depth))

    class Unrolled(eqx.Module):
        blocks: list

        def __init__(self, key):
            self.blocks = [block(width, k) for k in jax.random.split(key, depth)]

        def __call__(self, x):
            for block_ in self.blocks:
                x = block_(x)
            return x

    return equinox_loss(Unrolled(jax.random.key(0)))


# --- raw JAX -----------------------------------------------------------------------------


def raw_params(depth, width):
    keys = jax.random.split(jax.random.key(0), depth)
    kernels = jax.vmap(lambda k: jax.nn.initializers.lecun_normal()(k, (width, width)))(keys)
    return {"kernel": kernels, "bias": jnp.zeros((depth, width))}


def raw_list(depth, width):
    stacked = raw_params(depth, width)
    params = [{k: v[i] for k, v in stacked.items()} for i in range(depth)]
    scale = residual_scale(depth)

    def loss(params, x):
        for p in params:
            x = x + scale * jax.nn.relu(x @ p["kernel"] + p["bias"])
        return jnp.mean(x**2)

    return params, loss


def raw_scan(depth, width):
    scale = residual_scale(depth)

    def loss(params, x):
        def body(x, p):
            return x + scale * jax.nn.relu(x @ p["kernel"] + p["bias"]), None

        return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)

    return raw_params(depth, width), loss


CONTESTANTS: dict[str, Builder] = {
    "lamina Stack": lamina_stack,
    "lamina list": lamina_list,
    "Linen nn.scan": linen_scan,
    "Linen list": linen_list,
    "NNX nnx.scan": nnx_scan,
    "NNX list": nnx_list,
    "Haiku layer_stack": haiku_scan,
    "Haiku list": haiku_list,
    "Equinox lax.scan": equinox_scan,
    "Equinox list": equinox_list,
}
NEEDS_STACK = {"lamina Stack"}
# lamina beside its counterparts: (label, numerator, denominator) of the printed ratios
RATIOS = [
    ("Stack/Linen scan", "lamina Stack", "Linen nn.scan"),
    ("Stack/NNX scan", "lamina Stack", "NNX nnx.scan"),
    ("Stack/Haiku stack", "lamina Stack", "Haiku layer_stack"),
    ("Stack/Eqx scan", "lamina Stack", "Equinox lax.scan"),
    ("list/Linen list", "lamina list", "Linen list"),
    ("list/NNX list", "lamina list", "NNX list"),
    ("list/Haiku list", "lamina list", "Haiku list"),
    ("list/Eqx list", "lamina list", "Equinox list"),
    ("list/Stack", "lamina list", "lamina Stack"),
]


# --- measuring ------------------------------------------------------------------------


def make_step(loss, optimizer):
    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def measure(build: Builder, depth: int, width: int, steps: int) -> dict:
    """Seconds to build and init, lower (trace), compile, and call the compiled step."""
    gc.collect()
    start = time.perf_counter()
    params, loss = build(depth, width)
    jax.block_until_ready(params)
    built = time.perf_counter()
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    x = jax.random.normal(jax.random.key(1), (BATCH, width))
    jax.block_until_ready((opt_state, x))
    start_lower = time.perf_counter()
    lowered = jax.jit(make_step(loss, optimizer)).lower(params, opt_state, x)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    params, opt_state, value = jax.block_until_ready(compiled(params, opt_state, x))
    first_call = time.perf_counter() - compiled_at
    later = []
    for _ in range(steps):
        start_step = time.perf_counter()
        params, opt_state, _ = jax.block_until_ready(compiled(params, opt_state, x))
        later.append(time.perf_counter() - start_step)
    return {
        "build_init": built - start,
        "trace": lowered_at - start_lower,
        "compile": compiled_at - lowered_at,
        "trace_compile": compiled_at - start_lower,
        "first_call": first_call,
        "step_median": statistics.median(later) if later else None,
        "loss": float(value),
        "hlo_chars": len(lowered.as_text()),
    }


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def print_table(title: str, depths, results, key: str, scale: float = 1.0, unit: str = "s"):
    widths = {name: max(14, len(name)) for name in results}
    print(f"\n{title}")
    header = f"{'depth':>6s} " + " ".join(f"{name:>{w}s}" for name, w in widths.items())
    print(header)
    print("-" * len(header))
    for depth in depths:
        cells = []
        for name, w in widths.items():
            row = results[name].get(depth)
            cells.append(f"{row[key] * scale:{w}.3f}" if row else f"{'-':>{w}s}")
        print(f"{depth:6d} " + " ".join(cells) + f"  {unit}")


def print_ratios(depths, results, key: str):
    pairs = [(label, a, b) for label, a, b in RATIOS if a in results and b in results]
    if pairs:
        print("\nratios of trace + compile time (lamina over its counterpart)")
        header = f"{'depth':>6s} " + " ".join(f"{label:>17s}" for label, _, _ in pairs)
        print(header)
        print("-" * len(header))
        for depth in depths:
            cells = [
                f"{results[a][depth][key] / results[b][depth][key]:17.2f}" for _, a, b in pairs
            ]
            print(f"{depth:6d} " + " ".join(cells))
    growth = {name: rows[depths[-1]][key] / rows[depths[0]][key] for name, rows in results.items()}
    print(
        f"\ntrace + compile at depth {depths[-1]} / at depth {depths[0]}: "
        + ", ".join(f"{name} {value:.1f}x" for name, value in growth.items())
    )


# run.py's columns: (list contestant, scanned contestant) per column
COLUMN_CONTESTANTS = {
    "jax": (raw_list, raw_scan),
    "lamina": (lamina_list, lamina_stack),
    "linen": (linen_list, linen_scan),
    "nnx": (nnx_list, nnx_scan),
    "haiku": (haiku_list, haiku_scan),
    "equinox": (equinox_list, equinox_scan),
}
DEPTHS = {"smoke": (2,), "quick": (8, 32), "full": (8, 16, 32, 64)}


def collect(mode: str = "quick") -> list:
    """run.py's rows: seconds of trace + compile of a training step, list and scan, per depth.

    Each row holds the median of `repeat` compiles (contestants interleaved), and the
    spread their minimum and maximum; the extra field holds the depth and the trace times.
    """
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _harness import Row

    repeat = {"smoke": 1, "quick": 2, "full": 3}[mode]
    for list_build, scan_build in COLUMN_CONTESTANTS.values():  # warm-up, untimed
        measure(list_build, 2, WIDTH, 0)
        measure(scan_build, 2, WIDTH, 0)
    rows = []
    for depth in DEPTHS[mode]:
        for kind, index in (("list", 0), ("scan", 1)):
            samples = {column: [] for column in COLUMN_CONTESTANTS}
            details = {}
            for _ in range(repeat):
                for column, builds in COLUMN_CONTESTANTS.items():  # interleaved
                    row = measure(builds[index], depth, WIDTH, 0)
                    samples[column].append(row["trace_compile"])
                    details.setdefault(column, []).append(row)
            values = {c: statistics.median(t) for c, t in samples.items()}
            spread = {c: (min(t), max(t)) for c, t in samples.items()}
            label = "Python list of blocks" if kind == "list" else "scan (lamina: lm.Stack)"
            rows.append(
                Row(
                    f"compile_{kind}_{depth}",
                    f"trace + compile, {depth} residual Dense({WIDTH}) blocks, {label}, s",
                    "s",
                    values,
                    spread,
                    extra={
                        "depth": depth,
                        "kind": kind,
                        "trace_s": {c: min(r["trace"] for r in d) for c, d in details.items()},
                    },
                )
            )
    return rows


def run_depths(args, folder):
    names = [name for name in CONTESTANTS if name not in NEEDS_STACK or has_stack()]
    if not has_stack():
        print("lm.Stack is not in this lamina yet: the lamina Stack column is left out")
    print(
        f"residual Dense({WIDTH}, {WIDTH}) + relu blocks, batch {BATCH}, adam step; "
        f"jax {jax.__version__} on {jax.default_backend()}; {load()}"
    )
    print("warming up (depth 2, untimed) ...")
    for name in names:
        measure(CONTESTANTS[name], 2, WIDTH, 0)
    results: dict[str, dict[int, dict]] = {name: {} for name in names}
    for depth in args.depths:
        for name in names:  # interleaved, so drift in the machine's speed hits all alike
            best = None
            for _ in range(args.repeat):
                row = measure(CONTESTANTS[name], depth, WIDTH, args.steps)
                if best is None or row["trace_compile"] < best["trace_compile"]:
                    best = row
            results[name][depth] = best
        print(
            f"depth {depth}: "
            + ", ".join(f"{n} {results[n][depth]['trace_compile']:.2f} s" for n in names)
        )
    for name, rows in results.items():
        bad = [d for d, row in rows.items() if not np.isfinite(row["loss"])]
        if bad:
            print(f"warning: {name} computed a non-finite loss at depth {bad}")
    depths = args.depths
    print_table(
        "trace + compile, seconds (jax.jit(step).lower(...).compile())",
        depths,
        results,
        "trace_compile",
    )
    print_table("of which trace (lower), seconds", depths, results, "trace")
    print_table(
        "first call of the compiled step, milliseconds", depths, results, "first_call", 1000, "ms"
    )
    if args.steps:
        print_table(
            f"later steps, median of {args.steps}, milliseconds",
            depths,
            results,
            "step_median",
            1000,
            "ms",
        )
    print_ratios(depths, results, "trace_compile")
    print(f"\n{load()}")
    panels = {
        "trace + compile (s)": {
            n: (depths, [rows[d]["trace_compile"] for d in depths]) for n, rows in results.items()
        },
        "first call of the compiled step (ms)": {
            n: (depths, [1000 * rows[d]["first_call"] for d in depths])
            for n, rows in results.items()
        },
    }
    _common.save_run(
        folder,
        {"benchmark": "depth", "load": load(), "jax": jax.__version__, "results": results},
        args,
        panels,
        "depth (blocks)",
    )


def run_big(args, folder):
    if not has_stack():
        raise SystemExit("--big times lm.Stack, which this lamina does not have yet")
    print(
        f"lm.Stack of residual Dense(4, 4) blocks, batch {BATCH}, adam step; "
        f"jax {jax.__version__} on {jax.default_backend()}; {load()}"
    )
    measure(lamina_stack, 2, 4, 0)  # warm-up
    results = {}
    print(f"{'blocks':>7s} {'build+init':>11s} {'trace':>8s} {'compile':>8s} {'first call':>11s}")
    for depth in args.big_depths:
        row = measure(lamina_stack, depth, 4, args.steps)
        results[depth] = row
        print(
            f"{depth:7d} {row['build_init']:11.3f} {row['trace']:8.3f} {row['compile']:8.3f} "
            f"{row['first_call']:11.4f}  s (loss {row['loss']:.3g})"
        )
    listed = {}
    if args.big_list:
        depth = args.big_depths[0]
        print(f"the same {depth} blocks as a Python list (lamina list) ...")
        listed = {depth: measure(lamina_list, depth, 4, 0)}
        row = listed[depth]
        print(
            f"{depth:7d} {row['build_init']:11.3f} {row['trace']:8.3f} {row['compile']:8.3f} "
            f"{row['first_call']:11.4f}  s (a list; loss {row['loss']:.3g})"
        )
    print(f"\n{load()}")
    depths = list(results)
    panels = {
        "seconds": {
            key: (depths, [results[d][key] for d in depths])
            for key in ("build_init", "trace", "compile", "first_call")
        }
    }
    _common.save_run(
        folder,
        {
            "benchmark": "depth --big",
            "load": load(),
            "jax": jax.__version__,
            "results": results,
            "list_results": listed,
        },
        args,
        panels,
        "blocks",
    )


def positive_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"depths must be at least 1, got {text}")
    return values


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="depths 4, 16, 64 and fewer steps (1 to 2 minutes)"
    )
    parser.add_argument(
        "--depths",
        type=positive_ints,
        metavar="N,N,...",
        help="the depths to time (default: 4,8,16,32,64; with --quick 4,16,64)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="compile each (contestant, depth) this many times and keep the fastest "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="steps timed after the first call, for a median step time "
        "(default: 10; with --quick 3)",
    )
    parser.add_argument(
        "--big",
        action="store_true",
        help="time only lm.Stack, at 1,000 and 10,000 Dense(4, 4) blocks (see --big-depths)",
    )
    parser.add_argument(
        "--big-depths",
        type=positive_ints,
        default=[1000, 10000],
        metavar="N,N,...",
        help="the depths of --big (default: 1000,10000)",
    )
    parser.add_argument(
        "--big-list",
        action="store_true",
        help="with --big, also time a lamina Python list at the first --big-depths depth "
        "(1,000 blocks: about three minutes on 2 cores, the cost Stack avoids)",
    )
    _common.add_output_argument(parser, "depth")
    args = parser.parse_args()
    if args.depths is None:
        args.depths = [4, 16, 64] if args.quick else [4, 8, 16, 32, 64]
    if args.steps is None:
        args.steps = 3 if args.quick else 10
    if args.repeat < 1 or args.steps < 0:
        parser.error("--repeat must be at least 1 and --steps at least 0")
    folder = _common.run_folder(args, "depth-big" if args.big else "depth")
    if args.big:
        run_big(args, folder)
    else:
        run_depths(args, folder)


if __name__ == "__main__":
    main()
