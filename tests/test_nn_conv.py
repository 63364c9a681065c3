"""Conv, ConvTranspose and ConvLocal against Flax Linen, given the same weights.

Outputs and gradients (variables and inputs) equal Linen's, with masks and input dilation;
the layout of the variables, dtypes, batch axes, settings; every error a user can cause.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lamina as lm
from lamina import Conv, ConvTranspose
from tests.helpers import abstract_init, assert_close, layout
from tests.linen_helpers import check_against_linen

pytestmark = pytest.mark.fast_compile  # tests/conftest.py


@pytest.fixture
def normal():
    """Returns ``normal(shape, dtype=float32)``: standard normal data, the same in every test.

    The data comes from NumPy: a jax.random call would compile once per shape, and those
    compilations, not the convolutions, would dominate this file's runtime.
    """
    rng = np.random.default_rng(0)
    return lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)


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


# --- masks, input dilation and ConvLocal --------------------------------------------------------


def mask(*shape, dtype=np.float32):
    """A fixed random 0/1 mask."""
    return (np.random.default_rng(3).random(shape) < 0.6).astype(dtype)


def _linen_options(options):
    """lamina's options under Linen's names."""
    names = {"dilation": "kernel_dilation", "groups": "feature_group_count"}
    return {names.get(k, k): v for k, v in options.items()}


# (id, Linen class, lamina class, input shape, out_size, kernel_size, options (lamina's names))
CASES = [
    ("conv-mask-1d", nn.Conv, lm.Conv, (2, 8, 3), 4, 3, dict(mask=mask(3, 3, 4))),
    (
        "conv-mask-groups-int",
        nn.Conv,
        lm.Conv,
        (2, 6, 6, 4),
        6,
        (3, 3),
        dict(mask=mask(3, 3, 2, 6), groups=2, strides=2),
    ),
    (
        "conv-input-dilation",
        nn.Conv,
        lm.Conv,
        (2, 5, 4, 2),
        3,
        (3, 2),
        dict(input_dilation=(2, 1), padding=((1, 1), (0, 1)), dilation=(1, 2)),
    ),
    (
        "conv-input-dilation-int-strides-mask",
        nn.Conv,
        lm.Conv,
        (2, 6, 2),
        3,
        3,
        dict(input_dilation=3, padding=2, strides=2, mask=mask(3, 2, 3)),
    ),
    (
        "conv-transpose-mask",
        nn.ConvTranspose,
        lm.ConvTranspose,
        (2, 5, 5, 3),
        2,
        (3, 3),
        dict(mask=mask(3, 3, 3, 2), strides=2),
    ),
    (
        "conv-transpose-mask-transposed-kernel",
        nn.ConvTranspose,
        lm.ConvTranspose,
        (2, 6, 3),
        4,
        3,
        dict(mask=mask(3, 4, 3), transpose_kernel=True, padding="CIRCULAR"),
    ),
]

# ConvLocal: (id, input shape, out_size, kernel_size, options); spatial_shape is the input's
LOCAL_CASES = [
    ("1d-valid-linen-example", (1, 8, 3), 4, (3,), dict(padding="VALID")),
    ("2d-circular-stride", (1, 8, 6, 3), 4, (3, 3), dict(strides=2, padding="CIRCULAR")),
    (
        "1d-causal-dilated-nobias",
        (2, 7, 2),
        3,
        2,
        dict(padding="CAUSAL", dilation=2, use_bias=False),
    ),
    ("2d-pairs-input-dilation", (2, 3, 4, 2), 3, (2, 2), dict(padding=1, input_dilation=(2, 1))),
    ("2d-masked-batchless", (5, 4, 2), 3, (2, 3), dict(padding="VALID", mask=mask(4, 2, 12, 3))),
    ("1d-reflect-stride-several-batch", (2, 2, 9, 2), 3, 3, dict(padding="REFLECT", strides=2)),
]


@pytest.mark.parametrize(
    "linen_cls, ours_cls, shape, out_size, kernel_size, options",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_masks_and_input_dilation_match_linen(
    linen_cls, ours_cls, shape, out_size, kernel_size, options, normal
):
    linen = linen_cls(out_size, kernel_size, **_linen_options(options))
    ours = ours_cls(shape[-1], out_size, kernel_size, **options)
    check_against_linen(linen, ours, normal(shape), normal)


@pytest.mark.parametrize(
    "shape, out_size, kernel_size, options",
    [c[1:] for c in LOCAL_CASES],
    ids=[c[0] for c in LOCAL_CASES],
)
def test_conv_local_matches_linen(shape, out_size, kernel_size, options, normal):
    n = 1 if isinstance(kernel_size, int) else len(kernel_size)
    spatial = shape[-n - 1 : -1]
    linen = nn.ConvLocal(out_size, kernel_size, **_linen_options(options))
    ours = lm.ConvLocal(shape[-1], out_size, kernel_size, spatial, **options)
    check_against_linen(linen, ours, normal(shape), normal)


def test_conv_local_kernel_is_linen_layout():
    # Linen's docstring: 'CIRCULAR' with stride 2 on an input (1, 8, 3) of a 2-d window
    layer = lm.ConvLocal(3, 4, (3, 3), (1, 8), strides=2, padding="CIRCULAR")
    shapes = jax.eval_shape(lm.transform(layer).init, jax.random.key(0))
    assert jax.tree.map(jnp.shape, shapes) == {
        "params": {"bias": (1, 4, 4), "kernel": (1, 4, 27, 4)}
    }
    assert layer.spatial_shape == (1, 8) and layer.input_dilation == (1, 1)


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
def test_input_dilation_with_a_padding_name_pads_the_dilated_input(padding, normal):
    """Linen (lax) takes only explicit pairs with an input dilation; a name means its pairs."""
    x = normal((2, 5, 2))
    layer = lm.Conv(2, 3, 3, strides=2, padding=padding, input_dilation=2)
    pads = tuple(lax.padtype_to_pads((9,), (3,), (2,), padding))
    explicit = lm.Conv(2, 3, 3, strides=2, padding=pads, input_dilation=2)
    variables = lm.transform(layer).init(jax.random.key(0))
    got, _ = lm.transform(layer).apply(variables, None, x)
    expected, _ = lm.transform(explicit).apply(variables, None, x)
    assert got.shape == ((2, 4, 3) if padding == "VALID" else (2, 5, 3))
    assert_close(got, expected)


def test_mask_dtype_takes_part_in_dtype_inference_as_in_linen(normal):
    """With dtype=None, Linen promotes ``kernel * mask``: a float32 mask widens bfloat16."""
    x = normal((2, 6, 3), jnp.bfloat16)
    for mask_dtype, expected in ((np.float32, jnp.float32), (bool, jnp.bfloat16)):
        layer = lm.Conv(3, 4, 3, mask=mask(3, 3, 4, dtype=mask_dtype), dtype=None)
        layer_bf16 = lm.Conv(
            3, 4, 3, mask=mask(3, 3, 4, dtype=mask_dtype), dtype=None, param_dtype=jnp.bfloat16
        )
        init, apply = lm.transform(layer_bf16)
        variables = init(jax.random.key(0))
        y, _ = apply(variables, None, x)
        assert y.dtype == expected
        linen = nn.Conv(4, 3, mask=jnp.asarray(mask(3, 3, 4, dtype=mask_dtype)))
        with jax.numpy_dtype_promotion("standard"):  # Linen's kernel * mask promotes implicitly
            linen_y = linen.copy(param_dtype=jnp.bfloat16).apply(variables, x)
        assert linen_y.dtype == expected
        assert_close(y, linen_y, check_dtype=False, rtol=1e-2, atol=1e-2)
        assert layer.mask.dtype == jnp.dtype(mask_dtype)


def test_conv_local_complex_matches_linen(normal):
    layer = lm.ConvLocal(2, 3, 2, 5, dtype=None, param_dtype=jnp.complex64)
    variables = jax.tree.map(
        lambda v: v * (1 + 0.5j) + 0.25j, lm.transform(layer).init(jax.random.key(0))
    )
    z = lax.complex(normal((2, 5, 2)), normal((2, 5, 2)))
    got, _ = lm.transform(layer).apply(variables, None, z)
    expected = nn.ConvLocal(3, 2, param_dtype=jnp.complex64).apply(variables, z)
    assert got.dtype == expected.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    real = lm.ConvLocal(2, 3, 2, 5)
    with pytest.raises(TypeError, match=r"^ConvLocal\(.*spatial_shape=\(5,\)\) at the root got"):
        lm.transform(real).apply(lm.transform(real).init(jax.random.key(0)), None, z)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: lm.Conv(3, 4, 3, mask=np.ones((3, 4, 3))),
            ValueError,
            r"^Conv\(in_size=3, out_size=4, kernel_size=\(3,\)\): mask has shape \(3, 4, 3\) but "
            r"the kernel has shape \(3, 3, 4\)",
        ),
        (
            lambda: lm.ConvTranspose(3, 4, 3, transpose_kernel=True, mask=np.ones((3, 3, 4))),
            ValueError,
            r"^ConvTranspose\(.*\): mask has shape \(3, 3, 4\) but the kernel has shape "
            r"\(3, 4, 3\)",
        ),
        (
            lambda: lm.ConvLocal(3, 4, 3, 8, mask=np.ones((3, 3, 4))),
            ValueError,
            r"^ConvLocal\(.*spatial_shape=\(8,\)\): mask has shape .* kernel has shape \(8, 9, 4\)",
        ),
        (lambda: lm.Conv(3, 4, 3, mask="causal"), TypeError, r"mask must be a concrete array"),
        (lambda: lm.Conv(3, 4, 3, mask=[[None]]), TypeError, r"mask must be a concrete array"),
        (lambda: lm.Conv(3, 4, 3, input_dilation=0), ValueError, r"every entry of input_dilation"),
        (lambda: lm.Conv(3, 4, 3, input_dilation=(1, 2)), ValueError, r"input_dilation=\(1, 2\)"),
        (lambda: lm.Conv(3, 4, 3, input_dilation=1.5), TypeError, r"input_dilation must be an int"),
        (
            lambda: lm.ConvLocal(3, 4, 3, (8, 8)),
            ValueError,
            r"spatial_shape=\(8, 8\) has 2 entries",
        ),
        (lambda: lm.ConvLocal(3, 4, 3, "8"), TypeError, r"spatial_shape must be an int or a tuple"),
        (
            lambda: lm.ConvLocal(3, 4, 5, 3, padding="VALID"),
            ValueError,
            r"^ConvLocal\(.*spatial_shape=\(3,\)\) got an input of shape \(1, 3, 3\): spatial "
            r"axis 0 has size 3 .*smaller than the window 5",
        ),
        (lambda: lm.ConvLocal(3, 4, 3, 8, groups=2), TypeError, r"unexpected keyword.*groups"),
    ],
)
def test_settings_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "layer, shape, match",
    [
        (
            lm.ConvLocal(2, 3, 3, 6),
            (2, 7, 2),
            r"^ConvLocal\(.*\) got an input of shape \(2, 7, 2\): its spatial axes must have the "
            r"sizes spatial_shape=\(6,\) .* got \(7,\)",
        ),
        (
            lm.Conv(2, 3, 4, padding="VALID", input_dilation=2),
            (1, 2, 2),
            r"^Conv\(.*\) \(input_dilation=\(2,\) dilates the input\) got an input of shape "
            r"\(1, 3, 2\): spatial axis 0 has size 3 .*smaller than the window 4",
        ),
        (lm.ConvLocal(2, 3, 3, 6), (2, 6, 3), r"its last axis must be in_size=2, got 3"),
    ],
)
def test_input_errors(layer, shape, match):
    init, apply = lm.transform(layer)
    with pytest.raises(ValueError, match=match):
        apply(init(jax.random.key(0)), None, jnp.ones(shape))


def test_mask_is_read_only_and_a_constant():
    layer = lm.Conv(2, 3, 3, mask=mask(3, 2, 3))
    with pytest.raises(AttributeError, match=r"Conv.mask is read-only"):
        layer.mask = None
    variables = jax.eval_shape(lm.transform(layer).init, jax.random.key(0))
    assert sorted(variables["params"]) == ["bias", "kernel"]  # not a variable
