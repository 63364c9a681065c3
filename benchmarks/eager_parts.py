"""Where an eager `apply` spends lamina's own time: each step of a call timed on its own.

The model is `overhead.py`'s 8-layer MLP. Per call, `apply` checks the variables against the
plan (`bind_variables`: flatten, compare treedef and shapes), opens a frame and unflattens the
result; per layer, `Dense` reads its variables, works out the compute dtype (refusing a silent
complex-to-real cast) and checks the input size before it dispatches its jitted kernel. The
figures behind docs/performance.md's explanation of the eager row:

    python benchmarks/eager_parts.py
"""

from __future__ import annotations

import timeit

import jax
import overhead

import lamina as lm
from lamina._core.frame import Frame
from lamina._core.graph import Plan
from lamina._core.layout import bind_variables
from lamina._core.records import split_requests
from lamina._core.rng import RngStreams
from lamina.nn import _checks, _dtypes
from lamina.nn.linear import dense


def timed(name: str, fn, number: int = 20000) -> None:
    fn()
    seconds = min(timeit.repeat(fn, number=number, repeat=5)) / number
    print(f"{name:34s} {1e6 * seconds:7.2f} us")


def main() -> None:
    weights = overhead.make_weights()
    x = jax.random.normal(jax.random.key(1), (overhead.BATCH, overhead.WIDTH))
    model = overhead.Mlp()
    variables = overhead.as_variables(weights)
    plan = Plan(model)
    plan.bind()  # as transform does, so that reads inside the frame find their slots
    values = bind_variables(plan, variables, "apply")
    declared = frozenset(entry.collection for entry in plan.variables)
    layer = model.layers[0]
    kernel, bias = weights[0]
    print("per call")
    timed("records.split_requests", lambda: split_requests(variables, declared))
    timed("bind_variables (check + flatten)", lambda: bind_variables(plan, variables, "apply"))
    timed("  of which jax.tree_util.tree_flatten", lambda: jax.tree_util.tree_flatten(variables))
    timed("unflatten the result", lambda: plan.treedef.unflatten(values))

    def frame() -> None:
        with Frame(plan, values, RngStreams(None), "apply"):
            pass

    timed("Frame enter/exit with its streams", frame)
    print("per Dense layer")
    with Frame(plan, values, RngStreams(None), "apply"):
        timed("kernel.value", lambda: layer.kernel.value)
        timed("compute_dtype", lambda: _dtypes.compute_dtype(layer, layer.dtype, x, kernel, bias))
        timed(
            "check_last_axis",
            lambda: _checks.check_last_axis(layer._describe, x, overhead.WIDTH, "in_size"),
        )
        timed("a Setting read (layer.precision)", lambda: layer.precision)
    print("the kernels themselves (dispatch, not waited for)")
    timed("dense(x, kernel, bias, float32)", lambda: dense(x, kernel, bias, layer.dtype), 5000)
    timed("lm.relu(x)", lambda: lm.relu(x), 5000)


if __name__ == "__main__":
    main()
