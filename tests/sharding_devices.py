"""Checks of sharding on 8 CPU host devices, run by tests/test_sharding.py in a subprocess.

JAX reads ``--xla_force_host_platform_device_count`` when it starts, and the test suite's
own process has one device, so these checks run in a process of their own:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_devices.py

Each check asserts; the script prints one ``ok <name>`` line per check and exits non-zero at
the first failure. It runs under the suite's strict settings (dtype and rank promotion).
"""

from __future__ import annotations

import math
import re
import sys

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lamina as lm  # noqa: E402

VOCAB, WIDTH, HEADS, HIDDEN, DEPTH = 32, 16, 4, 64, 2
RULES = {"batch": "data", "vocab": "model", "heads": "model", "mlp": "model", "layers": None}


class Block(lm.Module):
    """A pre-norm transformer block whose every variable has logical axis names."""

    def __init__(self) -> None:
        super().__init__()
        embed = ("embed",)
        self.attention_norm = lm.LayerNorm(WIDTH, scale_sharding=embed, bias_sharding=embed)
        self.attention = lm.MultiHeadAttention(
            HEADS,
            WIDTH,
            kernel_sharding=("embed", "heads", "kv"),
            bias_sharding=("heads", "kv"),
            out_kernel_sharding=("heads", "kv", "embed"),
            out_bias_sharding=embed,
        )
        self.mlp_norm = lm.RMSNorm(WIDTH, scale_sharding=embed)
        self.mlp_in = lm.Dense(
            WIDTH, HIDDEN, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",)
        )
        self.mlp_out = lm.Dense(
            HIDDEN, WIDTH, kernel_sharding=("mlp", "embed"), bias_sharding=embed
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), causal=True)
        return x + self.mlp_out(lm.relu(self.mlp_in(self.mlp_norm(x))))


class Transformer(lm.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = lm.Embed(VOCAB, WIDTH, embedding_sharding=("vocab", "embed"))
        self.blocks = lm.Stack(Block(), DEPTH, depth_sharding="layers")
        self.head = lm.LoRA(
            lm.Dense(WIDTH, VOCAB, kernel_sharding=("embed", "vocab")),
            rank=4,
            b_init=lm.initializers.normal(0.1),
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.head(self.blocks(self.embed(ids)))


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def close(a: object, b: object, what: str, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    def check(path: tuple, x: jax.Array, y: jax.Array) -> None:
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=f"{what} {path}"
        )

    jax.tree_util.tree_map_with_path(check, a, b)


def check_init_is_sharded() -> None:
    """jit(init, out_shardings=...) makes each variable with its spec, never whole."""
    mesh = auto_mesh((2, 4), ("data", "model"))
    model = Transformer()
    tree = lm.shardings(model, mesh, RULES)
    init = lm.transform(model).init
    jitted = jax.jit(init, out_shardings=tree)
    variables = jitted(jax.random.key(0))
    expected = {
        ("embed", "embedding"): P("model", None),
        ("blocks", "block", "attention", "query", "kernel"): P(None, None, "model", None),
        ("blocks", "block", "attention", "query", "bias"): P(None, "model", None),
        ("blocks", "block", "attention", "out", "kernel"): P(None, "model", None, None),
        ("blocks", "block", "attention", "out", "bias"): P(None, None),
        ("blocks", "block", "attention_norm", "scale"): P(None, None),
        ("blocks", "block", "mlp_in", "kernel"): P(None, None, "model"),
        ("blocks", "block", "mlp_in", "bias"): P(None, "model"),
        ("blocks", "block", "mlp_out", "kernel"): P(None, "model", None),
        ("head", "base", "kernel"): P(None, "model"),
        ("head", "base", "bias"): P(None),
        ("head", "lora_a"): P(None, None),
        ("head", "lora_b"): P(None, "model"),
    }
    for path, spec in expected.items():
        array = variables["params"]
        for key in path:
            array = array[key]
        assert array.sharding == NamedSharding(mesh, spec), (path, array.sharding, spec)
    # every variable has the sharding asked for, and the values of an unsharded init
    shardings_of = jax.tree.map(lambda a: a.sharding, variables)
    assert shardings_of == tree
    # the same values as the same program on one device (eager init rounds a normal draw
    # differently in the last bit: XLA fuses the jitted inverse erf)
    one = jax.jit(init)
    close(variables, one(jax.random.key(0)), "sharded init", rtol=0, atol=0)
    close(variables, init(jax.random.key(0)), "sharded init", rtol=1e-6, atol=0)
    # The compiled program (one per device, after GSPMD) holds the shards' shapes and never
    # a whole sharded array: mlp_in's kernel is (2, 16, 64) stacked, 16 columns per device.
    text = jitted.lower(jax.random.key(0)).compile().as_text()
    shapes = set(re.findall(r"f32\[([\d,]*)\]", text))
    assert "2,16,16" in shapes, sorted(shapes)
    # nor the whole of mlp_in's kernel, the embedding, or a query kernel (2, 16, 4, 4)
    assert not shapes & {"2,16,64", "32,16", "2,16,4,4"}, sorted(shapes)
    print("ok init_is_sharded")


def loss_fn(apply: object, params: dict, ids: jax.Array, targets: jax.Array) -> jax.Array:
    logits, _ = apply({"params": params}, None, ids)  # type: ignore[operator]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def without_key_bias(params: dict) -> dict:
    def keep(path: tuple, leaf: jax.Array) -> jax.Array | None:
        return None if jax.tree_util.keystr(path).endswith("['key']['bias']") else leaf

    return jax.tree_util.tree_map_with_path(keep, params)


def check_training_step_matches_one_device() -> None:
    """Data- and tensor-parallel adamw steps on a 2x4 mesh give one device's numbers."""
    mesh = auto_mesh((2, 4), ("data", "model"))
    model = Transformer()
    init, apply = lm.transform(model)
    optimizer = optax.adamw(1e-2)

    def step(params: dict, opt_state: object, ids: jax.Array, targets: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(apply, p, ids, targets))(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, VOCAB, (8, 6)).astype(np.int32), rng.integers(0, VOCAB, (8, 6)))
        for _ in range(2)
    ]

    # one device
    one = jax.devices()[0]
    params = jax.device_put(init(jax.random.key(1))["params"], one)
    opt_state = optimizer.init(params)
    single = jax.jit(step)
    reference = []
    for ids, targets in batches:
        params, opt_state, loss, grads = single(params, opt_state, ids, targets.astype(np.int32))
        reference.append((params, opt_state, loss, grads))

    # the mesh: weights as the rules say, Adam's moments like the weights, the batch split
    tree = lm.shardings(model, mesh, RULES)["params"]
    params = jax.jit(lambda k: init(k)["params"], out_shardings=tree)(jax.random.key(1))
    replicated = NamedSharding(mesh, P())
    state_tree = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        tree,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=state_tree)(params)
    mu = opt_state[0].mu
    assert jax.tree.map(lambda a: a.sharding, mu) == tree
    batch = NamedSharding(mesh, P("data", None))
    sharded = jax.jit(step, out_shardings=(tree, state_tree, replicated, tree))
    for (ids, targets), expected in zip(batches, reference, strict=True):
        ids, targets = jax.device_put((ids, targets.astype(np.int32)), batch)
        params, opt_state, loss, grads = sharded(params, opt_state, ids, targets)
        close((opt_state, loss, grads), expected[1:], "step")
        # The key projection's bias adds the same number to every score of a query, so its
        # gradient is zero but for rounding, which Adam scales up to steps of +-lr: it is the
        # one variable whose update differs (as it would between two runs on one device
        # with another summation order).
        key_bias = grads["blocks"]["block"]["attention"]["key"]["bias"]
        assert float(jnp.abs(key_bias).max()) < 1e-6
        close(without_key_bias(params), without_key_bias(expected[0]), "updated params")
    assert jax.tree.map(lambda a: a.sharding, params) == tree
    lora_b = params["head"]["lora_b"]
    assert lora_b.sharding.spec == P(None, "model") and len(lora_b.addressable_shards) == 8
    assert lora_b.addressable_shards[0].data.shape == (4, VOCAB // 4)
    print("ok training_step_matches_one_device")


def check_explicit_mesh_training_step_matches_one_device() -> None:
    """On jax.make_mesh's default Explicit axes: the same step, values and shardings.

    The layers resolve the shardings JAX asks for on explicit axes (a contraction over a
    sharded dimension, a lookup in a sharded table, the Stack's scan): the user passes none.
    """
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert set(mesh.axis_types) == {AxisType.Explicit}
    model = Transformer()
    init, apply = lm.transform(model)
    optimizer = optax.adamw(1e-2)
    gathered = NamedSharding(mesh, P("data", None, None))

    def step(params: dict, opt_state: object, ids: jax.Array, targets: jax.Array) -> tuple:
        def loss(p: dict) -> jax.Array:
            logits, _ = apply({"params": p}, None, ids)
            if jax.typeof(logits).sharding.mesh.explicit_axes:
                # optax's integer-label gather needs the vocabulary whole: the user's code
                logits = jax.sharding.reshard(logits, gathered)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        value, grads = jax.value_and_grad(loss)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (8, 6)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (8, 6)).astype(np.int32)
    params = jax.device_put(init(jax.random.key(1))["params"], jax.devices()[0])
    expected = jax.jit(step)(params, optimizer.init(params), ids, targets)

    tree = lm.shardings(model, mesh, RULES)["params"]
    params = jax.jit(lambda k: init(k)["params"], out_shardings=tree)(jax.random.key(1))
    assert jax.typeof(params["blocks"]["block"]["mlp_in"]["kernel"]).sharding.spec == P(
        None, None, "model"
    )
    batch = NamedSharding(mesh, P("data", None))
    ids, targets = jax.device_put((ids, targets), batch)
    with jax.set_mesh(mesh):  # optax makes its step count under the mesh
        opt_state = jax.jit(optimizer.init)(params)
        new_params, opt_state, loss, grads = jax.jit(step)(params, opt_state, ids, targets)
    close((opt_state, loss, grads), expected[1:], "explicit step")
    close(without_key_bias(new_params), without_key_bias(expected[0]), "explicit params")
    # the weights and their gradients keep the rules' shardings (the types say so)
    assert jax.tree.map(lambda a: a.sharding, new_params) == tree
    assert jax.tree.map(lambda a: a.sharding, grads) == tree
    print("ok explicit_mesh_training_step_matches_one_device")


def check_explicit_mesh_depth_sharded_stack() -> None:
    """A Stack whose depth is sharded on an explicit mesh: gathered for the scan, same values."""
    mesh = jax.make_mesh((2, 4), ("layers", "model"))
    model = lm.Stack(
        lm.Dense(8, 8, kernel_sharding=("embed", "mlp"), bias_sharding=("mlp",)),
        4,
        depth_sharding="depth",
    )
    init, apply = lm.transform(model)
    rules = {"depth": "layers", "mlp": "model"}
    x = np.random.default_rng(4).normal(size=(4, 8)).astype(np.float32)

    def loss(params: dict, x: jax.Array) -> jax.Array:
        y, _ = apply({"params": params}, None, x)
        return jnp.sum(y**2)

    params = init(jax.random.key(2))["params"]
    expected = jax.jit(jax.value_and_grad(loss))(params, x)
    tree = lm.shardings(model, mesh, rules)["params"]
    assert tree["block"]["kernel"].spec == P("layers", None, "model")
    sharded = jax.device_put(params, tree)
    value, grads = jax.jit(jax.value_and_grad(loss))(sharded, x)
    close((value, grads), expected, "depth-sharded Stack", rtol=1e-5, atol=1e-5)
    assert jax.tree.map(lambda a: a.sharding, grads) == tree
    print("ok explicit_mesh_depth_sharded_stack")


class ConvNet(lm.Module):
    """Every convolution, each fed the previous one's output channels (sharded over "mlp")."""

    def __init__(self) -> None:
        mlp = (None, None, "mlp")
        self.conv = lm.Conv(4, 8, 3, kernel_sharding=mlp, bias_sharding=("mlp",))
        self.up = lm.ConvTranspose(8, 8, 3, strides=2, kernel_sharding=(None, "mlp", None))
        self.flipped = lm.ConvTranspose(8, 8, 2, transpose_kernel=True, kernel_sharding=mlp)
        self.local = lm.ConvLocal(8, 4, 3, spatial_shape=20, kernel_sharding=mlp)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv(x))
        return self.local(self.flipped(self.up(h)))


def check_explicit_mesh_conv_training_step_matches_one_device() -> None:
    """Conv, ConvTranspose and ConvLocal on explicit axes: one device's step, same shardings."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = ConvNet()
    init, apply = lm.transform(model)

    def step(params: dict, x: jax.Array) -> tuple:
        def loss(p: dict) -> jax.Array:
            y, _ = apply({"params": p}, None, x)
            return jnp.mean(y**2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value, grads

    x = np.random.default_rng(5).normal(size=(8, 10, 4)).astype(np.float32)
    params = jax.device_put(init(jax.random.key(3))["params"], jax.devices()[0])
    expected = jax.jit(step)(params, x)
    tree = lm.shardings(model, mesh, RULES)["params"]
    assert tree["up"]["kernel"].spec == P(None, "model", None)
    sharded = jax.device_put(params, tree)
    x = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    got = jax.jit(step)(sharded, x)
    close(got, expected, "explicit conv step", rtol=1e-5, atol=1e-5)
    assert jax.tree.map(lambda a: a.sharding, got[2]) == tree
    y, _ = jax.jit(lambda p, x: apply({"params": p}, None, x))(sharded, x)
    assert jax.typeof(y).sharding.spec == P("data", None, "model")
    print("ok explicit_mesh_conv_training_step_matches_one_device")


def check_batch_norm_under_shard_map() -> None:
    """BatchNorm(axis_name="data") in shard_map normalises with the whole batch's stats."""
    mesh = auto_mesh((8,), ("data",))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 3)) * [1.0, 2.0, 3.0] + 1.0)
    x = x.astype(jnp.float32)

    def run(axis_name: str | None) -> tuple:
        init, apply = lm.transform(lm.BatchNorm(3, momentum=0.5, axis_name=axis_name))
        variables = init(jax.random.key(0))
        if axis_name is None:
            return apply(variables, None, x, True)

        def shard(variables: dict, x: jax.Array) -> tuple:
            return apply(variables, None, x, True)

        mapped = jax.shard_map(
            shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P())
        )
        return jax.jit(mapped)(variables, jax.device_put(x, NamedSharding(mesh, P("data"))))

    whole_y, whole = run(None)
    y, new = run("data")
    close((y, new), (whole_y, whole), "BatchNorm", rtol=1e-5, atol=1e-5)
    mean = np.asarray(new["batch_stats"]["mean"])
    np.testing.assert_allclose(mean, 0.5 * np.asarray(x).mean(0), rtol=1e-5)
    # Without axis_name each device would normalise with its own two examples' statistics.
    init, apply = lm.transform(lm.BatchNorm(3, momentum=0.5))
    local = jax.shard_map(
        lambda v, x: apply(v, None, x, True)[0],
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )(init(jax.random.key(0)), x)
    assert not np.allclose(np.asarray(local), np.asarray(whole_y), atol=1e-3)
    print("ok batch_norm_under_shard_map")


def check_pmean_is_one_all_reduce() -> None:
    """lm.pmean over 8 devices: lax.pmean's values, from one buffer per dtype (lax.pmean's
    own all-reduce has an operand per leaf)."""
    mesh = auto_mesh((8,), ("data",))
    rng = np.random.default_rng(3)
    tree = {
        "kernel": jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
        "scale": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
        "half": jnp.asarray(rng.normal(size=(8, 5)), jnp.bfloat16),
    }

    def mapped(mean: object) -> object:
        return jax.jit(
            jax.shard_map(
                lambda t: mean(jax.tree.map(lambda x: x[0], t), "data"),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )

    ours, theirs = mapped(lm.pmean), mapped(jax.lax.pmean)
    close(ours(tree), theirs(tree), "lm.pmean", rtol=1e-6, atol=1e-7)
    for name, leaf in ours(tree).items():
        assert leaf.shape == tree[name].shape[1:] and leaf.dtype == tree[name].dtype, name

    # One buffer per dtype, where lax.pmean's all-reduce has an operand per leaf (XLA may
    # combine all-reduces into one of several operands, and sums bfloat16 in float32).
    def operands(mean: object) -> list[int]:
        hlo = mapped(mean).lower(tree).compile().as_text()
        shapes = re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", hlo)
        return [shape.count("[") for shape in shapes]

    assert operands(lm.pmean) == [2] and operands(jax.lax.pmean) == [4], (
        operands(lm.pmean),
        operands(jax.lax.pmean),
    )
    # On explicit mesh axes, a leaf sharded along "model" keeps its own collective over
    # "data" (a reshape of it to one buffer would be an error), the others share one.
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    grads = {
        "kernel": jax.device_put(
            tree["kernel"][:2], NamedSharding(explicit, P(None, None, "model"))
        ),
        "bias": jax.device_put(tree["bias"][:2, :3], NamedSharding(explicit, P("data"))),
        "scale": jax.device_put(tree["scale"][:2], NamedSharding(explicit, P("data"))),
    }

    def explicit_mean(mean: object) -> object:
        mapped = jax.shard_map(
            lambda g: mean(jax.tree.map(lambda x: x[0], g), "data"),
            mesh=explicit,
            in_specs=P("data"),
            out_specs=P(),
            axis_names={"data"},
        )
        with jax.set_mesh(explicit):
            return jax.jit(mapped)(grads)

    ours, theirs = explicit_mean(lm.pmean), explicit_mean(jax.lax.pmean)
    close(ours, theirs, "lm.pmean on explicit axes", rtol=1e-6, atol=1e-7)
    assert ours["kernel"].sharding.spec == theirs["kernel"].sharding.spec == P(None, "model")
    print("ok pmean_is_one_all_reduce")


def check_errors_on_a_real_mesh() -> None:
    mesh = auto_mesh((2, 4), ("data", "model"))
    model = lm.Dense(6, 8, kernel_sharding=("embed", "mlp"))
    try:
        lm.shardings(model, mesh, {"embed": "model"})
    except ValueError as error:
        assert "params/kernel" in str(error) and "(6, 8)" in str(error), error
    else:
        raise AssertionError("6 rows on 4 devices were accepted")
    print("ok errors_on_a_real_mesh")


def main() -> None:
    assert jax.device_count() == 8, (
        f"{jax.device_count()} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    assert math.prod(auto_mesh((2, 4), ("data", "model")).devices.shape) == 8
    checks = [
        check_init_is_sharded,
        check_training_step_matches_one_device,
        check_batch_norm_under_shard_map,
        check_errors_on_a_real_mesh,
        check_explicit_mesh_training_step_matches_one_device,
        check_explicit_mesh_depth_sharded_stack,
        check_explicit_mesh_conv_training_step_matches_one_device,
        check_pmean_is_one_all_reduce,
    ]
    names = sys.argv[1:]
    for check in checks:
        if not names or check.__name__.removeprefix("check_") in names:
            check()


if __name__ == "__main__":
    main()
