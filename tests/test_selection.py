"""split, merge, filter_variables and mask: the NNX guide's cases, on lamina models."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import lamina as lm
from tests.test_properties import build, specs


class SpecialParam(lm.Parameter):
    pass


class Bar(lm.Module):
    """The guide's example: a Param and a SpecialParam (a subclass)."""

    def __init__(self):
        self.a = lm.Parameter((2,), lm.initializers.ones())
        self.b = SpecialParam((3,), lm.initializers.ones())


class Net(lm.Module):
    def __init__(self):
        super().__init__()
        self.encoder = lm.Dense(3, 4)
        self.norm = lm.BatchNorm(4)
        self.blocks = [lm.Dense(4, 4), lm.Dense(4, 4)]
        self.head = lm.Dense(4, 2)
        self.tied = self.head  # shared: seen once, at its first path

    def __call__(self, x, is_training=False):
        x = self.norm(self.encoder(x), is_training)
        for block in self.blocks:
            x = lm.relu(block(x))
        return self.tied(x)


def variables_of(model, seed=0):
    return lm.transform(model).init(jax.random.key(seed))


def paths(tree):
    return sorted(
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def test_order_matters_special_before_param():
    bar = Bar()
    variables = variables_of(bar)
    params, special = lm.split(bar, variables, lm.Parameter, SpecialParam)  # wrong order
    assert paths(params) == ["params/a", "params/b"] and special == {}
    special, params = lm.split(bar, variables, SpecialParam, lm.Parameter)  # right order
    assert paths(special) == ["params/b"] and paths(params) == ["params/a"]


def test_one_filter_gives_a_tree_not_a_tuple():
    variables = variables_of(Bar())
    assert lm.split(Bar(), variables, ...) == variables


def test_unmatched_variable_is_an_error_naming_it():
    net = Net()
    with pytest.raises(
        ValueError,
        match=r"no filter matches batch_stats/norm/mean "
        r"\(BatchStat\).*end the filters with \.\.\.",
    ):
        lm.split(net, variables_of(net), lm.Parameter)


@pytest.mark.parametrize("rest", [..., True])
def test_ellipsis_only_last(rest):
    net = Net()
    with pytest.raises(ValueError, match=r"position 0 .* may only stand last"):
        lm.split(net, variables_of(net), rest, lm.Parameter)


def test_no_filters_and_bad_filters():
    net = Net()
    with pytest.raises(ValueError, match="at least one filter"):
        lm.split(net, variables_of(net))
    with pytest.raises(TypeError, match="is not a filter"):
        lm.split(net, variables_of(net), 3, ...)


def test_groups_keep_the_variables_layout():
    net = Net()
    variables = variables_of(net)
    blocks, stats, rest = lm.split(net, variables, lm.PathContains("blocks"), "batch_stats", ...)
    assert paths(blocks) == [
        "params/blocks/0/bias",
        "params/blocks/0/kernel",
        "params/blocks/1/bias",
        "params/blocks/1/kernel",
    ]
    assert paths(stats) == ["batch_stats/norm/mean", "batch_stats/norm/var"]
    assert "params/head/kernel" in paths(rest) and not any("tied" in p for p in paths(rest))
    assert lm.merge(blocks, stats, rest) == variables


def test_filters_see_int_list_indices():
    net = Net()
    first = lm.filter_variables(net, variables_of(net), lambda path, v: 0 in path)
    assert paths(first) == ["params/blocks/0/bias", "params/blocks/0/kernel"]


def test_filter_variables_drops_the_rest_and_handles_several():
    net = Net()
    variables = variables_of(net)
    kernels, biases = lm.filter_variables(
        net, variables, lm.PathContains("kernel"), lm.PathContains("bias")
    )
    assert all(p.endswith("kernel") for p in paths(kernels)) and len(paths(kernels)) == 4
    assert all(p.endswith("bias") for p in paths(biases)) and len(paths(biases)) == 5
    assert lm.filter_variables(net, variables, "nothing-has-this-tag") == {}


def test_subsets_of_variables_are_accepted():
    net = Net()
    params = {"params": variables_of(net)["params"]}
    head, rest = lm.split(net, params, lm.PathContains("head"), ...)
    assert paths(head) == ["params/head/bias", "params/head/kernel"]
    assert "batch_stats" not in rest


def test_foreign_paths_and_shapes_are_errors():
    net = Net()
    variables = variables_of(net)
    extra = {"params": {**variables["params"], "ghost": {"kernel": jnp.ones(2)}}}
    with pytest.raises(lm.VariablesError, match=r"unexpected \(1\): params/ghost/kernel"):
        lm.split(net, extra, ...)
    wrong = jax.tree.map(lambda x: x, variables)
    wrong["params"]["head"]["kernel"] = jnp.ones((5, 2))
    with pytest.raises(lm.VariablesError, match=r"params/head/kernel: expected \(4, 2\)"):
        lm.mask(net, wrong, lm.Parameter)


def test_merge_errors():
    a = {"params": {"x": jnp.ones(1)}}
    with pytest.raises(lm.VariablesError, match="params/x is in more than one tree"):
        lm.merge(a, a)
    with pytest.raises(lm.VariablesError, match="params/x is a leaf in one tree"):
        lm.merge(a, {"params": {"x": {"y": jnp.ones(1)}}})
    with pytest.raises(lm.VariablesError, match="merge takes variables trees"):
        lm.merge(a, [1])


def test_mask_structure_and_values():
    net = Net()
    variables = variables_of(net)
    trainable = lm.mask(net, variables, lm.All(lm.Parameter, lm.Not(lm.PathContains("encoder"))))
    assert jax.tree.structure(trainable) == jax.tree.structure(variables)
    assert trainable["params"]["encoder"]["kernel"] is False
    assert trainable["params"]["head"]["kernel"] is True
    assert trainable["batch_stats"]["norm"]["mean"] is False


def test_works_inside_jit():
    net = Net()
    variables = variables_of(net)

    @jax.jit
    def head_norm(variables):
        head, _ = lm.split(net, variables, lm.PathContains("head"), ...)
        return sum(jnp.sum(x**2) for x in jax.tree.leaves(head))

    expected = sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(variables["params"]["head"]))
    np.testing.assert_allclose(head_norm(variables), expected, rtol=1e-6)


@given(specs)
def test_split_merge_round_trip_on_random_trees(spec):
    model = build(spec, [])
    variables = lm.transform(model).init(jax.random.key(0))
    parts = lm.split(model, variables, "counters", lm.Parameter, ...)
    assert lm.merge(*parts) == variables
    leaves = sum(len(jax.tree.leaves(part)) for part in parts)
    assert leaves == len(jax.tree.leaves(variables))
    flags = jax.tree.leaves(lm.mask(model, variables, lm.Parameter))
    assert sum(flags) == len(jax.tree.leaves(parts[1]))


def test_masks_with_optax_multi_transform():
    net = Net()
    params = {"params": variables_of(net)["params"]}
    labels = jax.tree.map(
        lambda frozen: "frozen" if frozen else "train",
        lm.mask(net, params, lm.PathContains("encoder")),
    )
    optimizer = optax.multi_transform(
        {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels
    )
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(
        new["params"]["encoder"]["kernel"], params["params"]["encoder"]["kernel"]
    )
    assert not np.array_equal(new["params"]["head"]["kernel"], params["params"]["head"]["kernel"])
