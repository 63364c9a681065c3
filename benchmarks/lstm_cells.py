"""A training step of an LSTM over a sequence, with each LSTM cell: lamina's two and Linen's two.

The step is ``jax.jit(value_and_grad(loss))`` plus an SGD update, for `RNN(cell)` over inputs of
shape ``(batch, time, in_size)``: lamina's `LSTMCell` (eight gate products per step) and
`OptimizedLSTMCell` (two, the kernels concatenated), Flax Linen's `LSTMCell` and
`OptimizedLSTMCell`. All four hold the same variables (Linen's init, loaded into each), and
compute the same loss (checked before timing). Run:

    python benchmarks/lstm_cells.py                 # batch 32, 64 steps, 128 -> 256
    python benchmarks/lstm_cells.py --hidden 1024 --quick

It prints the median milliseconds per step of each and its ratio to lamina's `LSTMCell`.
Timings on a shared machine vary from run to run: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import timeit

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm


def training_step(apply):
    """``step(variables, x) -> (loss, variables)``: one SGD step on ``mean(sin(outputs))``."""

    def loss(variables, x):
        return jnp.mean(jnp.sin(apply(variables, x)))

    @jax.jit
    def step(variables, x):
        value, grads = jax.value_and_grad(loss)(variables, x)
        return value, jax.tree.map(lambda v, g: v - 0.01 * g, variables, grads)

    return step


def contestants(in_size, hidden):
    def lamina_rnn(cell):
        apply = lm.transform(lm.RNN(cell(in_size, hidden))).apply
        return lambda v, x: apply(v, None, x)[0]

    def linen_rnn(cell):
        rnn = nn.RNN(cell(hidden))
        return rnn.apply

    return {
        "lamina LSTMCell": lamina_rnn(lm.LSTMCell),
        "lamina OptimizedLSTMCell": lamina_rnn(lm.OptimizedLSTMCell),
        "Linen LSTMCell": linen_rnn(nn.LSTMCell),
        "Linen OptimizedLSTMCell": linen_rnn(nn.OptimizedLSTMCell),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--time", type=int, default=64)
    parser.add_argument("--in-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()

    x = jnp.asarray(
        np.random.default_rng(0).standard_normal((args.batch, args.time, args.in_size)),
        jnp.float32,
    )
    variables = jax.jit(nn.RNN(nn.LSTMCell(args.hidden)).init)(jax.random.key(0), x)
    steps = {name: training_step(fn) for name, fn in contestants(args.in_size, args.hidden).items()}
    losses = {name: float(step(variables, x)[0]) for name, step in steps.items()}
    reference = losses["lamina LSTMCell"]
    for name, value in losses.items():
        assert abs(value - reference) <= 1e-5 * max(1.0, abs(reference)), (name, value, reference)

    repeat, number = (3, 5) if args.quick else (7, 10)
    print(
        f"LSTM training step, batch {args.batch}, {args.time} steps, "
        f"{args.in_size} -> {args.hidden}, {jax.devices()[0].platform}:"
    )
    times = {}
    for name, step in steps.items():
        run = lambda step=step: jax.block_until_ready(step(variables, x))  # noqa: E731
        run()
        times[name] = np.median(timeit.repeat(run, repeat=repeat, number=number)) / number * 1e3
    base = times["lamina LSTMCell"]
    for name, ms in times.items():
        print(f"  {name:<26} {ms:9.3f} ms   x{ms / base:5.2f}")


if __name__ == "__main__":
    main()
