"""Conv and ConvTranspose against Flax Linen, given the same weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina import Conv, ConvTranspose
from tests.helpers import abstract_init, assert_close, layout


@pytest.fixture
def normal():
    """Returns ``normal(shape, dtype=float32)``: standard normal data, the same in every test.

    The data comes from NumPy: a jax.random call would compile once per shape, and those
    compilations, not the convolutions, would dominate this file's runtime.
    """
    rng = np.random.default_rng(0)
    return lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)


def linen_variables(linen, x, normal):
    """Variables with Linen's layout (its `init`'s paths, shapes and dtypes), random values.

    Random biases (Linen's are zeros) make the bias part of the comparison; `jax.eval_shape`
    spares the compilation of Linen's initializers for every shape.
    """
    shapes = jax.eval_shape(linen.init, jax.random.key(0), x)
    return jax.tree.map(lambda s: normal(s.shape, s.dtype), dict(shapes))


def outputs_and_gradients(fn, variables, x, cotangent):
    out, vjp = jax.vjp(fn, variables, x)
    return out, vjp(cotangent)


def check_against_linen(linen, ours, x, normal, tol=1e-5):
    """Linen's variables in lamina's apply: equal outputs, and gradients w.r.t. both inputs."""
    variables = linen_variables(linen, x, normal)
    init, apply = lm.transform(ours)
    # lamina's init lays its variables out as Linen's does (paths, shapes, storage dtypes)
    assert layout(jax.eval_shape(init, jax.random.key(0))) == layout(variables)

    out_shape = jax.eval_shape(linen.apply, variables, x)
    cotangent = normal(out_shape.shape, out_shape.dtype)
    expected = jax.jit(outputs_and_gradients, static_argnums=0)(
        linen.apply, variables, x, cotangent
    )
    got = outputs_and_gradients(lambda v, x: apply(v, None, x)[0], variables, x, cotangent)
    assert float(jnp.max(jnp.abs(expected[0].astype(jnp.float32)))) > 0.1  # a real signal
    assert_close(got, expected, rtol=tol, atol=tol)
    return got[0]


# (id, input shape, out_size, kernel_size, settings under lamina's names)
CONV_CASES = [
    ("1d-same", (2, 8, 3), 4, (3,), {}),
    ("1d-int-kernel-valid-stride", (2, 9, 3), 4, 3, dict(strides=2, padding="VALID")),
    ("1d-circular-dilated", (2, 12, 2), 3, (4,), dict(padding="CIRCULAR", dilation=3)),
    ("1d-causal-dilated", (2, 8, 2), 3, (3,), dict(padding="CAUSAL", dilation=2)),
    ("1d-reflect-stride", (2, 8, 2), 3, (4,), dict(padding="REFLECT", strides=2)),
    ("1d-int-padding-groups", (2, 6, 3), 6, (3,), dict(padding=2, groups=3)),
    ("2d-seed-mnist", (2, 8, 8, 1), 32, (3, 3), dict(strides=(1, 1), padding="SAME")),
    ("2d-same-stride-odd", (2, 7, 7, 3), 4, (3, 3), dict(strides=2)),
    ("2d-valid-mixed", (2, 8, 7, 2), 3, (3, 2), dict(strides=(2, 1), dilation=(1, 2))),
    (
        "2d-circular-groups-nobias",
        (2, 7, 6, 4),
        6,
        (2, 3),
        dict(padding="CIRCULAR", strides=2, groups=2, use_bias=False),
    ),
    ("2d-pairs-dilated", (2, 6, 7, 2), 3, (2, 3), dict(padding=((1, 0), (2, 1)), dilation=2)),
    ("2d-int-and-pair", (2, 6, 6, 2), 3, (3, 3), dict(padding=[1, (0, 2)], strides=(1, 2))),
    ("2d-depthwise-lowercase", (2, 6, 6, 4), 8, (3, 3), dict(groups=4, padding="same")),
    ("2d-pointwise", (2, 5, 5, 3), 4, (1, 1), dict(padding="VALID")),
    ("3d-same-stride", (2, 5, 6, 4, 2), 3, (2, 3, 2), dict(strides=(1, 2, 1))),
    (
        "3d-circular-dilated-groups-nobias",
        (1, 5, 5, 5, 4),
        2,
        (3, 3, 3),
        dict(padding="CIRCULAR", dilation=(1, 2, 1), groups=2, use_bias=False),
    ),
    ("3d-int-padding-stride", (1, 5, 4, 5, 2), 3, (2, 2, 2), dict(padding=1, strides=2)),
]


def linen_conv_kwargs(settings):
    renamed = {"groups": "feature_group_count", "dilation": "kernel_dilation"}
    kwargs = {renamed.get(k, k): v for k, v in settings.items()}
    if isinstance(kwargs.get("padding"), str):
        kwargs["padding"] = kwargs["padding"].upper()  # Linen's names are upper case only
    return kwargs


@pytest.mark.parametrize(
    ("shape", "out_size", "kernel_size", "settings"),
    [case[1:] for case in CONV_CASES],
    ids=[case[0] for case in CONV_CASES],
)
def test_conv_equals_linen(normal, shape, out_size, kernel_size, settings):
    x = normal(shape)
    linen = nn.Conv(out_size, kernel_size, **linen_conv_kwargs(settings))
    check_against_linen(linen, Conv(shape[-1], out_size, kernel_size, **settings), x, normal)


# (id, input shape, out_size, kernel_size, settings); the names are Linen's except dilation
CONV_TRANSPOSE_CASES = [
    ("1d-same-stride", (2, 5, 3), 4, 3, dict(strides=2)),
    ("1d-valid-stride-dilated", (2, 5, 2), 3, (4,), dict(padding="VALID", strides=3, dilation=2)),
    ("1d-circular-stride", (2, 5, 2), 3, (3,), dict(padding="CIRCULAR", strides=2)),
    (
        "1d-circular-transposed",
        (2, 6, 2),
        3,
        (5,),
        dict(padding="CIRCULAR", transpose_kernel=True),
    ),
    ("1d-int-padding-nobias", (2, 6, 3), 2, (3,), dict(padding=1, use_bias=False)),
    ("2d-same-stride-transposed", (2, 4, 5, 3), 4, (3, 3), dict(strides=2, transpose_kernel=True)),
    ("2d-circular-strides", (2, 4, 3, 2), 3, (4, 3), dict(padding="CIRCULAR", strides=(2, 3))),
    (
        "2d-circular-even-kernel-transposed",
        (1, 5, 5, 3),
        4,
        (6, 6),
        dict(padding="CIRCULAR", strides=2, transpose_kernel=True),
    ),
    (
        "2d-pairs-dilated",
        (2, 4, 5, 2),
        3,
        (3, 2),
        dict(padding=((2, 1), (0, 1)), dilation=(1, 2), strides=2),
    ),
    ("2d-valid-nobias", (2, 4, 4, 2), 3, (2, 2), dict(padding="VALID", use_bias=False)),
    ("3d-same-strides", (1, 3, 4, 3, 2), 3, (2, 3, 2), dict(strides=(2, 1, 2))),
    (
        "3d-circular-dilated-transposed",
        (1, 4, 3, 4, 2),
        2,
        (3, 2, 2),
        dict(padding="CIRCULAR", strides=(1, 2, 1), dilation=2, transpose_kernel=True),
    ),
]


def linen_conv_transpose_kwargs(settings):
    return {"kernel_dilation" if k == "dilation" else k: v for k, v in settings.items()}


@pytest.mark.parametrize(
    ("shape", "out_size", "kernel_size", "settings"),
    [case[1:] for case in CONV_TRANSPOSE_CASES],
    ids=[case[0] for case in CONV_TRANSPOSE_CASES],
)
def test_conv_transpose_equals_linen(normal, shape, out_size, kernel_size, settings):
    x = normal(shape)
    linen = nn.ConvTranspose(out_size, kernel_size, **linen_conv_transpose_kwargs(settings))
    ours = ConvTranspose(shape[-1], out_size, kernel_size, **settings)
    check_against_linen(linen, ours, x, normal)


@pytest.mark.parametrize(
    ("transpose", "shape", "out_size", "kernel_size", "settings"),
    [
        (False, (2, 8, 3), 5, (3,), dict(strides=2)),
        (False, (2, 6, 6, 4), 6, (3, 3), dict(padding="CIRCULAR", groups=2)),
        (True, (2, 4, 4, 4), 5, (3, 3), dict(strides=2)),
        (True, (2, 5, 4), 5, (4,), dict(padding="CIRCULAR", strides=2, transpose_kernel=True)),
    ],
    ids=["conv-1d", "conv-2d-circular-groups", "transpose-2d", "transpose-1d-circular"],
)
def test_bfloat16_compute_float32_storage(
    normal, transpose, shape, out_size, kernel_size, settings
):
    x = normal(shape)
    dtypes = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    if transpose:
        linen_cls, ours_cls, linen_kwargs = nn.ConvTranspose, ConvTranspose, settings
    else:
        linen_cls, ours_cls, linen_kwargs = nn.Conv, Conv, linen_conv_kwargs(settings)
    linen = linen_cls(out_size, kernel_size, **linen_kwargs, **dtypes)
    ours = ours_cls(shape[-1], out_size, kernel_size, **settings, **dtypes)
    # check_against_linen also compares init's layout, float32 storage included
    got = check_against_linen(linen, ours, x, normal, tol=2e-2)
    assert got.dtype == jnp.bfloat16
    variables = jax.eval_shape(lm.transform(ours).init, jax.random.key(0))
    assert {a.dtype for a in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("batch_shape", [(), (2, 3)], ids=["unbatched", "two-batch-axes"])
@pytest.mark.parametrize("transpose", [False, True], ids=["conv", "transpose"])
def test_batch_axes_like_linen(normal, batch_shape, transpose):
    x = normal((*batch_shape, 5, 4, 2))
    if transpose:
        linen, ours = nn.ConvTranspose(3, (3, 2), strides=2), ConvTranspose(2, 3, (3, 2), strides=2)
    else:
        linen, ours = nn.Conv(3, (3, 2), strides=2), Conv(2, 3, (3, 2), strides=2)
    got = check_against_linen(linen, ours, x, normal)
    assert got.shape[: len(batch_shape)] == batch_shape
    assert got.ndim == len(batch_shape) + 3


def test_seed_layer_with_linen_init_values_under_jit(normal, getkey):
    # The seed's layer, with the values of Linen's own init (lecun_normal kernel, zero bias).
    x = normal((2, 8, 8, 1))
    linen = nn.Conv(32, kernel_size=(3, 3), strides=(1, 1), padding="SAME")
    variables = dict(linen.init(getkey(), x))
    _, apply = lm.transform(Conv(1, 32, kernel_size=(3, 3), strides=(1, 1), padding="SAME"))
    expected = linen.apply(variables, x)
    eager, _ = apply(variables, None, x)
    jitted, _ = jax.jit(apply)(variables, None, x)
    np.testing.assert_allclose(eager, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-5)
    assert expected.shape == (2, 8, 8, 32)


def test_init_values(getkey):
    init, _ = lm.transform(Conv(4, 64, (3, 3), groups=2))
    params = init(getkey())["params"]
    # lecun_normal over fan_in = 3 * 3 * (4 // 2) = 18, and zero biases (Linen's defaults)
    assert abs(float(jnp.std(params["kernel"])) - 18**-0.5) < 0.03
    np.testing.assert_array_equal(params["bias"], np.zeros(64, np.float32))


def test_init_layout_and_settings():
    variables = abstract_init(Conv(4, 6, (3, 2, 2), groups=2))
    assert layout(variables) == {
        "params": {
            "kernel": ((3, 2, 2, 2, 6), jnp.dtype(jnp.float32)),
            "bias": ((6,), jnp.dtype(jnp.float32)),
        }
    }
    tk = ConvTranspose(4, 6, (3,), transpose_kernel=True, use_bias=False)
    assert layout(abstract_init(tk)) == {"params": {"kernel": ((3, 6, 4), jnp.dtype(jnp.float32))}}
    layer = Conv(2, 3, 3, strides=2, padding=1, dilation=(2,))
    assert layer.kernel_size == (3,)
    assert layer.strides == (2,) and layer.dilation == (2,)
    assert layer.padding == ((1, 1),)
    assert Conv(2, 3, (3, 3), padding="circular").padding == "CIRCULAR"


def test_sharding_annotations_reach_the_variables():
    layer = Conv(2, 4, (3, 3), kernel_sharding=(None, None, "in", "out"), bias_sharding=("out",))
    assert layer.kernel.sharding == (None, None, "in", "out")
    assert layer.bias.sharding == ("out",)
    layer = ConvTranspose(2, 4, (3,), kernel_sharding=(None, "in", "out"))
    assert layer.kernel.sharding == (None, "in", "out")
    with pytest.raises(ValueError, match="sharding names one logical axis per dimension"):
        Conv(2, 4, (3, 3), kernel_sharding=("in", "out"))


# -- errors a user can cause ----------------------------------------------------------------


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_wrong_number_of_input_channels(cls):
    layer = cls(3, 8, (3, 3))
    apply = lm.transform(layer).apply
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_init(layer))
    name = cls.__name__
    with pytest.raises(
        ValueError,
        match=rf"{name}\(in_size=3, out_size=8, kernel_size=\(3, 3\)\) got an input of shape "
        r"\(2, 5, 5, 4\): its last axis must be in_size=3, got 4\..*Inputs are channels last",
    ):
        apply(variables, None, jnp.ones((2, 5, 5, 4)))


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_input_rank_does_not_fit_kernel_size(cls):
    layer = cls(3, 8, (3, 3, 3))
    apply = lm.transform(layer).apply
    variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_init(layer))
    with pytest.raises(
        ValueError,
        match=r"got input of shape \(5, 5, 3\): a kernel with 3 spatial axes needs input of "
        r"shape \(batch\.\.\., spatial, spatial, spatial, 3\)",
    ):
        apply(variables, None, jnp.ones((5, 5, 3)))


@pytest.mark.parametrize(("in_size", "out_size"), [(6, 8), (4, 6)])
def test_groups_must_divide_channels(in_size, out_size):
    with pytest.raises(
        ValueError,
        match=rf"groups=4 must divide both in_size={in_size} and out_size={out_size}; choose",
    ):
        Conv(in_size, out_size, (3, 3), groups=4)
    with pytest.raises(ValueError, match="groups must be a positive int, got 0"):
        Conv(4, 4, (3, 3), groups=0)


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
@pytest.mark.parametrize("kernel_size", [(), (3, 3, 3, 3)])
def test_kernel_size_must_have_one_to_three_axes(cls, kernel_size):
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__}\(.*\): kernel_size .* has {len(kernel_size)} entries; it must "
        r"have 1, 2 or 3 \(one per spatial axis\)",
    ):
        cls(2, 3, kernel_size)


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_kernel_size_entries(cls):
    with pytest.raises(TypeError, match="kernel_size must be an int or a tuple of ints"):
        cls(2, 3, "3x3")
    with pytest.raises(ValueError, match=r"every entry of kernel_size must be >= 1, got \(3, 0\)"):
        cls(2, 3, (3, 0))


@pytest.mark.parametrize(
    ("cls", "padding", "allowed"),
    [
        (Conv, "FULL", "'SAME', 'VALID', 'CIRCULAR', 'REFLECT', 'CAUSAL'"),
        (ConvTranspose, "REFLECT", "'SAME', 'VALID', 'CIRCULAR'"),
        (ConvTranspose, "causal", "'SAME', 'VALID', 'CIRCULAR'"),
    ],
)
def test_bad_padding_string(cls, padding, allowed):
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__}\(in_size=2, out_size=3, kernel_size=\(3, 3\)\): unknown padding "
        rf"'{padding}'; use one of {allowed}, an int, or one \(low, high\) pair per spatial axis",
    ):
        cls(2, 3, (3, 3), padding=padding)


def test_causal_padding_is_one_dimensional():
    with pytest.raises(ValueError, match="padding='CAUSAL' is only defined for 1-D convolutions"):
        Conv(2, 3, (3, 3), padding="CAUSAL")


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
@pytest.mark.parametrize("padding", [((1, 1),), ((1, 1), (1, 1), (1, 1))])
def test_wrong_number_of_padding_pairs(cls, padding):
    with pytest.raises(
        ValueError,
        match=rf"padding .* has {len(padding)} \(low, high\) pairs but kernel_size has 2 spatial "
        r"axes; give exactly one pair per spatial axis",
    ):
        cls(2, 3, (3, 3), padding=padding)


@pytest.mark.parametrize("padding", [((1, 2, 3), (1, 1)), 1.5, [(1, 1), "SAME"]])
def test_malformed_padding(padding):
    with pytest.raises(TypeError, match=r"padding must be one of .* \(low, high\) pair of ints"):
        Conv(2, 3, (3, 3), padding=padding)


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
@pytest.mark.parametrize("name", ["strides", "dilation"])
def test_strides_and_dilation_per_axis(cls, name):
    with pytest.raises(
        ValueError,
        match=rf"{name}=\(1, 2, 1\) has 3 entries but kernel_size has 2 spatial axes",
    ):
        cls(2, 3, (3, 3), **{name: (1, 2, 1)})
    with pytest.raises(ValueError, match=rf"every entry of {name} must be >= 1, got 0"):
        cls(2, 3, (3, 3), **{name: 0})
    with pytest.raises(TypeError, match=rf"{name} must be an int or a tuple of 2 ints"):
        cls(2, 3, (3, 3), **{name: 1.0})


@pytest.mark.parametrize("cls", [Conv, ConvTranspose])
def test_sizes_must_be_positive_ints(cls):
    with pytest.raises(ValueError, match="in_size must be a positive int, got 0"):
        cls(0, 3, (3,))
    with pytest.raises(ValueError, match=r"out_size must be a positive int, got 2\.0"):
        cls(2, 2.0, (3,))
