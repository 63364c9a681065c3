"""Where the char transformer's training step spends its time: XLA:CPU's per-operation profile.

XLA:CPU runs a compiled program as a sequence of *thunks* (a fused loop, a library call for a
matrix product or a reduction, a copy). With ``--xla_cpu_enable_xprof_traceme=true`` it
records each thunk's start and end for JAX's profiler. This script compiles the example's
training step (`examples/char_transformer.py`'s `make_steps`: its model, AdamW and batch),
traces a few steps, and sums the thunks' times per step:

- by **layer**, from the ``op_name`` XLA keeps for every instruction: ``jit(dense)``,
  ``jit(project_qkv)``, ``jit(attention_kernel)``, ``jit(normalization)``, ``jit(gelu)``...
  (lamina jits each layer's computation under its own name, so the names survive fusion);
- by **phase**: forward (``jvp``), backward (``transpose``), the optimiser (the rest);
- by **kind**: library matrix products and reductions (``__ynn_fusion``: YNNPACK, XLA:CPU's
  default for dots and reductions in jaxlib 0.10), Eigen dots, XLA's own loop fusions, copies;

and prints the longest thunks, the host's time for a call to return (dispatch) and the
compile time split into tracing, lowering and XLA's compile. The sum of the thunks' times is
compared with the step's wall time: when they agree, the thunks ran one after another.

    python benchmarks/char_transformer_profile.py                  # about a minute
    python benchmarks/char_transformer_profile.py --devices 2 --top 60
    python benchmarks/char_transformer_profile.py --devices 2 --steps-per-call   # as the example
    python benchmarks/char_transformer_profile.py --json profile.json

``--steps-per-call`` profiles the program the example runs, 25 steps per call (a scan); the
default is one step per call, whose figures the docs quote from before the example ran 25.

The figures are milliseconds per step on this machine; other processes inflate them (the
load average is printed), proportions hold better than absolute values.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

FLAG = "--xla_cpu_enable_xprof_traceme=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()

import jax  # noqa: E402  (XLA reads its flags when the backend starts)
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from char_transformer import DEFAULT_DATA, example  # noqa: E402  (the example, loaded once)

import lamina as lm  # noqa: E402

LAYERS = (  # op_name fragment -> row; the first that matches names the row
    ("jit(project_qkv)", "attention: q, k, v projections"),
    ("jit(attention_kernel)", "attention: scores, mask, softmax, values"),
    ("jit(project_heads_out)", "attention: output projection"),
    ("jit(dense)", "MLP: the two Dense layers"),
    ("jit(normalization)", "LayerNorm"),
    ("jit(gelu)", "GELU"),
    ("attend", "output layer (the tied embedding's matrix product)"),
    ("embed", "embeddings (gather, scatter-add)"),
)
# What no layer names: the loss (optax's cross-entropy has no jit of its own), the residual
# additions, the Stack's per-layer slices of its weights, gradient clipping and AdamW.
REST = "the rest: cross-entropy, residuals, Stack slices, clipping, AdamW"
# With several devices: the gradients' sum across them, including the wait for the slower
# (their -start/-done forms too).
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
COLLECTIVE = "all-reduce across devices (with the wait for the other)"


def instruction_metadata(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Maps each instruction of the compiled program to (kind, op_name)."""
    table = {}
    for line in hlo_text.splitlines():
        # The type is one word, or a tuple in parentheses (all-reduce, multi-output fusions).
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w-]*)\(", line)
        if not match:
            continue
        name, _, opcode = match.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        kind = opcode
        if opcode == "fusion":
            kind_match = re.search(r"kind=(\w+)", line)
            kind = kind_match.group(1) if kind_match else "fusion"
            if "__ynn_fusion" in line or "ynn" in name:
                what = op_name.group(1).rsplit("/", 1)[-1] if op_name else ""
                kind = "YNNPACK " + ("dot" if what == "dot_general" else "reduce/other")
            elif "__xnn_fusion" in line:
                kind = "XNNPACK"
            elif "copy" in name or "transpose" in name:
                kind = "copy/transpose fusion"
            else:
                kind = "XLA loop fusion"
        table[name] = (kind, op_name.group(1) if op_name else "")
    return table


def layer_of(kind: str, op_name: str) -> str:
    if kind.startswith(COLLECTIVES):  # their op_name is the sum's, in the backward pass
        return COLLECTIVE
    for fragment, row in LAYERS:
        if fragment in op_name:
            return row
    return REST if op_name else "(no op_name)"


def phase_of(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "optimiser and the rest"


def trace_events(folder: str) -> list[dict]:
    (path,) = Path(folder).glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def build(args, per_call=1):
    """The example's step, parameters, optimiser state and one call's batches, like its
    `train`: `per_call` steps per call (a scan)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data = example.load_text(args)
    model = example.build_model(args, len(data.chars))
    init, apply = lm.transform(model)
    params = jax.jit(init)(jax.random.key(0))["params"]
    optimizer, _ = example.make_optimizer(args, model, params)
    devices = example.batch_devices(args.devices, args.batch_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    split = NamedSharding(mesh, P("batch"))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.jit(optimizer.init)(params)
    train_step, _ = example.make_steps(apply, optimizer, split, per_call)
    count = None if per_call == 1 else per_call
    batch = example.Batches(data.train, args, 0, split).next(count)
    return train_step, params, opt_state, batch, example.Batches(data.train, args, 0, split)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=10, help="steps traced, in whole calls (default: 10)"
    )
    parser.add_argument(
        "--scheduler",
        help="XLA:CPU's scheduler for the step (a compiler option; default: XLA's choice): "
        "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED, CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
    )
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        help="steps per call, a scan, as the example runs %(const)s (default: %(default)s); "
        "the figures are per step",
        const=example.STEPS_PER_CALL,
        nargs="?",
    )
    parser.add_argument("--top", type=int, default=25, help="longest thunks to list")
    parser.add_argument("--json", help="write the tables to this file")
    parser.add_argument(
        "--show",
        metavar="ROW",
        action="append",
        default=[],
        help="list the thunks of the 'by layer' rows containing ROW (repeatable)",
    )
    options, rest = parser.parse_known_args()
    example.cpu_cores_as_devices()
    example.keep_freed_memory()  # the example's malloc settings
    data = str(DEFAULT_DATA) if DEFAULT_DATA.is_file() else None
    args = example.parse_args([*(["--data", data] if data else []), *rest, "--quiet"])
    args.devices = options.devices

    compile_events: dict[str, float] = collections.defaultdict(float)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compile_events.__setitem__(
            event, compile_events[event] + seconds
        )
    )
    per_call = options.steps_per_call
    if per_call < 1:
        parser.error(f"--steps-per-call must be at least 1, got {per_call}")
    train_step, params, opt_state, batch, batches = build(args, per_call)
    compile_events.clear()  # from here on: the step's compile alone
    key = jax.random.key(1)
    step_args = (params, opt_state, *batch, key, 0)
    tick = time.perf_counter()
    lowered = train_step.lower(*step_args)
    lower_seconds = time.perf_counter() - tick
    tick = time.perf_counter()
    overrides = {"xla_cpu_scheduler_type": options.scheduler} if options.scheduler else None
    compiled = lowered.compile(overrides)
    compile_seconds = time.perf_counter() - tick
    step_events = dict(compile_events)
    table = instruction_metadata(compiled.as_text())

    def calls(steps):  # calls that run about `steps` steps, at least one
        return max(round(steps / per_call), 1)

    state = (params, opt_state)
    for i in range(calls(5)):  # warm-up
        *state, loss = compiled(*state, *batch, key, i * per_call)
    loss.block_until_ready()
    walls, cpus = [], []
    timed = max(calls(40), 5)
    for i in range(timed):
        wall, cpu = time.perf_counter(), time.process_time()
        *state, loss = compiled(*state, *batch, key, i * per_call)
        loss.block_until_ready()
        walls.append((time.perf_counter() - wall) / per_call)
        cpus.append((time.process_time() - cpu) / per_call)
    step_ms = 1000 * statistics.median(walls)
    cpu_ratio = statistics.median(cpus) / statistics.median(walls)

    # The host: how long a call takes to return (dispatch; the devices run behind it), with
    # at most `example.IN_FLIGHT` steps queued, as the example's loop keeps them (more
    # deadlock XLA:CPU's all-reduce on several devices); then drawing a batch alone.
    returns, queued = [], []
    in_flight = max(example.IN_FLIGHT // per_call, 1)
    for i in range(max(calls(50), 2 * in_flight + 1)):
        tick = time.perf_counter()
        *state, loss = compiled(*state, *batch, key, i * per_call)
        returns.append(time.perf_counter() - tick)
        queued.append(loss)
        if i >= in_flight:
            queued[i - in_flight].block_until_ready()
    dispatch_ms = 1000 * statistics.median(returns)
    loss.block_until_ready()
    tick = time.perf_counter()
    for _ in range(200):
        jax.block_until_ready(batches.next())
    batch_ms = 1000 * (time.perf_counter() - tick) / 200

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for i in range(calls(options.steps)):
                *state, loss = compiled(*state, *batch, key, i * per_call)
                loss.block_until_ready()
        events = trace_events(folder)
    traced = calls(options.steps) * per_call  # steps

    by_name: dict[str, float] = collections.defaultdict(float)
    threads: dict[int, float] = collections.defaultdict(float)
    for event in events:
        if event.get("ph") == "X" and event.get("name") in table:
            by_name[event["name"]] += event["dur"] / 1000 / traced
            threads[event.get("tid", 0)] += event["dur"] / 1000 / traced
    rows = {"layer": collections.Counter(), "phase": collections.Counter()}
    rows["kind"] = collections.Counter()
    for name, ms in by_name.items():
        kind, op_name = table[name]
        rows["layer"][layer_of(kind, op_name)] += ms
        rows["phase"][phase_of(op_name)] += ms
        rows["kind"][kind] += ms
    total = sum(by_name.values())

    print(
        f"jax {jax.__version__}, {args.devices} device(s), {len(table)} instructions, load "
        f"{os.getloadavg()[0]:.2f}, {per_call} step(s) per call, scheduler "
        f"{options.scheduler or 'default'}\n"
        f"step {step_ms:.1f} ms (median of {timed} calls, CPU/wall "
        f"{cpu_ratio:.2f}); thunks sum to {total:.1f} ms/step on {len(threads)} thread(s); "
        f"host: {dispatch_ms:.2f} ms for a call to return, {batch_ms:.2f} ms per batch"
    )
    print(
        f"compile: trace+lower {lower_seconds:.2f} s, XLA {compile_seconds:.2f} s ("
        + ", ".join(f"{k.rsplit('/', 1)[-1]} {v:.2f} s" for k, v in step_events.items())
        + ")"
    )
    for title, counter in rows.items():
        print(f"\n{'by ' + title:<66} {'ms/step':>8} {'share':>6}")
        for row, ms in counter.most_common():
            print(f"  {row:<64} {ms:8.2f} {ms / total:6.1%}")
    print(f"\n{'longest thunks':<44} {'ms/step':>8}  kind, op_name")
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[: options.top]:
        kind, op_name = table[name]
        print(f"  {name:<42} {ms:8.3f}  {kind}, {op_name[-70:]}")
    for wanted in options.show:
        print(f"\nthunks of rows containing {wanted!r}")
        for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1]):
            kind, op_name = table[name]
            if wanted in layer_of(kind, op_name):
                print(f"  {name:<42} {ms:8.3f}  {kind}, {op_name[-90:]}")
    if options.json:
        Path(options.json).write_text(
            json.dumps(
                {
                    "step_ms": step_ms,
                    "cpu_per_wall": cpu_ratio,
                    "dispatch_ms": dispatch_ms,
                    "batch_ms": batch_ms,
                    "thunks_ms": total,
                    **{title: dict(counter) for title, counter in rows.items()},
                    "load": os.getloadavg()[0],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
