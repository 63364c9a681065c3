"""lm.shardings and the layers' logical axis names.

The specs are built against an `AbstractMesh` of 2x4 devices (no devices needed), so they
run in this process, which has one device. What needs eight devices (variables created
sharded, a data- and tensor-parallel training step equal to one device's, BatchNorm under
`shard_map`, the sharded example) runs in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: tests/sharding_devices.py.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lamina as lm
from tests.layer_table import LAYERS

ROOT = pathlib.Path(__file__).parents[1]
MESH = AbstractMesh((2, 4), ("data", "model"))
RULES = {"batch": "data", "embed": None, "mlp": "model", "heads": "model", "vocab": "model"}


def specs(model, rules=RULES, mesh=MESH):
    """The PartitionSpec of each variable, by its flat key ``params/layer/kernel``."""
    tree = lm.shardings(model, mesh, rules)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(k.key for k in path): sharding.spec for path, sharding in flat}


# The subprocesses compile with XLA's backend optimisations off (as the marker
# ``fast_compile`` does, tests/conftest.py): their time is compiling many small programs,
# LLVM's passes are half of it, and the programs compute the same operations.
FAST_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def eight_device_env():
    flags = os.environ.get("XLA_FLAGS", "")
    return {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip(),
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        **FAST_COMPILE,
    }


# --- specs per variable ------------------------------------------------------------------


def test_dense_and_conv_specs():
    dense = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",))
    assert specs(dense) == {"params/kernel": P(None, "model"), "params/bias": P("model")}
    conv = lm.Conv(3, 8, (3, 3), kernel_sharding=(None, None, "embed", "mlp"))
    assert specs(conv) == {"params/kernel": P(None, None, None, "model"), "params/bias": P(None)}


def test_embed_spec():
    embed = lm.Embed(16, 4, embedding_sharding=("vocab", "embed"))
    assert specs(embed) == {"params/embedding": P("model", None)}
    assert specs(lm.Embed(16, 4)) == {"params/embedding": P(None, None)}


def test_multi_head_attention_specs_per_projection():
    mha = lm.MultiHeadAttention(
        4,
        8,
        kernel_sharding=("embed", "heads", "kv"),
        bias_sharding=("heads", "kv"),
        out_kernel_sharding=("heads", "kv", "embed"),
        out_bias_sharding=("embed",),
    )
    got = specs(mha)
    for name in ("query", "key", "value"):
        assert got[f"params/{name}/kernel"] == P(None, "model", None)
        assert got[f"params/{name}/bias"] == P("model", None)
    assert got["params/out/kernel"] == P("model", None, None)
    assert got["params/out/bias"] == P(None)
    # the output kernel is not derived from kernel_sharding: left out, it is replicated
    alone = lm.MultiHeadAttention(4, 8, kernel_sharding=("embed", "heads", "kv"))
    assert specs(alone)["params/out/kernel"] == P(None, None, None)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: lm.LayerNorm(8, **kw),
        lambda **kw: lm.GroupNorm(2, 8, **kw),
        lambda **kw: lm.InstanceNorm(8, **kw),
    ],
    ids=["LayerNorm", "GroupNorm", "InstanceNorm"],
)
def test_norm_specs(make):
    norm = make(scale_sharding=("mlp",), bias_sharding=("embed",))
    assert specs(norm) == {"params/scale": P("model"), "params/bias": P(None)}


def test_rms_norm_spec_and_its_arguments():
    assert specs(lm.RMSNorm(8, scale_sharding=("mlp",))) == {"params/scale": P("model")}
    with pytest.raises(TypeError, match="bias_sharding"):
        lm.RMSNorm(8, bias_sharding=("mlp",))  # RMSNorm has no bias


def test_batch_norm_statistics_follow_the_scale():
    norm = lm.BatchNorm((4, 8), axis=(-2, -1), scale_sharding=(None, "mlp"))
    assert specs(norm) == {
        "params/scale": P(None, "model"),
        "params/bias": P(None, None),
        "batch_stats/mean": P(None, "model"),
        "batch_stats/var": P(None, "model"),
    }


def test_stack_puts_the_depth_name_in_front():
    block = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",))
    unsharded = lm.Stack(block, 2)
    assert specs(unsharded) == {
        "params/block/kernel": P(None, None, "model"),
        "params/block/bias": P(None, "model"),
    }
    block = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"))
    stack = lm.Stack(block, 2, depth_sharding="layers")
    assert specs(stack, {**RULES, "layers": "data"})["params/block/kernel"] == P(
        "data", None, "model"
    )
    # a stack of stacks: one name per leading axis, outermost first
    inner = lm.Stack(lm.Dense(4, 4, kernel_sharding=("embed", None)), 4, depth_sharding="inner")
    outer = lm.Stack(inner, 2, depth_sharding="outer")
    got = specs(outer, {"outer": "data", "inner": "model"})
    assert got["params/block/block/kernel"] == P("data", "model", None, None)
    assert got["params/block/block/bias"] == P("data", "model", None)


def test_leading_axes_without_names_replicate():
    # A Stack without depth_sharding stores its axis without a logical name.
    dense = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"))
    unnamed = lm.Stack(dense, 3)
    assert specs(unnamed) == {
        "params/block/kernel": P(None, None, "model"),
        "params/block/bias": P(None, None),
    }
    stacked = lm.Stack(unnamed, 2, depth_sharding="layers")
    got = specs(stacked, {"layers": "data", "mlp": "model"})
    assert got["params/block/block/kernel"] == P("data", None, None, "model")


def test_lora_adapters_take_the_base_kernel_names():
    lora = lm.LoRA(lm.Dense(8, 16, kernel_sharding=("embed", "mlp")), rank=2)
    got = specs(lora)
    assert got["params/base/kernel"] == P(None, "model")
    assert got["params/lora_a"] == P(None, None)
    assert got["params/lora_b"] == P(None, "model")
    conv = lm.LoRA(lm.Conv(4, 8, (3,), kernel_sharding=(None, "mlp", "heads")), rank=2)
    got = specs(conv, {"mlp": "data", "heads": "model"})
    assert got["params/lora_a"] == P(None, "data", None)
    assert got["params/lora_b"] == P(None, "model")
    assert specs(lm.LoRA(lm.Dense(8, 16), rank=2))["params/lora_b"] == P(None, None)


def test_rules_as_pairs_first_wins_and_tuples_of_mesh_axes():
    model = lm.Dense(8, 16, kernel_sharding=("embed", "mlp"))
    pairs = [("mlp", ("data", "model")), ("mlp", "data"), ("embed", None)]
    assert specs(model, pairs)["params/kernel"] == P(None, ("data", "model"))
    assert specs(model, {"mlp": ["data", "model"]})["params/kernel"] == P(None, ("data", "model"))


def test_names_without_rules_and_unnamed_axes_replicate():
    model = lm.Sequential(
        lm.Dense(4, 8, kernel_sharding=("embed", "hidden")),  # "hidden": no rule
        lm.Dense(8, 4),  # no names at all
    )
    got = specs(model, {"mlp": "model"})
    assert set(got.values()) == {P(None, None), P(None)}
    assert specs(model, {}) == got


def test_tied_variables_appear_once():
    class Tied(lm.Module):
        def __init__(self):
            super().__init__()
            self.embed = lm.Embed(16, 4, embedding_sharding=("vocab", "embed"))
            self.again = self.embed

    assert specs(Tied()) == {"params/embed/embedding": P("model", None)}


def test_a_parameter_declared_directly():
    class Model(lm.Module):
        def __init__(self):
            super().__init__()
            self.w = lm.Parameter((8, 4), lm.initializers.zeros(), sharding=("mlp", None))
            self.count = lm.State("counters", (), lm.initializers.zeros(), jnp.int32)

    assert specs(Model()) == {"params/w": P("model", None), "counters/count": P()}


def test_shardings_is_the_variables_layout():
    model = lm.Sequential(lm.Dense(4, 8, kernel_sharding=("embed", "mlp")), lm.BatchNorm(8))
    tree = lm.shardings(model, MESH, RULES)
    shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
    assert jax.tree.structure(tree) == jax.tree.structure(shapes)
    assert all(isinstance(s, NamedSharding) and s.mesh == MESH for s in jax.tree.leaves(tree))


def test_every_layer_of_the_table_gets_a_tree_in_its_variables_layout():
    """Every layer, its names left out: one replicated sharding per variable, no more."""
    for case in LAYERS:
        model = case.make(jnp.float32, None)
        tree = lm.shardings(model, MESH, RULES)
        shapes = jax.eval_shape(lm.transform(model).init, jax.random.key(0))
        expected = jax.tree.map(lambda s: P(*(None,) * len(s.shape)), shapes)
        assert jax.tree.map(lambda s: s.spec, tree) == expected, case.name


def test_jit_init_with_out_shardings_on_one_device():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    model = lm.Stack(lm.Dense(4, 8, kernel_sharding=("embed", "mlp")), 2)
    tree = lm.shardings(model, mesh, RULES)
    init = lm.transform(model).init
    variables = jax.jit(init, out_shardings=tree)(jax.random.key(0))
    assert jax.tree.map(lambda a: a.sharding, variables) == tree
    expected = jax.jit(init)(jax.random.key(0))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(expected), strict=True)
    )


# --- errors ---------------------------------------------------------------------------


def test_a_rule_naming_a_missing_mesh_axis():
    model = lm.Sequential(lm.Dense(4, 8, kernel_sharding=("embed", "mlp")))
    with pytest.raises(ValueError, match=r"params/layers_0/kernel \(shape \(4, 8\).*'mlp' -> "
                       r"'modle'.*no axis 'modle' \(did you mean 'model'\?\)"):  # fmt: skip
        lm.shardings(model, MESH, {"mlp": "modle"})
    # a rule that no variable uses may name any axis (one table serves several meshes)
    assert specs(model, {"mlp": "model", "batch": "pipeline"})


def test_two_dimensions_on_one_mesh_axis():
    model = lm.Dense(8, 8, kernel_sharding=("embed", "mlp"))
    with pytest.raises(ValueError, match=r"params/kernel.*dimensions 0 and 1 .* mesh axis 'model'"):
        lm.shardings(model, MESH, {"embed": "model", "mlp": "model"})
    with pytest.raises(ValueError, match=r"dimensions 0 and 1 .* mesh axis 'data'"):
        lm.shardings(model, MESH, {"embed": "data", "mlp": ("model", "data")})


def test_a_dimension_the_mesh_axes_do_not_divide():
    model = lm.Dense(4, 6, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",))
    match = r"params/bias \(shape \(6,\).*size 6.*'mlp' -> 'model'.*4 devices"
    with pytest.raises(ValueError, match=match):
        lm.shardings(model, MESH, {"mlp": "model"})
    with pytest.raises(ValueError, match=r"size 6.*\('data', 'model'\).*8 devices"):
        lm.shardings(model, MESH, {"mlp": ("data", "model")})
    stack = lm.Stack(lm.Dense(4, 4), 3, depth_sharding="layers")
    with pytest.raises(ValueError, match=r"params/block/bias \(shape \(3, 4\).*dimension 0"):
        lm.shardings(stack, MESH, {"layers": "data"})


def test_a_misspelt_rule_is_not_silently_ignored():
    model = lm.Dense(4, 8, kernel_sharding=("embed", "mlp"))
    with pytest.raises(ValueError, match=r"params/kernel has the logical axis 'mlp'.*'mpl'"):
        lm.shardings(model, MESH, {"mpl": "model"})
    # replicating it on purpose is said with None
    assert specs(model, {"mpl": "model", "mlp": None})["params/kernel"] == P(None, None)


@pytest.mark.parametrize(
    "rules, match",
    [
        (None, "Pass {} to replicate"),
        ("mlp", "rules must map"),
        ([("mlp",)], r"rule 0 is \('mlp',\)"),
        ({3: "model"}, "maps 3"),
        ({"mlp": 4}, "rule for 'mlp' maps it to 4"),
        ({"mlp": ("model", "model")}, "distinct mesh axis names"),
    ],
)
def test_malformed_rules(rules, match):
    with pytest.raises(TypeError, match=match):
        lm.shardings(lm.Dense(4, 8, kernel_sharding=("embed", "mlp")), MESH, rules)


def test_not_a_mesh_or_not_a_model():
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        lm.shardings(lm.Dense(2, 2), ("data", "model"), RULES)
    with pytest.raises(TypeError, match=r"expected an lm\.Module"):
        lm.shardings({"params": {}}, MESH, RULES)


@pytest.mark.parametrize(
    "sharding",
    ["em", ("embed",), ("embed", ("data", "model")), (None, 3)],
    ids=["str", "too-few", "mesh-axes", "int"],
)
def test_a_declaration_edited_after_construction_is_checked(sharding):
    model = lm.Dense(4, 8)
    model.kernel.sharding = sharding
    with pytest.raises(TypeError, match=r"params/kernel \(shape \(4, 8\)\) has sharding="):
        lm.shardings(model, MESH, RULES)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: lm.Embed(4, 2, embedding_sharding=("vocab",)), ValueError, "embedding_sharding"),
        (lambda: lm.Embed(4, 2, embedding_sharding="vocab"), TypeError, "embedding_sharding"),
        (lambda: lm.LayerNorm(4, scale_sharding=("a", "b")), ValueError, "scale_sharding"),
        (lambda: lm.LayerNorm((2, 4), feature_axes=(-2, -1), bias_sharding=("a",)), ValueError,
         "bias_sharding names one logical axis per dimension of a 2-dimensional"),
        (lambda: lm.GroupNorm(2, 4, bias_sharding=[1]), TypeError, "bias_sharding"),
        (lambda: lm.InstanceNorm(4, scale_sharding="embed"), TypeError, "scale_sharding"),
        (lambda: lm.BatchNorm(4, scale_sharding=(None, None)), ValueError, "scale_sharding"),
        (lambda: lm.MultiHeadAttention(2, 4, kernel_sharding=("embed", "heads")), ValueError,
         "kernel_sharding names one logical axis per dimension of a 3-dimensional"),
        (lambda: lm.MultiHeadAttention(2, 4, bias_sharding=("heads",)), ValueError,
         "bias_sharding"),
        (lambda: lm.MultiHeadAttention(2, 4, out_kernel_sharding=("a", "b")), ValueError,
         "out_kernel_sharding"),
        (lambda: lm.MultiHeadAttention(2, 4, out_bias_sharding=("a", "b")), ValueError,
         "out_bias_sharding"),
        (lambda: lm.Stack(lm.Dense(2, 2), 2, depth_sharding=("layers",)), TypeError,
         "depth_sharding must be None or one logical axis name"),
    ],
)  # fmt: skip
def test_layer_sharding_arguments_are_checked(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_stack_depth_sharding_is_read_only():
    stack = lm.Stack(lm.Dense(2, 2), 2, depth_sharding="layers")
    with pytest.raises(AttributeError, match="depth_sharding is read-only"):
        stack.depth_sharding = None


# --- on eight devices -------------------------------------------------------------------


def test_on_eight_host_devices():
    """Sharded init, a 2x4 data+tensor-parallel adamw step equal to one device's, BatchNorm
    under shard_map, a divisibility error on a real mesh, on jax.make_mesh's default
    Explicit axes the same step and a depth-sharded Stack, and lm.pmean's one all-reduce
    per dtype (tests/sharding_devices.py)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sharding_devices.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=eight_device_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert result.stdout.split() == [
        "ok",
        "init_is_sharded",
        "ok",
        "training_step_matches_one_device",
        "ok",
        "batch_norm_under_shard_map",
        "ok",
        "errors_on_a_real_mesh",
        "ok",
        "explicit_mesh_training_step_matches_one_device",
        "ok",
        "explicit_mesh_depth_sharded_stack",
        "ok",
        "explicit_mesh_conv_training_step_matches_one_device",
        "ok",
        "pmean_is_one_all_reduce",
    ]


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def test_sharded_training_example_end_to_end(tmp_path):
    """examples/sharded_training.py on its own 8 host devices (it asks XLA for them)."""
    path = tmp_path / "text.txt"
    path.write_text(TEXT * 30, encoding="utf-8")
    args = [
        *("--data", str(path), "--layers", "1", "--heads", "4", "--width", "16"),
        *("--block-size", "8", "--batch-size", "4", "--iters", "30", "--eval-interval", "15"),
        *("--eval-batches", "1", "--warmup-iters", "5", "--lr", "1e-2", "--quiet"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **FAST_COMPILE}
    env.pop("XLA_FLAGS", None)
    script = str(ROOT / "examples" / "sharded_training.py")
    result = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    lines = result.stdout.rstrip("\n").split("\n")
    assert "mesh: 2 x 4 CPU devices (data x model)" in lines
    assert "blocks/block/mlp_in/kernel (1, 16, 64): P(None, None, 'model'), (1, 16, 16)" in (
        result.stdout
    )
    assert lines[-2].endswith("weight shardings kept")
    losses = [float(x) for x in re.findall(r"val loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5  # it learns
    assert re.fullmatch(r"val loss: \d+\.\d{4}", lines[-1])
    assert lines[-1] == f"val loss: {losses[-1]:.4f}"
    # the same run on one device (a 1 x 1 mesh): the same losses, to float32 rounding
    one = subprocess.run(
        [sys.executable, script, *args, "--data-parallel", "1", "--model-parallel", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert "mesh: 1 x 1 CPU devices (data x model)" in one.stdout, one.stderr[-3000:]
    one_losses = [float(x) for x in re.findall(r"val loss (\d+\.\d+)", one.stdout)]
    np.testing.assert_allclose(one_losses, losses, rtol=1e-3)
    # a mesh that does not fit: a clear error, not a traceback
    bad = subprocess.run(
        [sys.executable, script, *args, "--data-parallel", "3", "--model-parallel", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode != 0
    assert "error: --data-parallel 3 does not divide --batch-size 4" in bad.stderr
