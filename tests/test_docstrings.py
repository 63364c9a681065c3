"""Runs every `>>>` example in lamina's own docstrings."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import lamina

# Compiled with XLA's backend optimisations off (tests/conftest.py): the examples compile
# many small programs; every example passes in both modes (checked when this was set).
pytestmark = pytest.mark.fast_compile

MODULES = sorted(info.name for info in pkgutil.walk_packages(lamina.__path__, prefix="lamina."))


@pytest.mark.parametrize("name", ["lamina", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={}):
        if test.name.split(".")[0] != "lamina":
            continue
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {name}"


# Every public name has a `>>>` example (which the test above runs). The names below lack one
# for now, each with its reason; the list may only shrink: a name that gains an example must
# leave it (`test_the_exceptions_are_current`).
PUBLIC_MODULES = [
    "lamina",
    "lamina.nn",
    "lamina.initializers",
    "lamina.data",
    "lamina.io",
    "lamina.interop",
    "lamina.utils",
]
# Public names allowed to lack a `>>>` example, each with the reason (none today; the set
# must shrink, never grow silently: test_the_exceptions_are_current).
EXCEPTIONS: dict[str, str] = {}


def public_objects() -> dict[str, object]:
    """Every public class and function lamina defines, by its first public name.

    Names re-exported from elsewhere (`jax.nn`'s activations, `typing` helpers) are their
    owners' to document, and are left out; so are constants and submodules.
    """
    found: dict[int, tuple[str, object]] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module) if n[0] != "_"]
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                continue
            if not str(getattr(obj, "__module__", "")).startswith("lamina"):
                continue
            found.setdefault(id(obj), (f"{module_name}.{name}", obj))
    return dict(found.values())


def has_example(obj: object) -> bool:
    return ">>>" in (inspect.getdoc(obj) or "")


def test_every_public_name_has_an_example():
    objects = public_objects()
    assert len(objects) > 100  # a guard against a walk that finds nothing
    missing = sorted(
        n for n, obj in objects.items() if not has_example(obj) and n not in EXCEPTIONS
    )
    assert not missing, f"public names without a `>>>` example in their docstring: {missing}"


def test_the_exceptions_are_current():
    objects = public_objects()
    unknown = sorted(set(EXCEPTIONS) - set(objects))
    assert not unknown, f"EXCEPTIONS names that are not public lamina names: {unknown}"
    done = sorted(n for n in EXCEPTIONS if has_example(objects[n]))
    assert not done, f"these now have an example: remove them from EXCEPTIONS: {done}"


def test_a_missing_example_is_found():
    def documented():
        """Says what it does.

        Example:
            >>> 1
            1
        """

    def undocumented():
        """Says what it does, without an example."""

    assert has_example(documented) and not has_example(undocumented)
