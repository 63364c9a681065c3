"""Conv's and ConvTranspose's mask and input_dilation, and ConvLocal, against Flax Linen."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lamina as lm
from tests.helpers import assert_close
from tests.test_nn_conv import check_against_linen


@pytest.fixture
def normal():
    rng = np.random.default_rng(0)
    return lambda shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)


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
