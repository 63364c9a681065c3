"""The checks the layers share (lamina/nn/_checks.py): every layer words an error the same way."""

import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import apply_to


@pytest.mark.parametrize(
    ("make", "where", "name"),
    [
        (lambda v: lm.Conv(3, v, 3), r"Conv\(in_size=3, out_size=.*\)", "out_size"),
        (lambda v: lm.LayerNorm(v), "LayerNorm", "size"),
        (lambda v: lm.MultiHeadAttention(2, v), "MultiHeadAttention", "in_size"),
        (lambda v: lm.GRUCell(3, v), "GRUCell", "hidden_size"),
        (lambda v: lm.Dense(v, 3), "Dense", "in_size"),
        (lambda v: lm.Embed(10, v), "Embed", "size"),
        (lambda v: lm.LSTMCell(v, 3), "LSTMCell", "in_size"),
    ],
)
def test_sizes_are_positive_ints_everywhere(make, where, name):
    assert make(np.int64(4)) is not None  # NumPy's integers are integers
    with pytest.raises(ValueError, match=rf"{where}: {name} must be a positive int.*got 0\."):
        make(0)
    for wrong in (4.0, "4", True, None):
        # A wrong type is a TypeError, and also a ValueError, as a wrong value is.
        with pytest.raises(TypeError, match=rf"{name} must be a positive int") as error:
            make(wrong)
        assert isinstance(error.value, ValueError)


def test_numbers_in_a_range():
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\), got 1\.0"):
        lm.MultiHeadAttention(2, 4, dropout_rate=1.0)
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\] \(the weight"):
        lm.BatchNorm(4, momentum=1.5)
    with pytest.raises(ValueError, match=r"epsilon must be a finite non-negative number"):
        lm.RMSNorm(4, epsilon="1e-6")
    assert lm.BatchNorm(4, momentum=np.float32(0.9)).momentum == pytest.approx(0.9)


def test_flags_must_be_python_bools_everywhere():
    x = jnp.ones((2, 3, 4))
    calls = {
        "dropout": lambda: apply_to(lm.Dropout(0.5), x, 1),
        "BatchNorm": lambda: apply_to(lm.BatchNorm(4), x, 1),
        "MultiHeadAttention": lambda: apply_to(lm.MultiHeadAttention(2, 4), x, is_training=1),
        "dot_product_attention": lambda: lm.dot_product_attention(x, x, x, is_training=1),
    }
    for where, call in calls.items():
        with pytest.raises(
            TypeError,
            match=rf"^{where}: is_training must be a Python bool, got int: it chooses what is "
            r"computed, so it cannot be a traced value\. Under jax\.jit, make it static",
        ):
            call()


def test_dtypes_are_checked_the_same_way_as_variables():
    for make in (
        lambda: lm.LSTMCell(3, 4, dtype="float3"),
        lambda: lm.GroupNorm(2, 4, dtype="float3"),
        lambda: lm.MultiHeadAttention(2, 4, dtype="float3"),
    ):
        with pytest.raises(TypeError, match=r": dtype must be a dtype such as jnp\.float32"):
            make()


def test_last_axis_errors_name_the_layer_and_the_setting():
    x = jnp.ones((3, 5))
    gru = lm.GRUCell(4, 2)
    for layer, args, where in [
        (lm.Dense(4, 2), (x,), r"Dense\(in_size=4, out_size=2\)"),
        (lm.LayerNorm(4), (x,), r"LayerNorm\(size=4\)"),
        (gru, (gru.initialize_carry((3,)), x), r"GRUCell\(in_size=4, hidden_size=2\)"),
    ]:
        with pytest.raises(ValueError, match=where + r" got an input of shape \(3, 5\): its "):
            apply_to(layer, *args)
