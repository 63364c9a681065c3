"""lm.Policy and lm.with_policy: dtypes per variable kind, casts where they belong (the jaxpr),
every policy against a hand-cast reference, composition, and the traps of docs/mixed-precision.md.
"""

from __future__ import annotations

import copy
import pickle
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from lamina._core import casting
from lamina._core.graph import Plan
from tests.helpers import assert_close, normal

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")
KEY = jax.random.key(0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# --- helpers --------------------------------------------------------------------------------


def eqns(jaxpr: Any) -> list[Any]:
    """Every equation of `jaxpr` and of the jaxprs inside it (jit, scan, custom_jvp, remat),
    each sub-jaxpr counted where it is used."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    found += eqns(inner)
    return found


def converts(fn: Any, *args: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(source, target, shape)`` of every floating cast in the program of ``fn(*args)``."""
    return [
        (e.invars[0].aval.dtype.name, np.dtype(e.params["new_dtype"]).name, e.invars[0].aval.shape)
        for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        if e.primitive.name == "convert_element_type"
        and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
    ]


def dots(fn: Any, *args: Any) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in the program of ``fn(*args)``."""
    return [
        tuple(v.aval.dtype.name for v in e.invars)
        for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        if e.primitive.name == "dot_general"
    ]


def jit_names(fn: Any, *args: Any) -> list[str]:
    return [e.params.get("name") for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def cast(tree: Any, dtype: Any) -> Any:
    """Floating array leaves cast to `dtype` (the hand-cast reference's inputs and outputs)."""
    return jax.tree.map(lambda a: a.astype(dtype) if casting.is_floating(a) else a, tree)


def stored(model: lm.Module) -> dict[str, tuple[str, str]]:
    """``{path: (dtype read, dtype stored)}`` of every variable of `model`'s plan."""
    return {e.name: (e.state.dtype.name, e.state.param_dtype.name) for e in Plan(model).variables}


def same(got: Any, expected: Any) -> None:
    """Bitwise equal, leaf by leaf, dtypes included."""
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


# --- lm.Policy ------------------------------------------------------------------------------


def test_policy_takes_names_and_dtypes_and_defaults_the_output_to_compute():
    policy = lm.Policy("float32", jnp.bfloat16)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, BF16, BF16)
    assert lm.Policy(jnp.float32, "float16", "float32").output_dtype == F32
    assert policy == lm.Policy(np.float32, "bfloat16", "bfloat16")
    assert len({policy, lm.Policy("float32", "bfloat16")}) == 1
    assert repr(policy) == (
        "Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=bfloat16)"
    )
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert copy.deepcopy(policy) is policy


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("int32", "bfloat16"), "param_dtype must be a real floating dtype.*got int32"),
        (("float32", "bool"), "compute_dtype must be a real floating dtype.*got bool"),
        (("float32", "float32", "complex64"), "output_dtype must be a real floating"),
        (("float32", "bfloat61"), "compute_dtype must be a dtype such as jnp.float32"),
        ((None, "float32"), r"param_dtype must be a floating dtype.*got None.*only output_dtype"),
        (("float32", "float64"), r"compute_dtype is float64.*jax_enable_x64', True\)"),
        ((jnp.float64, "float32"), r"param_dtype is float64.*without 64-bit"),
    ],
)
def test_policy_refuses_what_is_not_a_floating_dtype(args, match):
    with pytest.raises(TypeError, match=match):
        lm.Policy(*args)


# --- every policy against a hand-cast reference ----------------------------------------------
# The reference is the same layer built with dtype=param_dtype=compute, given the policy
# model's variables and inputs cast to the compute dtype by hand, its outputs cast to the
# output dtype: what "stores in param, computes in compute, returns output" means.


def _mha(d, p):
    return lm.MultiHeadAttention(2, 4, dtype=d, param_dtype=p, decode_shape=(2, 3))


def _lora(d, p):
    b_init = lm.initializers.normal(0.5)  # a non-zero adapter, so that it counts
    return lm.LoRA(lm.Dense(4, 3, dtype=d, param_dtype=p), rank=2, b_init=b_init)


LAYERS = {
    "Dense": (lambda d, p: lm.Dense(4, 3, dtype=d, param_dtype=p), lambda r: (normal(r, 2, 4),)),
    "Conv": (
        lambda d, p: lm.Conv(3, 4, (2, 2), dtype=d, param_dtype=p),
        lambda r: (normal(r, 1, 3, 3, 3),),
    ),
    "Embed": (
        lambda d, p: lm.Embed(7, 4, dtype=d, param_dtype=p),
        lambda r: (jnp.array([[1, 6], [0, 3]]),),
    ),
    "LayerNorm": (
        lambda d, p: lm.LayerNorm(4, dtype=d, param_dtype=p, bias_init=lm.initializers.ones()),
        lambda r: (3 * normal(r, 2, 4) + 1,),
    ),
    "BatchNorm": (
        lambda d, p: lm.BatchNorm(4, dtype=d, param_dtype=p, momentum=0.5),
        lambda r: (3 * normal(r, 3, 4) + 1, True),
    ),
    "MultiHeadAttention": (_mha, lambda r: (normal(r, 2, 1, 4),), {"decode": True}),
    "LoRA": (_lora, lambda r: (normal(r, 2, 4),)),
    "RNN": (
        lambda d, p: lm.RNN(lm.LSTMCell(3, 4, dtype=d, param_dtype=p)),
        lambda r: (normal(r, 2, 3, 3),),
    ),
    "Stack": (
        lambda d, p: lm.Stack(lm.Dense(4, 4, dtype=d, param_dtype=p), 2),
        lambda r: (normal(r, 2, 4),),
    ),
}
EVERY_POLICY = [  # every storage and compute pair, each output dtype with three of them
    lm.Policy(param, compute, (F32, BF16)[i % 2])
    for i, (param, compute) in enumerate(
        (param, compute) for param in (F32, BF16) for compute in (F32, BF16, F16)
    )
]
# Every storage/compute pair on Dense; on the other layers (slower to compile), each param,
# compute and output dtype at least once, and both directions of a storage/compute
# difference (the slowest layers take one policy each, the first two in turn).
SOME_POLICIES = [
    lm.Policy(F32, BF16, F32),
    lm.Policy(BF16, F16, BF16),
    lm.Policy(BF16, F32, BF16),
]
SLOW = {  # one policy each, the first two taken in turn
    "MultiHeadAttention": SOME_POLICIES[1:2],
    "RNN": SOME_POLICIES[:1],
    "Conv": SOME_POLICIES[1:2],
    "Stack": SOME_POLICIES[:1],
}


def _floating_sum(tree: Any) -> Any:
    return sum(
        jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(tree) if casting.is_floating(a)
    )


@pytest.mark.parametrize("name", list(LAYERS))
def test_every_policy_equals_the_hand_cast_reference(name, rng):
    build, make_args, *rest = LAYERS[name]
    kwargs = rest[0] if rest else {}
    args = make_args(rng)
    policies = EVERY_POLICY if name == "Dense" else SLOW.get(name, SOME_POLICIES)
    for policy in policies:
        p, c, o = policy.param_dtype, policy.compute_dtype, policy.output_dtype
        model = build(F32, None)
        policied = lm.with_policy(model, policy, where=type(model))
        init, apply = lm.transform(policied)
        ref_init, ref_apply = lm.transform(build(c, c))
        variables = init(KEY)
        # Storage per kind: parameters in param_dtype, caches in compute_dtype, statistics as
        # the layer built with the policy's dtypes stores them (compute, at least float32).
        targets = jax.eval_shape(ref_init, KEY)
        direct = jax.eval_shape(lm.transform(build(c, p)).init, KEY)
        for entry in Plan(policied).variables:
            leaf = variables[entry.key[0]]
            for part in entry.key[1:]:
                leaf = leaf[part]
            wanted = {"cache": c, "params": p}.get(
                entry.collection, max(c, F32, key=lambda d: d.itemsize)
            )
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                wanted = leaf.dtype  # the cache index
            assert leaf.dtype == wanted, (name, policy, entry.name, leaf.dtype)
        assert jax.tree.map(lambda a: a.dtype, variables) == jax.tree.map(lambda a: a.dtype, direct)
        ref_variables = jax.tree.map(lambda a, t: a.astype(t.dtype), variables, targets)
        out, new = apply(variables, None, *args, **kwargs)
        ref_out, ref_new = ref_apply(ref_variables, None, *cast(args, c), **kwargs)
        same(out, cast(ref_out, o))
        if name == "Dense":  # and against jnp itself
            kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
            by_hand = args[0].astype(c) @ kernel.astype(c) + bias.astype(c)[None]
            same(out, by_hand.astype(o))
        same(new["params"], variables["params"])
        written = {k: v for k, v in new.items() if k != "params"}  # statistics, caches
        ref_written = {k: v for k, v in ref_new.items() if k != "params"}
        same(written, jax.tree.map(lambda r, a: r.astype(a.dtype), ref_written, written))
        if name != "Dense" and policy is not policies[0]:
            continue  # gradients: every policy on Dense, the first on the others

        def loss(params, apply, variables, args):
            return _floating_sum(apply({**variables, "params": params}, None, *args, **kwargs)[0])

        grads = jax.grad(loss)(variables["params"], apply, variables, args)
        ref_grads = jax.grad(loss)(ref_variables["params"], ref_apply, ref_variables, cast(args, c))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            assert g.dtype == p  # cotangents of the stored parameters
            np.testing.assert_allclose(
                np.asarray(g, np.float64), np.asarray(r.astype(p), np.float64), rtol=1e-6
            )


# --- the casts in the program: where they belong, and no others -------------------------------


def _program(model: lm.Module, x: Any) -> tuple[Any, Any]:
    init, apply = lm.transform(model)
    variables = init(KEY)
    return (lambda v, x: apply(v, None, x)[0]), variables


def test_the_jaxpr_casts_the_input_once_and_each_parameter_once():
    model = lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))
    half = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=...)
    x = jnp.ones((3, 4))
    fn, variables = _program(half, x)
    assert sorted(converts(fn, variables, x)) == sorted(
        [
            ("float32", "bfloat16", (3, 4)),  # the input, once, at the Sequential
            ("float32", "bfloat16", (4, 8)),  # each kernel and bias, where it is read
            ("float32", "bfloat16", (8,)),
            ("float32", "bfloat16", (8, 2)),
            ("float32", "bfloat16", (2,)),
        ]
    )  # and nothing on the outputs: the last Dense returns bfloat16 already
    assert dots(fn, variables, x) == [("bfloat16", "bfloat16")] * 2
    assert fn(variables, x).dtype == BF16
    # The gradient: float32 cotangents of the float32 parameters.
    grads = jax.grad(lambda v: jnp.sum(fn(v, x).astype(jnp.float32)))(variables)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}
    # Without a policy, the same model casts nothing.
    plain_fn, plain_variables = _program(model, x)
    assert converts(plain_fn, plain_variables, x) == []


def test_a_float32_layer_norm_in_a_bfloat16_model_casts_once_in_and_once_out():
    model = lm.Sequential(
        lm.Dense(4, 4, use_bias=False), lm.LayerNorm(4), lm.Dense(4, 2, use_bias=False)
    )
    model = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=...)
    model = lm.with_policy(model, lm.Policy("float32", "float32", "bfloat16"), where=lm.LayerNorm)
    x = jnp.ones((3, 4))
    fn, variables = _program(model, x)
    assert sorted(converts(fn, variables, x)) == sorted(
        [
            ("float32", "bfloat16", (3, 4)),  # the model's input
            ("float32", "bfloat16", (4, 4)),  # the first kernel
            ("bfloat16", "float32", (3, 4)),  # into the LayerNorm (scale, bias: float32 as stored)
            ("float32", "bfloat16", (3, 4)),  # out of it
            ("float32", "bfloat16", (4, 2)),  # the second kernel
        ]
    )
    assert dots(fn, variables, x) == [("bfloat16", "bfloat16")] * 2


def test_no_code_runs_on_the_calls_of_layers_that_cast_themselves():
    """The overhead guard: Policy(f32, bf16) on layers whose call casts its inputs adds no
    boundary, so apply runs no line of the casting code."""
    model = lm.Sequential(
        lm.Embed(5, 4),
        lm.LoRA(lm.Dense(4, 4), rank=2),
        lm.MultiHeadAttention(2, 4),
        lm.DenseGeneral(4, 3),
        lm.Conv(3, 2, (2,)),
    )
    layers = (lm.Embed, lm.LoRA, lm.Dense, lm.MultiHeadAttention, lm.DenseGeneral, lm.Conv)
    half = lm.with_policy(model, lm.Policy("float32", "bfloat16"), where=layers)
    for _, module in Plan(half).modules:
        assert "_lamina_boundary" not in vars(module), type(module).__name__
    init, apply = lm.transform(half)
    variables = init(KEY)
    ids = jnp.array([[1, 2, 3]])
    ran = set()
    watched = {
        casting._call_with_boundary.__code__,
        casting.cast_floating.__code__,
        casting.boundary_class.__wrapped__.__code__,
    }

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            ran.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        y, _ = apply(variables, None, ids)
    finally:
        sys.setprofile(None)
    assert ran == set()
    assert y.dtype == BF16
    # The unmatched Sequential computes nothing itself; with it matched, a boundary runs.
    boundary = lm.with_policy(half, lm.Policy("float32", "bfloat16"), where=lm.Sequential)
    assert vars(boundary)["_lamina_boundary"] == casting.Boundary(BF16, BF16)


# --- errors ---------------------------------------------------------------------------------

HALF = lm.Policy("float32", "bfloat16")


def _mlp() -> lm.Module:
    return lm.Sequential(lm.Dense(4, 8), lm.relu, lm.Dense(8, 2))


def test_bad_arguments_are_refused_and_say_what_to_pass():
    model = _mlp()
    with pytest.raises(TypeError, match=r"takes an lm\.Module, got dict"):
        lm.with_policy({}, HALF)
    with pytest.raises(TypeError, match=r"policy must be an lm.Policy, got str.*lm.Policy\("):
        lm.with_policy(model, "bfloat16")
    with pytest.raises(TypeError, match="selects variables, not modules"):
        lm.with_policy(model, HALF, where="params")
    with pytest.raises(TypeError, match="selects variables, not modules"):
        lm.with_policy(model, HALF, where=lm.Parameter)


def test_a_filter_that_matches_no_module_lists_the_modules_and_suggests():
    model = _mlp()
    with pytest.raises(
        ValueError,
        match=r"(?s)matches no module of Sequential.*layers_0 \(Dense\).*Did you mean lm.Dense\?",
    ):
        lm.with_policy(model, HALF, where=lm.DenseGeneral)
    with pytest.raises(ValueError, match=r"Did you mean lm.PathContains\('layers_2'\)"):
        lm.with_policy(model, HALF, where=lm.PathContains("layer_2"))
    with pytest.raises(ValueError, match="matches no module"):
        lm.with_policy(model, HALF, where=lambda path, module: False)


def test_a_complex_variable_under_a_policy_is_refused_by_path():
    model = lm.Sequential(lm.Dense(2, 2), lm.Dense(2, 2, dtype=jnp.complex64))
    with pytest.raises(
        TypeError, match=r"params/layers_1/kernel is a complex Parameter \(complex64\)"
    ):
        lm.with_policy(model, HALF, where=...)
    lm.with_policy(model, HALF, where=lm.PathContains("layers_0"))  # left out: fine


def test_an_assigned_value_that_overflows_the_new_storage_is_refused_and_nothing_changes():
    model = lm.Dense(2, 2)
    model.kernel.value = jnp.full((2, 2), 1e5)  # beyond float16's 65504
    before = stored(model)
    with pytest.raises(
        ValueError, match=r"cannot store the value assigned to params/kernel as float16"
    ):
        lm.with_policy(model, lm.Policy("float16", "float16"))
    assert stored(model) == before and "_lamina_policy" not in vars(model)
    # Within range, the assigned value is rounded to the storage dtype, as a write is.
    model.kernel.value = jnp.full((2, 2), 1 / 3)
    variables = lm.transform(lm.with_policy(model, lm.Policy("bfloat16", "bfloat16"))).init(KEY)
    assert variables["params"]["kernel"].dtype == BF16
    assert float(variables["params"]["kernel"][0, 0]) == float(jnp.bfloat16(1 / 3))


# --- what changes and what does not -------------------------------------------------------------


class Block(lm.Module):
    def __init__(self, size=4):
        self.norm = lm.LayerNorm(size)
        self.dense = lm.Dense(size, size)

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class Net(lm.Module):
    def __init__(self):
        self.embed = lm.Embed(6, 4)
        self.blocks = lm.Stack(Block(), 2)
        self.norm = lm.LayerNorm(4)
        self.head = lm.Dense(4, 6, dtype=None)

    def __call__(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids))))


def test_the_original_model_and_unmatched_modules_are_unchanged():
    model = Net()
    before = stored(model)
    half = lm.with_policy(model, lm.Policy("bfloat16", "bfloat16"), where=lm.Stack)
    assert stored(model) == before
    assert not any("_lamina_policy" in vars(m) for _, m in Plan(model).modules)
    after = stored(half)
    for name, dtypes in before.items():
        if "blocks" in name:  # the Stack's parameters: stored and read in bfloat16
            assert after[name] == ("bfloat16", "bfloat16"), name
        else:
            assert after[name] == dtypes, name
    assert (half.embed.dtype, half.head.dtype, half.norm.dtype) == (F32, None, F32)
    assert (half.blocks.block.dense.dtype, half.blocks.block.norm.param_dtype) == (BF16, BF16)


def test_dtype_none_layers_compute_in_the_policy_or_infer_from_their_inputs():
    # Matched: dtype=None becomes the compute dtype, whatever the input.
    dense = lm.with_policy(lm.Dense(4, 2, dtype=None), HALF)
    assert dense.dtype == BF16
    fn, variables = _program(dense, jnp.ones((1, 4)))
    assert fn(variables, jnp.ones((1, 4))).dtype == BF16
    # Unmatched after a bfloat16 output: promote(bfloat16 input, float32 params) = float32.
    model = lm.with_policy(Net(), HALF, where=lm.PathContains("norm", exact=False))
    init, apply = lm.transform(model)
    variables = init(KEY)
    logits, _ = apply(variables, None, jnp.array([[1, 2]]))
    assert logits.dtype == F32  # the head (dtype=None) promoted bfloat16 and float32
    assert model.head.dtype is None


def test_initial_values_are_the_original_models_in_the_storage_dtype():
    model = Net()
    original = lm.transform(model).init(KEY)
    same(lm.transform(lm.with_policy(model, HALF)).init(KEY), original)
    stored_half = lm.transform(lm.with_policy(model, lm.Policy("bfloat16", "bfloat16"))).init(KEY)
    assert {a.dtype for a in jax.tree.leaves(stored_half)} == {BF16}


# --- composition ---------------------------------------------------------------------------------

NORMS = lm.Policy("float32", "float32", "bfloat16")


def test_the_innermost_mark_wins_whatever_the_order_and_marking_again_overrides():
    model = Net()
    a = lm.with_policy(lm.with_policy(model, HALF, where=lm.Stack), NORMS, where=lm.LayerNorm)
    b = lm.with_policy(lm.with_policy(model, NORMS, where=lm.LayerNorm), HALF, where=lm.Stack)
    assert stored(a) == stored(b)
    for x, y in zip(Plan(a).modules, Plan(b).modules, strict=True):
        assert vars(x[1]).get("_lamina_boundary") == vars(y[1]).get("_lamina_boundary"), x[0]
    assert a.blocks.block.norm.dtype == F32 and a.blocks.block.dense.dtype == BF16
    assert stored(lm.with_policy(a, HALF, where=lm.Stack)) == stored(a)  # idempotent
    # Marking the norms again with the Stack's policy overrides their own mark.
    c = lm.with_policy(a, HALF, where=lm.LayerNorm)
    assert c.blocks.block.norm.dtype == BF16 and c.norm.dtype == BF16


def test_matching_every_module_casts_the_models_output_until_the_root_is_marked_again():
    """Trap (a): `...` matches the model itself, so its output is in the compute dtype."""
    half = lm.with_policy(Net(), HALF, where=...)
    ids = jnp.array([[1, 2, 3]])
    fn, variables = _program(half, ids)
    assert fn(variables, ids).dtype == BF16
    fixed = lm.with_policy(half, lm.Policy("float32", "float32"), where=lambda path, m: path == ())
    fn, variables = _program(fixed, ids)
    assert fn(variables, ids).dtype == F32
    assert fixed.blocks.block.dense.dtype == BF16  # its modules keep their own marks


# --- the traps of docs/mixed-precision.md -----------------------------------------------------


def _stack_reference(stack: lm.Stack, variables: Any, x: Any) -> Any:
    """The stack's copies applied one after another by hand (the block planned alone)."""
    block_apply = lm.transform(stack.block).apply
    block_variables = {"params": variables["params"]["block"]}
    for i in range(stack.n):
        x, _ = block_apply(_copy(block_variables, i), None, x)
    return x


def _copy(stacked: Any, i: int) -> Any:
    """Copy `i` of a Stack's variables."""
    return jax.tree.map(lambda a: a[i], stacked)


@pytest.mark.parametrize(
    ("marks", "out"),
    [
        ([(lm.Policy("float32", "bfloat16", "float32"), Block)], F32),
        ([(HALF, Block)], BF16),  # the Stack casts its input to what its block returns
        ([(HALF, lm.Stack), (lm.Policy("float32", "bfloat16", "float32"), Block)], BF16),
        ([(lm.Policy("float32", "bfloat16", "float32"), lm.Stack)], F32),
    ],
)
def test_a_stacks_carry_keeps_one_dtype(marks, out, rng):
    """Trap (b): a scan's carry must keep its dtype through the block."""
    stack = lm.Stack(Block(), 3)
    for policy, where in marks:
        stack = lm.with_policy(stack, policy, where=where)
    x = normal(rng, 2, 4)
    fn, variables = _program(stack, x)
    y = fn(variables, x)
    assert y.dtype == out
    carried = vars(stack)["_lamina_boundary"].input_dtype  # what enters the first block
    expected = _stack_reference(stack, variables, x.astype(carried)).astype(out)
    # Within bfloat16's rounding: XLA may keep excess precision inside the compiled scan.
    assert_close(y, expected, rtol=2e-2, atol=2e-2)


def _lstm_reference(policy: lm.Policy, variables: Any, carry: Any, xs: Any) -> Any:
    """A bfloat16 LSTMCell stepped by hand, its carry and inputs cast to the compute dtype and
    its outputs to the output dtype at every step."""
    c, o = policy.compute_dtype, policy.output_dtype
    init, apply = lm.transform(lm.LSTMCell(3, 4, dtype=c, param_dtype=c))
    cell_variables = jax.tree.map(
        lambda a, t: a.astype(t.dtype), variables, jax.eval_shape(init, KEY)
    )
    ys = []
    for t in range(xs.shape[1]):
        (carry, y), _ = apply(cell_variables, None, cast(carry, c), cast(xs[:, t], c))
        carry, y = cast(carry, o), cast(y, o)
        ys.append(y)
    return carry, jnp.stack(ys, 1)


@pytest.mark.parametrize("where", [lm.LSTMCell, lm.RNN, ...], ids=["cell", "rnn", "everything"])
def test_an_rnn_carry_follows_the_policy(where, rng):
    """Trap (c): initialize_carry makes the carry in the dtype the cell's calls exchange."""
    policy = lm.Policy("float32", "bfloat16", "float32" if where is lm.LSTMCell else "bfloat16")
    rnn = lm.with_policy(lm.RNN(lm.LSTMCell(3, 4), return_carry=True), policy, where=where)
    init, apply = lm.transform(rnn)
    variables = init(KEY)
    xs = normal(rng, 2, 5, 3)
    (carry, ys), _ = apply(variables, None, xs)
    zeros = (jnp.zeros((2, 4)), jnp.zeros((2, 4)))
    ref_carry, ref_ys = _lstm_reference(policy, {"params": variables["params"]["cell"]}, zeros, xs)
    # Within bfloat16's rounding: XLA may keep excess precision inside the compiled scan.
    assert_close((carry, ys), (ref_carry, ref_ys), rtol=2e-2, atol=2e-2)
    # A carry passed in float32 is cast where the RNN or the cell is matched.
    (carry, _), _ = apply(variables, None, xs, zeros)
    assert {a.dtype for a in carry} == {policy.output_dtype}
    # The user's copy keeps its class and methods: only the transformed snapshot casts.
    assert type(rnn.cell) is lm.LSTMCell and "initialize_carry" not in vars(rnn.cell)
    assert rnn.cell.initialize_carry((2,))[0].dtype == F32


def test_fused_paths_still_run_under_a_policy(rng):
    """Trap (d): fast paths that check a layer's exact type keep running where a policy adds
    no boundary; a matched cell is called step by step instead, with the same numbers."""
    x = normal(rng, 2, 3, 4)
    mha = lm.with_policy(lm.MultiHeadAttention(2, 4), HALF, where=...)
    fn, variables = _program(mha, x)
    assert "project_qkv" in jit_names(fn, variables, x)  # the fused q/k/v projections
    assert dots(fn, variables, x) == [("bfloat16", "bfloat16")] * 6
    rnn = lm.RNN(lm.OptimizedLSTMCell(4, 8))
    fused = lm.with_policy(rnn, HALF, where=lm.RNN)
    fn, variables = _program(fused, x)
    assert len(dots(fn, variables, x)) == 2  # the step's two concatenated products
    y = fn(variables, x)
    stepped = lm.with_policy(rnn, HALF, where=...)  # the cell matched: called per step
    step_fn, _ = _program(stepped, x)
    assert len(dots(step_fn, variables, x)) == 8  # one product per gate and source
    np.testing.assert_allclose(
        np.asarray(step_fn(variables, x), np.float32),
        np.asarray(y, np.float32),
        rtol=1e-2,
        atol=1e-2,
    )


class Shared(lm.Module):
    def __init__(self, tied_policy_place=False):
        dense = lm.Dense(4, 4)
        self.a = lm.Sequential(dense, lm.relu)
        self.b = lm.Sequential(dense) if tied_policy_place else dense
        self.c = lm.Dense(4, 4)
        self.c.kernel = self.a.layers_0.kernel if not tied_policy_place else self.c.kernel

    def __call__(self, x):
        return self.a(x), self.b(x), self.c(x)


def test_a_module_or_variable_shared_with_an_uncovered_place_follows_the_policy_there_too():
    """Trap (e): one object holds one set of dtypes."""
    model = lm.with_policy(Shared(), HALF, where=lm.PathContains("a"))
    assert model.b.dtype == BF16  # the Dense of `a`, also used as `b`
    assert model.c.dtype == F32 and model.c.kernel.dtype == BF16  # c reads a's kernel
    fn, variables = _program(model, jnp.ones((1, 4)))
    a, b, c = fn(variables, jnp.ones((1, 4)))
    assert (a.dtype, b.dtype, c.dtype) == (BF16, BF16, F32)
    two = lm.with_policy(Shared(True), HALF, where=lambda path, module: path == ("a",))
    with pytest.raises(
        ValueError,
        match=r"Dense at a/layers_0 is one object reached in places that follow different policies",
    ):
        lm.with_policy(two, lm.Policy("float32", "float16"), where=lambda path, m: path == ("b",))
    # Marking the shared module itself decides.
    lm.with_policy(two, lm.Policy("float32", "float16"), where=lm.PathContains("layers_0"))


def test_a_float32_checkpoint_loads_into_bfloat16_parameters_only_by_an_explicit_cast(tmp_path):
    """Trap (f): lm.load checks dtypes; both routes its message gives work."""
    model = _mlp()
    variables = lm.transform(model).init(KEY)
    path = str(tmp_path / "f32.safetensors")
    lm.save(path, variables)
    half = lm.with_policy(model, lm.Policy("bfloat16", "bfloat16"))
    with pytest.raises(
        lm.VariablesError,
        match=r"(?s)wrong dtype.*expected bfloat16, got float32.*"
        r"lm\.assign_variables\(model, lm\.load\(path\)\).*"
        r"jax\.tree\.map\(lambda a, t: a\.astype\(t\.dtype\)",
    ):
        lm.load(path, half)
    rounded = cast(variables, BF16)
    loaded = lm.transform(lm.assign_variables(half, lm.load(path))).init(KEY)
    same(loaded, rounded)
    init, apply = lm.transform(half)
    cast_dict = jax.tree.map(
        lambda a, t: a.astype(t.dtype), lm.load(path), jax.eval_shape(init, KEY)
    )
    same(cast_dict, rounded)
    same(apply(cast_dict, None, jnp.ones((1, 4)))[0], apply(loaded, None, jnp.ones((1, 4)))[0])
    # PyTorch weights (NumPy here) into bfloat16 parameters: rounded, as stored.
    weight = np.asarray(normal(np.random.default_rng(1), 8, 4))
    state_dict = {"0.weight": weight, "0.bias": np.zeros(8, np.float32)}
    state_dict |= {"2.weight": np.ones((2, 8), np.float32), "2.bias": np.zeros(2, np.float32)}
    converted = lm.from_torch(half, state_dict)
    kernel = converted["params"]["layers_0"]["kernel"]
    assert kernel.dtype == BF16
    np.testing.assert_array_equal(
        np.asarray(kernel, np.float32), weight.T.astype(BF16).astype(np.float32)
    )


def test_layers_added_after_a_policy_are_not_covered():
    """Trap (g): apply policies after wrapping (LoRA) or replacing layers."""
    stored_half = lm.Policy("bfloat16", "bfloat16")
    after = lm.with_policy(lm.LoRA(lm.Dense(4, 3), rank=2), stored_half)
    assert stored(after)["params/lora_a"] == ("bfloat16", "bfloat16")
    before = lm.LoRA(lm.with_policy(lm.Dense(4, 3), stored_half), rank=2)
    assert stored(before)["params/lora_a"] == ("bfloat16", "bfloat16")  # copied from the base
    wider = lm.LoRA(lm.with_policy(lm.Dense(4, 3), HALF), rank=2, param_dtype="float16")
    assert stored(wider)["params/lora_a"] == ("bfloat16", "float16")  # its own, uncovered
    # A module put in later is covered when with_policy runs again (from the marks).
    model = lm.with_policy(Net(), HALF, where=lm.Stack)
    model.blocks.block.dense = lm.Dense(4, 4)
    assert stored(model)["params/blocks/block/dense/kernel"] == ("float32", "float32")
    model = lm.with_policy(model, lm.Policy("float32", "float32"), where=lm.PathContains("head"))
    assert stored(model)["params/blocks/block/dense/kernel"] == ("bfloat16", "float32")
    cached = lm.with_policy(lm.MultiHeadAttention(2, 4, decode_shape=(1, 3)), HALF)
    assert stored(cached)["cache/cached_key"] == ("bfloat16", "bfloat16")  # built from dtype


# --- with the rest of lamina -------------------------------------------------------------------


class Lifted(lm.Module):
    """A Stack's block run by hand: as an ensemble (lm.vmap) or in sequence (lm.scan)."""

    def __init__(self, how):
        self.stack = lm.Stack(Block(), 3)
        self.how = how

    def __call__(self, x):
        if self.how == "vmap":
            return lm.vmap(lambda m, x: m(x), in_axes=(0, None))(self.stack.block, x)
        step = lm.scan(lambda m, x: m(x), in_axes=(0, lm.Carry), out_axes=lm.Carry)
        return step(self.stack.block, x)


@pytest.mark.parametrize("how", ["vmap", "scan"])
def test_lifted_transforms_run_a_block_under_its_policy(how, rng):
    policy = lm.Policy("float32", "bfloat16", "float32" if how == "scan" else "bfloat16")
    model = lm.with_policy(Lifted(how), policy, where=Block)
    x = normal(rng, 2, 4)
    fn, variables = _program(model, x)
    y = fn(variables, x)
    assert y.dtype == policy.output_dtype
    block_apply = lm.transform(model.stack.block).apply
    copies = {"params": variables["params"]["stack"]["block"]}
    outputs = [block_apply(_copy(copies, i), None, x)[0] for i in range(3)]
    if how == "vmap":
        expected = jnp.stack(outputs)
    else:
        expected = x
        for i in range(3):
            expected = block_apply(_copy(copies, i), None, expected)[0]
    assert_close(y, expected, rtol=2e-2, atol=2e-2)  # bfloat16 rounding, compiled or not


def test_a_policy_model_pickles_jits_and_records_its_outputs_once():
    model = lm.with_policy(Net(), HALF, where=...)
    model = lm.with_policy(model, NORMS, where=lm.LayerNorm)
    model = lm.with_policy(model, lm.Policy("float32", "float32"), where=lm.PathContains("head"))
    ids = jnp.array([[1, 2, 3]])
    init, apply = lm.transform(model)
    variables = init(KEY)
    y, _ = apply(variables, None, ids)
    assert y.dtype == BF16  # the model itself is matched by `...`
    again = pickle.loads(pickle.dumps(model))
    assert vars(again)["_lamina_policy"] == HALF and again.head.dtype == F32
    same(lm.transform(again).apply(variables, None, ids)[0], y)
    jitted = jax.jit(apply)(variables, None, ids)[0]
    assert jitted.dtype == BF16
    assert_close(jitted, y, rtol=2e-2, atol=2e-2)  # XLA may keep excess precision when fused
    captured = lm.capture_intermediates(apply)
    _, records = captured(variables, None, ids)
    records = records["intermediates"]
    assert records["norm"]["__call__"][0].dtype == BF16  # the LayerNorm's boundary output
    assert records["head"]["__call__"][0].dtype == F32
    assert len(records["norm"]["__call__"]) == 1  # one record per call, boundary or not
    assert len(records["embed"]["__call__"]) == 1
    assert records["__call__"][0].dtype == BF16


# --- what the policy leaves alone, and statistics ----------------------------------------------


class Positions(lm.Module):
    """A module whose `dtype` is an integer dtype: not a precision a policy sets."""

    def __init__(self):
        self.dtype = jnp.int32
        self.table = lm.Embed(300, 2)

    def __call__(self, x):
        return x + self.table(jnp.arange(x.shape[0], dtype=self.dtype))


def test_a_dtype_setting_that_is_not_floating_is_left_alone():
    half = lm.with_policy(Positions(), HALF)
    assert half.dtype is jnp.int32 and half.table.dtype == BF16
    fn, variables = _program(half, jnp.zeros((300, 2)))
    y = fn(variables, jnp.zeros((300, 2)))
    table = variables["params"]["table"]["embedding"].astype(BF16)
    same(y, table)  # row 257 reads position 257 (a bfloat16 position would read 256)


@pytest.mark.parametrize(
    "policy",
    [
        lm.Policy("float32", "float32"),
        lm.Policy("bfloat16", "bfloat16"),
        lm.Policy("float32", "bfloat16"),
        lm.Policy("float16", "float16"),
    ],
    ids=["f32", "bf16", "f32-bf16", "f16"],
)
def test_running_statistics_are_kept_as_the_layer_built_with_the_policys_dtypes_keeps_them(
    policy,
):
    """Statistics follow BatchNorm's own rule (compute dtype, at least float32): running means
    in bfloat16 stall (at 8 for inputs of 10), variances in float16 overflow."""
    p, c = policy.param_dtype, policy.compute_dtype
    policied = lm.with_policy(lm.BatchNorm(2, momentum=0.5), policy)
    direct = lm.BatchNorm(2, momentum=0.5, dtype=c, param_dtype=p)
    assert {k: v for k, v in stored(policied).items() if "batch_stats" in k} == {
        k: v for k, v in stored(direct).items() if "batch_stats" in k
    }
    x = jnp.concatenate([jnp.full((4, 2), 10.0), 300 * jnp.ones((4, 2))])
    results = []
    for model in (policied, direct):
        init, apply = lm.transform(model)
        variables = init(KEY)
        for _ in range(3):
            _, variables = apply(variables, None, x, True)
        results.append((apply(variables, None, x, False)[0], variables))
    same(results[0], results[1])
    assert results[0][1]["batch_stats"]["mean"].dtype == F32
    assert np.isfinite(np.asarray(results[0][1]["batch_stats"]["var"])).all()


def test_statistics_under_a_float64_policy_are_float64(tmp_path):
    """x64 (in a subprocess: the flag is global): Policy(f32, f64) on a training BatchNorm."""
    script = tmp_path / "x64.py"
    script.write_text(
        "import jax\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "import jax.numpy as jnp, numpy as np, lamina as lm\n"
        "x = jnp.arange(8.0).reshape(4, 2)\n"
        "out = []\n"
        "for m in (lm.with_policy(lm.BatchNorm(2), lm.Policy('float32', 'float64')),\n"
        "          lm.BatchNorm(2, dtype=jnp.float64, param_dtype=jnp.float32)):\n"
        "    init, apply = lm.transform(m)\n"
        "    out.append(apply(init(jax.random.key(0)), None, x, True))\n"
        "for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):\n"
        "    assert a.dtype == b.dtype and np.array_equal(a, b), (a.dtype, b.dtype)\n"
        "print(sorted({a.dtype.name for a in jax.tree.leaves(out[0][1]['batch_stats'])}))\n"
    )
    import subprocess

    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['float64']"


# --- modules read rather than called; arguments that are declarations ----------------------------


def test_a_policy_on_a_part_its_parent_reads_is_refused_and_marking_the_parent_takes_them_along():
    mha = lm.with_policy(lm.MultiHeadAttention(2, 8), HALF)
    f32 = lm.Policy("float32", "float32")
    with pytest.raises(
        ValueError,
        match=r"(?s)Projection at query would follow.*never called.*MultiHeadAttention at "
        r"<root>.*Match the MultiHeadAttention instead",
    ):
        lm.with_policy(mha, f32, where=lm.PathContains("query"))
    lm.with_policy(mha, HALF, where=lm.PathContains("query"))  # the same policy: fine
    # Marked with `...` (projections included), then the attention alone: they follow it.
    both = lm.with_policy(lm.MultiHeadAttention(2, 8), HALF, where=...)
    both = lm.with_policy(both, f32, where=lm.MultiHeadAttention)
    assert "_lamina_policy" not in vars(both.query)
    assert stored(both)["params/query/kernel"] == ("float32", "float32")
    with pytest.raises(ValueError, match="never called"):
        lm.with_policy(lm.MultiHeadAttention(2, 8), HALF, where=lm.PathContains("out"))


class Scale(lm.Module):
    def __call__(self, x, gain, layer):
        return layer(x) * gain.value[None]


class Passing(lm.Module):
    """Passes a declaration and a module of its own to a matched module."""

    def __init__(self):
        self.scale = Scale()
        self.gain = lm.Parameter((4,), lm.initializers.ones())
        self.dense = lm.Dense(4, 4)

    def __call__(self, x):
        return self.scale(x, self.gain, self.dense)


def test_declarations_and_modules_passed_to_a_matched_module_arrive_as_themselves():
    model = lm.with_policy(Passing(), HALF, where=Scale)
    fn, variables = _program(model, jnp.ones((2, 4)))
    y = fn(variables, jnp.ones((2, 4)))
    dense = lm.transform(lm.Dense(4, 4)).apply
    ref, _ = dense({"params": variables["params"]["dense"]}, None, jnp.ones((2, 4)))
    # gain and dense are not covered: float32, then the Scale's output cast to bfloat16.
    same(y, (ref * variables["params"]["gain"][None]).astype(BF16))
    gain = Passing().gain
    assert casting.cast_floating((gain, jnp.ones(2)), BF16)[0] is gain


# --- a Stack's carry, whatever is matched -----------------------------------------------------


class PostNorm(lm.Module):
    def __init__(self):
        self.dense = lm.Dense(4, 4)
        self.norm = lm.LayerNorm(4)

    def __call__(self, x):
        return self.norm(x + self.dense(x))


class Inside(lm.Module):
    """A Stack made inside a matched parent, its input made in float32 there."""

    def __init__(self, **kwargs):
        self.stack = lm.Stack(lm.Dense(4, 4), 2, **kwargs)

    def __call__(self, x):
        return self.stack(x.astype(jnp.float32) + jnp.arange(4.0)[None])


F32_POLICY = lm.Policy("float32", "float32")
STACKS = {
    "post-norm, norms float32": (
        lambda: lm.with_policy(
            lm.with_policy(lm.Stack(PostNorm(), 2), HALF, where=lm.Stack),
            F32_POLICY,
            where=lm.LayerNorm,
        ),
        BF16,
    ),
    "Stack(Sequential(block))": (
        lambda: lm.with_policy(lm.Stack(lm.Sequential(PostNorm()), 2), HALF, where=PostNorm),
        F32,  # the block's output cast back to the carry it took
    ),
    "Stack(Stack(block))": (
        lambda: lm.with_policy(lm.Stack(lm.Stack(PostNorm(), 2), 2), HALF, where=PostNorm),
        BF16,
    ),
    "root marked": (lambda: lm.with_policy(Inside(), HALF, where=lambda p, m: p == ()), BF16),
    "root marked, remat": (
        lambda: lm.with_policy(Inside(remat=True), HALF, where=lambda p, m: p == ()),
        BF16,
    ),
}


@pytest.mark.parametrize("case", list(STACKS))
def test_a_stacks_carry_keeps_one_dtype_whatever_is_matched(case, rng):
    build, out = STACKS[case]
    model = build()
    x = normal(rng, 2, 4)
    fn, variables = _program(model, x)
    y = fn(variables, x)
    assert y.dtype == out
    if case.startswith("root"):  # by hand: the block copies in bfloat16
        ref = (x.astype(BF16).astype(F32) + jnp.arange(4.0)[None]).astype(BF16)
        dense = lm.transform(model.stack.block).apply
        for i in range(2):
            ref, _ = dense(_copy({"params": variables["params"]["stack"]["block"]}, i), None, ref)
    elif case.startswith("post"):
        ref = x.astype(BF16)
        block = lm.transform(model.block).apply
        for i in range(2):
            ref = block(_copy({"params": variables["params"]["block"]}, i), None, ref)[0]
            ref = ref.astype(BF16)
    else:
        return  # the dtype, without the scan's carry error, is the point
    assert_close(y, ref, rtol=2e-2, atol=2e-2)  # bfloat16 rounding, compiled or not


# --- messages ---------------------------------------------------------------------------------


class Complex(lm.Module):
    def __init__(self):
        self.w = lm.Parameter((2,), lm.initializers.ones(), jnp.complex64)

    def __call__(self, x):
        return x * self.w.value


class WithComplex(lm.Module):
    def __init__(self):
        self.encoder = Complex()
        self.d = lm.Dense(2, 2)

    def __call__(self, x):
        return self.encoder(self.d(x))


def test_messages_say_what_works():
    for where in (lm.Not(Complex), ...):
        with pytest.raises(
            TypeError,
            match=r"(?s)params/encoder/w is a complex Parameter.*match neither the module that "
            r"holds it nor any module above it \(not the model itself",
        ):
            lm.with_policy(WithComplex(), HALF, where=where)
    assert stored(lm.with_policy(WithComplex(), HALF, where=lm.Dense))["params/d/kernel"] == (
        "bfloat16",
        "float32",
    )
    with pytest.raises(
        TypeError,
        match=r"selects variables, not modules.*named 'encoder' \(at encoder\).*"
        r"lm\.PathContains\('encoder'\)",
    ):
        lm.with_policy(WithComplex(), HALF, where="encoder")


def test_merging_a_lora_keeps_its_policy():
    lora = lm.LoRA(lm.Dense(4, 2), 2, b_init=lm.initializers.normal(0.5))
    lora = lm.with_policy(lora, lm.Policy("float32", "bfloat16", "float32"), where=lm.LoRA)
    model = lm.Sequential(lora, lm.relu)
    variables = lm.transform(model).init(KEY)
    merged, merged_variables = lm.merge_lora(model, variables)
    assert vars(merged.layers_0)["_lamina_policy"] == vars(lora)["_lamina_policy"]
    x = jnp.ones((1, 4))
    y = lm.transform(model).apply(variables, None, x)[0]
    y_merged = lm.transform(merged).apply(merged_variables, None, x)[0]
    assert y.dtype == y_merged.dtype == F32
    assert_close(y_merged, y, rtol=2e-2, atol=2e-2)  # the merged kernel rounds once to bf16
    # Policies worked out again from the marks keep it.
    again = lm.with_policy(merged, F32_POLICY, where=lambda path, module: path == ())
    assert again.layers_0.dtype == BF16


class Grouped(lm.Module):
    """A plain container (never called itself) of layers its parent calls."""

    def __init__(self):
        self.encoder = lm.Module()
        self.encoder.first = lm.Dense(4, 4)

    def __call__(self, x):
        return self.encoder.first(x)


def test_a_container_that_is_not_called_but_holds_called_layers_takes_a_policy():
    model = lm.with_policy(Grouped(), HALF, where=lm.PathContains("encoder"))
    assert model.encoder.first.dtype == BF16
    fn, variables = _program(model, jnp.ones((1, 4)))
    assert fn(variables, jnp.ones((1, 4))).dtype == BF16
