"""Flax Linen's variables drive lamina's layers as they are: same collections, paths, shapes.

Linen's variables load directly into the lamina layer, over every entry of the layer table
(`tests/layer_table/`). Each entry has either a Linen twin in `LINEN` (the same layer built
with ``flax.linen``, and how its call differs) or a reason in `NO_LINEN`;
`test_every_table_entry_says_how_it_compares` fails for an entry with neither, so a new layer
must say.

For each twin, `test_linen_variables_drive_lamina`:

1. takes the tree of variables Linen's ``init`` makes (float32; traced with
   `jax.eval_shape`, since its values are replaced) and gives every leaf a non-trivial value
   (the same tree, only the numbers change: Linen's initial scales of one and biases of zero
   would hide a swapped or ignored parameter);
2. asserts that the tree has exactly lamina's paths, shapes and dtypes (a readable diff of
   what one side has and the other lacks);
3. calls lamina's ``apply`` on that dict as it is (no renaming, no transposes) with the
   entry's inputs, and compares the outputs with Linen's, and, for the collections the call
   updates (``batch_stats`` while training), the updated values; the collections it does not
   update come back unchanged.

`DOCUMENTED_DIFFERENCES` pins, path by path, how the layouts of the `NO_LINEN` entries that
differ by design (the `SpectralNorm` and `WeightNorm` wrappers) differ.

Dropout is compared exactly, in training mode, by handing Linen the key lamina draws: a
``"dropout"`` stream of key ``K`` hands out ``fold_in(K, 0)`` first (docs/architecture.md,
"Randomness"), which Linen's ``rng=`` / ``dropout_rng=`` arguments accept. Only `Stack`'s
per-copy streams have no Linen counterpart, so that entry is compared in evaluation mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import pooling
from jax import lax

import lamina as lm
from tests.helpers import assert_close
from tests.layer_table import BY_NAME, IDS, LAYERS, LayerCase, cast_inputs
from tests.linen_helpers import randomize

DROPOUT_KEY = jax.random.key(42)
FIRST_DROPOUT_KEY = jax.random.fold_in(DROPOUT_KEY, 0)  # what lamina's first draw gets


@dataclasses.dataclass(frozen=True)
class Twin:
    """The Linen module that is a layer-table entry's layer, and how its call differs.

    Attributes:
        build: ``build(lamina_layer) -> nn.Module`` (the lamina layer is there to read
            settings such as a convolution's mask, not to copy weights).
        kwargs: Linen's keyword arguments for the call (``deterministic``, a mask...), or a
            function of the inputs that returns them.
        method: The Linen method the call runs (``"attend"``).
        mutable: The collections the call updates (compared after the call).
        lamina_kwargs: Replaces the entry's call keywords (an evaluation-mode comparison).
    """

    build: Callable[[lm.Module], nn.Module]
    kwargs: dict[str, Any] | Callable[[tuple], dict[str, Any]] = dataclasses.field(
        default_factory=dict
    )
    method: str | None = None
    mutable: tuple[str, ...] = ()
    lamina_kwargs: dict[str, Any] | None = None


def twin(build: Callable[[], nn.Module], **options: Any) -> Twin:
    """A `Twin` whose Linen module does not depend on the lamina layer's settings."""
    return Twin(lambda _: build(), **options)


class LinenFn(nn.Module):
    """Linen's side of the table's `Function` entries: ``fn(*inputs, **options)``.

    `fn` is a field, so a Linen module there is the submodule ``fn``, as lamina's `Function`
    wrapper's attribute is.
    """

    fn: Any
    options: dict

    def __call__(self, *inputs: Any) -> Any:
        return self.fn(*inputs, **self.options)


class _ScanSequential(nn.Sequential):
    """`nn.Sequential` as a scan body: ``(x, _) -> (x', None)``."""

    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return super().__call__(x), None


class LinenStack(nn.Module):
    """`lm.Stack(block, n)` in Linen: `nn.scan` with the block's variables stacked on axis 0.

    `layers` makes one block's layers, unbound (``parent=None``), so that `nn.Sequential`
    adopts and names them (``layers_<index>``, as lamina's `Sequential`).
    """

    layers: Callable[[], list]
    length: int
    remat: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block = nn.remat(_ScanSequential) if self.remat else _ScanSequential
        scanned = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.length,
        )
        y, _ = scanned(self.layers(), name="block")(x, None)
        return y


def causal_mask(inputs: tuple) -> dict[str, Any]:
    """Linen's form of lamina's ``causal=True``: a mask over the queries' positions."""
    return {"mask": nn.make_causal_mask(jnp.ones(inputs[0].shape[:-1]))}


def mha(**options: Any) -> Callable[[], nn.Module]:
    return lambda: nn.MultiHeadDotProductAttention(**options)


def rnn(cell: Callable[[], nn.Module], **options: Any) -> Callable[[], nn.Module]:
    return lambda: nn.RNN(cell(), **options)


TRAIN_DROPOUT = {"deterministic": False, "rng": FIRST_DROPOUT_KEY}

LINEN: dict[str, Twin] = {
    # linear and embeddings
    "dense": twin(lambda: nn.Dense(4)),
    "dense_nobias": twin(lambda: nn.Dense(4, use_bias=False)),
    "embed": twin(lambda: nn.Embed(10, 6)),
    "embed_attend": twin(lambda: nn.Embed(10, 6), method="attend"),
    "dense_general_batch_axes": twin(
        lambda: nn.DenseGeneral((2, 5), axis=(1, -1), batch_dims=(0,))
    ),
    "einsum_ellipsis": twin(lambda: nn.Einsum((4, 3, 2), "...d,dhk->...kh")),
    # convolutions
    "conv1d": twin(lambda: nn.Conv(4, (3,), strides=2)),
    "conv2d": twin(lambda: nn.Conv(4, (3, 3), padding="VALID")),
    "conv2d_groups_circular": twin(
        lambda: nn.Conv(6, (3, 3), padding="CIRCULAR", feature_group_count=2)
    ),
    "conv3d": twin(lambda: nn.Conv(3, (2, 2, 2), kernel_dilation=(1, 2, 1))),
    "conv_transpose2d": twin(lambda: nn.ConvTranspose(2, (3, 3), strides=(2, 2))),
    # Linen (lax) takes only explicit pairs with an input dilation; lamina's default "SAME"
    # means the pairs of the dilated (7, 5) input (tests/test_nn_conv.py)
    "conv_masked_input_dilation": Twin(
        lambda m: nn.Conv(
            4,
            (3, 2),
            input_dilation=(2, 1),
            padding=tuple(lax.padtype_to_pads((7, 5), (3, 2), (1, 1), "SAME")),
            mask=jnp.asarray(m.mask),
        )
    ),
    "conv_transpose_masked": Twin(
        lambda m: nn.ConvTranspose(2, (3,), strides=(2,), mask=jnp.asarray(m.mask))
    ),
    "conv_local_2d_masked": Twin(
        lambda m: nn.ConvLocal(3, (2, 2), padding="VALID", mask=jnp.asarray(m.mask))
    ),
    # normalisation
    "batch_norm_train": twin(
        lambda: nn.BatchNorm(momentum=0.9),
        kwargs={"use_running_average": False},
        mutable=("batch_stats",),
    ),
    "batch_norm_eval": twin(nn.BatchNorm, kwargs={"use_running_average": True}),
    "batch_norm_two_axes_mask_two_pass": Twin(
        lambda m: LinenFn(
            nn.BatchNorm(axis=(1, 2), momentum=0.9, use_fast_variance=False),
            {"use_running_average": False, "mask": m.options["mask"]},
        ),
        mutable=("batch_stats",),
    ),
    "layer_norm": twin(nn.LayerNorm),
    "layer_norm_two_axes_mask": Twin(
        lambda m: LinenFn(
            nn.LayerNorm(reduction_axes=(1, 2), feature_axes=(-2, -1)),
            {"mask": m.options["mask"]},
        )
    ),
    "rms_norm": twin(nn.RMSNorm),
    "group_norm": twin(lambda: nn.GroupNorm(num_groups=2)),
    "group_norm_group_size_two_pass": twin(
        lambda: nn.GroupNorm(num_groups=None, group_size=3, use_fast_variance=False)
    ),
    "instance_norm": twin(nn.InstanceNorm),
    # dropout: exact, in training mode, given lamina's key
    "dropout": twin(lambda: nn.Dropout(0.3), kwargs=TRAIN_DROPOUT),
    "dropout_function": twin(lambda: LinenFn(nn.Dropout(0.5, broadcast_dims=(0,)), TRAIN_DROPOUT)),
    # attention
    "attention_self": twin(mha(num_heads=2, qkv_features=8)),
    "attention_cross_causal": twin(
        mha(num_heads=2, qkv_features=4, out_features=3), kwargs=causal_mask
    ),
    "attention_dropout": twin(
        mha(num_heads=2, dropout_rate=0.5),
        kwargs={"deterministic": False, "dropout_rng": FIRST_DROPOUT_KEY},
    ),
    "attention_normalize_qk": twin(
        mha(num_heads=2, qkv_features=8, normalize_qk=True),
        # sow_weights records only into a requested "intermediates" collection, on both sides
        kwargs=lambda inputs: {**causal_mask(inputs), "sow_weights": True},
    ),
    "dot_product_attention": twin(lambda: LinenFn(nn.dot_product_attention, {})),
    "dot_product_attention_weights": twin(lambda: LinenFn(nn.dot_product_attention_weights, {})),
    # pooling (functions, no variables: the outputs are compared)
    "max_pool": twin(lambda: LinenFn(nn.max_pool, {"window_shape": (2, 2), "strides": (2, 2)})),
    "min_pool_int_window": twin(
        lambda: LinenFn(pooling.min_pool, {"window_shape": (3,), "padding": "SAME"})
    ),
    "avg_pool": twin(
        lambda: LinenFn(
            nn.avg_pool, {"window_shape": (3, 3), "padding": "SAME", "count_include_pad": False}
        )
    ),
    "pool_sum_padded": twin(
        lambda: LinenFn(
            nn.pool,
            {
                "init": 0.0,
                "reduce_fn": lax.add,
                "window_shape": (2, 2),
                "strides": None,
                "padding": ((1, 0), (0, 1)),
            },
        )
    ),
    # recurrent cells: the same (carry, inputs) -> (carry, outputs), LSTM carries (c, h)
    "lstm_cell": twin(lambda: nn.LSTMCell(4)),
    "optimized_lstm_cell": twin(lambda: nn.OptimizedLSTMCell(4)),
    "gru_cell": twin(lambda: nn.GRUCell(4)),
    "mgu_cell": twin(lambda: nn.MGUCell(4)),
    "simple_cell_residual": twin(lambda: nn.SimpleCell(4, residual=True)),
    # RNN and Bidirectional (the initial carry is zeros on both sides)
    "rnn_mgu": twin(rnn(lambda: nn.MGUCell(4, reset_gate=False))),
    "rnn_simple": twin(rnn(lambda: nn.SimpleCell(4))),
    "rnn_lstm": twin(rnn(lambda: nn.LSTMCell(4))),
    "rnn_gru_reverse": twin(rnn(lambda: nn.GRUCell(4), reverse=True, keep_order=True)),
    "rnn_conv_lstm_1d": twin(rnn(lambda: nn.ConvLSTMCell(3, (2,), padding="CAUSAL"))),
    "bidirectional_lengths": twin(
        lambda: nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(4)), nn.RNN(nn.SimpleCell(2))),
        kwargs={"seq_lengths": BY_NAME["bidirectional_lengths"].kwargs["seq_lengths"]},
    ),
    # combinators
    "sequential": twin(lambda: nn.Sequential([nn.Dense(8), nn.gelu, nn.LayerNorm(), nn.Dense(2)])),
    "stack": twin(
        lambda: LinenStack(
            lambda: [nn.Dense(4, parent=None), nn.tanh, nn.LayerNorm(parent=None)], 3
        )
    ),
    # Stack splits every stream per copy its own way (Linen's split_rngs derives other
    # keys): evaluation mode, where both are the identity and hold no variables.
    "stack_remat_dropout": twin(
        lambda: LinenStack(
            lambda: [nn.Dropout(0.5, deterministic=True, parent=None)], 2, remat=True
        ),
        lamina_kwargs={"is_training": False},
    ),
}

NO_LINEN: dict[str, str] = {
    "apply_rotary_interleaved": (
        "Linen has no rotary embedding; compared with transformers' apply_rotary_pos_emb (and "
        "the half layout after the permutation) in tests/test_nn_rotary.py"
    ),
    "rotary_embedding_llama3_partial": (
        "Linen has no rotary embedding; frequencies and rotation compared with transformers' "
        "ROPE_INIT_FUNCTIONS and GPT-NeoX's partial rotary in tests/test_nn_rotary.py"
    ),
    "attention_gqa_rope_rms": (
        "Linen's MultiHeadDotProductAttention has no grouped-query heads, RoPE or RMS q/k "
        "norms; compared with transformers' Qwen3Attention in tests/test_attention_modern.py"
    ),
    "attention_mqa_window": (
        "Linen's MultiHeadDotProductAttention has no grouped heads or sliding window; "
        "compared with transformers' MistralAttention in tests/test_attention_modern.py"
    ),
    "gated_mlp": (
        "Linen has no gated MLP layer; compared with transformers' LlamaMLP (and GemmaMLP) "
        "given the same weights in tests/test_nn_gated_mlp.py"
    ),
    "gated_mlp_gelu_tanh_bias": (
        "Linen has no gated MLP layer; compared with transformers' GemmaMLP and LlamaMLP "
        "(mlp_bias) given the same weights in tests/test_nn_gated_mlp.py"
    ),
    "rms_norm_gemma_offset": (
        "Linen's RMSNorm has no (1 + scale) offset; compared bit for bit with transformers' "
        "GemmaRMSNorm in tests/test_nn_norm.py"
    ),
    "rms_norm_llama_order_two_axes": (
        "Linen's RMSNorm multiplies the scale before the cast; this order is transformers' "
        "LlamaRMSNorm's, compared bit for bit in tests/test_nn_norm.py"
    ),
    "lora_dense": (
        "lamina-only: Linen has no LoRA layer (Flax's LoRA is NNX's nnx.LoRA); the adapter's "
        "outputs and merge_lora are tested in tests/test_lora.py"
    ),
    "lora_conv": (
        "lamina-only: Linen has no LoRA layer (Flax's LoRA is NNX's nnx.LoRA); the adapter's "
        "outputs and merge_lora are tested in tests/test_lora.py"
    ),
    # Documented in lamina/nn/weight_normalization.py: Linen keeps the wrapper's own variables
    # under flat keys holding '/', whose first part is the wrapped layer's Linen name
    # ("layer_instance" at the top, "Dense_0" when the layer was made in a parent's compact
    # method); lamina refuses '/' in a key and nests them under fixed names instead.
    "spectral_norm_dense": (
        "layout differs by design: Linen's nn.SpectralNorm(nn.Dense(4)) holds "
        "params/layer_instance/{kernel,bias} and batch_stats/'layer_instance/kernel/u' and "
        "/'layer_instance/kernel/sigma'; lamina holds params/layer/{kernel,bias}, "
        "batch_stats/u/kernel and batch_stats/sigma/kernel (DOCUMENTED_DIFFERENCES). Equal to "
        "Linen after that renaming in "
        "tests/test_nn_weight_normalization.py::test_spectral_norm_matches_linen"
    ),
    "weight_norm_conv_whole": (
        "layout differs by design: Linen's nn.WeightNorm(nn.Conv(4, (3, 3))) holds "
        "params/layer_instance/{kernel,bias} and params/'layer_instance/kernel/scale'; lamina "
        "holds params/layer/{kernel,bias} and params/scale/kernel (DOCUMENTED_DIFFERENCES). "
        "Equal to Linen after that renaming in "
        "tests/test_nn_weight_normalization.py::test_weight_norm_matches_linen"
    ),
}


def flat_layout(variables: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params/layer/kernel": (shape, dtype)}`` for every leaf (mappings of any kind)."""
    leaves = jax.tree_util.tree_leaves_with_path(variables)
    return {
        "/".join(_key(k) for k in path): (
            tuple(np.shape(leaf)),
            str(jnp.result_type(leaf)),
        )
        for path, leaf in leaves
    }


def _key(entry: Any) -> str:
    """A path entry as text; one holding '/' (Linen's flat ``"layer/kernel/u"``) quoted."""
    key = str(getattr(entry, "key", entry))
    return repr(key) if "/" in key else key


def layout_diff(linen: Any, lamina: Any) -> str:
    """What one layout has and the other lacks or holds differently, one line each."""
    a, b = flat_layout(linen), flat_layout(lamina)
    lines = [f"  only Linen has {k} {a[k]}" for k in sorted(a.keys() - b.keys())]
    lines += [f"  only lamina has {k} {b[k]}" for k in sorted(b.keys() - a.keys())]
    lines += [
        f"  {k}: Linen {a[k]}, lamina {b[k]}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]
    ]
    return "\n".join(lines)


def to_dict(tree: Any) -> Any:
    """Nested mappings (Linen's `FrozenDict` included) as plain dicts; leaves unchanged."""
    if hasattr(tree, "items"):
        return {k: to_dict(v) for k, v in tree.items()}
    return tree


# What Linen holds and lamina does not, for the entries of NO_LINEN whose layouts differ by
# design (checked, so that the reasons stay true: a change on either side fails).
DOCUMENTED_DIFFERENCES: dict[str, tuple[Twin, list[str]]] = {
    "spectral_norm_dense": (
        twin(lambda: nn.SpectralNorm(nn.Dense(4), n_steps=40), kwargs={"update_stats": True}),
        [
            "  only Linen has batch_stats/'layer_instance/kernel/sigma' ((), 'float32')",
            "  only Linen has batch_stats/'layer_instance/kernel/u' ((1, 4), 'float32')",
            "  only Linen has params/layer_instance/bias ((4,), 'float32')",
            "  only Linen has params/layer_instance/kernel ((5, 4), 'float32')",
            "  only lamina has batch_stats/sigma/kernel ((), 'float32')",
            "  only lamina has batch_stats/u/kernel ((1, 4), 'float32')",
            "  only lamina has params/layer/bias ((4,), 'float32')",
            "  only lamina has params/layer/kernel ((5, 4), 'float32')",
        ],
    ),
    "weight_norm_conv_whole": (
        twin(lambda: nn.WeightNorm(nn.Conv(4, (3, 3)), feature_axes=None)),
        [
            "  only Linen has params/'layer_instance/kernel/scale' ((), 'float32')",
            "  only Linen has params/layer_instance/bias ((4,), 'float32')",
            "  only Linen has params/layer_instance/kernel ((3, 3, 3, 4), 'float32')",
            "  only lamina has params/layer/bias ((4,), 'float32')",
            "  only lamina has params/layer/kernel ((3, 3, 3, 4), 'float32')",
            "  only lamina has params/scale/kernel ((), 'float32')",
        ],
    ),
}


def linen_kwargs(spec: Twin, inputs: tuple) -> dict[str, Any]:
    return spec.kwargs(inputs) if callable(spec.kwargs) else dict(spec.kwargs)


def linen_results(
    module: nn.Module, spec: Twin, inputs: tuple
) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Linen's variables (randomised), outputs and updated collections."""
    kwargs = linen_kwargs(spec, inputs)
    method = spec.method or "__call__"
    with jax.numpy_dtype_promotion("standard"):  # Linen mixes dtypes implicitly
        # the shapes of Linen's variables (computing its initial values would only cost time)
        shapes = jax.eval_shape(
            lambda *x: module.init(jax.random.key(0), *x, method=method, **kwargs), *inputs
        )
        variables = randomize(to_dict(shapes))

        @jax.jit
        def call(variables: Any, *inputs: Any) -> tuple[Any, Any]:
            if spec.mutable:
                mutable = list(spec.mutable)
                return module.apply(variables, *inputs, method=method, mutable=mutable, **kwargs)
            return module.apply(variables, *inputs, method=method, **kwargs), {}

        outputs, updated = call(variables, *inputs)
    return variables, outputs, to_dict(updated)


def example_inputs(case: LayerCase) -> tuple:
    return cast_inputs(case.inputs(np.random.default_rng(0), np.float32), jnp.float32)


def test_every_table_entry_says_how_it_compares():
    names = set(IDS)
    neither = sorted(names - LINEN.keys() - NO_LINEN.keys())
    assert not neither, (
        f"layer-table entries with neither a Linen twin in LINEN nor a reason in NO_LINEN "
        f"(tests/test_linen_interop.py): {neither}"
    )
    assert not LINEN.keys() & NO_LINEN.keys(), "an entry is both in LINEN and NO_LINEN"
    stale = sorted((LINEN.keys() | NO_LINEN.keys()) - names)
    assert not stale, f"entries of LINEN/NO_LINEN that the layer table lacks: {stale}"
    assert all(len(reason) > 40 for reason in NO_LINEN.values())


@pytest.mark.parametrize("case", [c for c in LAYERS if c.name in LINEN], ids=lambda c: c.name)
def test_linen_variables_drive_lamina(case: LayerCase):
    spec = LINEN[case.name]
    layer = case.make(jnp.float32, jnp.float32)
    inputs = example_inputs(case)
    variables, expected, updated = linen_results(spec.build(layer), spec, inputs)

    init, apply = lm.transform(layer, to_callable=case.to_callable)
    ours = jax.eval_shape(init, jax.random.key(0))
    diff = layout_diff(variables, ours)
    assert not diff, f"{case.name}: Linen's variables and lamina's differ:\n{diff}"
    assert jax.tree.structure(variables) == jax.tree.structure(ours)  # empty subtrees too

    kwargs = case.kwargs if spec.lamina_kwargs is None else spec.lamina_kwargs
    rngs = {"dropout": DROPOUT_KEY} if case.needs_rng else None
    outputs, new = apply(variables, rngs, *inputs, **kwargs)
    assert_close(outputs, expected, rtol=1e-5, atol=1e-5)
    assert new.keys() == variables.keys()
    for collection, given in variables.items():
        if collection in spec.mutable:
            assert_close(new[collection], updated[collection], rtol=1e-5, atol=1e-6)
            assert not np.allclose(flat(new[collection]), flat(given))  # it did update
        else:
            assert_close(new[collection], given, rtol=0, atol=0)
    if case.needs_rng and spec.lamina_kwargs is None:
        # compared in training mode: the outputs depend on the key, so matching is not luck
        other, _ = apply(variables, {"dropout": jax.random.key(7)}, *inputs, **kwargs)
        assert not np.allclose(flat(other), flat(outputs))


def flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("name", sorted(DOCUMENTED_DIFFERENCES))
def test_documented_layout_differences(name: str):
    spec, expected = DOCUMENTED_DIFFERENCES[name]
    case = BY_NAME[name]
    inputs = example_inputs(case)
    module, kwargs = spec.build(case.make(jnp.float32, jnp.float32)), linen_kwargs(spec, inputs)
    with jax.numpy_dtype_promotion("standard"):
        linen = jax.eval_shape(lambda *x: module.init(jax.random.key(0), *x, **kwargs), *inputs)
    init = lm.transform(case.make(jnp.float32, jnp.float32)).init
    assert layout_diff(to_dict(linen), jax.eval_shape(init, jax.random.key(0))).splitlines() == (
        expected
    )
    assert name in NO_LINEN


def test_a_different_layout_or_weight_is_caught():
    """The checks can fail: the diff names each difference, a transposed kernel shows."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5)), jnp.float32)
    variables, _, _ = linen_results(nn.Dense(4), twin(nn.Dense), (x,))
    ours = jax.eval_shape(lm.transform(lm.Dense(5, 3, use_bias=False)).init, jax.random.key(0))
    assert layout_diff(variables, ours).splitlines() == [
        "  only Linen has params/bias ((4,), 'float32')",
        "  params/kernel: Linen ((5, 4), 'float32'), lamina ((5, 3), 'float32')",
    ]
    variables, expected, _ = linen_results(nn.Dense(5), twin(nn.Dense), (x,))
    swapped = {"params": {**variables["params"], "kernel": variables["params"]["kernel"].T}}
    got, _ = lm.transform(lm.Dense(5, 5)).apply(swapped, None, x)
    with pytest.raises(AssertionError):
        assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _LinenAutoNamed(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = nn.Dense(4)  # Linen names it Dense_0
        return nn.Dense(3)(hidden(x))  # Dense_1


class _Named(lm.Module):
    """The same model, its submodules named `hidden` and `out` (or Linen's names)."""

    def __init__(self, names: tuple[str, str] = ("hidden", "out")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], lm.Dense(5, 4))
        setattr(self, names[1], lm.Dense(4, 3))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden, out = (getattr(self, name) for name in self.names)
        return out(hidden(x))


def test_frozen_dicts_load_and_other_names_are_an_error():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5)), jnp.float32)
    linen = _LinenAutoNamed()
    variables = randomize(to_dict(jax.eval_shape(linen.init, jax.random.key(0), x)))
    with jax.numpy_dtype_promotion("standard"):
        expected = linen.apply(variables, x)
    # attributes named as Linen names its submodules: Linen's FrozenDict goes in as it is
    ours = lm.transform(_Named(("Dense_0", "Dense_1")))
    got, _ = ours.apply(flax.core.freeze(variables), None, x)
    assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # other names: an error that names every path either side lacks
    with pytest.raises(
        ValueError,
        match=r"(?s)missing \(4\): params/hidden/bias.*unexpected \(4\):.*params/Dense_0/kernel",
    ):
        lm.transform(_Named()).apply(variables, None, x)
