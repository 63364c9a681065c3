"""`transform` and `init` of a model with thousands of layers, beside Flax Linen and Haiku.

    python benchmarks/scale.py              # 1,000 Dense(16, 16) layers
    python benchmarks/scale.py --layers 3000

Prints seconds for the first `init` (which compiles the initializers) and for a second one,
with a fresh key. lamina initialises variables that share an initializer, shape and dtype in
one vectorised call; Linen and Haiku initialise them one by one (eagerly).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import lamina as lm


def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def lamina_times(n):
    class Deep(lm.Module):
        def __init__(self):
            self.layers = [lm.Dense(16, 16) for _ in range(n)]

    start = time.perf_counter()
    init, _ = lm.transform(Deep())
    transform = time.perf_counter() - start
    return transform, timed(lambda: init(jax.random.key(0))), timed(lambda: init(jax.random.key(1)))


def linen_times(n):
    import flax.linen as nn

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(n):
                x = nn.Dense(16)(x)
            return x

    x = jnp.ones((1, 16))
    return (
        0.0,
        timed(lambda: Deep().init(jax.random.key(0), x)),
        timed(lambda: Deep().init(jax.random.key(1), x)),
    )


def haiku_times(n):
    import haiku as hk

    def forward(x):
        for _ in range(n):
            x = hk.Linear(16)(x)
        return x

    model = hk.transform(forward)
    x = jnp.ones((1, 16))
    return (
        0.0,
        timed(lambda: model.init(jax.random.key(0), x)),
        timed(lambda: model.init(jax.random.key(1), x)),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    args = parser.parse_args()
    print(
        f"{args.layers} Dense(16, 16) layers ({2 * args.layers} variables); seconds, "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )
    print(f"{'':12s} {'transform':>10s} {'first init':>11s} {'second init':>12s}")
    for name, fn in (("lamina", lamina_times), ("Flax Linen", linen_times), ("Haiku", haiku_times)):
        transform, first, second = fn(args.layers)
        print(f"{name:12s} {transform:10.3f} {first:11.3f} {second:12.3f}")
    print("(Linen and Haiku have no separate transform step; their init runs the forward pass)")


if __name__ == "__main__":
    main()
