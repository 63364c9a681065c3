"""The checks every layer must pass, over the table in `tests/layer_table/`."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import lamina as lm
import lamina.nn
from tests.helpers import assert_close
from tests.layer_table import IDS, LAYERS, NOT_LAYERS, cast_inputs

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

GOLDEN = pathlib.Path(__file__).parent / "golden" / "layer_variables.json"
F32 = (jnp.float32, None)


def build(case, dtype=jnp.float32, param_dtype=None, seed=0):
    """Transforms the case's layer; returns (variables, call, inputs) with call(v, *inputs)."""
    init, apply = lm.transform(case.make(dtype, param_dtype), to_callable=case.to_callable)
    variables = init(jax.random.key(seed))
    inputs = cast_inputs(case.inputs(np.random.default_rng(seed), np.float32), dtype)
    rngs = jax.random.key(seed + 1) if case.needs_rng else None

    def call(variables, *inputs):
        return apply(variables, rngs, *inputs, **case.kwargs)

    return variables, call, inputs


def differentiable(case, variables, inputs):
    """The loss, and which arguments to differentiate: float variables and float inputs."""
    params = variables.get("params", {})
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params, *inputs):
        outputs, _ = call_holder[0]({"params": params, **rest} if params else rest, *inputs)
        leaves = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
        wide = [x if x.dtype.itemsize >= 4 else x.astype(jnp.float32) for x in leaves]
        return sum(jnp.sum(jnp.sin(x) * x) for x in wide)

    argnums = (0,) + (tuple(range(1, 1 + len(inputs))) if case.differentiable_inputs else ())
    call_holder = []
    return loss, params, argnums, call_holder


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_jit_equals_eager(case):
    variables, call, inputs = build(case)
    eager = call(variables, *inputs)
    jitted = jax.jit(call)(variables, *inputs)
    assert_close(jitted, eager)


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_checkpoint_equals_eager(case):
    variables, call, inputs = build(case)
    assert_close(jax.checkpoint(call)(variables, *inputs), call(variables, *inputs))


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_vmap_equals_loop(case):
    variables, call, _ = build(case)
    stacked = [
        cast_inputs(case.inputs(np.random.default_rng(s), np.float32), jnp.float32)
        for s in range(3)
    ]
    batched = jax.tree.map(lambda *xs: jnp.stack(xs), *stacked)
    got = jax.vmap(call, in_axes=(None, *([0] * len(batched))))(variables, *batched)
    for i, inputs in enumerate(stacked):
        assert_close(
            jax.tree.map(lambda x, i=i: x[i], got), call(variables, *inputs), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_grad_eager_jit_and_checkpoint_agree(case):
    variables, call, inputs = build(case)
    loss, params, argnums, holder = differentiable(case, variables, inputs)
    holder.append(call)
    grads = jax.grad(loss, argnums=argnums)(params, *inputs)
    assert_close(
        jax.jit(jax.grad(loss, argnums=argnums))(params, *inputs), grads, rtol=1e-4, atol=1e-5
    )
    holder[0] = jax.checkpoint(call)
    assert_close(jax.grad(loss, argnums=argnums)(params, *inputs), grads, rtol=1e-4, atol=1e-5)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert any(np.abs(np.asarray(g)).sum() > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_grad_matches_finite_differences_in_float64(case):
    with jax.enable_x64(True):
        variables, call, inputs = build(case, jnp.float64)
        loss, params, argnums, holder = differentiable(case, variables, inputs)
        holder.append(call)
        chosen = [params, *inputs]
        fixed = {i: a for i, a in enumerate(chosen) if i not in argnums}

        def by_args(*diff):
            full = dict(zip(argnums, diff, strict=True)) | fixed
            return loss(*(full[i] for i in range(len(chosen))))

        check_grads(
            by_args,
            tuple(chosen[i] for i in argnums),
            order=1,
            modes=("rev",),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_dtypes(case, dtype):
    reference_vars, reference_call, reference_inputs = build(case)
    expected, _ = reference_call(reference_vars, *reference_inputs)
    with jax.enable_x64(dtype == "float64"):
        compute = jnp.dtype(dtype)
        storage = jnp.float32 if dtype == "bfloat16" else jnp.float64
        variables, call, inputs = build(case, compute, storage)
        for leaf in jax.tree.leaves(variables.get("params", {})):
            assert leaf.dtype == storage
        # the same weights as the float32 reference, so the outputs are comparable
        variables = jax.tree.map(lambda r, v: jnp.asarray(r, v.dtype), reference_vars, variables)
        outputs, new_variables = call(variables, *inputs)
        floats = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
        if case.output_in_dtype:
            assert {x.dtype for x in floats} == {compute}
        assert jax.tree.structure(new_variables) == jax.tree.structure(variables)
        if dtype == "float64" and case.needs_rng:
            # 64-bit uniforms give other dropout masks: the same layer, other random draws
            assert all(np.isfinite(np.asarray(x)).all() for x in floats)
        elif dtype == "float64":
            assert_close(outputs, expected, rtol=1e-4, atol=1e-5, check_dtype=False)
        else:
            scale = max(
                float(np.abs(np.asarray(x, np.float32)).max()) for x in jax.tree.leaves(expected)
            )
            assert_close(outputs, expected, rtol=5e-2, atol=5e-2 * scale, check_dtype=False)


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_dtype_none_infers_the_compute_dtype(case):
    """``dtype=None`` computes in the promotion of inputs and variables (Linen's default)."""
    variables, call, inputs = build(case, None, jnp.bfloat16)
    for leaf in jax.tree.leaves(variables.get("params", {})):
        assert leaf.dtype == jnp.bfloat16
    inputs = cast_inputs(inputs, jnp.bfloat16)
    outputs, _ = call(variables, *inputs)
    floats = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in floats} <= {jnp.dtype(jnp.bfloat16)}
    # float32 parameters promote bfloat16 inputs to float32, as jnp.result_type does
    variables, call, _ = build(case, None, None)
    stack = isinstance(case.make(None, None), lm.Stack)
    if stack and variables.get("params"):  # a scan's carry cannot change dtype
        with pytest.raises(TypeError, match=r"goes in as bfloat16\[.* comes out as float32"):
            call(variables, *inputs)
        return
    outputs, _ = call(variables, *inputs)
    floats = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
    if case.output_in_dtype and variables.get("params"):
        assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}


def golden_entry(case):
    variables = jax.eval_shape(lm.transform(case.make(jnp.float32, None)).init, jax.random.key(0))
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {"/".join(str(k.key) for k in path): f"{tuple(x.shape)} {x.dtype}" for path, x in flat}


def test_golden_variable_paths_and_shapes():
    """Fails on any unintended change of a layer's variables; LAMINA_UPDATE_GOLDEN=1 rewrites."""
    current = {case.name: golden_entry(case) for case in LAYERS}
    if os.environ.get("LAMINA_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    for name in current:
        assert name in recorded, f"{name} is not in {GOLDEN.name}: run with LAMINA_UPDATE_GOLDEN=1"
        assert current[name] == recorded[name], f"the variables of {name} changed"
    assert set(recorded) == set(current)


def public_layers():
    """Every public `lm.*` subclass of `lm.Module`, and every public function of `lamina.nn`."""
    names = set()
    for name in dir(lm):
        obj = getattr(lm, name)
        if name.startswith("_"):
            continue
        if (isinstance(obj, type) and issubclass(obj, lm.Module)) or (
            callable(obj) and getattr(obj, "__module__", "").startswith("lamina.nn")
        ):
            names.add(name)
    for name in dir(lamina.nn):  # its layers; not the activations and initializers it re-exports
        obj = getattr(lamina.nn, name)
        if not name.startswith("_") and (
            (isinstance(obj, type) and issubclass(obj, lm.Module))
            or (callable(obj) and getattr(obj, "__module__", "").startswith("lamina.nn"))
        ):
            names.add(name)
    return names


def covered(case):
    """The public names that a table entry exercises: its modules' classes and functions."""
    names, stack, seen = set(), [case.make(jnp.float32, None)], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, lm.Module):
            names.add(type(node).__name__)
            stack.extend(vars(node).values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif callable(node):
            names.add(getattr(node, "__name__", ""))
    return names


def test_every_public_layer_is_in_the_table():
    """A public layer without an entry in tests/layer_table/ is a failure (as Haiku's)."""
    in_table = set().union(*(covered(case) for case in LAYERS))
    missing = sorted(public_layers() - in_table - set(NOT_LAYERS))
    assert not missing, (
        f"public layers missing from tests/layer_table/: {missing}; add an entry to LAYERS "
        f"(or, if it is not a layer, to NOT_LAYERS with the reason)"
    )
    assert not set(NOT_LAYERS) & in_table, "an entry of NOT_LAYERS is in the table after all"
    assert set(NOT_LAYERS) <= public_layers(), "NOT_LAYERS names something that is not public"


class _Lifted(lm.Module):
    """Runs the case's layer through a lifted transform: checkpoint, or vmap over a Stack."""

    def __init__(self, case, layer, copies):
        self.case = case
        self.copies = copies
        self.layer = lm.Stack(layer, copies) if copies else layer

    def __call__(self, *inputs):
        case = self.case

        def run(layer, *inputs):
            method = case.to_callable(layer) if case.to_callable else layer.__call__
            return method(*inputs, **case.kwargs)

        if not self.copies:
            return lm.checkpoint(run)(self.layer, *inputs)
        in_axes = (0, *([None] * len(inputs)))
        return lm.vmap(run, in_axes=in_axes, axis_size=self.copies)(self.layer.block, *inputs)


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_lifted_checkpoint_equals_the_plain_layer(case):
    variables, call, inputs = build(case)
    host = _Lifted(case, case.make(*F32), copies=0)
    init, apply = lm.transform(host)
    lifted = {c: {"layer": v} for c, v in variables.items()}
    rngs = jax.random.key(1) if case.needs_rng else None
    out, new = apply(lifted, rngs, *inputs)
    if case.needs_rng:  # the lifted call forks the streams, so its keys differ
        assert jax.tree.structure(out) == jax.tree.structure(call(variables, *inputs)[0])
        return
    expected, expected_new = call(variables, *inputs)
    assert_close(out, expected)
    assert_close(lm.take_variables(host, new, host.layer), expected_new)


@pytest.mark.parametrize("case", LAYERS, ids=IDS)
def test_every_member_of_a_stack_equals_the_layer_with_its_slice(case):
    _, call, inputs = build(case)
    host = _Lifted(case, case.make(*F32), copies=2)
    init, apply = lm.transform(host)
    variables = init(jax.random.key(0))
    rngs = jax.random.key(1) if case.needs_rng else None
    out, new = apply(variables, rngs, *inputs)
    stacked = lm.take_variables(host, variables, host.layer.block)
    new_stacked = lm.take_variables(host, new, host.layer.block)
    for i in range(2):
        member = jax.tree.map(lambda a, i=i: a[i], stacked)
        expected, expected_new = call(member, *inputs)
        got = jax.tree.map(lambda a, i=i: a[i], out)
        if case.needs_rng:
            assert jax.tree.structure(got) == jax.tree.structure(expected)
            continue
        assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert_close(jax.tree.map(lambda a, i=i: a[i], new_stacked), expected_new)
    if stacked:
        first = jax.tree.leaves(stacked)[0]
        assert first.shape[0] == 2
