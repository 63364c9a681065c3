"""The filter DSL (Flax NNX's, on lamina's declarations) and its conversions."""

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
    assert not lm.PathContains("enc")(path, P) and not lm.PathContains("0")(path, P)
    assert lm.PathContains("enc", exact=False)(path, P)
    assert lm.PathContains("0", exact=False)(path, P)


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
