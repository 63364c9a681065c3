"""One process of a two-process data-parallel step, started by tests/test_multiprocess.py.

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Each process joins JAX's distributed runtime (``jax.distributed.initialize``, the coordinator
on 127.0.0.1:PORT, run by process 0), with 4 CPU devices of its own and CPU collectives over
gloo, so that ``jax.devices()`` lists the 8 devices of both. On a global mesh of those 8, it
makes the global batch from the rows this process holds
(``jax.make_array_from_process_local_data``), runs one AdamW step of a small MLP whose
weights are replicated (data parallelism: XLA all-reduces the gradients across processes),
and prints the loss and checksums of the gradients and the new weights as one JSON line.
`step_on_one_device` runs the same step in a single process, on one device, for comparison.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

LOCAL_DEVICES = 4
GLOBAL_BATCH, FEATURES, HIDDEN, CLASSES = 16, 8, 32, 4


def data() -> tuple[Any, Any]:
    """The global batch: every process makes the same arrays and keeps its own rows."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, GLOBAL_BATCH).astype(np.int32)
    return x, y


def build() -> tuple[Any, Any, Any]:
    """The model, its transform and the optimizer (the same in every run)."""
    import optax

    import lamina as lm

    model = lm.Sequential(
        lm.Dense(FEATURES, HIDDEN, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",)),
        lm.relu,
        lm.Dense(HIDDEN, CLASSES, kernel_sharding=("mlp", "embed")),
    )
    return model, lm.transform(model), optax.adamw(1e-2)


def make_step(apply: Any, optimizer: Any) -> Any:
    import jax
    import optax

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> tuple:
        def loss_fn(params: Any) -> Any:
            logits, _ = apply({"params": params}, None, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), loss, grads

    return step


def summary(params: Any, loss: Any, grads: Any) -> dict:
    """Loss and per-variable checksums (sum and sum of squares), as plain floats."""
    import jax
    import numpy as np

    def local(x: Any) -> np.ndarray:  # a replicated global array: this process' copy
        return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else x

    def checksums(tree: Any) -> dict:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {
            jax.tree_util.keystr(path): [float(local(v).sum()), float((local(v) ** 2).sum())]
            for path, v in flat
        }

    return {"loss": float(local(loss)), "grads": checksums(grads), "params": checksums(params)}


def step_on_one_device() -> dict:
    """The same step in this process, on one device, without any mesh."""
    import jax

    _, (init, apply), optimizer = build()
    device = jax.devices()[0]
    params = jax.device_put(init(jax.random.key(0))["params"], device)
    x, y = data()
    new, loss, grads = jax.jit(make_step(apply, optimizer))(params, optimizer.init(params), x, y)
    return summary(new, loss, grads)


def main(process_id: int, num_processes: int, port: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import lamina as lm

    assert jax.process_count() == num_processes and jax.local_device_count() == LOCAL_DEVICES
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    model, (init, apply), optimizer = build()
    # data parallelism: no rule shards a weight, so every device holds all of them
    weights = lm.shardings(model, mesh, {"batch": "data"})["params"]
    params = jax.jit(lambda key: init(key)["params"], out_shardings=weights)(jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    state = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        weights,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=state)(params)

    x, y = data()
    rows = GLOBAL_BATCH // num_processes
    mine = slice(process_id * rows, (process_id + 1) * rows)
    batch = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(batch, x[mine], x.shape)
    y = jax.make_array_from_process_local_data(batch, y[mine], y.shape)
    step = jax.jit(make_step(apply, optimizer), out_shardings=(weights, replicated, weights))
    new, loss, grads = step(params, opt_state, x, y)
    result = summary(new, loss, grads)
    result.update(process=process_id, processes=jax.process_count(), devices=devices)
    print(json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
