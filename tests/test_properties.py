"""Property tests over random module trees: lists, dicts, nesting, shared objects."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lamina as lm

pytestmark = pytest.mark.fast_compile  # tests/conftest.py

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
leaves = st.one_of(
    st.tuples(st.just("param"), shapes),
    st.tuples(st.just("state"), st.sampled_from(["stats", "counters"]), shapes),
    st.tuples(st.just("share"), st.integers(0, 50)),
)


def containers(children):
    names = st.sampled_from(["a", "b", "layer", "x1", "_private"])
    return st.one_of(
        st.tuples(st.just("list"), st.lists(children, max_size=3)),
        st.tuples(st.just("dict"), st.dictionaries(names, children, max_size=3)),
        st.tuples(st.just("module"), st.dictionaries(names, children, max_size=3)),
    )


specs = st.tuples(
    st.just("module"),
    st.dictionaries(
        st.sampled_from(["p", "q", "sub"]),
        st.recursive(leaves, containers, max_leaves=8),
        min_size=1,
        max_size=3,
    ),
)


class Node(lm.Module):
    """Sums its variables (and its children's) into the input; bumps mutable states."""

    def __call__(self, x):
        return x + self.total(list(vars(self).values()))

    def total(self, items):
        result = jnp.zeros(())
        for item in items:
            if isinstance(item, lm.Module):
                result = result + item(jnp.zeros(()))
            elif isinstance(item, lm.State):
                result = result + jnp.sum(item.value)
                if item.mutable:
                    item.value = item.value + 1.0
            elif isinstance(item, (list, tuple)):
                result = result + self.total(item)
            elif isinstance(item, dict):
                result = result + self.total(list(item.values()))
        return result


def build(spec, made):
    kind = spec[0]
    if kind == "param":
        node = lm.Parameter(spec[1], lm.initializers.normal(1.0))
    elif kind == "state":
        node = lm.State(spec[1], spec[2], lm.initializers.normal(1.0), mutable=True)
    elif kind == "share":
        return made[spec[1] % len(made)] if made else lm.Parameter((1,), lm.initializers.ones())
    elif kind == "list":
        return [build(child, made) for child in spec[1]]
    elif kind == "dict":
        return {key: build(child, made) for key, child in spec[1].items()}
    else:
        node = Node()
        for key, child in spec[1].items():
            setattr(node, key, build(child, made))
    made.append(node)
    return node


def declarations(node, seen):
    """The distinct State objects reachable from node (an oracle independent of lamina)."""
    if id(node) in seen:
        return
    if isinstance(node, lm.State):
        seen[id(node)] = node
    elif isinstance(node, lm.Module):
        seen[id(node)] = node
        for child in vars(node).values():
            declarations(child, seen)
    elif isinstance(node, (list, tuple)):
        for child in node:
            declarations(child, seen)
    elif isinstance(node, dict):
        for child in node.values():
            declarations(child, seen)


def unique_states(model):
    seen = {}
    declarations(model, seen)
    return [s for s in seen.values() if isinstance(s, lm.State)]


@given(specs)
def test_round_trip_and_tied_variables_once(spec):
    model = build(spec, [])
    init, apply = lm.transform(model)
    variables = init(jax.random.key(0))
    states = unique_states(model)
    leaves = jax.tree.leaves(variables)
    assert len(leaves) == len(states)
    assert sorted(leaf.shape for leaf in leaves) == sorted(s.shape for s in states)
    out, new = apply(variables, None, jnp.zeros(()))
    assert jax.tree.structure(new) == jax.tree.structure(variables)
    out2, _ = apply(new, None, jnp.zeros(()))  # the new variables are valid input
    assert out2.shape == out.shape


@given(specs)
def test_apply_is_pure_and_model_untouched(spec):
    model = build(spec, [])
    before = repr(model)
    init, apply = lm.transform(model)
    variables = init(jax.random.key(1))
    a = apply(variables, None, jnp.ones(()))
    b = apply(variables, None, jnp.ones(()))
    np.testing.assert_array_equal(a[0], b[0])
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert repr(model) == before
    assert all(s._lamina_plan is None for s in unique_states(model))


@given(specs)
def test_jit_equals_eager(spec):
    init, apply = lm.transform(build(spec, []))
    key = jax.random.key(2)
    variables = init(key)
    for x, y in zip(jax.tree.leaves(jax.jit(init)(key)), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(x, y)
    eager = apply(variables, None, jnp.ones(()))
    jitted = jax.jit(apply)(variables, None, jnp.ones(()))
    np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(jitted[1]), jax.tree.leaves(eager[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@given(specs)
def test_assign_variables_round_trip(spec):
    model = build(spec, [])
    variables = lm.transform(model).init(jax.random.key(3))
    copied = lm.assign_variables(model, variables)
    again = lm.transform(copied).init(jax.random.key(4))  # another key: values are assigned
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(x, y)
