"""The filter DSL (Flax NNX's, on lamina's declarations) and its conversions."""

import numpy as np
import pytest

import lamina as lm


class SpecialParam(lm.Parameter):
    pass


def zeros():
    return lm.initializers.zeros()


P = lm.Parameter((1,), zeros())
S = SpecialParam((1,), zeros())
B = lm.BatchStat((1,), zeros())
T = lm.State("cache", (1,), zeros(), mutable=True, tags=("decode", "kv"))


def test_literals_convert_in_order():
    assert lm.to_predicate("params") == lm.WithTag("params")
    assert lm.to_predicate(lm.Parameter) == lm.OfType(lm.Parameter)
    assert lm.to_predicate(True) == lm.Everything() == lm.to_predicate(...)
    assert lm.to_predicate(False) == lm.Nothing() == lm.to_predicate(None)
    assert lm.to_predicate((lm.Parameter, "batch_stats")) == lm.Any(
        lm.OfType(lm.Parameter), lm.WithTag("batch_stats")
    )
    assert lm.to_predicate([lm.Parameter, ["cache"]]) == lm.Any(
        lm.OfType(lm.Parameter), lm.Any(lm.WithTag("cache"))
    )

    def custom(path, variable):
        return True

    assert lm.to_predicate(custom) is custom


@pytest.mark.parametrize("bad", [3, 2.5, b"params", object()])
def test_bad_filter_is_shown(bad):
    with pytest.raises(TypeError, match=rf"{type(bad).__name__}\) is not a filter"):
        lm.to_predicate(bad)
    with pytest.raises(TypeError, match="is not a filter"):
        lm.Any(lm.Parameter, bad)


def test_with_tag_matches_collection_or_tags():
    assert lm.WithTag("params")((), P) and lm.WithTag("params")((), S)
    assert not lm.WithTag("params")((), B)
    assert lm.WithTag("kv")((), T) and lm.WithTag("cache")((), T)
    assert not lm.WithTag("decode")((), P)


def test_of_type_matches_subclasses():
    assert lm.OfType(lm.Parameter)((), S) and lm.OfType(lm.State)((), B)
    assert not lm.OfType(SpecialParam)((), P)


def test_path_contains():
    path = ("encoder", "layers", 0, "kernel")
    assert lm.PathContains("layers")(path, P) and lm.PathContains(0)(path, P)
    assert not lm.PathContains("enc")(path, P) and not lm.PathContains(1)(path, P)
    assert lm.PathContains("enc", exact=False)(path, P)
    assert lm.PathContains("0", exact=False)(path, P)


@pytest.mark.parametrize("key", [0, "0"])
def test_path_contains_compares_keys_as_shown(key):
    """Paths are shown as text (params/layers/0/kernel): 0 and "0" are the same key."""
    assert lm.PathContains(key)(("layers", 0, "kernel"), P)  # a list item
    assert lm.PathContains(key)(("table", "0", "kernel"), P)  # a dict key, written with str()
    assert lm.PathContains(key) == lm.PathContains(str(key)) == lm.PathContains(np.int64(0))
    assert len({lm.PathContains(0), lm.PathContains("0")}) == 1


def test_path_contains_with_slashes_matches_consecutive_keys():
    path = ("encoder", "layers", 0, "kernel")
    assert lm.PathContains("layers/0")(path, P) and lm.PathContains("layers/0/kernel")(path, P)
    assert not lm.PathContains("encoder/0")(path, P)
    assert lm.PathContains("rs/0/ke", exact=False)(path, P)
    assert lm.PathContains("/layers/")(path, P)  # outer slashes are dropped


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        (True, TypeError, r"a str or int\), got True \(bool\)"),
        (None, TypeError, r"got None \(NoneType\)"),
        (1.0, TypeError, r"got 1.0 \(float\)"),
        ("", ValueError, "would match nothing"),
        ("/", ValueError, "would match nothing"),
    ],
)
def test_path_contains_rejects_keys_that_are_not_keys(key, error, match):
    with pytest.raises(error, match=match):
        lm.PathContains(key)


def test_with_tag_and_of_type_check_their_argument():
    with pytest.raises(TypeError, match=r"WithTag takes a non-empty string .*got 3"):
        lm.WithTag(3)
    with pytest.raises(TypeError, match=r"WithTag takes a non-empty string .*got ''"):
        lm.to_predicate("")
    with pytest.raises(TypeError, match=r"OfType takes a class .*got 'Parameter' \(str\)"):
        lm.OfType("Parameter")


def test_one_argument_lambda_says_how_filters_are_called():
    with pytest.raises(
        TypeError,
        match=r"filter function <lambda> .* takes \(v\); "
        r"a filter is called as filter\(path, variable\)",
    ):
        lm.to_predicate(lambda v: True)

    class Callable:
        def __call__(self, path, variable, extra):
            return True

    with pytest.raises(TypeError, match=r"takes \(path, variable, extra\)"):
        lm.to_predicate(Callable())
    with pytest.raises(TypeError, match=r"lm.Not\(...\), item 0: the filter function <lambda>"):
        lm.Not(lambda: True)
    fine = lambda *args: True  # noqa: E731
    assert lm.to_predicate(fine) is fine
    assert lm.to_predicate(lambda path, variable, extra=1: True)((), P)


def test_objects_are_not_filters():
    with pytest.raises(TypeError, match=r"a Dense object is not a filter.*lm.Dense, or Dense\)"):
        lm.to_predicate(lm.Dense(2, 3))
    with pytest.raises(TypeError, match="a Parameter object is not a filter"):
        lm.to_predicate(P)


def test_errors_inside_tuples_say_where():
    with pytest.raises(TypeError, match=r"lm.Any\(...\), item 1: 3 \(int\) is not a filter"):
        lm.to_predicate(("params", 3))
    with pytest.raises(
        TypeError, match=r"lm.All\(...\), item 1: lm.Any\(...\), item 1: b'x' \(bytes\)"
    ):
        lm.All("params", [lm.Parameter, b"x"])


def test_module_class_filter_needs_the_model():
    with pytest.raises(
        TypeError,
        match=r"OfType\(Dense\) matches the variables of Dense modules, so it needs the model",
    ):
        lm.to_predicate(lm.Dense)(("kernel",), P)
    with pytest.raises(TypeError, match="needs the model"):
        lm.Not(lm.Dense)(("kernel",), P)


def test_resolving_against_a_plan_keeps_value_equality():
    from lamina._core.graph import Plan

    model = lm.Sequential(lm.Dense(2, 3), lm.LayerNorm(3))
    plan = Plan(model)
    resolved = lm.to_predicate((lm.Dense, lm.Not(lm.LayerNorm)), plan)
    assert resolved == lm.to_predicate((lm.Dense, lm.Not(lm.LayerNorm)), plan)
    assert hash(resolved) == hash(lm.to_predicate((lm.Dense, lm.Not(lm.LayerNorm)), plan))
    assert repr(resolved) == "Any(OfType(Dense), Not(OfType(LayerNorm)))"
    kernel = next(e for e in plan.variables if e.name == "params/layers_0/kernel")
    scale = next(e for e in plan.variables if e.name == "params/layers_1/scale")
    dense = lm.to_predicate(lm.Dense, plan)
    assert dense(kernel.path, kernel.state) and not dense(scale.path, scale.state)
    assert lm.to_predicate(lm.Parameter, plan)(scale.path, scale.state)  # State kinds as before


def test_combinators_and_empty_cases():
    both = lm.All(lm.Parameter, lm.Not(SpecialParam))
    assert both((), P) and not both((), S) and not both((), B)
    assert lm.All()((), B) and not lm.Any()((), B)
    assert lm.Everything()((), T) and not lm.Nothing()((), T)
    assert lm.Not(...)((), P) is False


def test_filters_compare_and_hash_by_value():
    table = {lm.All(lm.Parameter, "kv"): 1, lm.PathContains("a", exact=False): 2}
    assert table[lm.All(lm.Parameter, "kv")] == 1
    assert table[lm.PathContains("a", exact=False)] == 2
    assert lm.Not("x") == lm.Not("x") and lm.Not("x") != lm.Not("y")
    assert lm.PathContains("a") != lm.PathContains("a", exact=False)


def test_reprs():
    assert repr(lm.to_predicate((lm.Parameter, "batch_stats"))) == (
        "Any(OfType(Parameter), WithTag('batch_stats'))"
    )
    assert repr(lm.Not(lm.PathContains("head", exact=False))) == (
        "Not(PathContains('head', exact=False))"
    )
    assert repr(lm.All()) == "All()" and repr(lm.to_predicate(...)) == "Everything()"
