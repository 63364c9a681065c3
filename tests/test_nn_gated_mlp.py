"""GatedMLP against transformers' LlamaMLP and GemmaMLP given the same weights; errors."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from transformers.models.gemma.modeling_gemma import GemmaMLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

IN, HIDDEN = 8, 24


def hf_mlp(kind, bias=False):
    """A transformers MLP with every weight (and bias) random."""
    torch.manual_seed(0)
    if kind == "gemma":
        module = GemmaMLP(
            transformers.GemmaConfig(
                hidden_size=IN,
                intermediate_size=HIDDEN,
                hidden_act="gelu_pytorch_tanh",
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=4,
            )
        )
    else:
        act = {"llama": "silu", "llama_gelu": "gelu"}[kind]
        module = LlamaMLP(
            transformers.LlamaConfig(
                hidden_size=IN,
                intermediate_size=HIDDEN,
                hidden_act=act,
                mlp_bias=bias,
                num_attention_heads=2,
                num_key_value_heads=2,
            )
        )
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module


def lamina_variables(module):
    params = {}
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        linear = getattr(module, theirs)
        params[ours] = {"kernel": jnp.asarray(linear.weight.detach().numpy().T)}
        if linear.bias is not None:
            params[ours]["bias"] = jnp.asarray(linear.bias.detach().numpy())
    return {"params": params}


ACTIVATION = {"llama": "silu", "gemma": "gelu_tanh", "llama_gelu": "gelu"}


@pytest.mark.parametrize(
    "kind, bias", [("llama", False), ("llama", True), ("gemma", False), ("llama_gelu", True)]
)
def test_matches_transformers(kind, bias):
    module = hf_mlp(kind, bias)
    x = np.random.default_rng(0).standard_normal((2, 5, IN)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    mlp = lm.GatedMLP(IN, HIDDEN, activation=ACTIVATION[kind], use_bias=bias)
    init, apply = lm.transform(mlp)
    variables = lamina_variables(module)
    assert jax.tree.map(jnp.shape, init(jax.random.key(0))) == jax.tree.map(jnp.shape, variables)
    ours, _ = apply(variables, None, jnp.asarray(x))
    assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    jitted, _ = jax.jit(apply)(variables, None, jnp.asarray(x))
    assert_close(jitted, ours, rtol=1e-6, atol=1e-6)


def test_activations_differ_so_the_names_matter():
    module = hf_mlp("llama")
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, IN)), jnp.float32)
    variables = lamina_variables(module)
    outs = [
        lm.transform(lm.GatedMLP(IN, HIDDEN, activation=a))[1](variables, None, x)[0]
        for a in ("silu", "gelu_tanh", "gelu")
    ]
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2], atol=1e-6)
    # a function is accepted too
    custom = lm.GatedMLP(IN, HIDDEN, activation=jax.nn.silu)
    np.testing.assert_array_equal(lm.transform(custom)[1](variables, None, x)[0], outs[0])


@pytest.mark.parametrize("kind", ["llama", "gemma", "llama_gelu"])
def test_bfloat16_equals_transformers_bit_for_bit(kind):
    """PyTorch computes silu/gelu of bfloat16 in float32 and rounds once; so does lamina."""
    module = hf_mlp(kind).to(torch.bfloat16)
    x = np.random.default_rng(2).standard_normal((2, 5, IN)).astype(np.float32)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    with torch.no_grad():
        expected = module(xt).float().numpy()
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), lamina_variables(module.float()))
    mlp = lm.GatedMLP(IN, HIDDEN, activation=ACTIVATION[kind], dtype=None, param_dtype=jnp.bfloat16)
    xb = jnp.asarray(xt.float().numpy(), jnp.bfloat16)
    ours, _ = lm.transform(mlp)[1](variables, None, xb)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), expected)
    jitted, _ = jax.jit(lm.transform(mlp)[1])(variables, None, xb)
    np.testing.assert_array_equal(np.asarray(jitted, np.float32), expected)


@pytest.mark.parametrize(
    "name, hf_name, low",
    [("silu", "silu", -8.0), ("gelu_tanh", "gelu_pytorch_tanh", -3.5), ("gelu", "gelu", -3.0)],
)
def test_named_activation_rounds_once_in_bfloat16(name, hf_name, low):
    """The gate's activation alone (identity projections): PyTorch's, not jax.nn's in bf16.

    The GELUs from `low` up: further down XLA's float32 erf/tanh near -1 are not PyTorch's,
    so values below 3e-3 in magnitude may differ in their last bits (see GatedMLP's docs).
    """
    n = 512
    gate = jnp.linspace(low, 8.0, n, dtype=jnp.float32).astype(jnp.bfloat16)
    eye = jnp.eye(n, dtype=jnp.bfloat16)
    variables = {
        "params": {
            "gate": {"kernel": eye * gate[None, :]},
            "up": {"kernel": eye},
            "down": {"kernel": eye},
        }
    }
    mlp = lm.GatedMLP(n, n, activation=name, dtype=None, param_dtype=jnp.bfloat16)
    ours, _ = lm.transform(mlp)[1](variables, None, jnp.ones((1, n), jnp.bfloat16))
    act = transformers.activations.ACT2FN[hf_name]
    expected = act(torch.from_numpy(np.asarray(gate, np.float32)).bfloat16()).float().numpy()
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32), expected)
    naive = ACTIVATION_FUNCTIONS[name](gate)  # intermediates rounded to bfloat16
    assert not np.array_equal(np.asarray(naive, np.float32), expected)


ACTIVATION_FUNCTIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True),
    "gelu": lambda g: jax.nn.gelu(g, approximate=False),
}


@pytest.mark.parametrize(
    "alias, name, hf_act",
    [
        ("swish", "silu", "swish"),
        ("gelu_pytorch_tanh", "gelu_tanh", "gelu_pytorch_tanh"),
        ("gelu_new", "gelu_tanh", "gelu_new"),
    ],
)
def test_transformers_activation_names_are_aliases(alias, name, hf_act):
    mlp = lm.GatedMLP(IN, HIDDEN, activation=alias)
    assert mlp.activation == name
    module = LlamaMLP(
        transformers.LlamaConfig(
            hidden_size=IN,
            intermediate_size=HIDDEN,
            hidden_act=hf_act,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    x = np.random.default_rng(3).standard_normal((4, IN)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    ours, _ = lm.transform(mlp)[1](lamina_variables(module), None, jnp.asarray(x))
    assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_kernel_sharding_names_and_stack():
    mlp = lm.GatedMLP(IN, HIDDEN, use_bias=True, kernel_sharding=("embed", "mlp"))
    assert mlp.gate.kernel.sharding == ("embed", "mlp") == mlp.up.kernel.sharding
    assert mlp.down.kernel.sharding == ("mlp", "embed")
    assert mlp.gate.bias.sharding == ("mlp",) and mlp.down.bias.sharding == ("embed",)
    assert lm.GatedMLP(IN, HIDDEN).gate.kernel.sharding is None
    stack = lm.Stack(lm.GatedMLP(IN, HIDDEN), 3)
    variables = lm.transform(stack)[0](jax.random.key(0))
    assert variables["params"]["block"]["down"]["kernel"].shape == (3, HIDDEN, IN)


def test_pickles_and_keeps_its_settings():
    mlp = lm.GatedMLP(IN, HIDDEN, activation="gelu_tanh")
    again = pickle.loads(pickle.dumps(mlp))
    assert again.activation == "gelu_tanh" and again.hidden_size == HIDDEN
    with pytest.raises(AttributeError, match="activation"):
        mlp.activation = "silu"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"activation": "gelu_fast"},
            ValueError,
            r"GatedMLP: activation must be one of 'silu', 'gelu_tanh', 'gelu' \(or "
            r"transformers' aliases 'swish', 'gelu_pytorch_tanh', 'gelu_new'\).*got 'gelu_fast'",
        ),
        ({"activation": 3}, TypeError, r"GatedMLP: activation must be a function"),
        ({"use_bias": "no"}, TypeError, r"GatedMLP: use_bias must be True or False"),
        ({"kernel_sharding": ("embed",)}, ValueError, r"kernel_sharding"),
        ({"dtype": jnp.int32}, TypeError, r"dtype must be a floating"),
    ],
)
def test_setting_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        lm.GatedMLP(IN, HIDDEN, **kwargs)


def test_size_errors():
    with pytest.raises(ValueError, match=r"GatedMLP: hidden_size must be a positive int"):
        lm.GatedMLP(IN, 0)
    with pytest.raises(TypeError, match=r"GatedMLP: in_size must be a positive int"):
        lm.GatedMLP(8.0, HIDDEN)


def test_call_errors():
    apply = lm.transform(lm.GatedMLP(IN, HIDDEN))[1]
    variables = lm.transform(lm.GatedMLP(IN, HIDDEN))[0](jax.random.key(0))
    with pytest.raises(ValueError, match=r"GatedMLP\(in_size=8, hidden_size=24\)"):
        apply(variables, None, jnp.ones((2, IN + 1)))
    bad = lm.GatedMLP(IN, HIDDEN, activation=lambda g: g.sum(-1))
    with pytest.raises(TypeError, match=r"must keep the shape and dtype"):
        lm.transform(bad)[1](variables, None, jnp.ones((2, IN)))
