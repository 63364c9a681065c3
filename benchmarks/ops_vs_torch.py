"""The char transformer's operations one at a time: XLA:CPU (through lamina) against PyTorch.

Each row is one operation of the char transformer's training step at its shapes (batch 12,
context 64, width 128, 4 heads, MLP width 512), forward and backward, run by JAX (lamina's
own kernels: `dense`, `dot_product_attention`, `LayerNorm`, `gelu`, each `jax.jit`-compiled
with its gradient) and by PyTorch on the same arrays, timed in alternating rounds in one
process so that both see the same machine. The ratio says which operations XLA:CPU runs
slower than PyTorch's kernels (oneDNN/MKL matrix products, fused LayerNorm, the CPU flash
attention), that is, where the step's gap comes from; the plain matrix products are the
reproducer of the largest one.

    python benchmarks/ops_vs_torch.py              # about 10 seconds; needs torch

Each JAX figure includes one jitted call's dispatch (about 25 us, against 2 for
``torch.mm``): it matters only in the smallest rows (the 768x128x128 product), and inside a
compiled training step it is not paid per operation.

PyTorch runs on as many threads as JAX's CPU client uses cores (``torch.set_num_threads``).
Needs a quiet machine: PyTorch's OpenMP threads slow down by an order of magnitude when
another process takes a core (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm
from lamina.nn.attention import dot_product_attention
from lamina.nn.linear import dense

B, T, C, H, HIDDEN = 12, 64, 128, 4, 512


def timed(function, count: int) -> float:
    """Median microseconds of `count` calls."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def cases(torch):
    """(name, GFLOP or None, jax thunk, torch thunk) for every operation."""
    rng = np.random.default_rng(0)

    def array(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def pair(*shape, grad=True):
        value = array(*shape)
        return jnp.asarray(value), torch.from_numpy(value).requires_grad_(grad)

    rows = []
    for m, k, n in [(B * T, C, HIDDEN), (B * T, HIDDEN, C), (B * T, C, C), (C, B * T, HIDDEN)]:
        (ja, ta), (jb, tb) = pair(m, k, grad=False), pair(k, n, grad=False)
        product = jax.jit(jnp.matmul)
        rows.append(
            (
                f"matmul {m}x{k} @ {k}x{n}",
                2 * m * k * n / 1e9,
                lambda ja=ja, jb=jb, f=product: f(ja, jb).block_until_ready(),
                lambda ta=ta, tb=tb: torch.mm(ta, tb),
            )
        )

    def race(name, flops, jax_function, jax_args, torch_function, torch_args):
        cotangent = jax_function(*jax_args)
        gradient = jax.jit(lambda *a: jax.vjp(jax_function, *a)[1](cotangent))
        torch_cotangent = torch.from_numpy(np.array(cotangent))

        def torch_step():
            for a in torch_args:
                a.grad = None
            torch_function(*torch_args).backward(torch_cotangent)

        rows.append((name, flops, lambda: jax.block_until_ready(gradient(*jax_args)), torch_step))

    (jx, tx), (jw, tw), (jbias, tbias) = pair(B, T, C), pair(C, HIDDEN), pair(HIDDEN)
    race(
        "Dense 128->512, forward+backward",
        3 * 2 * B * T * C * HIDDEN / 1e9,
        lambda x, w, b: dense(x, w, b, jnp.float32),
        (jx, jw, jbias),
        lambda x, w, b: torch.nn.functional.linear(x, w.T, b),
        (tx, tw, tbias),
    )
    (jq, tq), (jk, tk), (jv, tv) = (pair(B, T, H, C // H) for _ in range(3))
    causal = lm.make_causal_mask(jnp.zeros((B, T)))
    race(
        "attention (causal), forward+backward",
        3 * 2 * 2 * B * H * T * T * (C // H) / 1e9,
        lambda q, k, v: dot_product_attention(q, k, v, mask=causal),
        (jq, jk, jv),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2),
        (tq, tk, tv),
    )
    norm = lm.LayerNorm(C, epsilon=1e-5)
    apply = lm.transform(norm).apply
    (js, ts), (jb2, tb2) = pair(C), pair(C)
    race(
        "LayerNorm, forward+backward",
        None,
        lambda x, s, b: apply({"params": {"scale": s, "bias": b}}, None, x)[0],
        (jx, js, jb2),
        lambda x, s, b: torch.nn.functional.layer_norm(x, (C,), s, b, 1e-5),
        (tx, ts, tb2),
    )
    (jh, th) = pair(B, T, HIDDEN)
    race(
        "GELU (tanh), forward+backward",
        None,
        lambda h: lm.gelu(h),
        (jh,),
        lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
        (th,),
    )
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="(default: %(default)s)")
    parser.add_argument("--calls", type=int, default=50, help="per round (default: %(default)s)")
    args = parser.parse_args()
    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    torch.set_num_threads(threads)
    print(
        f"jax {jax.__version__}, torch {torch.__version__} on {torch.get_num_threads()} "
        f"threads; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'operation':<40} {'JAX us':>8} {'torch us':>9} {'JAX/torch':>9} {'JAX GFLOP/s':>11}")
    for name, flops, jax_thunk, torch_thunk in cases(torch):
        for _ in range(10):
            jax_thunk()
            torch_thunk()
        jax_times, torch_times = [], []
        for _ in range(args.rounds):
            jax_times.append(timed(jax_thunk, args.calls))
            torch_times.append(timed(torch_thunk, args.calls))
        j, t = statistics.median(jax_times), statistics.median(torch_times)
        rate = f"{flops / j * 1e6:11.0f}" if flops else f"{'':>11}"
        print(f"{name:<40} {j:8.0f} {t:9.0f} {j / t:9.2f} {rate}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
