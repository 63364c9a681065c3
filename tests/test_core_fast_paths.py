"""The fast paths of transform and apply decide exactly what the careful paths decided.

Each test pins one shortcut taken for speed to the behaviour it must keep: a leaf
that is not an array is still refused by `apply`, a complex input is still refused by a real
layer, and the snapshot shares immutable settings while copying everything mutable.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm


class _Shaped:
    """Has the right shape but is no array: the fast check must not let it through."""

    shape = (2,)


def test_apply_still_refuses_a_leaf_that_is_not_an_array():
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(jax.random.key(0))
    variables["params"]["bias"] = _Shaped()
    with pytest.raises(lm.VariablesError, match=r"_Shaped .* at params/bias; variables must be"):
        apply(variables, None, jnp.ones((1, 2)))


def test_apply_accepts_numpy_leaves_with_the_same_result():
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(jax.random.key(0))
    as_numpy = jax.tree.map(np.asarray, variables)
    x = jnp.ones((1, 2))
    np.testing.assert_array_equal(apply(as_numpy, None, x)[0], apply(variables, None, x)[0])


def test_real_layer_still_refuses_complex_input_with_the_canonical_dtype():
    init, apply = lm.transform(lm.Dense(2, 2))
    variables = init(jax.random.key(0))
    with pytest.raises(TypeError, match=r"got a complex64 value but computes in float32"):
        apply(variables, None, np.ones((1, 2), np.complex128))


def test_snapshot_shares_dtypes_and_copies_containers():
    class Holder(lm.Module):
        def __init__(self):
            super().__init__()
            self.dense = lm.Dense(2, 2, dtype=jnp.bfloat16)
            self.sizes = [1, 2]

    model = Holder()
    _, apply = lm.transform(model)
    snapshot = apply.__closure__  # the snapshot is private; reach it through the plan
    plans = [c.cell_contents for c in snapshot if type(c.cell_contents).__name__ == "Plan"]
    root = plans[0].root
    assert root.dense.dtype is model.dense.dtype  # immutable: shared
    assert root.sizes is not model.sizes and list(root.sizes) == [1, 2]
    model.sizes.append(3)
    assert list(root.sizes) == [1, 2]
