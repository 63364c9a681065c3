"""Where an eager `apply` spends lamina's own time: each step of a call timed on its own.

The model is `overhead.py`'s 8-layer MLP. Per call, `apply` checks the variables against the
plan (`bind_variables`: flatten, compare treedef and shapes), opens a frame and unflattens the
result; per layer, `Dense` reads its variables, works out the compute dtype (refusing a silent
complex-to-real cast) and checks the input size before it dispatches its jitted kernel. The
figures behind docs/performance.md's explanation of the eager row:

    python benchmarks/eager_parts.py

The second table takes the parts away one at a time from a whole call (each `Dense` call
stripped down in this process only), which tells what each costs in place, and ends with the
same kernels called by hand, the target's denominator.
"""

from __future__ import annotations

import timeit

import jax
import overhead

import lamina as lm
from lamina._core.frame import Frame
from lamina._core.graph import Plan
from lamina._core.layout import bind_variables
from lamina._core.recording import split_requests
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
    ablations(overhead.Mlp(), variables, weights, x)  # its own copy of the model


def ablations(model, variables, weights, x) -> None:
    """A whole eager call, with lamina's parts taken away one at a time."""
    _, apply = lm.transform(model)
    forward = model.__call__  # the forward pass alone, without apply around it
    kernels = overhead.raw_jax_lamina_kernels(weights)[0]
    float32, first = jax.numpy.float32, weights[0]
    print("a whole call, parts taken away one at a time (us per call)")
    timed("apply, as shipped", lambda: apply(variables, None, x), 5000)
    shipped = lm.Dense.__call__
    try:

        def reads_only(self, x):  # no input-size check, no compute-dtype check
            return dense(x, self.kernel.value, self.bias.value, self.dtype, self.precision)

        lm.Dense.__call__ = reads_only
        timed("  without the two checks", lambda: apply(variables, None, x), 5000)

        def nothing(self, x):  # the same kernel on fixed arrays: no variable or setting read
            return dense(x, first[0], first[1], float32)

        lm.Dense.__call__ = nothing
        timed("  and without the reads", lambda: apply(variables, None, x), 5000)
        timed("  and without apply's frame", lambda: forward(x), 5000)
    finally:
        lm.Dense.__call__ = shipped
    timed("the same kernels by hand", lambda: kernels(variables, x), 5000)


if __name__ == "__main__":
    main()
