"""split, merge, filter_variables and mask: the NNX guide's cases, on lamina models."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import lamina as lm
from tests.test_properties import build, specs

pytestmark = pytest.mark.fast_compile  # tests/conftest.py


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
    special, params = lm.split(bar, variables, SpecialParam, lm.Parameter)  # right order
    assert paths(special) == ["params/b"] and paths(params) == ["params/a"]


def test_a_filter_whose_variables_earlier_filters_took_is_an_error():
    """The NNX guide's trap (Param before SpecialParam gives SpecialParam nothing), caught."""
    bar = Bar()
    with pytest.raises(
        ValueError,
        match=r"position 1 \(SpecialParam\) gets no variable: all it matches \(params/b\) is "
        r"taken by the filter\(s\) before it \(position 0: Parameter\).*"
        r"lm.split\(model, variables, SpecialParam, Parameter\)",
    ):
        lm.split(bar, variables_of(bar), lm.Parameter, SpecialParam)


def test_one_filter_gives_a_tree_not_a_tuple():
    variables = variables_of(Bar())
    assert lm.split(Bar(), variables, ...) == variables


def test_unmatched_variables_are_an_error_naming_them():
    net = Net()
    with pytest.raises(
        ValueError,
        match=r"no filter matches 2 variable\(s\): batch_stats/norm/mean \(BatchStat\), "
        r"batch_stats/norm/var \(BatchStat\).*"
        r"end the filters with \.\.\..*lm.split\(model, variables, Parameter, \.\.\.\)",
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
    with pytest.raises(
        TypeError, match=r"split: the filter at position 0: 3 \(int\) is not a filter"
    ):
        lm.split(net, variables_of(net), 3, ...)
    with pytest.raises(TypeError, match=r"mask: the filter function <lambda> .* takes \(v\)"):
        lm.mask(net, variables_of(net), lambda v: True)
    with pytest.raises(
        TypeError, match=r"position 1: lm.Any\(...\), item 1: None \(NoneType\)|position 1: lm.Any"
    ):
        lm.split(net, variables_of(net), "params", ("batch_stats", object()), ...)


def test_a_repeated_filter():
    net = Net()
    with pytest.raises(ValueError, match=r"position 1 \(Parameter\) repeats the one at position 0"):
        lm.split(net, variables_of(net), lm.Parameter, lm.Parameter, ...)


def test_model_and_variables_swapped():
    net = Net()
    with pytest.raises(TypeError, match=r"takes the model first and its variables second"):
        lm.filter_variables(variables_of(net), net, ...)


def test_errors_raised_by_a_filter_name_the_variable():
    net = Net()

    def by_kernel_shape(path, variable):
        return variable.shape[1] == 4  # biases have one dimension

    with pytest.raises(IndexError) as info:
        lm.mask(net, variables_of(net), by_kernel_shape)
    assert "raised by the filter by_kernel_shape" in info.value.__notes__[0]
    assert "on the variable batch_stats/norm/mean" in info.value.__notes__[0]


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
    np.testing.assert_allclose(head_norm(variables), expected, rtol=1e-5, atol=1e-6)


@given(specs)
def test_split_merge_round_trip_on_random_trees(spec):
    model = build(spec, [])
    variables = lm.transform(model).init(jax.random.key(0))
    parts = lm.split(model, variables, "counters", lm.Parameter, "stats")
    assert lm.merge(*parts) == variables
    leaves = sum(len(jax.tree.leaves(part)) for part in parts)
    assert leaves == len(jax.tree.leaves(variables))
    if parts[1]:
        flags = jax.tree.leaves(lm.mask(model, variables, lm.Parameter))
        assert sum(flags) == len(jax.tree.leaves(parts[1]))
    elif variables:
        with pytest.raises(ValueError, match="the filter Parameter selects no variable"):
            lm.mask(model, variables, lm.Parameter)


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


# ---- filters that select nothing ------------------------------------------------------------


def test_a_string_close_to_a_collection_suggests_it():
    """ "param" for "params" selects nothing: the error suggests the collection's name."""
    net = Net()
    variables = variables_of(net)
    message = (
        r"the filter 'param' selects no variable of Net\.\n"
        r"  Net holds collections batch_stats \(2\), params \(10\); no tags; variable types "
        r"Parameter, BatchStat; module types Net, Dense, BatchNorm\.\n"
        r"  Did you mean 'params'\?"
    )
    with pytest.raises(ValueError, match="mask: " + message):
        lm.mask(net, variables, "param")
    with pytest.raises(ValueError, match="filter_variables: " + message):
        lm.filter_variables(net, variables, "param")
    with pytest.raises(ValueError, match=r"split: the filter 'param' \(position 0\) selects no"):
        lm.split(net, variables, "param", ...)


def test_a_typo_is_an_error_even_beside_filters_that_match():
    net = Net()
    with pytest.raises(
        ValueError, match=r"(?s)'batch_stat' \(position 1\).*Did you mean 'batch_stats'"
    ):
        lm.split(net, variables_of(net), lm.PathContains("head"), "batch_stat", ...)
    with pytest.raises(ValueError, match=r"Did you mean lm.PathContains\('blocks'\)\?"):
        lm.split(net, variables_of(net), "batch_stats", lm.PathContains("block"), ...)


def test_a_collection_the_model_lacks_is_allowed_beside_filters_that_match():
    """Generic code may ask every model for its batch stats; a model without them gets {}."""
    model = lm.Sequential(lm.Dense(2, 3), lm.Dense(3, 1))
    params, stats, rest = lm.split(model, variables_of(model), lm.Parameter, "batch_stats", ...)
    assert stats == {} and rest == {} and len(paths(params)) == 4


def test_every_filter_but_the_rest_selecting_nothing_is_an_error():
    net = Net()
    with pytest.raises(
        ValueError,
        match=r"(?s)split: none of the filters 'cache' \(position 0\), 'intermediates' "
        r"\(position 1\) selects any variable of Net\..*Choose a filter that selects something",
    ):
        lm.split(net, variables_of(net), "cache", "intermediates", ...)


def test_names_that_are_paths_or_collections_in_the_wrong_place():
    net = Net()
    variables = variables_of(net)
    with pytest.raises(
        ValueError,
        match=r"Did you mean lm.PathContains\('head'\) \(a string filter is a collection or tag\)",
    ):
        lm.filter_variables(net, variables, "head")
    with pytest.raises(
        ValueError,
        match=r"Did you mean 'params' \(paths in filters start below the collection; "
        r"lm.PathContains\('head'\) for the path\)",
    ):
        lm.mask(net, variables, lm.PathContains("params/head"))


def test_a_filter_that_selects_only_variables_not_given_says_so():
    net = Net()
    params = {"params": variables_of(net)["params"]}
    with pytest.raises(
        ValueError,
        match=r"mask: the filter 'batch_stats' selects none of the variables given \(collections "
        r"given: params\)\.\n  In Net it selects batch_stats/norm/mean, batch_stats/norm/var, "
        r"which the variables passed do not hold",
    ):
        lm.mask(net, params, "batch_stats")


def test_not_everything_and_explicit_nothing():
    net = Net()
    variables = variables_of(net)
    with pytest.raises(ValueError, match=r"the filter Not\(Everything\(\)\) selects no variable"):
        lm.mask(net, variables, lm.Not(...))
    assert not any(jax.tree.leaves(lm.mask(net, variables, None)))  # asked for: no error
    assert all(jax.tree.leaves(lm.mask(net, variables, ...)))
    nothing, rest = lm.split(net, variables, False, ...)
    assert nothing == {} and rest == variables


class Empty(lm.Module):
    def __call__(self, x):
        return x


def test_a_model_without_variables():
    """Nothing given, nothing to select: no filter is shown wrong, so no error."""
    empty = Empty()
    assert lm.split(empty, {}, ...) == {} and lm.filter_variables(empty, {}, lm.Parameter) == {}
    assert lm.mask(empty, {}, "params") == {}
    assert lm.split(empty, {}, "params", "batch_stats") == ({}, {})


# ---- module classes as filters ----------------------------------------------------------------


def test_a_module_class_selects_the_variables_of_its_modules():
    net = Net()
    variables = variables_of(net)
    dense = lm.filter_variables(net, variables, lm.Dense)
    assert sorted(dense) == ["params"]
    assert sorted(dense["params"]) == ["blocks", "encoder", "head"]
    norm = lm.filter_variables(net, variables, lm.BatchNorm)
    assert paths(norm) == [
        "batch_stats/norm/mean",
        "batch_stats/norm/var",
        "params/norm/bias",
        "params/norm/scale",
    ]
    kernels = lm.filter_variables(net, variables, lm.All(lm.Dense, lm.PathContains("kernel")))
    assert len(paths(kernels)) == 4 and all(p.endswith("kernel") for p in paths(kernels))
    not_norm = lm.mask(net, variables, lm.Not(lm.BatchNorm))
    assert not_norm["params"]["head"]["bias"] and not not_norm["batch_stats"]["norm"]["mean"]
    assert lm.filter_variables(net, variables, lm.Module) == variables  # every module's


class Shared(lm.Module):
    """A Dense whose kernel is tied to a parameter declared first, outside it."""

    def __init__(self):
        self.embedding = lm.Parameter((2, 2), lm.initializers.ones())
        self.out = lm.Dense(2, 2)
        self.out.kernel = self.embedding

    def __call__(self, x):
        return self.out(x @ self.embedding)


def test_a_module_class_selects_tied_variables_by_reachability():
    model = Shared()
    variables = variables_of(model)
    assert paths(variables) == ["params/embedding", "params/out/bias"]
    assert paths(lm.filter_variables(model, variables, lm.Dense)) == paths(variables)
    assert paths(lm.filter_variables(model, variables, lm.PathContains("out"))) == [
        "params/out/bias"
    ]


def test_module_classes_in_split_follow_first_match():
    net = Net()
    variables = variables_of(net)
    stats, dense, rest = lm.split(net, variables, lm.BatchStat, lm.Dense, ...)
    assert sorted(stats) == ["batch_stats"] and sorted(dense["params"]) == [
        "blocks",
        "encoder",
        "head",
    ]
    assert paths(rest) == ["params/norm/bias", "params/norm/scale"]
    with pytest.raises(ValueError, match=r"the filter LayerNorm selects no variable of Net.*"):
        lm.filter_variables(net, variables, lm.LayerNorm)
