"""Lifted transforms: modules as arguments of vmap, scan, checkpoint, cond, switch and loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lamina as lm
from tests.helpers import assert_close


class Counter(lm.Module):
    """A Dense with a mutable call counter and a running sum of its inputs."""

    def __init__(self, n_in=3, n_out=2):
        self.dense = lm.Dense(n_in, n_out)
        self.calls = lm.State("counters", (), lm.initializers.zeros(), jnp.float32, mutable=True)

    def __call__(self, x):
        self.calls.value = self.calls + 1
        return self.dense(x)


class Host(lm.Module):
    """Runs `body(self, *args)` inside apply."""

    def __init__(self, body, **children):
        for name, child in children.items():
            setattr(self, name, child)
        self.body = body

    def __call__(self, *args):
        return self.body(self, *args)


def affine(x, params, i=None):
    kernel, bias = params["kernel"], params["bias"]
    if i is not None:
        kernel, bias = kernel[i], bias[i]
    return x @ kernel + bias.reshape((1,) * (x.ndim - 1) + bias.shape)


def run(body, *args, rngs=None, jit=False, **children):
    init, apply = lm.transform(Host(body, **children))
    variables = init(jax.random.key(0))
    fn = jax.jit(apply) if jit else apply
    out, new = fn(variables, rngs, *args)
    return out, new, variables


# --- vmap ------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_over_a_stacked_block_equals_each_member(jit):
    def body(m, x):
        return lm.vmap(lambda block, x: block(x), in_axes=(0, None))(m.stack.block, x)

    x = jnp.arange(3.0)
    out, _, v = run(body, x, jit=jit, stack=lm.Stack(lm.Dense(3, 2), 4))
    params = v["params"]["stack"]["block"]
    expected = np.stack([affine(x, params, i) for i in range(4)])
    assert out.shape == (4, 2)
    assert_close(out, expected)


def test_vmap_state_axes_maps_params_and_broadcasts_the_rest():
    def body(m, xs):
        axes = lm.StateAxes({"params": None, "counters": None})
        return lm.vmap(lambda c, x: c.dense(x), in_axes=(axes, 0))(m.c, xs)

    xs = jnp.ones((5, 3))
    out, _, v = run(body, xs, c=Counter())
    expected = affine(xs, v["params"]["c"]["dense"])
    assert_close(out, expected)


def test_vmap_writes_mapped_state_back_with_its_axis():
    class Stat(lm.Module):
        def __init__(self):
            self.seen = lm.State("stats", (3,), lm.initializers.zeros(), mutable=True)

        def __call__(self, x):
            self.seen.value = self.seen + x
            return x

    def body(m, xs):
        axes = lm.StateAxes({"stats": 0})
        return lm.vmap(lambda s, x: s(x), in_axes=(axes, None), axis_size=2)(m.s.block, xs)

    xs = jnp.arange(3.0)
    _, new, _ = run(body, xs, s=lm.Stack(Stat(), 2))
    assert_close(new["stats"]["s"]["block"]["seen"], np.stack([xs, xs]))


def test_vmap_broadcast_state_written_with_a_mapped_value_is_an_error():
    def write(c, x):
        c.calls.value = c.calls + x.sum()  # differs per member
        return x

    def body(m, xs):
        return lm.vmap(write, in_axes=(None, 0))(m.c, xs)

    with pytest.raises(ValueError, match=r"broadcast variable .*counters/c/calls"):
        run(body, jnp.ones((4, 3)), c=Counter())


def test_vmap_broadcast_state_written_with_an_unmapped_value_is_fine():
    def body(m, xs):
        return lm.vmap(lambda c, x: c(x), in_axes=(None, 0))(m.c, xs)

    class Same(Counter):
        def __call__(self, x):
            self.calls.value = jnp.float32(7.0)
            return self.dense(x)

    _, new, _ = run(body, jnp.ones((4, 3)), c=Same())
    assert float(new["counters"]["c"]["calls"]) == 7.0


def test_state_axes_with_an_unmatched_variable_names_it():
    def body(m, xs):
        return lm.vmap(lambda c, x: c(x), in_axes=(lm.StateAxes({"params": None}), 0))(m.c, xs)

    with pytest.raises(ValueError, match=r"counters/c/calls matches no filter of StateAxes"):
        run(body, jnp.ones((4, 3)), c=Counter())


def test_module_passed_twice_with_different_axes():
    def body(m, xs):
        return lm.vmap(lambda a, b, x: a(x), in_axes=(None, 0, 0))(m.c, m.c, xs)

    with pytest.raises(ValueError, match=r"module at c is passed twice with different axes"):
        run(body, jnp.ones((2, 3)), c=Counter())


def test_variable_shared_by_two_modules_with_different_axes():
    shared = lm.Dense(3, 3)

    class Wrap(lm.Module):
        def __init__(self, inner):
            self.inner = inner

    def body(m, xs):
        return lm.vmap(lambda a, b, x: a.inner(x), in_axes=(None, 0, 0))(m.a, m.b, xs)

    shared_by = r"params/a/inner/(kernel|bias) is shared by the module at a \(axis None"
    with pytest.raises(ValueError, match=shared_by):
        run(body, jnp.ones((3, 3)), a=Wrap(shared), b=Wrap(shared))


def test_module_returned_with_other_axes():
    def body(m, xs):
        return lm.vmap(lambda c, x: (c, x), in_axes=(None, 0), out_axes=(0, 0))(m.c, xs)

    with pytest.raises(ValueError, match=r"module at c is returned with axes 0 but came in"):
        run(body, jnp.ones((2, 3)), c=Counter())


def test_module_returned_with_its_spec_comes_back_as_itself():
    def body(m, xs):
        c, ys = lm.vmap(lambda c, x: (c, x * 2), in_axes=(None, 0), out_axes=(None, 0))(m.c, xs)
        assert c is m.c
        return ys

    out, _, _ = run(body, jnp.ones((2, 3)), c=Counter())
    assert_close(out, np.full((2, 3), 2.0))


def test_captured_module_can_be_read_not_written_nor_returned():
    def read(m, xs):
        return lm.vmap(lambda x: m.c.dense(x))(xs)

    out, _, v = run(read, jnp.ones((2, 3)), c=Counter())
    assert out.shape == (2, 2)

    def write(m, xs):
        return lm.vmap(lambda x: m.c(x))(xs)

    with pytest.raises(lm.TraceContextError, match=r"counters/c/calls .* not an argument"):
        run(write, jnp.ones((2, 3)), c=Counter())

    def give_back(m, xs):
        return lm.vmap(lambda x: (m.c, x), out_axes=(None, 0))(xs)

    with pytest.raises(ValueError, match=r"returned the module at c, which was not passed"):
        run(give_back, jnp.ones((2, 3)), c=Counter())


def test_lifted_transform_outside_a_call_says_where_to_use_it():
    with pytest.raises(RuntimeError, match=r"lm.vmap was called outside init/apply"):
        lm.vmap(lambda x: x)(jnp.ones(2))


def test_raw_transform_around_a_lifted_one_is_refused():
    def body(m, xs):
        return jax.vmap(lambda x: lm.vmap(lambda c, y: c(y), in_axes=(None, 0))(m.c, x))(xs)

    with pytest.raises(lm.TraceContextError, match=r"lm.vmap was called inside a JAX"):
        run(body, jnp.ones((2, 2, 3)), c=Counter())


# --- rngs ------------------------------------------------------------------------------------


def noise(x):
    return x + jax.random.normal(lm.next_rng_key("dropout"), x.shape)


def test_vmap_broadcasts_keys_by_default_and_splits_them_on_request():
    def broadcast(m, xs):
        return lm.vmap(noise)(xs)

    out, _, _ = run(broadcast, jnp.zeros((3, 2)), rngs={"dropout": jax.random.key(1)})
    assert_close(out[0], out[1])

    def split(m, xs):
        return lm.split_rngs(splits=3)(lm.vmap(noise))(xs)

    out, _, _ = run(split, jnp.zeros((3, 2)), rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(out[0], out[1]) and not np.allclose(out[1], out[2])


def test_split_rngs_only_selects_streams():
    def body(m, xs):
        return lm.split_rngs(splits=2, only="other")(lm.vmap(noise))(xs)

    rngs = {"dropout": jax.random.key(1), "other": jax.random.key(2)}
    out, _, _ = run(body, jnp.zeros((2, 2)), rngs=rngs)
    assert_close(out[0], out[1])


def test_split_count_must_match_the_axis():
    def body(m, xs):
        return lm.split_rngs(splits=5)(lm.scan(lambda c, x: (c, noise(x))))(0.0, xs)

    with pytest.raises(ValueError, match=r"(split_rngs\(splits=5\)|mismatch|size)"):
        run(body, jnp.zeros((3, 2)), rngs={"dropout": jax.random.key(1)})


def test_keys_are_never_reused_across_lifted_calls():
    def body(m, x):
        a = lm.vmap(noise, axis_size=1, in_axes=None)(x)
        b = lm.vmap(noise, axis_size=1, in_axes=None)(x)
        c = noise(x)
        return jnp.stack([a[0], b[0], c])

    out, _, _ = run(body, jnp.zeros(2), rngs={"dropout": jax.random.key(1)})
    rows = {tuple(r) for r in np.asarray(out).tolist()}
    assert len(rows) == 3


# --- scan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scan_carries_arrays_and_stacks_outputs(jit):
    def body(m, xs):
        return lm.scan(lambda c, x: (c + x, c * x))(jnp.zeros(()), xs)

    (carry, ys), _, _ = run(body, jnp.arange(4.0), jit=jit)
    assert float(carry) == 6.0
    assert_close(ys, np.array([0.0, 0.0, 2.0, 9.0], np.float32))


def test_scan_carries_a_modules_state():
    def body(m, xs):
        step = lm.scan(lambda c, x: (c, c(x)), in_axes=(lm.Carry, 0), out_axes=(lm.Carry, 0))
        c, ys = step(m.c, xs)
        assert c is m.c
        return ys

    xs = jnp.ones((5, 3))
    ys, new, v = run(body, xs, c=Counter())
    assert float(new["counters"]["c"]["calls"]) == 5.0
    assert_close(ys, affine(xs, v["params"]["c"]["dense"]))


def test_scan_broadcast_state_written_is_an_error():
    def body(m, xs):
        return lm.scan(
            lambda c, x: (c, m.c(x)) if False else (c, c(x)), in_axes=(None, 0), out_axes=(None, 0)
        )(m.c, xs)

    with pytest.raises(ValueError, match=r"counters/c/calls is broadcast .* written inside"):
        run(body, jnp.ones((2, 3)), c=Counter())


def test_stack_equals_the_loop_over_its_copies():
    x = jnp.arange(8.0).reshape(2, 4) / 8
    block = lm.Sequential(lm.Dense(4, 4), lm.tanh)
    init, apply = lm.transform(lm.Stack(block, 5))
    v = init(jax.random.key(0))
    params = v["params"]["block"]["layers_0"]
    assert not np.allclose(params["kernel"][0], params["kernel"][1])  # copies differ
    expected = x
    for i in range(5):
        expected = jnp.tanh(affine(expected, params, i))
    assert_close(apply(v, None, x)[0], expected)
    grads = jax.grad(lambda v: apply(v, None, x)[0].sum())(v)
    manual = jax.grad(lambda p: _loop(p, x).sum())(params)
    assert_close(grads["params"]["block"]["layers_0"]["kernel"], manual["kernel"])


def _loop(params, x):
    for i in range(params["kernel"].shape[0]):
        x = jnp.tanh(affine(x, params, i))
    return x


def test_stack_gives_each_layer_its_own_dropout_keys():
    class Drop(lm.Module):
        def __call__(self, x):
            return x + jax.random.normal(lm.next_rng_key("dropout"), x.shape)

    init, apply = lm.transform(lm.Stack(Drop(), 3))
    a, _ = apply({}, {"dropout": jax.random.key(0)}, jnp.zeros(2))
    # the sum of three different normals, not three times one
    single = jax.random.normal(jax.random.fold_in(jax.random.key(0), 0), (2,))
    assert not np.allclose(a, 3 * single)
    b, _ = apply({}, {"dropout": jax.random.key(0)}, jnp.zeros(2))
    assert_close(a, b)


def test_stack_program_does_not_grow_with_depth():
    def size(n):
        init, apply = lm.transform(lm.Stack(lm.Dense(4, 4), n))
        v = jax.eval_shape(init, jax.random.key(0))
        v = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), v)
        return len(str(jax.make_jaxpr(lambda v: apply(v, None, jnp.ones(4))[0])(v)))

    assert size(64) == size(2) or abs(size(64) - size(2)) < 200


def test_stack_of_batch_norm_writes_stacked_statistics():
    class Block(lm.Module):
        def __init__(self):
            self.bn = lm.BatchNorm(3)

        def __call__(self, x):
            return self.bn(x, True)

    init, apply = lm.transform(lm.Stack(Block(), 2))
    v = init(jax.random.key(0))
    x = jnp.arange(12.0).reshape(4, 3)
    _, new = apply(v, None, x)
    mean = new["batch_stats"]["block"]["bn"]["mean"]
    assert mean.shape == (2, 3) and not np.allclose(mean[0], 0)


# --- checkpoint, cond, switch, loops ---------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_checkpoint_equals_the_plain_call_with_gradients(jit):
    def plain(m, x):
        return m.c(x)

    def remat(m, x):
        return lm.checkpoint(lambda c, x: c(x))(m.c, x)

    x = jnp.arange(3.0)
    for body in (plain, remat):
        init, apply = lm.transform(Host(body, c=Counter()))
        v = init(jax.random.key(0))
        fn = jax.jit(apply) if jit else apply
        out, new = fn(v, None, x)
        grads = jax.grad(lambda v, fn=fn: fn(v, None, x)[0].sum())(v)
        if body is plain:
            expected = (out, new, grads)
        else:
            jax.tree.map(assert_close, (out, new, grads), expected)


def test_checkpoint_static_argnums():
    def body(m, x):
        return lm.remat(lambda c, x, times: c.dense(x) * times, static_argnums=2)(m.c, x, 3)

    out, _, v = run(body, jnp.ones(3), c=Counter())
    params = v["params"]["c"]["dense"]
    assert_close(out, 3 * affine(jnp.ones(3), params))


def test_checkpoint_writes_back_only_the_state_it_wrote():
    # jax.checkpoint hands every value back as a new tracer: state only read inside must stay
    # the leaf apply was given (lm.export's training-mode check relies on it)
    def reads(m, x):
        return lm.remat(lambda c, x: c.dense(x))(m.c, x)

    def writes(m, x):
        return lm.remat(lambda c, x: c(x))(m.c, x)

    for body, written in ((reads, False), (writes, True)):
        init, apply = lm.transform(Host(body, c=Counter()))
        seen = []

        def probe(variables, x, apply=apply, seen=seen):
            _, new = apply(variables, None, x)
            seen.append(new["counters"]["c"]["calls"] is not variables["counters"]["c"]["calls"])
            return new

        new = jax.eval_shape(probe, init(jax.random.key(0)), jnp.ones(3))
        assert seen == [written] and new["counters"]["c"]["calls"].shape == ()


@pytest.mark.parametrize("pred", [True, False])
def test_cond_writes_state_from_the_branch_taken(pred):
    def body(m, x, p):
        return lm.cond(p, lambda c, x: c(x), lambda c, x: c.dense(x) * 0, m.c, x)

    out, new, _ = run(body, jnp.ones(3), jnp.asarray(pred), c=Counter(), jit=True)
    assert float(new["counters"]["c"]["calls"]) == (1.0 if pred else 0.0)
    assert bool(np.any(out != 0)) == pred


def test_switch_with_state():
    def body(m, i, x):
        branches = [lambda c, x: x[:2], lambda c, x: c(x) * 0 + 5, lambda c, x: -x[:2]]
        return lm.switch(i, branches, m.c, x)

    out, new, _ = run(body, 1, jnp.ones(3), c=Counter(), jit=True)
    assert float(out[0]) == 5.0 and float(new["counters"]["c"]["calls"]) == 1.0


def test_branches_that_return_different_modules_are_an_error():
    def body(m, p):
        return lm.cond(p, lambda a, b: a, lambda a, b: b, m.a, m.b)

    with pytest.raises((ValueError, TypeError)):
        run(body, jnp.asarray(True), a=Counter(), b=Counter())


def test_fori_loop_carries_state():
    def body(m, x):
        def step(i, val):
            c, x = val
            return c, c(x) + x * i

        return lm.fori_loop(0, 3, step, (m.c, x))[1]

    counter = Counter(2, 2)
    out, new, v = run(body, jnp.ones(2), c=counter, jit=True)
    assert float(new["counters"]["c"]["calls"]) == 3.0
    p = v["params"]["c"]["dense"]
    expected = jnp.ones(2)
    for i in range(3):
        expected = affine(expected, p) + expected * i
    assert_close(out, expected)


def test_while_loop_with_state_and_split_keys():
    def body(m, x):
        def step(val):
            c, x = val
            c.calls.value = c.calls + 1
            return c, x + jnp.abs(jax.random.normal(lm.next_rng_key("dropout")))

        return lm.while_loop(lambda v: v[1] < 3.0, step, (m.c, x), split_rngs="dropout")[1]

    out, new, _ = run(body, jnp.zeros(()), c=Counter(), rngs={"dropout": jax.random.key(2)})
    assert float(out) >= 3.0 and float(new["counters"]["c"]["calls"]) >= 1


def test_while_loop_condition_may_not_write():
    def body(m, x):
        def cond(val):
            c, x = val
            c.calls.value = c.calls + 1
            return x < 3

        return lm.while_loop(cond, lambda v: (v[0], v[1] + 1), (m.c, x))[1]

    with pytest.raises(ValueError, match=r"cond_fun wrote counters/c/calls"):
        run(body, jnp.zeros(()), c=Counter())


def test_nested_lifted_transforms():
    def body(m, xs):
        def member(block, x):
            return lm.checkpoint(lambda b, x: b(x))(block, x)

        return lm.vmap(member, in_axes=(0, None))(m.s.block, xs)

    out, _, v = run(body, jnp.ones(3), s=lm.Stack(lm.Dense(3, 3), 2))
    p = v["params"]["s"]["block"]
    assert_close(out[1], affine(jnp.ones(3), p, 1))


# --- a submodule on its own ------------------------------------------------------------------


class AutoEncoder(lm.Module):
    def __init__(self):
        self.embed = lm.Embed(10, 4)
        self.encoder = lm.Stack(lm.Sequential(lm.Dense(4, 4), lm.tanh), 2)
        self.decoder = Decoder(self.embed)

    def __call__(self, tokens):
        return self.decoder(self.encoder(self.embed(tokens)))


class Decoder(lm.Module):
    def __init__(self, embed):
        self.project = lm.Dense(4, 4)
        self.embed = embed  # tied: first reached as AutoEncoder.embed

    def __call__(self, z):
        return self.embed.attend(self.project(z))


def test_a_submodule_runs_alone_on_its_slice():
    model = AutoEncoder()
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    z = jnp.ones((3, 4))
    whole, _ = lm.transform(model, to_callable=lambda m: m.decoder).apply(variables, None, z)
    sliced = lm.take_variables(model, variables, model.decoder)
    assert sorted(sliced["params"]) == ["embed", "project"]  # the tied embedding comes along
    alone, _ = lm.transform(model.decoder).apply(sliced, None, z)
    assert_close(alone, whole)


def test_a_stack_block_slice_keeps_its_axis_and_goes_back():
    model = AutoEncoder()
    variables = lm.transform(model).init(jax.random.key(0))
    block = lm.take_variables(model, variables, model.encoder.block)
    assert block["params"]["layers_0"]["kernel"].shape == (2, 4, 4)
    doubled = jax.tree.map(lambda a: 2 * a, block)
    new = lm.put_variables(model, variables, model.encoder.block, doubled)
    assert_close(
        new["params"]["encoder"]["block"]["layers_0"]["kernel"],
        2 * variables["params"]["encoder"]["block"]["layers_0"]["kernel"],
    )
    assert_close(new["params"]["embed"], variables["params"]["embed"])


def test_slices_check_their_inputs():
    model = AutoEncoder()
    variables = lm.transform(model).init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"not a submodule of AutoEncoder"):
        lm.take_variables(model, variables, lm.Dense(4, 4))
    with pytest.raises(lm.VariablesError, match=r"lack 2 of the Decoder's"):
        lm.take_variables(model, {"params": {"embed": variables["params"]["embed"]}}, model.decoder)
    with pytest.raises(lm.VariablesError, match=r"unexpected"):
        lm.put_variables(model, variables, model.decoder, {"params": {"nope": jnp.ones(2)}})


# --- each transform against the same computation without it, with gradients -----------------


def _with(kind):
    """A body that computes dense(x) * 2 through the lifted transform `kind`."""

    def body(m, x):
        if kind == "plain":
            return m.d(x) * 2
        if kind == "vmap":
            return lm.vmap(lambda d, x: d(x) * 2, in_axes=(None, 0))(m.d, x[None])[0]
        if kind == "scan":
            step = lm.scan(lambda d, x: (d, d(x) * 2), in_axes=(lm.Carry, 0))
            return step(m.d, x[None])[1][0]
        if kind == "checkpoint":
            return lm.checkpoint(lambda d, x: d(x) * 2)(m.d, x)
        if kind == "cond":
            return lm.cond(True, lambda d, x: d(x) * 2, lambda d, x: d(x) * 3, m.d, x)
        if kind == "switch":
            return lm.switch(1, [lambda d, x: d(x), lambda d, x: d(x) * 2], m.d, x)
        if kind == "fori_loop":
            return lm.fori_loop(0, 1, lambda i, v: (v[0], v[0](v[1]) * 2), (m.d, x))[1]
        return lm.while_loop(
            lambda v: v[2] < 1, lambda v: (v[0], v[0](v[1]) * 2, v[2] + 1), (m.d, x, 0)
        )[1]

    return body


@pytest.mark.parametrize(
    "kind", ["vmap", "scan", "checkpoint", "cond", "switch", "fori_loop", "while_loop"]
)
def test_each_transform_equals_the_plain_computation_and_its_gradient(kind):
    x = jnp.arange(3.0) / 3
    results = []
    for body in (_with("plain"), _with(kind)):
        init, apply = lm.transform(Host(body, d=lm.Dense(3, 3)))
        v = init(jax.random.key(0))
        out = jax.jit(apply)(v, None, x)[0]
        if kind == "while_loop":  # JAX cannot reverse-differentiate while_loop
            results.append(out)
            continue
        grads = jax.grad(lambda v, apply=apply: jnp.sum(jnp.sin(apply(v, None, x)[0])))(v)
        results.append((out, grads))
    jax.tree.map(assert_close, results[1], results[0])


@pytest.mark.parametrize("unroll", [2, True])
def test_stack_unroll_computes_the_same(unroll):
    x = jnp.arange(4.0) / 4
    init, apply = lm.transform(lm.Stack(lm.Dense(4, 4), 4))
    v = init(jax.random.key(0))
    _, unrolled = lm.transform(lm.Stack(lm.Dense(4, 4), 4, unroll=unroll))
    assert_close(unrolled(v, None, x)[0], apply(v, None, x)[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"Stack: n must be a positive int"),
        ({"unroll": 0}, r"Stack: unroll must be a positive int"),
        ({"remat": "yes"}, r"Stack: remat must be True or False"),
    ],
)
def test_stack_checks_its_arguments(kwargs, match):
    arguments = {"n": 2, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        lm.Stack(lm.Dense(2, 2), **arguments)


def test_stack_block_must_be_a_module():
    with pytest.raises(TypeError, match=r"Stack: block must be an lm.Module"):
        lm.Stack(lambda x: x, 2)


# --- stored layouts, splits carried by the call, variables as arguments ----------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_broadcasting_a_stacked_variable_into_its_block_names_the_layout(jit):
    def body(m, x):
        axes = lm.StateAxes({...: None})
        return lm.vmap(lambda b, x: b(x), in_axes=(axes, None), axis_size=4)(m.s.block, x)

    match = (
        r"lm.vmap: params/s/block/(kernel|bias) is stored as \(4, 4(, 4)?\) .*the module at "
        r"s/block lies inside the Stack at s \(4 copies\).* axis None \(from StateAxes"
    )
    with pytest.raises(ValueError, match=match):
        run(body, jnp.ones(4), jit=jit, s=lm.Stack(lm.Dense(4, 4), 4))


def test_state_axes_mapping_the_stacked_axis_still_works():
    def body(m, x):
        axes = lm.StateAxes({"params": 0, ...: None})
        return lm.vmap(lambda b, x: b(x), in_axes=(axes, None))(m.s.block, x)

    x = jnp.arange(4.0)
    out, _, v = run(body, x, s=lm.Stack(lm.Dense(4, 4), 4))
    params = v["params"]["s"]["block"]
    assert_close(out, np.stack([affine(x, params, i) for i in range(4)]))


def test_mapping_the_copies_of_a_stack_passed_whole_is_an_error():
    def body(m, x):
        return lm.vmap(lambda s, x: s(x), in_axes=(0, None))(m.s, x)

    with pytest.raises(ValueError, match=r"the module at s runs the stacked copies itself"):
        run(body, jnp.ones(4), s=lm.Stack(lm.Dense(4, 4), 4))


def test_split_rngs_as_a_context_manager_is_refused():
    def body(m, xs):
        return lm.vmap(noise)(xs)

    init, apply = lm.transform(Host(body))
    refused = r"with lm.split_rngs\(splits=3.*lm.vmap\(f, split_rngs"
    with pytest.raises(TypeError, match=refused), lm.split_rngs(splits=3):
        apply({}, {"dropout": jax.random.key(1)}, jnp.zeros((3, 2)))


@pytest.mark.parametrize(
    "lift",
    [
        lambda f: lm.vmap(f, split_rngs="dropout"),
        lambda f: lm.vmap(f, split_rngs=True),
        lambda f: lm.vmap(lm.split_rngs(splits=3, only="dropout")(f)),
        lambda f: lm.split_rngs(splits=3)(lm.vmap(f)),
    ],
    ids=["argument", "all", "inner-decorator", "outer-decorator"],
)
def test_a_split_travels_with_its_lifted_call_under_jit(lift):
    def body(m, xs):
        split = lift(noise)(xs)
        plain = lm.vmap(noise)(xs)  # never split: no ambient state reaches it
        return split, plain

    init, apply = lm.transform(Host(body))
    step = jax.jit(apply)
    for seed in (1, 2):  # the second call reuses the trace
        (split, plain), _ = step({}, {"dropout": jax.random.key(seed)}, jnp.zeros((3, 2)))
        assert len({tuple(np.asarray(r).tolist()) for r in split}) == 3
        assert_close(plain[0], plain[1])
        assert_close(plain[1], plain[2])


def test_split_rngs_naming_a_stream_the_call_lacks_is_an_error():
    def body(m, xs):
        return lm.vmap(noise, split_rngs="dropout")(xs)

    with pytest.raises(lm.RngError, match=r"'dropout', but this call's rngs have only 'default'"):
        run(body, jnp.zeros((3, 2)), rngs=jax.random.key(1))


def test_split_count_names_the_count_and_the_axis_size():
    def body(m, xs):
        return lm.split_rngs(splits=5)(lm.vmap(noise))(xs)

    with pytest.raises(ValueError, match=r"split_rngs\(splits=5\) but the mapped axis has size 3"):
        run(body, jnp.zeros((3, 2)), rngs={"dropout": jax.random.key(1)})


def test_split_rngs_is_refused_where_nothing_iterates_or_nothing_lifts():
    with pytest.raises(TypeError, match=r"lm.checkpoint runs its function once"):
        lm.checkpoint(lm.split_rngs(splits=2)(noise))
    with pytest.raises(TypeError, match=r"noise was decorated with split_rngs.*called directly"):
        lm.split_rngs(splits=2)(noise)(jnp.zeros(2))
    with pytest.raises(TypeError, match=r"give the split once"):
        lm.vmap(lm.split_rngs(splits=2)(noise), split_rngs=True)


class Tally(lm.Module):
    def __init__(self):
        self.n = lm.State("counters", (), lm.initializers.zeros(), jnp.float32, mutable=True)


def bump(v, x=None):
    v.value = v + 1
    return x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda v, xs: lm.vmap(lambda v, x: (bump(v), x)[1], in_axes=(None, 0))(v, xs), 1.0),
        (lambda v, xs: lm.scan(lambda v, x: (bump(v, v), x), in_axes=(lm.Carry, 0))(v, xs), 3.0),
        (lambda v, xs: lm.cond(True, lambda v: bump(v, v + 0), lambda v: v + 0, v), 1.0),
        (lambda v, xs: lm.fori_loop(0, 4, lambda i, v: bump(v, v), v), 4.0),
        (lambda v, xs: lm.checkpoint(lambda v, x: bump(v, x))(v, xs), 1.0),
    ],
    ids=["vmap", "scan", "cond", "fori_loop", "checkpoint"],
)
def test_a_variable_passed_directly_is_written_back(call, expected, jit):
    def body(m, xs):
        call(m.t.n, xs)
        return m.t.n + 0

    _, new, _ = run(body, jnp.ones((3, 2)), jit=jit, t=Tally())
    assert float(new["counters"]["t"]["n"]) == expected


def test_a_module_given_as_0_and_as_state_axes_of_0_is_one_spec():
    def body(m, x):
        fn = lm.vmap(lambda a, b, x: a(x) + b(x), in_axes=(0, lm.StateAxes({...: 0}), None))
        return fn(m.s.block, m.s.block, x)

    x = jnp.arange(4.0)
    out, _, v = run(body, x, s=lm.Stack(lm.Dense(4, 4), 3))
    params = v["params"]["s"]["block"]
    assert_close(out, np.stack([2 * affine(x, params, i) for i in range(3)]))


def test_a_variable_given_as_an_axis_spec_is_refused():
    def body(m, x):
        return lm.vmap(lambda d, x: d(x), in_axes=(m.t.n, None))(m.d, x)

    with pytest.raises(TypeError, match=r"in_axes holds State, which is not an axis spec"):
        run(body, jnp.ones(3), t=Tally(), d=lm.Dense(3, 2))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scan_over_another_axis_moves_inputs_outputs_and_state(jit):
    class Sums(lm.Module):
        def __init__(self):
            self.seen = lm.State("stats", (3, 5), lm.initializers.zeros(), mutable=True)

    def body(m, xs):
        def step(c, s, x):
            s.value = s + x
            return c + x.sum(), x * 2

        scan = lm.scan(step, in_axes=(lm.Carry, 1, 1), out_axes=(lm.Carry, 1))
        return scan(jnp.zeros(()), m.s.seen, xs)

    xs = jnp.arange(15.0).reshape(3, 5)
    (total, ys), new, _ = run(body, xs, jit=jit, s=Sums())
    assert float(total) == float(xs.sum())
    assert_close(ys, xs * 2)
    assert_close(new["stats"]["s"]["seen"], xs)


# --- per-member shapes, wrapped callables, sizes ---------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["vmap", "scan"])
def test_mapping_a_plain_module_is_an_error_naming_the_shapes(kind, jit):
    def body(m, x):
        if kind == "vmap":
            return lm.vmap(lambda d, x: d(x), in_axes=(0, 0))(m.d, x)
        return lm.scan(lambda d, c, x: (d(c), x), in_axes=(0, lm.Carry, 0))(m.d, x[0], x)

    match = (
        rf"lm.{kind}: params/d/(kernel|bias) is stored as \(4,( 4)?\), its declared shape; "
        rf"the module at d computes with \(4,( 4)?\), but with axis 0 \(from 0\) each "
        rf"(member|step) would get it as \((4,)?\): it has no axis of copies to map.*"
        rf"pass the variables themselves as arguments with their axes instead of the module "
        rf"\(e\.g\. lm\.{kind}\(f, in_axes=\(None, 0, 0\)\)\(self\.mem\.w, self\.mem\.h, x\)"
    )
    with pytest.raises(ValueError, match=match):
        run(body, jnp.ones((4, 4)), jit=jit, d=lm.Dense(4, 4))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_plain_modules_variables_passed_as_arguments_map_their_axes(jit):
    class Memory(lm.Module):
        def __init__(self):
            super().__init__()
            self.w = lm.Parameter((4,), lm.initializers.normal())
            self.h = lm.Parameter((3, 4), lm.initializers.normal())

    def body(m, x):
        return lm.vmap(lambda w, h, x: w * h * x, in_axes=(None, 0, 0))(m.mem.w, m.mem.h, x)

    x = jnp.arange(12.0).reshape(3, 4)
    y, _, v = run(body, x, jit=jit, mem=Memory())
    assert_close(y, v["params"]["mem"]["w"][None] * v["params"]["mem"]["h"] * x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mapping_a_stack_block_twice_is_an_error(jit):
    def body(m, x):
        inner = lambda b, x: lm.vmap(lambda b, x: b(x), in_axes=(0, 0))(b, x)  # noqa: E731
        return lm.vmap(inner, in_axes=(0, None))(m.s.block, x)

    match = (
        r"lm.vmap: params/s/block/(kernel|bias) is stored as \(4, 4(, 4)?\) \(stacked axes "
        r"\(4,\) in front of its declared shape \(4,( 4)?\)\); the module at s/block computes "
        r"with \(4,( 4)?\), but with axis 0 \(from 0\) each member would get it as \((4,)?\): "
        r"the transform around this one mapped its stacked copies already"
    )
    with pytest.raises(ValueError, match=match):
        run(body, jnp.ones((4, 4)), jit=jit, s=lm.Stack(lm.Dense(4, 4), 4))


def test_a_plain_module_may_be_broadcast_while_a_variable_alone_is_mapped():
    def body(m, x):
        def f(d, shift, x):
            return d(x) + shift

        return lm.vmap(f, in_axes=(None, 0, None))(m.d, m.e.kernel, x)

    x = jnp.arange(4.0)
    out, _, v = run(body, x, d=lm.Dense(4, 4), e=lm.Dense(3, 1))
    params, shift = v["params"]["d"], v["params"]["e"]["kernel"]
    assert shift.shape == (3, 1) and len(set(np.asarray(shift).ravel().tolist())) == 3
    assert_close(out, np.stack([affine(x, params) + shift[i] for i in range(3)]))


class Scaled:
    """A callable object with attributes named as a lifted function's own."""

    def __init__(self, fn, k):
        self.fn, self.k, self.split = fn, k, "not a split"

    def __call__(self, x):
        return self.k * self.fn(x)


@pytest.mark.parametrize(
    "lift",
    [
        lambda f: lm.vmap(f),
        lambda f: lm.vmap(lm.split_rngs(splits=3)(f)),
        lambda f: lm.split_rngs(splits=3)(lm.vmap(f)),
        lambda f: lm.checkpoint(f),
    ],
    ids=["vmap", "inner-split", "outer-split", "checkpoint"],
)
def test_a_lifted_callable_object_keeps_its_own_attributes(lift):
    def body(m, x):
        return lift(Scaled(jnp.sin, 10.0))(x)

    x = jnp.arange(3.0)
    out, _, _ = run(body, x)
    assert_close(out, 10.0 * jnp.sin(x))


def test_two_split_decorators_on_one_function_are_refused():
    with pytest.raises(TypeError, match=r"noise is already decorated with split_rngs\(splits=3"):
        lm.split_rngs(splits=4, only="dropout")(lm.split_rngs(splits=3)(noise))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_split_decorated_method_binds_like_a_method(jit):
    class Noisy(lm.Module):
        def __init__(self):
            self.scale = lm.State("consts", (), lm.initializers.constant(2.0))

        @lm.split_rngs(splits=3)
        def member(self, x):
            return self.scale * noise(x)

        def __call__(self, x):
            return lm.vmap(self.member)(x)

    init, apply = lm.transform(Noisy())
    fn = jax.jit(apply) if jit else apply
    out, _ = fn(init(jax.random.key(0)), {"dropout": jax.random.key(1)}, jnp.zeros((3, 2)))
    assert len({tuple(np.asarray(r).tolist()) for r in out}) == 3
    with pytest.raises(TypeError, match=r"member was decorated with split_rngs.*called directly"):
        apply_direct = lm.transform(Noisy(), to_callable=lambda m: m.member)[1]
        apply_direct(init(jax.random.key(0)), {"dropout": jax.random.key(1)}, jnp.zeros(2))


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda m, x: lm.vmap(lambda b, y: b(y), in_axes=(0, 0))(m.s.block, jnp.ones((5, 4))),
            r"lm.vmap: the inputs it maps disagree .*axis 0 of the argument args\[1\] \(shape "
            r"\(5, 4\)\) has size 5; axis 0 of params/s/block/bias \(shape \(3, 4\)\) has size 3",
        ),
        (
            lambda m, x: lm.vmap(lambda b: b(x), axis_size=2)(m.s.block),
            r"lm.vmap: .*disagree .*axis_size=2; axis 0 of params/s/block/bias .* has size 3",
        ),
        (
            lambda m, x: lm.vmap(lambda d: d["a"] + d["b"], in_axes=({"a": 0, "b": 1},))(
                {"a": jnp.ones((3, 2)), "b": jnp.ones((2, 5))}
            ),
            r"axis 0 of the argument args\[0\]\['a'\] .* size 3; axis 1 of the argument "
            r"args\[0\]\['b'\] \(shape \(2, 5\)\) has size 5",
        ),
        (
            lambda m, x: lm.scan(
                lambda b, c: b(c), in_axes=(0, lm.Carry), out_axes=lm.Carry, length=2
            )(m.s.block, x),
            r"lm.scan: the inputs it scans disagree .*length=2; axis 0 of params/s/block/bias",
        ),
        (
            lambda m, x: lm.scan(lambda b, c, y: (b(c), y), in_axes=(0, lm.Carry, 0))(
                m.s.block, x, jnp.ones(5)
            ),
            r"lm.scan: .*axis 0 of the argument args\[2\] \(shape \(5,\)\) has size 5; axis 0 "
            r"of params/s/block/bias",
        ),
        (
            lambda m, x: lm.scan(lambda s, c, y: (s(c), y), in_axes=(None, lm.Carry, 3))(
                m.s, x, jnp.ones((3, 3, 3))
            ),
            r"lm.scan: in_axes gives axis 3 for the argument args\[2\], of shape \(3, 3, 3\), "
            r"which has no axis 3",
        ),
    ],
    ids=["vmap-array", "vmap-axis-size", "vmap-arrays", "scan-length", "scan-array", "scan-axis"],
)
def test_mapped_sizes_and_axes_are_checked_naming_the_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        run(call, jnp.ones(4), s=lm.Stack(lm.Dense(4, 4), 3))


def test_a_bad_write_inside_vmap_states_the_per_member_shape():
    def body(m, x):
        def f(v, x):
            v.value = jnp.ones(3)
            return x

        return lm.vmap(f, in_axes=(0, 0))(m.c.seen, x)

    class Seen(lm.Module):
        def __init__(self):
            self.seen = lm.State("stats", (3,), lm.initializers.zeros(), mutable=True)

    match = (
        r"cannot write a value of shape \(3,\) to State at stats/c/seen, of shape \(\) in "
        r"each member of lm.vmap \(declared \(3,\)\)"
    )
    with pytest.raises(ValueError, match=match):
        run(body, jnp.ones(3), c=Seen())
