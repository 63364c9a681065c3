"""`lm.from_torch` / `lm.to_torch` against real PyTorch: same weights, same outputs.

Every converted layer kind runs in PyTorch with random weights and in lamina with the
converted ones (inputs transposed NCHW -> NHWC here, in the test); round trips are exact; every
error a user can cause is checked by its message.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm

torch = pytest.importorskip("torch")
nn = torch.nn
torch.set_num_threads(1)

ATOL = 2e-5  # float32: the two libraries sum in different orders


def run(model, variables, *args, **kwargs):
    """Applies a lamina model; returns the output as NumPy."""
    out, _ = lm.transform(model).apply(variables, None, *args, **kwargs)
    return np.asarray(out)


def run_torch(module, *args, **kwargs):
    """Runs a torch module; returns its output (the first one of a tuple) as NumPy."""
    with torch.no_grad():
        out = module(*args, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).numpy()


def randomize(module, seed=0):
    """Random values for every parameter and buffer (biases and running stats included)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        for name, b in module.named_buffers():
            if name.endswith("running_var"):
                b.copy_(torch.rand_like(b) + 0.5)
            elif name.endswith("running_mean"):
                b.copy_(torch.randn_like(b))
    return module.eval()


def channels_last(x):
    """NC... -> N...C, as NumPy."""
    return np.moveaxis(x.numpy() if hasattr(x, "numpy") else x, 1, -1)


def assert_close(lamina_out, torch_out, atol=ATOL):
    np.testing.assert_allclose(lamina_out, torch_out, atol=atol, rtol=1e-5)


def assert_same(tree_a, tree_b):
    """Two variables dicts with the same paths and bit-identical arrays."""
    flat_a = jax.tree_util.tree_leaves_with_path(tree_a)
    flat_b = jax.tree_util.tree_leaves_with_path(tree_b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, a), (_, b) in zip(flat_a, flat_b, strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path


# --- layer by layer -----------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_dense_from_linear(bias):
    linear = randomize(nn.Linear(5, 3, bias=bias))
    model = lm.Dense(5, 3, use_bias=bias)
    variables = lm.from_torch(model, linear.state_dict())
    x = torch.randn(2, 4, 5)
    assert_close(run(model, variables, x.numpy()), run_torch(linear, x))


def test_embed_from_embedding():
    embedding = randomize(nn.Embedding(7, 3))
    model = lm.Embed(7, 3)
    ids = np.array([[0, 6, 2], [1, 1, 5]])
    expected = run_torch(embedding, torch.from_numpy(ids))
    assert_close(run(model, lm.from_torch(model, embedding.state_dict()), ids), expected)


CONVS = [
    # (torch class, lamina kernel_size, torch options)
    (nn.Conv1d, (3,), {"stride": 2, "padding": 1}),
    (nn.Conv2d, (3, 2), {"stride": (1, 2), "padding": (1, 0), "dilation": (2, 1)}),
    (nn.Conv2d, (3, 3), {"groups": 2, "padding": 1}),
    (nn.Conv3d, (2, 2, 2), {"bias": False}),
]


@pytest.mark.parametrize(("cls", "window", "options"), CONVS)
def test_conv_from_torch_conv(cls, window, options):
    conv = randomize(cls(4, 6, window, **options))
    n = len(window)
    per_axis = lambda v: v if isinstance(v, tuple) else (v,) * n  # noqa: E731
    padding = [(p, p) for p in per_axis(options.get("padding", 0))]
    model = lm.Conv(
        4,
        6,
        window,
        strides=per_axis(options.get("stride", 1)),
        padding=padding,
        dilation=per_axis(options.get("dilation", 1)),
        groups=options.get("groups", 1),
        use_bias=options.get("bias", True),
    )
    variables = lm.from_torch(model, conv.state_dict())
    x = torch.randn(2, 4, *[7] * n)
    assert_close(run(model, variables, channels_last(x)), channels_last(run_torch(conv, x)))


CONV_TRANSPOSES = [
    (nn.ConvTranspose1d, (3,), {"stride": 2, "padding": 1, "output_padding": 1}),
    (nn.ConvTranspose2d, (3, 2), {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2)}),
    (nn.ConvTranspose2d, (4, 4), {"stride": 2, "padding": 1, "bias": False}),
]


@pytest.mark.parametrize("transpose_kernel", [False, True])
@pytest.mark.parametrize(("cls", "window", "options"), CONV_TRANSPOSES)
def test_conv_transpose_from_torch(cls, window, options, transpose_kernel):
    conv = randomize(cls(4, 3, window, **options))
    n = len(window)
    per_axis = lambda v: v if isinstance(v, tuple) else (v,) * n  # noqa: E731
    dilation, padding = per_axis(options.get("dilation", 1)), per_axis(options.get("padding", 0))
    extra = per_axis(options.get("output_padding", 0))
    # PyTorch's padding p trims p from each side of the full output: lax pads the
    # stride-dilated input by dilation * (kernel - 1) - p (output_padding on the high side).
    pads = [
        (d * (k - 1) - p, d * (k - 1) - p + e)
        for d, k, p, e in zip(dilation, window, padding, extra, strict=True)
    ]
    model = lm.ConvTranspose(
        4,
        3,
        window,
        strides=per_axis(options.get("stride", 1)),
        padding=pads,
        dilation=dilation,
        use_bias=options.get("bias", True),
        transpose_kernel=transpose_kernel,
    )
    variables = lm.from_torch(model, conv.state_dict())
    x = torch.randn(2, 4, *[5] * n)
    assert_close(run(model, variables, channels_last(x)), channels_last(run_torch(conv, x)))
    assert_same(lm.from_torch(model, lm.to_torch(model, variables)), variables)


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d])
def test_batch_norm_eval_and_train(cls):
    bn = randomize(cls(3, momentum=0.1))
    model = lm.BatchNorm(3, momentum=0.9, epsilon=1e-5)
    variables = lm.from_torch(model, bn.state_dict())
    x = torch.randn(4, 3, 5, 5) if cls is nn.BatchNorm2d else torch.randn(6, 3)
    x_last = channels_last(x)
    # eval: the running statistics
    assert_close(run(model, variables, x_last, False), channels_last(run_torch(bn, x)))
    # train: the batch's statistics, and the same running mean (PyTorch's momentum 0.1 is
    # lamina's 0.9); PyTorch's running variance uses the unbiased batch variance.
    y, new = lm.transform(model).apply(variables, None, x_last, True)
    bn.train()
    assert_close(np.asarray(y), channels_last(run_torch(bn, x)))
    assert_close(np.asarray(new["batch_stats"]["mean"]), bn.running_mean.numpy())
    # PyTorch updated its buffers in place; the converted variables share no memory with them
    assert not np.array_equal(variables["batch_stats"]["mean"], bn.running_mean.numpy())
    count = x.numel() // 3
    unbiased = np.asarray(new["batch_stats"]["var"]) - 0.9 * np.asarray(
        variables["batch_stats"]["var"]
    )
    expected = bn.running_var.numpy() - 0.9 * np.asarray(variables["batch_stats"]["var"])
    assert_close(unbiased * count / (count - 1), expected)


def test_layer_norm_group_norm_rms_norm_instance_norm():
    x = torch.randn(2, 4, 3, 6)
    cases = [
        (nn.LayerNorm(6), lm.LayerNorm(6, epsilon=1e-5), x, lambda a: a),
        (
            nn.LayerNorm((3, 6)),
            lm.LayerNorm((3, 6), epsilon=1e-5, reduction_axes=(-2, -1), feature_axes=(-2, -1)),
            x,
            lambda a: a,
        ),
        (nn.LayerNorm(6, bias=False), lm.LayerNorm(6, epsilon=1e-5, use_bias=False), x, None),
        (nn.RMSNorm(6, eps=1e-6), lm.RMSNorm(6, epsilon=1e-6), x, None),
        (nn.GroupNorm(2, 4), lm.GroupNorm(2, 4, epsilon=1e-5), x, channels_last),
        (nn.InstanceNorm2d(4, affine=True), lm.InstanceNorm(4, epsilon=1e-5), x, channels_last),
    ]
    for module, model, inputs, layout in cases:
        layout = layout or (lambda a: a)
        randomize(module)
        variables = lm.from_torch(model, module.state_dict())
        expected = run_torch(module, inputs)
        got = run(model, variables, layout(inputs.numpy()))
        assert_close(got, layout(expected))


def mha_pair(embed, heads, kdim=None, vdim=None, bias=True):
    torch_mha = randomize(
        nn.MultiheadAttention(embed, heads, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    )
    model = lm.MultiHeadAttention(heads, embed, key_size=kdim, value_size=vdim, use_bias=bias)
    return torch_mha, model, lm.from_torch(model, torch_mha.state_dict())


def test_multi_head_attention_with_causal_and_padding_masks():
    torch_mha, model, variables = mha_pair(8, 2)
    x = torch.randn(3, 5, 8)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # True: masked
    expected = run_torch(torch_mha, x, x, x, attn_mask=causal, need_weights=False)
    assert_close(run(model, variables, x.numpy(), causal=True), expected)
    # a key padding mask (True: padding in PyTorch; lamina's masks keep True entries)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    expected = run_torch(torch_mha, x, x, x, key_padding_mask=padding, need_weights=False)
    keep = ~padding.numpy()[:, None, None, :]
    assert_close(run(model, variables, x.numpy(), mask=jnp.asarray(keep)), expected)


def test_multi_head_attention_cross_sizes_and_no_bias():
    torch_mha, model, variables = mha_pair(8, 4, kdim=6, vdim=5, bias=False)
    assert "q_proj_weight" in torch_mha.state_dict()
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 5)
    expected = run_torch(torch_mha, q, k, v, need_weights=False)
    assert_close(run(model, variables, q.numpy(), k.numpy(), v.numpy()), expected)
    assert_same(lm.from_torch(model, lm.to_torch(model, variables)), variables)


def lamina_rnn(kind, size, hidden):
    cell = lm.LSTMCell(size, hidden) if kind == "LSTM" else lm.GRUCell(size, hidden)
    return lm.RNN(cell)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_lstm_and_gru_sequences(kind):
    torch_rnn = randomize(getattr(nn, kind)(3, 4, batch_first=True))
    model = lamina_rnn(kind, 3, 4)
    variables = lm.from_torch(model, torch_rnn.state_dict())
    x = torch.randn(2, 6, 3)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_rnn, x))


def test_optimized_lstm_cell_reads_the_same_weights():
    torch_rnn = randomize(nn.LSTM(3, 4, batch_first=True))
    model = lm.RNN(lm.OptimizedLSTMCell(3, 4))
    variables = lm.from_torch(model, torch_rnn.state_dict())
    x = torch.randn(2, 5, 3)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_rnn, x))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_bidirectional_multi_layer_rnn(kind):
    torch_rnn = randomize(
        getattr(nn, kind)(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    )
    model = lm.Sequential(
        lm.Bidirectional(lamina_rnn(kind, 3, 4), lamina_rnn(kind, 3, 4)),
        lm.Bidirectional(lamina_rnn(kind, 8, 4), lamina_rnn(kind, 8, 4)),
    )
    variables = lm.from_torch(model, torch_rnn.state_dict())
    x = torch.randn(2, 5, 3)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_rnn, x))


def test_multi_layer_lstm_is_a_sequential_of_rnns():
    torch_rnn = randomize(nn.LSTM(3, 4, num_layers=3, batch_first=True))
    model = lm.Sequential(*(lamina_rnn("LSTM", s, 4) for s in (3, 4, 4)))
    variables = lm.from_torch(model, torch_rnn.state_dict())
    x = torch.randn(2, 5, 3)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_rnn, x))
    exported = lm.to_torch(model, variables)
    assert sorted(exported) == sorted(torch_rnn.state_dict())


# --- whole models -------------------------------------------------------------------------


class TorchCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        return self.classifier(self.features(x).mean(dim=(2, 3)))


class LaminaCnn(lm.Module):
    def __init__(self):
        super().__init__()
        self.features = lm.Sequential(
            lm.Conv(1, 4, (3, 3), padding=1), lm.BatchNorm(4, epsilon=1e-5)
        )
        self.classifier = lm.Dense(4, 3)

    def __call__(self, x, is_training=False):
        x = self.features.layers_0(x)
        x = lm.relu(self.features.layers_1(x, is_training))
        x = lm.max_pool(x, (2, 2), strides=(2, 2))
        return self.classifier(x.mean(axis=(1, 2)))


def test_small_cnn_end_to_end():
    torch_cnn = randomize(TorchCnn())
    model = LaminaCnn()
    variables = lm.from_torch(model, torch_cnn.state_dict())
    x = torch.randn(2, 1, 8, 8)
    assert_close(run(model, variables, channels_last(x)), run_torch(torch_cnn, x))
    # exported back, PyTorch loads it (num_batches_tracked is its own) and computes the same
    fresh = TorchCnn().eval()
    fresh.load_state_dict(lm.to_torch(model, variables), strict=True)
    assert_close(run_torch(fresh, x), run_torch(torch_cnn, x), atol=0)


def test_mlp_end_to_end():
    torch_mlp = randomize(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)))
    model = lm.Sequential(lm.Dense(5, 8), lm.tanh, lm.Dense(8, 2))
    variables = lm.from_torch(model, torch_mlp.state_dict())
    x = torch.randn(4, 5)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_mlp, x))


# --- round trips --------------------------------------------------------------------------


class Everything(lm.Module):
    """One of each converted layer."""

    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 4)
        self.embed = lm.Embed(5, 4)
        self.conv = lm.Conv(2, 4, (3, 3), groups=2)
        self.deconv = lm.ConvTranspose(4, 2, (2,))
        self.bn = lm.BatchNorm(4)
        self.ln = lm.LayerNorm(4)
        self.gn = lm.GroupNorm(2, 4)
        self.attention = lm.MultiHeadAttention(2, 4)
        self.lstm = lm.RNN(lm.LSTMCell(4, 3))
        self.gru = lm.Bidirectional(lm.RNN(lm.GRUCell(4, 3)), lm.RNN(lm.GRUCell(4, 3)))


def random_variables(model, seed=0):
    """Random values of every variable (nothing trivially zero or one), without compiling init."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes)


def test_round_trip_lamina_torch_lamina_is_exact():
    model = Everything()
    variables = random_variables(model)
    state_dict = lm.to_torch(model, variables)
    assert all(isinstance(t, torch.Tensor) for t in state_dict.values())
    assert_same(lm.from_torch(model, state_dict), variables)


def test_round_trip_torch_lamina_torch_is_exact_but_for_rnn_biases():
    torch_model = nn.ModuleDict(
        {
            "fc": nn.Linear(3, 4),
            "bn": nn.BatchNorm1d(4),
            "attention": nn.MultiheadAttention(4, 2),
            "lstm": nn.LSTM(4, 3),
            "gru": nn.GRU(4, 3, bidirectional=True),
        }
    )
    randomize(torch_model)
    model = lm.Module()
    model.fc, model.bn = lm.Dense(3, 4), lm.BatchNorm(4)
    model.attention, model.lstm = lm.MultiHeadAttention(2, 4), lm.RNN(lm.LSTMCell(4, 3))
    model.gru = lm.Bidirectional(lm.RNN(lm.GRUCell(4, 3)), lm.RNN(lm.GRUCell(4, 3)))
    original = torch_model.state_dict()
    back = lm.to_torch(model, lm.from_torch(model, original))
    assert set(back) == set(original) - {"bn.num_batches_tracked"}
    combined = {k for k in back if k.startswith(("lstm.bias", "gru.bias"))}
    for name in set(back) - combined:
        assert torch.equal(back[name], original[name]), name
    h = 3
    # LSTM: bias_ih + bias_hh in bias_hh, zeros in bias_ih
    assert torch.equal(back["lstm.bias_ih_l0"], torch.zeros(4 * h))
    summed = original["lstm.bias_ih_l0"].numpy() + original["lstm.bias_hh_l0"].numpy()
    assert np.array_equal(back["lstm.bias_hh_l0"].numpy(), summed)
    # GRU: r and z summed into bias_hh; n's two biases stay apart (r gates bias_hh's)
    for suffix in ("_l0", "_l0_reverse"):
        b_ih, b_hh = original[f"gru.bias_ih{suffix}"], original[f"gru.bias_hh{suffix}"]
        new_ih, new_hh = back[f"gru.bias_ih{suffix}"], back[f"gru.bias_hh{suffix}"]
        assert torch.equal(new_ih[: 2 * h], torch.zeros(2 * h))
        assert torch.equal(new_ih[2 * h :], b_ih[2 * h :])
        assert np.array_equal(new_hh[: 2 * h].numpy(), (b_ih[: 2 * h] + b_hh[: 2 * h]).numpy())
        assert torch.equal(new_hh[2 * h :], b_hh[2 * h :])
    # and the exported RNNs compute what the original ones do
    x = torch.randn(5, 2, 4)
    reloaded = nn.GRU(4, 3, bidirectional=True).eval()
    reloaded.load_state_dict({k[4:]: v for k, v in back.items() if k.startswith("gru.")})
    assert_close(run_torch(reloaded, x), run_torch(torch_model["gru"], x))


def test_bfloat16_and_numpy_state_dicts():
    linear = randomize(nn.Linear(4, 2)).to(torch.bfloat16)
    model = lm.Dense(4, 2, dtype=jnp.bfloat16)
    variables = lm.from_torch(model, linear.state_dict())
    kernel = variables["params"]["kernel"]
    assert kernel.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(kernel, np.float32), linear.weight.detach().float().numpy().T)
    back = lm.to_torch(model, variables)
    assert back["weight"].dtype == torch.bfloat16 and torch.equal(back["weight"], linear.weight)
    # NumPy arrays work as well as tensors, and float64 is stored in the model's float32
    numpy_dict = {"weight": np.ones((2, 4)), "bias": np.zeros(2)}
    stored = lm.from_torch(lm.Dense(4, 2), numpy_dict)["params"]["kernel"]
    assert stored.dtype == jnp.float32 and stored.shape == (4, 2)


def test_decoding_cache_starts_empty():
    torch_mha = randomize(nn.MultiheadAttention(4, 2, batch_first=True))
    model = lm.MultiHeadAttention(2, 4, decode_shape=(1, 3))
    variables = lm.from_torch(model, torch_mha.state_dict())
    assert int(variables["cache"]["cache_index"]) == 0
    assert not np.any(np.asarray(variables["cache"]["cached_key"]))
    assert "cached_key" not in str(list(lm.to_torch(model, variables)))
    no_cache = {"params": variables["params"]}
    assert sorted(lm.to_torch(model, no_cache)) == sorted(torch_mha.state_dict())


def test_lamina_imports_without_torch():
    code = (
        "import sys, numpy as np, lamina as lm\n"
        "lm.from_torch(lm.Dense(2, 1), {'weight': np.ones((1, 2)), 'bias': np.ones(1)})\n"
        "assert 'torch' not in sys.modules, 'lamina imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- the hook: rename and register_torch --------------------------------------------------


class Layers(lm.Module):
    """A list of layers applied in turn: paths layers/0, layers/1, ..."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_rename_prefix_mapping_and_function():
    torch_model = randomize(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    wrapped = {f"backbone.{k}": v for k, v in torch_model.state_dict().items()}
    wrapped["head.extra"] = torch.zeros(1)
    model = Layers([lm.Dense(3, 4), lm.Dense(4, 2)])
    by_prefix = lm.from_torch(model, wrapped, rename={"backbone.": "layers.", "head.": None})
    by_function = lm.from_torch(
        model,
        wrapped,
        rename=lambda k: None if k.startswith("head.") else k.replace("backbone", "layers"),
    )
    assert_same(by_prefix, by_function)
    x = torch.randn(2, 3)
    assert_close(run(model, by_prefix, x.numpy()), run_torch(torch_model, x))
    # to_torch applies the prefix dict backwards
    back = lm.to_torch(model, by_prefix, rename={"backbone.": "layers.", "head.": None})
    assert sorted(back) == sorted(k for k in wrapped if k.startswith("backbone."))
    back = lm.to_torch(model, by_prefix, rename=lambda k: "net." + k)
    assert sorted(back) == [
        "net.layers.0.bias",
        "net.layers.0.weight",
        "net.layers.1.bias",
        "net.layers.1.weight",
    ]


class Scale(lm.Module):
    """A layer of its own: y = x * w + b, PyTorch's parameters named gamma and beta."""

    def __init__(self, size):
        super().__init__()
        self.w = lm.Parameter((size,), lm.initializers.ones())
        self.b = lm.Parameter((size,), lm.initializers.zeros())

    def __call__(self, x):
        return x * self.w + self.b


class LinearWithInOutWeight(lm.Dense):
    """A Dense whose PyTorch module stores (in, out), as Hugging Face's Conv1D does."""


def test_register_torch_for_a_new_layer_and_for_a_subclass():
    lm.register_torch(
        Scale,
        lambda layer, t: {"w": t["gamma"], "b": t["beta"]},
        lambda layer, v: {"gamma": v["w"], "beta": v["b"]},
    )
    lm.register_torch(
        LinearWithInOutWeight,
        lambda layer, t: {"kernel": t["weight"], "bias": t["bias"]},
        lambda layer, v: {"weight": v["kernel"], "bias": v["bias"]},
    )
    model = lm.Module()
    model.scale, model.proj, model.plain = Scale(3), LinearWithInOutWeight(3, 2), lm.Dense(2, 2)
    state_dict = {
        "scale.gamma": np.arange(3.0),
        "scale.beta": np.ones(3),
        "proj.weight": np.arange(6.0).reshape(3, 2),  # (in, out): not transposed
        "proj.bias": np.zeros(2),
        "plain.weight": np.arange(4.0).reshape(2, 2),  # (out, in): the Dense converter
        "plain.bias": np.zeros(2),
    }
    variables = lm.from_torch(model, state_dict)
    assert np.array_equal(variables["params"]["proj"]["kernel"], state_dict["proj.weight"])
    assert np.array_equal(variables["params"]["plain"]["kernel"], state_dict["plain.weight"].T)
    assert np.array_equal(variables["params"]["scale"]["w"], np.arange(3.0))
    back = lm.to_torch(model, variables)
    for name, array in state_dict.items():
        assert np.array_equal(back[name].numpy(), array), name


# --- errors -------------------------------------------------------------------------------


def test_missing_and_unused_names_are_one_error():
    model = lm.Sequential(lm.Dense(3, 4), lm.Dense(4, 2))
    state_dict = {
        "0.weight": np.ones((4, 3)),  # 0.bias is missing
        "1.weight": np.ones((2, 4)),
        "1.bias": np.ones(2),
        "2.weight": np.ones((2, 2)),  # no such layer
    }
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)missing.*0\.bias \(for layers_0 \(Dense\)\).*"
        r"unused state dict entries \(1\): 2\.weight.*rename=",
    ):
        lm.from_torch(model, state_dict)
    # not strict: what matches, nothing else
    partial = lm.from_torch(model, state_dict, strict=False)
    assert list(partial["params"]) == ["layers_1"]


def test_unfilled_variables_are_listed():
    model = lm.Module()
    model.a, model.b = lm.Dense(2, 2), lm.LayerNorm(2)
    state_dict = {"a.weight": np.ones((2, 2)), "a.bias": np.ones(2)}
    with pytest.raises(lm.VariablesError, match=r"missing from the state dict \(1\): b\.weight"):
        lm.from_torch(model, state_dict)


def test_wrong_shape_names_both_sides_and_the_layout():
    model = lm.Module()
    model.encoder = lm.Dense(3, 4)
    state_dict = {"encoder.weight": np.ones((3, 4)), "encoder.bias": np.ones(4)}
    with pytest.raises(
        lm.VariablesError,
        match=r"torch 'encoder.weight' has shape \(3, 4\), but the lamina layer encoder \(Dense\) "
        r"needs a Linear weight \(out_features, in_features\) = \(4, 3\)",
    ):
        lm.from_torch(model, state_dict)
    # not even strict=False accepts a wrong shape
    with pytest.raises(lm.VariablesError, match="wrong shape"):
        lm.from_torch(model, state_dict, strict=False)


def test_wrong_rnn_and_attention_layouts():
    gru = nn.GRU(3, 4)  # into an LSTM: 3 gates where 4 are needed
    with pytest.raises(lm.VariablesError, match=r"'weight_ih_l0' has shape \(12, 3\).*\(16, 3\)"):
        lm.from_torch(lm.RNN(lm.LSTMCell(3, 4)), gru.state_dict())
    mha = nn.MultiheadAttention(8, 2)
    with pytest.raises(lm.VariablesError, match=r"in_proj_weight.*3 \* embed_dim"):
        lm.from_torch(lm.MultiHeadAttention(2, 4), mha.state_dict())


def test_a_layer_without_converter_is_an_error_naming_it():
    model = lm.Module()
    model.block = lm.Module()
    model.block.proj = lm.DenseGeneral(3, (2, 2))
    with pytest.raises(
        TypeError,
        match=r"no PyTorch converter for block/proj \(DenseGeneral, holding params/block/proj/"
        r".*register_torch\(DenseGeneral, to_lamina, to_torch\).*rename=",
    ):
        lm.from_torch(model, {})
    own = lm.Module()
    own.gain = lm.Parameter((2,), lm.initializers.ones())
    with pytest.raises(TypeError, match=r"no PyTorch converter for <root> \(Module, holding"):
        lm.to_torch(own, {"params": {"gain": jnp.ones(2)}})


def test_unsupported_cells_and_options():
    with pytest.raises(TypeError, match=r"rnn \(RNN\): it is an RNN of SimpleCell.*register_torch"):
        model = lm.Module()
        model.rnn = lm.RNN(lm.SimpleCell(2, 3))
        lm.from_torch(model, nn.RNN(2, 3).state_dict())
    model = lm.MultiHeadAttention(2, 4, normalize_qk=True)
    with pytest.raises(TypeError, match="normalize_qk=True"):
        lm.from_torch(model, nn.MultiheadAttention(4, 2).state_dict())
    variables = random_variables(model)
    with pytest.raises(TypeError, match=r"lm.to_torch cannot export 1 layer.*normalize_qk"):
        lm.to_torch(model, variables)


def test_rename_errors():
    model = lm.Dense(2, 2)
    state_dict = {"a.weight": np.ones((2, 2)), "b.weight": np.ones((2, 2))}
    with pytest.raises(ValueError, match=r"rename maps both 'a.weight' and 'b.weight' to 'weight'"):
        lm.from_torch(model, state_dict, rename={"a.": "", "b.": ""})
    with pytest.raises(TypeError, match=r"rename returned 3 for 'a.weight'"):
        lm.from_torch(model, state_dict, rename=lambda k: 3)
    with pytest.raises(TypeError, match="rename must be a function"):
        lm.from_torch(model, state_dict, rename=["a."])
    with pytest.raises(lm.VariablesError, match=r"These rename prefixes matched no name: nope\."):
        lm.from_torch(model, {"weight": np.ones((2, 2))}, rename={"nope.": ""})
    variables = random_variables(model)
    with pytest.raises(ValueError, match="rename maps both 'weight' and 'bias' to 'x'"):
        lm.to_torch(model, variables, rename=lambda k: "x")


def test_bad_state_dicts():
    model = lm.Dense(2, 2)
    with pytest.raises(TypeError, match=r"pass module.state_dict\(\)"):
        lm.from_torch(model, nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"state_dict\['weight'\] is a list"):
        lm.from_torch(model, {"weight": [[1.0, 2.0], [3.0, 4.0]], "bias": np.ones(2)})
    with pytest.raises(TypeError, match="names must be str"):
        lm.from_torch(model, {0: np.ones(2)})
    with pytest.raises(TypeError, match=r"expected an lm\.Module"):
        lm.from_torch(nn.Linear(2, 2), {})


def test_lossy_dtypes_and_bad_converters_are_refused():
    class Counter(lm.Module):
        def __init__(self):
            super().__init__()
            self.count = lm.State("counters", (2,), lm.initializers.zeros(), jnp.int32)

    lm.register_torch(
        Counter, lambda layer, t: {"count": t["n"]}, lambda layer, v: {"n": v["count"]}
    )
    with pytest.raises(lm.VariablesError, match=r"counters/count is stored as int32.*float64"):
        lm.from_torch(Counter(), {"n": np.array([1.5, 2.0])})
    assert lm.from_torch(Counter(), {"n": np.array([1, 2])})["counters"]["count"].dtype == jnp.int32

    lm.register_torch(Counter, lambda layer, t: {"cnt": t["n"]}, lambda layer, v: {"n": v["count"]})
    with pytest.raises(ValueError, match=r"returned cnt, which the layer does not declare.*count"):
        lm.from_torch(Counter(), {"n": np.array([1, 2])})
    lm.register_torch(
        Counter, lambda layer, t: {"count": t["n"][:1]}, lambda layer, v: {"n": v["count"]}
    )
    with pytest.raises(lm.VariablesError, match=r"counters/count needs shape \(2,\).*from 'n'"):
        lm.from_torch(Counter(), {"n": np.array([1, 2])})


def test_register_torch_checks_its_arguments():
    with pytest.raises(TypeError, match=r"must be a subclass of lm\.Module"):
        lm.register_torch(nn.Linear, lambda *a: {}, lambda *a: {})
    with pytest.raises(TypeError, match="to_torch must be a function"):
        lm.register_torch(Scale, lambda *a: {}, None)


def test_to_torch_checks_the_variables():
    model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
    variables = random_variables(model)
    del variables["params"]["layers_1"]
    with pytest.raises(
        lm.VariablesError,
        match=r"without 2 of Sequential's weights: "
        r"params/layers_1/bias, params/layers_1/kernel",
    ):
        lm.to_torch(model, variables)
    variables["params"]["layers_1"] = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(1)}
    with pytest.raises(lm.VariablesError, match=r"params/layers_1/kernel: expected \(3, 1\)"):
        lm.to_torch(model, variables)


class TorchResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class TorchTower(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleList([TorchResidual() for _ in range(n)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Residual(lm.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = lm.LayerNorm(4, epsilon=1e-5), lm.Dense(4, 4)

    def __call__(self, x):
        return x + self.fc(self.norm(x))


class Tower(lm.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = lm.Stack(Residual(), n)
        self.head = lm.Dense(4, 2)

    def __call__(self, x):
        return self.head(self.blocks(x))


def test_a_stack_is_a_module_list():
    torch_tower = randomize(TorchTower(3))
    model = Tower(3)
    variables = lm.from_torch(model, torch_tower.state_dict())
    assert variables["params"]["blocks"]["block"]["fc"]["kernel"].shape == (3, 4, 4)
    x = torch.randn(2, 4)
    assert_close(run(model, variables, x.numpy()), run_torch(torch_tower, x))
    back = lm.to_torch(model, variables)
    assert sorted(back) == sorted(torch_tower.state_dict())
    assert all(torch.equal(back[k], v) for k, v in torch_tower.state_dict().items())
    assert_same(lm.from_torch(model, back), variables)
    # one block short: the missing copy is named
    short = {k: v for k, v in back.items() if not k.startswith("blocks.2.fc.")}
    with pytest.raises(lm.VariablesError, match=r"missing.*blocks\.2\.fc\.weight"):
        lm.from_torch(model, short)


def test_a_stack_at_the_root_and_nested_stacks():
    weights = {
        f"{i}.{name}": np.full(shape, i, np.float32)
        for i in range(2)
        for name, shape in (("weight", (3, 2)), ("bias", (3,)))
    }
    variables = lm.from_torch(lm.Stack(lm.Dense(2, 3), 2), weights)
    assert variables["params"]["block"]["kernel"].shape == (2, 2, 3)
    assert np.array_equal(variables["params"]["block"]["bias"][:, 0], [0.0, 1.0])
    model = lm.Stack(lm.Stack(lm.Dense(2, 2), 2), 3)
    with pytest.raises(
        TypeError, match=r"Dense\) has variables stored with leading axes.*jnp\.stack"
    ):
        lm.from_torch(model, {})


def test_to_torch_refuses_a_rename_dict_it_cannot_reverse():
    class Model(lm.Module):
        def __init__(self):
            super().__init__()
            self.body = lm.Dense(3, 4)

    linear = nn.Linear(3, 4)
    rename = {"backbone.": "body.", "neck.": "body."}
    variables = lm.from_torch(
        Model(), {f"backbone.{k}": v for k, v in linear.state_dict().items()}, rename=rename
    )
    with pytest.raises(
        ValueError,
        match=r"cannot reverse rename: it maps 'backbone.', 'neck.' all to 'body.'.*Pass a "
        r"function",
    ):
        lm.to_torch(Model(), variables, rename=rename)
    exported = lm.to_torch(Model(), variables, rename={"backbone.": "body."})
    assert sorted(exported) == ["backbone.bias", "backbone.weight"]


def test_meta_tensors_are_refused_by_name():
    with torch.device("meta"):
        linear = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"state_dict\['weight'\] is a meta tensor"):
        lm.from_torch(lm.Dense(3, 2), linear.state_dict())


@pytest.mark.parametrize(
    ("torch_dtype", "dtype"),
    [
        (torch.float8_e4m3fn, jnp.float8_e4m3fn),
        (torch.float8_e5m2, jnp.float8_e5m2),
    ],
)
def test_float8_state_dicts_round_trip_bit_for_bit(torch_dtype, dtype):
    state_dict = {k: v.to(torch_dtype) for k, v in nn.Linear(3, 2).state_dict().items()}
    model = lm.Dense(3, 2, param_dtype=dtype, dtype=jnp.float32)
    variables = lm.from_torch(model, state_dict)
    assert variables["params"]["kernel"].dtype == dtype
    back = lm.to_torch(model, variables)
    for name, tensor in state_dict.items():
        assert back[name].dtype == torch_dtype
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))


def test_tied_variables_holding_nan_are_equal():
    class Tied(lm.Module):
        def __init__(self):
            super().__init__()
            self.a = lm.Dense(3, 3)
            self.b = lm.Dense(3, 3)
            self.b.kernel = self.a.kernel

    weight = torch.randn(3, 3)
    weight[0, 0] = float("nan")
    state_dict = {
        "a.weight": weight,
        "a.bias": torch.zeros(3),
        "b.weight": weight.clone(),
        "b.bias": torch.ones(3),
    }
    variables = lm.from_torch(Tied(), state_dict)
    assert np.isnan(variables["params"]["a"]["kernel"][0, 0])
    changed = dict(state_dict, **{"b.weight": torch.ones(3, 3)})
    with pytest.raises(lm.VariablesError, match="shared by two layers, which got different values"):
        lm.from_torch(Tied(), changed)


def test_non_strict_import_that_converts_nothing_is_an_error():
    state_dict = {f"module.{k}": v for k, v in nn.Linear(3, 2).state_dict().items()}
    with pytest.raises(
        lm.VariablesError,
        match=r"converted none of Dense's variables \(missing weight \(for <root> \(Dense\)\); "
        r"the state dict's names look like module.bias, module.weight, the model's variables "
        r"like params/bias\)",
    ):
        lm.from_torch(lm.Dense(3, 2), state_dict, rename={"modul.": ""}, strict=False)

    class Two(lm.Module):
        def __init__(self):
            super().__init__()
            self.a = lm.Dense(3, 2)
            self.b = lm.Dense(2, 2)

    only_a = {f"a.{k}": v for k, v in nn.Linear(3, 2).state_dict().items()}
    partial = lm.from_torch(Two(), only_a, strict=False)
    assert list(partial["params"]) == ["a"]


def test_values_a_narrower_dtype_cannot_hold_are_refused():
    big = {"weight": torch.full((2, 2), 1e6), "bias": torch.zeros(2)}
    with pytest.raises(
        lm.VariablesError,
        match=r"params/kernel is stored as float16, but .* gave float32: 4 finite value\(s\) "
        r"\(the largest 1e\+06\) are beyond float16's range",
    ):
        lm.from_torch(lm.Dense(2, 2, param_dtype=jnp.float16), big)

    class Counter(lm.Module):
        def __init__(self):
            super().__init__()
            self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32)

    lm.register_torch(
        Counter, lambda layer, t: {"count": t["n"]}, lambda layer, v: {"n": v["count"]}
    )
    with pytest.raises(lm.VariablesError, match=r"do not fit in int32 .* a cast would wrap"):
        lm.from_torch(Counter(), {"n": torch.tensor(2**40 + 5)})
    counters = lm.from_torch(Counter(), {"n": torch.tensor(7)})["counters"]  # int64, fits
    assert counters["count"].dtype == jnp.int32 and int(counters["count"]) == 7


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match=r"lm.from_torch: strict must be True or False, got int"):
        lm.from_torch(lm.Dense(3, 2), nn.Linear(3, 2).state_dict(), strict=0)


def test_two_layers_with_one_pytorch_name_are_refused():
    class Clash(lm.Module):
        def __init__(self):
            super().__init__()
            self.m = {"a": {"b": lm.Dense(2, 2)}, "a.b": lm.Dense(2, 2)}

    state_dict = {"m.a.b.weight": torch.ones(2, 2), "m.a.b.bias": torch.zeros(2)}
    match = r"lamina layers m/a/b and m/a.b would both read and write the PyTorch names 'm.a.b.\*'"
    with pytest.raises(ValueError, match=match):
        lm.from_torch(Clash(), state_dict)
    with pytest.raises(ValueError, match=match):
        lm.to_torch(Clash(), random_variables(Clash()))


def test_a_one_layer_model_lists_the_entries_it_could_not_name():
    state_dict = {f"x.{k}": v for k, v in nn.Linear(3, 2).state_dict().items()}
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)missing from the state dict \(1\): weight.*unused state dict entries \(2\): "
        r"x.weight, x.bias",
    ):
        lm.from_torch(lm.Dense(3, 2), state_dict)
    wrong_shape = {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}
    with pytest.raises(lm.VariablesError, match="wrong shape") as error:
        lm.from_torch(lm.Dense(3, 2), wrong_shape)
    assert "unused" not in str(error.value)  # the bias is the layer's, not a stray entry
