"""lm.export_onnx: the replay's pool rewrites, the layer table and four models through ONNX
Runtime, and every refusal.

Each ONNX file is run by ONNX Runtime here and compared with `lm.apply` on the same inputs
(the export's own check is exercised by the model tests, which keep ``check=True``). The
first ``jax2onnx.to_onnx`` of a process costs seconds (its plugins load), paid once by the
module-scoped `warm` fixture.
"""

from __future__ import annotations

import functools
import importlib
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
import pytest
from jax import lax

import lamina as lm
from lamina.deploy import onnx_export
from lamina.deploy.jaxpr_replay import Unsupported, equations, pool_for_onnx, replay
from tests.helpers import assert_close
from tests.layer_table import LAYERS, Function, build_inference_form, cast_inputs, drawn

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

ort.set_default_logger_severity(3)
EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
RTOL, ATOL = 1e-4, 1e-5
QUICK = {"xla_backend_optimization_level": 0}  # XLA's options for programs that run once

# Layer-table entries ONNX cannot take, what the refusal says (it names the primitive, or the
# training mode, and the layer), and why (the docs page lists them).
UNSUPPORTED = {
    "conv3d": (
        r"ONNX cannot express 'conv_general_dilated' \(a convolution over 3 spatial axes: "
        r"jax2onnx converts 1-D and 2-D ones\), used in Conv at <root>\.",
        "jax2onnx 0.17.1 has no layout for 3-D convolutions (plugins/jax/lax/conv.py)",
    ),
    "dropout_function": (
        r"Function draws random keys in Function at <root> \(dropout on, or another layer "
        r"that samples\).*training mode",
        "fixes is_training=True in the layer: its only form draws random keys (training)",
    ),
}
# Layer-table entries exported at their static shape only: what exporting with batch_dims="b"
# says (None: it is not tried, axis 0 is not a batch), and why.
SYMBOLIC = r"jax2onnx cannot convert it at a symbolic size: InconclusiveDimensionOperation"
STATIC_ONLY = {
    "dense_general_batch_axes": (None, "axis 0 is the layer's batch_shape axis, of size 2"),
    "rotary_embedding_llama3_partial": (None, "its positions, fixed (2, 3), fix the batch"),
    "batch_norm_two_axes_mask_two_pass": (None, "its mask, fixed (4, 1, 1), fixes the batch"),
    "rnn_conv_lstm_1d": (
        rf"ONNX cannot express 'pad' \({SYMBOLIC}.*used in Conv at cell/ih\. Export with static "
        r"shapes \(batch_dims=None",
        "jax2onnx 0.17.1 pads with constant sizes only (plugins/jax/lax/pad.py)",
    ),
    "bidirectional_lengths": (
        rf"ONNX cannot express 'rem' \({SYMBOLIC}.*used in RNN at backward_rnn\..*lm\.export",
        "jax2onnx 0.17.1's rem needs constant sizes (plugins/jax/lax/rem.py)",
    ),
}
# Keyword arguments that are inputs of the exported function (a batch of lengths).
AS_INPUTS = {"bidirectional_lengths": "seq_lengths"}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One export first: jax2onnx loads its plugins on its first conversion (seconds)."""
    model = lm.Dense(2, 2)
    path = tmp_path_factory.mktemp("warm") / "warm.onnx"
    lm.export_onnx(model, lm.init(model)(jax.random.key(0)), jnp.ones((1, 2)), path=str(path))


def run_onnx(path, *inputs):
    """ONNX Runtime's outputs of the file at `path` on `inputs` (fed in order)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    leaves = [np.asarray(x) for x in jax.tree.leaves(inputs)]
    names = [i.name for i in session.get_inputs()]
    assert len(names) == len(leaves), names
    return session.run(None, dict(zip(names, leaves, strict=True)))


# --- the replay (JAX only) ------------------------------------------------------------------


def replayed(fn, *args):
    """`fn`'s jaxpr replayed on `args`, and the primitives the replay binds."""
    closed = jax.make_jaxpr(fn)(*args)
    again = jax.make_jaxpr(lambda *xs: replay(closed, *xs))(*args)
    return replay(closed, *args), again


def pool_ranks(jaxpr):
    """The rank of every ``reduce_window_max`` operand, bodies of control flow included."""
    return [
        e.invars[0].aval.ndim for e in equations(jaxpr) if e.primitive.name == "reduce_window_max"
    ]


def names_of(closed):
    return [eqn.primitive.name for eqn in closed.jaxpr.eqns]


X4 = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 6, 3)), jnp.float32)


@pytest.mark.parametrize(
    "pool",
    [
        lambda x: lm.max_pool(x, (2, 2), strides=2),
        lambda x: lm.max_pool(x, (3, 3), strides=2, padding="SAME"),
        lambda x: lm.min_pool(x, (3, 2), strides=(1, 2), padding="SAME"),
        lambda x: lax.reduce_window(
            x, -jnp.inf, lax.max, (2, 2, 1, 2), (1, 1, 1, 2), ((1, 0), (0, 1), (0, 0), (1, 1))
        ),
    ],
    ids=["max_valid", "max_same", "min_same", "max_dilated_channels"],
)
def test_nhwc_pools_become_pools_of_at_most_three_axes_with_the_same_values(pool):
    (got,), again = replayed(pool, X4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool(X4)))
    assert all(rank <= 3 for rank in pool_ranks(again)) and pool_ranks(again)
    assert "reduce_window_min" not in names_of(again) and "jit" not in names_of(again)


def test_a_min_pool_is_the_negated_max_pool_of_the_negation():
    (got,), again = replayed(lambda x: lm.min_pool(x, 3, padding="SAME"), X4[:, 0])
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(lm.min_pool(X4[:, 0], 3, padding="SAME"))
    )
    assert names_of(again)[0] == names_of(again)[-1] == "neg"
    assert pool_ranks(again) == [2]  # (batch * channels, length)


def test_a_3d_pool_is_pooled_two_axes_then_one():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 6, 4, 3)), jnp.float32)
    pool = functools.partial(lm.max_pool, kernel_size=(2, 3, 2), strides=(1, 2, 2), padding="SAME")
    (got,), again = replayed(pool, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool(x)))
    assert pool_ranks(again) == [3, 2]


def test_pools_fold_a_symbolic_batch_and_pools_inside_a_scan_are_rewritten():
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 6, 6, 3), jnp.float32)
    closed = jax.make_jaxpr(lambda x: lm.max_pool(x, (2, 2), strides=2))(spec)
    again = jax.make_jaxpr(lambda x: replay(closed, x))(spec)
    assert str(again.jaxpr.eqns[1].outvars[0].aval.shape[0]) == "3*b"

    def scanned(x):
        return lax.scan(lambda c, xi: (c, lm.min_pool(xi, (2, 2))), 0.0, x)[1]

    x = jnp.stack([X4, -X4])
    (got,), again = replayed(scanned, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(scanned(x)))
    assert names_of(again) == ["scan"] and pool_ranks(again) == [3]


def test_calls_are_inlined_and_other_primitives_kept():
    def fn(x):
        return jax.checkpoint(lambda y: jax.nn.relu(jnp.sin(y)) * 2)(x)

    (got,), again = replayed(fn, X4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(X4)))
    assert names_of(again) == ["sin", "max", "mul"]


def test_integer_pools_are_unsupported_and_bad_arity_is_refused():
    with pytest.raises(Unsupported, match="a max pool of int32 values: ONNX pools floats only"):
        replayed(lambda x: lm.max_pool(x, (2, 2)), X4.astype(jnp.int32))
    params = dict(window_dimensions=(2,), window_strides=(1,), padding=((0, 0),))
    with pytest.raises(Unsupported, match="reduce_window_min: a min pool of int32"):
        pool_for_onnx(
            "reduce_window_min", jnp.arange(3), base_dilation=(1,), window_dilation=(1,), **params
        )
    closed = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(TypeError, match="the jaxpr takes 1 inputs, got 2"):
        replay(closed, 1.0, 2.0)


# --- the layer table through ONNX Runtime ---------------------------------------------------


def test_the_lists_name_entries_of_the_table():
    names = {case.name for case in LAYERS}
    assert set(UNSUPPORTED) | set(STATIC_ONLY) | set(AS_INPUTS) <= names


def built(case):
    """``(model, to_callable, variables, inputs)`` of an entry in its inference form
    (`build_inference_form`; an unsupported entry keeps its layer's training flags)."""
    model, to_callable, variables, inputs = build_inference_form(
        case, AS_INPUTS.get(case.name), keep_layer_flags=case.name in UNSUPPORTED
    )
    return model, to_callable, variables, cast_inputs(inputs, jnp.float32)


@pytest.mark.parametrize("case", LAYERS, ids=[case.name for case in LAYERS])
def test_layer_table_entry_through_onnx_runtime_equals_apply(case, warm, tmp_path):
    model, to_callable, variables, inputs = built(case)
    path = tmp_path / f"{case.name}.onnx"
    if case.name in UNSUPPORTED:
        with pytest.raises(lm.ExportError, match=UNSUPPORTED[case.name][0]):
            lm.export_onnx(model, variables, *inputs, path=str(path), to_callable=to_callable)
        assert not os.listdir(tmp_path)
        return
    if case.name in STATIC_ONLY and STATIC_ONLY[case.name][0] is not None:
        with pytest.raises(lm.ExportError, match=STATIC_ONLY[case.name][0]):
            lm.export_onnx(
                model, variables, *inputs, path=str(path), to_callable=to_callable, batch_dims="b"
            )
        assert not os.listdir(tmp_path)
    batch_dims = None if case.name in STATIC_ONLY else "b"
    if batch_dims:  # a batch of 1: the check runs the file at 1 and 7 (not three sizes)
        inputs = jax.tree.map(lambda x: x[:1], inputs)
    lm.export_onnx(
        model, variables, *inputs, path=str(path), to_callable=to_callable, batch_dims=batch_dims
    )
    # check=True: ONNX Runtime ran the file and matched apply (rtol 1e-4, atol 1e-5) on the
    # inputs, at batch 1, and at 7 from the same file (see the tests of the check below).
    assert os.listdir(tmp_path) == [path.name]


# --- the four models: batches 5, 1, 7 (the check) and 64 from one file -----------


def expected(model, variables, inputs, static=(), to_callable=None):
    """`lm.apply`'s outputs (compiled for one run), flat; `static` arguments after `inputs`."""
    apply = lm.apply(model, to_callable=to_callable)
    fn = jax.jit(lambda v, *xs: apply(v, None, *xs, *static)[0])
    return jax.tree.leaves(fn.lower(variables, *inputs).compile(QUICK)(variables, *inputs))


class MLP(lm.Module):
    """Dense, LayerNorm, gelu, dropout (off when exported), Dense."""

    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(6, 16)
        self.norm = lm.LayerNorm(16)
        self.drop = lm.Dropout(0.5)
        self.out = lm.Dense(16, 3)

    def __call__(self, x, is_training):
        return self.out(self.drop(lm.gelu(self.norm(self.dense(x))), is_training))


class Tagger(lm.Module):
    """An LSTM over a sequence (`lm.RNN`), then a Dense on every step."""

    def __init__(self):
        super().__init__()
        self.rnn = lm.RNN(lm.LSTMCell(3, 8))
        self.out = lm.Dense(8, 2)

    def __call__(self, x):
        return self.out(self.rnn(x))


@pytest.fixture(scope="module")
def examples():
    """examples/mnist.py and examples/char_transformer.py as modules (they import _common)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))
        return importlib.import_module("mnist"), importlib.import_module("char_transformer")


def make_model(name, examples):
    """``(model, variables, make_inputs(batch) -> inputs, static args, input name)``."""
    rng = np.random.default_rng(0)

    def floats(*shape):
        return lambda n: (jnp.asarray(rng.standard_normal((n, *shape)), jnp.float32),)

    if name == "mnist_convnet":
        model = examples[0].ConvNet(image_size=(8, 8), channels=1, num_classes=10)
        make, static, input_name = floats(8, 8, 1), (False,), "x"
    elif name == "mlp_layernorm":
        model, make, static, input_name = MLP(), floats(6), (False,), "x"
    elif name == "char_transformer":
        model = examples[1].CharTransformer(11, layers=2, heads=2, width=16, block_size=8)
        make = lambda n: (jnp.asarray(rng.integers(0, 11, (n, 8)), jnp.int32),)  # noqa: E731
        static, input_name = (), "ids"
    else:
        model, make, static, input_name = Tagger(), floats(5, 3), (), "x"
    variables = drawn(jax.eval_shape(lm.init(model), jax.random.key(0)))
    return model, variables, make, static, input_name


MODELS = ["mnist_convnet", "mlp_layernorm", "char_transformer", "lstm_sequence"]


@pytest.fixture(scope="module")
def exported_models(examples, warm, tmp_path_factory):
    """Each model exported once with ``batch_dims="b"`` (checked at batch 5, 1 and 7)."""
    folder = tmp_path_factory.mktemp("models")

    @functools.cache
    def export(name):
        model, variables, make, static, input_name = make_model(name, examples)
        path = folder / f"{name}.onnx"
        proto = lm.export_onnx(model, variables, *make(5), *static, path=str(path), batch_dims="b")
        assert [i.name for i in proto.graph.input] == [input_name]
        assert [o.name for o in proto.graph.output] == ["output"]
        return path, model, variables, make, static

    return export


@pytest.mark.parametrize("name", MODELS)
def test_model_through_onnx_runtime_at_every_batch_size_from_one_file(name, exported_models):
    # The export's check ran the file at batches 5 (the example), 1 and 7 against apply.
    path, model, variables, make, static = exported_models(name)
    inputs = make(64)
    got = run_onnx(path, *inputs)
    assert_close(got, expected(model, variables, inputs, static), RTOL, ATOL)


# --- pools through ONNX Runtime -------------------------------------------------------------


@pytest.mark.parametrize(
    "pool",
    [
        Function(lm.max_pool, kernel_size=(3, 3), strides=2, padding="SAME"),
        Function(lm.min_pool, kernel_size=(2, 3), strides=(2, 1), padding="SAME"),
        Function(lm.max_pool, kernel_size=(2, 2, 2), strides=2),
    ],
    ids=["nhwc_max_same", "nhwc_min_same", "ndhwc_max"],
)
def test_pools_through_onnx_runtime_at_a_symbolic_batch(pool, warm, tmp_path):
    x = X4 if len(pool.options["kernel_size"]) == 2 else jnp.stack([X4, X4 + 1], axis=1)
    path = tmp_path / "pool.onnx"
    lm.export_onnx(pool, {}, x[:1], path=str(path), batch_dims="b", check=False)
    assert_close(run_onnx(path, x), [pool(x)], RTOL, ATOL)


def test_without_the_rewrite_onnx_runtime_refuses_the_pool_and_nothing_is_written(
    warm, tmp_path, monkeypatch
):
    # The pool as jax2onnx converts it unrewritten: a MaxPool over all four axes, which
    # converts, but which ONNX Runtime cannot run. The check turns that into an error.
    monkeypatch.setattr(
        onnx_export,
        "replay",
        lambda closed, *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs),
    )
    pool = Function(lm.max_pool, kernel_size=(2, 2), strides=2)
    with pytest.raises(
        lm.ExportError,
        match=r"ONNX Runtime cannot (run|load) the converted "
        r"Function.*nothing written.*lm\.export",
    ):
        lm.export_onnx(pool, {}, X4, path=str(tmp_path / "pool.onnx"))
    assert not os.listdir(tmp_path)


# --- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp():
    model = MLP()
    return model, lm.init(model)(jax.random.key(0)), jnp.ones((2, 6))


def test_the_path_is_checked_first_even_without_the_extra(mlp, tmp_path, monkeypatch):
    model, variables, x = mlp
    monkeypatch.setitem(sys.modules, "jax2onnx", None)  # not installed
    with pytest.raises(FileNotFoundError, match=r"lm\.export_onnx: the folder .*missing"):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path / "missing" / "m.onnx"))
    with pytest.raises(IsADirectoryError, match=r"lm\.export_onnx: .* is a folder"):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path))
    with pytest.raises(
        ImportError,
        match=r"lm\.export_onnx needs jax2onnx.*pip install "
        r"'lamina\[onnx\]'.*lm\.export",
    ):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_training_mode_is_refused(mlp, tmp_path):
    model, variables, x = mlp
    with pytest.raises(lm.ExportError, match=r"draws random keys.*drop.*training mode"):
        lm.export_onnx(model, variables, x, True, path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_another_compute_dtype_than_float32_is_refused_naming_the_layer(tmp_path):
    model = lm.Sequential(lm.Dense(3, 4), lm.Dense(4, 2, dtype=jnp.bfloat16))
    variables = lm.init(model)(jax.random.key(0))
    with pytest.raises(
        lm.ExportError,
        match=r"Sequential computes in bfloat16 \(in Dense "
        r"at layers_1\); ONNX export is float32 only.*lm\.export",
    ):
        lm.export_onnx(model, variables, jnp.ones((2, 3)), path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


class TwoConvs(lm.Module):
    """A 2-D convolution ONNX takes and a 3-D one it does not."""

    def __init__(self):
        super().__init__()
        self.flat = lm.Conv(1, 2, (3, 3))
        self.deep = lm.Conv(1, 2, (2, 2, 2))

    def __call__(self, image, volume):
        return self.flat(image), self.deep(volume)


def test_an_operation_onnx_cannot_express_names_the_primitive_and_the_layer(warm, tmp_path):
    model = TwoConvs()
    variables = lm.init(model)(jax.random.key(0))
    with pytest.raises(
        lm.ExportError,
        match=r"ONNX cannot express 'conv_general_dilated' \(a "
        r"convolution over 3 spatial axes.*used in Conv at deep\. lm\.export "
        r"writes the model as StableHLO",
    ):
        lm.export_onnx(
            model,
            variables,
            jnp.ones((1, 4, 4, 1)),
            jnp.ones((1, 3, 3, 3, 1)),
            path=str(tmp_path / "m.onnx"),
        )
    pools = lm.Sequential(Function(lm.max_pool, kernel_size=(2,)))
    with pytest.raises(
        lm.ExportError,
        match=r"ONNX cannot express 'reduce_window_max' \(a max "
        r"pool of int32 values: ONNX pools floats only\), used in Function at "
        r"layers_0",
    ):
        lm.export_onnx(pools, {}, jnp.ones((1, 4, 2), jnp.int32), path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_a_primitive_without_a_jax2onnx_plugin_names_itself(warm, tmp_path):
    product = lm.Sequential(Function(lm.pool, init=1.0, reduce_fn=lax.mul, kernel_size=(2,)))
    with pytest.raises(
        lm.ExportError,
        match=r"ONNX cannot express 'reduce_window' \(jax2onnx: "
        r"NotImplementedError: reduce_window currently supports .*add/max/min\), used in "
        r"Function at layers_0",
    ):
        lm.export_onnx(product, {}, jnp.ones((1, 4, 2)), path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_other_conversion_failures_are_export_errors(mlp, warm, tmp_path, monkeypatch):
    import jax2onnx

    def broken(*args, **kwargs):
        raise RuntimeError("something jax2onnx did not expect")

    monkeypatch.setattr(jax2onnx, "to_onnx", broken)
    model, variables, x = mlp
    with pytest.raises(
        lm.ExportError,
        match=r"jax2onnx could not convert MLP \(RuntimeError: "
        r"something jax2onnx did not expect\)",
    ):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_a_file_that_differs_from_apply_is_not_written(mlp, warm, tmp_path, monkeypatch):
    model, variables, x = mlp
    monkeypatch.setattr(
        onnx_export, "replay", lambda closed, *xs: [y + 1e-3 for y in replay(closed, *xs)]
    )
    with pytest.raises(
        lm.ExportError,
        match=r"output 'output' of MLP differs from apply on "
        r"the example inputs: max \|onnx - apply\| = 0\.001.*nothing written",
    ):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"))
    # The same file within a tolerance that admits it, or unchecked, is written.
    lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"), atol=1e-2)
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_a_batch_check_failure_names_the_batch(mlp, warm, tmp_path, monkeypatch):
    model, variables, x = mlp  # a batch of 2: rows from the third on are made wrong

    def wrong_from_row_2(closed, *xs):
        outputs = replay(closed, *xs)
        return [
            y + (lax.broadcasted_iota(y.dtype, y.shape, 0) >= 2).astype(y.dtype) for y in outputs
        ]

    monkeypatch.setattr(onnx_export, "replay", wrong_from_row_2)
    with pytest.raises(lm.ExportError, match=r"differs from apply on a batch of 7"):
        lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"), batch_dims="b")
    assert not os.listdir(tmp_path)


def test_too_big_for_one_protobuf_and_a_failing_write_leave_nothing(
    mlp, warm, tmp_path, monkeypatch
):
    model, variables, x = mlp
    with monkeypatch.context() as patch:
        patch.setattr(onnx_export, "LIMIT", 1000)
        with pytest.raises(
            lm.ExportError,
            match=r"MLP makes an ONNX file of 0\.0 GiB, past "
            r"protobuf's 2 GiB limit.*with_variables=False",
        ):
            lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"))
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(OSError, match="disk full"):
            lm.export_onnx(model, variables, x, False, path=str(tmp_path / "m.onnx"))
    assert not os.listdir(tmp_path)


def test_bad_options_and_inputs_are_refused_before_anything_is_written(mlp, tmp_path):
    model, variables, x = mlp
    path = str(tmp_path / "m.onnx")
    with pytest.raises(
        ValueError,
        match=r"opset must be an int from 9 to 28 .*23 by default\), got '23'",
    ):
        lm.export_onnx(model, variables, x, False, path=path, opset="23")
    with pytest.raises(ValueError, match=r"rtol must be a number >= 0, got -1"):
        lm.export_onnx(model, variables, x, False, path=path, rtol=-1)
    with pytest.raises(lm.VariablesError):
        lm.export_onnx(model, {"params": {}}, x, False, path=path)
    with pytest.raises(lm.ExportError, match=r"tracing MLP with the example arguments failed"):
        lm.export_onnx(model, variables, jnp.ones((2, 5)), False, path=path)
    assert not os.listdir(tmp_path)


# --- what ONNX computes differently, rewritten by the replay --------------------------------


class Slices(lm.Module):
    """Dynamic slices and updates at a start that is an input (JAX clamps it)."""

    def __call__(self, x, start):
        window = lax.dynamic_slice_in_dim(x, start, 3, axis=1)
        update = lax.dynamic_update_slice_in_dim(x, -jnp.ones((x.shape[0], 2)), start, axis=1)
        return window, update


def test_dynamic_slices_clamp_their_starts_as_jax_does(warm, tmp_path):
    model, x, path = Slices(), jnp.arange(12.0).reshape(2, 6), tmp_path / "slices.onnx"
    lm.export_onnx(model, {}, x, jnp.int32(1), path=str(path))
    for start in (5, 9, -1, -4, -9):  # past the end, negative (wrapped once, then clamped)
        start = jnp.int32(start)
        assert_close(run_onnx(path, x, start), expected(model, {}, (x, start)), 0, 0)


def test_a_decoding_step_from_onnx_runtime_equals_apply_past_the_cache_end(
    examples, warm, tmp_path
):
    from lamina.deploy.inference import inference_function

    char = examples[1]
    model = char.CharTransformer(5, layers=1, heads=1, width=8, block_size=2, decode_batch=2)
    variables = drawn(jax.eval_shape(lm.init(model), jax.random.key(0)))
    variables = {**variables, "cache": lm.init(model)(jax.random.key(0))["cache"]}
    step = lambda m: functools.partial(m.__call__, decode=True)  # noqa: E731
    ids, path = jnp.asarray([[3], [1]], jnp.int32), tmp_path / "step.onnx"
    proto = lm.export_onnx(model, variables, ids, path=str(path), to_callable=step, check=False)
    names = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    assert names[0][-1] == "ids" and names[0][0].startswith("cache/blocks/")
    assert names[1][0] == "output" and names[1][1].startswith("updated/cache/blocks/")
    # what apply computes (its run-time overflow check left out, as in every artifact)
    fn = jax.jit(inference_function(model, variables, (ids,), to_callable=step).fn)
    cache = {"cache": variables["cache"]}
    for i in range(3):  # the third step is past block_size: NaN, and the cache is kept
        got = run_onnx(path, cache, ids + i)
        out, new = fn(cache, ids + i)
        assert_close(got, jax.tree.leaves((out, new)), RTOL, ATOL)
        cache = new
    assert np.isnan(got[0]).all()


class Tails(lm.Module):
    """Functions whose ONNX forms lose accuracy near 0 or round differently."""

    def __call__(self, x):
        soft = lm.softplus(x)
        return soft, jnp.log(soft), lm.log_sigmoid(x), jnp.expm1(x), jnp.log1p(x), lax.round(x)


def test_log1p_expm1_and_rounding_keep_their_accuracy(warm, tmp_path):
    x = jnp.asarray([[-30.0, -20.0, 20.0, 1e-7, -1e-7, 0.5, 2.5, -2.5, 0.49999997, 1.5]])
    path = tmp_path / "tails.onnx"
    lm.export_onnx(Tails(), {}, jnp.ones((1, 3)), path=str(path), batch_dims="b, n")
    assert_close(run_onnx(path, x), expected(Tails(), {}, (x,)), 1e-6, 0)


# --- names, examples as shapes, the check's sizes, opsets -----------------------------------


class Named(lm.Module):
    """Pytree inputs and outputs, and a parameter named like the outputs."""

    def __call__(self, feats, output):
        logits = feats["tokens"] * feats["weights"][None] + output
        return {"logits": logits, "aux": -output}


def test_inputs_and_outputs_are_named_by_pytree_path_and_unique(warm, tmp_path):
    rng = np.random.default_rng(0)
    feats = {
        "tokens": jnp.asarray(rng.standard_normal((2, 3)), jnp.float32),
        "weights": jnp.ones(3),
    }
    output = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    path = tmp_path / "named.onnx"
    lm.export_onnx(Named(), {}, feats, output, path=str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["feats/tokens", "feats/weights", "output"]
    assert [o.name for o in session.get_outputs()] == ["output/aux", "output/logits"]
    feed = {"feats/tokens": np.asarray(feats["tokens"]), "output": np.asarray(output)}
    feed["feats/weights"] = np.full(3, 2.0, np.float32)  # fed by name, not by position
    got = session.run(["output/logits", "output/aux"], feed)
    want = Named()(feats | {"weights": jnp.full(3, 2.0)}, output)
    assert_close(got, [want["logits"], want["aux"]], RTOL, ATOL)


def test_the_check_draws_shape_examples_and_changes_every_symbol(mlp, warm, tmp_path, monkeypatch):
    model, variables, x = mlp
    path = str(tmp_path / "m.onnx")
    quadratic = lambda closed, *xs: [y + 1e-3 * xs[0].sum() ** 2 for y in replay(closed, *xs)]  # noqa: E731
    monkeypatch.setattr(onnx_export, "replay", quadratic)  # right at zeros only
    spec = jax.ShapeDtypeStruct((2, 6), jnp.float32)
    with pytest.raises(lm.ExportError, match=r"differs from apply on the example inputs"):
        lm.export_onnx(model, variables, spec, False, path=path)

    def wrong_unless_4_columns(closed, *xs):
        columns = jnp.asarray(xs[0].shape[1])
        return [y + lax.convert_element_type(columns != 4, y.dtype) for y in replay(closed, *xs)]

    monkeypatch.setattr(onnx_export, "replay", wrong_unless_4_columns)
    tanh = Function(jnp.tanh)
    with pytest.raises(lm.ExportError, match=r"differs from apply on t = 3"):
        lm.export_onnx(tanh, {}, jnp.ones((2, 4, 3)), path=path, batch_dims="b, t, 3")
    assert not os.listdir(tmp_path)


def test_opsets_are_checked_first_and_every_file_is_checked_by_onnx(
    mlp, warm, tmp_path, monkeypatch
):
    model, variables, x = mlp
    path = str(tmp_path / "m.onnx")
    for opset in (5, 99, True):
        with pytest.raises(ValueError, match=r"opset must be an int from 9 to 28 \(the opsets"):
            lm.export_onnx(model, variables, x, False, path=path, opset=opset, check=False)
    monkeypatch.setattr(onnx_export, "OPSETS", range(1, 29))
    with pytest.raises(
        lm.ExportError, match=r"the converted MLP is not a valid ONNX model.*Expand"
    ):
        lm.export_onnx(model, variables, x, False, path=path, opset=5, check=False)
    assert not os.listdir(tmp_path)
