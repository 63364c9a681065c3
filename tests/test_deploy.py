"""`lm.export` / `lm.load_exported`: StableHLO artifacts that run without lamina.

Round trips against `apply` (symbolic batch sizes 1, 7 and 64 from one artifact), an artifact
run in a subprocess where ``import lamina`` is impossible, training-mode refusals and
``allow_training``, decoding caches, platforms, and every error path (nothing written).
The layer-table round trips live in tests/test_deploy_table.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina.deploy.inference import inference_function


class MLP(lm.Module):
    """The issue's MLP: LayerNorm, gelu, dropout (off at export)."""

    def __init__(self):
        super().__init__()
        self.hidden = lm.Dense(6, 16)
        self.norm = lm.LayerNorm(16)
        self.drop = lm.Dropout(0.5)
        self.out = lm.Dense(16, 3)

    def __call__(self, x, is_training):
        x = jax.nn.gelu(self.norm(self.hidden(x)))
        return self.out(self.drop(x, is_training))


class ConvNet(lm.Module):
    """The MNIST example's ConvNet, small: two convolutions, two max pools, a flatten."""

    def __init__(self):
        super().__init__()
        self.conv1 = lm.Conv(1, 4, kernel_size=(3, 3), padding="SAME")
        self.conv2 = lm.Conv(4, 8, kernel_size=(3, 3), padding="SAME")
        self.fc = lm.Dense(2 * 2 * 8, 5)

    def __call__(self, x, is_training):
        x = lm.max_pool(lm.relu(self.conv1(x)), kernel_size=(2, 2), strides=(2, 2))
        x = lm.max_pool(lm.relu(self.conv2(x)), kernel_size=(2, 2), strides=(2, 2))
        x = lm.dropout(x.reshape((x.shape[0], -1)), rate=0.5, is_training=is_training)
        return self.fc(x)


class Normed(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 4)
        self.bn = lm.BatchNorm(4)

    def __call__(self, x, is_training):
        return self.bn(self.dense(x), is_training)


def _inputs(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6)


def _round_trip(exported):
    return jax.export.deserialize(exported.serialize())


@pytest.fixture(scope="module")
def mlp():
    model = MLP()
    return model, lm.init(model)(jax.random.key(0))


@pytest.fixture(scope="module")
def convnet():
    model = ConvNet()
    return model, lm.init(model)(jax.random.key(1))


@pytest.fixture(scope="module")
def convnet_artifact(convnet):
    model, variables = convnet
    return lm.export(model, variables, _inputs((2, 8, 8, 1)), False, batch_dims="b")


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_one_artifact_runs_batch_1_7_64(name, request):
    model, variables = request.getfixturevalue(name)
    shape = (6,) if name == "mlp" else (8, 8, 1)
    if name == "convnet":
        exported = request.getfixturevalue("convnet_artifact")
    else:
        exported = lm.export(model, variables, _inputs((2, *shape)), False, batch_dims="b")
    loaded = _round_trip(exported)
    assert str(loaded.in_avals[0].shape[0]) == "b"
    x = _inputs((1 + 7 + 64, *shape))
    apply = jax.jit(lm.transform(model).apply, static_argnums=3)
    expected, _ = apply(variables, None, x, False)  # the rows are independent
    for start, stop in ((0, 1), (1, 8), (8, 72)):
        _close(loaded.call(x[start:stop]), expected[start:stop])


def test_artifact_runs_where_lamina_cannot_be_imported(convnet, convnet_artifact, tmp_path):
    model, variables = convnet
    x = _inputs((3, 8, 8, 1), seed=3)
    expected = np.asarray(lm.transform(model).apply(variables, None, x, False)[0])
    artifact = tmp_path / "convnet.stablehlo"
    artifact.write_bytes(convnet_artifact.serialize())
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(
        """
        import sys
        sys.modules["lamina"] = None  # the editable install would defeat `python -I`
        try:
            import lamina
        except ImportError:
            pass
        else:
            raise SystemExit("lamina was importable")
        import jax, numpy as np
        folder = sys.argv[1]
        with open(folder + "/convnet.stablehlo", "rb") as file:
            exported = jax.export.deserialize(bytearray(file.read()))
        y = exported.call(np.load(folder + "/x.npy"))
        np.testing.assert_allclose(np.asarray(y), np.load(folder + "/expected.npy"),
                                   rtol=1e-5, atol=1e-6)
        print("same outputs without lamina")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same outputs without lamina" in done.stdout


def test_dropout_in_training_mode_is_refused(mlp, tmp_path):
    model, variables = mlp
    path = tmp_path / "mlp.stablehlo"
    with pytest.raises(
        lm.ExportError,
        match=r"MLP draws random keys in Dropout at drop \(dropout on.*training mode.*"
        r"is_training=False.*allow_training=True",
    ) as caught:
        lm.export(model, variables, _inputs((2, 6)), True, path=path)
    assert isinstance(caught.value.__cause__, lm.RngError)
    assert os.listdir(tmp_path) == []


def test_batch_norm_in_training_mode_is_refused():
    model = Normed()
    variables = lm.init(model)(jax.random.key(0))
    with pytest.raises(
        lm.ExportError,
        match=r"updates batch_stats/bn/mean \(BatchNorm at bn, in training mode\).*"
        r"is_training=False.*allow_training=True",
    ):
        lm.export(model, variables, _inputs((4, 3)), True)


class Counts(lm.Module):
    def __init__(self):
        super().__init__()
        self.calls = lm.State("counts", (), lm.initializers.zeros(), mutable=True)

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return x


def test_other_state_updates_are_refused_too():
    model = Counts()
    with pytest.raises(
        lm.ExportError,
        match=r"updates counts/calls \(Counts at <root>, a variable outside the decoding "
        r"caches\).*allow_training=True",
    ):
        lm.export(model, lm.init(model)(jax.random.key(0)), _inputs((2,)))


def test_allow_training_takes_a_key_and_returns_the_updated_collections():
    model = Normed()
    variables = lm.init(model)(jax.random.key(0))
    x, key = _inputs((4, 3)), jax.random.key(5)
    exported = _round_trip(lm.export(model, variables, x, True, allow_training=True))
    outputs, updated = exported.call(key, x)
    expected, new = lm.transform(model).apply(variables, key, x, True)
    _close(outputs, expected)
    assert set(updated) == {"batch_stats"}
    jax.tree.map(_close, updated["batch_stats"], new["batch_stats"])

    mlp = MLP()
    mlp_variables = lm.init(mlp)(jax.random.key(0))
    exported = lm.export(mlp, mlp_variables, _inputs((2, 6)), True, allow_training=True)
    outputs, updated = exported.call(key, _inputs((2, 6)))
    expected, _ = lm.transform(mlp).apply(mlp_variables, key, _inputs((2, 6)), True)
    _close(outputs, expected)
    assert updated == {}
    assert not np.allclose(outputs, exported.call(jax.random.key(6), _inputs((2, 6)))[0])


def test_decoding_cache_is_an_input_and_an_output():
    model = lm.MultiHeadAttention(num_heads=2, in_size=8, decode_shape=(2, 4))
    variables = lm.init(model)(jax.random.key(0))
    step = lambda m: lambda x: m(x, decode=True)  # noqa: E731
    x1, x2 = _inputs((2, 1, 8), seed=1), _inputs((2, 1, 8), seed=2)
    exported = _round_trip(lm.export(model, variables, x1, to_callable=step))
    cache = {"cache": variables["cache"]}
    y1, cache = exported.call(cache, x1)
    y2, cache = exported.call(cache, x2)
    apply = jax.jit(lm.transform(model, step).apply)
    expected1, state = apply(variables, None, x1)
    expected2, state = apply(state, None, x2)
    _close(y1, expected1)
    _close(y2, expected2)
    assert int(cache["cache"]["cache_index"]) == 2
    jax.tree.map(_close, cache["cache"], state["cache"])
    # past max_length (4): NaN, the cached keys kept, but cache_index advances (documented)
    for x in (x1, x2):
        _, cache = exported.call(cache, x)
    full = cache["cache"]
    y5, cache = exported.call(cache, x1)
    assert np.isnan(np.asarray(y5)).all() and int(cache["cache"]["cache_index"]) == 5
    _close(cache["cache"]["cached_key"], full["cached_key"])
    # with the variables as an input too, the cache is its own input and not theirs
    info = inference_function(model, variables, (x1,), to_callable=step, with_variables=False)
    assert set(info.specs[0]) == {"params"} and set(info.specs[1]) == {"cache"}
    assert info.output_names[0] == "output" and "updated/cache/cache_index" in info.output_names


def test_platforms_cuda_lowers_here_and_runs_on_cpu(mlp):
    model, variables = mlp
    x = _inputs((2, 6))
    exported = lm.export(model, variables, x, False, platforms=("CPU", "cuda"))
    assert exported.platforms == ("cpu", "cuda")
    _close(_round_trip(exported).call(x), lm.transform(model).apply(variables, None, x, False)[0])
    cuda_first = lm.export(model, variables, x, False, platforms=["cuda"])
    assert cuda_first.platforms == ("cuda", "cpu")


@pytest.mark.parametrize(
    ("platforms", "match"),
    [
        (("gpu",), r"'gpu' is ambiguous.*'cuda'.*'rocm'"),
        (("metal",), r"unknown platform 'metal'.*'cpu', 'cuda', 'rocm', 'tpu'"),
    ],
)
def test_unknown_platforms_are_refused(mlp, platforms, match, tmp_path):
    model, variables = mlp
    with pytest.raises(ValueError, match=match):
        lm.export(
            model, variables, _inputs((2, 6)), False, platforms=platforms, path=tmp_path / "m"
        )
    assert os.listdir(tmp_path) == []


def test_with_variables_false_takes_the_variables_first(mlp):
    model, variables = mlp
    x = _inputs((2, 6))
    exported = _round_trip(
        lm.export(model, variables, x, False, with_variables=False, batch_dims="b")
    )
    other = lm.init(model)(jax.random.key(7))
    apply = lm.transform(model).apply
    _close(exported.call(variables, x), apply(variables, None, x, False)[0])
    _close(exported.call(other, _inputs((5, 6))), apply(other, None, _inputs((5, 6)), False)[0])


def test_dict_outputs_and_pytree_inputs_keep_their_structure(mlp):
    model, variables = mlp

    def both(m):
        return lambda batch: {"logits": m(batch["x"], False), "scaled": 2 * batch["x"]}

    batch = {"x": _inputs((2, 6))}
    exported = _round_trip(lm.export(model, variables, batch, to_callable=both))
    out = exported.call(batch)
    expected, _ = lm.transform(model, both).apply(variables, None, batch)
    assert set(out) == {"logits", "scaled"}
    jax.tree.map(_close, out, expected)
    info = inference_function(model, variables, (batch,), to_callable=both)
    assert info.input_names == ("batch/x",)  # the leaves of a pytree input: name/<path>
    assert info.output_names == ("output/logits", "output/scaled")


class Pair(NamedTuple):
    logits: jax.Array
    hidden: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Result:
    logits: jax.Array


@pytest.mark.parametrize(("container", "name"), [(Pair, "Pair"), (Result, "Result")])
def test_unserializable_outputs_are_refused_before_lowering(mlp, container, name, tmp_path):
    model, variables = mlp

    def wrapped(m):
        if container is Pair:
            return lambda x: Pair(m(x, False), x)
        return lambda x: Result(m(x, False))

    with pytest.raises(lm.ExportError, match=rf"returns a {name}.*Return a tuple or dict"):
        lm.export(model, variables, _inputs((2, 6)), to_callable=wrapped, path=tmp_path / "m")
    assert os.listdir(tmp_path) == []


def test_wrong_example_arguments_wrap_the_layers_error(mlp, tmp_path):
    model, variables = mlp
    with pytest.raises(
        lm.ExportError,
        match=r"tracing MLP with the example arguments failed in Dense at hidden.*"
        r"in_size=6.*shapes \(2, 5\)",
    ) as caught:
        lm.export(model, variables, _inputs((2, 5)), False, path=tmp_path / "m")
    assert isinstance(caught.value.__cause__, ValueError)
    assert os.listdir(tmp_path) == []


def test_host_callbacks_are_refused(mlp, tmp_path):
    model, variables = mlp

    def printing(m):
        def call(x):
            jax.debug.print("x: {}", x)
            return m(x, False)

        return call

    with pytest.raises(lm.ExportError, match=r"MLP calls back into Python.*jax\.debug\.print"):
        lm.export(model, variables, _inputs((2, 6)), to_callable=printing, path=tmp_path / "m")
    assert os.listdir(tmp_path) == []


def test_variables_that_do_not_fit_raise_variables_error_unchanged(mlp, tmp_path):
    model, variables = mlp
    broken = {"params": {k: v for k, v in variables["params"].items() if k != "out"}}
    with pytest.raises(lm.VariablesError, match=r"missing.*params/out/kernel"):
        lm.export(model, broken, _inputs((2, 6)), False, path=tmp_path / "m")
    with pytest.raises(TypeError, match=r"variables must be the dict that init returns"):
        lm.export(model, [variables], _inputs((2, 6)), False)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("batch_dims", "match"),
    [
        ("1b", r"batch_dims for input 0 \(x\) is '1b'"),
        (("b", "b"), r"batch_dims has 2 entries.*1 array input\(s\) \(x\)"),
        ("b, 4", r"batch_dims for input 0 \(x\) is 'b, 4', which does not fit its shape \(2, 6\)"),
        (3, r"batch_dims must be None, a string"),
    ],
)
def test_bad_batch_dims(mlp, batch_dims, match):
    model, variables = mlp
    with pytest.raises(ValueError, match=match):
        lm.export(model, variables, _inputs((2, 6)), False, batch_dims=batch_dims)


def test_example_arguments_float64_and_mixed(mlp):
    model, variables = mlp
    exported = lm.export(model, variables, np.ones((2, 6)), False)
    assert exported.in_avals[0].dtype == np.float32  # as JAX stores float64 with x64 off
    abstract = lm.export(model, variables, jax.ShapeDtypeStruct((3, 6), np.float32), False)
    assert abstract.in_avals[0].shape == (3, 6)
    with pytest.raises(TypeError, match=r"example argument 0 \(x\) mixes arrays and Python"):
        lm.export(model, variables, {"x": np.ones((2, 6)), "mode": "eval"}, False)


def test_paths_that_cannot_be_written(mlp, tmp_path, monkeypatch):
    model, variables = mlp
    x = _inputs((2, 6))
    missing = tmp_path / "nowhere" / "m.stablehlo"
    with pytest.raises(FileNotFoundError, match=r"folder .*nowhere.* does not exist"):
        lm.export(model, variables, x, False, path=missing)
    with pytest.raises(IsADirectoryError, match=rf"{re.escape(str(tmp_path))} is a folder"):
        lm.export(model, variables, x, False, path=tmp_path)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    folder = re.escape(str(tmp_path))
    with pytest.raises(PermissionError, match=rf"folder {folder} is not writable"):
        lm.export(model, variables, x, False, path=tmp_path / "m.stablehlo")
    assert os.listdir(tmp_path) == []


def test_nothing_half_written(mlp, tmp_path, monkeypatch):
    model, variables = mlp
    x = _inputs((2, 6))
    path = tmp_path / "m.stablehlo"
    path.write_bytes(b"the previous artifact")

    def fail(*args, **kwargs):
        raise RuntimeError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(jax.export.Exported, "serialize", fail)
        with pytest.raises(lm.ExportError, match=r"could not be serialized.*disk on fire"):
            lm.export(model, variables, x, False, path=path)
    assert os.listdir(tmp_path) == ["m.stablehlo"]
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")))
        with pytest.raises(OSError, match="No space"):
            lm.export(model, variables, x, False, path=path)
    assert os.listdir(tmp_path) == ["m.stablehlo"]
    assert path.read_bytes() == b"the previous artifact"
    lm.export(model, variables, x, False, path=path)
    assert os.listdir(tmp_path) == ["m.stablehlo"]
    _close(lm.load_exported(path).call(x), lm.transform(model).apply(variables, None, x, False)[0])


def test_load_exported_errors(mlp, tmp_path, monkeypatch):
    model, variables = mlp
    with pytest.raises(FileNotFoundError, match=r"no such file: .*absent"):
        lm.load_exported(tmp_path / "absent")
    with pytest.raises(IsADirectoryError, match=r"lm\.load_exported: .* is a folder"):
        lm.load_exported(tmp_path)
    garbage = tmp_path / "garbage.stablehlo"
    garbage.write_bytes(b"not an artifact at all" * 10)
    with pytest.raises(lm.ExportError, match=re.escape(f"{garbage} is not a jax.export artifact")):
        lm.load_exported(garbage)
    blob = lm.export(model, variables, _inputs((2, 6)), False).serialize()
    truncated = tmp_path / "truncated.stablehlo"
    truncated.write_bytes(bytes(blob[: len(blob) // 2]))
    pattern = re.escape(f"{truncated} is not a jax.export artifact") + ".*truncated"
    with pytest.raises(lm.ExportError, match=pattern):
        lm.load_exported(truncated)
    empty = tmp_path / "empty.stablehlo"
    empty.write_bytes(b"")
    with pytest.raises(lm.ExportError, match=r"is not a jax\.export artifact"):
        lm.load_exported(empty)
    whole = tmp_path / "whole.stablehlo"
    whole.write_bytes(bytes(blob))
    monkeypatch.setattr(jax.export, "maximum_supported_calling_convention_version", 1)
    with pytest.raises(lm.ExportError, match=r"calling convention \d+, but this JAX"):
        lm.load_exported(whole)


# -- the adversarial review's findings ---------------------------------------------------------


def test_weakly_typed_example_scalars_stay_weak():
    model = lm.Dense(3, 2, dtype=jnp.bfloat16)
    variables = lm.init(model)(jax.random.key(0))
    scaled = lambda m: lambda x, scale: m(x) * scale  # noqa: E731
    x, scale = _inputs((4, 3)), jnp.asarray(0.1)  # weakly typed, as apply sees it
    exported = lm.export(model, variables, x, scale, to_callable=scaled)
    assert exported.in_avals[1].weak_type and exported.out_avals[0].dtype == jnp.bfloat16
    expected = lm.transform(model, scaled).apply(variables, None, x, scale)[0]
    actual = exported.call(x, scale)
    assert actual.dtype == expected.dtype == jnp.bfloat16
    _close(actual.astype(jnp.float32), expected.astype(jnp.float32))
    weak = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
    info = inference_function(model, variables, (x, weak), to_callable=scaled)
    assert info.specs[1].weak_type and info.arguments[1].weak_type


class EvalBlock(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 3)
        self.bn = lm.BatchNorm(3)

    def __call__(self, x):
        return self.bn(self.dense(x), False)


class Rematted(lm.Module):
    def __init__(self):
        super().__init__()
        self.block = EvalBlock()

    def __call__(self, x):
        return lm.remat(lambda m, x: m(x))(self.block, x)


@pytest.mark.parametrize("kind", ["remat", "stack"])
def test_batch_norm_in_eval_mode_under_remat_is_not_training(kind):
    model = Rematted() if kind == "remat" else lm.Stack(EvalBlock(), 2, remat=True)
    variables = lm.init(model)(jax.random.key(0))
    x = _inputs((4, 3))
    expected, new = lm.transform(model).apply(variables, None, x)
    # apply hands back the leaves it did not write as it got them (lift/bind.store)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(variables), strict=True)
    )
    info = inference_function(model, variables, (x,))
    _close(jax.jit(info.fn)(x), expected)


def test_batch_dims_must_fit_the_rank_unless_it_ends_with_dots():
    model = lm.Embed(10, 4)
    variables = lm.init(model)(jax.random.key(0))
    ids = np.zeros((2, 6, 3), np.int32)
    with pytest.raises(
        ValueError, match=r"input 0 \(ids\) is 'b, t'.*shape \(2, 6, 3\).*2 axes for a rank-3"
    ):
        inference_function(model, variables, (ids,), batch_dims="b, t")
    info = inference_function(model, variables, (ids,), batch_dims="b, t, ...")
    assert str(info.specs[0].shape) == "(b, t, 3)"


def test_one_symbol_is_one_size_in_every_example():
    model = lm.Dense(8, 8)
    variables = lm.init(model)(jax.random.key(0))
    score = lambda m: lambda queries, keys: m(queries) @ keys.T  # keys: a table, no batch  # noqa: E731
    q, k = _inputs((4, 8)), _inputs((5, 8))
    with pytest.raises(
        ValueError,
        match=r"axis 0 of input 1 \(keys\) the symbolic size b, but it is 5 there and 4 in "
        r"axis 0 of input 0 \(queries\).*\('b', None\)",
    ):
        inference_function(model, variables, (q, k), to_callable=score, batch_dims="b")
    info = inference_function(model, variables, (q, k), to_callable=score, batch_dims=("b", None))
    assert str(info.specs[0].shape) == "(b, 8)" and info.specs[1].shape == (5, 8)


def test_lists_of_numbers_and_batch_dims_without_array_inputs_are_refused():
    model = lm.Embed(10, 4)
    variables = lm.init(model)(jax.random.key(0))
    with pytest.raises(TypeError, match=r"argument 0 \(ids\) is a list of numbers.*np\.asarray"):
        lm.export(model, variables, [[1, 2, 3]])
    count = lambda m: lambda n: m(jnp.zeros((n, 3), jnp.int32))  # noqa: E731
    with pytest.raises(ValueError, match=r"batch_dims='b'.*no example argument is an array"):
        lm.export(model, variables, 2, to_callable=count, batch_dims="b")


def test_default_platforms_add_this_machines_accelerator(monkeypatch):
    from lamina.deploy.stablehlo import check_platforms

    assert check_platforms(None, "lm.export")[0] == "cpu"
    monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cuda")
    assert check_platforms(None, "lm.export") == ("cpu", "cuda")
    model = lm.Dense(3, 2)
    exported = lm.export(model, lm.init(model)(jax.random.key(0)), _inputs((1, 3)))
    assert exported.platforms == ("cpu", "cuda")
    monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cpu")
    assert check_platforms(None, "lm.export") == ("cpu",)


def test_symbolic_shape_dtype_struct_examples():
    model = lm.Sequential(lm.Dense(3, 8), lm.relu, lm.Dense(8, 2))
    variables = lm.init(model)(jax.random.key(0))
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)
    exported = lm.export(model, variables, spec)
    x = _inputs((5, 3))
    _close(exported.call(x), lm.transform(model).apply(variables, None, x)[0])
    info = inference_function(model, variables, (spec,))
    with pytest.raises(lm.ExportError, match=r"export: x is a ShapeDtypeStruct of the symbolic"):
        _ = info.arguments
    with pytest.raises(ValueError, match=r"already has the symbolic shape \(n, 3\).*give None"):
        lm.export(model, variables, spec, batch_dims="b")


@pytest.mark.parametrize(
    ("example", "match"),
    [
        ({0: np.ones((2, 3), np.float32)}, r"argument 0 \(a\) is a dict with the key 0"),
        (Pair(np.ones((2, 3), np.float32), np.ones(1)), r"argument 0 \(a\) is a Pair"),
    ],
)
def test_inputs_an_artifact_cannot_hold_are_refused_before_tracing(example, match, tmp_path):
    model = lm.Dense(3, 2)
    variables = lm.init(model)(jax.random.key(0))
    first = lambda m: lambda a: m(jax.tree.leaves(a)[0])  # noqa: E731
    with pytest.raises(lm.ExportError, match=match + r".*Pass a tuple or dict"):
        lm.export(model, variables, example, to_callable=first, path=tmp_path / "m")
    assert os.listdir(tmp_path) == []


class Sows(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 2)

    def __call__(self, x):
        y = self.dense(x)
        lm.sow("y", y)
        return y


def test_sown_records_are_refused_or_returned_with_allow_training():
    model = Sows()
    variables = {**lm.init(model)(jax.random.key(0)), "intermediates": {}}
    x = _inputs((4, 3))
    with pytest.raises(lm.ExportError, match=r"records intermediates/y/0 \(lm\.sow.*out of the"):
        lm.export(model, variables, x)
    with pytest.raises(lm.ExportError, match=r"records intermediates") as caught:
        inference_function(model, variables, (x,), where="lm.export_onnx")
    assert "allow_training" not in str(caught.value)
    info = inference_function(model, variables, (x,), allow_training=True)
    outputs, updated = jax.jit(info.fn)(jax.random.key(0), x)
    expected, new = lm.transform(model).apply(variables, None, x)
    _close(outputs, expected)
    _close(updated["intermediates"]["y"][0], new["intermediates"]["y"][0])


def test_allow_training_artifacts_do_not_recheck_batch_sizes():
    model = Normed()
    variables = lm.init(model)(jax.random.key(0))
    exported = lm.export(
        model, variables, _inputs((4, 3)), True, allow_training=True, batch_dims="b"
    )
    one = _inputs((1, 3))
    with pytest.raises(ValueError, match=r"BatchNorm.*while training"):
        lm.transform(model).apply(variables, None, one, True)
    outputs, _ = exported.call(jax.random.key(0), one)  # runs: batch variance 0 (documented)
    assert np.isfinite(np.asarray(outputs)).all()


class Noise(lm.Module):
    def __init__(self):
        super().__init__()
        self.dense = lm.Dense(3, 2)

    def __call__(self, x):
        return self.dense(x) + jax.random.normal(lm.next_rng_key("noise"), (2,))


def test_messages_name_the_sampling_layer_and_abstract_variables(mlp):
    model = Noise()
    with pytest.raises(
        lm.ExportError,
        match=r"Noise draws random keys in Noise at <root> \(dropout on, or another layer",
    ):
        lm.export(model, lm.init(model)(jax.random.key(0)), _inputs((4, 3)))
    mlp_model, mlp_variables = mlp
    with pytest.raises(lm.ExportError, match=r"training mode") as caught:
        inference_function(
            mlp_model, mlp_variables, (_inputs((2, 6)), True), where="lm.export_onnx"
        )
    assert "allow_training" not in str(caught.value)
    dense = lm.Dense(3, 2)
    abstract = jax.eval_shape(lm.transform(dense).init, jax.random.key(0))
    with pytest.raises(
        lm.ExportError,
        match=r"lm\.export: the variables hold a ShapeDtypeStruct at "
        r"params/bias.*with_variables=False",
    ):
        lm.export(dense, abstract, _inputs((4, 3)))
    info = inference_function(dense, abstract, (_inputs((4, 3)),), with_variables=False)
    assert info.specs[0]["params"]["kernel"].shape == (3, 2)


def test_the_exported_function_is_named_after_the_model(mlp):
    model, variables = mlp
    info = inference_function(model, variables, (_inputs((2, 6)), False))
    assert info.fn.__name__ == "MLP"
    assert lm.export(model, variables, _inputs((2, 6)), False).fun_name == "MLP"
