"""lm.pmean: lax.pmean's values over a whole pytree, from one buffer per dtype.

On one device, ``jax.vmap(..., axis_name=...)`` binds the axis; the eight-device check (one
all-reduce per dtype in the compiled program) is in tests/sharding_devices.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lamina as lm


def tree(members: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "kernel": jnp.asarray(rng.normal(size=(members, 3, 4)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(members, 4)), jnp.float32),
        "scale": jnp.asarray(rng.normal(size=(members,)), jnp.float32),
        "half": jnp.asarray(rng.normal(size=(members, 2, 2)), jnp.bfloat16),
        "steps": jnp.arange(members * 3, dtype=jnp.int32).reshape(members, 3),
    }


def test_values_shapes_and_dtypes_are_lax_pmeans():
    values = tree(4)
    ours = jax.vmap(lambda t: lm.pmean(t, "i"), axis_name="i")(values)
    theirs = jax.vmap(lambda t: jax.lax.pmean(t, "i"), axis_name="i")(values)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for name in values:
        assert ours[name].shape == theirs[name].shape, name
        assert ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_allclose(
            np.asarray(ours[name], np.float32), np.asarray(theirs[name], np.float32), rtol=1e-6
        )
    # Every member holds the mean: the first member's kernel is the mean over members.
    np.testing.assert_allclose(ours["kernel"][0], values["kernel"].mean(0), rtol=1e-6)


def test_python_numbers_keep_their_weak_type():
    """A Python float (or a weakly typed value) beside float32 arrays comes back weakly
    typed, as from lax.pmean, so it promotes the same way afterwards."""

    def mean_scale(mean, w):
        return mean({"w": w, "scale": 0.5, "traced": 2.0 * w.sum()}, "i")

    w = jnp.ones((2, 3), jnp.float32)
    ours = jax.vmap(lambda w: mean_scale(lm.pmean, w), axis_name="i")(w)
    theirs = jax.vmap(lambda w: mean_scale(jax.lax.pmean, w), axis_name="i")(w)
    for name in ("scale", "traced"):
        assert jax.typeof(ours[name]).weak_type == jax.typeof(theirs[name]).weak_type, name
    assert not jax.typeof(ours["w"]).weak_type


def test_one_collective_per_dtype():
    """The jaxpr averages one concatenated buffer per dtype, not one per leaf."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def psum_operands(mean):
        mapped = jax.shard_map(lambda t: mean(t, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        jaxpr = jax.make_jaxpr(mapped)(tree(1))
        inner = jaxpr.eqns[0].params["jaxpr"]
        return sorted(len(e.invars) for e in inner.eqns if e.primitive.name.startswith("psum"))

    assert psum_operands(lm.pmean) == [1, 1, 1]  # float32 (3 leaves), bfloat16, int32
    assert sum(psum_operands(jax.lax.pmean)) == 5


def test_gradients_flow_through():
    """A pmean inside a differentiated function has lax.pmean's gradient."""

    def loss(mean, w):
        return jax.vmap(lambda w: (mean({"w": w, "v": 2 * w}, "i")["v"] ** 2).sum(), axis_name="i")(
            w
        ).sum()

    w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)), jnp.float32)
    np.testing.assert_allclose(
        jax.grad(loss, 1)(lm.pmean, w), jax.grad(loss, 1)(jax.lax.pmean, w), rtol=1e-6
    )


def test_empty_and_single_leaf_trees():
    assert jax.vmap(lambda t: lm.pmean(t, "i"), axis_name="i", axis_size=2)({}) == {}
    single = jax.vmap(lambda x: lm.pmean(x, "i"), axis_name="i")(jnp.arange(4.0))
    np.testing.assert_allclose(single, np.full(4, 1.5))


def test_outside_a_mapped_axis_says_where_to_call_it():
    with pytest.raises(NameError, match=r"lm.pmean: no mapped axis 'data' here.*shard_map"):
        lm.pmean({"w": jnp.ones(3), "b": jnp.ones(2)}, "data")


def test_a_leaf_that_is_not_an_array_is_named():
    with pytest.raises(TypeError, match=r"leaf at \['notes'\] is a str, not an array"):
        jax.vmap(lambda w: lm.pmean({"w": w, "notes": "lr 1e-3"}, "i"), axis_name="i")(jnp.ones(2))
