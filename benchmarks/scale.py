"""`transform` and `init` of a model with thousands of layers, beside Flax Linen and Haiku.

    python benchmarks/scale.py              # 1,000 Dense(16, 16) layers
    python benchmarks/scale.py --layers 3000

Prints seconds for the first `init` (which compiles the initializers) and for a second one,
with a fresh key. lamina initialises variables that share an initializer, shape and dtype in
one vectorised call; Linen and Haiku initialise them one by one (eagerly).
"""

from __future__ import annotations

import argparse
import pathlib
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


# --- run.py's rows: Dense(4, 4) layers in a list, each contestant in a fresh process ---------


def _make(column, n):
    """(transform, init(seed)) of n Dense(4, 4) layers; transform is None where there is none."""
    if column == "lamina":

        class Deep(lm.Module):
            def __init__(self):
                self.layers = [lm.Dense(4, 4) for _ in range(n)]

        def transform():
            return lm.transform(Deep())[0]

        return transform, None
    if column == "jax":
        initializer = jax.nn.initializers.lecun_normal()

        def init(seed):
            keys = jax.random.split(jax.random.key(seed), n)
            return [{"kernel": initializer(k, (4, 4)), "bias": jnp.zeros((4,))} for k in keys]

        return None, init
    if column == "linen":
        import flax.linen as nn

        class LinenDeep(nn.Module):
            @nn.compact
            def __call__(self, x):
                for _ in range(n):
                    x = nn.Dense(4)(x)
                return x

        return None, lambda seed: LinenDeep().init(jax.random.key(seed), jnp.ones((1, 4)))
    if column == "nnx":
        from flax import nnx

        class NnxDeep(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(n)])

        return None, lambda seed: nnx.state(NnxDeep(nnx.Rngs(seed)))
    if column == "haiku":
        import haiku as hk

        def forward(x):
            for _ in range(n):
                x = hk.Linear(4)(x)
            return x

        model = hk.transform(forward)
        return None, lambda seed: model.init(jax.random.key(seed), jnp.ones((1, 4)))
    if column == "equinox":
        import equinox as eqx

        def init(seed):
            keys = jax.random.split(jax.random.key(seed), n)
            return [eqx.nn.Linear(4, 4, key=k) for k in keys]

        return None, init
    raise ValueError(f"unknown contestant {column!r}")


def _peak_rss() -> int:
    """Bytes: the peak resident set size of this process (Linux's VmHWM)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status: peak RSS needs Linux")


def worker(column: str, n: int, trace_memory: bool, second: bool = True) -> dict:
    """Seconds of transform, first and second init, and peak memory, in this process."""
    import tracemalloc

    import psutil

    rss_before = psutil.Process().memory_info().rss
    if trace_memory:
        tracemalloc.start()
    make_transform, init = _make(column, n)
    start = time.perf_counter()
    if make_transform is not None:
        transformed_init = make_transform()
        transform = time.perf_counter() - start

        def init(seed):
            return transformed_init(jax.random.key(seed))

    else:
        transform = 0.0
    first = timed(lambda: init(0))
    result = {"transform": transform, "first_init": first}
    if trace_memory:
        result["tracemalloc_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    else:  # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, on Linux)
        peak = _peak_rss()
        result["rss_peak_mib"] = (peak - rss_before) / 2**20
    if second:
        result["second_init"] = timed(lambda: init(1))
    return result


SIZES = {"smoke": (10,), "quick": (1000, 10000), "full": (1000, 10000)}


def collect(mode: str = "quick") -> list:
    """run.py's rows: transform + first init, second init, tracemalloc and RSS peaks.

    Each (contestant, size) runs in a fresh process (``--worker``), so that neither JAX's
    caches nor the memory of the one before counts; smoke mode runs in this process.
    """
    import json
    import subprocess
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _harness import COLUMNS, Row

    rows = []
    for n in SIZES[mode]:
        results: dict[str, dict] = {}
        skipped = []  # --quick: the peers' slow eager inits at 10,000 are timed once only
        for column in COLUMNS:
            results[column] = {}
            short = mode == "quick" and n >= 10000 and column in ("linen", "nnx", "haiku")
            if short:
                skipped.append(column)
            for trace_memory in (False,) if short else (False, True):
                if mode == "smoke":  # in this process: RSS would mean nothing, left out
                    out = worker(column, n, trace_memory)
                    out.pop("rss_peak_mib", None)
                else:
                    command = [sys.executable, __file__, "--worker", column, "--layers", str(n)]
                    command += ["--tracemalloc"] if trace_memory else []
                    command += ["--no-second"] if short else []
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    out = json.loads(done.stdout.strip().splitlines()[-1])
                if trace_memory:  # the times under tracemalloc are slower: keep the others
                    out = {"tracemalloc_peak_mib": out["tracemalloc_peak_mib"]}
                results[column].update(out)
        notes = {c: "no separate transform step: init is the whole cost" for c in COLUMNS}
        del notes["lamina"]
        what = f"{n:,} Dense(4, 4) in a list"
        for key, label, unit in (
            ("setup", "transform + first init", "s"),
            ("second_init", "second init", "s"),
            (
                "tracemalloc_peak_mib",
                "peak Python memory (tracemalloc) of transform + first init",
                "MiB",
            ),
            ("rss_peak_mib", "peak RSS growth of transform + first init", "MiB"),
        ):
            values = {
                c: r["transform"] + r["first_init"] if key == "setup" else r[key]
                for c, r in results.items()
                if key == "setup" or key in r
            }
            if not values:
                continue  # smoke mode's RSS
            missing = {c: "skipped by --quick (slow): run the full mode" for c in skipped}
            rows.append(
                Row(
                    f"scale_{key}_{n}",
                    f"{label}, {what}, {unit}",
                    unit,
                    values,
                    notes=notes if key == "setup" else missing if key != "rss_peak_mib" else {},
                    extra={"n": n, "raw": results} if key == "setup" else {"n": n},
                )
            )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run.py's: one contestant
    parser.add_argument("--tracemalloc", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-second", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json

        print(json.dumps(worker(args.worker, args.layers, args.tracemalloc, not args.no_second)))
        return
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
