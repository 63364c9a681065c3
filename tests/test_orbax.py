"""Orbax saves lamina's variables as they are: they are plain pytrees of arrays.

Variables and an Optax state together, restored into an abstract target (`jax.eval_shape` of
the initialisation), step-numbered checkpoints with `CheckpointManager`, and asynchronous
saves. Orbax's own format, so nothing of lamina's is involved but the variables dict.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import lamina as lm


class Net(lm.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = lm.Dense(4, 8, param_dtype=jnp.bfloat16, dtype=jnp.float32)
        self.norm = lm.BatchNorm(8)
        self.layer2 = lm.Dense(8, 2)

    def __call__(self, x, is_training=False):
        return self.layer2(lm.relu(self.norm(self.layer1(x), is_training)))


MODEL = Net()
INIT, APPLY = lm.transform(MODEL)
OPTIMIZER = optax.adam(1e-2)
X = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).standard_normal((6, 2)), jnp.float32)


def fresh_state(key):
    variables = INIT(key)
    return {"variables": variables, "opt_state": OPTIMIZER.init(variables["params"])}


@jax.jit
def train_step(state):
    variables = state["variables"]

    def loss(params):
        out, new = APPLY({**variables, "params": params}, None, X, is_training=True)
        return jnp.mean((out - Y) ** 2), new

    grads, new = jax.grad(loss, has_aux=True)(variables["params"])
    with jax.numpy_dtype_promotion("standard"):  # Adam's bias correction: float ** int32
        updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return {"variables": {**new, "params": params}, "opt_state": opt_state}


@pytest.fixture(scope="module")
def states():
    """The state after 0, 1, 2 and 3 training steps."""
    result = [fresh_state(jax.random.key(0))]
    for _ in range(3):
        result.append(train_step(result[-1]))
    return result


ABSTRACT = jax.eval_shape(fresh_state, jax.random.key(0))


def assert_same(got, expected):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_variables_and_optimizer_state_restore_into_an_abstract_target(tmp_path, states):
    state = states[-1]
    with ocp.StandardCheckpointer() as checkpointer:  # saves in the background
        checkpointer.save(tmp_path / "checkpoint", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "checkpoint", ABSTRACT)
    assert_same(restored, state)  # bfloat16 kernel, batch_stats and Adam's moments included
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    expected, _ = APPLY(state["variables"], None, X)
    got, _ = APPLY(restored["variables"], None, X)
    np.testing.assert_array_equal(got, expected)
    # and training goes on from the restored state exactly as from the original one
    assert_same(train_step(restored), train_step(state))


def test_checkpoint_manager_keeps_the_last_steps_and_saves_asynchronously(tmp_path, states):
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        for step, state in enumerate(states):
            manager.save(step, args=ocp.args.StandardSave(state))  # returns before it is written
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
        latest = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(ABSTRACT))
        older = manager.restore(2, args=ocp.args.StandardRestore(ABSTRACT))
    assert_same(latest, states[3])
    assert_same(older, states[2])
    # a new manager over the same folder (a restarted job) finds the same steps
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        assert manager.latest_step() == 3
        restored = manager.restore(3, args=ocp.args.StandardRestore(ABSTRACT))
    np.testing.assert_array_equal(
        APPLY(restored["variables"], None, X)[0], APPLY(states[3]["variables"], None, X)[0]
    )


def test_params_alone_restore_into_a_fresh_models_variables(tmp_path, states):
    trained = states[-1]["variables"]
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "params", trained["params"])
        checkpointer.wait_until_finished()
        params = checkpointer.restore(tmp_path / "params", ABSTRACT["variables"]["params"])
    variables = {**INIT(jax.random.key(5)), "params": params}  # fresh batch_stats
    assert_same(params, trained["params"])
    expected = APPLY({**variables, "params": trained["params"]}, None, X)[0]
    np.testing.assert_array_equal(APPLY(variables, None, X)[0], expected)
