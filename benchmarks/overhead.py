"""Per-call overhead of an 8-layer MLP (width 32, batch 4): lamina beside raw JAX and peers.

The network is tiny on purpose: the arithmetic costs next to nothing, so what is measured is
what each library adds around it. Every contestant computes the same function with the same
weights (checked before timing). Run:

    python benchmarks/overhead.py            # all peers that are installed
    python benchmarks/overhead.py --quick    # fewer repetitions

Ratios are against raw JAX: eager lamina against eager raw JAX, jitted against jitted.
"raw JAX (lamina kernels)" calls the same jitted kernels lamina's layers call, so the ratio of
lamina to it is the library's own overhead; "raw JAX" is the idiomatic hand-written function.
"""

from __future__ import annotations

import argparse
import timeit

import jax
import jax.numpy as jnp
import numpy as np

import lamina as lm
from lamina.nn.linear import dense

DEPTH, WIDTH, BATCH = 8, 32, 4


def make_weights():
    keys = jax.random.split(jax.random.key(0), DEPTH)
    return [
        (jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5, jnp.full((WIDTH,), 0.01)) for k in keys
    ]


def as_variables(weights):
    """lamina's (and Linen's) layout; raw JAX gets the same tree, so flattening costs the same."""
    layers = {str(i): {"kernel": w, "bias": b} for i, (w, b) in enumerate(weights)}
    return {"params": {"layers": layers}}


def raw_jax(weights):
    def forward(variables, x):
        layers = variables["params"]["layers"]
        for i in range(DEPTH):
            x = x @ layers[str(i)]["kernel"] + layers[str(i)]["bias"]
            if i < DEPTH - 1:
                x = jax.nn.relu(x)
        return x

    return forward, as_variables(weights)


def raw_jax_full(weights):
    """The hand-written function with apply's signature: outputs and the variables."""
    forward, variables = raw_jax(weights)
    return (lambda v, x: (forward(v, x), v)), variables


def raw_jax_lamina_kernels(weights):
    def forward(variables, x):
        layers = variables["params"]["layers"]
        for i in range(DEPTH):
            x = dense(x, layers[str(i)]["kernel"], layers[str(i)]["bias"], jnp.float32)
            if i < DEPTH - 1:
                x = lm.relu(x)
        return x

    return forward, as_variables(weights)


class Mlp(lm.Module):
    def __init__(self):
        super().__init__()
        self.layers = [lm.Dense(WIDTH, WIDTH) for _ in range(DEPTH)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = lm.relu(layer(x))
        return self.layers[-1](x)


def lamina_model(weights):
    _, apply = lm.transform(Mlp())
    return (lambda v, x: apply(v, None, x)[0]), as_variables(weights)


def lamina_full_apply(weights):
    """`apply` itself: returns the outputs and the new variables."""
    _, apply = lm.transform(Mlp())
    return (lambda v, x: apply(v, None, x)), as_variables(weights)


def linen_model(weights):
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(DEPTH):
                x = nn.Dense(WIDTH, name=f"layers_{i}")(x)
                if i < DEPTH - 1:
                    x = nn.relu(x)
            return x

    model = Mlp()
    variables = {
        "params": {f"layers_{i}": {"kernel": w, "bias": b} for i, (w, b) in enumerate(weights)}
    }
    return model.apply, variables


def nnx_model(weights):
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)])

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    model = Mlp(nnx.Rngs(0))
    for layer, (w, b) in zip(model.layers, weights, strict=True):
        layer.kernel.value = w
        layer.bias.value = b
    return (lambda m, x: m(x)), model


def haiku_model(weights):
    import haiku as hk

    def forward(x):
        for i in range(DEPTH):
            x = hk.Linear(WIDTH, name=f"linear_{i}")(x)
            if i < DEPTH - 1:
                x = jax.nn.relu(x)
        return x

    transformed = hk.without_apply_rng(hk.transform(forward))
    params = {f"linear_{i}": {"w": w, "b": b} for i, (w, b) in enumerate(weights)}
    return transformed.apply, params


def equinox_model(weights):
    import equinox as eqx

    keys = jax.random.split(jax.random.key(0), DEPTH)
    layers = [eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys]
    for i, (w, b) in enumerate(weights):
        layers[i] = eqx.tree_at(lambda lin: (lin.weight, lin.bias), layers[i], (w.T, b))

    class Mlp(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jax.nn.relu(jax.vmap(layer)(x))
            return jax.vmap(self.layers[-1])(x)

    return (lambda m, x: m(x)), Mlp(layers)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def per_call_us(fn, args, number):
    jax.block_until_ready(fn(*args))
    return timeit.timeit(lambda: jax.block_until_ready(fn(*args)), number=number) / number * 1e6


# run.py's columns: each contestant's builder, and how its jitted apply is compiled
COLUMN_BUILDERS = {
    "jax": raw_jax,
    "lamina": lamina_model,
    "linen": linen_model,
    "nnx": nnx_model,
    "haiku": haiku_model,
    "equinox": equinox_model,
}


def jit_for(column: str, fn):
    """Each library's own jit: `nnx.jit` and `eqx.filter_jit` for NNX and Equinox."""
    if column == "nnx":
        from flax import nnx

        return nnx.jit(fn)
    if column == "equinox":
        import equinox as eqx

        return eqx.filter_jit(fn)
    return jax.jit(fn)


def pure_forward(column: str, fn, state):
    """(forward(params, x), params) with params a pytree of arrays, for `jax.jit` and grad."""
    if column == "nnx":
        from flax import nnx

        graphdef, params = nnx.split(state)
        return (lambda p, x: nnx.merge(graphdef, p)(x)), params
    return (lambda p, x: first(fn(p, x))), state


def collect(mode: str = "quick") -> list:
    """run.py's rows: eager apply, jitted apply and a jitted Optax step, per call.

    Args:
        mode: "smoke" (a few calls), "quick" or "full".

    Returns:
        Three `_harness.Row`s, in microseconds per call.
    """
    import optax
    from _harness import blocking, check_same, interleaved, row_from_samples

    number, rounds = {"smoke": (3, 2), "quick": (100, 7), "full": (400, 15)}[mode]
    weights = make_weights()
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    optimizer = optax.sgd(1e-3, momentum=0.9)
    eager, jitted, steps, outputs = {}, {}, {}, {}
    for column, build in {**COLUMN_BUILDERS, "kernels": raw_jax_lamina_kernels}.items():
        fn, state = build(weights)
        outputs[column] = first(fn(state, x))
        eager[column] = blocking(fn, state, x)
        jitted[column] = blocking(jit_for(column, fn), state, x)
        if column == "kernels":
            continue
        forward, params = pure_forward(column, fn, state)

        def step(params, opt_state, x, y, forward=forward):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - y) ** 2))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        steps[column] = blocking(jax.jit(step), params, optimizer.init(params), x, y)
    check_same(outputs)
    # lamina against the same kernels by hand: a pair of its own, timed back to back with as
    # many calls as the jitted row (beside the slow eager peers, a few calls per sample after
    # a 10 ms Linen call measured the kernels at 2.6x their cost, and lamina below them).
    pair = interleaved({"kernels": eager.pop("kernels"), "lamina": eager["lamina"]}, rounds, number)
    kernels_eager = interleaved(eager, rounds, number // 10 + 2)
    kernels_jit = interleaved({"kernels": jitted.pop("kernels"), **jitted}, rounds, number)
    jit_kernels = kernels_jit.pop("kernels")
    step_samples = interleaved(steps, rounds, number)
    what = f"{DEPTH}-layer MLP, width {WIDTH}, batch {BATCH}"
    notes = {
        "nnx": "nnx.jit on the module (the jitted row); the step splits and merges",
        "equinox": "eqx.filter_jit (the jitted row)",
    }
    return [
        row_from_samples(
            "apply_eager",
            f"eager apply ({what}), us/call",
            "us",
            kernels_eager,
            1e6,
            extra={
                "lamina_kernels_by_hand_us": 1e6 * float(np.median(pair["kernels"])),
                "lamina_beside_them_us": 1e6 * float(np.median(pair["lamina"])),
            },
        ),
        row_from_samples(
            "apply_jit",
            f"jitted apply ({what}), us/call",
            "us",
            kernels_jit,
            1e6,
            notes=notes,
            extra={"lamina_kernels_by_hand_us": 1e6 * float(np.median(jit_kernels))},
        ),
        row_from_samples(
            "step_overhead",
            f"jitted SGD step ({what}), us/call",
            "us",
            step_samples,
            1e6,
        ),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    number, repeat = (100, 5) if args.quick else (400, 15)

    weights = make_weights()
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    contestants = {
        "raw JAX": raw_jax,
        "raw JAX (lamina kernels)": raw_jax_lamina_kernels,
        "lamina": lamina_model,
        "Flax Linen": linen_model,
        "Flax NNX": nnx_model,
        "Haiku": haiku_model,
        "Equinox": equinox_model,
    }
    full = {
        "raw JAX, (out, variables)": raw_jax_full,
        "lamina apply, (out, variables)": lamina_full_apply,
    }
    jitters = {"Flax NNX": "nnx.jit", "Equinox": "eqx.filter_jit"}
    reference = None
    timed = {}  # name -> (eager fn, jitted fn, args, jit via)
    for name, build in {**contestants, **full}.items():
        try:
            fn, state = build(weights)
        except ImportError as error:
            print(f"{name}: not installed ({error.name}); skipped")
            continue
        out = first(fn(state, x))
        if reference is None:
            reference = out
        np.testing.assert_allclose(out, reference, rtol=2e-5, atol=2e-5, err_msg=name)
        if name == "Flax NNX":
            from flax import nnx

            jitted = nnx.jit(fn)
        elif name == "Equinox":
            import equinox as eqx

            jitted = eqx.filter_jit(fn)
        else:
            jitted = jax.jit(fn)
        np.testing.assert_allclose(first(jitted(state, x)), reference, rtol=2e-5, atol=2e-5)
        timed[name] = (fn, jitted, (state, x), jitters.get(name, "jax.jit"))

    # Interleaved rounds, so that drift in the machine's speed hits every contestant alike.
    eager_times = {name: [] for name in timed}
    jit_times = {name: [] for name in timed}
    for _ in range(repeat):
        for name, (fn, jitted, fargs, _) in timed.items():
            eager_times[name].append(per_call_us(fn, fargs, max(number // 10, 5)))
            jit_times[name].append(per_call_us(jitted, fargs, number))
    rows = [
        (name, min(eager_times[name]), min(jit_times[name]), how)
        for name, (_, _, _, how) in timed.items()
    ]

    by_name = {row[0]: row for row in rows}
    raw_eager, raw_jit = by_name["raw JAX"][1], by_name["raw JAX"][2]
    print(
        f"\n{DEPTH}-layer MLP, width {WIDTH}, batch {BATCH}; microseconds per call (best of rounds)"
    )
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    header = f"{'':32s} {'eager':>9s} {'x raw':>7s}   {'jitted':>8s} {'x raw':>7s}  jit via"
    print(header)
    print("-" * len(header))
    for name, eager, compiled, how in rows:
        if name in full:
            raw_eager, raw_jit = by_name["raw JAX, (out, variables)"][1:3]
        print(
            f"{name:32s} {eager:9.1f} {eager / raw_eager:7.2f}   {compiled:8.1f} "
            f"{compiled / raw_jit:7.2f}  {how}"
        )
    own = by_name["lamina"][1] / by_name["raw JAX (lamina kernels)"][1]
    print(f"\nlamina's own eager overhead (vs the same kernels called by hand): {own:.2f}x")
    print(
        "The last two rows return the variables too (apply's signature), against the "
        "hand-written function that does the same."
    )


if __name__ == "__main__":
    main()
