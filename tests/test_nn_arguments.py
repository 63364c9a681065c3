"""Every layer checks every argument (lamina/nn/_checks.py), and its settings stay as built.

Each row of a table is one mistake a user can make, and the error it must raise: the layer's
name, what was given, and what to do.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import apply_to

# (id, constructor call, error type, message pattern)
CONSTRUCTOR_ERRORS = [
    # Dense: sizes (a clear error, not a ZeroDivisionError or a Parameter shape error), options
    (
        "dense-in-0",
        lambda: lm.Dense(0, 4),
        ValueError,
        r"^Dense: in_size must be a positive int, got 0\.$",
    ),
    (
        "dense-out-0",
        lambda: lm.Dense(4, 0),
        ValueError,
        r"^Dense: out_size must be a positive int, got 0\.$",
    ),
    (
        "dense-negative",
        lambda: lm.Dense(-3, 4),
        ValueError,
        r"^Dense: in_size must be a positive int, got -3",
    ),
    (
        "dense-float-size",
        lambda: lm.Dense(2.5, 3),
        TypeError,
        r"^Dense: in_size must be a positive int, got 2\.5\.$",
    ),
    (
        "dense-bool-size",
        lambda: lm.Dense(True, 3),
        TypeError,
        r"^Dense: in_size must be a positive int, got True",
    ),
    (
        "dense-str-size",
        lambda: lm.Dense("4", 3),
        TypeError,
        r"^Dense: in_size must be a positive int, got '4'",
    ),
    (
        "dense-use-bias-str",
        lambda: lm.Dense(4, 3, use_bias="False"),
        TypeError,
        r"^Dense: use_bias must be True or False, got str 'False'",
    ),
    (
        "dense-use-bias-int",
        lambda: lm.Dense(4, 3, use_bias=0),
        TypeError,
        r"^Dense: use_bias must be True or False, got int 0",
    ),
    (
        "dense-kernel-init",
        lambda: lm.Dense(4, 3, kernel_init=0.02),
        TypeError,
        r"^Dense: kernel_init must be an initializer, a function init\(key, shape, dtype\)",
    ),
    (
        "dense-bias-init",
        lambda: lm.Dense(4, 3, bias_init="zeros"),
        TypeError,
        r"^Dense: bias_init must be an initializer",
    ),
    (
        "dense-dtype-name",
        lambda: lm.Dense(4, 3, dtype="float3"),
        TypeError,
        r"^Dense: dtype must be a dtype such as jnp\.float32, got 'float3'",
    ),
    (
        "dense-param-dtype-none",
        lambda: lm.Dense(4, 3, dtype=None, param_dtype=jnp.int32),
        TypeError,
        r"^Dense: param_dtype must be a floating or complex dtype .* got int32",
    ),
    (
        "dense-complex-storage-real-compute",
        lambda: lm.Dense(4, 3, param_dtype=jnp.complex64),
        TypeError,
        r"^Dense: param_dtype=complex64 is complex but dtype=float32 is real.*dtype=None",
    ),
    (
        "dense-dtype-int",
        lambda: lm.Dense(4, 3, dtype=jnp.int32),
        TypeError,
        r"^Dense: dtype must be a floating or complex dtype .* got int32",
    ),
    (
        "dense-param-dtype",
        lambda: lm.Dense(4, 3, param_dtype=jnp.int8),
        TypeError,
        r"^Dense: param_dtype must be a floating or complex dtype",
    ),
    (
        "dense-precision",
        lambda: lm.Dense(4, 3, precision="fast"),
        TypeError,
        r"^Dense: precision must be None, a jax\.lax\.Precision .* got 'fast'",
    ),
    (
        "dense-sharding-len",
        lambda: lm.Dense(4, 3, kernel_sharding=("embed",)),
        ValueError,
        r"^Dense: kernel_sharding names one logical axis per dimension of a 2-dimensional",
    ),
    (
        "dense-sharding-type",
        lambda: lm.Dense(4, 3, bias_sharding="mlp"),
        TypeError,
        r"^Dense: bias_sharding must be None or a tuple of logical axis names",
    ),
    # Embed
    (
        "embed-0",
        lambda: lm.Embed(0, 4),
        ValueError,
        r"^Embed: num_embeddings must be a positive int, got 0",
    ),
    (
        "embed-float",
        lambda: lm.Embed(10, 4.0),
        TypeError,
        r"^Embed: size must be a positive int, got 4\.0",
    ),
    (
        "embed-init",
        lambda: lm.Embed(10, 4, embedding_init=None),
        TypeError,
        r"^Embed: embedding_init must be an initializer",
    ),
    # Conv and ConvTranspose
    (
        "conv-bool-size",
        lambda: lm.Conv(True, 4, 3),
        TypeError,
        r"^Conv\(in_size=True, .*\): in_size must be a positive int, got True",
    ),
    (
        "conv-kernel-str",
        lambda: lm.Conv(3, 4, "3"),
        TypeError,
        r"^Conv\(.*\): kernel_size must be an int or a tuple of ints",
    ),
    (
        "conv-kernel-bool",
        lambda: lm.Conv(3, 4, (True, 3)),
        TypeError,
        r"kernel_size must be an int or a tuple of ints",
    ),
    (
        "conv-strides-float",
        lambda: lm.Conv(3, 4, (3, 3), strides=1.5),
        TypeError,
        r"^Conv\(.*\): strides must be an int or a tuple of 2 ints, got 1\.5",
    ),
    (
        "conv-transpose-kernel",
        lambda: lm.ConvTranspose(3, 4, 3, transpose_kernel="yes"),
        TypeError,
        r"^ConvTranspose\(.*\): transpose_kernel must be True or False",
    ),
    (
        "conv-dtype",
        lambda: lm.Conv(3, 4, 3, dtype=jnp.int32),
        TypeError,
        r"^Conv\(.*\): dtype must be a floating or complex dtype",
    ),
    (
        "conv-precision",
        lambda: lm.Conv(3, 4, 3, precision=3),
        TypeError,
        r"^Conv\(.*\): precision must be None",
    ),
    # norms
    (
        "layernorm-size",
        lambda: lm.LayerNorm(0),
        ValueError,
        r"^LayerNorm: size must be a positive int, the size of the input's last axis",
    ),
    (
        "rmsnorm-epsilon-nan",
        lambda: lm.RMSNorm(4, epsilon=float("nan")),
        ValueError,
        r"^RMSNorm: epsilon must be a finite non-negative number",
    ),
    (
        "groupnorm-groups-bool",
        lambda: lm.GroupNorm(True, 4),
        TypeError,
        r"^GroupNorm: num_groups must be a positive int, got True",
    ),
    (
        "batchnorm-momentum-bool",
        lambda: lm.BatchNorm(4, momentum=True),
        TypeError,
        r"^BatchNorm: momentum must be a number in \[0, 1\].*got True \(True and False are not "
        r"numbers here\)",
    ),
    (
        "batchnorm-axis-name",
        lambda: lm.BatchNorm(4, axis_name=("data", 1)),
        TypeError,
        r"^BatchNorm: axis_name must be None, the name of a mapped axis",
    ),
    (
        "batchnorm-use-bias",
        lambda: lm.BatchNorm(4, use_bias=None),
        TypeError,
        r"^BatchNorm: use_bias must be True or False, got NoneType None",
    ),
    # dropout
    (
        "dropout-str",
        lambda: lm.Dropout("0.5"),
        TypeError,
        r"^Dropout: rate must be a number in \[0, 1\], got '0\.5' \(a string is not a number",
    ),
    (
        "dropout-bool",
        lambda: lm.Dropout(True),
        TypeError,
        r"^Dropout: rate must be a number in \[0, 1\], got True \(True and False are not",
    ),
    (
        "dropout-nan",
        lambda: lm.Dropout(float("nan")),
        ValueError,
        r"^Dropout: rate must be a number in \[0, 1\], got nan",
    ),
    (
        "dropout-dims",
        lambda: lm.Dropout(0.5, broadcast_dims=(0.0,)),
        TypeError,
        r"^Dropout: broadcast_dims must be an int or a tuple of ints",
    ),
    (
        "dropout-stream",
        lambda: lm.Dropout(0.5, stream=1),
        TypeError,
        r"^Dropout: stream must be the name of a random stream",
    ),
    # attention
    (
        "mha-heads-float",
        lambda: lm.MultiHeadAttention(2.0, 8),
        TypeError,
        r"^MultiHeadAttention: num_heads must be a positive int, got 2\.0",
    ),
    (
        "mha-qkv-bool",
        lambda: lm.MultiHeadAttention(2, 8, qkv_size=True),
        TypeError,
        r"^MultiHeadAttention: qkv_size must be a positive int, got True",
    ),
    (
        "mha-value-size",
        lambda: lm.MultiHeadAttention(2, 8, value_size=0),
        ValueError,
        r"^MultiHeadAttention: value_size must be a positive int, got 0",
    ),
    (
        "mha-broadcast-dropout",
        lambda: lm.MultiHeadAttention(2, 8, broadcast_dropout=1),
        TypeError,
        r"^MultiHeadAttention: broadcast_dropout must be True or False",
    ),
    (
        "mha-out-init",
        lambda: lm.MultiHeadAttention(2, 8, out_kernel_init=1.0),
        TypeError,
        r"^MultiHeadAttention: out_kernel_init must be an initializer",
    ),
    # cells and RNN
    (
        "lstm-hidden-float",
        lambda: lm.LSTMCell(3, 4.0),
        TypeError,
        r"^LSTMCell: hidden_size must be a positive int, got 4\.0",
    ),
    (
        "gru-activation",
        lambda: lm.GRUCell(3, 4, activation_fn="tanh"),
        TypeError,
        r"^GRUCell: activation_fn must be a function such as lm\.tanh, got 'tanh'",
    ),
    (
        "rnn-cell",
        lambda: lm.RNN(lm.Dense(3, 4)),
        TypeError,
        r"^RNN's cell must be a cell module such as LSTMCell\(in_size, hidden_size\)",
    ),
    (
        "rnn-flag",
        lambda: lm.RNN(lm.GRUCell(3, 4), return_carry=1),
        TypeError,
        r"^RNN: return_carry must be True or False, got int 1",
    ),
    # Sequential
    (
        "sequential-list",
        lambda: lm.Sequential([lm.Dense(2, 2), lm.relu]),
        TypeError,
        r"^Sequential takes the layers as separate arguments, got one list; unpack it",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [row[1:] for row in CONSTRUCTOR_ERRORS],
    ids=[row[0] for row in CONSTRUCTOR_ERRORS],
)
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match) as raised:
        make()
    if error is TypeError and "must be a positive int" in match:
        assert isinstance(raised.value, ValueError)  # a wrong setting is also a ValueError


@pytest.mark.parametrize(
    "make",
    [
        lambda: lm.Dense(4, 3, False),
        lambda: lm.Embed(10, 4, lm.initializers.zeros()),
        lambda: lm.Conv(3, 4, 3, 2),
        lambda: lm.ConvTranspose(3, 4, 3, 2),
        lambda: lm.LayerNorm(4, 1e-5),
        lambda: lm.RMSNorm(4, 1e-5),
        lambda: lm.BatchNorm(4, 0.9),
        lambda: lm.GroupNorm(2, 4, 1e-5),
        lambda: lm.LSTMCell(3, 4, lm.relu),
        lambda: lm.GRUCell(3, 4, lm.relu),
        lambda: lm.MultiHeadAttention(2, 8, 8),
        lambda: lm.Dropout(0.5, (0,)),
        lambda: lm.RNN(lm.GRUCell(3, 4), True),
        lambda: lm.LoRA(lm.Dense(4, 4), 2, 4.0),
    ],
    ids=[
        "Dense", "Embed", "Conv", "ConvTranspose", "LayerNorm", "RMSNorm", "BatchNorm",
        "GroupNorm", "LSTMCell", "GRUCell", "MultiHeadAttention", "Dropout", "RNN", "LoRA",
    ],
)  # fmt: skip
def test_options_after_the_sizes_are_keyword_only(make):
    """A positional slip is a TypeError, never another model."""
    with pytest.raises(TypeError, match=r"positional argument"):
        make()


# (id, layer, setting, new value)
READ_ONLY = [
    ("dense-in_size", lambda: lm.Dense(4, 3), "in_size", 5),
    ("dense-dtype", lambda: lm.Dense(4, 3), "dtype", jnp.bfloat16),
    ("dense-use_bias", lambda: lm.Dense(4, 3), "use_bias", False),
    ("embed-size", lambda: lm.Embed(10, 4), "size", 8),
    ("conv-kernel_size", lambda: lm.Conv(3, 4, (3, 3)), "kernel_size", (5, 5)),
    ("conv-padding", lambda: lm.Conv(3, 4, (3, 3)), "padding", "VALID"),
    ("conv-groups", lambda: lm.Conv(4, 4, (3, 3)), "groups", 2),
    ("layernorm-size", lambda: lm.LayerNorm(4), "size", 5),
    ("batchnorm-momentum", lambda: lm.BatchNorm(4), "momentum", 0.5),
    ("groupnorm-num_groups", lambda: lm.GroupNorm(2, 4), "num_groups", 4),
    ("lstm-hidden_size", lambda: lm.LSTMCell(3, 4), "hidden_size", 8),
    ("mha-num_heads", lambda: lm.MultiHeadAttention(2, 8), "num_heads", 4),
    ("mha-decode_shape", lambda: lm.MultiHeadAttention(2, 8), "decode_shape", (1, 4)),
    ("dropout-rate", lambda: lm.Dropout(0.5), "rate", "0.9"),
    ("rnn-reverse", lambda: lm.RNN(lm.GRUCell(3, 4)), "reverse", True),
    ("sequential-num_layers", lambda: lm.Sequential(lm.relu), "num_layers", 2),
]


@pytest.mark.parametrize(
    ("make", "name", "value"), [r[1:] for r in READ_ONLY], ids=[r[0] for r in READ_ONLY]
)
def test_settings_are_read_only_after_construction(make, name, value):
    """`dense.dtype = ...` was ignored and `dense.in_size = ...` crashed inside a kernel."""
    layer = make()
    before = getattr(layer, name)
    cls = type(layer).__name__
    with pytest.raises(
        AttributeError,
        match=rf"^{cls}\.{name} is read-only: it is fixed when the layer is built .* Build a new "
        rf"layer with the setting you want .* model\.layer = lm\.{cls}\(\.\.\., {name}=\.\.\.\)",
    ):
        setattr(layer, name, value)
    with pytest.raises(AttributeError, match=rf"^{cls}\.{name} is read-only"):
        delattr(layer, name)
    assert getattr(layer, name) == before
    assert getattr(copy.deepcopy(layer), name) == before  # transform's snapshot is a copy


def test_read_only_settings_survive_transform_and_repr():
    dense = lm.Dense(4, 3)
    init, apply = lm.transform(dense)
    y, _ = apply(init(jax.random.key(0)), None, jnp.ones((2, 4)))
    assert y.shape == (2, 3)
    assert "in_size=4" in repr(dense)
    with pytest.raises(AttributeError, match="read-only"):
        dense.in_size = 5
    # replacing a whole layer (the seed's model surgery) is how a setting changes
    seq = lm.Sequential(lm.Dense(4, 3), lm.relu)
    seq.layers_0 = lm.Dense(4, 5)
    assert seq.layers[0].out_size == 5


def test_sequential_layers_is_an_immutable_tuple():
    """`seq.layers[0] = ...` and `seq.layers.append(...)` were silently dropped."""
    seq = lm.Sequential(lm.Dense(4, 3), lm.relu)
    first = seq.layers_0
    # a tuple in every way users see it: equal and hashing as one, a tuple to JAX's trees
    assert isinstance(seq.layers, tuple) and seq.layers == (first, lm.relu)
    assert hash(seq.layers) == hash((first, lm.relu))
    assert jax.tree.leaves(seq.layers) == [first, lm.relu]
    assert seq.layers[:1] == (first,) and (*seq.layers, lm.tanh) == (first, lm.relu, lm.tanh)
    with pytest.raises(
        TypeError,
        match=r"^Sequential\.layers is read-only: .* assign its attribute "
        r"\(seq\.layers_0 = new_layer\); to add or remove layers, build a new Sequential",
    ):
        seq.layers[0] = lm.Dense(4, 8)
    with pytest.raises(TypeError, match=r"Sequential\(\*seq\.layers\[:1\], \*seq\.layers\[2:\]\)"):
        del seq.layers[1]
    assert seq.layers_0 is first and seq.num_layers == 2  # nothing changed
    with pytest.raises(AttributeError, match="append"):
        seq.layers.append(lm.Dense(3, 2))
    with pytest.raises(
        AttributeError, match=r"^Sequential\.layers is read-only .* assign seq\.layers_i"
    ):
        seq.layers = (lm.Dense(4, 8),)
    seq.layers_0 = lm.Dense(4, 8)  # the storage: the edit is kept
    assert seq.layers[0].out_size == 8
    variables = lm.transform(seq).init(jax.random.key(0))
    assert variables["params"]["layers_0"]["kernel"].shape == (4, 8)


# --- call errors --------------------------------------------------------------------------------


def test_embed_ids_out_of_range():
    with pytest.raises(
        ValueError,
        match=r"^Embed\(num_embeddings=10, size=4\) got id 10: ids must be in \[0, 10\)",
    ):
        apply_to(lm.Embed(10, 4), jnp.array([1, 10]))
    with pytest.raises(ValueError, match=r"got id -1: ids must be in \[0, 10\)"):
        apply_to(lm.Embed(10, 4), jnp.array([-1, 2]))
    assert apply_to(lm.Embed(10, 4), jnp.array([0, 9]))[0].shape == (2, 4)
    assert apply_to(lm.Embed(10, 4), [[0, 9]])[0].shape == (1, 2, 4)  # lists of ints work
    with pytest.raises(TypeError, match=r"^Embed\(num_embeddings=10, size=4\) takes integer ids"):
        apply_to(lm.Embed(10, 4), "3")
    assert apply_to(lm.Embed(10, 4), jnp.zeros((0,), jnp.int32))[0].shape == (0, 4)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda x: lm.dropout(x, "0.5", True),
            TypeError,
            r"^dropout: rate must be a number in \[0, 1\], got '0\.5'",
        ),
        (
            lambda x: lm.dropout(x, True, True),
            TypeError,
            r"^dropout: rate must be a number .* got True",
        ),
        (
            lambda x: lm.dropout(x, 0.5, True, broadcast_dims=(2,)),
            ValueError,
            r"^dropout: broadcast_dims=\(2,\) names axis 2, but the input of shape \(3, 4\) has "
            r"2 axes \(valid: -2 to 1\)",
        ),
        (
            lambda x: lm.dropout(x, 0.5, True, broadcast_dims=(-3,)),
            ValueError,
            r"names axis -3, but the input",
        ),
        (
            lambda x: lm.dropout(x, 0.5, True, broadcast_dims=(0, -2)),
            ValueError,
            r"^dropout: broadcast_dims=\(0, -2\) names the same axis twice",
        ),
        (
            lambda x: lm.dropout(x.astype(jnp.int32), 0.5, True),
            TypeError,
            r"^dropout needs a floating input, got dtype int32",
        ),
        (
            lambda x: lm.dropout(x, 0.5, True, stream=""),
            TypeError,
            r"^dropout: stream must be the name of a random stream",
        ),
    ],
    ids=["rate-str", "rate-bool", "dims-high", "dims-low", "dims-twice", "int-input", "stream"],
)
def test_dropout_call_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.ones((3, 4)))


def test_dropout_int_input_was_inf_and_broadcast_dims_apply_to_the_named_axis():
    key = jax.random.key(0)
    y = lm.dropout(jnp.ones((6, 5)), 0.5, True, broadcast_dims=-1, rng=key)
    assert all(len(set(row.tolist())) == 1 for row in np.asarray(y))  # one mask per row
    with pytest.raises(TypeError, match="needs a floating input"):
        lm.dropout(jnp.ones((6, 5), jnp.int32), 0.5, False)  # also when not training


POOL_ERRORS = [
    ({"kernel_size": 0}, ValueError, r"^max_pool: every entry of kernel_size must be >= 1, got 0"),
    (
        {"kernel_size": (2, -1)},
        ValueError,
        r"^max_pool: every entry of kernel_size must be >= 1, got \(2, -1\)",
    ),
    (
        {"kernel_size": (2, 2), "strides": 0},
        ValueError,
        r"^max_pool: every entry of strides must be >= 1",
    ),
    ({"kernel_size": 2.0}, TypeError, r"^max_pool: kernel_size must be an int or a tuple of ints"),
    (
        {"kernel_size": (2, 2), "strides": (2.0, 2)},
        TypeError,
        r"^max_pool: strides must be an int or a tuple of 2 ints",
    ),
    (
        {"kernel_size": (5, 5)},
        ValueError,
        r"^max_pool got an input of shape \(1, 4, 4, 1\): spatial axis 0 has size 4 "
        r"\(padding='VALID'\), smaller than the window 5, so the output would be empty",
    ),
    (
        {"kernel_size": (3, 3), "padding": ((0, 0), (-2, 0))},
        ValueError,
        r"spatial axis 1 has size 4 \(padding \(-2, 0\)\), smaller than the window 3",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), POOL_ERRORS)
def test_pool_argument_errors(kwargs, error, match):
    """Zero windows reached JAX's reduce_window; too large VALID windows gave empty arrays."""
    with pytest.raises(error, match=match):
        lm.max_pool(jnp.ones((1, 4, 4, 1)), **kwargs)


def test_pool_int_window_and_strides():
    """`max_pool(x, 2)` raised "'int' object is not iterable"; an int is a 1-D window."""
    x = jnp.arange(8.0).reshape(1, 8, 1)
    np.testing.assert_array_equal(lm.max_pool(x, 2, 2)[0, :, 0], [1, 3, 5, 7])
    np.testing.assert_array_equal(lm.avg_pool(x, 4, strides=4)[0, :, 0], [1.5, 5.5])
    images = jnp.arange(16.0).reshape(1, 4, 4, 1)
    np.testing.assert_array_equal(
        lm.max_pool(images, (2, 2), 2), lm.max_pool(images, (2, 2), (2, 2))
    )


def test_pool_int_window_on_images_is_ambiguous_not_one_dimensional():
    images = jnp.arange(16.0).reshape(1, 4, 4, 1)
    with pytest.raises(
        TypeError, match=r"kernel_size=2 is a window over one spatial axis.*\(2, 2\)"
    ):
        lm.max_pool(images, 2)
    assert lm.max_pool(images, (2,)).shape == (1, 4, 3, 1)  # explicit: pool one axis


def test_pool_input_dtypes():
    with pytest.raises(TypeError, match=r"^avg_pool needs a floating input, got dtype int32"):
        lm.avg_pool(jnp.ones((1, 4, 1), jnp.int32), 2)
    with pytest.raises(
        TypeError, match=r"^max_pool needs an integer or floating input, got dtype bool"
    ):
        lm.max_pool(jnp.ones((1, 4, 1), bool), 2)
    with pytest.raises(TypeError, match=r"^avg_pool: count_include_pad must be True or False"):
        lm.avg_pool(jnp.ones((1, 4, 1)), 2, count_include_pad="no")


@pytest.mark.parametrize(
    ("layer", "shape", "match"),
    [
        (
            lm.Conv(1, 2, (3, 3), padding="VALID"),
            (1, 2, 5, 1),
            r"^Conv\(in_size=1, out_size=2, kernel_size=\(3, 3\)\) got an input of shape "
            r"\(1, 2, 5, 1\): spatial axis 0 has size 2 \(padding='VALID'\), smaller than the "
            r"window 3, so the output would be empty",
        ),
        (
            lm.Conv(1, 2, 3, padding="VALID", dilation=3),
            (2, 6, 1),
            r"spatial axis 0 has size 6 \(padding='VALID'\), smaller than the window 7 \(kernel "
            r"3 with dilation 3\)",
        ),
        (lm.Conv(1, 2, 3), (2, 0, 1), r"spatial axis 0 has size 0, so the output would be empty"),
        (
            lm.ConvTranspose(1, 2, 3, padding=((-3, -3),)),
            (2, 2, 1),
            r"^ConvTranspose\(.*\) got an input of shape \(2, 2, 1\): with padding \(-3, -3\) on "
            r"spatial axis 0, the output would have -6 positions",
        ),
    ],
    ids=["conv-valid", "conv-dilated", "conv-empty", "transpose-negative-padding"],
)
def test_windows_that_do_not_fit_the_input(layer, shape, match):
    with pytest.raises(ValueError, match=match):
        apply_to(layer, jnp.ones(shape))


def test_batch_norm_training_needs_a_batch_axis():
    """One example's batch statistics normalise it to zeros, silently: an error instead."""
    with pytest.raises(
        ValueError,
        match=r"^BatchNorm\(size=4\) at the root got an input of shape \(4,\) while training: "
        r"its batch statistics reduce over no axis",
    ):
        apply_to(lm.BatchNorm(4), jnp.ones(4), True)
    assert apply_to(lm.BatchNorm(4), jnp.ones(4), False)[0].shape == (4,)  # evaluation works
