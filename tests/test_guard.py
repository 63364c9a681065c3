"""Raw JAX transforms begun inside a call: keys and writes there are errors, reads are fine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class Probe(lm.Module):
    def __init__(self, body):
        self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.float32, mutable=True)
        self.w = lm.Parameter((3,), lm.initializers.ones())
        self.body = body

    def __call__(self, x):
        return self.body(self, x)


def run(body, x=None, jit=False):
    init, apply = lm.transform(Probe(body))
    variables = init(jax.random.key(0))
    x = jnp.ones(3) if x is None else x
    return (jax.jit(apply) if jit else apply)(variables, jax.random.key(1), x)


DRAWS = {
    "scan": lambda m, x: jax.lax.scan(lambda c, _: (c, lm.next_rng_key()), 0, None, length=3),
    "vmap": lambda m, x: jax.vmap(lambda _: lm.next_rng_key())(x),
    "jit": lambda m, x: jax.jit(lambda: lm.next_rng_key())(),
    "checkpoint": lambda m, x: jax.checkpoint(lambda y: y * jax.random.normal(lm.next_rng_key()))(
        x
    ),
    "cond": lambda m, x: jax.lax.cond(
        x[0] > 0, lambda: jax.random.normal(lm.next_rng_key()), lambda: 0.0
    ),
    "fori_loop": lambda m, x: jax.lax.fori_loop(
        0, 3, lambda i, c: c + jax.random.normal(lm.next_rng_key()), 0.0
    ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(DRAWS))
def test_drawing_a_key_inside_a_raw_transform_is_an_error(name, jit):
    with pytest.raises(lm.TraceContextError, match=r"next_rng_key\(\) was called inside a JAX"):
        run(DRAWS[name], jit=jit)


WRITES = {
    "scan": lambda m, x: jax.lax.scan(
        lambda c, xi: (m.count.__setattr__("value", xi) or c, None), 0, x
    ),
    "vmap": lambda m, x: jax.vmap(lambda xi: m.count.__setattr__("value", xi))(x),
    "jit": lambda m, x: jax.jit(lambda: m.count.__setattr__("value", x[0]))(),
    "inplace in vmap": lambda m, x: jax.vmap(lambda xi: m.count.__iadd__(xi))(x),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_writing_a_variable_inside_a_raw_transform_is_an_error(name):
    with pytest.raises(
        lm.TraceContextError, match=r"State at counters/count was written inside a JAX"
    ):
        run(WRITES[name])


def test_reading_inside_raw_transforms_is_allowed():
    out, _ = run(lambda m, x: jax.vmap(lambda xi: xi * m.w)(jnp.ones((2, 3))))
    np.testing.assert_array_equal(out, np.ones((2, 3)))
    out, _ = run(lambda m, x: jax.lax.scan(lambda c, _: (c + m.w, None), x, None, length=2)[0])
    np.testing.assert_array_equal(out, np.full(3, 3.0))


def test_keys_drawn_outside_and_passed_in_differ_per_iteration():
    def body(m, x):
        keys = lm.next_rng_key(num=4)
        return jax.vmap(lambda k: jax.random.normal(k))(keys)

    out, _ = run(body)
    assert len(set(np.asarray(out).tolist())) == 4


def test_transforms_around_apply_are_untouched():
    def body(m, x):
        m.count.value = m.count + jnp.sum(x)
        return jax.random.normal(lm.next_rng_key(), x.shape) * m.w

    init, apply = lm.transform(Probe(body))
    variables = init(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 4)
    outs, new = jax.vmap(apply, in_axes=(None, 0, 0))(variables, keys, jnp.ones((4, 3)))
    assert outs.shape == (4, 3) and new["counters"]["count"].shape == (4,)
    grads = jax.grad(lambda v: apply(v, jax.random.key(1), jnp.ones(3))[0].sum())(variables)
    assert grads["params"]["w"].shape == (3,)
    jitted, _ = jax.jit(apply)(variables, jax.random.key(1), jnp.ones(3))
    eager, _ = apply(variables, jax.random.key(1), jnp.ones(3))
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


def test_next_rng_key_never_repeats_within_a_call():
    def body(m, x):
        return jnp.stack(
            [jax.random.key_data(lm.next_rng_key()) for _ in range(3)]
            + list(jax.random.key_data(lm.next_rng_key(num=3)))
        )

    out, _ = run(body)
    assert len({tuple(row) for row in np.asarray(out).tolist()}) == 6


class NoisyCell(lm.Module):
    """A user's cell that draws a key at every step (dropout-like noise on the carry)."""

    def __init__(self, size, write=False):
        self.dense = lm.Dense(size, size)
        self.size = size
        self.write = write
        self.steps = lm.State("counters", (), lm.initializers.zeros(), jnp.int32, mutable=True)

    def initialize_carry(self, batch):
        return jnp.zeros((*batch, self.size))

    def __call__(self, carry, x):
        if self.write:
            self.steps += 1
        noise = jax.random.normal(lm.next_rng_key("noise"), carry.shape)
        carry = self.dense(x) + noise
        return carry, carry


def test_rnn_gives_a_users_cell_a_different_key_at_every_step(getkey):
    init, apply = lm.transform(lm.RNN(NoisyCell(2)))
    variables = init(getkey())
    zero = jax.tree.map(jnp.zeros_like, variables)
    out, _ = apply(zero, {"noise": jax.random.key(3)}, jnp.zeros((1, 5, 2)))
    assert len({tuple(row) for row in np.asarray(out[0]).tolist()}) == 5  # noise differs per step
    again, _ = apply(zero, {"noise": jax.random.key(3)}, jnp.zeros((1, 5, 2)))
    np.testing.assert_array_equal(out, again)
    other, _ = apply(zero, {"noise": jax.random.key(4)}, jnp.zeros((1, 5, 2)))
    assert not np.allclose(out, other)


def test_rnn_refuses_a_cell_that_writes_state(getkey):
    init, apply = lm.transform(lm.RNN(NoisyCell(2, write=True)))
    with pytest.raises(
        lm.TraceContextError, match=r"counters/cell/steps was written inside RNN's cell NoisyCell"
    ):
        apply(init(getkey()), jax.random.key(0), jnp.zeros((1, 5, 2)))
