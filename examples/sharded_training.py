"""The character transformer trained on a device mesh: the batch data-parallel, the weights
tensor-parallel.

The model and the data are examples/char_transformer.py's (imported, not copied): a GPT
whose blocks are one `lm.Stack`. Its layers name the axes of their variables
(``kernel_sharding=("embed", "mlp")``...: logical names, which mean nothing on one device);
here rules map those names onto a 2-D mesh of devices, ``("data", "model")``, and
`lm.shardings` turns names and rules into one `NamedSharding` per variable:

- ``"data"`` splits each batch (data parallelism: every device row sees its own windows);
- ``"model"`` splits the attention heads and the MLP's hidden units (tensor parallelism,
  Megatron's layout: the query/key/value and first MLP kernels by columns, the output
  projections by rows), so each device holds a quarter of those weights;
- the Stack's depth axis is not sharded (``Stack(..., depth_sharding=None)``, the default),
  nor are the embeddings (the vocabulary, some 100 characters, need not divide the mesh).

The variables are created already sharded (``jax.jit(init, out_shardings=...)``), Adam's
moments like the weights (``optax.tree_map_params``), and ``jax.jit`` partitions the
training step (GSPMD): XLA inserts the collectives. Nothing else changes from one device:
the numbers are the same up to float rounding.

The mesh is ``--data-parallel`` x ``--model-parallel`` devices (by default as many as JAX
has: 2 x 4 of 8, 1 x 1 of one GPU). On a CPU, JAX has one device; so, before importing JAX,
this script asks XLA for 8 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, unless XLA_FLAGS already sets a
count). That flag affects only the CPU backend: on GPUs or TPUs the script runs unchanged on
the accelerators. CPU host devices share the machine's cores, so here they show that the
program partitions and what it computes, not speed.

    python examples/sharded_training.py                      # 500 iterations, small model
    python examples/sharded_training.py --iters 50 --data-parallel 8 --model-parallel 1

The last line it prints is ``val loss: X.XXXX``, as the char transformer's.
"""

from __future__ import annotations

import os
import re

if not re.search(r"--xla_force_host_platform_device_count", os.environ.get("XLA_FLAGS", "")):
    # Before JAX starts: 8 CPU host devices (the CPU backend only; accelerators unaffected).
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import argparse
import math

import char_transformer as ct
import jax
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lamina as lm

# Logical axis name -> mesh axis. Names without a rule ("embed", "kv", "vocab", the Stack's
# depth) are replicated.
RULES = {"batch": "data", "heads": "model", "mlp": "model"}


class MeshError(ValueError):
    """The mesh does not fit the devices, the batch or the model."""


def make_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """The ``(data, model)`` mesh of ``--data-parallel`` x ``--model-parallel`` devices.

    Left out, they fit the devices JAX has: 2 x 4 of 8 (the CPU host devices this script asks
    for), 1 x 1 on one GPU, 2 x 4 on eight.
    """
    available = jax.devices()
    if args.model_parallel is None:
        args.model_parallel = math.gcd(len(available), 4)
    if args.data_parallel is None:
        args.data_parallel = max(len(available) // args.model_parallel, 1)
    shape = (args.data_parallel, args.model_parallel)
    if math.prod(shape) > len(available):
        raise MeshError(
            f"a {shape[0]} x {shape[1]} mesh needs {math.prod(shape)} devices; JAX has "
            f"{len(available)} {available[0].platform.upper()} device(s)"
        )
    if args.batch_size % args.data_parallel:
        raise MeshError(
            f"--data-parallel {args.data_parallel} does not divide --batch-size "
            f"{args.batch_size}: each row of the mesh takes an equal share of the batch"
        )
    devices = available[: math.prod(shape)]
    # Auto axes: jax.jit partitions the program from the shardings of its inputs (GSPMD).
    return jax.make_mesh(shape, ("data", "model"), (AxisType.Auto,) * 2, devices=devices)


def train(args: argparse.Namespace, data: ct.Text) -> dict:
    mesh = make_mesh(args)
    model = ct.build_model(args, len(data.chars))
    init, apply = lm.transform(model)
    try:
        weights = lm.shardings(model, mesh, RULES)["params"]
    except ValueError as error:  # e.g. --heads not a multiple of --model-parallel
        raise MeshError(str(error)) from None
    shapes = jax.eval_shape(lambda: init(jax.random.key(0))["params"])
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    print(
        f"model: {args.layers} layers, {args.heads} heads, width {args.width}, context "
        f"{args.block_size}, {count:,} parameters"
        + ("; the blocks compute in bfloat16" if args.precision == "bfloat16" else "")
    )
    platform = mesh.devices.flat[0].platform.upper()
    print(f"mesh: {args.data_parallel} x {args.model_parallel} {platform} devices (data x model)")
    shape = shapes["blocks"]["block"]["mlp_in"]["kernel"].shape
    sharding = weights["blocks"]["block"]["mlp_in"]["kernel"]
    print(
        f"blocks/block/mlp_in/kernel {shape}: {sharding.spec}, {sharding.shard_shape(shape)} "
        f"on each device"
    )

    optimizer, _ = ct.make_optimizer(args, model, shapes)
    replicated = NamedSharding(mesh, P())
    moments = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, shapes),
        weights,
        transform_non_params=lambda _: replicated,
    )
    # Created where they live: no device ever holds a whole sharded weight.
    params = jax.jit(lambda key: init(key)["params"], out_shardings=weights)(
        jax.random.key(args.seed)
    )
    opt_state = jax.jit(optimizer.init, out_shardings=moments)(params)
    split = NamedSharding(mesh, P("data", None))  # (batch, length): the batch split
    train_step, evaluate = ct.make_steps(apply, optimizer, split)
    batches = ct.Batches(data.train, args, args.seed, split)
    validation = ct.validation_windows(data, args, split)
    key = jax.device_put(jax.random.key(args.seed + 1), replicated)
    run = ct.fit(args, (params, opt_state), train_step, evaluate, batches, validation, key)
    params, history = run["params"], run["history"]
    # The step kept every weight where the rules put it.
    kept = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), params, weights)
    return {
        "history": history,
        "val_loss": history[-1]["val_loss"],
        "seconds": run["seconds"],
        "shardings_kept": all(jax.tree.leaves(kept)),
        "params": params,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--data", metavar="PATH", help="a UTF-8 text file (default: Python's own source)")
    add(
        "--data-parallel",
        type=int,
        help="mesh rows, each with a share of the batch (default: the devices left over by "
        "--model-parallel: 2 of 8)",
    )
    add(
        "--model-parallel",
        type=int,
        help="mesh columns, each with a share of the weights (default: as many of 4 as divide "
        "the devices: 4 of 8, 1 of 1)",
    )
    add("--layers", type=int, default=2, help="(default: %(default)s)")
    add("--heads", type=int, default=4, help="a multiple of --model-parallel (default: 4)")
    add("--width", type=int, default=64, help="(default: %(default)s)")
    add("--block-size", type=int, default=32, help="context (default: %(default)s)")
    add("--batch-size", type=int, default=16, help="(default: %(default)s)")
    add("--iters", type=int, default=500, help="training iterations (default: %(default)s)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    add("--warmup-iters", type=int, default=20, help="(default: %(default)s)")
    add("--eval-interval", type=int, default=50, help="(default: %(default)s)")
    add("--eval-batches", type=int, default=4, help="(default: %(default)s)")
    add("--seed", type=int, default=1337, help="(default: %(default)s)")
    add(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the blocks' compute dtype, as in char_transformer.py (default: %(default)s)",
    )
    add("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("data_parallel", "model_parallel"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("layers", "heads", "width", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("batch_size", "iters", "eval_interval", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    # what char_transformer's model and optimizer also read
    args.dropout, args.tie, args.unroll, args.log_interval = 0.0, True, None, 10
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        data = ct.load_text(args)
        results = train(args, data)
    except (OSError, UnicodeDecodeError, ct.TextTooShortError, MeshError) as error:
        raise SystemExit(f"error: {error}") from None
    kept = "kept" if results["shardings_kept"] else "NOT kept"
    print(f"{args.iters} iterations in {results['seconds']:.1f} s; weight shardings {kept}")
    print(f"val loss: {results['val_loss']:.4f}")
    return results


if __name__ == "__main__":
    main()
