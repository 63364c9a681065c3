"""Training-step time of an MLP and of the seed's CNN: lamina, raw JAX and four peers.

Every contestant holds the same weights (lamina's `init`, moved into each library's layout)
and computes the same loss on the same batch (checked before timing); the step is
``jax.jit`` of `jax.value_and_grad` plus an Optax SGD-with-momentum update. The programs are
the same, so the ratios should be 1.00 within noise. The CNN is `examples/mnist.py`'s
`ConvNet` (two 3x3 convolutions, max pools, two dense layers) on 28x28 images, with its
dropout off: each library draws dropout masks its own way, which would make the programs
differ (`mnist_vs_linen.py` trains with dropout on). Equinox's layers take one example in
channels-first layout, so its model is `jax.vmap`-ped and transposes each example. Run:

    python benchmarks/train_steps.py            # both models
    python benchmarks/train_steps.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

import lamina as lm

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from _harness import COLUMNS, Row, blocking, check_same, interleaved, row_from_samples
from mnist import ConvNet

# --- the MLP --------------------------------------------------------------------------------


class LaminaMlp(lm.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = [lm.Dense(a, b) for a, b in itertools.pairwise(sizes)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = lm.relu(layer(x))
        return self.layers[-1](x)


def mlp_builders(sizes):
    """column -> weights -> (forward(params, x), params); weights are lamina's params."""
    n = len(sizes) - 1

    def raw(weights):
        def forward(params, x):
            for i in range(n):
                x = x @ params[str(i)]["kernel"] + params[str(i)]["bias"]
                x = jax.nn.relu(x) if i < n - 1 else x
            return x

        return forward, weights["layers"]

    def lamina(weights):
        _, apply = lm.transform(LaminaMlp(sizes))
        return (lambda p, x: apply({"params": p}, None, x)[0]), weights

    def linen(weights):
        import flax.linen as nn

        class Mlp(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i, size in enumerate(sizes[1:]):
                    x = nn.Dense(size, name=f"layers_{i}")(x)
                    x = nn.relu(x) if i < n - 1 else x
                return x

        params = {f"layers_{i}": weights["layers"][str(i)] for i in range(n)}
        return (lambda p, x: Mlp().apply({"params": p}, x)), params

    def nnx_(weights):
        from flax import nnx

        class Mlp(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List(
                    [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
                )

            def __call__(self, x):
                for layer in self.layers[:-1]:
                    x = nnx.relu(layer(x))
                return self.layers[-1](x)

        model = Mlp(nnx.Rngs(0))
        for i, layer in enumerate(model.layers):
            layer.kernel.value = weights["layers"][str(i)]["kernel"]
            layer.bias.value = weights["layers"][str(i)]["bias"]
        graphdef, params = nnx.split(model)
        return (lambda p, x: nnx.merge(graphdef, p)(x)), params

    def haiku(weights):
        import haiku as hk

        def forward(x):
            for i, size in enumerate(sizes[1:]):
                x = hk.Linear(size, name=f"linear_{i}")(x)
                x = jax.nn.relu(x) if i < n - 1 else x
            return x

        model = hk.without_apply_rng(hk.transform(forward))
        params = {
            f"linear_{i}": {
                "w": weights["layers"][str(i)]["kernel"],
                "b": weights["layers"][str(i)]["bias"],
            }
            for i in range(n)
        }
        return model.apply, params

    def equinox(weights):
        import equinox as eqx

        keys = jax.random.split(jax.random.key(0), n)
        layers = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layer = eqx.nn.Linear(a, b, key=keys[i])
            w = weights["layers"][str(i)]
            layers.append(
                eqx.tree_at(lambda m: (m.weight, m.bias), layer, (w["kernel"].T, w["bias"]))
            )

        def forward(layers, x):
            for layer in layers[:-1]:
                x = jax.nn.relu(jax.vmap(layer)(x))
            return jax.vmap(layers[-1])(x)

        return forward, layers

    return {
        "jax": raw,
        "lamina": lamina,
        "linen": linen,
        "nnx": nnx_,
        "haiku": haiku,
        "equinox": equinox,
    }


# --- the CNN --------------------------------------------------------------------------------

CONV_DIMS = ("NHWC", "HWIO", "NHWC")


def cnn_builders(image, num_classes=10):
    h, w = image

    def raw(weights):
        def conv(x, p):
            y = jax.lax.conv_general_dilated(
                x, p["kernel"], (1, 1), "SAME", dimension_numbers=CONV_DIMS
            )
            return y + p["bias"]

        def pool(x):
            return jax.lax.reduce_window(
                x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
            )

        def forward(p, x):
            x = pool(jax.nn.relu(conv(x, p["conv1"])))
            x = pool(jax.nn.relu(conv(x, p["conv2"])))
            x = x.reshape((x.shape[0], -1))
            x = jax.nn.relu(x @ p["fc1"]["kernel"] + p["fc1"]["bias"])
            return x @ p["fc2"]["kernel"] + p["fc2"]["bias"]

        return forward, weights

    def lamina(weights):
        _, apply = lm.transform(ConvNet(image, 1, num_classes))
        return (lambda p, x: apply({"params": p}, None, x, is_training=False)[0]), weights

    def linen(weights):
        from mnist_vs_linen import LinenConvNet

        model = LinenConvNet(num_classes)
        return (lambda p, x: model.apply({"params": p}, x, False)), weights

    def nnx_(weights):
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.conv1 = nnx.Conv(1, 32, (3, 3), padding="SAME", rngs=rngs)
                self.conv2 = nnx.Conv(32, 64, (3, 3), padding="SAME", rngs=rngs)
                self.fc1 = nnx.Linear((h // 4) * (w // 4) * 64, 128, rngs=rngs)
                self.fc2 = nnx.Linear(128, num_classes, rngs=rngs)

            def __call__(self, x):
                x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
                x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
                x = x.reshape((x.shape[0], -1))
                return self.fc2(nnx.relu(self.fc1(x)))

        model = Net(nnx.Rngs(0))
        for name in ("conv1", "conv2", "fc1", "fc2"):
            getattr(model, name).kernel.value = weights[name]["kernel"]
            getattr(model, name).bias.value = weights[name]["bias"]
        graphdef, params = nnx.split(model)
        return (lambda p, x: nnx.merge(graphdef, p)(x)), params

    def haiku(weights):
        import haiku as hk

        def forward(x):
            for name, channels in (("conv1", 32), ("conv2", 64)):
                x = jax.nn.relu(hk.Conv2D(channels, 3, padding="SAME", name=name)(x))
                x = hk.max_pool(x, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
            x = x.reshape((x.shape[0], -1))
            x = jax.nn.relu(hk.Linear(128, name="fc1")(x))
            return hk.Linear(num_classes, name="fc2")(x)

        model = hk.without_apply_rng(hk.transform(forward))
        params = {k: {"w": v["kernel"], "b": v["bias"]} for k, v in weights.items()}
        return model.apply, params

    def equinox(weights):
        import equinox as eqx

        keys = jax.random.split(jax.random.key(0), 4)

        def conv(a, b, key, p):
            layer = eqx.nn.Conv2d(a, b, 3, padding=1, key=key)
            kernel = jnp.transpose(p["kernel"], (3, 2, 0, 1))  # HWIO -> OIHW
            return eqx.tree_at(
                lambda m: (m.weight, m.bias), layer, (kernel, p["bias"][:, None, None])
            )

        def linear(a, b, key, p):
            layer = eqx.nn.Linear(a, b, key=key)
            return eqx.tree_at(lambda m: (m.weight, m.bias), layer, (p["kernel"].T, p["bias"]))

        class Net(eqx.Module):
            conv1: eqx.nn.Conv2d
            conv2: eqx.nn.Conv2d
            fc1: eqx.nn.Linear
            fc2: eqx.nn.Linear
            pool: eqx.nn.MaxPool2d

            def __call__(self, x):  # one example, HWC
                x = jnp.transpose(x, (2, 0, 1))
                x = self.pool(jax.nn.relu(self.conv1(x)))
                x = self.pool(jax.nn.relu(self.conv2(x)))
                x = jnp.transpose(x, (1, 2, 0)).reshape(-1)  # flattened as HWC, like the others
                return self.fc2(jax.nn.relu(self.fc1(x)))

        net = Net(
            conv(1, 32, keys[0], weights["conv1"]),
            conv(32, 64, keys[1], weights["conv2"]),
            linear((h // 4) * (w // 4) * 64, 128, keys[2], weights["fc1"]),
            linear(128, num_classes, keys[3], weights["fc2"]),
            eqx.nn.MaxPool2d(2, 2),
        )
        params, static = eqx.partition(net, eqx.is_array)
        return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params

    return {
        "jax": raw,
        "lamina": lamina,
        "linen": linen,
        "nnx": nnx_,
        "haiku": haiku,
        "equinox": equinox,
    }


# --- measuring ------------------------------------------------------------------------------


def time_steps(builders, weights, x, labels, rounds, number) -> dict[str, list[float]]:
    """Seconds per jitted training step of each contestant (same loss checked first)."""
    optimizer = optax.sgd(1e-3, momentum=0.9)
    steps, losses = {}, {}
    for column in COLUMNS:
        forward, params = builders[column](weights)

        def loss_fn(params, x, labels, forward=forward):
            logits = forward(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def step(params, opt_state, x, labels, loss_fn=loss_fn):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        losses[column] = jax.jit(loss_fn)(params, x, labels)
        steps[column] = blocking(jax.jit(step), params, optimizer.init(params), x, labels)
    check_same(losses, rtol=1e-4, atol=1e-5)
    return interleaved(steps, rounds, number)


SIZES = {  # mode -> (MLP sizes, MLP batch, CNN image size, CNN batch, rounds, steps per round)
    "smoke": ((16, 16, 10), 4, (8, 8), 2, 2, 1),
    "quick": ((784, 512, 512, 10), 128, (28, 28), 64, 7, 3),
    "full": ((784, 512, 512, 10), 128, (28, 28), 64, 15, 5),
}


def collect(mode: str = "quick") -> list[Row]:
    """run.py's rows: ms per training step of the MLP and of the CNN."""
    sizes, mlp_batch, image, cnn_batch, rounds, number = SIZES[mode]
    key = jax.random.key(0)
    rows = []

    init, _ = lm.transform(LaminaMlp(sizes))
    weights = init(key)["params"]
    x = jax.random.normal(jax.random.key(1), (mlp_batch, sizes[0]))
    labels = jax.random.randint(jax.random.key(2), (mlp_batch,), 0, sizes[-1])
    samples = time_steps(mlp_builders(sizes), weights, x, labels, rounds, number)
    what = " -> ".join(map(str, sizes))
    rows.append(
        row_from_samples(
            "train_mlp", f"train step, MLP {what}, batch {mlp_batch}, ms", "ms", samples, 1e3
        )
    )

    init, _ = lm.transform(ConvNet(image, 1, 10))
    weights = init(key)["params"]
    x = jax.random.normal(jax.random.key(1), (cnn_batch, *image, 1))
    labels = jax.random.randint(jax.random.key(2), (cnn_batch,), 0, 10)
    samples = time_steps(cnn_builders(image), weights, x, labels, rounds, number)
    notes = {"equinox": "vmapped over the batch; transposes each example to channels-first"}
    rows.append(
        row_from_samples(
            "train_cnn",
            f"train step, seed CNN {image[0]}x{image[1]}, batch {cnn_batch}, ms",
            "ms",
            samples,
            1e3,
            notes=notes,
        )
    )
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    for row in collect("quick" if args.quick else "full"):
        print(row.label)
        for column, ratio in row.ratios().items():
            print(f"  {column:8s} {row.values[column]:9.3f} {row.unit}  {ratio:6.3f}x raw JAX")


if __name__ == "__main__":
    main()
