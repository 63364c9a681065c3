"""Every layer-table entry through `lm.export`: static shapes, and a symbolic batch ``b``.

Each entry runs in its inference form (its training flags, ``is_training`` and
``update_stats``, set to False), is exported with its variables baked in, written, read back
with `lm.load_exported` and called; the outputs must equal `lm.apply`'s on the same inputs
exactly. The symbolic export (``batch_dims="b"``: axis 0 of every input) is called at batch 7,
on inputs built from the entry's own (fresh float rows; integer rows picked from the entry's,
so that ids and lengths stay valid). A layer that fixes its batch size refuses ``b``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.layer_table import LAYERS, build_inference_form

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

# Entries without an inference form, and why.
NO_INFERENCE_FORM = {
    "dropout_function": "fixes is_training=True in the layer: its only form draws random keys "
    "(the refusal of training mode is tested in test_deploy.py)",
}
# Entries whose layer fixes the batch size (what fixes it), and what refusing `b` says.
FIXED_BATCH = {
    "dense_general_batch_axes": "declares batch_shape=(2,)",
    "rotary_embedding_llama3_partial": "its positions, a (2, 3) constant of the layer",
    "batch_norm_two_axes_mask_two_pass": "its mask, a (4, 1, 1) constant of the layer",
}
FIXED_BATCH_ERROR = {
    "dense_general_batch_axes": r"batch_shape=\(2,\)\) got an input of shape \(b, 3, 5, 4\)",
    "rotary_embedding_llama3_partial": r"positions of shape \(2, 3\) do not fit x of shape "
    r"\(b, 3, 2, 8\)",
    "batch_norm_two_axes_mask_two_pass": r"got a mask of shape \(4, 1, 1\) for an input of "
    r"shape \(b, 3, 5\)",
}
# Keyword arguments that become inputs of the artifact (one length per sequence of the batch).
AS_INPUTS = {"bidirectional_lengths": "seq_lengths"}
BATCH = 7

CASES = [case for case in LAYERS if case.name not in NO_INFERENCE_FORM]
IDS = [case.name for case in CASES]


def test_the_lists_name_entries_of_the_table():
    names = {case.name for case in LAYERS}
    assert set(NO_INFERENCE_FORM) <= names
    assert set(FIXED_BATCH) == set(FIXED_BATCH_ERROR) <= names
    assert set(AS_INPUTS) <= names


@functools.cache
def built(name):
    """``(model, to_callable, variables, inputs)`` of an entry in its inference form
    (`build_inference_form`); the inputs have batch `BATCH` (built from the entry's own)
    unless the layer fixes the batch."""
    case = next(c for c in CASES if c.name == name)
    model, to_callable, variables, inputs = build_inference_form(case, AS_INPUTS.get(name))
    if name not in FIXED_BATCH:
        inputs = batch_of(inputs, BATCH)
    return model, to_callable, variables, inputs


def batch_of(inputs, size, seed=1):
    """Inputs of batch `size` like `inputs`: fresh float rows, integer rows picked from them."""
    rng = np.random.default_rng(seed)

    def grow(x):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            return rng.standard_normal((size, *x.shape[1:])).astype(x.dtype)
        return x[rng.integers(0, x.shape[0], size)]

    return jax.tree.map(grow, inputs)


def expected(name):
    """`lm.apply` of the entry on its inputs, compiled as the artifact is (so exactly equal)."""
    model, to_callable, variables, inputs = built(name)
    apply = lm.apply(model, to_callable=to_callable)
    return jax.jit(lambda *args: apply(variables, None, *args)[0])(*inputs)


def round_trip(name, path, batch_dims=None):
    """The entry exported to `path` and read back."""
    model, to_callable, variables, inputs = built(name)
    lm.export(model, variables, *inputs, to_callable=to_callable, batch_dims=batch_dims, path=path)
    return lm.load_exported(path)


def assert_equal(got, want, what):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), what
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


@pytest.mark.parametrize("name", IDS)
def test_round_trips_equal_apply(name, tmp_path):
    """Static shapes, then the batch `b` called at batch 7 (one compile each, one for apply)."""
    inputs = built(name)[3]
    want = expected(name)
    static = round_trip(name, tmp_path / "static.jax")
    assert [x.shape for x in static.in_avals] == [np.shape(x) for x in jax.tree.leaves(inputs)]
    assert_equal(static.call(*inputs), want, "static shapes")
    if name in FIXED_BATCH:
        with pytest.raises(lm.ExportError, match=FIXED_BATCH_ERROR[name]):
            round_trip(name, tmp_path / "symbolic.jax", batch_dims="b")
        assert [p.name for p in tmp_path.iterdir()] == ["static.jax"]  # nothing written
    else:
        symbolic = round_trip(name, tmp_path / "symbolic.jax", batch_dims="b")
        assert all(str(x.shape[0]) == "b" for x in symbolic.in_avals)
        assert_equal(symbolic.call(*inputs), want, f"batch b, called at {BATCH}")


def test_symbolic_sizes_pass_the_checks_outside_the_table():
    """Where a symbolic size meets lamina's own shape checks, beyond the table's calls."""
    (b,) = jax.export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 3), jnp.float32)

    def traced(model, to_callable, **kwargs):  # abstract variables: nothing compiles
        init, apply = lm.transform(model, to_callable=to_callable)
        variables = jax.eval_shape(init, jax.random.key(0))
        return jax.eval_shape(lambda v, x: apply(v, None, x, **kwargs)[0], variables, x)

    # BatchNorm in training: the "at least two entries" check cannot count `b`; it traces.
    assert traced(lm.BatchNorm(3), None, is_training=True).shape == (b, 3)
    # A cell's carry for a symbolic batch.
    carry = traced(lm.GRUCell(3, 4), lambda c: lambda x: c.initialize_carry(x.shape[:1]))
    assert carry.shape == (b, 4)
    # lm.vmap over the symbolic axis (the mapped size is `b`, not an int).
    per_row = lm.vmap(lambda m, row: m(row), in_axes=(None, 0))
    assert traced(lm.Dense(3, 2), lambda m: lambda x: per_row(m, x)).shape == (b, 2)
